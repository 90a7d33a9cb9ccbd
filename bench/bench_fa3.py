"""Prefill workload of DESIGN.md (8 x 8192, 32/8 heads, hd128, bf16, page 16, three 1024-token
spans per request): FlashInfer fa2/fa3 causal vs variantgen mm_prefix on fa2 and fa3, and the
fa3 soft-cap variant. The short form of bench_prefill.py that fits a few device minutes.
Run from the repo root on the GPU machine: python bench/bench_fa3.py"""
import json
import os
import time
from pathlib import Path

import flashinfer
import torch

import variantgen
from variantgen.testing import (
    PREFILL_BENCH_SHAPE,
    PREFILL_BENCH_SPANS,
    cuda_median_ms,
    prefill_bench_batch,
    result_file_name,
    run_environment,
)

B, L, HQ, HKV, D, PS = PREFILL_BENCH_SHAPE
SPANS = PREFILL_BENCH_SPANS
b, ranges = prefill_bench_batch("cuda")
kv = (b.k_cache, b.v_cache)
ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
res = {**run_environment(), "workload": dict(batch=B, tokens=L, qo_heads=HQ, kv_heads=HKV, head_dim=D,
                                             page_size=PS, spans=SPANS), "ms": {}, "notes": {}}
ms = res["ms"]


def record(name, fn):
    ms[name] = round(cuda_median_ms(fn, 20), 3)
    print(f"{name:44s} {ms[name]:8.3f} ms", flush=True)


outs = {}
for be in ("fa2", "fa3"):
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=be)
    w.plan(*b.plan_args()[:6], D, PS, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    record(f"flashinfer_causal_{be}", lambda w=w: w.run(b.q, kv))
for be in ("fa2", "fa3"):
    w = variantgen.make_wrapper("specs/mm_prefix.yaml", ws, head_dim_qk=D, q_dtype="bf16", kv_dtype="bf16", backend=be)
    for skip in (True, False):
        tag = f"variantgen_{be}_mm_prefix_{'planned' if skip else 'direct'}"
        torch.cuda.synchronize()
        t = time.perf_counter()
        w.plan(*b.plan_args(), skip_tiles=skip, **({"ranges": ranges} if skip else {}))
        torch.cuda.synchronize()
        res["notes"][f"{tag}_plan_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        res["notes"][f"{tag}_launches"] = [(la.mask_mode, la.num_requests, la.window_left) for la in w._launches]
        record(tag, lambda w=w: w.run(b.q, kv, ranges=ranges))
        outs[tag] = w.run(b.q, kv, ranges=ranges).float()
ref = outs["variantgen_fa2_mm_prefix_planned"]
for k, o in outs.items():
    res["notes"][f"{k}_rel_vs_fa2_planned"] = ((o - ref).norm() / ref.norm()).item()
ws_ = variantgen.make_wrapper("specs/softcap.yaml", ws, head_dim_qk=D, q_dtype="bf16", kv_dtype="bf16", backend="fa3")
ws_.plan(*b.plan_args(), skip_tiles=False)
record("variantgen_fa3_softcap_direct", lambda: ws_.run(b.q, kv, soft_cap=50.0, window=-1))
ws_.plan(*b.plan_args(), skip_tiles=True, soft_cap=50.0, window=-1)
record("variantgen_fa3_softcap_planned", lambda: ws_.run(b.q, kv, soft_cap=50.0, window=-1))


def ratio(a, c):
    return round(ms[a] / ms[c], 3) if a in ms and c in ms else None


res["ratios"] = {
    "fa3_mm_prefix_planned_vs_flashinfer_fa3_causal": ratio("variantgen_fa3_mm_prefix_planned",
                                                            "flashinfer_causal_fa3"),
    "fa2_mm_prefix_planned_vs_flashinfer_fa2_causal": ratio("variantgen_fa2_mm_prefix_planned",
                                                            "flashinfer_causal_fa2"),
    "fa3_mm_prefix_planned_vs_fa2_mm_prefix_planned": ratio("variantgen_fa3_mm_prefix_planned",
                                                           "variantgen_fa2_mm_prefix_planned"),
    "fa3_softcap_planned_vs_flashinfer_fa3_causal": ratio("variantgen_fa3_softcap_planned", "flashinfer_causal_fa3"),
}
print(json.dumps(res, indent=1))
name = result_file_name("prefill-fa3", res)
out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
(out_dir / name).write_text(json.dumps(res, indent=1))
print("wrote", out_dir / name)
