"""Ragged-KV prefill benchmark (MLA-shaped, as vLLM's FlashInfer MLA prefill runs it): variantgen's
fa2 and fa3 ragged modules next to FlashInfer's ragged prefill on its fa2 and fa3 kernels.

8 requests x 8192 new tokens, 32 query / 32 key-value heads (MLA's prefill is multi-head after
the latent projection), head dims 192 (qk) / 128 (vo), bf16. Rows: causal over the request
(``causal`` spec vs FlashInfer causal=True) and one non-causal context chunk (``full``: every key
visible, tests/data/full.yaml, vs causal=False), each with return_lse=True as the chunked-context
merge needs it. Every kernel is timed in the same process with CUDA events (median of --iters).
Writes bench/results/ragged-<date>-<gpu>.json (or --out; also into $OUT when set).
Run on the GPU machine:  python bench/bench_ragged.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.testing.harness import cuda_median_ms, run_environment, write_result  # noqa: E402

B, L, HQ, HKV, DQK, DVO = 8, 8192, 32, 32, 192, 128
SPECS = {"causal": ROOT / "specs" / "causal.yaml", "full": ROOT / "tests" / "data" / "full.yaml"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backends", default="fa2,fa3", help="variantgen backends (and FlashInfer's) to measure")
    ap.add_argument("--skip-flashinfer", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    dev = "cuda"
    res: dict = {**run_environment(), "workload": dict(batch=B, qo_len=L, kv_len=L, qo_heads=HQ, kv_heads=HKV,
                                                       head_dim_qk=DQK, head_dim_vo=DVO, dtype="bf16",
                                                       return_lse=True),
                 "ms": {}, "notes": {}, "errors": {}}
    ms, notes, errors = res["ms"], res["notes"], res["errors"]
    g = torch.Generator(device=dev).manual_seed(3)
    kw = dict(device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(B * L, HQ, DQK, **kw)
    k = torch.randn(B * L, HKV, DQK, **kw)
    v = torch.randn(B * L, HKV, DVO, **kw)
    indptr = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=dev)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    outputs: dict[str, torch.Tensor] = {}

    def record(name, fn):
        try:
            ms[name] = round(cuda_median_ms(fn, args.iters), 4)
            print(f"{name:45s} {ms[name]:8.4f} ms", flush=True)
            out = fn()
            outputs[name] = (out[0] if isinstance(out, tuple) else out).float()
        except Exception as e:  # noqa: BLE001 - record it, go on with the other rows
            errors[name] = f"{type(e).__name__}: {str(e)[:500]}"
            traceback.print_exc()

    if not args.skip_flashinfer:
        import flashinfer

        for backend in backends:
            for row, causal in (("causal", True), ("full", False)):
                name = f"flashinfer_{backend}_{row}"
                try:
                    t = time.perf_counter()
                    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8,
                                                                                    device=dev), "NHD", backend=backend)
                    w.plan(indptr, indptr, HQ, HKV, DQK, head_dim_vo=DVO, causal=causal, q_data_type=torch.bfloat16)
                    notes[f"{name}_setup_s"] = round(time.perf_counter() - t, 1)
                except Exception as e:  # noqa: BLE001
                    errors[name] = f"setup: {type(e).__name__}: {str(e)[:500]}"
                    continue
                record(name, lambda w=w: w.run(q, k, v, return_lse=True))
    for backend in backends:
        for row, path in SPECS.items():
            name = f"variantgen_{backend}_{row}"
            try:
                w = variantgen.make_wrapper(path, ws, head_dim_qk=DQK, head_dim_vo=DVO, q_dtype="bf16",
                                            kv_dtype="bf16", kind="ragged", backend=backend)
                torch.cuda.synchronize()
                t = time.perf_counter()
                w.plan(indptr, indptr, HQ, HKV)
                torch.cuda.synchronize()
                notes[f"{name}_plan_ms"] = round((time.perf_counter() - t) * 1e3, 3)
                notes[f"{name}_launches"] = w.plan_stats.get("launches")
            except Exception as e:  # noqa: BLE001
                errors[name] = f"setup: {type(e).__name__}: {str(e)[:500]}"
                continue
            record(name, lambda w=w: w.run(q, k, v, return_lse=True))
            theirs = outputs.get(f"flashinfer_{backend}_{row}")
            if name in outputs and theirs is not None:
                notes[f"{name}_vs_flashinfer_max_abs"] = (outputs[name] - theirs).abs().max().item()

    def ratio(a, b):
        return round(ms[a] / ms[b], 3) if a in ms and b in ms else None

    res["ratios"] = {f"variantgen_{b}_{r}_vs_flashinfer_{b}_{r}": ratio(f"variantgen_{b}_{r}", f"flashinfer_{b}_{r}")
                     for b in backends for r in SPECS}
    res["ratios"].update({f"variantgen_fa3_{r}_vs_variantgen_fa2_{r}": ratio(f"variantgen_fa3_{r}",
                                                                            f"variantgen_fa2_{r}") for r in SPECS})
    print(json.dumps(res["ratios"], indent=1))
    if errors:
        print("errors:", json.dumps(errors, indent=1))
    out = write_result("ragged", res, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
