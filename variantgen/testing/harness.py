"""The tests' and benchmarks' harness: timing, the benchmark workload, run metadata and result
files; the random batches (variantgen.wrappers.batches) are re-exported here for them."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..abi.table import MaskMode
from ..wrappers.batches import (  # noqa: F401 (re-exported for tests and bench/)
    PagedBatch,
    alibi_slopes,
    random_paged_batch,
    random_spec_args,
    within_range,
)
from ..wrappers.spans import spans_to_ranges  # noqa: F401
from ..wrappers.trees import random_tree_parents, tree_bits  # noqa: F401


def poison_keys(k: torch.Tensor, v: torch.Tensor, kv_lens: list[int], request: int, value: float, *,
                kv_indptr: list[int] | None = None, kv_indices: torch.Tensor | None = None,
                page_size: int = 1) -> list[int]:
    """Write ``value`` (NaN, inf) into K and V of request ``request``'s first and last key, every
    KV head and element (in place): one bad request, for isolation tests. Paged caches ([pages,
    page_size, heads, dim], NHD) take ``kv_indptr`` (host list), ``kv_indices`` and ``page_size``;
    ragged ones ([total_kv, heads, dim]) take neither. A value the cache's dtype cannot hold is
    stored as torch converts it (fp8 e4m3 has no inf: 448). Returns the poisoned kv positions."""
    n = kv_lens[request]
    positions = sorted({0, n - 1}) if n else []
    for pos in positions:
        if kv_indices is None:
            row = sum(kv_lens[:request]) + pos
            k[row], v[row] = value, value
        else:
            assert kv_indptr is not None
            page = int(kv_indices[kv_indptr[request] + pos // page_size])
            k[page, pos % page_size], v[page, pos % page_size] = value, value
    return positions


def rows_of_requests(qo_lens: list[int], requests: list[int] | set[int]) -> torch.Tensor:
    """Bool [total_q]: the query rows of ``requests``."""
    owner = torch.repeat_interleave(torch.arange(len(qo_lens)), torch.tensor(qo_lens, dtype=torch.int64))
    return torch.isin(owner, torch.tensor(sorted(requests), dtype=torch.int64))


def nan_positions_differ(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Bool, per row (first axis) of ``out`` vs ``ref``: whether a NaN or inf stands where the
    other has a finite value, a NaN where the other has an inf, or infs of opposite sign (a NaN
    in means NaN out: the positions must agree, the values elsewhere are compared as numbers)."""
    a, b = out.float().reshape(out.shape[0], -1), ref.float().reshape(ref.shape[0], -1)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    same_special = (torch.isnan(a) & torch.isnan(b)) | (torch.isinf(a) & (a == b))
    return ((~fa | ~fb) & ~same_special).any(dim=1)


def assert_close_with_nans(out: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float, label: str = "",
                           ) -> None:
    """``out`` matches ``ref``: NaN / inf at the same positions, the finite values within
    ``atol`` + ``rtol`` * |ref|."""
    differ = nan_positions_differ(out, ref)
    if bool(differ.any()):
        rows = differ.nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{label}: {int(differ.sum())} rows have NaN/inf where the reference does not (or the "
                             f"reverse), rows {rows}")
    a, b = out.float(), ref.float()
    both = torch.isfinite(a) & torch.isfinite(b)
    err = torch.where(both, (a - b).abs(), torch.zeros_like(a))
    bound = atol + rtol * torch.where(both, b.abs(), torch.zeros_like(b))
    if bool((err > bound).any()):
        raise AssertionError(f"{label}: max abs error {float(err.max()):.3g} over atol {atol:g} + rtol {rtol:g}|ref| "
                             f"({int((err > bound).sum())} elements)")


def mask_exact_launches(plan: Any) -> int:
    """fa2's same-process A/B of the benchmarks and GPU tests: ``plan``'s exact causal launches
    (mode and kernel window are their whole mask) marked as the tail launch, so that run() passes
    them the tail launch's code and they run on the kernel units with the spec's mask compiled in
    - evaluated on no tile, vg_meta still saying every key is visible: the output must not
    change. Plan again to undo. Returns how many launches it marked."""
    exact = [la for la in plan.launches if la.exact and la.mode == MaskMode.CAUSAL]
    for la in exact:
        la.tail = True
    return len(exact)


def cuda_median_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median device time of ``fn`` in milliseconds (CUDA events, after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_back_to_back_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Device time per call of ``fn`` run ``iters`` times back to back between two CUDA events:
    the host's work between launches overlaps the GPU's, as in a model's forward pass, where
    cuda_median_ms (one call between its events) also counts the host time before the first
    launch."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


# The prefill workload of DESIGN.md that the benchmarks share: batch, tokens per request,
# query / KV heads, head dim, page size; and three 1024-token image spans per request.
PREFILL_BENCH_SHAPE = (8, 8192, 32, 8, 128, 16)
PREFILL_BENCH_SPANS = [(1024 + 2048 * i, 1024 + 2048 * i + 1023) for i in range(3)]


def prefill_bench_batch(device: str | torch.device = "cuda", seed: int = 2) -> tuple[PagedBatch, torch.Tensor]:
    """The benchmark workload's batch (full prefill, shuffled pages) and its spans as mm_prefix
    ``ranges`` [total_q, 2]."""
    b, length, hq, hkv, d, ps = PREFILL_BENCH_SHAPE
    batch = random_paged_batch([length] * b, [length] * b, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                               page_size=ps, device=device, seed=seed)
    return batch, spans_to_ranges(batch.qo_lens, batch.kv_lens, [PREFILL_BENCH_SPANS] * b).to(device)


def source_commit() -> str:
    """The commit a measurement ran: VARIANTGEN_COMMIT (set it where the checkout's git history
    did not travel, e.g. on a lent GPU machine), else the checkout's HEAD (12 hex digits,
    '-dirty' with changes to tracked files), else 'unknown'."""
    import os

    return os.environ.get("VARIANTGEN_COMMIT") or _checkout_commit()


@functools.cache
def _checkout_commit() -> str:
    # once per process: a fuzzer names it in every failure it reports
    import subprocess

    from ..core.env import REPO_DIR

    try:
        head = subprocess.run(["git", "-C", str(REPO_DIR), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_DIR), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("-dirty" if dirty else "")) if head else "unknown"


def run_environment() -> dict[str, Any]:
    """What a benchmark's JSON records about where it ran: commit, date, GPU, versions, host, nvcc."""
    import datetime
    import platform
    import subprocess

    import flashinfer

    from .._version import __version__

    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.splitlines()[-1]
    except (OSError, IndexError):
        nvcc = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"commit": source_commit(), "date": datetime.date.today().isoformat(), "gpu": gpu,
            "torch": torch.__version__, "cuda": torch.version.cuda, "flashinfer": flashinfer.__version__,
            "variantgen": __version__, "host": platform.node(), "nvcc": nvcc}


def result_file_name(kind: str, env: dict[str, Any]) -> str:
    """bench/results/ naming: '<kind>-<date>-<GPU name>.json'."""
    return f"{kind}-{env['date']}-{env['gpu'].replace(' ', '_')}.json"


def write_result(kind: str, res: dict[str, Any], out: str | None = None) -> Path:
    """A benchmark's JSON: to ``out``, else bench/results/<result_file_name>; also into $OUT when set
    (the GPU machine's return folder). Returns the path written."""
    import json
    import os

    from ..core.env import REPO_DIR

    path = Path(out) if out else REPO_DIR / "bench" / "results" / result_file_name(kind, res)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(res, indent=1)
    path.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(text)
    return path


def gpu_bench_args(doc: str, list_modules: Callable[[], str], argv: list[str] | None = None,
                   extra: Callable[[Any], None] | None = None) -> Any:
    """The GPU benchmarks' command line: --iters, --out, --backends (a comma list of fa3, fa2,
    checked), --list-modules (printed here, then None is returned) and ``extra``'s own options.
    Refuses to go on without a CUDA GPU. The parsed arguments, ``backends`` as a list."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--backends", default="fa3,fa2", help="comma list of fa3, fa2")
    ap.add_argument("--list-modules", action="store_true", help="print the precompile commands and exit")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if args.list_modules:
        print(list_modules())
        return None
    args.backends = [b for b in args.backends.split(",") if b]
    if not args.backends or set(args.backends) - {"fa2", "fa3"}:
        ap.error(f"--backends={','.join(args.backends)!r}: expected a comma list of fa3, fa2")
    if args.iters < 1:
        ap.error(f"--iters={args.iters}: expected at least 1")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (H100 / H200); --list-modules works anywhere")
    return args


def noted(res: dict[str, Any], key: str, fn: Callable[[], object]) -> bool:
    """fn(); an exception is recorded as the note ``<key>_error`` and printed, and the benchmark
    goes on (report, do not hide: the rows fn would have written are missing). Whether it ran."""
    try:
        fn()
        return True
    except Exception as e:
        res["notes"][f"{key}_error"] = f"{type(e).__name__}: {str(e)[:600]}"
        print(f"{key}: {res['notes'][f'{key}_error']}", flush=True)
        return False
