"""Steady-state plan() time of the interval planner vs the kernel it plans, on the GPU.

Workload of bench_prefill.py (8 x 8192 tokens, 32/8 heads, hd 128, page 16, three 1024-token
spans per request). Per backend and spec: plan() with the planner off (the launch builder's
one custom launch per request, in one C++ call of the kernel module), and on with the spec's
generated planner module (rowplan.py, the default on CUDA: row kernel, compacted read-back,
launches built in one C++ call), also with the index tensors on the host as serving engines
pass them; then run() of the planned and unplanned launches; CUDA-graph mode (plan, eager
run, replay). Each plan() is timed from
the host (it ends with a device sync: the segment boundaries are read back); median of
--iters after two warm-up plans (and, for the default path, the fastest and the 90th
percentile). The kernels' ratio to FlashInfer's causal kernel is also measured paired: the
runs alternate in rounds (--rounds, 10 runs each), so that a drift of the GPU's clocks within
the process weighs on both sides alike; ``paired`` has each round's times and the median
ratio. Writes bench/results/plan-<date>-<gpu>.json (or --out; also
into $OUT when set). Run on the GPU machine:  python bench/bench_plan.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.testing.harness import (  # noqa: E402
    PREFILL_BENCH_SHAPE,
    cuda_median_ms,
    prefill_bench_batch,
    result_file_name,
    run_environment,
)

D = PREFILL_BENCH_SHAPE[4]  # head dim


def plan_ms(w, batch, kw, iters: int, host_indptrs: bool = False, spread: dict | None = None) -> float:
    """Median plan() time. ``host_indptrs``: qo_indptr, paged_kv_indptr and last_page_len as
    CPU tensors, as serving engines pass them to FlashInfer's plan (vLLM keeps CPU copies);
    the page list stays on the GPU. Otherwise all on the GPU (plan() reads them back: a sync).
    ``spread``: gets the fastest and the 90th-percentile plan too (host time is noisy)."""
    args = list(batch.plan_args())
    if host_indptrs:
        args[0], args[1], args[3] = args[0].cpu(), args[1].cpu(), args[3].cpu()
    times = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        w.plan(*args, **kw)
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    if spread is not None:
        times.sort()
        spread.update(min=round(times[0], 3), p90=round(times[int(0.9 * (len(times) - 1))], 3))
    return round(statistics.median(times), 3)


class FlashInferPlan:
    """plan_ms() adapter for a FlashInfer wrapper (its plan takes head dim and page size)."""

    def __init__(self, wrapper, batch, kw):
        self.wrapper, self.kw = wrapper, kw

    def plan(self, *plan_args, **_):
        self.wrapper.plan(*plan_args[:6], D, PREFILL_BENCH_SHAPE[5], **self.kw)


def paired(runs: dict, rounds: int) -> dict:
    """Each run's device time, alternating in ``rounds`` rounds (median of 10 runs each), and per
    run its median ratio to the first (FlashInfer's causal kernel) over the rounds."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            times[n].append(round(cuda_median_ms(runs[n], 10), 3))
    base = names[0]
    ratio = {n: round(statistics.median(a / b for a, b in zip(times[n], times[base])), 4) for n in names[1:]}
    return {"rounds": rounds, "baseline": base, "ms": times, "median_ratio_to_baseline": ratio}


def graph_mode(out: dict, tag: str, batch, ws, name: str, planned: dict, iters: int, backend: str) -> None:
    """CUDA-graph mode (graph.py) at the workload's own size: plan() time, and the replay of a
    run() captured once (padded launches, split-KV off) against the eager run of that plan."""
    from variantgen.planning.graph import GraphCapacity

    cap = GraphCapacity(max_batch_size=len(batch.qo_lens), max_total_q=batch.q.shape[0],
                        max_kv_pages=batch.kv_indices.numel())
    w = variantgen.make_wrapper(ROOT / "specs" / f"{name}.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                kv_dtype="bf16", graph=cap, backend=backend)
    out["plan_ms"][f"{tag}_graph_mode"] = plan_ms(w, batch, planned, iters)
    args = {k: v for k, v in planned.items() if k != "skip_tiles"}
    o = torch.empty_like(batch.q)
    run = lambda: w.run(batch.q, (batch.k_cache, batch.v_cache), out=o, **args)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out["run_ms"][f"{tag}_graph_mode_eager"] = round(cuda_median_ms(run, 10), 3)
    out["run_ms"][f"{tag}_graph_mode_replay"] = round(cuda_median_ms(graph.replay, 10), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backends", default="fa2,fa3")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=7, help="rounds of the paired kernel measurement (0: none)")
    ap.add_argument("--skip-flashinfer", action="store_true",
                    help="no FlashInfer baseline rows (they JIT-compile FlashInfer's modules on first use)")
    args = ap.parse_args()
    batch, ranges = prefill_bench_batch("cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kv = (batch.k_cache, batch.v_cache)
    out = {**run_environment(), "workload": "8 x 8192, 32/8 heads, hd 128, bf16, page 16, 3 spans of 1024",
           "plan_ms": {}, "plan_ms_spread": {}, "run_ms": {}, "plan_fraction_of_run": {}, "launches": {}}
    pairs: dict[str, dict] = {}
    for backend in args.backends.split(","):
        pair = pairs[backend] = {}
        if not args.skip_flashinfer:
            import flashinfer

            # FlashInfer's own causal wrapper: its plan() is the floor a launch pays (host scheduler).
            fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty_like(ws), "NHD", backend=backend)
            fi_kw = dict(causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            fi_plan = FlashInferPlan(fw, batch, fi_kw)
            out["plan_ms"][f"{backend}_flashinfer_causal"] = plan_ms(fi_plan, batch, {}, args.iters)
            out["plan_ms"][f"{backend}_flashinfer_causal_host_indptrs"] = plan_ms(fi_plan, batch, {}, args.iters, True)
            fi_run = pair[f"{backend}_flashinfer_causal"] = lambda fw=fw: fw.run(batch.q, kv)
            out["run_ms"][f"{backend}_flashinfer_causal"] = round(cuda_median_ms(fi_run, 10), 3)
        for name, spec_args in (("causal", {}), ("mm_prefix", {"ranges": ranges})):
            w = variantgen.make_wrapper(ROOT / "specs" / f"{name}.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                        kv_dtype="bf16", backend=backend)
            tag = f"{backend}_{name}"
            out["plan_ms"][f"{tag}_direct"] = plan_ms(w, batch, {"skip_tiles": False}, args.iters)
            direct = cuda_median_ms(lambda w=w, a=spec_args: w.run(batch.q, kv, **a), 10)
            out["run_ms"][f"{tag}_direct"] = round(direct, 3)
            planned = {"skip_tiles": True, **spec_args}
            for impl, host_indptrs in (("row_kernel", False), ("row_kernel_host_indptrs", True)):
                spread = out["plan_ms_spread"][f"{tag}_planned_{impl}"] = {}
                out["plan_ms"][f"{tag}_planned_{impl}"] = plan_ms(w, batch, planned, args.iters, host_indptrs, spread)
            out["launches"][tag] = {"row_planner": w.plan_stats.get("row_planner"),
                                    "launches": w.plan_stats.get("launches")}
            planned_run = pair[f"{tag}_planned"] = lambda w=w, a=spec_args: w.run(batch.q, kv, **a)
            run = cuda_median_ms(planned_run, 10)
            out["run_ms"][f"{tag}_planned"] = round(run, 3)
            for impl in ("row_kernel", "row_kernel_host_indptrs"):
                out["plan_fraction_of_run"][f"{tag}_{impl}"] = round(out["plan_ms"][f"{tag}_planned_{impl}"] / run, 4)
            graph_mode(out, tag, batch, ws, name, planned, args.iters, backend)
            print(tag, {k: v for k, v in out["plan_ms"].items() if k.startswith(tag)}, f"run {run:.3f} ms",
                  out["launches"][tag], flush=True)
    if args.rounds > 0:
        out["paired"] = {b: paired(p, args.rounds) for b, p in pairs.items() if len(p) > 1}
        for b, p in out["paired"].items():
            print(b, "paired:", p["median_ratio_to_baseline"], flush=True)
    print(json.dumps(out, indent=1))
    text = json.dumps(out, indent=1) + "\n"
    Path(args.out or ROOT / "bench" / "results" / result_file_name("plan", out)).write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "plan-bench.json").write_text(text)


if __name__ == "__main__":
    main()
