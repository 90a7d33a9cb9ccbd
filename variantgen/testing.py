"""Random paged batches and spec arguments, timing and run metadata, for tests, `variantgen check` and bench/.

Arguments of the shipped specs get meaningful values (spans that contain their query,
increasing document ids, ALiBi slopes, draft trees); tensors of other specs get random values in a
range that exercises the mask (ints in [-2, max kv_len], floats ~ N(0, 1)).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .plan_abi import MaskMode
from .spans import spans_to_ranges  # also importable from here, where tests and bench/ take it
from .spec import ScalarArg, VariantSpec
from .trees import random_tree_parents, tree_bits


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor  # NHD pages [num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_lens: list[int]
    kv_lens: list[int]
    num_qo_heads: int
    num_kv_heads: int
    page_size: int

    def plan_args(self) -> tuple:
        return (self.qo_indptr, self.kv_indptr, self.kv_indices, self.last_page_len,
                self.num_qo_heads, self.num_kv_heads, self.page_size)


def random_paged_batch(qo_lens: list[int], kv_lens: list[int], *, num_qo_heads: int, num_kv_heads: int,
                       head_dim: int, page_size: int, dtype: torch.dtype = torch.bfloat16,
                       kv_dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                       seed: int = 0, shuffle_pages: bool = True) -> PagedBatch:
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    pages = [math.ceil(k / page_size) for k in kv_lens]
    kv_indptr = [0]
    for p in pages:
        kv_indptr.append(kv_indptr[-1] + p)
    total_pages = kv_indptr[-1]
    perm = torch.randperm(total_pages, generator=g) if shuffle_pages else torch.arange(total_pages)
    qo_indptr = [0]
    for q in qo_lens:
        qo_indptr.append(qo_indptr[-1] + q)
    last = [(k - 1) % page_size + 1 if k else 0 for k in kv_lens]
    q = torch.randn(qo_indptr[-1], num_qo_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(total_pages, page_size, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    v = torch.randn(total_pages, page_size, num_kv_heads, head_dim, generator=g).to(kv_dtype)
    i32 = dict(dtype=torch.int32)
    return PagedBatch(
        q=q.to(device), k_cache=k.to(device), v_cache=v.to(device),
        qo_indptr=torch.tensor(qo_indptr, **i32).to(device), kv_indptr=torch.tensor(kv_indptr, **i32).to(device),
        kv_indices=perm.to(torch.int32).to(device), last_page_len=torch.tensor(last, **i32).to(device),
        qo_lens=list(qo_lens), kv_lens=list(kv_lens), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        page_size=page_size,
    )


def alibi_slopes(num_heads: int) -> torch.Tensor:
    n = 2 ** math.floor(math.log2(num_heads))
    base = [2 ** (-8.0 * (i + 1) / n) for i in range(n)]
    extra = [2 ** (-4.0 * (2 * i + 1) / n) for i in range(num_heads - n)]
    return torch.tensor(base + extra, dtype=torch.float32)


def random_spec_args(spec: VariantSpec, batch: PagedBatch, *, seed: int = 0,
                     device: str | torch.device | None = None) -> dict[str, Any]:
    """Run-time arguments for ``spec`` on ``batch`` (tensors on ``device``, default: batch's)."""
    g = torch.Generator().manual_seed(seed + 7)
    dev = device or batch.q.device
    ql, kl = batch.qo_lens, batch.kv_lens
    dims = {"total_q": sum(ql), "total_kv": sum(kl), "batch": len(ql), "num_qo_heads": batch.num_qo_heads,
            "num_kv_heads": batch.num_kv_heads}
    out: dict[str, Any] = {}
    for t in spec.tensors:
        shape = tuple(dims[d] if isinstance(d, str) else d for d in t.shape)
        if t.name == "ranges" and shape[1:] == (2,):
            spans = []
            for k in kl:
                req = []
                for _ in range(int(torch.randint(0, 4, (1,), generator=g))):
                    s = int(torch.randint(0, max(k, 1), (1,), generator=g))
                    e = min(k - 1, s + int(torch.randint(0, max(k // 3, 1), (1,), generator=g)))
                    # (a request without keys draws the empty span (0, -1): dropped, same draws)
                    if s <= e and not any(s <= e2 and e >= s2 for s2, e2 in req):
                        req.append((s, e))
                spans.append(req)
            value = spans_to_ranges(ql, kl, spans)
        elif t.name == "prefix_len":
            value = torch.tensor([int(torch.randint(0, k + 3, (1,), generator=g)) for k in kl], dtype=torch.int32)
        elif t.name == "doc_ids":
            ids = []
            for k in kl:
                cuts = torch.rand(k, generator=g) < 4.0 / max(k, 1)
                ids.append(torch.cumsum(cuts.to(torch.int32), 0).to(torch.int32))
            value = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int32)
        elif t.name == "slopes" and len(shape) == 1:
            value = alibi_slopes(shape[0])
        elif t.name == "tree_bits" and len(shape) == 2 and t.dtype == "int32":
            # a random draft tree per request (chains, stars, random parents, forests)
            shapes = ("random", "chain", "star", "forest")
            parents = [random_tree_parents(min(n, 32 * shape[1]), g, shapes[i % 4]) for i, n in enumerate(ql)]
            bits = tree_bits(parents, words=shape[1])
            value = torch.zeros(shape, dtype=torch.int32)
            rows = torch.cat([torch.arange(sum(ql[:i]), sum(ql[:i]) + len(p)) for i, p in enumerate(parents)])
            value[rows] = bits
        elif t.dtype == "int32":
            value = torch.randint(-2, max(kl) + 1, shape, generator=g, dtype=torch.int32)
        else:
            value = torch.randn(shape, generator=g)
        out[t.name] = value.to(dev).contiguous()
    return out


def within_range(scalar: ScalarArg, value: int | float) -> int | float:
    """``value`` moved to the nearest value the scalar's declared range allows: random tests
    draw scalars freely, then keep to what plan()/run() accept."""
    lo, hi = scalar.minimum, scalar.maximum
    if scalar.positive:
        smallest = 1 if scalar.dtype == "int" else 2.0**-126  # the smallest normal float32
        lo = smallest if lo is None else max(lo, smallest)
    if lo is not None:
        value = max(value, lo)
    if hi is not None:
        value = min(value, hi)
    return value


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

    from .env import REPO_DIR

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

    from ._version import __version__

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

    from .env import REPO_DIR

    path = Path(out) if out else REPO_DIR / "bench" / "results" / result_file_name(kind, res)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(res, indent=1)
    path.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(text)
    return path
