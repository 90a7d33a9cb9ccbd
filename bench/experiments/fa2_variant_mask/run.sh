#!/bin/bash
# run.sh [KIND ...]: on the GPU machine, from the root of a checkout at 68313de (the fa2 variant
# with one struct for every launch; from 59d9ab6 on the exact launches have their own). Each KIND
# (make_copy.py) gets a copy of the package, its fa2 causal module built, and pair.py run in it.
# Results: $OUT (or build/fa2-variant-mask)/pair-<kind>.json.
# DECODE=1: CUDA-core decode instead (the decode module, pair.py --decode), from any checkout: the
# decode modules instantiate the one variant struct whose mask make_copy.py replaces.
set -uo pipefail
if [ -n "${DECODE:-}" ]; then KIND_ARGS="--kind decode"; PAIR_ARGS="--decode"; TAG=decode-; else
  KIND_ARGS=""; PAIR_ARGS=""; TAG=""; fi
KINDS=${*:-"base maskfree maskfree_qlen window select noinline"}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=build/fa2-variant-mask
RESULTS=${OUT:-$WORK}
export VARIANTGEN_CACHE_DIR=$PWD/$WORK/cache
rm -rf "$WORK/copies" && mkdir -p "$WORK/copies" "$RESULTS"
for k in $KINDS; do python3 "$HERE/make_copy.py" "$k" "$WORK/copies/$k"; done
for k in $KINDS; do
  ( cd "$WORK/copies/$k" && PYTHONPATH=$PWD:${PYTHONPATH:-} python3 -m variantgen precompile causal --backend fa2 $KIND_ARGS \
      --head-dim 128 --dtype bf16 --arch 9.0a -j 1 --jobs-per-module 5 > "$RESULTS/build-$TAG$k.log" 2>&1 ) &
done
wait
export VARIANTGEN_DISABLE_JIT=1
for k in $KINDS; do
  ( cd "$WORK/copies/$k" && PYTHONPATH=$PWD:${PYTHONPATH:-} python3 "$HERE/pair.py" "$k" "$RESULTS/pair-$TAG$k.json" $PAIR_ARGS )
done
