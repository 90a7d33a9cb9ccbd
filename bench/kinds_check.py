"""Quick GPU check of the decode and ragged kinds against the derived reference: decode
(CUDA cores, mm_prefix, key trimming on/off) and ragged MLA-shaped prefill (192/128) with LSE.
Run from the repo root on the GPU machine: python bench/kinds_check.py"""
import json
import os
import sys
from pathlib import Path

import torch

import variantgen
from variantgen.testing.harness import random_paged_batch, random_spec_args, result_file_name, run_environment
from variantgen.wrappers.ragged import random_ragged_batch, reference_ragged
from variantgen.wrappers.reference import reference_attention

ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
res = {}
spec = variantgen.load_spec("specs/mm_prefix.yaml")


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


try:  # decode, CUDA cores: one query per request (the last token), GQA 32/8, page 16
    kv = [1, 15, 16, 17, 700, 4000, 33, 129]
    b = random_paged_batch([1] * len(kv), kv, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                           device="cuda", seed=3)
    args = random_spec_args(spec, b, seed=3)
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                backend="fa2")
    ref, ref_lse = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                       b.last_page_len, args, return_lse=True)
    for skip in (False, True):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 16, skip_tiles=skip, **(args if skip else {}))
        out, lse = w.run(b.q, (b.k_cache, b.v_cache), return_lse=True, **args)
        res[f"decode_mm_prefix_trim_{skip}_rel"] = rel(out, ref)
        res[f"decode_mm_prefix_trim_{skip}_lse_maxabs"] = (lse - ref_lse).abs().max().item()
except Exception as e:
    res["decode_error"] = f"{type(e).__name__}: {str(e)[:600]}"

try:  # ragged, MLA prefill shape 192/128, chunked prefill + qo_len 1, LSE
    rb = random_ragged_batch([37, 300, 1, 129], [37, 812, 700, 1000], num_qo_heads=16, num_kv_heads=16,
                             head_dim_qk=192, head_dim_vo=128, device="cuda", seed=4)
    wr = variantgen.make_wrapper(spec, ws, head_dim_qk=192, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16",
                                 kind="ragged", backend="fa2")
    args = random_spec_args(spec, rb, seed=4)
    wr.plan(*rb.plan_args())
    out, lse = wr.run(rb.q, rb.k, rb.v, return_lse=True, **args)
    ref, ref_lse = reference_ragged(spec, rb.q, rb.k, rb.v, rb.qo_indptr, rb.kv_indptr, args, return_lse=True)
    res["ragged_192x128_mm_prefix_rel"] = rel(out, ref)
    res["ragged_192x128_lse_maxabs"] = (lse - ref_lse).abs().max().item()
except Exception as e:
    res["ragged_error"] = f"{type(e).__name__}: {str(e)[:600]}"
print(json.dumps(res, indent=1))
name = result_file_name("kinds-check", run_environment())
out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
(out_dir / name).write_text(json.dumps(res, indent=1))
sys.exit(0)
