"""What falling back to the flex route costs: variantgen's flex route next to its FlashInfer routes.

The prefill benchmark workload (DESIGN.md; bench_prefill.py): 8 requests x 8192 tokens, 32/8
heads, head dim 128, bf16, paged KV (page 16, shuffled pages), three 1024-token image spans per
request for mm_prefix. For each spec: the flex route (make_wrapper(backend="flex")) planned
(block mask from the interval planner) and direct (block mask from evaluating the mask), its
plan() time, its first call (the compile), the share of its page gather; the variantgen fa2 / fa3
routes where their modules load (planned); FlashInfer's own causal kernels and a hand-written
Flex mm_prefix on contiguous KV as the yardsticks. Also one decode batch (64 x 8192 keys).
Kernels timed with CUDA events (median of --iters after warm-up), all in one process.
Writes bench/results/flex-<date>-<gpu>.json (and $OUT/ when set). Run on the GPU machine:
    python bench/bench_flex.py [--backends fa2,fa3] [--cases mm_prefix,causal]
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    random_paged_batch,
    source_commit,
    write_result,
)

B, L, HQ, HKV, D, PS = PREFILL_BENCH_SHAPE
CASES = ("causal", "mm_prefix", "sliding_window", "document", "prefix_lm", "softcap")


def environment() -> dict:
    env = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "cuda": torch.version.cuda, "variantgen": variantgen.__version__}
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError:
        env["flashinfer"] = None
    env["commit"] = source_commit()
    return env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backends", default="fa2,fa3", help="variantgen FlashInfer routes to compare (their modules "
                    "load from the cache or build)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    wanted = [c for c in args.cases.split(",") if c]
    if set(wanted) - set(CASES):
        ap.error(f"--cases: unknown {sorted(set(wanted) - set(CASES))}; expected some of {', '.join(CASES)}")
    dev = "cuda"
    res: dict = {**environment(), "workload": dict(batch=B, tokens=L, qo_heads=HQ, kv_heads=HKV, head_dim=D,
                                                   page_size=PS, dtype="bf16"), "ms": {}, "notes": {}}
    ms, notes = res["ms"], res["notes"]

    def record(name, fn):
        ms[name] = round(cuda_median_ms(fn, args.iters), 3)
        print(f"{name:45s} {ms[name]:8.3f} ms", flush=True)

    def save():
        return write_result("flex", res, args.out)

    batch, ranges = prefill_bench_batch(dev)
    kv = (batch.k_cache, batch.v_cache)
    flex_ws = torch.empty(0, dtype=torch.uint8, device=dev)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    doc_ids = (torch.arange(L, device=dev, dtype=torch.int32) // (L // 8)).repeat(B).contiguous()
    spec_args = {"causal": {}, "mm_prefix": {"ranges": ranges}, "sliding_window": {"window": 1024},
                 "document": {"doc_ids": doc_ids}, "prefix_lm": {"prefix_len": torch.full((B,), 2048,
                                                                                          dtype=torch.int32,
                                                                                          device=dev)},
                 "softcap": {"soft_cap": 50.0, "window": -1}}

    # FlashInfer's own causal kernels: the yardstick every route is quoted against.
    try:
        import flashinfer

        for be in ("fa2", "fa3"):
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=be)
            w.plan(*batch.plan_args()[:6], D, PS, causal=True, q_data_type=torch.bfloat16,
                   kv_data_type=torch.bfloat16)
            record(f"flashinfer_causal_{be}", lambda w=w: w.run(batch.q, kv))
    except Exception as e:  # noqa: BLE001 - a missing yardstick is reported, not fatal
        notes["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    save()

    outputs: dict[str, torch.Tensor] = {}
    for name in wanted:
        a = spec_args[name]
        spec = variantgen.load_spec(ROOT / "specs" / f"{name}.yaml")
        w = variantgen.make_wrapper(spec, flex_ws, head_dim_qk=D, q_dtype="bf16", kv_dtype="bf16", backend="flex")
        for planned in (True, False):
            tag = f"flex_{name}_" + ("planned" if planned else "direct")
            torch.cuda.synchronize()
            t = time.perf_counter()
            w.plan(*batch.plan_args(), skip_tiles=planned, **(a if planned else {}))
            torch.cuda.synchronize()
            notes[f"{tag}_plan_ms"] = round((time.perf_counter() - t) * 1e3, 2)
            t = time.perf_counter()
            out = w.run(batch.q, kv, **a)
            torch.cuda.synchronize()
            notes[f"{tag}_first_run_s"] = round(time.perf_counter() - t, 2)  # compile (planned) or block search
            notes[f"{tag}_blocks"] = w.plan_stats.get("blocks")
            notes[f"{tag}_keys_gathered"] = w.plan_stats.get("keys_gathered")
            record(tag, lambda w=w, a=a: w.run(batch.q, kv, **a))
            if planned:
                outputs[f"flex_{name}"] = out.float()
                plan = w._plan
                shape = (plan.layout.kv_len, HKV, D)
                record(f"flex_{name}_gather_kv", lambda w=w, plan=plan, shape=shape: (
                    w._gather(plan, batch.k_cache, shape, torch.bfloat16),
                    w._gather(plan, batch.v_cache, shape, torch.bfloat16)))
        save()
        for backend in filter(None, args.backends.split(",")):
            tag = f"variantgen_{backend}_{name}_planned"
            try:
                fw = variantgen.make_wrapper(spec, ws, head_dim_qk=D, q_dtype="bf16", kv_dtype="bf16", backend=backend)
                fw.plan(*batch.plan_args(), skip_tiles=True, **a)
                record(tag, lambda fw=fw, a=a: fw.run(batch.q, kv, **a))
                o = fw.run(batch.q, kv, **a).float()
                ref = outputs[f"flex_{name}"]
                notes[f"{tag}_vs_flex_rel_error"] = ((o - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001 - the row is missing, with the reason
                notes[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        save()

    # A hand-written Flex mm_prefix on contiguous KV, one batch row per request (bench_prefill's row).
    if "mm_prefix" in wanted:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        qd = batch.q.view(B, L, HQ, D).transpose(1, 2).contiguous()
        pg = batch.kv_indices.long().view(B, -1)
        kd = batch.k_cache[pg].reshape(B, L, HKV, D).transpose(1, 2).contiguous()
        vd = batch.v_cache[pg].reshape(B, L, HKV, D).transpose(1, 2).contiguous()
        rg = ranges.view(B, L, 2)

        def mm_mask(b, h, qi, ki):
            return (ki <= qi) | ((ki >= rg[b, qi, 0]) & (ki <= rg[b, qi, 1]))

        fc = torch.compile(flex_attention)
        bm = create_block_mask(mm_mask, B, None, L, L, device=dev)
        with torch.no_grad():
            record("handwritten_flex_mm_prefix_contiguous", lambda: fc(qd, kd, vd, block_mask=bm, enable_gqa=True))

    # Decode: 64 requests x 8192 keys (causal), flex vs the module routes (fa3: its prefill module).
    dkv = [8192] * 64
    db = random_paged_batch([1] * len(dkv), dkv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
                            dtype=torch.bfloat16, device=dev, seed=3)
    for backend in ("flex", *filter(None, args.backends.split(","))):
        tag = f"{'flex' if backend == 'flex' else 'variantgen_' + backend}_decode_causal_64x8192"
        try:
            dw = variantgen.make_wrapper(ROOT / "specs" / "causal.yaml", flex_ws if backend == "flex" else ws,
                                         head_dim_qk=D, q_dtype="bf16", kv_dtype="bf16", backend=backend,
                                         kind="decode")
            dw.plan(*db.plan_args()[1:])
            record(tag, lambda dw=dw: dw.run(db.q, (db.k_cache, db.v_cache)))
        except Exception as e:  # noqa: BLE001
            notes[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    def ratio(a, b):
        return round(ms[a] / ms[b], 3) if a in ms and b in ms else None

    res["ratios"] = {}
    for name in wanted:
        for backend in ("fa2", "fa3"):
            res["ratios"][f"flex_{name}_planned_vs_variantgen_{backend}"] = ratio(
                f"flex_{name}_planned", f"variantgen_{backend}_{name}_planned")
        res["ratios"][f"flex_{name}_planned_vs_flashinfer_causal_fa3"] = ratio(f"flex_{name}_planned",
                                                                               "flashinfer_causal_fa3")
        res["ratios"][f"flex_{name}_gather_share"] = ratio(f"flex_{name}_gather_kv", f"flex_{name}_planned")
    res["ratios"]["flex_mm_prefix_planned_vs_handwritten_flex"] = ratio("flex_mm_prefix_planned",
                                                                        "handwritten_flex_mm_prefix_contiguous")
    print(json.dumps(res["ratios"], indent=1))
    print("wrote", save())


if __name__ == "__main__":
    main()
