"""The paged-prefill wrapper (kind "prefill", factory.make_wrapper makes it): a spec's module
behind ``plan(...)`` / ``run(..., <args by name>)`` on the shared checks of base.WrapperBase.

``run`` checks every argument (dtype, shape, contiguity, device) before any launch and
names the argument in the error. The kernel sees *launch requests*: in the direct path
one per caller request; with the interval planner (planner.py) a request's rows may be
split into several, grouped into up to three launches by mask mode. Each launch request
carries a row of ``vg_meta`` telling the variant where it sits in the caller's batch, so
the generated mask always sees true positions and rows; q and o are read and written in
place (launch requests need not be packed), so nothing is gathered or scattered.

The same wrapper drives fa2 and fa3 (sm90) prefill modules. plan() checks its arguments and
asks its planner.Planner for the batch's plan.Plan (kept as ``wrapper.last_plan``): the
launches, each built by the one launch builder (templates/plan/) - with the spec's planner
module (the default on CUDA) after its row pass, in one C++ call; otherwise planner-off, one
custom launch per request, and the Plan says why. run() runs the plan's launches. Graph mode
(graph.py) fixes the launches and their buffers at a capacity. Decode and ragged KV have
their own wrappers (decode.py, ragged.py) on the shared checks of base.WrapperBase and checks.py.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from ..abi.table import FA2_TAIL_RUN_CODE, LISTED_RUN_CODE, MaskMode
from ..core.errors import LaunchError
from ..core.flags import check_flags
from ..planning.graph import GraphCapacity
from ..planning.intervals import usable_form
from ..planning.plan import Batch, Launch, Plan
from ..planning.planner import Planner
from .base import LAYOUT_CODES, WrapperBase, host_indices
from .checks import check_paged_arguments, paged_batch
from .merge import piece_buffers

log = logging.getLogger("variantgen.wrappers.paged")


class VariantWrapper(WrapperBase):
    """Paged-KV prefill for one spec, dtype and head-dim combination (see make_wrapper).
    ``graph``: CUDA-graph mode with buffers for at most that batch (graph.py)."""

    def __init__(self, *args: Any, graph: GraphCapacity | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._launches: list[Launch] = []
        self.last_plan: Plan | None = None  # what the last plan() decided (None: no plan, or it failed)
        if graph is not None and not isinstance(graph, GraphCapacity):
            raise LaunchError(f"graph={graph!r}: expected a variantgen.GraphCapacity (or None)")
        cfg = self.config
        self.planner = Planner(self.module, self.spec, backend=cfg.backend, head_dim_qk=cfg.head_dim_qk,
                               head_dim_vo=cfg.head_dim_vo, kv_dtype_bytes=1 if cfg.kv_dtype.startswith("fp8") else 2,
                               device=self.device, float_workspace=self._float_workspace, graph=graph)
        self._graph = self.planner.graph
        # (the merge computes an inline first piece in one dtype: q, k, v and o alike)
        self.planner.inline_allowed = self.planner.inline_allowed and cfg.q_dtype == cfg.kv_dtype == cfg.o_dtype

    @property
    def plan_stats(self) -> dict[str, Any]:
        return self.last_plan.stats() if self.last_plan is not None else {}

    @property
    def row_planner(self) -> Any:
        """The spec's planner module plan() uses (None: planner-off plans)."""
        return self.planner.row_planner

    def set_row_planner(self, module: Any, reason: str = "") -> None:
        """Use the spec's planner module in plan() (None: planner-off plans, ``reason`` says why)."""
        self.planner.set_row_planner(module, reason)

    def _page_lists(self) -> list[torch.Tensor]:
        # (graph mode: the launch slots' views, whole - the same buffers every plan, what a captured launch reads)
        return [la.kv_indices for la in self._launches]

    def _trim_to_batch(self, args: dict[str, Any]) -> dict[str, Any]:
        """Spec tensors given as capacity-sized static buffers, cut to this batch's sizes
        (views from the start: same data_ptr) for the planner, which sizes work by them."""
        dims = self._dims()
        out = dict(args)
        for t in self.spec.tensors:
            if t.name in out:
                out[t.name] = out[t.name][tuple(slice(0, dims[d] if isinstance(d, str) else d) for d in t.shape)]
        return out

    def _dim_capacity(self) -> dict[str, int]:
        if self._graph is None or self._batch is None:
            return {}
        cap = self._graph.capacity
        return {"total_q": cap.max_total_q, "batch": cap.max_batch_size,
                "total_kv": cap.max_kv_pages * self._batch.page_size}

    # ------------------------------------------------------------------ plan
    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, page_size: int,
             *, skip_tiles: bool | None = None, disable_split_kv: bool = False, **spec_args: Any) -> Plan:
        """Plan a batch; returns its Plan (also kept as ``last_plan``: print it for a summary).
        ``skip_tiles`` turns the interval planner on/off (default: on where the spec's
        intervals are known). With the planner on, spec tensors the intervals read must be
        passed here by name as well. Without the spec's planner module (JIT disabled and it is
        not precompiled, or a CPU wrapper) the plan is planner-off, and the Plan says why.

        The index tensors (int32, on the CPU or any CUDA device; indptrs starting at 0) are read here, once:
        the launches get their own copies of the indptrs, lengths and page list, so changing
        them after plan() changes nothing. Every entry of the batch's page list,
        ``paged_kv_indices[:paged_kv_indptr[-1]]``, must be a page of the KV cache run() is
        given: negative entries are refused here, the rest by run(), which has the cache (in
        CUDA-graph mode, where replays run no host code, also here against the cache the graph
        was captured with). plan() never waits for the GPU to read the list's bounds: with the
        page list on the GPU and the indptrs on the host, and nothing else read back, they may
        still be on their way when run() is called; run() then clamps the kernels' copy of the
        list to the cache on the GPU, and the next plan() or run() raises once they show entries
        outside it (checks.py). Pass the page list on the host to have them refused up front.

        Contract: the tensors plan() reads must not change until the next plan(). run()
        re-reads q, the KV cache and the spec tensors, but the launches - which rows go to
        which mask mode, which pages each reads - are fixed here from the values of the spec
        tensors the intervals read (e.g. ``ranges``, ``doc_ids``): rewriting those in place
        without planning again gives a wrong output. ``check_plan=True`` detects it.
        """
        # A plan() that fails must not leave the previous plan half-replaced.
        self._batch, self._launches, self._planned_args, self.last_plan = None, [], {}, None
        self._check_replays()
        check_flags("plan()", skip_tiles=skip_tiles, disable_split_kv=disable_split_kv)
        check_paged_arguments(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                              num_qo_heads, num_kv_heads, page_size)
        (qo_h, kvp_h, last_h), indices_h, folded = self._read_indptrs(
            paged_kv_indices, paged_kv_indptr, qo_indptr, paged_kv_indptr, paged_kv_last_page_len)
        batch_of = paged_batch(qo_h, kvp_h, last_h, paged_kv_indices.numel(), num_qo_heads, num_kv_heads, page_size)
        graph = self._graph
        if graph is not None:
            graph.capacity.check_batch(batch_of.batch_size, qo_h[-1], kvp_h[-1], max(batch_of.qo_lens))
            disable_split_kv = True  # split-KV changes the schedule from batch to batch
        self._begin_pages(paged_kv_indices, kvp_h[-1], folded)
        self._batch = batch_of
        try:
            args, reason = self._planner_args(skip_tiles, spec_args)
            plan = self.planner.plan(self._batch, indices_h, paged_kv_indices, args, disable_split_kv=disable_split_kv,
                                     reason=reason, pages_given=kvp_h[-1])
            if plan.planner != "module":
                self._planned_args = {}  # (nothing of the spec arguments shaped this plan)
            self._finish_pages()
            self._snapshot_planned()
        except BaseException:
            self._batch, self._launches, self._planned_args = None, [], {}
            raise
        self.last_plan, self._launches = plan, plan.launches
        return plan

    def _planner_args(self, skip_tiles: bool | None, spec_args: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """(the checked spec arguments the interval planner reads, or None with the reason it is off)."""
        reason = self._off_reason(skip_tiles, spec_args, "interval planner")
        if reason:
            self._accept_unplanned_args(spec_args)
            return None, reason
        checked = self._check_args(spec_args, where="plan()", require_tensors_from="intervals")
        form, read, tensors = self._interval_facts
        if not form.planner_ready or not tensors <= checked.keys():
            usable_form(self.spec, checked)  # raises: which intervals or tensors are missing
        self._planned_args = {k: v for k, v in checked.items() if k in read}
        return (self._trim_to_batch(checked) if self._graph is not None else checked), ""

    # ------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, paged_kv_cache: Any, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None, **spec_args: Any):
        """Attention of ``q`` [total_q, num_qo_heads, head_dim_qk] over ``paged_kv_cache`` ((k_cache,
        v_cache), or one [num_pages, 2, ...] tensor) for the planned batch; returns ``out``
        [total_q, num_qo_heads, head_dim_vo] (contiguous), or ``(out, lse)`` with ``return_lse=True``
        (base-2 LSE, float32 [total_q, num_qo_heads]). Spec arguments by name.

        run() reads q, the cache and the spec tensors; the launches are plan()'s (see its
        contract). It checks every argument first, and the planned page list against the
        cache's page count - or, where plan() left the list's bounds on their way, clamps the
        kernels' copy of it to the cache on the GPU before the launch; a later plan() or run()
        raises if they show that the clamp changed anything (checks.py). It raises first for
        such an earlier run(). Under CUDA-graph capture it records the clamp in the graph and
        remembers the cache's page count, which later plan()s check against (replays run no
        host code)."""
        if self._batch is None or (self._batch.total_q and not self._launches):  # none, or plan() failed
            raise LaunchError("run() called before plan(): call plan(qo_indptr, paged_kv_indptr, ...) first")
        b = self._batch
        cfg = self.config
        rows = b.total_q
        if self._graph is not None and isinstance(q, torch.Tensor) and q.dim() == 3:
            # Graph mode: q / out may be the capture's static buffers, up to capacity rows
            # (rows past this batch's total_q are not written, nor read but by a GQA-packed
            # fa3 run's packed copy of q).
            if b.total_q <= q.shape[0] <= self._graph.capacity.max_total_q:
                rows = q.shape[0]
        k_cache, v_cache, args, out, lse = self._check_paged_run(
            q, (rows, b.num_qo_heads, cfg.head_dim_qk), paged_kv_cache, (q_scale, k_scale, v_scale), spec_args, out,
            return_lse, enable_pdl)
        tensors, scalars = self._kernel_args(args, q_scale, k_scale, v_scale)
        layout = LAYOUT_CODES[self.kv_layout]
        if enable_pdl is None:  # programmatic dependent launch: sm90+, as FlashInfer defaults
            enable_pdl = self._pdl_default()
        fa3 = self.config.backend == "fa3"
        pack = self.last_plan.pack_gqa if self.last_plan is not None else 1
        q_k, out_k, lse_k = (q, out, lse) if pack == 1 else gqa_packed(q, out, lse, pack)
        merge = self.last_plan.merge if self.last_plan is not None else None
        lse_base = lse_k
        if merge is not None and merge.inline is not None and lse_k is None:  # (the merge reads the rows' LSE)
            lse_base = torch.empty(out_k.shape[0], out_k.shape[1], dtype=torch.float32, device=out_k.device)
        if merge is not None:  # rows that see several key intervals: a partial output per interval
            parts, parts_lse = piece_buffers(out_k, merge.pieces)  # (GQA packing: packed rows, as out_k's)
        for la in self._launches:
            # fa2's tail launch: causal with the spec's mask on the tiles the kernel masks, a code
            # of its own (the other causal launches run units without the spec's mask); launch
            # requests over page lists: the listed variant's code
            code = FA2_TAIL_RUN_CODE if la.tail and not fa3 else LISTED_RUN_CODE if la.listed else int(la.mode)
            if pack > 1 and la.mode == MaskMode.CAUSAL:  # (a graph's causal and window slots: always empty)
                continue
            o_l, lse_l = (out_k, lse_base) if la.piece < 0 else (parts[la.piece], parts_lse[la.piece])
            if fa3:
                self.module.paged_run(
                    la.float_workspace, la.int_workspace, la.plan_info, q_k, k_cache, v_cache, la.kv_indices, o_l,
                    lse_l, code, layout, la.window_left, pack, enable_pdl, *tensors, la.meta, *scalars)
            else:
                self.module.paged_run(
                    la.float_workspace, la.int_workspace, la.plan_info, q, k_cache, v_cache, la.q_starts,
                    la.kv_indptr, la.kv_indices, la.last_page_len, o_l, lse_l, code, layout,
                    -1, enable_pdl, *tensors, la.meta, *scalars)
        if merge is not None and merge.inline is not None:  # the rows' short first piece, computed there
            group = 1 if pack > 1 else b.num_qo_heads // b.num_kv_heads  # (out_k's heads per key/value head)
            self.module.merge_inline(out_k, lse_base, lse_k, q_k, k_cache, v_cache, merge.kv_indices, merge.out_rows,
                                     *merge.inline, self._sm_scale(q_scale, k_scale),
                                     float(v_scale) if v_scale is not None else 1.0, group, self.kv_layout == "HND")
        elif merge is not None:
            self.module.merge_pieces(out_k, lse_k, parts, parts_lse, merge.out_rows, merge.out_counts)
        if pack > 1:  # (graph mode: only the planned rows; out's rows past them stay as they are)
            gqa_unpack(out, lse, out_k, lse_k, pack, self.planner.graph.rows if self._graph is not None else None)
        return (out, lse) if return_lse else out


def gqa_packed(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, group: int,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GQA packing's kernel tensors: q [rows, kv_heads x group, d] as [rows x group, kv_heads, d]
    (row r's query head kv x group + g at packed row r x group + g; a copy), and outputs of
    that shape for the launches to write (gqa_unpack copies them back)."""
    rows, heads = q.shape[0], q.shape[1] // group
    q_k = q.unflatten(1, (heads, group)).transpose(1, 2).reshape(rows * group, heads, q.shape[2])
    out_k = out.new_empty(rows * group, heads, out.shape[2])
    lse_k = lse.new_empty(rows * group, heads) if lse is not None else None
    return q_k, out_k, lse_k


def gqa_unpack(out: torch.Tensor, lse: torch.Tensor | None, out_k: torch.Tensor, lse_k: torch.Tensor | None,
               group: int, valid_rows: torch.Tensor | None = None) -> None:
    """The packed launches' outputs (gqa_packed) back into ``out`` / ``lse`` rows and heads;
    ``valid_rows`` (a device int32 [1], CUDA-graph mode): only rows below it, as a captured run's
    row count changes from replay to replay."""
    rows, heads = out.shape[0], out.shape[1] // group
    new_out = out_k.view(rows, group, heads, -1).transpose(1, 2)
    new_lse = lse_k.view(rows, group, heads).transpose(1, 2) if lse_k is not None else None
    if valid_rows is not None:
        keep = torch.arange(rows, device=out.device) < valid_rows
        new_out = torch.where(keep.view(-1, 1, 1, 1), new_out, out.unflatten(1, (heads, group)))
        if new_lse is not None:
            new_lse = torch.where(keep.view(-1, 1, 1), new_lse, lse.view(rows, heads, group))
    out.unflatten(1, (heads, group)).copy_(new_out)
    if lse is not None:
        lse.view(rows, heads, group).copy_(new_lse)




class PagedBatchLists(NamedTuple):
    """A paged batch as plan() checked it: the Batch and host copies of its index tensors."""

    batch: Batch
    qo_indptr: list[int]
    kv_indptr: list[int]
    last_page_len: list[int]
    host: torch.Tensor  # the three back to back on the host (host_indices)


def read_paged_batch(qo_indptr: Any, paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any,
                     num_qo_heads: Any, num_kv_heads: Any, page_size: Any) -> PagedBatchLists:
    """check_paged_arguments, the host copies (one device-to-host copy) and paged_batch: a route
    that reads the batch without VariantWrapper's reads of the page list (the flex route reads its
    bounds with its plan)."""
    check_paged_arguments(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                          num_kv_heads, page_size)
    (qo_h, kvp_h, last_h), indices_h = host_indices(qo_indptr, paged_kv_indptr, paged_kv_last_page_len)
    batch = paged_batch(qo_h, kvp_h, last_h, paged_kv_indices.numel(), num_qo_heads, num_kv_heads, page_size)
    return PagedBatchLists(batch, qo_h, kvp_h, last_h, indices_h)

