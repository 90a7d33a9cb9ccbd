"""H200 benchmark of issue 18's masks next to what FlashInfer offers for the same workloads.

* sinks (gpt-oss shape: 64/8 heads, head dim 64, 8 x 8192 prefill, and a 64 x 8192 decode):
  attention_sink_learned with window 128 (sliding layers) and global, fa2 and fa3, against
  FlashInfer's BatchAttentionWithAttentionSinkWrapper (its fa2 / fa3 sink variants), and the same
  128-key window without a sink (FlashInfer's plain prefill with window_left 127 and variantgen's
  sliding_window spec) to tell what the window costs from what the sink costs;
* tree (64 requests x 8192 context x 16-node draft trees, 32/8 heads, head dim 128): tree_verify
  against FlashInfer on the same query count - its causal prefill (the cost of verifying a chain),
  its custom-mask prefill (a packed tree mask: how engines verify trees with FlashInfer today) and
  one decode step of the batch (a single query per request);
* gemma4 (8 x 8192 tokens, three 1024-token images per request, 32/8 heads, head dim 256, window
  1024): gemma4_sliding against FlashInfer's sliding-window causal prefill (no image blocks).

Every kernel is timed in one process with CUDA events (median of --iters after warm-up); plan()
host times are recorded too. Writes bench/results/masks-<date>-<gpu>.json (or --out). Modules are
loaded from VARIANTGEN_CACHE_DIR (precompile: --list-modules prints the commands); FlashInfer
JIT-builds its own on first use. Run on the GPU machine:

    python bench/bench_masks.py --list-modules      # precompile commands (CPU box)
    python bench/bench_masks.py                     # every case
    python bench/bench_masks.py --cases tree --skip custom_mask
    python bench/bench_masks.py --cases sinks --sink-windows global --skip flashinfer_sink_fa3
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.testing.harness import (  # noqa: E402
    PREFILL_BENCH_SPANS,
    cuda_median_ms,
    random_paged_batch,
    result_file_name,
    run_environment,
    spans_to_ranges,
)
from variantgen.wrappers.trees import random_tree_parents, tree_bits  # noqa: E402

CASES = ("sinks", "tree", "gemma4")
PS = 16
SINKS = dict(batch=8, tokens=8192, decode_batch=64, qo_heads=64, kv_heads=8, head_dim=64, window=128)
TREE = dict(batch=64, context=8192, nodes=16, qo_heads=32, kv_heads=8, head_dim=128)
GEMMA4 = dict(batch=8, tokens=8192, spans=PREFILL_BENCH_SPANS, qo_heads=32, kv_heads=8, head_dim=256, window=1024)
MODULES = (  # (spec, head dim, backends, kinds) this script loads
    ("attention_sink_learned", 64, ("fa2", "fa3"), ("prefill",)),
    ("attention_sink_learned", 64, ("fa2",), ("decode",)),
    ("sliding_window", 64, ("fa2", "fa3"), ("prefill",)),
    ("tree_verify", 128, ("fa2", "fa3"), ("prefill",)),
    ("gemma4_sliding", 256, ("fa2", "fa3"), ("prefill",)),
)


class Bench:
    """The rows measured so far, written to ``out`` after each one (a run cut short keeps them)."""

    def __init__(self, iters: int, res: dict, out: Path):
        self.iters, self.res, self.out = iters, res, out
        self.ms, self.notes = res["ms"], res["notes"]

    def record(self, name: str, fn: Callable[[], object]) -> None:
        self.ms[name] = round(cuda_median_ms(fn, self.iters), 3)
        print(f"{name:52s} {self.ms[name]:8.3f} ms", flush=True)
        self.save()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.res, indent=1) + "\n")

    def plan_ms(self, name: str, plan: Callable[[], object], times: int = 5) -> None:
        """Median host time of plan() (it syncs at its end anyway: the segment read-back)."""
        samples = []
        for _ in range(times):
            torch.cuda.synchronize()
            t = time.perf_counter()
            plan()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t) * 1e3)
        self.notes[f"{name}_plan_ms"] = round(sorted(samples)[len(samples) // 2], 3)

    def compare(self, name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        a, b = ours.float(), theirs.float()
        self.notes[f"{name}_max_abs_diff"] = round((a - b).abs().max().item(), 5)
        self.notes[f"{name}_rel_error"] = round(((a - b).norm() / b.norm().clamp_min(1e-12)).item(), 6)


def paged(qo_lens, kv_lens, hq, hkv, d, seed):
    return random_paged_batch(qo_lens, kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=PS,
                              dtype=torch.bfloat16, device="cuda", seed=seed)


def ours(spec: str, ws, d: int, backend: str, bench: Bench, kind: str = "prefill"):
    t = time.perf_counter()
    w = variantgen.make_wrapper(ROOT / "specs" / f"{spec}.yaml", ws, head_dim_qk=d, q_dtype="bf16", kv_dtype="bf16",
                                backend=backend, kind=kind)
    bench.notes[f"variantgen_{spec}_{backend}_{kind}_make_wrapper_s"] = round(time.perf_counter() - t, 3)
    bench.notes[f"variantgen_{spec}_{backend}_{kind}_built_now"] = w.build.built
    return w


# ----------------------------------------------------------------------------- cases


def bench_sinks(bench: Bench, ws, skip: set[str], backends: list[str], windows: tuple[int, ...]) -> None:
    import flashinfer

    c = SINKS
    hq, hkv, d = c["qo_heads"], c["kv_heads"], c["head_dim"]
    b = paged([c["tokens"]] * c["batch"], [c["tokens"]] * c["batch"], hq, hkv, d, seed=1)
    db = paged([1] * c["decode_batch"], [c["tokens"]] * c["decode_batch"], hq, hkv, d, seed=2)
    kv, dkv = (b.k_cache, b.v_cache), (db.k_cache, db.v_cache)
    sinks = (torch.randn(hq, generator=torch.Generator().manual_seed(3)) * 2.0).cuda()
    dqo = torch.arange(c["decode_batch"] + 1, dtype=torch.int32, device="cuda")
    for window in windows:
        tag = f"w{window}" if window > 0 else "global"
        args = {"sinks": sinks, "window": window}
        window_left = window - 1 if window > 0 else -1
        theirs = {}
        for be in ("fa2", "fa3"):
            if f"flashinfer_{be}" in skip or f"flashinfer_sink_{be}" in skip:
                continue
            fw = flashinfer.BatchAttentionWithAttentionSinkWrapper(
                ws, "NHD", backend=be, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, head_dim_qk=d,
                head_dim_vo=d, window_left=window_left)
            t = time.perf_counter()
            fw.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, PS, causal=True,
                    window_left=window_left, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            theirs[be] = fw.run(b.q, kv, sinks, 1.0 / math.sqrt(d))
            torch.cuda.synchronize()
            bench.notes[f"flashinfer_sink_{be}_{tag}_first_call_s"] = round(time.perf_counter() - t, 1)
            bench.record(f"flashinfer_sink_{be}_{tag}", lambda fw=fw: fw.run(b.q, kv, sinks, 1.0 / math.sqrt(d)))
            if be == "fa2":  # decode: FlashInfer's sink wrapper with one query per request
                fw.plan(dqo, db.kv_indptr, db.kv_indices, db.last_page_len, hq, hkv, d, PS, causal=True,
                        window_left=window_left, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                theirs["decode"] = fw.run(db.q, dkv, sinks, 1.0 / math.sqrt(d))
                bench.record(f"flashinfer_sink_fa2_decode_{tag}", lambda fw=fw: fw.run(db.q, dkv, sinks,
                                                                                       1.0 / math.sqrt(d)))
        for be in backends:
            w = ours("attention_sink_learned", ws, d, be, bench)
            name = f"variantgen_sink_{be}_{tag}"
            bench.plan_ms(name, lambda w=w, a=args: w.plan(*b.plan_args(), **a))
            bench.notes[f"{name}_launches"] = w.plan_stats.get("launches")
            bench.record(name, lambda w=w, a=args: w.run(b.q, kv, **a))
            if be in theirs:
                bench.compare(f"{name}_vs_flashinfer", w.run(b.q, kv, **args), theirs[be])
        if window > 0:  # the same window without the sink: what the window launches cost alone
            for be in ("fa2", "fa3"):
                if f"flashinfer_{be}" in skip:
                    continue
                fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=be)
                fw.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, d, PS, causal=True,
                        window_left=window_left, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                bench.record(f"flashinfer_window_no_sink_{be}_{tag}", lambda fw=fw: fw.run(b.q, kv))
            for be in backends:
                w = ours("sliding_window", ws, d, be, bench)
                a = {"window": window_left}  # (sliding_window's window is FlashInfer's window_left)
                w.plan(*b.plan_args(), **a)
                bench.notes[f"variantgen_window_no_sink_{be}_{tag}_launches"] = w.plan_stats.get("launches")
                bench.record(f"variantgen_window_no_sink_{be}_{tag}", lambda w=w, a=a: w.run(b.q, kv, **a))
        if "fa2" in backends:
            w = ours("attention_sink_learned", ws, d, "fa2", bench, kind="decode")
            name = f"variantgen_sink_decode_{tag}"
            bench.plan_ms(name, lambda w=w, a=args: w.plan(db.kv_indptr, db.kv_indices, db.last_page_len, hq, hkv,
                                                           PS, **a))
            bench.record(name, lambda w=w, a=args: w.run(db.q, dkv, **a))
            if "decode" in theirs:
                bench.compare(f"{name}_vs_flashinfer", w.run(db.q, dkv, **args), theirs["decode"])


def bench_tree(bench: Bench, ws, skip: set[str], backends: list[str]) -> None:
    import flashinfer

    c = TREE
    n, ctx, nodes, hq, hkv, d = c["batch"], c["context"], c["nodes"], c["qo_heads"], c["kv_heads"], c["head_dim"]
    b = paged([nodes] * n, [ctx + nodes] * n, hq, hkv, d, seed=4)
    kv = (b.k_cache, b.v_cache)
    g = torch.Generator().manual_seed(5)
    parents = [random_tree_parents(nodes, g, "random") for _ in range(n)]
    bits = tree_bits(parents, device="cuda")
    bench.notes["tree_parents_first_request"] = parents[0]
    for be in ("fa2", "fa3"):  # FlashInfer's causal prefill of the same query count: a chain's cost
        if f"flashinfer_{be}" in skip:
            continue
        fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=be)
        fw.plan(*b.plan_args()[:6], d, PS, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        bench.record(f"flashinfer_causal_{be}_same_queries", lambda fw=fw: fw.run(b.q, kv))
    if "custom_mask" not in skip:  # FlashInfer's tree verification today: a dense custom mask (fa2)
        masks = []
        for par in parents:
            m = torch.zeros(nodes, ctx + nodes, dtype=torch.bool)
            m[:, :ctx] = True
            for i in range(nodes):
                j = i
                while j >= 0:
                    m[i, ctx + j] = True
                    j = par[j]
            masks.append(m.flatten())
        fm = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        fm.plan(*b.plan_args()[:6], d, PS, custom_mask=torch.cat(masks).cuda(), q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16)
        bench.record("flashinfer_custom_mask_fa2", lambda: fm.run(b.q, kv))
        tree_ref = fm.run(b.q, kv)
    else:
        tree_ref = None
    if "flashinfer_decode" not in skip:  # one decode step of the batch: the floor a verification compares with
        db = paged([1] * n, [ctx + nodes] * n, hq, hkv, d, seed=6)
        fd = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        fd.plan(db.kv_indptr, db.kv_indices, db.last_page_len, hq, hkv, d, PS, q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16)
        bench.record("flashinfer_decode_one_query", lambda: fd.run(db.q, (db.k_cache, db.v_cache)))
    args = {"tree_bits": bits}
    for be in backends:
        w = ours("tree_verify", ws, d, be, bench)
        name = f"variantgen_tree_verify_{be}"
        bench.plan_ms(name, lambda w=w: w.plan(*b.plan_args(), **args))
        bench.notes[f"{name}_launches"] = w.plan_stats.get("launches")
        bench.notes[f"{name}_segments"] = w.plan_stats.get("segments")
        bench.record(name, lambda w=w: w.run(b.q, kv, **args))
        if tree_ref is not None:
            bench.compare(f"{name}_vs_flashinfer_custom_mask", w.run(b.q, kv, **args), tree_ref)


def bench_gemma4(bench: Bench, ws, skip: set[str], backends: list[str]) -> None:
    import flashinfer

    c = GEMMA4
    n, length, hq, hkv, d, window = c["batch"], c["tokens"], c["qo_heads"], c["kv_heads"], c["head_dim"], c["window"]
    b = paged([length] * n, [length] * n, hq, hkv, d, seed=7)
    kv = (b.k_cache, b.v_cache)
    ranges = spans_to_ranges(b.qo_lens, b.kv_lens, [c["spans"]] * n).cuda()
    for be in ("fa2", "fa3"):  # sliding-window causal, without the image blocks
        if f"flashinfer_{be}" in skip:
            continue
        fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=be)
        fw.plan(*b.plan_args()[:6], d, PS, causal=True, window_left=window - 1, q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16)
        bench.record(f"flashinfer_sliding_window_{be}", lambda fw=fw: fw.run(b.q, kv))
    args = {"ranges": ranges, "window": window}
    for be in backends:
        w = ours("gemma4_sliding", ws, d, be, bench)
        name = f"variantgen_gemma4_sliding_{be}"
        bench.plan_ms(name, lambda w=w: w.plan(*b.plan_args(), **args))
        bench.notes[f"{name}_segments"] = w.plan_stats.get("segments")
        bench.record(name, lambda w=w: w.run(b.q, kv, **args))


def list_modules() -> str:
    lines = []
    for spec, d, backends, kinds in MODULES:
        for be in backends:
            for kind in kinds:
                lines.append(f"python -m variantgen precompile specs/{spec}.yaml --head-dim {d} --dtype bf16 "
                             f"--backend {be} --kind {kind} --arch 9.0a -j 8")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--backends", default="fa2,fa3", help="variantgen backends to measure")
    ap.add_argument("--skip", default="", help="comma list of FlashInfer rows to skip: flashinfer_fa2, "
                    "flashinfer_fa3, flashinfer_sink_fa2, flashinfer_sink_fa3 (the sink wrapper only), "
                    "custom_mask, flashinfer_decode")
    ap.add_argument("--sink-windows", default=f"{SINKS['window']},global",
                    help=f"the sinks case's layers: comma list of window widths and `global` "
                         f"(default {SINKS['window']},global)")
    ap.add_argument("--list-modules", action="store_true", help="print the precompile commands and exit")
    args = ap.parse_args(argv)
    if args.list_modules:
        print(list_modules())
        return 0
    wanted = [c for c in args.cases.split(",") if c]
    if set(wanted) - set(CASES):
        ap.error(f"--cases: unknown {sorted(set(wanted) - set(CASES))}; expected some of {', '.join(CASES)}")
    try:
        windows = tuple(-1 if w == "global" else int(w) for w in filter(None, args.sink_windows.split(",")))
    except ValueError:
        ap.error(f"--sink-windows={args.sink_windows!r}: expected a comma list of positive integers and `global`")
    if not windows or any(w == 0 or w < -1 for w in windows):
        ap.error(f"--sink-windows={args.sink_windows!r}: a window width is a positive integer (or `global`)")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the H200); --list-modules works anywhere")
    skip = set(filter(None, args.skip.split(",")))
    backends = [b for b in args.backends.split(",") if b]
    res: dict = {**run_environment(), "workloads": {"sinks": SINKS, "tree": TREE, "gemma4": GEMMA4, "page_size": PS},
                 "ms": {}, "notes": {}}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / result_file_name("masks", res)
    bench = Bench(args.iters, res, out)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    runners = {"sinks": lambda *a: bench_sinks(*a, windows=windows), "tree": bench_tree, "gemma4": bench_gemma4}
    for case in wanted:
        try:
            runners[case](bench, ws, skip, backends)
        except Exception as e:  # report, do not hide: the case's remaining rows are missing
            res["notes"][f"{case}_error"] = f"{type(e).__name__}: {str(e)[:600]}"
            print(f"{case}: {res['notes'][f'{case}_error']}", flush=True)
    bench.save()
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
