"""A dense float32 torch reference derived from the same expression trees as the kernel.

Every GPU test compares against this. It evaluates the mask (the logits transform, the sink
logit of each head) for each request over a [heads, qo_len, kv_len] grid with the semantics
codegen.py promises: Python-style ``//`` and ``%`` (0 for a zero divisor), float ``/``,
``bit(x, i)`` on the 32-bit two's complement (false for i outside 0..31), offset row indices
(``kv_row - 1``) clamped to the rows of their request, other indices clamped to the
tensor's extent. Integers are evaluated in int64; expressions whose values leave the int32
range are outside the language's contract.

It runs on whatever device the inputs are on (CPU in CI, the GPU in GPU tests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .expr import REQUEST_ROWS, Binary, Call, Cond, Const, Index, Name, Node, Type, Unary, row_index
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


class _Evaluator:
    def __init__(self, spec: VariantSpec, grid: RequestGrid, args: Mapping[str, Any],
                 logits: torch.Tensor | None = None):
        self.spec = spec
        self.args = args
        self.logits = logits
        g = grid
        dev = g.device
        i64 = torch.int64
        q_local = torch.arange(g.qo_len, device=dev, dtype=i64).view(1, -1, 1)
        kv_pos = torch.arange(g.kv_len, device=dev, dtype=i64).view(1, 1, -1)
        q_pos = q_local + (g.kv_len - g.qo_len)
        qo_head = torch.arange(g.num_qo_heads, device=dev, dtype=i64).view(-1, 1, 1)
        self.env = {
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
        self.device = dev

    @classmethod
    def from_env(cls, spec: VariantSpec, env: Mapping[str, torch.Tensor], args: Mapping[str, Any]) -> _Evaluator:
        """An evaluator over caller-given builtin tensors (e.g. one entry per query row)."""
        self = cls.__new__(cls)
        self.spec, self.args, self.logits = spec, args, None
        self.env = dict(env)
        self.device = next(iter(env.values())).device
        return self

    def ev(self, node: Node) -> torch.Tensor:
        return getattr(self, "_" + type(node).__name__.lower())(node)

    def _as_float(self, node: Node) -> torch.Tensor:
        return self.ev(node).to(torch.float32)

    def _scalar_tensor(self, value, dtype: torch.dtype) -> torch.Tensor:
        # One device tensor per distinct value: creating one is a host-to-device copy, and
        # the planner evaluates the same few constants many times per plan().
        key = (value, dtype)
        cache = self.__dict__.setdefault("_scalars", {})
        if key not in cache:
            cache[key] = torch.tensor(value, dtype=dtype, device=self.device)
        return cache[key]

    def _const(self, node: Const) -> torch.Tensor:
        v = node.value
        dtype = torch.bool if isinstance(v, bool) else torch.int64 if isinstance(v, int) else torch.float32
        return self._scalar_tensor(v, dtype)

    def _name(self, node: Name) -> torch.Tensor:
        if node.id == "logits":
            assert self.logits is not None
            return self.logits
        if node.id in self.env:
            return self.env[node.id]
        scalar = next(s for s in self.spec.scalars if s.name == node.id)
        value = self.args.get(node.id, scalar.default)
        dtype = {Type.BOOL: torch.bool, Type.INT: torch.int64, Type.FLOAT: torch.float32}[scalar.ty]
        return self._scalar_tensor(value, dtype)

    def _index(self, node: Index) -> torch.Tensor:
        tensor = self.args[node.tensor]
        shape = next(t.shape for t in self.spec.tensors if t.name == node.tensor)
        idx = []
        for k, (dim, sub) in enumerate(zip(shape, node.indices)):
            ref = row_index(sub) if isinstance(dim, str) else None
            if ref is not None and ref.offsets and ref.builtin in REQUEST_ROWS:
                # first row of the request + (position + offset) clamped to the request's rows
                position, count = (self.env[n] for n in REQUEST_ROWS[ref.builtin])
                local = position + sum(sign * self.ev(term).to(torch.int64) for sign, term in ref.offsets)
                i = self.env[ref.builtin] - position + torch.minimum(local.clamp_min(0), count - 1)
            else:
                i = self.ev(sub).to(torch.int64)
            idx.append(i.clamp(0, tensor.shape[k] - 1))
        idx = torch.broadcast_tensors(*idx)
        value = tensor.to(self.device)[tuple(idx)]
        return value.to(torch.int64) if tensor.dtype == torch.int32 else value.to(torch.float32)

    def _unary(self, node: Unary) -> torch.Tensor:
        x = self.ev(node.operand)
        if node.op == "not":
            return ~x
        return -x if node.op == "-" else x

    def _binary(self, node: Binary) -> torch.Tensor:
        op = node.op
        if op in ("and", "or"):
            a, b = self.ev(node.left), self.ev(node.right)
            return a & b if op == "and" else a | b
        float_math = node.left.ty is Type.FLOAT or node.right.ty is Type.FLOAT or op == "/"
        a = self._as_float(node.left) if float_math else self.ev(node.left)
        b = self._as_float(node.right) if float_math else self.ev(node.right)
        if op == "<":
            return a < b
        if op == "<=":
            return a <= b
        if op == ">":
            return a > b
        if op == ">=":
            return a >= b
        if op == "==":
            return a == b
        if op == "!=":
            return a != b
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return a / b
        zero = b == 0
        safe_b = torch.where(zero, torch.ones_like(b), b)
        if op == "//":
            return torch.where(zero, torch.zeros_like(a), torch.div(a, safe_b, rounding_mode="floor"))
        if op == "%":
            return torch.where(zero, torch.zeros_like(a), torch.remainder(a, safe_b))
        raise AssertionError(op)

    def _call(self, node: Call) -> torch.Tensor:
        f = node.func
        if f in ("min", "max"):
            vals = [self._as_float(a) if node.ty is Type.FLOAT else self.ev(a) for a in node.args]
            out = vals[0]
            for v in vals[1:]:
                out = torch.minimum(out, v) if f == "min" else torch.maximum(out, v)
            return out
        if f == "abs":
            return self.ev(node.args[0]).abs()
        if f == "bit":
            return bit(self.ev(node.args[0]), self.ev(node.args[1]))
        x = self._as_float(node.args[0])
        if f == "float":
            return x
        return {"tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
                "sigmoid": torch.sigmoid}[f](x)

    def _cond(self, node: Cond) -> torch.Tensor:
        test = self.ev(node.test)
        if node.ty is Type.FLOAT:
            return torch.where(test, self._as_float(node.then), self._as_float(node.orelse))
        return torch.where(test, self.ev(node.then), self.ev(node.orelse))


def bit(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """The language's ``bit(x, i)`` on int64 tensors: bit i of x's low 32 bits (its int32 two's
    complement, as the kernel holds it), false for i outside 0..31."""
    in_range = (i >= 0) & (i < 32)
    word = torch.bitwise_and(x, 0xFFFFFFFF)
    return in_range & (torch.bitwise_and(torch.bitwise_right_shift(word, i.clamp(0, 31)), 1) == 1)


def mask_for_request(spec: VariantSpec, grid: RequestGrid, args: Mapping[str, Any]) -> torch.Tensor:
    """Bool mask broadcastable to [num_qo_heads, qo_len, kv_len]: True = key visible."""
    m = _Evaluator(spec, grid, args).ev(spec.mask)
    return m.expand(grid.num_qo_heads, grid.qo_len, grid.kv_len)


def sink_for_request(spec: VariantSpec, grid: RequestGrid, args: Mapping[str, Any]) -> torch.Tensor | None:
    """The spec's sink logit of each query head of one request, float32 [num_qo_heads, 1]
    (broadcast over the request's rows); None for a spec without a sink."""
    if spec.sink is None:
        return None
    value = _Evaluator(spec, grid, args)._as_float(spec.sink)
    return value.expand(grid.num_qo_heads, 1, 1).reshape(grid.num_qo_heads, 1)


def transform_logits(spec: VariantSpec, grid: RequestGrid, args: Mapping[str, Any],
                     scores: torch.Tensor) -> torch.Tensor:
    if spec.logits is None:
        return scores
    out = _Evaluator(spec, grid, args, logits=scores)._as_float(spec.logits)
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
