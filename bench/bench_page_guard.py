"""What the page-list guard (variantgen/wrappers/checks.py) costs, on the GPU, for the plan benchmark's
page list (8 requests x 8192 tokens in pages of 16: 4096 entries).

Where plan() gets the page list on the GPU and the indptrs on the host and reads nothing back,
it does not wait for the list's bounds: run() clamps the kernels' copy of the list on the GPU
and a later call reports. Measured here, with PageGuard itself (no attention module needed):

* device time of run()'s clamp and of plan()'s bounds reduction + copy to page-locked memory
  (queued behind a sleeping kernel, so they run back to back without the host's launch gaps;
  median over --iters, per call);
* host time of the guard's calls per plan()/run() pair with the bounds still on their way (the
  GPU busy): poll, begin, finish in plan(); poll, check_run (the clamp's launch) in run();
* that nothing waits: behind a one-second kernel those calls return in microseconds, the
  clamp is applied, and once the GPU is done the next poll() raises the report; a capture of
  check_run records the clamp, and its replay clamps a later list.

Writes bench/results/page-guard-<date>-<gpu>.json (or --out; also into $OUT when set).
Run on the GPU machine:  python bench/bench_page_guard.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from variantgen.core.errors import LaunchError  # noqa: E402
from variantgen.wrappers.checks import BoundsCopy, PageGuard  # noqa: E402

ENTRIES = 8 * 8192 // 16  # the plan benchmark's page list (bench_plan.py: 8 x 8192 tokens, page 16)
PAGES = ENTRIES  # a cache of exactly those pages
DECODE_KERNEL_MS, PREFILL_KERNEL_MS = 0.5, 9.0  # the kernels the shares are of (README's decode / fa3 prefill)


def busy(ms: float) -> None:
    """Queue about ``ms`` of GPU time (a spinning kernel), so that what follows is queued, not run."""
    torch.cuda._sleep(int(ms * 1.98e6))  # H200 SM clock under load: ~1.98 GHz


def queued_device_us(op, iters: int) -> float:
    """Device time of ``op`` per call, the calls queued behind a sleeping kernel (back to back on
    the GPU: no host launch gaps in the figure); median of 5 batches of ``iters``."""
    per_call = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        busy(20)
        start.record()
        for _ in range(iters):
            op()
        end.record()
        torch.cuda.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(per_call)


def host_us(samples: list[int]) -> dict[str, float]:
    us = sorted(s / 1e3 for s in samples)
    return {"median": statistics.median(us), "p90": us[int(0.9 * (len(us) - 1))], "min": us[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    page_list = torch.randperm(PAGES, device=dev, generator=g).to(torch.int32)
    kernel_list = page_list.clone()  # the wrapper's copy that the kernels read
    out: dict = {"entries": ENTRIES, "pages": PAGES, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "date": datetime.date.today().isoformat()}

    # --- device time
    copy = BoundsCopy(dev)
    out["device_us"] = {
        "run_clamp": queued_device_us(lambda: kernel_list.clamp_(0, PAGES - 1), args.iters),
        "plan_bounds_to_host": queued_device_us(lambda: copy.start(page_list), args.iters),
    }

    # --- host time of the guard's calls, the bounds on their way (nothing lands while measuring)
    guard = PageGuard()
    lists = [kernel_list]
    plan_ns, run_ns = [], []
    for rounds in range(3):
        busy(500)  # half a second: far longer than the loop
        for _ in range(args.iters):
            t0 = time.perf_counter_ns()
            guard.poll("plan()")
            guard.begin(page_list, ENTRIES, [])
            guard.finish()
            t1 = time.perf_counter_ns()
            guard.poll("run()")
            guard.check_run(PAGES, False, lambda: lists)
            t2 = time.perf_counter_ns()
            if rounds:  # the first round allocates the page-locked copies
                plan_ns.append(t1 - t0)
                run_ns.append(t2 - t1)
        torch.cuda.synchronize()
        guard.poll("plan()")  # everything landed, nothing outside the cache: reads them all, reports nothing
    out["host_us_bounds_in_flight"] = {"plan": host_us(plan_ns), "run": host_us(run_ns)}

    # --- no wait, the clamp applied, the report once the GPU is done
    bad = page_list.clone()
    bad[1234] = PAGES + 77
    kernel_list.copy_(bad)
    busy(1000)
    t0 = time.perf_counter()
    guard.poll("plan()")
    guard.begin(bad, ENTRIES, [])
    guard.finish()
    guard.poll("run()")
    guard.check_run(PAGES, False, lambda: lists)
    behind_busy_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    clamped = int(kernel_list[1234]) == PAGES - 1 and int(kernel_list.max()) == PAGES - 1
    try:
        guard.poll("plan()")
        report = None
    except LaunchError as e:
        report = str(e)
    out["behind_a_busy_gpu"] = {"plan_and_run_s": behind_busy_s, "clamped": clamped, "report": report}

    # --- under capture: the clamp is in the graph (against the captured cache); a replay clamps a later list
    guard = PageGuard()
    kernel_list.copy_(page_list)
    guard.begin(page_list, ENTRIES, [])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        guard.check_run(PAGES, True, lambda: lists)
    kernel_list.copy_(bad)  # what a later plan() writes into the graph's buffer
    graph.replay()
    torch.cuda.synchronize()
    out["captured_clamp"] = {"captured_pages": guard.captured_pages, "replay_clamped": int(kernel_list.max()) < PAGES}

    clamp_us = out["device_us"]["run_clamp"]
    out["run_clamp_share"] = {"decode_0.5ms": clamp_us / (DECODE_KERNEL_MS * 1e3),
                              "prefill_9ms": clamp_us / (PREFILL_KERNEL_MS * 1e3)}
    text = json.dumps(out, indent=1)
    print(text)
    path = args.out or ROOT / "bench" / "results" / f"page-guard-{out['date']}-{out['gpu'].replace(' ', '_')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(text + "\n")


if __name__ == "__main__":
    main()
