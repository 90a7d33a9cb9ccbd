"""A dense float32 torch reference derived from the same expression trees as the kernel.

Every GPU test compares against this. It evaluates the mask (the logits transform, the sink
logit of each head) for each request over a [heads, qo_len, kv_len] grid with evaluate.Evaluator, whose semantics
are the ones codegen.py promises the kernels have.

It runs on whatever device the inputs are on (CPU in CI, the GPU in GPU tests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .evaluate import Evaluator
from .spec import VariantSpec


@dataclass(frozen=True)
class RequestGrid:
    """Where one request's queries and keys sit, as broadcastable tensors."""

    request: int
    qo_len: int
    kv_len: int
    q_row_base: int
    kv_row_base: int
    num_qo_heads: int
    num_kv_heads: int
    device: torch.device


def grid_env(grid: RequestGrid) -> dict[str, torch.Tensor]:
    """The builtins of one request over [heads, qo_len, kv_len] (broadcastable int64 tensors)."""
    g, dev, i64 = grid, grid.device, torch.int64
    q_local = torch.arange(g.qo_len, device=dev, dtype=i64).view(1, -1, 1)
    kv_pos = torch.arange(g.kv_len, device=dev, dtype=i64).view(1, 1, -1)
    q_pos = q_local + (g.kv_len - g.qo_len)
    qo_head = torch.arange(g.num_qo_heads, device=dev, dtype=i64).view(-1, 1, 1)
    return {
        "q_pos": q_pos,
        "kv_pos": kv_pos,
        "q_idx": q_local,
        "q_row": q_local + g.q_row_base,
        "kv_row": kv_pos + g.kv_row_base,
        "q_kv_row": q_pos + g.kv_row_base,
        "request": torch.tensor(g.request, device=dev, dtype=i64),
        "qo_head": qo_head,
        "kv_head": qo_head // (g.num_qo_heads // g.num_kv_heads),
        "qo_len": torch.tensor(g.qo_len, device=dev, dtype=i64),
        "kv_len": torch.tensor(g.kv_len, device=dev, dtype=i64),
    }


def mask_for_request(spec: VariantSpec, grid: RequestGrid, args: Mapping[str, Any]) -> torch.Tensor:
    """Bool mask broadcastable to [num_qo_heads, qo_len, kv_len]: True = key visible."""
    m = Evaluator(spec, grid_env(grid), args).ev(spec.mask)
    return m.expand(grid.num_qo_heads, grid.qo_len, grid.kv_len)


def sink_for_request(spec: VariantSpec, grid: RequestGrid, args: Mapping[str, Any]) -> torch.Tensor | None:
    """The spec's sink logit of each query head of one request, float32 [num_qo_heads, 1]
    (broadcast over the request's rows); None for a spec without a sink."""
    if spec.sink is None:
        return None
    value = Evaluator(spec, grid_env(grid), args).as_float(spec.sink)
    return value.expand(grid.num_qo_heads, 1, 1).reshape(grid.num_qo_heads, 1)


def transform_logits(spec: VariantSpec, grid: RequestGrid, args: Mapping[str, Any],
                     scores: torch.Tensor) -> torch.Tensor:
    if spec.logits is None:
        return scores
    out = Evaluator(spec, grid_env(grid), args, logits=scores).as_float(spec.logits)
    return out.expand_as(scores)


def split_kv_cache(paged_kv_cache, kv_layout: str = "NHD") -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) pages as [num_pages, page_size, num_kv_heads, head_dim] whatever the input form."""
    if isinstance(paged_kv_cache, (tuple, list)):
        k, v = paged_kv_cache
    else:
        k, v = paged_kv_cache.unbind(1)
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def kv_lengths(paged_kv_indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> list[int]:
    pages = (paged_kv_indptr[1:] - paged_kv_indptr[:-1]).tolist()
    last = last_page_len.tolist()
    return [0 if n == 0 else (n - 1) * page_size + lp for n, lp in zip(pages, last)]


def softmax_attention(scores: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the keys of ``scores`` [heads, q, kv] (-inf where masked) applied to ``v``
    [kv, heads, d]: (out [q, heads, d], lse [q, heads]). ``sink`` (broadcastable to [heads, q]):
    one more logit per row that joins the denominator and has no value. A row with no visible
    key (or no keys) gives 0 and lse -inf (with a sink: lse = the sink), as the kernels do; the
    LSE is base 2, FlashInfer's convention, and includes the sink."""
    heads, rows, _ = scores.shape
    if sink is not None:
        # the sink as a key whose value is 0: the same softmax, one column wider
        column = sink.to(scores.dtype).expand(heads, rows).unsqueeze(-1)
        scores = torch.cat([scores, column], dim=-1)
        v = torch.cat([v, v.new_zeros(1, *v.shape[1:])], dim=0)
    if scores.shape[-1] == 0:
        return (scores.new_zeros(rows, heads, v.shape[-1]), scores.new_full((rows, heads), -math.inf))
    row_max = scores.amax(dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
    denom = probs.sum(dim=-1, keepdim=True)
    weights = torch.where(denom > 0, probs / denom.clamp_min(1e-30), torch.zeros_like(probs))
    d = denom.squeeze(-1)
    lse = torch.where(d > 0, row_max.squeeze(-1) + d.log(), torch.full_like(d, -math.inf)) / math.log(2.0)
    return torch.einsum("hqk,khd->qhd", weights, v), lse.transpose(0, 1)


def reference_attention(
    spec: VariantSpec,
    q: torch.Tensor,
    paged_kv_cache,
    qo_indptr: torch.Tensor,
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    paged_kv_last_page_len: torch.Tensor,
    args: Mapping[str, Any] | None = None,
    *,
    kv_layout: str = "NHD",
    sm_scale: float | None = None,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    return_lse: bool = False,
):
    """Dense float32 attention for ``spec`` over a paged KV cache; returns [total_q, H, D_vo]."""
    args = dict(args or {})
    k_pages, v_pages = split_kv_cache(paged_kv_cache, kv_layout)
    page_size = k_pages.shape[1]
    num_qo_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pages.shape[2]
    group = num_qo_heads // num_kv_heads
    base_scale = sm_scale if sm_scale is not None else (
        spec.sm_scale if spec.sm_scale is not None else 1.0 / math.sqrt(head_dim))
    scale = base_scale * (q_scale if q_scale is not None else 1.0) * (k_scale if k_scale is not None else 1.0)
    qo = qo_indptr.tolist()
    kvp = paged_kv_indptr.tolist()
    kv_lens = kv_lengths(paged_kv_indptr, paged_kv_last_page_len, page_size)
    out = torch.zeros(q.shape[0], num_qo_heads, v_pages.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], num_qo_heads), -math.inf, dtype=torch.float32, device=q.device)
    kv_row_base = 0
    for b in range(len(qo) - 1):
        qo_len, kv_len = qo[b + 1] - qo[b], kv_lens[b]
        if qo_len == 0:
            kv_row_base += kv_len
            continue
        pages = paged_kv_indices[kvp[b]:kvp[b + 1]].long()
        k = k_pages[pages].reshape(-1, num_kv_heads, k_pages.shape[-1])[:kv_len].float()
        v = v_pages[pages].reshape(-1, num_kv_heads, v_pages.shape[-1])[:kv_len].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qb = q[qo[b]:qo[b + 1]].float()
        grid = RequestGrid(b, qo_len, kv_len, qo[b], kv_row_base, num_qo_heads, num_kv_heads, q.device)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        scores = transform_logits(spec, grid, args, scores)
        mask = mask_for_request(spec, grid, args)
        out[qo[b]:qo[b + 1]], lse[qo[b]:qo[b + 1]] = softmax_attention(scores.masked_fill(~mask, -math.inf), v,
                                                                       sink_for_request(spec, grid, args))
        kv_row_base += kv_len
    if v_scale is not None:
        out = out * v_scale
    return (out, lse) if return_lse else out
