"""A spec's typed trees as FlexAttention ``mask_mod`` / ``score_mod``, and the block masks of a batch.

The flex route (flex_wrapper.py) runs a spec through ``torch.nn.attention.flex_attention``
instead of a generated FlashInfer module: no nvcc, no cache, any device torch runs Flex on.
This module holds what is specific to Flex:

* :class:`FlexLayout`: where each request's queries and (gathered) keys sit in the tensors
  Flex sees, as small per-request tables on the device. Prefill and ragged batches are *packed*
  (Flex batch 1, requests back to back, a request check in the mask); decode batches are *one
  Flex batch row per request* (one query, the request's keys from kv index 0), since a packed
  query block of 128 decode rows would visit the keys of 128 requests.
* :func:`make_mods`: the mask (and logits transform) evaluated by ``evaluate.Evaluator`` on
  builtins derived from Flex's ``(b, h, q_idx, kv_idx)``. The evaluator is the reference's
  own, so ints follow exactly the semantics codegen.py promises (floor ``//`` and ``%``, 0 for
  a zero divisor, clamped tensor indices). Spec scalars are captured as 0-d tensors so that a
  new value does not recompile the kernel.
* block masks: from the interval planner's per-row key intervals where they are known
  (:func:`blocks_from_intervals`: full blocks skip the mask, partial ones evaluate it), else by
  evaluating the mask over the blocks each request can reach (:func:`blocks_from_mask`).
* :func:`flex_call`: flex_attention compiled with dynamic shapes (inductor on CUDA, dynamo
  with the eager backend on CPU), recorded for autograd only when an input requires grad, LSE
  through ``return_aux``. (Without ``compile=True`` the flex route computes in flex_dense.py.)

A spec's learned sink (a per-head logit in the softmax denominator) applies after the call, from
the LSE this module returns: ``o *= sigmoid(lse - sink[h])``, ``lse = logaddexp(lse, sink[h])``
(flex_wrapper's _finish).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..lang.evaluate import Evaluator
from ..lang.nodes import Name, Type, names_used
from ..lang.reads import HEAD_NAMES
from ..lang.values import VariantSpec

BLOCK = 128  # Flex's block size for queries and keys; lengths are padded to a multiple of it
EVAL_CHUNK = 1 << 22  # mask elements evaluated per step when block masks come from the mask
RECOMPILE_LIMIT = 64  # compiled graphs kept per spec and layout (see _compiled), while a flex route calls it

log = logging.getLogger("variantgen.wrappers.flex_blocks")


def flex_problem() -> str | None:
    """Why this torch cannot run the flex route, or None."""
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError as e:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention ({e}); the flex route needs " \
               "torch >= 2.5"
    if not hasattr(fa, "BlockMask") or not hasattr(fa.BlockMask, "from_kv_blocks"):
        return f"torch {torch.__version__}: flex_attention lacks BlockMask.from_kv_blocks (torch >= 2.5 has it)"
    if "enable_gqa" not in inspect.signature(fa.flex_attention).parameters:
        return f"torch {torch.__version__}: flex_attention has no enable_gqa (GQA needs torch >= 2.5)"
    if not torch._dynamo.is_dynamo_supported():
        return f"torch {torch.__version__}: dynamo is not supported on this Python, and flex_attention needs it"
    return None


def device_problem(device: torch.device, head_dim_qk: int, head_dim_vo: int) -> str | None:
    """Why Flex cannot run these head dims on ``device``, or None."""
    if device.type not in ("cuda", "cpu"):
        return f"device {device}: the flex route runs on CUDA and CPU devices"
    if device.type == "cuda" and min(head_dim_qk, head_dim_vo) < 16:
        return (f"head_dim_qk={head_dim_qk}, head_dim_vo={head_dim_vo}: Flex's CUDA kernel needs head dims of at "
                "least 16")
    return None


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class FlexLayout:
    """How a planned batch sits in the tensors Flex sees; tables on the device.

    Per request r: ``qo_len``, ``kv_len`` (the caller's lengths), ``q_start`` (its first row in
    q, packed only), ``kv_row_base`` (the caller's global key row of kv_pos 0), ``key_start``
    (Flex kv index of its first gathered key; 0 in per-request layouts), ``key_base`` (kv_pos of
    that key: plan() gathers only the keys some query can see), ``key_count`` (keys gathered).
    Packed only: ``q_request`` [q_len] and ``key_request`` [kv_len], the request of every Flex
    row (-1 / -2 for padding rows, which never match), and ``q_row_start`` (the caller's row of
    the request's first query: q_start is its Flex row).

    Packed layouts start every request's queries and keys at a multiple of BLOCK (see
    align_starts): no block holds two requests' rows or keys, so no kernel tile ever puts one
    request's values next to another's rows.
    """

    packed: bool
    batch: int  # Flex batch: 1 (packed) or the number of requests
    q_len: int  # Flex query length (padded to BLOCK when packed; 1 per request otherwise)
    kv_len: int  # Flex key length (padded to BLOCK)
    num_qo_heads: int
    num_kv_heads: int
    qo_len: torch.Tensor
    kv_len_req: torch.Tensor
    q_start: torch.Tensor
    kv_row_base: torch.Tensor
    key_start: torch.Tensor
    key_base: torch.Tensor
    key_count: torch.Tensor
    q_request: torch.Tensor | None = None
    key_request: torch.Tensor | None = None
    q_row_start: torch.Tensor | None = None

    def builtins(self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(visible-by-layout, builtin environment) at Flex indices ``(b, h, q, kv)`` (broadcastable
        int tensors: vmapped scalars inside Flex, grids when block masks are evaluated). The
        layout part is False on padding rows and keys of another request."""
        i64 = torch.int64
        b, h, q, kv = b.to(i64), h.to(i64), q.to(i64), kv.to(i64)
        if self.packed:
            assert self.q_request is not None and self.key_request is not None
            r_raw = self.q_request[q].to(i64)
            r = r_raw.clamp(min=0)
            valid = (r_raw >= 0) & (self.key_request[kv].to(i64) == r_raw)
            assert self.q_row_start is not None
            q_idx = q - self.q_start[r]
            kv_pos = kv - self.key_start[r] + self.key_base[r]
            q_row = q_idx + self.q_row_start[r]
        else:
            r = b
            valid = kv < self.key_count[r]
            q_idx = q
            kv_pos = kv + self.key_base[r]
            q_row = r
        qo_len, kv_len = self.qo_len[r].to(i64), self.kv_len_req[r].to(i64)
        q_pos = kv_len - qo_len + q_idx
        base = self.kv_row_base[r].to(i64)
        group = self.num_qo_heads // self.num_kv_heads
        env = {"q_pos": q_pos, "kv_pos": kv_pos, "q_idx": q_idx, "q_row": q_row, "kv_row": base + kv_pos,
               "q_kv_row": base + q_pos, "request": r, "qo_head": h, "kv_head": h // group, "qo_len": qo_len,
               "kv_len": kv_len}
        return valid, env


def align_starts(lengths: list[int]) -> list[int]:
    """Each request's first Flex row (or key) when every request starts at a multiple of BLOCK,
    then the total length (a multiple of BLOCK, at least one block).

    Why: Flex computes whole tiles, and a masked key still enters a tile's P.V product with
    weight 0 - where its value is NaN or inf, 0 x NaN = NaN lands on every row of the tile.
    With requests packed back to back, a tile straddling two requests would carry one request's
    bad value into the other's rows; aligned, a block's rows and keys belong to one request,
    and a block pair of two requests is never visited (the block lists hold only blocks a row
    can see). The cost: up to BLOCK - 1 padding rows and keys per request, in blocks that hold
    a request's rows anyway (no extra block pairs are visited)."""
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += -(-n // BLOCK) * BLOCK
    return starts + [max(at, BLOCK)]


class _FlexEvaluator(Evaluator):
    """The reference evaluator with spec scalars read from 0-d tensors (captured by the mods,
    so a new value is a new input of the compiled kernel, not a recompile)."""

    def _name(self, node: Name) -> torch.Tensor:
        if node.id in self.env or node.id == "logits":
            return super()._name(node)
        return self.args[node.id]


def capture_args(spec: VariantSpec, args: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Spec tensors as given, scalars as 0-d tensors of their type on ``device``."""
    out: dict[str, torch.Tensor] = {t.name: args[t.name] for t in spec.tensors if t.name in args}
    dtypes = {Type.BOOL: torch.bool, Type.INT: torch.int64, Type.FLOAT: torch.float32}
    for s in spec.scalars:
        out[s.name] = torch.tensor(args.get(s.name, s.default), dtype=dtypes[s.ty], device=device)
    return out


@dataclass(frozen=True)
class FlexMods:
    mask_mod: Callable
    score_mod: Callable | None  # None: the spec has no logits transform


def make_mods(spec: VariantSpec, layout: FlexLayout, args: Mapping[str, torch.Tensor]) -> FlexMods:
    """The spec's mask and logits transform as Flex mods over ``layout`` (``args`` from
    capture_args). A new closure per call costs no recompile
    (bench/results/2026-12-01-h200/flex-compile-standalone.log)."""

    def mask_mod(b, h, q_idx, kv_idx):
        valid, env = layout.builtins(b, h, q_idx, kv_idx)
        return valid & _FlexEvaluator(spec, env, args).ev(spec.mask).to(torch.bool)

    score_mod = None
    if spec.logits is not None:
        logits = spec.logits

        def score_mod(score, b, h, q_idx, kv_idx):
            # float32 in and out: Flex traces the mod with scores of the query's dtype, and a cast
            # back to it would round the transformed logits to 16 bits inside the kernel.
            _, env = layout.builtins(b, h, q_idx, kv_idx)
            return _FlexEvaluator(spec, env, args, logits=score.to(torch.float32)).as_float(logits)

    return FlexMods(mask_mod, score_mod)


def mask_reads_heads(spec: VariantSpec) -> bool:
    return bool(names_used(spec.mask) & HEAD_NAMES)


# ----------------------------------------------------------------------------- block masks


@dataclass(frozen=True)
class Blocks:
    """A batch's block lists (each query block's visited kv blocks), kept in BlockMask's ordered
    form: ``kv_num`` / ``kv_idx`` the partial blocks (the mask is evaluated there), ``full_num`` /
    ``full_idx`` the full ones (every element visible: the mask is skipped). Shapes [B, H, nq] and
    [B, H, nq, nkv], int32; H is 1 unless the mask reads the head."""

    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    full_num: torch.Tensor
    full_idx: torch.Tensor

    @classmethod
    def from_dense(cls, partial: torch.Tensor, full: torch.Tensor) -> Blocks:
        """From dense bool flags [B, H, nq, nkv]."""
        return cls(*_ordered(partial), *_ordered(full))

    def block_mask(self, mask_mod: Callable, layout: FlexLayout, backward: bool = False):
        from torch.nn.attention.flex_attention import BlockMask

        # Inference needs no query-block lists (the backward pass's): skip their dense transpose.
        extra = {"compute_q_blocks": False} if _from_kv_blocks_takes_q() and not backward else {}
        return BlockMask.from_kv_blocks(self.kv_num, self.kv_idx, self.full_num, self.full_idx,
                                        BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mask_mod,
                                        seq_lengths=(layout.q_len, layout.kv_len), **extra)

    def counts(self) -> dict[str, int]:
        """Block pairs visited with the mask, without it, and in all (for plan_stats)."""
        total = self.kv_num.numel() * self.kv_idx.shape[-1]
        return {"partial": int(self.kv_num.sum()), "full": int(self.full_num.sum()), "total": total}

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full) as dense bool [B, H, nq, nkv] (tests, explain)."""
        nkv = self.kv_idx.shape[-1]
        return _dense(self.kv_num, self.kv_idx, nkv), _dense(self.full_num, self.full_idx, nkv)


def _dense(num: torch.Tensor, idx: torch.Tensor, nkv: int) -> torch.Tensor:
    used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    out = torch.zeros(*idx.shape[:-1], nkv + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(-1, torch.where(used, idx.long(), nkv), True)
    return out[..., :nkv]


@functools.cache
def _from_kv_blocks_takes_q() -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense block flags [B, H, nq, nkv] -> (counts [B, H, nq], block indices [B, H, nq, nkv]) int32,
    the visited blocks of each query block first, ascending."""
    d = dense.to(torch.int32)
    return (d.sum(-1).to(torch.int32).contiguous(),
            torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32).contiguous())


def _count_ranges(shape: tuple[int, int, int], b: torch.Tensor, qb: torch.Tensor, first: torch.Tensor,
                  last: torch.Tensor) -> torch.Tensor:
    """int32 [B, nq, nkv]: per (b, query block, kv block) how many of the rows (b, qb) have the kv
    block in [first, last] (rows with last < first count nowhere), by a difference array."""
    batch, nq, nkv = shape
    diff = torch.zeros(batch * nq * (nkv + 1), dtype=torch.int32, device=b.device)
    ok = last >= first
    row = (b * nq + qb) * (nkv + 1)
    ones = ok.to(torch.int32)
    diff.scatter_add_(0, row + first.clamp(0, nkv), ones)
    diff.scatter_add_(0, row + (last + 1).clamp(0, nkv), -ones)
    return diff.view(batch, nq, nkv + 1).cumsum(-1, dtype=torch.int32)[..., :nkv]


def blocks_from_intervals(layout: FlexLayout, rows: RowBlocks) -> Blocks:
    """Block lists from per-row key intervals (the planner's): a kv block is visited by a query
    block if some row's interval reaches it, and full if every row of the query block that
    belongs to a request sees all of it exactly."""
    shape = (layout.batch, -(-layout.q_len // BLOCK), layout.kv_len // BLOCK)
    qb = rows.q // BLOCK
    reach = _count_ranges(shape, rows.b, qb, rows.lo // BLOCK, rows.hi // BLOCK)
    lo_full = -(-rows.lo // BLOCK)
    hi_full = torch.div(rows.hi + 1, BLOCK, rounding_mode="floor") - 1
    exact = rows.exact & (rows.hi >= rows.lo)
    cover = _count_ranges(shape, rows.b, qb, lo_full, torch.where(exact, hi_full, lo_full - 1))
    members = torch.zeros(shape[0] * shape[1], dtype=torch.int32, device=qb.device)
    members.scatter_add_(0, rows.b * shape[1] + qb, torch.ones_like(qb, dtype=torch.int32))
    members = members.view(shape[0], shape[1], 1)
    full = (cover == members) & (members > 0)
    partial = (reach > 0) & ~full
    return Blocks.from_dense(partial.unsqueeze(1), full.unsqueeze(1))


@dataclass(frozen=True)
class RowBlocks:
    """The rows of a batch in Flex coordinates, for blocks_from_intervals: Flex batch row ``b``,
    query index ``q``, visible Flex key range [lo, hi] (hi < lo: none) and whether every key of it
    is visible (int64 / bool, one entry per query row that belongs to a request)."""

    b: torch.Tensor
    q: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    exact: torch.Tensor


def blocks_from_mask(layout: FlexLayout, rows: RowBlocks, mods: FlexMods, spec: VariantSpec) -> Blocks:
    """Block lists by evaluating the mask on every block some row's key range reaches (rows.lo /
    rows.hi: the keys a row may see at all, e.g. its request's gathered keys): visited where any
    element is visible, full where all are (per head when the mask reads the head)."""
    shape = (layout.batch, -(-layout.q_len // BLOCK), layout.kv_len // BLOCK)
    reach = _count_ranges(shape, rows.b, rows.q // BLOCK, rows.lo // BLOCK, rows.hi // BLOCK) > 0
    heads = layout.num_qo_heads if mask_reads_heads(spec) else 1
    partial = torch.zeros(shape[0], heads, shape[1], shape[2], dtype=torch.bool, device=reach.device)
    full = torch.zeros_like(partial)
    cand = reach.nonzero()  # [C, 3]: (b, query block, kv block)
    dev = reach.device
    offs = torch.arange(BLOCK, device=dev)
    h = torch.arange(heads, device=dev).view(heads, 1, 1, 1)
    step = max(1, EVAL_CHUNK // (BLOCK * BLOCK * heads))
    for at in range(0, cand.shape[0], step):
        c = cand[at:at + step]
        b = c[:, 0].view(1, -1, 1, 1)
        q = (c[:, 1] * BLOCK).view(1, -1, 1, 1) + offs.view(1, 1, -1, 1)
        kv = (c[:, 2] * BLOCK).view(1, -1, 1, 1) + offs.view(1, 1, 1, -1)
        real = _real_rows(layout, b, q)  # rows of no request neither make a block visited nor spoil full
        vis = mods.mask_mod(b, h, q.clamp(max=layout.q_len - 1), kv).expand(heads, -1, BLOCK, BLOCK)
        anyv = (vis & real).flatten(2).any(-1)  # [heads, C]
        allv = (vis | ~real).flatten(2).all(-1) & real.flatten(2).any(-1)
        partial[c[:, 0], :, c[:, 1], c[:, 2]] = (anyv & ~allv).t()
        full[c[:, 0], :, c[:, 1], c[:, 2]] = allv.t()
    return Blocks.from_dense(partial, full)


def _real_rows(layout: FlexLayout, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Whether Flex query row (b, q) belongs to a request (broadcast over the key axis)."""
    if layout.packed:
        assert layout.q_request is not None
        inside = q < layout.q_len
        return inside & (layout.q_request[q.clamp(max=layout.q_len - 1)] >= 0)
    return (q < layout.q_len).expand_as(b + q)


# ----------------------------------------------------------------------------- the call


@functools.cache
def _compiled(backend: str, key: tuple) -> Callable:
    """flex_attention compiled for one spec and layout (``key``), behind a code object of its own:
    dynamo keeps compiled graphs per code object and checks their guards one by one on every
    call, so each spec's few graphs (dynamic shapes, sizes of 1 specialized) stay a short list
    instead of one list for every spec of the process."""
    import types

    from torch.nn.attention.flex_attention import flex_attention

    def call(q, k, v, kwargs):
        return flex_attention(q, k, v, **kwargs)

    # said before the wait: the first run() of a spec and layout traces (and on CUDA compiles) Flex
    log.info("flex route: the first run() of this spec and layout traces FlexAttention with torch.compile "
             "(%s backend): a few seconds, once per process", backend)
    code = call.__code__.replace(co_name=f"flex_attention_{len(key)}_{abs(hash(key)) % 10**8}")
    fn = types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)
    # Dynamic shapes: one or two compiles serve every batch; lengths are padded to BLOCK, where
    # the dynamic kernel ran within 9% of a static one (a non-multiple ran 2x slower).
    return torch.compile(fn, backend=backend, dynamic=True)


def flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: FlexMods, block_mask: Any, scale: float,
              compiled: bool, want_lse: bool, key: tuple, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention over [B, H, L, D] tensors: (out [B, Hq, Lq, Dv] in q's dtype, natural-log LSE
    [B, Hq, Lq] float32, or an empty tensor without ``want_lse``). ``compiled``: inductor's kernel;
    else dynamo with the eager backend (the dense math; CPU's default, since torch's compiled CPU
    kernel has no LSE). ``key``: what the compiled graphs are kept under (see _compiled). ``grad``:
    record the call for autograd (Flex's backward pass; the block mask needs its query-block lists)."""
    from torch.nn.attention import flex_attention as fa

    fn = _compiled("inductor" if compiled else "eager", key)
    kwargs: dict[str, Any] = dict(score_mod=mods.score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=q.shape[1] != k.shape[1])
    aux = getattr(fa, "AuxRequest", None)  # torch >= 2.9; return_lse before
    if want_lse:
        kwargs.update({"return_aux": aux(lse=True)} if aux is not None else {"return_lse": True})
    limit = {"recompile_limit": RECOMPILE_LIMIT} if hasattr(torch._dynamo.config, "recompile_limit") else \
        {"cache_size_limit": RECOMPILE_LIMIT}
    with torch.set_grad_enabled(grad), torch._dynamo.config.patch(**limit):
        result = fn(q, k, v, kwargs)
    if not want_lse:
        return result, result.new_empty(0, dtype=torch.float32)
    out, lse = result
    return out, (lse.lse if aux is not None else lse).to(torch.float32)

