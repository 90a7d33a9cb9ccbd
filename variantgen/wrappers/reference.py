"""A dense float32 torch reference derived from the same expression trees as the kernel.

Every GPU test compares against this. It evaluates the mask (the logits transform, the sink
logit of each head) for each request over a [heads, qo_len, kv_len] grid with evaluate.Evaluator, whose semantics
are the ones codegen.py promises the kernels have.

It runs on whatever device the inputs are on (CPU in CI, the GPU in GPU tests). Its inputs are
checked as the wrappers check theirs (checks.py), so a bad one raises a LaunchError that names it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import LaunchError
from ..core.flags import check_flags
from ..lang.evaluate import Evaluator
from ..lang.values import VariantSpec
from ..planning.plan import Batch
from .checks import (
    check_known,
    check_kv_layout,
    check_paged_arguments,
    check_pages,
    check_scale_values,
    check_spec_args,
    paged_batch,
    read_bounds,
    spec_dims,
    split_paged_cache,
)

WHERE = "reference_attention()"  # (its messages' prefix)


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
    check_kv_layout(kv_layout, WHERE)
    k, v = split_paged_cache(WHERE, paged_kv_cache)
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def _check_inputs(q: Any, k_pages: torch.Tensor, v_pages: torch.Tensor, qo_indptr: Any, paged_kv_indptr: Any,
                  paged_kv_indices: Any, paged_kv_last_page_len: Any, kv_layout: str,
                  ) -> tuple[Batch, list[int], list[int]]:
    """reference_attention's q, cache (``k_pages`` / ``v_pages`` from split_kv_cache) and batch,
    checked with the wrappers' checks: the Batch and host copies of qo_indptr and paged_kv_indptr."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_floating_point():
        got = f"{q.dtype} tensor of shape {list(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise LaunchError(f"{WHERE}: `q`: expected a floating-point tensor [total_q, num_qo_heads, head_dim_qk], "
                          f"got {got}")
    layout = "[pages, page_size, kv_heads, head_dim]" if kv_layout == "NHD" else \
        "[pages, kv_heads, page_size, head_dim]"
    for name, t in (("k_cache", k_pages), ("v_cache", v_pages)):
        if not t.is_floating_point():
            raise LaunchError(f"{WHERE}: `{name}`: expected a floating-point tensor {layout}, got {t.dtype}")
        if t.device != q.device:
            raise LaunchError(f"{WHERE}: `{name}` is on {t.device}, expected {q.device} (the device of q)")
    if v_pages.shape[:3] != k_pages.shape[:3]:  # (k_pages / v_pages are NHD: the caller's shapes for the message)
        shapes = [list(t.transpose(1, 2).shape if kv_layout == "HND" else t.shape) for t in (k_pages, v_pages)]
        raise LaunchError(f"{WHERE}: `k_cache` {shapes[0]} and `v_cache` {shapes[1]}: expected the same pages, page "
                          f"size and heads ({layout})")
    if q.shape[2] != k_pages.shape[3]:
        raise LaunchError(f"{WHERE}: `q`: head_dim_qk={q.shape[2]}, but `k_cache` has head_dim={k_pages.shape[3]}")
    num_pages, page_size, num_kv_heads = k_pages.shape[:3]
    check_paged_arguments(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, q.shape[1],
                          num_kv_heads, page_size, where=WHERE)
    qo, kvp, last = qo_indptr.tolist(), paged_kv_indptr.tolist(), paged_kv_last_page_len.tolist()
    batch = paged_batch(qo, kvp, last, paged_kv_indices.numel(), q.shape[1], num_kv_heads, page_size, where=WHERE)
    check_pages(WHERE, read_bounds(paged_kv_indices, kvp[-1]), paged_kv_indices, num_pages, "the KV cache")
    if q.shape[0] != batch.total_q:
        raise LaunchError(f"{WHERE}: `q`: expected shape [total_q={batch.total_q}, num_qo_heads, head_dim_qk], got "
                          f"{list(q.shape)}")
    return batch, qo, kvp


def softmax_attention(scores: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the keys of ``scores`` [heads, q, kv] (-inf where masked) applied to ``v``
    [kv, heads, d]: (out [q, heads, d], lse [q, heads]). ``sink`` (broadcastable to [heads, q]):
    one more logit per row that joins the denominator and has no value. A row with no visible
    key (or no keys) gives 0 and lse -inf (with a sink: lse = the sink), as the kernels do; the
    LSE is base 2, FlashInfer's convention, and includes the sink.

    Non-finite input means what it says: a NaN score of a visible key makes its row NaN (out and
    LSE), and a NaN or inf value of a visible key reaches the row as weight x value (NaN / inf);
    a masked key (score -inf) never contributes, whatever its value holds. Differentiable."""
    heads, rows, _ = scores.shape
    if sink is not None:
        # the sink as a key whose value is 0: the same softmax, one column wider
        column = sink.to(scores.dtype).expand(heads, rows).unsqueeze(-1)
        scores = torch.cat([scores, column], dim=-1)
        v = torch.cat([v, v.new_zeros(1, *v.shape[1:])], dim=0)
    if scores.shape[-1] == 0:
        return (scores.new_zeros(rows, heads, v.shape[-1]), scores.new_full((rows, heads), -math.inf))
    nan_score = torch.isnan(scores)
    nan_row = nan_score.any(dim=-1)  # [heads, q]: masked keys are -inf here, so only visible ones count
    scores = scores.masked_fill(nan_score, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
    denom = probs.sum(dim=-1, keepdim=True)
    weights = torch.where(denom > 0, probs / denom.clamp_min(1e-30), torch.zeros_like(probs))
    weights = weights.masked_fill(nan_row.unsqueeze(-1), math.nan)
    d = denom.squeeze(-1)
    # (log of the clamped sum: the branch not taken must not put an inf into the gradient)
    lse = torch.where(d > 0, row_max.squeeze(-1) + d.clamp_min(1e-30).log(), torch.full_like(d, -math.inf))
    lse = lse.masked_fill(nan_row, math.nan) / math.log(2.0)
    return _weighted_values(weights, scores > -math.inf, v), lse.transpose(0, 1)


def _weighted_values(weights: torch.Tensor, visible: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``weights`` [heads, q, kv] applied to ``v`` [kv, heads, d] -> [q, heads, d], where a
    non-finite value counts only for the rows that see its key: a plain product would give
    0 x NaN = NaN on every row, masked or not. Non-finite values (rare) are added one by one."""
    bad = ~torch.isfinite(v)
    out = torch.einsum("hqk,khd->qhd", weights, v.masked_fill(bad, 0.0))
    if not bool(bad.any()):
        return out
    k, h, c = bad.nonzero(as_tuple=True)
    w = weights[h, :, k]  # [n, q]
    part = torch.where(visible[h, :, k], w * v[k, h, c].unsqueeze(1), torch.zeros_like(w))
    rows, heads, dim = out.shape
    return out.reshape(rows, heads * dim).index_add(1, h * dim + c, part.t()).view(rows, heads, dim)


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
    """Dense float32 attention for ``spec`` over a paged KV cache; returns [total_q, H, D_vo]
    (with ``return_lse``: and the LSE, base 2). float64 inputs are computed in float64; the
    result is differentiable in q, the cache and float spec tensors (torch autograd). The
    arguments are the paged wrappers' (``args``: the spec's arguments by name), checked as they
    check them: LaunchError naming the argument."""
    k_pages, v_pages = split_kv_cache(paged_kv_cache, kv_layout)
    batch, qo, kvp = _check_inputs(q, k_pages, v_pages, qo_indptr, paged_kv_indptr, paged_kv_indices,
                                 paged_kv_last_page_len, kv_layout)
    args = {} if args is None else args
    if not isinstance(args, Mapping):
        raise LaunchError(f"{WHERE}: `args`: expected the spec's arguments by name (a dict), got {type(args).__name__}")
    check_known(spec, args, WHERE, also=" (by name in `args`)")
    args = check_spec_args(spec, args, spec_dims(batch), q.device, where=WHERE, device_of="q", contiguous=False)
    check_scale_values(WHERE, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    check_flags(WHERE, return_lse=return_lse)
    num_qo_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pages.shape[2]
    group = num_qo_heads // num_kv_heads
    base_scale = sm_scale if sm_scale is not None else (
        spec.sm_scale if spec.sm_scale is not None else 1.0 / math.sqrt(head_dim))
    scale = base_scale * (q_scale if q_scale is not None else 1.0) * (k_scale if k_scale is not None else 1.0)
    kv_lens = batch.kv_lens
    work = torch.float64 if q.dtype == torch.float64 else torch.float32  # (float64 in: gradient checks)
    out = torch.zeros(q.shape[0], num_qo_heads, v_pages.shape[-1], dtype=work, device=q.device)
    lse = torch.full((q.shape[0], num_qo_heads), -math.inf, dtype=work, device=q.device)
    kv_row_base = 0
    for b in range(len(qo) - 1):
        qo_len, kv_len = qo[b + 1] - qo[b], kv_lens[b]
        if qo_len == 0:
            kv_row_base += kv_len
            continue
        pages = paged_kv_indices[kvp[b]:kvp[b + 1]].long().to(k_pages.device)
        k = k_pages[pages].reshape(-1, num_kv_heads, k_pages.shape[-1])[:kv_len].to(work)
        v = v_pages[pages].reshape(-1, num_kv_heads, v_pages.shape[-1])[:kv_len].to(work)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qb = q[qo[b]:qo[b + 1]].to(work)
        grid = RequestGrid(b, qo_len, kv_len, qo[b], kv_row_base, num_qo_heads, num_kv_heads, q.device)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        scores = transform_logits(spec, grid, args, scores).to(work)  # (the evaluator computes floats in float32)
        mask = mask_for_request(spec, grid, args)
        out[qo[b]:qo[b + 1]], lse[qo[b]:qo[b + 1]] = softmax_attention(scores.masked_fill(~mask, -math.inf), v,
                                                                       sink_for_request(spec, grid, args))
        kv_row_base += kv_len
    if v_scale is not None:
        out = out * v_scale
    return (out, lse) if return_lse else out
