"""Where plan() spends its time, on the GPU: each phase's wall time per plan (the functions
below wrapped with a timer) and a torch.profiler table of host ops and kernels, for the
benchmark workload (bench_plan.py's). Wrapping adds ~1 us per call, so the total is a little
above bench_plan's. Run on the GPU machine:  python bench/plan_phases.py --backends fa3,fa2
(bench/logs/2026-11-29-h200/plan-phases-534fafb.log and -0a08588.log were made with an earlier form of it)."""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.core import staging  # noqa: E402
from variantgen.planning import planner  # noqa: E402
from variantgen.testing.harness import PREFILL_BENCH_SHAPE, prefill_bench_batch  # noqa: E402
from variantgen.wrappers import paged as wrapper  # noqa: E402

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(label: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            CALLS[label] += 1
    return call


def wrap(owner, names: list[str], prefix: str) -> None:
    for name in names:
        setattr(owner, name, timed(f"{prefix}.{name}", getattr(owner, name)))


class TimedModule:
    """A loaded module whose exported functions are timed."""

    def __init__(self, module, label: str):
        self._module, self._label = module, label

    def __getattr__(self, name: str):
        return timed(f"{self._label}.{name}", getattr(self._module, name))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="fa3,fa2")
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    wrap(wrapper, ["host_indices"], "wrapper")
    wrap(planner.Planner, ["plan", "_build", "_launches", "_flashinfer_plan"], "planner")
    wrap(wrapper.VariantWrapper, ["_planner_args", "_check_args", "_intervals_off", "_read_indptrs"], "wrapper")
    wrap(staging.HostStaging, ["to_device", "record", "begin"], "staging")
    batch, ranges = prefill_bench_batch("cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for backend in args.backends.split(","):
        for name, spec_args in (("causal", {}), ("mm_prefix", {"ranges": ranges})):
            w = variantgen.make_wrapper(ROOT / "specs" / f"{name}.yaml", ws, head_dim_qk=PREFILL_BENCH_SHAPE[4],
                                        q_dtype="bf16", kv_dtype="bf16", backend=backend)
            w.planner.module = TimedModule(w.module, "kernel_module")
            w.set_row_planner(TimedModule(w.row_planner, "planner_module"))
            for _ in range(5):
                w.plan(*batch.plan_args(), **spec_args)
            torch.cuda.synchronize()
            SECONDS.clear()
            CALLS.clear()
            times = []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                start = time.perf_counter()
                w.plan(*batch.plan_args(), **spec_args)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            print(f"== {backend} {name}: plan() median {statistics.median(times):.3f} ms "
                  f"(+ sync), launches {w.plan_stats.get('launches')}")
            for label, seconds in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
                print(f"   {label:40s} {seconds / args.iters * 1e3:8.3f} ms/plan  x{CALLS[label] / args.iters:.0f}")
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    w.plan(*batch.plan_args(), **spec_args)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    main()
