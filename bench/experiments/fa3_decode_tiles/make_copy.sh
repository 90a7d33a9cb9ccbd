#!/bin/bash
# make_copy.sh TILE_Q TILE_KV STAGES DEST: a copy of the package (run from the repository root)
# whose fa3 paged kernel units are instantiated at that tile, and whose planner lays out fa3
# work lists of TILE_Q query rows. The copy's templates differ, so its modules have their own
# cache keys: several copies can share one cache.
set -euo pipefail
TQ=$1 TKV=$2 ST=$3 DEST=$4
HERE=bench/experiments/fa3_decode_tiles
mkdir -p "$DEST"
cp -r variantgen templates specs bench pyproject.toml "$DEST"/
for unit in paged_kernel plain_kernel; do
  python3 - "$HERE/$unit.cu.jinja" "$HERE/tile_override.cuh" "$DEST/templates/fa3/$unit.cu.jinja" "$TQ" "$TKV" "$ST" <<'PY'
import sys
src, override, dest, tq, tkv, st = sys.argv[1:]
text = open(src).read().replace('#include "tile_override.cuh"  // one consumer warpgroup: see there\n',
                                open(override).read().split("#pragma once\n", 1)[1])
text = text.replace("@TILE_Q@", tq).replace("@TILE_KV@", tkv).replace("@STAGES@", st)
open(dest, "w").write(text)
PY
done
python3 - "$DEST/variantgen/planning/planner.py" "$TQ" <<'PY'
import sys
path, tq = sys.argv[1:]
text = open(path).read()
line = "    return 192 if head_dim_vo == 64 else 128\n"
assert line in text, "planner.fa3_cta_tile_q changed: update make_copy.sh"
open(path, "w").write(text.replace(line, f"    return 192 if head_dim_vo == 64 else {tq}\n"))
PY
