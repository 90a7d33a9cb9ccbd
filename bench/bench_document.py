"""Document masking (8 documents per request) on the prefill workload, planned, on the GPU.

Same workload as bench_prefill.py; FlexAttention on the same mask measured 2.18 ms in
bench/results/2026-11-29-h200/prefill-948f6a9.json. Run on the GPU machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.testing.harness import (  # noqa: E402
    PREFILL_BENCH_SHAPE,
    cuda_median_ms,
    prefill_bench_batch,
    random_paged_batch,
)
from variantgen.wrappers.reference import reference_attention  # noqa: E402

B, L, HQ, HKV, D, PS = PREFILL_BENCH_SHAPE


def main() -> None:
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = variantgen.make_wrapper(ROOT / "specs" / "document.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                kv_dtype="bf16")
    res = {"gpu": torch.cuda.get_device_name(0)}
    b, _ = prefill_bench_batch("cuda")
    ids = (torch.arange(L, device="cuda", dtype=torch.int32) // (L // 8)).repeat(B).contiguous()
    w.plan(*b.plan_args(), doc_ids=ids)
    res["segments"] = w.plan_stats["segments"]
    res["planned_ms"] = round(cuda_median_ms(lambda: w.run(b.q, (b.k_cache, b.v_cache), doc_ids=ids)), 3)
    w.plan(*b.plan_args(), skip_tiles=False)
    res["direct_ms"] = round(cuda_median_ms(lambda: w.run(b.q, (b.k_cache, b.v_cache), doc_ids=ids), 5), 3)
    # Correctness on a smaller batch with unaligned documents, planned.
    s = random_paged_batch([700, 300], [900, 300], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
                           device="cuda", seed=3)
    sid = torch.cat([torch.arange(900) // 130, torch.arange(300) // 77]).to(torch.int32).cuda()
    w.plan(*s.plan_args(), doc_ids=sid)
    res["unaligned_segments"] = w.plan_stats["segments"]
    out = w.run(s.q, (s.k_cache, s.v_cache), doc_ids=sid).float()
    ref = reference_attention(w.spec, s.q, (s.k_cache, s.v_cache), s.qo_indptr, s.kv_indptr, s.kv_indices,
                              s.last_page_len, {"doc_ids": sid})
    res["unaligned_rel_error"] = ((out - ref).norm() / ref.norm()).item()
    print(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "document-bench.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
