"""fa2 causal paired with FlashInfer's fa2 causal kernel, in the copy this runs from (make_copy.py).

The prefill benchmark workload (8 x 8192 tokens, 32/8 heads, hd 128, bf16, page 16): the causal
spec planned (one exact causal launch) and FlashInfer's causal wrapper alternate in 9 rounds of
10 runs (bench_plan.paired); the median of the per-round ratios, and the largest difference of
the two outputs.

    python pair.py KIND OUT_JSON        (from the copy's root, its modules precompiled)
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
from variantgen.testing import prefill_bench_batch, run_environment  # noqa: E402


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
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
