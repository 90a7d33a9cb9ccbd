"""Prefill benchmark on the DESIGN.md workload: variantgen kernels next to FlashInfer's.

8 requests x 8192 tokens, 32/8 heads, head dim 128, bf16, paged KV (page 16), three
1024-token image spans per request. Every kernel is timed in the same process with CUDA
events (median of --iters runs after warm-up). Writes bench/results/prefill-<date>-<gpu>.json
(or --out). Run on the GPU machine:  python bench/bench_prefill.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.testing import cuda_median_ms, random_paged_batch, spans_to_ranges  # noqa: E402

B, L, HQ, HKV, D, PS = 8, 8192, 32, 8, 128, 16
SPANS = [(1024 + 2048 * i, 1024 + 2048 * i + 1023) for i in range(3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma list of rows to skip (fa3, flashinfer_mm_prefix, flex)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    import flashinfer

    dev = "cuda"
    res: dict = {
        "date": dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": flashinfer.__version__,
        "variantgen": variantgen.__version__,
        "host": platform.node(),
        "workload": dict(batch=B, tokens=L, qo_heads=HQ, kv_heads=HKV, head_dim=D, page_size=PS,
                         spans=SPANS, dtype="bf16"),
        "ms": {},
        "notes": {},
    }
    try:
        res["nvcc"] = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.splitlines()[-1]
    except OSError:
        res["nvcc"] = None
    batch = random_paged_batch([L] * B, [L] * B, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
                               device=dev, seed=2)
    ranges = spans_to_ranges(batch.qo_lens, batch.kv_lens, [SPANS] * B).to(dev)
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

    # variantgen kernels: module load from the cache, then plan + run.
    for name, spec_args in (("causal", {}), ("mm_prefix", {"ranges": ranges})):
        t = time.perf_counter()
        w = variantgen.make_wrapper(ROOT / "specs" / f"{name}.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                    kv_dtype="bf16")
        res["notes"][f"variantgen_{name}_make_wrapper_s"] = round(time.perf_counter() - t, 3)
        res["notes"][f"variantgen_{name}_module_built_now"] = w.build.built
        modes = [False]
        try:
            from variantgen.intervals import analyze

            if analyze(w.spec).planner_ready:
                modes.append(True)
        except ImportError:
            pass
        for skip_tiles in modes:
            tag = f"variantgen_{name}" + ("_planned" if skip_tiles else "_direct")
            plan_kw = {"skip_tiles": skip_tiles, **(spec_args if skip_tiles else {})}
            torch.cuda.synchronize()
            t = time.perf_counter()
            w.plan(*batch.plan_args(), **plan_kw)
            torch.cuda.synchronize()
            res["notes"][f"{tag}_plan_ms"] = round((time.perf_counter() - t) * 1e3, 3)
            res["notes"][f"{tag}_launches"] = w.plan_stats.get("launches")
            record(tag, lambda w=w, a=spec_args: w.run(batch.q, kv, **a))
            if name == "mm_prefix" and ref_out is not None:
                o = w.run(batch.q, kv, **spec_args).float()
                res["notes"][f"{tag}_vs_flashinfer_max_abs"] = (o - ref_out).abs().max().item()
    # Sliding window (w = 1024): FlashInfer's built-in windowed causal vs the planned variant.
    w_left = 1024
    if "fa2" not in skip:
        fwin = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        fwin.plan(*batch.plan_args()[:6], D, PS, causal=True, window_left=w_left, q_data_type=torch.bfloat16,
                  kv_data_type=torch.bfloat16)
        record("flashinfer_sliding_window_fa2", lambda: fwin.run(batch.q, kv))
        ref_win = fwin.run(batch.q, kv).float()
    sw = variantgen.make_wrapper(ROOT / "specs" / "sliding_window.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                 kv_dtype="bf16")
    sw.plan(*batch.plan_args(), window=w_left)
    res["notes"]["variantgen_sliding_window_planned_launches"] = sw.plan_stats.get("launches")
    record("variantgen_sliding_window_planned", lambda: sw.run(batch.q, kv, window=w_left))
    if "fa2" not in skip:
        res["notes"]["sliding_window_vs_flashinfer_max_abs"] = (
            sw.run(batch.q, kv, window=w_left).float() - ref_win).abs().max().item()
    # Why does the planned causal launch trail FlashInfer's? Same kernel family; the knobs that
    # differ are split-KV and programmatic dependent launch (PDL). Time each.
    exp = res.setdefault("experiments_ms", {})
    if "fa2" not in skip:
        fe = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        for split in (False, True):
            fe.plan(*batch.plan_args()[:6], D, PS, causal=True, q_data_type=torch.bfloat16,
                    kv_data_type=torch.bfloat16, disable_split_kv=split)
            for pdl in (False, True):
                exp[f"flashinfer_fa2_causal_disable_split_{split}_pdl_{pdl}"] = round(
                    cuda_median_ms(lambda pdl=pdl: fe.run(batch.q, kv, enable_pdl=pdl), args.iters), 3)
    wc = variantgen.make_wrapper(ROOT / "specs" / "causal.yaml", ws, head_dim_qk=D, q_dtype="bf16", kv_dtype="bf16")
    for split in (False, True):
        wc.plan(*batch.plan_args(), skip_tiles=True, disable_split_kv=split)
        for pdl in (False, True):
            exp[f"variantgen_causal_planned_disable_split_{split}_pdl_{pdl}"] = round(
                cuda_median_ms(lambda pdl=pdl: wc.run(batch.q, kv, enable_pdl=pdl), args.iters), 3)
    print(json.dumps(exp, indent=1), flush=True)

    # Masks of issue 4 beyond mm_prefix: document (8 documents per request) and prefix-LM
    # (a 2048-token bidirectional prefix). No FlashInfer kernel exists for them.
    doc_len = L // 8
    doc_ids = (torch.arange(L, device=dev, dtype=torch.int32) // doc_len).repeat(B).contiguous()
    prefix = torch.full((B,), 2048, dtype=torch.int32, device=dev)
    for name, spec_args in (("document", {"doc_ids": doc_ids}), ("prefix_lm", {"prefix_len": prefix})):
        wx = variantgen.make_wrapper(ROOT / "specs" / f"{name}.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                     kv_dtype="bf16")
        wx.plan(*batch.plan_args(), **spec_args)
        res["notes"][f"variantgen_{name}_planned_launches"] = wx.plan_stats.get("launches")
        res["notes"][f"variantgen_{name}_segments"] = wx.plan_stats.get("segments")
        record(f"variantgen_{name}_planned", lambda wx=wx, a=spec_args: wx.run(batch.q, kv, **a))

    # FlexAttention (torch.compile, BlockMask) on the same masks, contiguous KV (Flex has no paged KV).
    if "flex" not in skip:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

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

            fc = torch.compile(flex_attention)
            for name, mask_mod in (("mm_prefix", mm_mask), ("sliding_window", sw_mask), ("document", doc_mask),
                                   ("prefix_lm", plm_mask)):
                t = time.perf_counter()
                bm = create_block_mask(mask_mod, B, None, L, L, device=dev)
                fc(qd, kd, vd, block_mask=bm, enable_gqa=True)
                torch.cuda.synchronize()
                res["notes"][f"flex_{name}_first_call_s"] = round(time.perf_counter() - t, 1)
                record(f"flex_{name}", lambda bm=bm: fc(qd, kd, vd, block_mask=bm, enable_gqa=True))
        except Exception as e:  # report, do not hide: the row is simply missing
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
        "mm_prefix_planned_vs_flex": ratio("variantgen_mm_prefix_planned", "flex_mm_prefix"),
        "sliding_window_planned_vs_flex": ratio("variantgen_sliding_window_planned", "flex_sliding_window"),
        "document_planned_vs_flex": ratio("variantgen_document_planned", "flex_document"),
        "prefix_lm_planned_vs_flex": ratio("variantgen_prefix_lm_planned", "flex_prefix_lm"),
    }
    print(json.dumps(res["ratios"], indent=1))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"prefill-{res['date']}-{res['gpu'].replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(json.dumps(res, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
