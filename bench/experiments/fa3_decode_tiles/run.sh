#!/bin/bash
# run.sh [CONFIG ...]: on the GPU machine, from the repository root, with variantgen's
# dependencies importable. CONFIG is TILE_Qx TILE_KVxSTAGES (default: the sweep below); `base`
# (FlashInfer's own dispatch, 128 x 96 x 2) always runs first, as the reference output.
# Results: $OUT (or build/fa3-decode-tiles)/tile-<config>.json.
set -uo pipefail
CONFIGS=${*:-"64x64x2 64x32x2 64x48x2 64x80x2 64x32x4 64x48x3 64x64x3 64x96x2 64x128x2"}
WORK=build/fa3-decode-tiles
RESULTS=${OUT:-$WORK}
export VARIANTGEN_CACHE_DIR=$PWD/$WORK/cache
rm -rf "$WORK/copies" "$WORK/ref" && mkdir -p "$WORK/copies/base" "$WORK/ref" "$RESULTS"
cp -r variantgen templates specs bench pyproject.toml "$WORK/copies/base"/
for c in $CONFIGS; do
  IFS=x read -r tq tkv st <<< "$c"
  bash bench/experiments/fa3_decode_tiles/make_copy.sh "$tq" "$tkv" "$st" "$WORK/copies/$c"
done
# FlashInfer's tensor-core decode module (its JIT), built meanwhile for base's comparison row
( PYTHONPATH=$PWD/bench:${PYTHONPATH:-} python3 -c "
import torch, flashinfer, bench_decode as bd
b = bd.decode_batch('cuda')
w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device='cuda'), 'NHD',
                                                  use_tensor_cores=True, backend='fa2')
w.plan(b['kv_indptr'], b['kv_indices'], b['last_page_len'], bd.HQ, bd.HKV, bd.D, bd.PS,
       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)" > "$RESULTS/flashinfer-build.log" 2>&1 ) &
for c in base $CONFIGS; do  # every copy's modules at once (the cache's locks share what is the same)
  ( cd "$WORK/copies/$c" && PYTHONPATH=$PWD:${PYTHONPATH:-} python3 -m variantgen precompile causal sliding_window \
      mm_prefix --backend fa3 --kind decode --head-dim 128 --dtype bf16 --arch 9.0a -j 3 --jobs-per-module 2 \
      > "$RESULTS/build-$c.log" 2>&1 ) &
done
wait
export VARIANTGEN_DISABLE_JIT=1
ROOT=$PWD
for c in base $CONFIGS; do
  ( cd "$WORK/copies/$c" && PYTHONPATH=$PWD:${PYTHONPATH:-} python3 "$ROOT/bench/experiments/fa3_decode_tiles/tile_bench.py" \
      "$c" "$RESULTS/tile-$c.json" "$ROOT/$WORK/ref" )
done
