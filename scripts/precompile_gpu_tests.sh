#!/usr/bin/env bash
# Precompile every module the GPU test files use, several at a time, before `pytest -m gpu`
# (one cold fa2 module is ~20-75 s on 16 cores, an fa3 module 60-110 s). Usage, on the GPU box:
#   bash scripts/precompile_gpu_tests.sh [fa2|fa3|decode|ragged|masks|fuzz ...]   (default: all but fuzz)
# Modules go to VARIANTGEN_CACHE_DIR (default cache/). Extra arguments to precompile via PRECOMPILE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
VG=(python3 -m variantgen precompile --arch 9.0a -j "${VG_PARALLEL:-4}" --jobs-per-module "${VG_JOBS:-4}" ${PRECOMPILE_ARGS:-})
groups=("$@"); [ ${#groups[@]} -eq 0 ] && groups=(fa2 fa3 decode ragged masks)
for g in "${groups[@]}"; do
  case $g in
    fa2)     # tests/gpu/test_gpu_specs.py
      "${VG[@]}" specs/*.yaml --head-dim 128 --dtype bf16 --backend fa2
      "${VG[@]}" specs/mm_prefix.yaml specs/softcap.yaml specs/document.yaml --head-dim 64,128,256 --dtype bf16,fp16 --backend fa2
      "${VG[@]}" specs/mm_prefix.yaml --head-dim 128 --dtype bf16 --kv-dtype fp8_e4m3 --backend fa2 ;;
    fa3)     # tests/gpu/test_gpu_fa3.py
      "${VG[@]}" specs/*.yaml tests/data/strictly_causal.yaml --head-dim 128 --dtype bf16 --backend fa3
      "${VG[@]}" specs/mm_prefix.yaml --head-dim 64,256 --dtype bf16 --backend fa3
      "${VG[@]}" specs/mm_prefix.yaml --head-dim 128 --dtype fp16 --backend fa3 ;;
    decode)  # tests/gpu/test_gpu_decode.py (tensor-core decode runs the fa2 prefill module; fa3 decode,
             # tests/gpu/test_gpu_fa3_decode.py, the fa3 prefill modules of group fa3)
      "${VG[@]}" specs/*.yaml --head-dim 128 --dtype bf16 --backend fa2 --kind decode
      "${VG[@]}" specs/softcap.yaml --head-dim 64 --dtype bf16 --backend fa2 --kind decode
      "${VG[@]}" specs/mm_prefix.yaml --head-dim 256 --dtype bf16 --backend fa2 --kind decode
      "${VG[@]}" specs/document.yaml --head-dim 64 --dtype fp16 --backend fa2 --kind decode
      "${VG[@]}" specs/sliding_window.yaml --head-dim 256 --dtype fp16 --backend fa2 --kind decode
      "${VG[@]}" specs/causal.yaml --head-dim 128 --dtype fp16 --backend fa2 --kind decode
      "${VG[@]}" specs/softcap.yaml --head-dim 128 --dtype bf16 --kv-dtype fp8_e4m3 --backend fa2 --kind decode
      "${VG[@]}" specs/causal.yaml specs/mm_prefix.yaml specs/softcap.yaml --head-dim 128 --dtype bf16 --backend fa2 ;;
    ragged)  # tests/gpu/test_gpu_ragged.py (fa2 every spec, fa3 a sample; tests/data/full.yaml: the context chunks)
      "${VG[@]}" specs/*.yaml --head-dim 128 --dtype bf16 --backend fa2 --kind ragged
      "${VG[@]}" specs/causal.yaml specs/mm_prefix.yaml specs/document.yaml specs/softcap.yaml specs/attention_sink_learned.yaml --head-dim 128 --dtype bf16 --backend fa3 --kind ragged
      "${VG[@]}" specs/mm_prefix.yaml specs/causal.yaml --head-dim 192/128 --dtype bf16 --backend fa3 --kind ragged
      "${VG[@]}" tests/data/full.yaml --head-dim 192/128 --dtype bf16 --backend fa2,fa3 --kind ragged
      "${VG[@]}" specs/mm_prefix.yaml specs/causal.yaml specs/softcap.yaml --head-dim 192/128 --dtype bf16,fp16 --backend fa2 --kind ragged
      "${VG[@]}" specs/softcap.yaml --head-dim 64,256 --dtype bf16 --backend fa2 --kind ragged ;;
    masks)   # tests/gpu/test_gpu_masks.py beyond the groups above: Gemma 4's sliding layers at head dim 256,
             # learned sinks at gpt-oss's head dim 64 (the comparison with FlashInfer's sink wrapper)
      "${VG[@]}" specs/gemma4_sliding.yaml --head-dim 256 --dtype bf16 --backend fa2,fa3
      "${VG[@]}" specs/attention_sink_learned.yaml --head-dim 64 --dtype bf16 --backend fa2,fa3 ;;
    fuzz)    # bench/fuzz_gpu.py's module matrix (not in the default groups)
      python3 bench/fuzz_gpu.py --list-modules args | while read -r args; do "${VG[@]}" $args; done ;;
    *) echo "unknown group $g (expected fa2, fa3, decode, ragged, masks, fuzz)" >&2; exit 2 ;;
  esac
done
