"""Random paged batches and spec arguments: the small batches `variantgen check`, `explain` and
probe(backend="flex") run, and the tests' and benchmarks' batches.

Arguments of the shipped specs get meaningful values (spans that contain their query,
increasing document ids, ALiBi slopes, draft trees); tensors of other specs get random values in a
range that exercises the mask (ints in [-2, max kv_len], floats ~ N(0, 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..lang.values import ScalarArg, VariantSpec
from .spans import spans_to_ranges
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
