"""fa3 decode at one copy's kernel tile (run.sh makes the copies and calls this in each).

bench_decode.py's workload (64 requests x 8192 cached tokens, one query each, 32/8 heads, head
dim 128, bf16, page 16), on the fa3 route: causal, mm_prefix (the decoded token is text) and
sliding_window (1023) with key trimming, GQA-packed. Per spec: run() eager (CUDA events around
each call, median of 200, twice) and replayed from a CUDA graph (median of 200), and the output's
largest difference from the reference copy's (``base``: FlashInfer's own tile). In ``base``
FlashInfer's tensor-core decode (fa2) runs too, with its difference from our causal output.

    python tile_bench.py CONFIG OUT_JSON REF_DIR     (from the copy's root)
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))

import bench_decode as bd  # noqa: E402

import variantgen  # noqa: E402
from variantgen.testing.harness import cuda_median_ms, run_environment  # noqa: E402

SPECS = ("causal", "mm_prefix", "sliding_window")
ITERS = 200


def decode_wrapper(spec: str, ws: torch.Tensor, **kw):
    return variantgen.make_wrapper(f"specs/{spec}.yaml", ws, head_dim_qk=bd.D, q_dtype="bf16", kv_dtype="bf16",
                                   kind="decode", backend="fa3", **kw)


def main() -> None:
    config, out_json, ref_dir = sys.argv[1:4]
    dev = "cuda"
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    batch = bd.decode_batch(dev)
    kv = (batch["k"], batch["v"])
    plan_pos = (batch["kv_indptr"], batch["kv_indices"], batch["last_page_len"])
    res = {**run_environment(), "config": config, "ms": {}, "notes": {}, "errors": {}}
    ms, notes = res["ms"], res["notes"]
    for spec in SPECS:
        try:
            args = bd.spec_args(spec, dev)
            w = decode_wrapper(spec, ws)
            w.plan(*plan_pos, bd.HQ, bd.HKV, bd.PS, **args)
            notes[f"{spec}_plan"] = json.loads(json.dumps(
                {k: v for k, v in w.plan_stats.items() if k in ("launches", "pack_gqa", "pages")}, default=str))
            eager = w.run(batch["q"], kv, **args).float()
            ms[spec] = round(cuda_median_ms(lambda w=w, a=args: w.run(batch["q"], kv, **a), ITERS), 4)
            ms[f"{spec}_again"] = round(cuda_median_ms(lambda w=w, a=args: w.run(batch["q"], kv, **a), ITERS), 4)
            ref = os.path.join(ref_dir, f"{spec}.pt")
            if config == "base":
                torch.save(eager.cpu(), ref)
            elif os.path.exists(ref):
                notes[f"{spec}_max_abs_vs_base"] = (eager.cpu() - torch.load(ref)).abs().max().item()
            cap = variantgen.GraphCapacity(max_batch_size=bd.B, max_total_q=bd.B, max_kv_pages=bd.B * (bd.L // bd.PS),
                                           max_qo_len=1)
            g = decode_wrapper(spec, ws, graph=cap)
            g.plan(*plan_pos, bd.HQ, bd.HKV, bd.PS, **args)
            out = torch.empty_like(batch["q"])
            g.run(batch["q"], kv, out=out, **args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                g.run(batch["q"], kv, out=out, **args)
            ms[f"{spec}_graph_replay"] = round(cuda_median_ms(graph.replay, ITERS), 4)
            graph.replay()
            torch.cuda.synchronize()
            notes[f"{spec}_graph_replay_vs_eager_max_abs"] = (out.float() - eager).abs().max().item()
        except Exception as e:  # noqa: BLE001 - recorded; the other specs still run
            traceback.print_exc()
            res["errors"][spec] = f"{type(e).__name__}: {str(e)[:400]}"
    if config == "base":
        try:
            import flashinfer

            fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev),
                                                               "NHD", use_tensor_cores=True, backend="fa2")
            fw.plan(*plan_pos, bd.HQ, bd.HKV, bd.D, bd.PS, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            ms["flashinfer_plain_tensor_cores"] = round(cuda_median_ms(lambda: fw.run(batch["q"], kv), ITERS), 4)
            fo = fw.run(batch["q"], kv).float().cpu()
            ours = torch.load(os.path.join(ref_dir, "causal.pt"))
            notes["causal_vs_flashinfer_max_abs"] = (fo - ours).abs().max().item()
        except Exception as e:  # noqa: BLE001
            res["errors"]["flashinfer"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(json.dumps({"config": config, "ms": ms, "errors": res["errors"]}), flush=True)
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
