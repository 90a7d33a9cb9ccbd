"""The flex route: a spec served by torch's FlexAttention behind make_wrapper's API.

``make_wrapper(spec, workspace, ..., backend="flex", kind=...)`` returns a wrapper with the
plan()/run() signatures, argument checks and outputs of the FlashInfer routes (o in the
output dtype, the base-2 LSE with ``return_lse``, 0 / -inf for a row that sees no key) for the
paged prefill, ragged and decode kinds. No module is built: nothing needs nvcc, the cache or
flashinfer, and it runs wherever torch runs Flex (CUDA: the compiled Triton kernel; CPU: the
eager math, for laptops and CI). The spec's semantics come from the same expression trees as
the generated kernels (flex.py).

What plan() does (once per batch):

* reads the batch as the other routes do (wrapper.read_paged_batch, decode.read_decode_batch,
  ragged.read_ragged_batch: the same checks and messages), and its page list as they do
  (checks.PageGuard, its bounds read back with the plan: every entry of
  ``paged_kv_indices[:paged_kv_indptr[-1]]``, gathered or not, must be a page of run()'s cache;
  plan() refuses negative ones, run() the rest);
* with the interval planner on (the default where the spec's key intervals are known and
  plan() has the tensors they read; ``skip_tiles`` as for the FlashInfer wrappers) it evaluates
  each query row's key interval, gathers only the keys some query can see, and gives Flex its
  block mask directly (full blocks skip the mask, partial ones evaluate it). Without it, the
  block mask is found by evaluating the mask over the blocks each request can reach, in the
  first run() (the mask's arguments arrive there), and kept while run() gets the same ones;
* lays the batch out for Flex (flex.FlexLayout): prefill and ragged packed into one sequence,
  decode one Flex batch row per request; lengths padded to multiples of 128.

run() gathers the pages (or ragged rows) of those keys into one contiguous buffer per K and V
(Flex's paged-attention helper needs pages of its block size, 128, and caches use 1-64; on the
H200 the gather of the benchmark workload's K and V took 0.17 ms against a ~11 ms kernel, see
flex_base's _gather), calls Flex, and writes o / lse. run() is differentiable in q, k, v and float spec tensors
(Flex's backward pass where it runs compiled, on CUDA; the dense path of flex_dense.py without
compile=True, the CPU's default). No CUDA-graph mode (plan() and run() sync with the host).

This module holds the kinds' wrappers (FlexPrefillWrapper, FlexRaggedWrapper, FlexDecodeWrapper),
the route's factory (flex_config, make_flex_wrapper) and its probe (probe_flex); what the kinds
share - FlexConfig, FlexPlan and FlexWrapperBase - is flex_base.py.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import Any

import torch

from ..core.errors import BackendError, LaunchError
from ..core.flags import check_flags
from ..lang.library import resolve_spec
from ..lang.values import VariantSpec
from ..planning.plan import Batch, Plan, ScheduledPlan
from ..routing.capabilities import FLEX, KINDS, canonical_dtype, graph_problem
from . import flex_blocks as flex
from .base import TORCH_DTYPES
from .checks import check_plan_sizes
from .flex_base import FlexConfig, FlexPlan, FlexWrapperBase, same_values, values_of
from .flex_blocks import BLOCK, FlexLayout, RowBlocks
from .paged import read_paged_batch

# The flex route's dtypes (its capability table entry): FlashInfer's names plus fp32 (CPU users
# run float32 models); an fp8 KV cache is widened to the query dtype when gathered.
Q_DTYPES = FLEX.q_dtypes
KV_DTYPES = FLEX.kv_dtypes


def flex_dtype(value: Any, arg: str, allowed: tuple[str, ...]) -> str:
    """'bf16' / 'fp16' / 'fp32' / 'fp8_*' for a torch dtype or name; ValueError naming ``arg``."""
    try:
        name = canonical_dtype(value, arg)
    except ValueError:
        name = None
    if name not in allowed:
        raise ValueError(f"{arg}={value!r}: the flex route takes {list(allowed)}")
    return name


# How a flex plan lays out its work (ScheduledPlan.scheduled_by)
NO_CALL = "no Flex call"
PACKED_INTERVALS = ("the packed layout; only the keys some query sees gathered, Flex block lists from the key "
                    "intervals")
PACKED_MASK = "the packed layout, every key gathered; Flex block lists found from the mask in the first run()"


# ----------------------------------------------------------------------------- paged prefill


class FlexPrefillWrapper(FlexWrapperBase):
    """Paged-KV prefill on FlexAttention (kind "prefill"); make_wrapper(..., backend="flex")."""

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, page_size: int,
             *, skip_tiles: bool | None = None, disable_split_kv: bool = False, **spec_args: Any) -> ScheduledPlan:
        """Plan a batch (VariantWrapper.plan's arguments; returns its Plan, also kept as
        ``last_plan``; ``disable_split_kv`` has no effect:
        Flex does not split KV). ``skip_tiles``: the interval planner on/off (default: on where
        the spec's intervals are known and plan() was given the tensors they read)."""
        self._reset()
        check_flags("plan()", skip_tiles=skip_tiles, disable_split_kv=disable_split_kv)
        paged = read_paged_batch(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                 num_qo_heads, num_kv_heads, page_size)
        self._batch = b = paged.batch
        self._staging.begin()
        if b.total_q == 0:
            self._plan_pages(paged_kv_indices, paged.kv_indptr[-1], None)
            self.plan_stats["launches"] = []
            return self._keep_plan(NO_CALL, "the batch has no queries")
        intervals = self._plan_intervals(paged.qo_indptr, list(b.kv_lens), skip_tiles, spec_args)
        plan = self._packed_plan(paged.qo_indptr, list(b.kv_lens), paged.kv_indptr[:-1], intervals, page_size)
        self._set_pages(plan, paged_kv_indices, *plan.source)
        self._finish_plan(plan, paged_kv_indices, paged.kv_indptr[-1])
        return self._keep_plan(PACKED_INTERVALS if intervals is not None else PACKED_MASK,
                               self.plan_stats.get("planner_off", ""))

    def _plan_intervals(self, qo_h: list[int], kv_lens: list[int], skip_tiles: bool | None,
                        spec_args: dict[str, Any]):
        off = self._off_reason(skip_tiles, spec_args, "interval planner")
        self._note_off(off)
        if off:
            self._accept_unplanned_args(spec_args)
            return None
        checked = self._check_args(spec_args, where="plan()", require_tensors_from="intervals")
        self._planned_args = {k: v for k, v in checked.items() if k in self._interval_facts.args}
        return self._row_intervals(qo_h, kv_lens, checked)

    def run(self, q: torch.Tensor, paged_kv_cache: Any, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None, **spec_args: Any):
        """VariantWrapper.run's arguments and outputs (``enable_pdl`` has no effect here)."""
        plan = self._check_planned()
        b, cfg = self._batch, self.config
        k_cache, v_cache, args, out, lse = self._check_paged_run(
            q, (b.total_q, b.num_qo_heads, cfg.head_dim_qk), paged_kv_cache, (q_scale, k_scale, v_scale), spec_args,
            out, return_lse, enable_pdl)
        if plan is None:
            return (out, lse) if return_lse else out
        return _run_packed(self, plan, q, k_cache, v_cache, args, q_scale, k_scale, v_scale, out, lse, return_lse)


def _run_packed(w: FlexWrapperBase, plan: FlexPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                args: dict[str, Any], q_scale: Any, k_scale: Any, v_scale: Any, out: torch.Tensor,
                lse: torch.Tensor | None, return_lse: bool):
    """A packed plan's run: q laid out (plan.q_rows), K/V gathered, Flex, the caller's rows written back."""
    b, layout = w._batch, plan.layout
    assert b is not None
    qbuf = q.new_zeros(layout.q_len, b.num_qo_heads, q.shape[-1])
    qbuf[plan.q_rows] = q
    kbuf = w._gather(plan, k, (layout.kv_len, b.num_kv_heads, k.shape[-1]), q.dtype)
    vbuf = w._gather(plan, v, (layout.kv_len, b.num_kv_heads, v.shape[-1]), q.dtype)
    o, lse_n = w._attend(plan, qbuf.transpose(0, 1)[None], kbuf.transpose(0, 1)[None], vbuf.transpose(0, 1)[None],
                         args, q_scale, k_scale, lse is not None)
    o_rows = o[0].transpose(0, 1)[plan.q_rows]
    lse_rows = lse_n[0].t()[plan.q_rows] if lse_n.numel() else lse_n
    return w._finish(o_rows, lse_rows, out, lse, v_scale, return_lse, args)


# ----------------------------------------------------------------------------- ragged


class FlexRaggedWrapper(FlexWrapperBase):
    """Ragged-KV prefill on FlexAttention (kind "ragged"): RaggedWrapper's plan()/run()."""

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             *, disable_split_kv: bool = False, **spec_args: Any) -> ScheduledPlan:
        """Plan a batch from its indptrs; returns its Plan (also kept as ``last_plan``). Spec
        arguments may be passed here as to the FlashInfer ragged wrapper: checked, not used (the
        block mask comes from run()'s arguments)."""
        from .ragged import read_ragged_batch

        self._reset()
        self._batch, qo_h, kv_h = read_ragged_batch(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads,
                                                    disable_split_kv)
        if spec_args:
            self._check_args(spec_args, where="plan()", require_tensors_from="plan")
        self._staging.begin()
        self._qo_h, self._kv_h, self._interval_plan_of = qo_h, kv_h, None
        if self._batch.total_q == 0:
            self.plan_stats["launches"] = []
            return self._keep_plan(NO_CALL, "the batch has no queries")
        self._plan = self._ragged_plan(None)
        self._finish_plan(self._plan)
        form = self._interval_facts.form
        if form.planner_ready:
            return self._keep_plan("the packed layout, every key gathered; in run(), the keys and Flex block lists "
                                   "from the key intervals for run()'s arguments",
                                   "the ragged kind's plan() reads no spec arguments: the key intervals are "
                                   "evaluated in run()")
        return self._keep_plan(PACKED_MASK, form.reason)

    def _ragged_plan(self, intervals: Any) -> FlexPlan:
        return self._packed_plan(self._qo_h, list(self._batch.kv_lens), self._kv_h[:-1], intervals, None)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None, **spec_args: Any):
        """RaggedWrapper.run's arguments and outputs. Where the spec's key intervals are known,
        the keys gathered and the block mask come from them (for these arguments; kept while
        run() gets the same ones)."""
        from .ragged import check_ragged_run

        plan = self._check_planned()
        args = check_ragged_run(self, q, k, v, (q_scale, k_scale, v_scale), out, return_lse, enable_pdl, spec_args)
        out, lse = self._outputs(out, return_lse)
        if plan is None:
            return (out, lse) if return_lse else out
        if self._interval_facts.form.planner_ready:
            plan = self._interval_plan(args)
        return _run_packed(self, plan, q, k, v, args, q_scale, k_scale, v_scale, out, lse, return_lse)

    def _interval_plan(self, args: dict[str, Any]) -> FlexPlan:
        if self._interval_plan_of is None or not same_values(self._interval_plan_of[0], args):
            self._staging.begin()
            plan = self._ragged_plan(self._row_intervals(self._qo_h, list(self._batch.kv_lens), args))
            self._finish_plan(plan)
            self._interval_plan_of = (values_of(args, self._interval_facts.args), plan)
        return self._interval_plan_of[1]


# ----------------------------------------------------------------------------- decode


class FlexDecodeWrapper(FlexWrapperBase):
    """Paged-KV decode on FlexAttention (kind "decode"): DecodeWrapper's plan()/run(), one query
    per request (its last token), one Flex batch row per request."""

    _multi: FlexPrefillWrapper | None = None  # multi-token decode: the prefill route plans and runs it
    _prefill_route: FlexPrefillWrapper | None = None  # made on the first multi-token plan, then kept

    def plan(self, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, page_size: int,
             *, q_len_per_request: int = 1, skip_tiles: bool | None = None, **spec_args: Any) -> Plan:
        """Plan a decode batch; returns its Plan (also kept as ``last_plan``). ``skip_tiles``
        turns key trimming on/off (default: on where the spec's key intervals are known and
        plan() was given the tensors they read): only the keys a query can see are gathered,
        and the block mask comes from the intervals.
        ``q_len_per_request`` > 1: multi-token decode, as DecodeWrapper.plan (through the flex
        prefill route, with qo_indptr = arange(batch + 1) * q_len_per_request)."""
        from .decode import check_q_len_per_request, check_queries_fit, read_decode_batch

        self._reset()
        self._multi = None
        check_flags("plan()", skip_tiles=skip_tiles)
        check_plan_sizes("plan()", num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_size=page_size)
        per = check_q_len_per_request(q_len_per_request, tensor_cores=True)
        kvp_h, _, kv_lens = read_decode_batch(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        batch = len(kv_lens)
        if per > 1:
            check_queries_fit(kv_lens, per)
            if self._prefill_route is None:  # kept: its compiled block masks serve later plans
                self._prefill_route = FlexPrefillWrapper(self.spec, dataclasses.replace(self.config, kind="prefill"),
                                                         self._float_workspace, self.kv_layout)
            multi = self._prefill_route
            qo_indptr = torch.arange(0, per * (batch + 1), per, dtype=torch.int32)
            multi.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                       num_kv_heads, page_size, skip_tiles=skip_tiles, **spec_args)
            self._multi = multi
            self._batch, self.last_plan = multi._batch, multi.last_plan
            assert self.last_plan is not None
            self.last_plan.kind = "decode"  # (the prefill route's plan, q_len_per_request queries per request)
            return self.last_plan
        self._batch = Batch(batch, batch, sum(kv_lens), num_qo_heads, num_kv_heads, page_size, (1,) * batch,
                            tuple(kv_lens))
        self._staging.begin()
        off = self._off_reason(skip_tiles, spec_args, "key trimming")
        self._note_off(off)
        qo_h = list(range(batch + 1))
        exact = None
        if not off:
            checked = self._check_args(spec_args, where="plan()", require_tensors_from="intervals")
            self._planned_args = {k: v for k, v in checked.items() if k in self._interval_facts.args}
            env, iv = self._row_intervals(qo_h, kv_lens, checked)
            base, count = self._key_ranges(env, iv, batch)
            exact = iv.exact & ~iv.empty & (iv.lo <= iv.hi)
        else:
            self._accept_unplanned_args(spec_args)
            base, count = [0] * batch, list(kv_lens)
        kv_len = -(-max(max(count), 1) // BLOCK) * BLOCK
        kv_row_base = list(accumulate(kv_lens, initial=0))[:-1]
        t = self._tables([[1] * batch, kv_lens, list(range(batch)), kv_row_base, [0] * batch, base, count,
                          kvp_h[:-1]])
        layout = FlexLayout(False, batch, 1, kv_len, num_qo_heads, num_kv_heads, qo_len=t[0], kv_len_req=t[1],
                            q_start=t[2], kv_row_base=t[3], key_start=t[4], key_base=t[5], key_count=t[6])
        key_r, local = self._keys(layout.key_count, sum(count))
        pos = layout.key_base[key_r] + local  # each gathered key's kv_pos
        entries, offs, dest = t[7][key_r] + pos // page_size, pos % page_size, key_r * kv_len + local
        reqs = torch.arange(batch, device=self.device)
        zeros = torch.zeros_like(reqs)
        reach = RowBlocks(reqs, zeros, zeros, layout.key_count - 1, torch.zeros_like(reqs, dtype=torch.bool))
        blocks = flex.blocks_from_intervals(layout, RowBlocks(reqs, zeros, zeros, layout.key_count - 1, exact)) \
            if exact is not None else None
        plan = FlexPlan(layout, sum(count), (), dest, reach, blocks)
        self._set_pages(plan, paged_kv_indices, entries, offs)
        self._finish_plan(plan, paged_kv_indices, kvp_h[-1])
        by = "one Flex batch row per request; " + ("only the keys the key intervals show gathered, Flex block "
                                                   "lists from them" if not off else
                                                   "every key gathered, Flex block lists found from the mask in "
                                                   "the first run()")
        return self._keep_plan(by, off, "key trimming")

    def run(self, q: torch.Tensor, paged_kv_cache: Any, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None, **spec_args: Any):
        """DecodeWrapper.run's arguments and outputs: ``q`` [batch, num_qo_heads, head_dim]
        ([batch * q_len_per_request, ...] for multi-token decode)."""
        if self._multi is not None:
            return self._multi.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                   return_lse=return_lse, enable_pdl=enable_pdl, **spec_args)
        plan = self._check_planned()
        assert plan is not None  # a decode batch has a query per request
        b, cfg = self._batch, self.config
        k_cache, v_cache, args, out, lse = self._check_paged_run(
            q, (b.batch_size, b.num_qo_heads, cfg.head_dim_qk), paged_kv_cache, (q_scale, k_scale, v_scale),
            spec_args, out, return_lse, enable_pdl)
        layout = plan.layout
        shape = (b.batch_size * layout.kv_len, b.num_kv_heads)
        kbuf = self._gather(plan, k_cache, (*shape, k_cache.shape[-1]), q.dtype)
        vbuf = self._gather(plan, v_cache, (*shape, v_cache.shape[-1]), q.dtype)

        def per_request(x: torch.Tensor) -> torch.Tensor:  # [B*L, H, D] -> [B, H, L, D]
            return x.view(b.batch_size, layout.kv_len, b.num_kv_heads, -1).transpose(1, 2)

        o, lse_n = self._attend(plan, q.unsqueeze(2), per_request(kbuf), per_request(vbuf), args, q_scale, k_scale,
                                lse is not None)
        return self._finish(o[:, :, 0], lse_n[:, :, 0] if lse_n.numel() else lse_n, out, lse, v_scale, return_lse,
                            args)


# ----------------------------------------------------------------------------- factory and probe

FLEX_WRAPPERS: dict[str, type[FlexWrapperBase]] = {
    "prefill": FlexPrefillWrapper,
    "ragged": FlexRaggedWrapper,
    "decode": FlexDecodeWrapper,
}


def flex_config(spec: VariantSpec, *, head_dim_qk: Any, head_dim_vo: Any = None, q_dtype: Any, kv_dtype: Any,
                o_dtype: Any = None, kind: str = "prefill", device: torch.device, compile: bool | None = None,
                ) -> FlexConfig:
    """The flex route's configuration, checked (ValueError naming the argument, BackendError
    when this torch or device cannot run it)."""
    problem = flex.flex_problem()
    if problem:
        raise BackendError(problem)
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    hd_vo = head_dim_vo if head_dim_vo is not None else head_dim_qk
    for name, value in (("head_dim_qk", head_dim_qk), ("head_dim_vo", hd_vo)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive int")
    q = flex_dtype(q_dtype, "q_dtype", Q_DTYPES)
    kv = flex_dtype(kv_dtype, "kv_dtype", KV_DTYPES)
    o = flex_dtype(o_dtype, "o_dtype", Q_DTYPES) if o_dtype is not None else q
    problem = flex.device_problem(device, head_dim_qk, hd_vo)
    if problem:
        raise BackendError(problem)
    compiled = device.type == "cuda" if compile is None else bool(compile)
    return FlexConfig(spec, head_dim_qk, hd_vo, q, kv, o, kind, compiled)


def make_flex_wrapper(spec: VariantSpec | str, workspace: torch.Tensor, *, head_dim_qk: int,
                      head_dim_vo: int | None = None, q_dtype: Any, kv_dtype: Any, o_dtype: Any = None,
                      kind: str = "prefill", kv_layout: str = "NHD", use_tensor_cores: bool = False,
                      graph: Any = None, compile: bool | None = None) -> FlexWrapperBase:
    """A flex wrapper for ``kind`` on ``workspace``'s device (what make_wrapper(backend="flex")
    returns). ``workspace``: any uint8 tensor on the target device (Flex needs no workspace; the
    argument keeps make_wrapper's signature). ``compile``: run Flex's compiled kernel (default on
    CUDA) or the eager math (default on CPU; torch's compiled CPU kernel has no LSE).
    ``use_tensor_cores`` (decode) changes nothing here. No CUDA-graph mode (``graph``)."""
    spec = resolve_spec(spec)
    if graph is not None:  # the capability table's rule (make_wrapper refuses it there first)
        raise ValueError(graph_problem("flex", kind) or "graph=: the flex route has no CUDA-graph mode")
    if use_tensor_cores and kind != "decode":
        raise ValueError(f"use_tensor_cores=True: only for kind='decode' (got kind={kind!r})")
    if not isinstance(workspace, torch.Tensor):
        raise LaunchError("workspace: expected a torch.uint8 tensor on the target device")
    config = flex_config(spec, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype,
                         kv_dtype=kv_dtype, o_dtype=o_dtype, kind=kind, device=workspace.device, compile=compile)
    return FLEX_WRAPPERS[kind](spec, config, workspace, kv_layout)


def probe_flex(spec: VariantSpec, *, head_dim_qk: Any, head_dim_vo: Any, q_dtype: Any, kv_dtype: Any,
               o_dtype: Any, kind: str, device: Any, cuda_graph: bool, page_size: Any) -> dict[str, Any]:
    """probe(backend="flex")'s checks: {"ok": bool, "reason": str, "details": {...}}. A small
    batch runs through the wrapper (so "ok" means Flex ran here, compiled where it will be)."""
    import time

    from ..wrappers.batches import random_paged_batch, random_spec_args

    details: dict[str, Any] = {"backend": "flex", "torch": torch.__version__}
    if cuda_graph:  # the capability table's rule (probe() refuses it there first)
        return {"ok": False, "reason": graph_problem("flex", kind, "cuda_graph=True") or
                "cuda_graph=True: the flex route has no CUDA-graph mode", "details": details}
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1):
        return {"ok": False, "reason": f"page_size={page_size!r}: expected a positive whole number",
                "details": details}
    try:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError) as e:
        return {"ok": False, "reason": f"device={device!r}: {e}", "details": details}
    try:
        config = flex_config(spec, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype,
                             kv_dtype=kv_dtype, o_dtype=o_dtype, kind=kind, device=dev)
    except (ValueError, BackendError) as e:
        return {"ok": False, "reason": str(e), "details": details}
    details.update(device=str(dev), compiled=config.compiled, config=config.describe())
    t0 = time.perf_counter()
    try:
        workspace = torch.empty(0, dtype=torch.uint8, device=dev)
        w = FLEX_WRAPPERS[kind](spec, config, workspace)
        ps = page_size or 16
        qo, kv = ([1, 1], [130, 7]) if kind == "decode" else ([5, 3], [130, 7])
        batch = random_paged_batch(qo, kv, num_qo_heads=2, num_kv_heads=1, head_dim=config.head_dim_qk,
                                   page_size=ps if kind != "ragged" else 1, dtype=TORCH_DTYPES[config.q_dtype],
                                   kv_dtype=TORCH_DTYPES[config.kv_dtype], device=dev)
        if config.head_dim_vo != config.head_dim_qk:
            batch.v_cache = torch.randn(*batch.v_cache.shape[:-1], config.head_dim_vo, device=dev).to(
                batch.v_cache.dtype)
        args = random_spec_args(spec, batch)
        if kind == "ragged":
            w.plan(batch.qo_indptr, batch.kv_indptr, 2, 1)
            pages = batch.kv_indices.long()
            w.run(batch.q, batch.k_cache[pages].flatten(0, 1), batch.v_cache[pages].flatten(0, 1), **args)
        else:
            w.plan(*(batch.plan_args()[1:] if kind == "decode" else batch.plan_args()), skip_tiles=False)
            w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 - a probe reports, it does not raise
        return {"ok": False, "reason": f"FlexAttention failed on a small batch on {dev}: {type(e).__name__}: "
                                       f"{str(e)[:400]}", "details": details}
    details["checked"] = f"ran a 2-request {kind} batch through Flex in {time.perf_counter() - t0:.2f} s"
    return {"ok": True, "reason": "", "details": details}
