"""What plan()'s read-back of device index tensors costs on the host, two ways, in one process.

plan() copies qo_indptr, paged_kv_indptr and last_page_len to the host and, with the page list
on the same GPU, the list's (min, max) over its first paged_kv_indptr[-1] entries, in the same
copy (checks.py). Timed here, host time per call (the call returns with the values on the host):

* ``torch``: the torch ops plan() ran for this before the module's read_indices (a masked
  min/max: compare, where, aminmax; a cat with the indptrs; .cpu(); tolist);
* ``module``: the wrapper's _read_indptrs, one call of the module's read_indices (one kernel,
  one copy) and tolist.

Workloads: the plan benchmark's prefill batch (8 requests x 8192 tokens, page 16: 4096 entries)
and a decode batch (64 requests x 8192 tokens: 32768 entries; paged_kv_indptr and last_page_len).
The values of both ways are compared. Writes bench/results/read-indices-<date>-<GPU>.json
(or --out; also into $OUT when set).
Run on the GPU machine (needs the causal fa2 prefill and decode modules, hd 128, bf16):
    python bench/bench_read_indices.py
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.testing.harness import run_environment, write_result  # noqa: E402

PAGE = 16


def torch_read(kv_indices: torch.Tensor, kv_indptr: torch.Tensor, positions: torch.Tensor,
               *parts: torch.Tensor) -> tuple[list[int], list[int]]:
    """The torch ops plan() read the indices with before read_indices."""
    low, high = torch.aminmax(torch.where(positions < kv_indptr[-1:], kv_indices, 0))
    values = torch.cat([*parts, low.view(1), high.view(1)]).cpu().tolist()
    return values[:-2], values[-2:]


def host_us(op, iters: int) -> dict[str, float]:
    times = []
    for _ in range(iters + 5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        op()
        times.append((time.perf_counter() - t) * 1e6)
    times = sorted(times[5:])
    return {"median_us": round(statistics.median(times), 2), "min_us": round(times[0], 2),
            "p90_us": round(times[int(0.9 * len(times))], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    spec = ROOT / "specs" / "causal.yaml"
    rows = []
    for kind, batch, tokens in (("prefill", 8, 8192), ("decode", 64, 8192)):
        w = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind=kind,
                                    backend="fa2")
        pages = batch * tokens // PAGE
        kv_indices = torch.randperm(pages, dtype=torch.int32, device="cuda")
        kv_indptr = torch.arange(0, pages + 1, tokens // PAGE, dtype=torch.int32, device="cuda")
        last = torch.full((batch,), PAGE, dtype=torch.int32, device="cuda")
        qo = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32, device="cuda")
        parts = (kv_indptr, last) if kind == "decode" else (qo, kv_indptr, last)
        positions = torch.arange(pages, dtype=torch.int32, device="cuda")
        old = torch_read(kv_indices, kv_indptr, positions, *parts)
        lists, _, folded = w._read_indptrs(kv_indices, kv_indptr, *parts)
        same = old == ([v for part in lists for v in part], folded)
        row = {"kind": kind, "requests": batch, "page_list_entries": pages, "same_values": same,
               "torch": host_us(functools.partial(torch_read, kv_indices, kv_indptr, positions, *parts), a.iters),
               "module": host_us(functools.partial(w._read_indptrs, kv_indices, kv_indptr, *parts), a.iters)}
        rows.append(row)
        print(f"{kind:8s} {pages:6d} entries: torch {row['torch']['median_us']:7.1f} us, module "
              f"{row['module']['median_us']:7.1f} us (median host time per read), same values: {same}")
    out = write_result("read-indices", {"bench": "read_indices", **run_environment(), "iters": a.iters,
                                        "rows": rows}, a.out)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
