#!/bin/bash
# run.sh [KIND ...]: on the GPU machine, from the root of a checkout at 68313de (the fa2 variant
# with one struct for every launch; from 59d9ab6 on the exact launches have their own). Each KIND
# (make_copy.py) gets a copy of the package, its fa2 causal module built, and pair.py run in it.
# Results: $OUT (or build/fa2-variant-mask)/pair-<kind>.json.
set -uo pipefail
KINDS=${*:-"base maskfree maskfree_qlen window select noinline"}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=build/fa2-variant-mask
RESULTS=${OUT:-$WORK}
export VARIANTGEN_CACHE_DIR=$PWD/$WORK/cache
rm -rf "$WORK/copies" && mkdir -p "$WORK/copies" "$RESULTS"
for k in $KINDS; do python3 "$HERE/make_copy.py" "$k" "$WORK/copies/$k"; done
for k in $KINDS; do
  ( cd "$WORK/copies/$k" && PYTHONPATH=$PWD:${PYTHONPATH:-} python3 -m variantgen.cli precompile causal --backend fa2 \
      --head-dim 128 --dtype bf16 --arch 9.0a -j 1 --jobs-per-module 5 > "$RESULTS/build-$k.log" 2>&1 ) &
done
wait
export VARIANTGEN_DISABLE_JIT=1
for k in $KINDS; do
  ( cd "$WORK/copies/$k" && PYTHONPATH=$PWD:${PYTHONPATH:-} python3 "$HERE/pair.py" "$k" "$RESULTS/pair-$k.json" )
done
