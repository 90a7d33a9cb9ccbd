"""Decode benchmark: variantgen decode modules next to FlashInfer's built-in decode.

64 requests x 8192 cached tokens, one query each, 32/8 heads, head dim 128, bf16, paged KV
(page 16). FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (plain; window_left=1023;
logits_soft_cap=50; tensor cores) against variantgen decode for causal, sliding_window
(window 1023), softcap (cap 50, global layer), document (8 documents of 1024 tokens per
request) and mm_prefix (three 1024-token image spans; the decoded token is text), on fa2's
CUDA-core decode module, fa2's tensor-core (prefill module) path and fa3 (sm90: its prefill
module, one query per request, GQA-packed: a key/value head's query heads as rows of one
tile; a `_unpacked` row with packing off), each with key trimming (spec arguments given to
plan(); the default) and without (plan(skip_tiles=False)). FlashInfer's tensor-core decode runs on its fa2
and (sm90) fa3 prefill kernels.

Every module (ours and FlashInfer's JIT ones) is built first, several at a time; then every
kernel is timed in the same process with CUDA events (median of --iters runs after warm-up).
plan() host time: ``<row>_plan_ms`` is the first plan (cold: torch's kernels load on first use),
``<row>_plan_ms_median`` the median of 20 plans after it, what a serving engine pays per step.
A tensor-core row's ``_exact_runs_on_masked_variant`` twin runs the same plan with its exact
causal launches on the kernel units that have the spec's mask compiled in (evaluated on no
tile: what compiling it in costs); so does a CUDA-core row's whose plan picked the kernels
without it (run_exact). A CUDA-core row's ``_mask_evaluated_on_known_keys`` twin also clears the
keys key trimming proved visible, so the mask is evaluated on every key: the same-process cost
of that evaluation.
Writes bench/results/decode-<date>-<gpu>.json (or --out; also into $OUT when set).
Run on the GPU machine:  python bench/bench_decode.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.abi.table import MetaColumn  # noqa: E402
from variantgen.testing.harness import cuda_median_ms, mask_exact_launches, run_environment, write_result  # noqa: E402

B, L, HQ, HKV, D, PS = 64, 8192, 32, 8, 128, 16
WINDOW, SOFT_CAP, DOC_LEN = 1023, 50.0, 1024
SPANS = [(1024 + 2048 * i, 1024 + 2048 * i + 1023) for i in range(3)]
SPECS = ("causal", "sliding_window", "softcap", "document", "mm_prefix")
# FlashInfer rows: name -> (wrapper kwargs, plan kwargs), and the variantgen spec each one matches.
FLASHINFER = {
    "flashinfer_plain_cuda_cores": ({}, {}),
    "flashinfer_plain_tensor_cores": ({"use_tensor_cores": True, "backend": "fa2"}, {}),
    "flashinfer_plain_tensor_cores_fa3": ({"use_tensor_cores": True, "backend": "fa3"}, {}),
    "flashinfer_window1023_cuda_cores": ({}, {"window_left": WINDOW}),
    "flashinfer_softcap50_cuda_cores": ({}, {"logits_soft_cap": SOFT_CAP}),
}
MATCHES = {"causal": "flashinfer_plain_cuda_cores", "sliding_window": "flashinfer_window1023_cuda_cores",
           "softcap": "flashinfer_softcap50_cuda_cores"}


def decode_batch(dev: str) -> dict:
    """The workload, generated on the device (a host-side randn of 2 GiB of KV takes too long)."""
    g = torch.Generator(device=dev).manual_seed(2)
    pages = L // PS
    total = B * pages
    kw = dict(device=dev, dtype=torch.bfloat16, generator=g)
    return {
        "q": torch.randn(B, HQ, D, **kw),
        "k": torch.randn(total, PS, HKV, D, **kw),
        "v": torch.randn(total, PS, HKV, D, **kw),
        "kv_indptr": (torch.arange(B + 1, device=dev, dtype=torch.int32) * pages),
        "kv_indices": torch.randperm(total, device=dev, generator=g).to(torch.int32),
        "last_page_len": torch.full((B,), PS, device=dev, dtype=torch.int32),
    }


def spec_args(name: str, dev: str) -> dict:
    if name == "sliding_window":
        return {"window": WINDOW}
    if name == "softcap":
        return {"soft_cap": SOFT_CAP, "window": -1}
    if name == "document":
        return {"doc_ids": (torch.arange(L, device=dev, dtype=torch.int32) // DOC_LEN).repeat(B).contiguous()}
    if name == "mm_prefix":  # the decoded token (position L - 1) lies in no span
        in_span = [s for s in SPANS if s[0] <= L - 1 <= s[1]]
        row = list(in_span[0]) if in_span else [-1, -1]
        return {"ranges": torch.tensor([row] * B, device=dev, dtype=torch.int32)}
    return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--parallel", type=int, default=None, help="modules built at once (default: cores / 3, <= 8)")
    ap.add_argument("--skip", default="", help="comma list: flashinfer, cuda_cores, tensor_cores, fa3, untrimmed, "
                                                "graph, or a FlashInfer row's name")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.perf_counter()
    cores = os.cpu_count() or 8
    parallel = args.parallel or max(2, min(8, cores // 3))
    per_build = max(2, cores // parallel)
    os.environ.setdefault("MAX_JOBS", str(per_build))  # FlashInfer's JIT ninja
    import flashinfer

    from variantgen.api.factory import device_arch
    from variantgen.build.builder import build_module, default_cache
    from variantgen.codegen.render import DEFAULT_MASK_MODES, ModuleConfig

    dev = "cuda"
    res: dict = {
        **run_environment(),
        "workload": dict(batch=B, kv_len=L, qo_heads=HQ, kv_heads=HKV, head_dim=D, page_size=PS, dtype="bf16",
                         window=WINDOW, soft_cap=SOFT_CAP, doc_len=DOC_LEN, spans=SPANS),
        "ms": {},
        "notes": {},
        "errors": {},
    }
    ms, notes, errors = res["ms"], res["notes"], res["errors"]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    batch = decode_batch(dev)
    kv = (batch["k"], batch["v"])
    plan_pos = (batch["kv_indptr"], batch["kv_indices"], batch["last_page_len"])
    torch.cuda.synchronize()

    # ---------------------------------------------------------------- build everything, several at once
    arch = device_arch(torch.device(dev))
    # path -> (backend, module kind): fa2 CUDA cores, fa2 tensor cores, fa3 (sm90 only)
    routes = {"cuda_cores": ("fa2", "decode"), "tensor_cores": ("fa2", "prefill"), "fa3": ("fa3", "prefill")}
    paths = [p for p in routes if p not in skip and (p != "fa3" or arch.startswith("9."))]
    configs = [ModuleConfig(variantgen.load_spec(ROOT / "specs" / f"{n}.yaml"), D, D, "bf16", "bf16", "bf16", arch,
                            routes[p][0], DEFAULT_MASK_MODES, routes[p][1])
               for n in SPECS for p in paths]
    fi_wrappers: dict = {}

    def build_vg(cfg):
        r = build_module(cfg, default_cache(), jobs=per_build)
        return f"{cfg.spec.name}_{cfg.backend}_{cfg.kind}", r.seconds, r.built

    def build_fi(name):  # FlashInfer compiles its JIT module inside plan()
        wkw, pkw = FLASHINFER[name]
        t = time.perf_counter()
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev),
                                                          "NHD", **wkw)
        w.plan(*plan_pos, HQ, HKV, D, PS, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **pkw)
        fi_wrappers[name] = w
        return name, time.perf_counter() - t, True

    fi_names = [] if "flashinfer" in skip else [n for n in FLASHINFER
                                                 if (not n.endswith("_fa3") or "fa3" in paths) and n not in skip]
    t = time.perf_counter()
    builds = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(build_fi, n): n for n in fi_names}
        futures.update({pool.submit(build_vg, c): f"{c.spec.name}_{c.backend}_{c.kind}" for c in configs})
        for fut in concurrent.futures.as_completed(futures):
            try:
                name, seconds, built = fut.result()
                builds[name] = {"s": round(seconds, 1), "built": built}
                print(f"ready {name:45s} {seconds:6.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - record it; the row is retried or missing
                errors[f"build_{futures[fut]}"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"FAILED {futures[fut]}: {e}", flush=True)
    notes["builds"] = builds
    notes["build_wall_s"] = round(time.perf_counter() - t, 1)
    notes["parallel_builds"], notes["jobs_per_build"] = parallel, per_build
    for name in fi_names:  # a concurrent JIT build that failed: once more, alone
        if name not in fi_wrappers:
            try:
                build_fi(name)
                errors.pop(f"build_{name}", None)
            except Exception as e:  # noqa: BLE001
                errors[f"build_{name}"] = f"{type(e).__name__}: {str(e)[:500]}"

    def record(name, fn):
        try:
            ms[name] = round(cuda_median_ms(fn, args.iters), 4)
            print(f"{name:50s} {ms[name]:8.4f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e)[:500]}"
            traceback.print_exc()

    def plan_median_ms(plan, plans=20):
        """plan() host time once warm (what a serving engine pays every decode step): the
        median of ``plans`` calls of ``plan``, each timed to its return, then synchronized."""
        times = []
        for _ in range(plans):
            t = time.perf_counter()
            plan()
            times.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        return round(sorted(times)[plans // 2] * 1e3, 3)

    # ---------------------------------------------------------------- FlashInfer
    fi_out = {}
    for name in fi_names:
        w = fi_wrappers.get(name)
        if w is None:
            continue
        wkw, pkw = FLASHINFER[name]
        torch.cuda.synchronize()
        t = time.perf_counter()
        w.plan(*plan_pos, HQ, HKV, D, PS, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **pkw)
        torch.cuda.synchronize()
        notes[f"{name}_plan_ms"] = round((time.perf_counter() - t) * 1e3, 3)
        notes[f"{name}_plan_ms_median"] = plan_median_ms(lambda w=w, pkw=pkw: w.plan(
            *plan_pos, HQ, HKV, D, PS, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **pkw))
        record(name, lambda w=w: w.run(batch["q"], kv))
        fi_out[name] = w.run(batch["q"], kv).float()

    # ---------------------------------------------------------------- variantgen
    def exact_runs_masked(w, name, run_args):
        """Same-process A/B on fa2's tensor-core path: the plan's exact causal launches on the
        units with the spec's mask compiled in (testing.mask_exact_launches) instead of the
        units without it."""
        good = w.run(batch["q"], kv, **run_args).float()
        if not mask_exact_launches(w.last_plan):
            return
        record(f"{name}_exact_runs_on_masked_variant", lambda: w.run(batch["q"], kv, **run_args))
        notes[f"{name}_exact_runs_on_masked_variant_max_abs_diff"] = (
            w.run(batch["q"], kv, **run_args).float() - good).abs().max().item()
        w.plan(*plan_pos, HQ, HKV, PS, **run_args)  # (the plan as planned again)

    def mask_on_known_keys(w, name, run_args):
        """The same on the CUDA-core path: a plan that picked the kernels without the spec's mask
        (run_exact) on the ones with it (evaluated on no key: what compiling it in costs); then
        its one launch's known-visible keys (key trimming's dense run) cleared, so the variant
        evaluates the spec's mask on every key it visits."""
        good = w.run(batch["q"], kv, **run_args).float()
        la = w._launch  # (the plan's own launch: a benchmark's experiment)
        if la.exact:
            la.exact = False  # (from here on the masked kernels, for the row below too)
            record(f"{name}_exact_runs_on_masked_variant", lambda: w.run(batch["q"], kv, **run_args))
            notes[f"{name}_exact_runs_on_masked_variant_max_abs_diff"] = (
                w.run(batch["q"], kv, **run_args).float() - good).abs().max().item()
        la.meta[:, MetaColumn.VIS_HI] = -1
        record(f"{name}_mask_evaluated_on_known_keys", lambda: w.run(batch["q"], kv, **run_args))
        notes[f"{name}_mask_evaluated_on_known_keys_max_abs_diff"] = (
            w.run(batch["q"], kv, **run_args).float() - good).abs().max().item()
        w.plan(*plan_pos, HQ, HKV, PS, **run_args)

    for spec_name in SPECS:
        run_args = spec_args(spec_name, dev)
        for path in paths:
            tag = f"variantgen_{spec_name}_{path}"
            try:
                w = variantgen.make_wrapper(ROOT / "specs" / f"{spec_name}.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                            kv_dtype="bf16", kind="decode", backend=routes[path][0],
                                            use_tensor_cores=path == "tensor_cores")
            except Exception as e:  # noqa: BLE001
                errors[tag] = f"{type(e).__name__}: {str(e)[:500]}"
                continue
            # (row suffix, key trimming, GQA packing): fa3 also runs with packing off, for comparison
            variants = [("", True, True), ("_untrimmed", False, True)] + ([("_unpacked", True, False)]
                                                                          if path == "fa3" else [])
            for suffix, trimmed, packed in variants:
                name = tag + suffix
                if w.planner is not None:
                    w.planner.pack_gqa_enabled = packed
                plan_kw = dict(run_args) if trimmed else {"skip_tiles": False}
                try:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    w.plan(*plan_pos, HQ, HKV, PS, **plan_kw)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    errors[name] = f"plan: {type(e).__name__}: {str(e)[:500]}"
                    continue
                notes[f"{name}_plan_ms"] = round((time.perf_counter() - t) * 1e3, 3)  # the first plan
                notes[f"{name}_plan_ms_median"] = plan_median_ms(
                    lambda w=w, kw=plan_kw: w.plan(*plan_pos, HQ, HKV, PS, **kw))
                stats = {k: v for k, v in w.plan_stats.items()
                         if k in ("pages", "launches", "planner_off", "pack_gqa", "variant", "intervals")}
                notes[f"{name}_plan_stats"] = json.loads(json.dumps(stats, default=str))
                if not trimmed and "untrimmed" in skip:
                    continue
                record(name, lambda w=w, a=run_args: w.run(batch["q"], kv, **a))
                if path == "tensor_cores" and trimmed:
                    exact_runs_masked(w, name, run_args)
                if path == "cuda_cores" and trimmed:
                    mask_on_known_keys(w, name, run_args)
                match = MATCHES.get(spec_name)
                if match in fi_out:
                    o = w.run(batch["q"], kv, **run_args).float()
                    notes[f"{name}_vs_{match}_max_abs"] = (o - fi_out[match]).abs().max().item()

    # ---------------------------------------------------------------- fa3 CUDA-graph replay (GQA-packed)
    if "fa3" in paths and "graph" not in skip:
        for spec_name in ("causal", "mm_prefix"):
            name = f"variantgen_{spec_name}_fa3_graph_replay"
            try:
                cap = variantgen.GraphCapacity(max_batch_size=B, max_total_q=B, max_kv_pages=B * (L // PS),
                                               max_qo_len=1)
                w = variantgen.make_wrapper(ROOT / "specs" / f"{spec_name}.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                            kv_dtype="bf16", kind="decode", backend="fa3", graph=cap)
                run_args = spec_args(spec_name, dev)
                w.plan(*plan_pos, HQ, HKV, PS, **run_args)
                notes[f"{name}_plan_stats"] = json.loads(json.dumps(
                    {k: v for k, v in w.plan_stats.items() if k in ("launches", "pack_gqa")}, default=str))
                out = torch.empty_like(batch["q"])
                w.run(batch["q"], kv, out=out, **run_args)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    w.run(batch["q"], kv, out=out, **run_args)
                record(name, graph.replay)
                eager = w.run(batch["q"], kv, **run_args)
                graph.replay()
                torch.cuda.synchronize()
                notes[f"{name}_vs_eager_max_abs"] = (out.float() - eager.float()).abs().max().item()
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {str(e)[:500]}"
                traceback.print_exc()

    # ---------------------------------------------------------------- summary
    def ratio(a, b):
        return round(ms[a] / ms[b], 3) if a in ms and b in ms else None

    res["ratios"] = {
        f"variantgen_{s}_{p}{u}_vs_{m}": ratio(f"variantgen_{s}_{p}{u}", m)
        for s, m in MATCHES.items() for p in paths for u in ("", "_untrimmed", "_unpacked")
        if f"variantgen_{s}_{p}{u}" in ms
    }
    res["ratios"].update({
        f"variantgen_{s}_{p}_vs_flashinfer_plain_cuda_cores": ratio(f"variantgen_{s}_{p}",
                                                                    "flashinfer_plain_cuda_cores")
        for s in ("document", "mm_prefix") for p in paths
    })
    res["ratios"].update({f"variantgen_{s}_fa3_graph_replay_vs_eager": ratio(f"variantgen_{s}_fa3_graph_replay",
                                                                             f"variantgen_{s}_fa3")
                          for s in ("causal", "mm_prefix") if f"variantgen_{s}_fa3_graph_replay" in ms})
    fastest = min((n for n in fi_names if n.startswith("flashinfer_plain") and n in ms), key=ms.get, default=None)
    if fastest is not None:  # issue 17's decode goal: causal on each path vs FlashInfer's fastest plain decode
        notes["flashinfer_fastest_plain"] = fastest
        res["ratios"].update({f"variantgen_causal_{p}_vs_flashinfer_fastest_plain": ratio(f"variantgen_causal_{p}",
                                                                                           fastest) for p in paths})
    res["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(res["ratios"], indent=1))
    if errors:
        print("errors:", json.dumps(errors, indent=1))
    out = write_result("decode", res, args.out)
    print(f"wrote {out} ({res['total_s']} s)")


if __name__ == "__main__":
    main()
