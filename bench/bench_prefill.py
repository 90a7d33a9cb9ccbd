"""Prefill benchmark on the DESIGN.md workload: variantgen kernels next to FlashInfer's.

8 requests x 8192 tokens, 32/8 heads, head dim 128, bf16, paged KV (page 16), three
1024-token image spans per request. Every kernel is timed in the same process with CUDA
events (median of --iters runs after warm-up). Experiments (``experiments_ms``): split-KV and
PDL on the causal rows, and each fa2 planned row again with its exact causal launches on the
units that have the spec's mask compiled in (``_exact_runs_on_masked_variant``, evaluated on no
tile: the difference is what compiling the mask into the kernel costs). ``vs_best``: each shipped
mask's variantgen row over the faster of FlashInfer's built-in kernels for that mask and
FlexAttention (torch.compile, contiguous KV) - issue 17's yardstick. Writes
bench/results/prefill-<date>-<gpu>.json (or --out). Run on the GPU machine:  python bench/bench_prefill.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.testing.harness import (  # noqa: E402
    PREFILL_BENCH_SHAPE,
    PREFILL_BENCH_SPANS,
    alibi_slopes,
    cuda_median_ms,
    mask_exact_launches,
    prefill_bench_batch,
    result_file_name,
    run_environment,
)

B, L, HQ, HKV, D, PS = PREFILL_BENCH_SHAPE
SPANS = PREFILL_BENCH_SPANS
CASES = ("causal", "mm_prefix", "sliding_window", "document", "prefix_lm", "softcap", "alibi", "chunked_local",
         "streaming_sink")  # variantgen rows
# FlashInfer's built-in kernels for the same mask, per case (its fa2 and fa3 rows); the cases not
# named have none (FlashInfer's ALiBi is an fa2 positional encoding not timed here).
SAME_MASK_FLASHINFER = {"causal": "flashinfer_causal", "sliding_window": "flashinfer_sliding_window",
                        "softcap": "flashinfer_softcap"}
CHUNK, NUM_SINK, SINK_WINDOW = 2048, 4, 1023  # chunked_local's chunk_size; streaming_sink's scalars


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma list of rows to skip (fa2, fa3, flashinfer_mm_prefix, flex, "
                    "experiments)")
    ap.add_argument("--backends", default="fa2,fa3", help="variantgen backends to measure")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="specs to measure (FlashInfer's window / softcap rows come with sliding_window / softcap); "
                         "e.g. --cases causal,mm_prefix,softcap --skip flashinfer_mm_prefix,flex,experiments is the "
                         "short form that fits a few device minutes")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    wanted = set(filter(None, args.cases.split(",")))
    if wanted - set(CASES):
        ap.error(f"--cases: unknown {sorted(wanted - set(CASES))}; expected some of {', '.join(CASES)}")
    import flashinfer

    dev = "cuda"
    res: dict = {
        **run_environment(),
        "workload": dict(batch=B, tokens=L, qo_heads=HQ, kv_heads=HKV, head_dim=D, page_size=PS,
                         spans=SPANS, dtype="bf16"),
        "ms": {},
        "notes": {},
    }
    batch, ranges = prefill_bench_batch(dev)
    kv = (batch.k_cache, batch.v_cache)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ms = res["ms"]

    def record(name, fn):
        ms[name] = round(cuda_median_ms(fn, args.iters), 3)
        print(f"{name:40s} {ms[name]:8.3f} ms", flush=True)

    # FlashInfer built-in kernels (their JIT modules compile on first use here).
    for be in ("fa2", "fa3"):
        if be in skip:
            continue
        t = time.perf_counter()
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=be)
        w.plan(*batch.plan_args()[:6], D, PS, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        w.run(batch.q, kv)
        torch.cuda.synchronize()
        res["notes"][f"flashinfer_{be}_first_call_s"] = round(time.perf_counter() - t, 1)
        record(f"flashinfer_causal_{be}", lambda w=w: w.run(batch.q, kv))
        w.plan(*batch.plan_args()[:6], D, PS, causal=False, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        record(f"flashinfer_full_{be}", lambda w=w: w.run(batch.q, kv))
    ref_out = None
    if "flashinfer_mm_prefix" not in skip:
        fw = flashinfer.BatchPrefillWithCausalBidirectionalRangesWrapper(
            ws, "NHD", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, head_dim_qk=D, head_dim_vo=D)
        fw.plan(*batch.plan_args()[:6], D, PS)
        record("flashinfer_mm_prefix_wrapper", lambda: fw.run(batch.q, kv, ranges))
        ref_out = fw.run(batch.q, kv, ranges).float()

    # Sliding window (w = 1024) and soft-cap 50 on FlashInfer's built-in kernels.
    w_left, cap = 1024, 50.0
    ref_win = ref_cap = None
    for be in ("fa2", "fa3"):
        if be in skip:
            continue
        if "sliding_window" in wanted:
            fwin = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=be)
            fwin.plan(*batch.plan_args()[:6], D, PS, causal=True, window_left=w_left, q_data_type=torch.bfloat16,
                      kv_data_type=torch.bfloat16)
            record(f"flashinfer_sliding_window_{be}", lambda fwin=fwin: fwin.run(batch.q, kv))
            ref_win = fwin.run(batch.q, kv).float()
        if "softcap" in wanted:
            fcap = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=be)
            fcap.plan(*batch.plan_args()[:6], D, PS, causal=True, logits_soft_cap=cap, q_data_type=torch.bfloat16,
                      kv_data_type=torch.bfloat16)
            record(f"flashinfer_softcap_{be}", lambda fcap=fcap: fcap.run(batch.q, kv))
            ref_cap = fcap.run(batch.q, kv).float()  # the same math: checks the folded transform's output

    # variantgen kernels, per backend: module load from the cache, then plan + run. fa2 rows
    # keep their names (variantgen_<spec>_<mode>); fa3 rows are variantgen_fa3_<spec>_<mode>.
    doc_len = L // 8
    doc_ids = (torch.arange(L, device=dev, dtype=torch.int32) // doc_len).repeat(B).contiguous()
    slopes = alibi_slopes(HQ).to(dev)
    prefix = torch.full((B,), 2048, dtype=torch.int32, device=dev)
    cases = (
        ("causal", {}, (False, True)),
        ("mm_prefix", {"ranges": ranges}, (False, True)),
        ("sliding_window", {"window": w_left}, (True,)),
        ("document", {"doc_ids": doc_ids}, (True,)),
        ("prefix_lm", {"prefix_len": prefix}, (True,)),
        ("softcap", {"soft_cap": cap, "window": -1}, (False, True)),
        ("alibi", {"slopes": slopes}, (False, True)),
        ("chunked_local", {"chunk_size": CHUNK}, (True,)),
        ("streaming_sink", {"num_sink": NUM_SINK, "window": SINK_WINDOW}, (True,)),
    )
    planned_mm_prefix = {}  # backend -> output, to compare the backends
    exp = res.setdefault("experiments_ms", {})

    def exact_runs_masked(w, tag, spec_args, o):
        """Same-process A/B: the plan's exact causal launches on the units with the spec's mask
        compiled in (testing.mask_exact_launches) instead of the units without it."""
        if not mask_exact_launches(w.last_plan):
            return
        exp[f"{tag}_exact_runs_on_masked_variant"] = round(
            cuda_median_ms(lambda: w.run(batch.q, kv, **spec_args), args.iters), 3)
        res["notes"][f"{tag}_exact_runs_on_masked_variant_max_abs_diff"] = (
            w.run(batch.q, kv, **spec_args).float() - o).abs().max().item()
        w.plan(*batch.plan_args(), skip_tiles=True, **spec_args)  # (the plan as planned again)

    for backend in args.backends.split(","):
        for name, spec_args, modes in cases:
            if name not in wanted:
                continue
            head = "variantgen_" + ("" if backend == "fa2" else f"{backend}_") + name
            t = time.perf_counter()
            try:
                w = variantgen.make_wrapper(ROOT / "specs" / f"{name}.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                            kv_dtype="bf16", backend=backend)
            except Exception as e:  # report, do not hide: the rows are simply missing
                res["notes"][f"{head}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                continue
            res["notes"][f"{head}_make_wrapper_s"] = round(time.perf_counter() - t, 3)
            res["notes"][f"{head}_module_built_now"] = w.build.built
            for skip_tiles in modes:
                tag = head + ("_planned" if skip_tiles else "_direct")
                plan_kw = {"skip_tiles": skip_tiles, **(spec_args if skip_tiles else {})}
                torch.cuda.synchronize()
                t = time.perf_counter()
                w.plan(*batch.plan_args(), **plan_kw)
                torch.cuda.synchronize()
                res["notes"][f"{tag}_plan_ms"] = round((time.perf_counter() - t) * 1e3, 3)
                res["notes"][f"{tag}_launches"] = w.plan_stats.get("launches")
                if w.plan_stats.get("segments"):
                    res["notes"][f"{tag}_segments"] = w.plan_stats["segments"]
                record(tag, lambda w=w, a=spec_args: w.run(batch.q, kv, **a))
                o = w.run(batch.q, kv, **spec_args).float()
                if name == "mm_prefix" and ref_out is not None:
                    res["notes"][f"{tag}_vs_flashinfer_max_abs"] = (o - ref_out).abs().max().item()
                if name == "mm_prefix" and skip_tiles:
                    planned_mm_prefix[backend] = o
                if name == "softcap" and ref_cap is not None:
                    res["notes"][f"{tag}_vs_flashinfer_max_abs"] = (o - ref_cap).abs().max().item()
                if name == "sliding_window" and ref_win is not None:
                    res["notes"][f"{tag}_vs_flashinfer_max_abs"] = (o - ref_win).abs().max().item()
                if backend == "fa2" and skip_tiles and "experiments" not in skip:
                    exact_runs_masked(w, tag, spec_args, o)


    if len(planned_mm_prefix) == 2:
        a, b = planned_mm_prefix["fa3"], planned_mm_prefix["fa2"]
        res["notes"]["fa3_vs_fa2_mm_prefix_planned_rel_error"] = ((a - b).norm() / b.norm()).item()

    # Why does the planned causal launch trail FlashInfer's? Same kernel family; the knobs that
    # differ are split-KV and programmatic dependent launch (PDL). Time each.
    if "fa2" not in skip and "experiments" not in skip:
        fe = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        for split in (False, True):
            fe.plan(*batch.plan_args()[:6], D, PS, causal=True, q_data_type=torch.bfloat16,
                    kv_data_type=torch.bfloat16, disable_split_kv=split)
            for pdl in (False, True):
                exp[f"flashinfer_fa2_causal_disable_split_{split}_pdl_{pdl}"] = round(
                    cuda_median_ms(lambda pdl=pdl: fe.run(batch.q, kv, enable_pdl=pdl), args.iters), 3)
    if "experiments" not in skip:
        wc = variantgen.make_wrapper(ROOT / "specs" / "causal.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                     kv_dtype="bf16", backend="fa2")
        for split in (False, True):
            wc.plan(*batch.plan_args(), skip_tiles=True, disable_split_kv=split)
            for pdl in (False, True):
                exp[f"variantgen_causal_planned_disable_split_{split}_pdl_{pdl}"] = round(
                    cuda_median_ms(lambda pdl=pdl: wc.run(batch.q, kv, enable_pdl=pdl), args.iters), 3)
        print(json.dumps(exp, indent=1), flush=True)

    # FlexAttention (torch.compile, BlockMask) on the same masks, contiguous KV (Flex has no paged KV).
    if "flex" not in skip:
        try:
            qd = batch.q.view(B, L, HQ, D).transpose(1, 2).contiguous()
            pg = batch.kv_indices.long().view(B, -1)
            kd = batch.k_cache[pg].reshape(B, L, HKV, D).transpose(1, 2).contiguous()
            vd = batch.v_cache[pg].reshape(B, L, HKV, D).transpose(1, 2).contiguous()
            rg = ranges.view(B, L, 2)
            dg = doc_ids.view(B, L)

            def mm_mask(b, h, qi, ki):
                return (ki <= qi) | ((ki >= rg[b, qi, 0]) & (ki <= rg[b, qi, 1]))

            def sw_mask(b, h, qi, ki):
                return (ki <= qi) & (qi - ki <= w_left)

            def doc_mask(b, h, qi, ki):
                return (ki <= qi) & (dg[b, qi] == dg[b, ki])

            def plm_mask(b, h, qi, ki):
                return ki <= torch.maximum(qi, prefix[b] - 1)

            def causal_mask(b, h, qi, ki):
                return ki <= qi

            def chunk_mask(b, h, qi, ki):
                return (ki <= qi) & (ki // CHUNK == qi // CHUNK)

            def sink_mask(b, h, qi, ki):
                return (ki <= qi) & ((ki < NUM_SINK) | (qi - ki <= SINK_WINDOW))

            def softcap_score(score, b, h, qi, ki):
                return cap * torch.tanh(score / cap)

            def alibi_score(score, b, h, qi, ki):
                return score + slopes[h] * (ki - qi)

            masks = (("mm_prefix", mm_mask, None), ("sliding_window", sw_mask, None), ("document", doc_mask, None),
                     ("prefix_lm", plm_mask, None), ("causal", causal_mask, None),
                     ("softcap", causal_mask, softcap_score), ("alibi", causal_mask, alibi_score),
                     ("chunked_local", chunk_mask, None), ("streaming_sink", sink_mask, None))
            flex_rows([m for m in masks if m[0] in wanted], qd, kd, vd, record, res["notes"])
        except Exception as e:  # report, do not hide: the Flex rows are missing
            res["notes"]["flex_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    # Ratios the issues state targets for.
    def ratio(a, b):
        return round(ms[a] / ms[b], 3) if a in ms and b in ms else None

    res["ratios"] = {
        "causal_direct_vs_flashinfer_fa2_causal": ratio("variantgen_causal_direct", "flashinfer_causal_fa2"),
        "mm_prefix_direct_vs_flashinfer_mm_prefix": ratio("variantgen_mm_prefix_direct",
                                                          "flashinfer_mm_prefix_wrapper"),
        "mm_prefix_planned_vs_flashinfer_fa2_causal": ratio("variantgen_mm_prefix_planned", "flashinfer_causal_fa2"),
        "mm_prefix_planned_vs_flashinfer_fa3_causal": ratio("variantgen_mm_prefix_planned", "flashinfer_causal_fa3"),
        "mm_prefix_planned_vs_flashinfer_mm_prefix": ratio("variantgen_mm_prefix_planned",
                                                           "flashinfer_mm_prefix_wrapper"),
        "causal_planned_vs_flashinfer_fa2_causal": ratio("variantgen_causal_planned", "flashinfer_causal_fa2"),
        "sliding_window_planned_vs_flashinfer_fa2": ratio("variantgen_sliding_window_planned",
                                                          "flashinfer_sliding_window_fa2"),
        "fa3_mm_prefix_planned_vs_flashinfer_fa3_causal": ratio("variantgen_fa3_mm_prefix_planned",
                                                                "flashinfer_causal_fa3"),
        "fa3_mm_prefix_planned_vs_flashinfer_fa2_causal": ratio("variantgen_fa3_mm_prefix_planned",
                                                                "flashinfer_causal_fa2"),
        "fa3_mm_prefix_planned_vs_fa2_mm_prefix_planned": ratio("variantgen_fa3_mm_prefix_planned",
                                                                "variantgen_mm_prefix_planned"),
        "fa3_causal_planned_vs_flashinfer_fa3_causal": ratio("variantgen_fa3_causal_planned", "flashinfer_causal_fa3"),
        "fa3_sliding_window_planned_vs_flashinfer_fa3": ratio("variantgen_fa3_sliding_window_planned",
                                                              "flashinfer_sliding_window_fa3"),
        "fa3_softcap_direct_vs_flashinfer_fa3": ratio("variantgen_fa3_softcap_direct", "flashinfer_softcap_fa3"),
        # the logits transform folded into the kernel's scales (logits_fold.py): at most 1.0x FlashInfer's
        # soft-cap kernel, which folds the same factors by hand
        "fa3_softcap_planned_vs_flashinfer_fa3": ratio("variantgen_fa3_softcap_planned", "flashinfer_softcap_fa3"),
        "softcap_direct_vs_flashinfer_fa2": ratio("variantgen_softcap_direct", "flashinfer_softcap_fa2"),
        "softcap_planned_vs_flashinfer_fa2": ratio("variantgen_softcap_planned", "flashinfer_softcap_fa2"),
        "softcap_direct_fa3_vs_fa2": ratio("variantgen_fa3_softcap_direct", "variantgen_softcap_direct"),
        "fa3_mm_prefix_planned_vs_flex": ratio("variantgen_fa3_mm_prefix_planned", "flex_mm_prefix"),
        "fa3_sliding_window_planned_vs_flex": ratio("variantgen_fa3_sliding_window_planned", "flex_sliding_window"),
        "fa3_document_planned_vs_flex": ratio("variantgen_fa3_document_planned", "flex_document"),
        "fa3_prefix_lm_planned_vs_flex": ratio("variantgen_fa3_prefix_lm_planned", "flex_prefix_lm"),
        "mm_prefix_planned_vs_flex": ratio("variantgen_mm_prefix_planned", "flex_mm_prefix"),
        "sliding_window_planned_vs_flex": ratio("variantgen_sliding_window_planned", "flex_sliding_window"),
        "document_planned_vs_flex": ratio("variantgen_document_planned", "flex_document"),
        "prefix_lm_planned_vs_flex": ratio("variantgen_prefix_lm_planned", "flex_prefix_lm"),
    }
    res["vs_best"] = vs_best(ms, wanted, args.backends.split(","))
    print(json.dumps(res["ratios"], indent=1))
    print(json.dumps(res["vs_best"], indent=1))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / result_file_name("prefill", res)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(json.dumps(res, indent=1))
    print("wrote", out)


def flex_rows(masks, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record, notes: dict,
              backend: str = "inductor") -> None:
    """Flex's row for each (name, mask_mod, score_mod) of ``masks``: ``record("flex_<name>", fn)``
    times it; a mask that fails leaves ``notes["flex_<name>_error"]`` and loses only its row.
    Every mask_mod is a new code object, so a recompile of one compiled flex_attention; past
    dynamo's recompile limit (8) torch would run Flex unfused, materializing the whole score
    matrix (a ninth mask ran out of memory on the H100). So each mask gets a fresh compile, and
    the fallback is an error, never a slow row."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, _, Lq, _ = q.shape
    fc = torch.compile(flex_attention, backend=backend)
    with torch._dynamo.config.patch(**({"fail_on_recompile_limit_hit": True} if hasattr(
            torch._dynamo.config, "fail_on_recompile_limit_hit") else {})):
        for name, mask_mod, score_mod in masks:
            try:
                torch._dynamo.reset()
                t = time.perf_counter()
                bm = create_block_mask(mask_mod, B, None, Lq, k.shape[2], device=q.device)
                fc(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
                if q.device.type == "cuda":
                    torch.cuda.synchronize()
                notes[f"flex_{name}_first_call_s"] = round(time.perf_counter() - t, 1)
                record(f"flex_{name}", lambda bm=bm, sm=score_mod: fc(q, k, v, score_mod=sm, block_mask=bm,
                                                                      enable_gqa=True))
            except Exception as e:  # report, do not hide: this mask's row is missing
                notes[f"flex_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def vs_best(ms: dict[str, float], cases: set[str], backends: list[str]) -> dict[str, dict]:
    """Per case and backend: variantgen's row (planned where it has one) over the faster of
    FlashInfer's built-in kernels for that mask (fa2, fa3) and FlexAttention's row, with the
    yardstick's name; None where either side is missing."""
    out = {}
    for case in sorted(cases):
        base = SAME_MASK_FLASHINFER.get(case)
        yardsticks = [f"{base}_{be}" for be in ("fa2", "fa3")] if base else []
        yardsticks.append(f"flex_{case}")
        timed = [(ms[n], n) for n in yardsticks if n in ms]
        best = min(timed) if timed else None
        row = {"best": best[1] if best else None}
        for backend in backends:
            head = "variantgen_" + ("" if backend == "fa2" else f"{backend}_") + case
            ours = ms.get(head + "_planned", ms.get(head + "_direct"))
            row[backend] = round(ours / best[0], 3) if ours is not None and best else None
        out[case] = row
    return out


if __name__ == "__main__":
    main()
