"""fa2 causal paired with FlashInfer's, in the copy this runs from (make_copy.py).

Prefill (default): the prefill benchmark workload (8 x 8192 tokens, 32/8 heads, hd 128, bf16,
page 16), the causal spec planned (one exact causal launch) against FlashInfer's fa2 causal
wrapper. ``--decode``: CUDA-core decode on the decode benchmark workload (64 requests x 8192
tokens, bench_decode.py), the causal spec's decode module (every key known visible, so its
mask is evaluated on none) against FlashInfer's CUDA-core decode wrapper. Either way the two
alternate in 9 rounds of 10 runs (bench_plan.paired); the median of the per-round ratios, and
the largest difference of the two outputs.

    python pair.py KIND OUT_JSON [--decode]    (from the copy's root, its modules precompiled)
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))

import flashinfer  # noqa: E402
from bench_plan import paired  # noqa: E402

import variantgen  # noqa: E402
from variantgen.testing.harness import prefill_bench_batch, run_environment  # noqa: E402


def decode_pair(ws: torch.Tensor) -> tuple[dict, torch.Tensor, torch.Tensor, list]:
    """CUDA-core decode of the causal spec against FlashInfer's: (paired times, its output, ours,
    our plan's launches)."""
    import bench_decode as bd

    batch = bd.decode_batch("cuda")
    kv, plan_pos = (batch["k"], batch["v"]), (batch["kv_indptr"], batch["kv_indices"], batch["last_page_len"])
    fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty_like(ws), "NHD")
    fw.plan(*plan_pos, bd.HQ, bd.HKV, bd.D, bd.PS, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    w = variantgen.make_wrapper("specs/causal.yaml", ws, head_dim_qk=bd.D, q_dtype="bf16", kv_dtype="bf16",
                                kind="decode", backend="fa2", use_tensor_cores=False)
    w.plan(*plan_pos, bd.HQ, bd.HKV, bd.PS)
    ref, mine = fw.run(batch["q"], kv).float(), w.run(batch["q"], kv).float()
    pair = paired({"fi": lambda: fw.run(batch["q"], kv), "vg": lambda: w.run(batch["q"], kv)}, 9)
    return pair, ref, mine, w.plan_stats.get("launches", [])


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if "--decode" in sys.argv[3:]:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        pair, ref, mine, launches = decode_pair(ws)
        res = {**run_environment(), "kind": kind, "route": "decode, CUDA cores", "times": pair["ms"],
               "ratio": pair["median_ratio_to_baseline"]["vg"], "max_abs": (ref - mine).abs().max().item(),
               "launches": launches}
        print(json.dumps({k: res[k] for k in ("kind", "route", "ratio", "max_abs")}), flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        return
    batch, _ = prefill_bench_batch("cuda")
    kv = (batch.k_cache, batch.v_cache)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty_like(ws), "NHD", backend="fa2")
    fw.plan(*batch.plan_args()[:6], 128, 16, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    w = variantgen.make_wrapper("specs/causal.yaml", ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16",
                                backend="fa2")
    w.plan(*batch.plan_args())
    ref, mine = fw.run(batch.q, kv).float(), w.run(batch.q, kv).float()
    pair = paired({"fi": lambda: fw.run(batch.q, kv), "vg": lambda: w.run(batch.q, kv)}, 9)
    res = {**run_environment(), "kind": kind, "times": pair["ms"], "ratio": pair["median_ratio_to_baseline"]["vg"],
           "max_abs": (ref - mine).abs().max().item(),
           "launches": [(la.mask_mode, la.num_requests) for la in w.last_plan.launches]}
    print(json.dumps({k: res[k] for k in ("kind", "ratio", "max_abs", "launches")}), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
