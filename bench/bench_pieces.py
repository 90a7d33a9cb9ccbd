"""GPU benchmark of rows that see several key intervals (variantgen/planning/pieces.py): streaming_sink
against sliding_window with the same window, on fa3 and fa2.

Workload (issue 41's): 8 requests x 8192 tokens of prefill, 32/8 heads, head dim 128, bf16, page
16; streaming_sink with num_sink 4 and window 1023, sliding_window with window 1023. Per backend
it times, in one process with CUDA events, each run() alone (median of --iters after warm-up: the
host's work before the first launch counted) and --iters runs back to back (per run: the host's
work overlapped with the GPU's, as in a model's forward pass):

* ``sliding_window``: the bar (its rows see one interval: causal and window launches);
* ``streaming_sink``: past the first window each row's sinks and window run as two pieces merged
  by LSE (the planner's split_rows "pieces");
* ``streaming_sink_gaps``: the same rows as custom launch requests whose page lists skip the gap
  between sinks and window (split_rows "gaps", planning/gaps.py): one pass, no merge, the mask
  evaluated outside the keys all rows of a launch request see;
* ``streaming_sink_hull``: the same rows planned with the pieces off (the planner's max_pieces =
  0): one custom launch over each row's hull, what plan() did before;

and records the ratios to sliding_window, plan()'s host time, the plan's summary and the largest
difference of the pieces' and the gaps' outputs from the hull's (the same attention, three
routes). For the pieces and the gaps it also records where the time goes: the GPU time of each
kernel of one run() (torch's profiler, per kernel name, and all kernels) and, where the rows'
partial outputs are merged, the merge alone - the module's merge_pieces kernel against the same
merge in torch ops (wrappers/merge.py's reference). ``streaming_sink_inline``: the sinks (4 keys)
computed by the merge itself (merge_inline; the planner's inline_keys), not launched. Writes
bench/results/pieces-<date>-<gpu>.json (or --out). Modules are loaded from VARIANTGEN_CACHE_DIR
(--list-modules prints the precompile commands for a CPU build box). Run on the GPU machine:

    python bench/bench_pieces.py --list-modules
    python bench/bench_pieces.py                 # fa3 and fa2
    python bench/bench_pieces.py --backends fa3 --iters 50
    python bench/bench_pieces.py --backends fa3 --decode   # and decode: 64 x 32768 keys

--decode adds StreamingLLM's own case: decode of 64 requests x 32768 cached tokens (one query
each, the tensor-core path), sliding_window against streaming_sink eager (pieces), in CUDA-graph
mode (gaps, the graph replayed) and over its hull.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.planning.pieces import INLINE_KEYS  # noqa: E402
from variantgen.testing.harness import (  # noqa: E402
    cuda_back_to_back_ms,
    cuda_median_ms,
    gpu_bench_args,
    noted,
    random_paged_batch,
    run_environment,
    write_result,
)

WORKLOAD = dict(batch=8, tokens=8192, qo_heads=32, kv_heads=8, head_dim=128, page_size=16, num_sink=4, window=1023)
# Decode (--decode): StreamingLLM's own case, long contexts, one query per request.
DECODE_WORKLOAD = dict(batch=64, kv_tokens=32768, qo_heads=32, kv_heads=8, head_dim=128, page_size=16, num_sink=4,
                       window=1023)
SPECS = ("streaming_sink", "sliding_window")


def list_modules() -> str:
    return "\n".join(f"python -m variantgen.tools.cli precompile specs/{s}.yaml --head-dim {WORKLOAD['head_dim']} "
                     f"--dtype bf16 --backend {be} --kind prefill --arch 9.0a -j 8"
                     for s in SPECS for be in ("fa3", "fa2"))


def plan_ms(plan, times: int = 5) -> float:
    samples = []
    for _ in range(times):
        torch.cuda.synchronize()
        t = time.perf_counter()
        plan()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e3)
    return round(sorted(samples)[len(samples) // 2], 3)


def bench_backend(backend: str, iters: int, res: dict) -> None:
    wl = WORKLOAD
    n, hd = wl["tokens"], wl["head_dim"]
    batch = random_paged_batch([n] * wl["batch"], [n] * wl["batch"], num_qo_heads=wl["qo_heads"],
                               num_kv_heads=wl["kv_heads"], head_dim=hd, page_size=wl["page_size"],
                               dtype=torch.bfloat16, device="cuda", seed=1)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sink = {"num_sink": wl["num_sink"], "window": wl["window"]}
    cases = {"sliding_window": ("sliding_window", {"window": wl["window"]}, None, "pieces"),
             "streaming_sink": ("streaming_sink", sink, None, "pieces"),
             "streaming_sink_inline": ("streaming_sink", sink, None, "inline"),
             "streaming_sink_gaps": ("streaming_sink", sink, None, "gaps"),
             "streaming_sink_hull": ("streaming_sink", sink, 0, "pieces")}
    outs = {}
    for name, (spec, args, max_pieces, split_rows) in cases.items():
        key = f"{name}_{backend}"
        w = variantgen.make_wrapper(ROOT / "specs" / f"{spec}.yaml", ws, head_dim_qk=hd, q_dtype="bf16",
                                    kv_dtype="bf16", backend=backend)
        w.planner.split_rows = "pieces" if split_rows == "inline" else split_rows
        # (the sinks computed by the merge, not launched - or launched, whatever the default)
        w.planner.inline_keys = INLINE_KEYS if split_rows == "inline" else 0
        if max_pieces is not None:
            w.planner.max_pieces = max_pieces
        plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        res["notes"][f"{key}_plan"] = repr(plan)
        res["notes"][f"{key}_plan_ms"] = plan_ms(lambda w=w, args=args: w.plan(*batch.plan_args(), skip_tiles=True,
                                                                                 **args))
        kv = (batch.k_cache, batch.v_cache)
        outs[name] = w.run(batch.q, kv, **args).clone()
        call = lambda w=w, args=args, kv=kv: w.run(batch.q, kv, **args)  # noqa: E731
        res["ms"][key] = round(cuda_median_ms(call, iters), 3)
        res["ms"][f"{key}_back_to_back"] = round(cuda_back_to_back_ms(call, iters), 3)
        print(f"{key:36s} {res['ms'][key]:8.3f} ms per call, {res['ms'][f'{key}_back_to_back']:8.3f} ms back to back",
              flush=True)
        if name in ("streaming_sink", "streaming_sink_inline", "streaming_sink_gaps"):
            breakdown(w, lambda w=w, args=args, kv=kv: w.run(batch.q, kv, **args), iters, res, key)
    for timing in ("", "_back_to_back"):
        bar = res["ms"][f"sliding_window_{backend}{timing}"]
        for name in ("streaming_sink", "streaming_sink_inline", "streaming_sink_gaps", "streaming_sink_hull"):
            ratio = res["ms"][f"{name}_{backend}{timing}"] / bar
            res["notes"][f"{name}_{backend}{timing}_over_sliding_window"] = round(ratio, 3)
    hull = outs["streaming_sink_hull"].float()
    for name, label in (("streaming_sink", "pieces"), ("streaming_sink_inline", "inline"),
                        ("streaming_sink_gaps", "gaps")):
        diff = (outs[name].float() - hull).abs().max().item()
        res["notes"][f"streaming_sink_{backend}_{label}_vs_hull_max_abs_diff"] = round(diff, 5)


def bench_decode(backend: str, iters: int, res: dict) -> None:
    """Decode on the tensor-core path (fa3's decode; fa2 use_tensor_cores=True), DECODE_WORKLOAD:
    sliding_window against streaming_sink eager (the pieces), in CUDA-graph mode (the gaps: one
    launch request per query over its sinks' page and its window; the graph replayed) and over
    its hull (max_pieces 0, eager)."""
    from variantgen.planning.graph import GraphCapacity

    wl = DECODE_WORKLOAD
    n, hd = wl["batch"], wl["head_dim"]
    batch = random_paged_batch([1] * n, [wl["kv_tokens"]] * n, num_qo_heads=wl["qo_heads"], num_kv_heads=wl["kv_heads"],
                               head_dim=hd, page_size=wl["page_size"], dtype=torch.bfloat16, device="cuda", seed=2)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    plan_args = (batch.kv_indptr, batch.kv_indices, batch.last_page_len, wl["qo_heads"], wl["kv_heads"],
                 wl["page_size"])
    sink = {"num_sink": wl["num_sink"], "window": wl["window"]}
    capacity = GraphCapacity(max_batch_size=n, max_total_q=n, max_kv_pages=int(batch.kv_indptr[-1]))
    cases = {"decode_sliding_window": ("sliding_window", {"window": wl["window"]}, None, None),
             "decode_streaming_sink": ("streaming_sink", sink, None, None),
             "decode_streaming_sink_graph": ("streaming_sink", sink, None, capacity),
             "decode_streaming_sink_hull": ("streaming_sink", sink, 0, None)}
    outs = {}
    for name, (spec, args, max_pieces, graph) in cases.items():
        key = f"{name}_{backend}"
        w = variantgen.make_wrapper(ROOT / "specs" / f"{spec}.yaml", ws, head_dim_qk=hd, q_dtype="bf16",
                                    kv_dtype="bf16", backend=backend, kind="decode", use_tensor_cores=True,
                                    graph=graph)
        if max_pieces is not None:
            w.planner.max_pieces = max_pieces
        plan = w.plan(*plan_args, **args)
        res["notes"][f"{key}_plan"] = repr(plan)
        kv = (batch.k_cache, batch.v_cache)
        out = torch.empty_like(batch.q)
        call = lambda w=w, args=args, kv=kv, out=out: w.run(batch.q, kv, out=out, **args)  # noqa: E731
        call()
        if graph is not None:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                call()
            call = captured.replay
        call()
        torch.cuda.synchronize()
        outs[name] = out.float()
        res["ms"][key] = round(cuda_median_ms(call, iters), 4)
        print(f"{key:40s} {res['ms'][key]:8.4f} ms per call", flush=True)
    bar = res["ms"][f"decode_sliding_window_{backend}"]
    for name in ("decode_streaming_sink", "decode_streaming_sink_graph", "decode_streaming_sink_hull"):
        res["notes"][f"{name}_{backend}_over_sliding_window"] = round(res["ms"][f"{name}_{backend}"] / bar, 3)
    for name in ("decode_streaming_sink", "decode_streaming_sink_graph"):
        diff = (outs[name] - outs["decode_streaming_sink_hull"]).abs().max().item()
        res["notes"][f"{name}_{backend}_vs_hull_max_abs_diff"] = round(diff, 5)


def breakdown(w, run, iters: int, res: dict, key: str) -> None:
    """Where a run()'s time goes: GPU time per kernel name (mean per run, ms), and the merge alone."""
    from torch.profiler import ProfilerActivity, profile

    from variantgen.wrappers.merge import merge_pieces_reference, piece_buffers

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.key_averages():  # (kernels by name; names cut at 90 characters, their times summed)
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total > 0:
            kernels[e.key[:90]] = round(kernels.get(e.key[:90], 0.0) + total / iters / 1e3, 4)
    kernels["(all kernels)"] = round(sum(kernels.values()), 4)
    res["notes"][f"{key}_kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
    merge = w.last_plan.merge
    if merge is None or merge.inline is not None:  # (the merge alone: of partial outputs)
        return
    out = torch.empty(w.last_plan.batch.total_q, w.last_plan.batch.num_qo_heads, w.config.head_dim_vo,
                      dtype=torch.bfloat16, device="cuda")
    parts, parts_lse = piece_buffers(out, merge.pieces)
    parts.normal_()
    parts_lse.normal_()
    res["ms"][f"{key}_merge_kernel"] = round(cuda_median_ms(
        lambda: w.module.merge_pieces(out, None, parts, parts_lse, merge.out_rows, merge.out_counts), iters), 3)
    res["ms"][f"{key}_merge_torch"] = round(cuda_median_ms(
        lambda: merge_pieces_reference(out, None, parts, parts_lse, merge.out_rows, merge.out_counts), iters), 3)
    print(f"{key}: merge kernel {res['ms'][f'{key}_merge_kernel']} ms, in torch ops "
          f"{res['ms'][f'{key}_merge_torch']} ms; kernels {res['notes'][f'{key}_kernels_ms']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    def options(ap) -> None:
        ap.add_argument("--decode", action="store_true", help="also time decode (DECODE_WORKLOAD): eager, graph mode")
        ap.add_argument("--no-prefill", action="store_true", help="skip the prefill workload")

    args = gpu_bench_args(__doc__, list_modules, argv, options)
    if args is None:
        return 0
    res: dict = {**run_environment(), "workload": WORKLOAD, "ms": {}, "notes": {}}
    if args.decode:
        res["decode_workload"] = DECODE_WORKLOAD
    for backend in args.backends:
        for part, bench, on in (("prefill", bench_backend, not args.no_prefill), ("decode", bench_decode, args.decode)):
            if on:
                noted(res, f"{backend}_{part}", lambda bench=bench, backend=backend: bench(backend, args.iters, res))
    print(f"results: {write_result('pieces', res, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
