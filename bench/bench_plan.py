"""Steady-state plan() time of the interval planner vs the kernel it plans, on the GPU.

Workload of bench_prefill.py (8 x 8192 tokens, 32/8 heads, hd 128, page 16, three 1024-token
spans per request). Each plan() is timed from the host (it ends with a device sync: the
segment boundaries are read back); median of --iters after two warm-up plans.
Run on the GPU machine:  python bench/bench_plan.py
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
from variantgen.testing import (  # noqa: E402
    PREFILL_BENCH_SHAPE,
    cuda_median_ms,
    prefill_bench_batch,
)

D = PREFILL_BENCH_SHAPE[4]  # head dim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    batch, ranges = prefill_bench_batch("cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kv = (batch.k_cache, batch.v_cache)
    out = {"gpu": torch.cuda.get_device_name(0), "plan_ms": {}, "run_ms": {}}
    for name, spec_args in (("causal", {}), ("mm_prefix", {"ranges": ranges})):
        w = variantgen.make_wrapper(ROOT / "specs" / f"{name}.yaml", ws, head_dim_qk=D, q_dtype="bf16",
                                    kv_dtype="bf16")
        for skip_tiles in (False, True):
            tag = f"{name}_{'planned' if skip_tiles else 'direct'}"
            kw = {"skip_tiles": skip_tiles, **(spec_args if skip_tiles else {})}
            times = []
            for i in range(args.iters + 2):
                torch.cuda.synchronize()
                t = time.perf_counter()
                w.plan(*batch.plan_args(), **kw)
                torch.cuda.synchronize()
                if i >= 2:
                    times.append((time.perf_counter() - t) * 1e3)
            out["plan_ms"][tag] = round(statistics.median(times), 3)
            out["run_ms"][tag] = round(cuda_median_ms(lambda w=w, a=spec_args: w.run(batch.q, kv, **a), 10), 3)
            print(tag, out["plan_ms"][tag], "ms plan,", out["run_ms"][tag], "ms run", flush=True)
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "plan-bench.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
