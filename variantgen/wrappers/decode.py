"""Batch decode (kind "decode"): a spec's module behind ``plan(...)`` / ``run(q, paged_kv_cache, ...)``.

One query per request, and that query is the request's *last* token: ``q`` is
``[batch, num_qo_heads, head_dim]``, and for request b the mask sees ``q_pos = kv_len - 1``,
``q_idx = 0``, ``qo_len = 1`` and ``q_row = b`` (so a spec tensor of shape ``[total_q, ...]``
has one row per request). This is FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``
layout.

Two paths, chosen by ``make_wrapper(..., kind="decode", use_tensor_cores=...)``, two classes
(``DecodeWrapper(...)`` makes the one its module's kind names):

* CUDA cores (default; ``CudaCoreDecodeWrapper``): FlashInfer's FA2 batch-decode kernel instantiated with the spec's
  variant (a "decode" module). It evaluates the mask on every key it visits but those key
  trimming proved visible (below).
* tensor cores (``TensorCoreDecodeWrapper``): the spec's paged *prefill* module with qo_len 1 per request (FlashInfer's
  advice for large GQA groups); the wrapper plans it like ``VariantWrapper`` with
  ``qo_indptr = arange(batch + 1)``. fa2 with ``use_tensor_cores=True``, and fa3 always (its
  decode is its prefill kernel; the default on sm90). ``plan(..., q_len_per_request=T)``
  makes it multi-token decode: the last T tokens of each request are queries (speculative
  verification), q ``[batch * T, num_qo_heads, head_dim]``.

Key trimming (the decode analogue of the prefill interval planner): where the mask's key
intervals are known (``intervals.analyze``) and plan() has the spec tensors they read,
plan() narrows each request's page list to the pages holding the hull of its visible keys
(e.g. the last ``window + 1`` keys of a sliding window, the current document), so the
kernel reads only those. The mask is still evaluated on every key visited outside the run of
keys the intervals prove visible (vg_meta's VIS_LO..VIS_HI; all of them for an exact interval
such as a window's), so a hull that is not exact stays right. Where every key a request's
kernel visits is provably visible (or below its hull, cut by a kernel window), plan() picks
``run_exact``, the module's kernels without the spec's mask (exact_window; not in CUDA-graph
mode, whose captured launch keeps its kernel). ``skip_tiles=False`` turns key trimming
off; with it off, spec arguments go to run() only. On the tensor-core path ``skip_tiles`` and
the spec arguments go to the prefill planner.

LSE convention: ``run(..., return_lse=True)`` returns FlashInfer's log-sum-exp in base 2,
like the prefill wrapper.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from ..abi.table import META_COLUMNS, RecField, meta_rows
from ..core.errors import LaunchError
from ..core.flags import check_flags
from ..core.staging import HostStaging
from ..planning.graph import GraphCapacity, pin_plan_info
from ..planning.intervals import analyze, args_read, row_intervals, tensors_read, usable_form
from ..planning.plan import Batch, Plan, ScheduledPlan
from ..planning.planner import Planner
from ..planning.rowplan import plan_rows
from .base import LAYOUT_CODES, WrapperBase, host_lists
from .checks import check_index_tensors, check_indptr_starts, check_plan_sizes, check_total_keys
from .paged import VariantWrapper

log = logging.getLogger("variantgen.wrappers.decode")

# GQA group sizes (num_qo_heads / num_kv_heads) FlashInfer's decode kernel is dispatched for.
DECODE_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)
DECODE_PLAN_INFO_LEN = 10  # flashinfer::DecodePlanInfo::ToVector()


@dataclass
class DecodeLaunch:
    """The one launch of a planned decode batch (CUDA-core path)."""

    kv_indptr: torch.Tensor  # on the device: the (possibly trimmed) page lists
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    meta: torch.Tensor  # [batch, META_COLUMNS] int32
    plan_info: Any
    int_workspace: torch.Tensor
    float_workspace: torch.Tensor
    pages: int  # pages the kernel visits (after trimming)
    exact: bool = False  # run_exact: the variant without the spec's mask (exact_window)


def exact_window(lo: list[int], vis_lo: list[int], vis_hi: list[int], last: list[int]) -> list[int] | None:
    """Per request, the kernel window under which the variant without the spec's mask gives the
    masked variant's output, or None where some request needs the mask. Request b's kernel
    visits keys kv_pos_base .. last[b]: those from lo[b] on must be provably visible (vis_lo <=
    lo, last <= vis_hi); those below lo[b] (the rest of the first page, whose hull starts inside
    it) are invisible by the hull, and a window of last[b] - lo[b] keys behind the query's
    (last) key cuts them."""
    if not lo or any(vl > vh or vl > a or vh < e for a, vl, vh, e in zip(lo, vis_lo, vis_hi, last)):
        return None
    return [e - a for a, e in zip(lo, last)]


class DecodeWrapper(WrapperBase):
    """Paged-KV decode for one spec, dtype and head-dim combination (see make_wrapper): the plan()
    / run() contract both paths share. Two classes, by the module they run:
    ``CudaCoreDecodeWrapper`` (a "decode" module: FlashInfer's FA2 decode kernel with key
    trimming) and ``TensorCoreDecodeWrapper`` (a "prefill" module, run by the paged prefill
    wrapper); ``DecodeWrapper(spec, config, ...)`` makes the one ``config.kind`` names."""

    use_tensor_cores: bool = False
    _module_kind = ""  # the module kind a subclass runs

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is DecodeWrapper:  # (the class the module's kind names)
            config = args[1] if len(args) > 1 else kwargs.get("config")
            kind = getattr(config, "kind", None)
            cls = {"decode": CudaCoreDecodeWrapper, "prefill": TensorCoreDecodeWrapper}.get(kind, DecodeWrapper)
        return super().__new__(cls)

    def __init__(self, *args: Any, graph: GraphCapacity | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not self._module_kind or self.config.kind != self._module_kind:
            raise ValueError(f"DecodeWrapper: needs a 'decode' module (CUDA cores) or a 'prefill' module "
                             f"(tensor cores), got kind={self.config.kind!r}")
        if self.config.backend not in ("fa2", "fa3"):
            raise ValueError(f"DecodeWrapper: decode runs on fa2 modules (the CUDA-core decode kernel, or the fa2 "
                             f"prefill module for use_tensor_cores=True) or on the fa3 prefill module, got "
                             f"backend={self.config.backend!r}")
        if graph is not None and not isinstance(graph, GraphCapacity):
            raise LaunchError(f"graph={graph!r}: expected a variantgen.GraphCapacity (or None)")
        self._graph = graph
        # What the last plan() decided (None: no plan, or it failed): tensor cores, the prefill
        # wrapper's Plan; CUDA cores, a ScheduledPlan of FlashInfer's one decode launch.
        self.last_plan: Plan | None = None

    # ------------------------------------------------------------------ plan
    def plan(self, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, page_size: int,
             *, q_len_per_request: int = 1, skip_tiles: bool | None = None, **spec_args: Any) -> Plan:
        """Plan a decode batch (one query per request); returns its Plan (also kept as
        ``last_plan``: print it for a summary). ``skip_tiles`` turns key trimming
        on/off (default: on where the spec's key intervals are known and plan() was given
        the spec tensors they read; pass those by name here and to run()).

        ``q_len_per_request`` > 1: multi-token decode (speculative verification: the last
        ``q_len_per_request`` tokens of every request are queries, rows ``b * T .. b * T + T - 1``
        of run()'s q); on the tensor-core path (fa3, or fa2 with use_tensor_cores=True).

        As VariantWrapper.plan: the index tensors are read (and the page list copied) here,
        ``paged_kv_indptr`` starts at 0, every entry of ``paged_kv_indices[:paged_kv_indptr[-1]]``
        must be a page of the KV cache run() is given (run() checks, or guards where the list's
        bounds are still on their way from the GPU - a device page list with host indptrs, as
        serving engines pass them; in CUDA-graph mode plan() too, against the cache the graph was
        captured with), and the spec tensors key trimming reads must not change until the next
        plan() (``check_plan=True`` detects it)."""
        # A plan() that fails must not leave the previous plan half-replaced.
        self._batch, self._planned_args, self.last_plan = None, {}, None
        self._forget_plan()
        self._check_replays()
        check_flags("plan()", skip_tiles=skip_tiles)
        check_plan_sizes("plan()", num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_size=page_size)
        per = check_q_len_per_request(q_len_per_request, self.use_tensor_cores)
        self._check_heads(num_qo_heads, num_kv_heads)
        check_decode_arguments(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        return self._plan_decode(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                                 num_kv_heads, page_size, per, skip_tiles, spec_args)

    def _forget_plan(self) -> None:
        """Drops what the previous plan() left for run() (plan() is failing or replacing it)."""

    def _check_heads(self, num_qo_heads: int, num_kv_heads: int) -> None:
        """LaunchError where the path cannot run this GQA group."""

    def _plan_decode(self, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
                     paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, page_size: int,
                     per: int, skip_tiles: bool | None, spec_args: dict[str, Any]) -> Plan:
        raise NotImplementedError(f"{type(self).__name__}: decode plans on CUDA cores or tensor cores")

    @staticmethod
    def _decode_batch(kv_lens: list[int], per: int, num_qo_heads: int, num_kv_heads: int, page_size: int) -> Batch:
        check_queries_fit(kv_lens, per)
        batch = len(kv_lens)
        return Batch(batch, batch * per, sum(kv_lens), num_qo_heads, num_kv_heads, page_size, (per,) * batch,
                     tuple(kv_lens))

    # ------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, paged_kv_cache: Any, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None, **spec_args: Any):
        """Decode one query per request: ``q`` [batch, num_qo_heads, head_dim]; returns ``out``
        [batch, num_qo_heads, head_dim] (and the base-2 LSE [batch, num_qo_heads] with
        ``return_lse=True``). Checks as VariantWrapper.run (the planned page list against the
        cache's page count among them, or the guard)."""
        if self._batch is None or not self._planned():
            raise LaunchError("run() called before plan(): call plan(paged_kv_indptr, paged_kv_indices, "
                              "paged_kv_last_page_len, num_qo_heads, num_kv_heads, page_size) first")
        b, cfg = self._batch, self.config
        want = (self._q_rows(q, b), b.num_qo_heads, cfg.head_dim_qk)
        if isinstance(q, torch.Tensor) and tuple(q.shape) != want:
            per = b.total_q // b.batch_size
            rows = (f"batch={b.batch_size}" if per == 1 else
                    f"batch * q_len_per_request={b.batch_size} * {per}")
            raise LaunchError(f"run(): `q`: expected shape [{rows}, num_qo_heads={b.num_qo_heads}, "
                              f"head_dim={cfg.head_dim_qk}] ({'one query' if per == 1 else f'{per} queries'} per "
                              f"request), got {list(q.shape)}")
        return self._run_decode(q, want, paged_kv_cache, (q_scale, k_scale, v_scale), out, return_lse, enable_pdl,
                                spec_args)

    def _planned(self) -> bool:
        return True

    def _q_rows(self, q: Any, b: Batch) -> int:
        """The query rows run() takes for this plan."""
        return b.total_q

    def _run_decode(self, q: torch.Tensor, want: tuple[int, int, int], paged_kv_cache: Any, scales: tuple,
                    out: torch.Tensor | None, return_lse: bool, enable_pdl: bool | None, spec_args: dict[str, Any]):
        raise NotImplementedError(f"{type(self).__name__}: decode runs on CUDA cores or tensor cores")


class TensorCoreDecodeWrapper(DecodeWrapper):
    """Decode on the spec's paged *prefill* module (fa3's decode; fa2 with use_tensor_cores=True):
    the paged prefill wrapper on the same module plans and runs it, qo_len q_len_per_request per
    request (its interval planner, GQA packing on fa3, CUDA-graph mode)."""

    use_tensor_cores = True
    _module_kind = "prefill"

    def __init__(self, *args: Any, graph: GraphCapacity | None = None, **kwargs: Any):
        super().__init__(*args, graph=graph, **kwargs)
        self._prefill = VariantWrapper(self.spec, self.config, self.module, self.build, self._float_workspace,
                                       self.kv_layout, graph=graph, check_plan=self.check_plan)

    @property
    def plan_stats(self) -> dict[str, Any]:
        return self._prefill.plan_stats

    @property
    def planner(self) -> Planner:
        """The prefill wrapper's Planner."""
        return self._prefill.planner

    @property
    def row_planner(self) -> Any:
        """The spec's planner module the prefill wrapper's plan() uses (None: without one)."""
        return self._prefill.row_planner

    def set_row_planner(self, module: Any, reason: str = "") -> None:
        """The spec's planner module (None: without it, ``reason`` says why): the prefill
        wrapper's interval planner."""
        self._prefill.set_row_planner(module, reason)

    def _plan_decode(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                     page_size, per, skip_tiles, spec_args) -> Plan:
        kvp_h, last_h = host_lists(paged_kv_indptr, paged_kv_last_page_len)  # (the prefill plan() reads the pages)
        kv_lens = decode_kv_lens(kvp_h, last_h, paged_kv_indices.numel(), page_size)
        new_batch = self._decode_batch(kv_lens, per, num_qo_heads, num_kv_heads, page_size)
        qo_indptr = torch.arange(0, per * (len(kv_lens) + 1), per, dtype=torch.int32)
        plan = self._prefill.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                  num_qo_heads, num_kv_heads, page_size, skip_tiles=skip_tiles, **spec_args)
        plan.kind = "decode"  # (the prefill module's launches, qo_len q_len_per_request per request)
        self._batch, self.last_plan = new_batch, plan
        return plan

    def _q_rows(self, q: Any, b: Batch) -> int:
        # Graph mode: a static buffer of up to capacity rows (the prefill kernel reads the planned rows).
        if self._graph is not None and isinstance(q, torch.Tensor) and q.dim() == 3 and \
                b.total_q <= q.shape[0] <= self._graph.max_total_q:
            return q.shape[0]
        return b.total_q

    def _page_lists(self) -> list[torch.Tensor]:
        return []  # (the prefill wrapper checks its own)

    def _dim_capacity(self) -> dict[str, int]:
        return {}

    def _run_decode(self, q, want, paged_kv_cache, scales, out, return_lse, enable_pdl, spec_args):
        q_scale, k_scale, v_scale = scales
        return self._prefill.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                 return_lse=return_lse, enable_pdl=enable_pdl, **spec_args)


class CudaCoreDecodeWrapper(DecodeWrapper):
    """Decode on FlashInfer's FA2 batch-decode kernel instantiated with the spec's variant (a
    "decode" module), with key trimming (the module doc)."""

    _module_kind = "decode"

    def __init__(self, *args: Any, graph: GraphCapacity | None = None, **kwargs: Any):
        super().__init__(*args, graph=graph, **kwargs)
        # Graph mode: the launch's metadata and page list live in these buffers (batch =
        # max_batch_size requests, at most max_kv_pages page-list entries), rewritten in place by
        # plan(); FlashInfer's CUDA-graph decode schedule for that batch size.
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_plan_info: list[int] | None = None
        if graph is not None:
            n = graph.max_batch_size
            self._graph_buffers = (torch.zeros(n + 1 + n + META_COLUMNS * n, dtype=torch.int32, device=self.device),
                                   torch.zeros(graph.max_kv_pages, dtype=torch.int32, device=self.device))
        self._launch: DecodeLaunch | None = None
        # the spec's planner module, whose row kernel finds key trimming's intervals in one call
        # (None: the intervals in torch ops, a few dozen small ones per plan)
        self._row_planner: Any = None
        self._row_buffers: dict[str, torch.Tensor] = {}

    @property
    def planner(self) -> None:
        """No launch builder on CUDA cores (key trimming plans the one launch)."""
        return None

    @property
    def row_planner(self) -> Any:
        """The spec's planner module key trimming's intervals come from (None: torch ops)."""
        return self._row_planner

    def set_row_planner(self, module: Any, reason: str = "") -> None:
        """The spec's planner module (None: without it): key trimming's intervals from its row
        kernel (without it, in torch ops)."""
        self._row_planner = module

    def _forget_plan(self) -> None:
        self._launch = None

    def _planned(self) -> bool:
        return self._launch is not None

    def _check_heads(self, num_qo_heads: int, num_kv_heads: int) -> None:
        group = num_qo_heads // num_kv_heads
        if group not in DECODE_GROUP_SIZES:
            raise LaunchError(f"plan(): GQA group size {group} (num_qo_heads={num_qo_heads} / num_kv_heads="
                              f"{num_kv_heads}) is not one FlashInfer's CUDA-core decode kernel supports "
                              f"{list(DECODE_GROUP_SIZES)}; build the wrapper with use_tensor_cores=True")

    def _plan_decode(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                     page_size, per, skip_tiles, spec_args) -> Plan:
        (kvp_h, last_h), _, folded = self._read_indptrs(paged_kv_indices, paged_kv_indptr, paged_kv_indptr,
                                                         paged_kv_last_page_len)
        kv_lens = decode_kv_lens(kvp_h, last_h, paged_kv_indices.numel(), page_size)
        batch = len(kv_lens)
        graph = self._graph
        if graph is not None:
            if batch != graph.max_batch_size:
                raise LaunchError(f"plan(): CUDA-graph decode on CUDA cores plans exactly max_batch_size="
                                  f"{graph.max_batch_size} requests (FlashInfer's CUDA-graph decode schedule is "
                                  f"for one batch size), got {batch}; pad the batch with dummy requests, or make "
                                  "the wrapper with use_tensor_cores=True (any batch up to the capacity)")
            graph.check_batch(batch, batch, kvp_h[-1])
        new_batch = self._decode_batch(kv_lens, per, num_qo_heads, num_kv_heads, page_size)
        self._batch = new_batch
        self._staging.begin()
        self._begin_pages(paged_kv_indices, kvp_h[-1], folded)
        try:
            self._plan_cuda_cores(kvp_h, last_h, kv_lens, paged_kv_indices, skip_tiles, spec_args)
            self._finish_pages()
            self._snapshot_planned()
        except BaseException:
            self._batch, self._launch, self._planned_args = None, None, {}
            raise
        stats = self._plan_stats
        self.last_plan = ScheduledPlan(
            new_batch, kind="decode", backend=self.config.backend,
            scheduled_by="FlashInfer's decode scheduler: one launch on CUDA cores"
            + (" (CUDA-graph schedule)" if self._graph_buffers is not None else ""),
            planner="off" if "planner_off" in stats else "key trimming", reason=stats.get("planner_off", ""),
            runs=stats["launches"],
            figures={k: v for k, v in stats.items() if k not in ("launches", "planner_off")})
        return self.last_plan

    def _plan_cuda_cores(self, kvp_h: list[int], last_h: list[int], kv_lens: list[int],
                         kv_indices: torch.Tensor, skip_tiles: bool | None, spec_args: dict[str, Any]) -> None:
        b = self._batch
        assert b is not None
        batch, ps = b.batch_size, b.page_size
        off = self._off_reason(skip_tiles, spec_args, "key trimming")
        self._plan_stats = {"planner_off": off} if off else {}
        kv_pos_base = [0] * batch
        vis_lo, vis_hi = [0] * batch, [-1] * batch  # no keys known visible: the mask on every key
        windows = None  # the exact variant's kernel windows (exact_window), where it applies
        trimmed = False
        if not off:
            checked = self._check_args(spec_args, where="plan()", require_tensors_from="intervals")
            self._planned_args = {k: v for k, v in checked.items() if k in args_read(analyze(self.spec), self.spec)}
            lo, hi, vis_lo, vis_hi = self._visible_hulls(kv_lens, checked)
            first_page = [lo_b // ps for lo_b in lo]
            end_page = [hi_b // ps + 1 for hi_b in hi]
            if any(f > 0 for f in first_page) or any(e != kvp_h[i + 1] - kvp_h[i] for i, e in enumerate(end_page)):
                kv_pos_base = [f * ps for f in first_page]
                counts = [e - f for f, e in zip(first_page, end_page)]
                # request i's trimmed list: its original list from page first_page[i] on
                ranges = [(kvp_h[i] + first_page[i], counts[i]) for i in range(batch)]
                kv_indices = gather_page_ranges(kv_indices, ranges, self._staging)
                trimmed = True
                kvp_h = list(accumulate(counts, initial=0))
                last_h = [hi[i] + 1 - kv_pos_base[i] - (counts[i] - 1) * ps for i in range(batch)]
            if self._graph_buffers is None:  # (a captured launch keeps the variant it was captured with)
                windows = exact_window(lo, vis_lo, vis_hi, hi if trimmed else [k - 1 for k in kv_lens])
        else:
            self._accept_unplanned_args(spec_args)
        kv_row = list(accumulate(kv_lens, initial=0))
        meta = meta_rows(q_row_base=list(range(batch)), q_pos_base=[k - 1 for k in kv_lens], kv_pos_base=kv_pos_base,
                         request=list(range(batch)), kv_row_base=kv_row[:-1], req_qo_len=[1] * batch,
                         req_kv_len=kv_lens, kernel_window=windows or [-1] * batch, launch_qo_len=[1] * batch,
                         vis_lo=vis_lo, vis_hi=vis_hi)
        int_ws, pinned = self._workspace(0)
        fixed = self._graph_buffers
        plan_info = self.module.plan(self._float_workspace, int_ws, pinned, torch.tensor(kvp_h, dtype=torch.int32),
                                     batch, b.num_qo_heads, b.num_kv_heads, ps, fixed is not None)
        if fixed is not None:  # the captured launch's parameters must not change
            self._graph_plan_info = pin_plan_info(self._graph_plan_info, plan_info, "the decode launch")
        # kv_indptr, last_page_len and vg_meta in one staged copy (no sync)
        staged = self._staging.to_device(kvp_h + last_h + meta, torch.int32)
        count = kvp_h[-1]
        if fixed is not None:  # graph mode: into the buffers the captured launch reads
            fixed[0].copy_(staged)
            fixed[1][:count].copy_(self._staging.on_device(kv_indices[:count]))
            staged, kv_indices = fixed
        elif not trimmed:  # (a trimmed list is a gathered copy already)
            kv_indices = self._own_pages(kv_indices, count)
        self._launch = DecodeLaunch(
            kv_indptr=staged[:batch + 1],
            kv_indices=kv_indices,
            last_page_len=staged[batch + 1:2 * batch + 1],
            meta=staged[2 * batch + 1:].view(batch, META_COLUMNS),
            plan_info=plan_info,
            int_workspace=int_ws,
            float_workspace=self._float_workspace,
            pages=kvp_h[-1] - kvp_h[0],
            exact=windows is not None,
        )
        self._staging.record()
        self.plan_stats["launches"] = [("decode", batch)]
        self.plan_stats["variant"] = "exact" if windows is not None else "masked"
        self.plan_stats["pages"] = {"given": sum(-(-kl // ps) for kl in kv_lens), "visited": self._launch.pages}

    def _page_lists(self) -> list[torch.Tensor]:
        return [self._launch.kv_indices] if self._launch is not None else []  # graph mode: the whole buffer

    def _dim_capacity(self) -> dict[str, int]:
        # (CUDA-graph decode on CUDA cores plans exactly max_batch_size requests: the batch's dims are the capacity)
        return {}

    def _visible_hulls(self, kv_lens: list[int],
                       args: dict[str, Any]) -> tuple[list[int], list[int], list[int], list[int]]:
        """Per request, [lo, hi]: a key range holding every key its (last-token) query sees, and
        [vis_lo, vis_hi]: keys it provably sees (the intervals' dense run; empty: vis_hi < vis_lo),
        where the variant skips the mask. Intervals that read no spec tensor come from torch ops
        on the host: no read-back, so plan() does not wait for a busy GPU (FlashInfer's decode
        plan() with host indptrs does not either). Those that read spec tensors come from the
        planner module's row pass where the wrapper has it, else from torch ops on the GPU: one
        read-back, which waits for the work queued before it."""
        form = usable_form(self.spec, args, "key intervals")
        on_device = bool(tensors_read(form, self.spec))
        kernel = on_device and self._row_planner is not None
        self._plan_stats["intervals"] = "row kernel" if kernel else "torch ops on the GPU" if on_device else "host"
        if kernel:
            rows = plan_rows(self._row_planner, self.spec, form, args, list(range(len(kv_lens) + 1)), kv_lens,
                             self._batch.page_size, self.device, staging=self._staging, buffers=self._row_buffers)
            # (the row pass has no "provably empty": such a request keeps its hull; the mask decides)
            lo_iv, hi_iv, _, dense_hi = rows.rec[RecField.LO:RecField.DENSE_HI + 1].cpu().tolist()
            empty = [0] * len(kv_lens)
        else:
            dev = self.device if on_device else torch.device("cpu")
            i64 = torch.int64
            kv = self._staging.to_device(kv_lens, i64) if dev.type == "cuda" else torch.tensor(kv_lens, dtype=i64)
            request = torch.arange(len(kv_lens), dtype=i64, device=dev)
            q_pos = kv - 1
            env = {"q_pos": q_pos, "q_idx": torch.zeros_like(kv), "q_row": request,
                   "q_kv_row": torch.cumsum(kv, 0) - kv + q_pos, "request": request, "qo_len": torch.ones_like(kv),
                   "kv_len": kv, "vg_kv_lens": kv}
            iv = row_intervals(form, self.spec, env, args)
            lo_iv, hi_iv, dense_hi, empty = torch.stack([iv.lo, iv.hi, iv.dense_hi, iv.empty.to(i64)]).cpu().tolist()
        lo, hi, vis_lo, vis_hi = [], [], [], []
        for a, b, d, e, q in zip(lo_iv, hi_iv, dense_hi, empty, (k - 1 for k in kv_lens)):
            if e:  # no visible key at all: visit the query's own key (the mask rejects it; output 0)
                a = b = q
            lo.append(min(max(a, 0), q))
            hi.append(max(min(b, q), lo[-1]))
            known = not e and min(d, q) >= a
            vis_lo.append(a if known else 0)
            vis_hi.append(min(d, q) if known else -1)
        return lo, hi, vis_lo, vis_hi

    def _run_decode(self, q, want, paged_kv_cache, scales, out, return_lse, enable_pdl, spec_args):
        la = self._launch
        assert la is not None
        q_scale, k_scale, v_scale = scales
        k_cache, v_cache, args, out, lse = self._check_paged_run(
            q, want, paged_kv_cache, scales, spec_args, out, return_lse, enable_pdl)
        tensors, scalars = self._kernel_args(args, q_scale, k_scale, v_scale)
        if enable_pdl is None:  # programmatic dependent launch: sm90+, as FlashInfer defaults
            enable_pdl = self._pdl_default()
        run = self.module.run_exact if la.exact else self.module.run
        run(la.float_workspace, la.int_workspace, la.plan_info, q, k_cache, v_cache, la.kv_indptr, la.kv_indices,
            la.last_page_len, out, lse, LAYOUT_CODES[self.kv_layout], -1, bool(enable_pdl), *tensors, la.meta,
            *scalars)
        return (out, lse) if return_lse else out


def check_q_len_per_request(value: Any, tensor_cores: bool) -> int:
    """plan()'s ``q_len_per_request``, checked: a whole number >= 1, and 1 on CUDA cores."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchError(f"plan(): q_len_per_request={value!r}: expected a whole number >= 1")
    if value > 1 and not tensor_cores:
        raise LaunchError(f"plan(): q_len_per_request={value}: multi-token decode runs on the prefill kernel; make "
                          "the wrapper with use_tensor_cores=True (or backend='fa3' on sm90)")
    return value


def check_queries_fit(kv_lens: list[int], per: int) -> None:
    """Every request holds its ``per`` queries (its last ``per`` tokens); LaunchError naming the first
    that does not."""
    short = next((b for b, kv in enumerate(kv_lens) if kv < per), None)
    if short is not None:
        raise LaunchError(f"plan(): request {short} has kv_len {kv_lens[short]} < q_len_per_request={per} "
                          "(its queries are its last q_len_per_request tokens)")


def check_decode_arguments(paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any) -> None:
    """plan()'s checks of a decode batch's index tensors before their values are read (after its
    sizes were checked), shared by every decode route."""
    check_index_tensors("plan()", paged_kv_indptr=paged_kv_indptr, paged_kv_indices=paged_kv_indices,
                        paged_kv_last_page_len=paged_kv_last_page_len)
    batch = paged_kv_indptr.numel() - 1
    if batch < 1 or paged_kv_last_page_len.numel() != batch:
        raise LaunchError(
            f"plan(): inconsistent batch: paged_kv_indptr has {paged_kv_indptr.numel()} entries, "
            f"paged_kv_last_page_len {paged_kv_last_page_len.numel()} (expected batch+1 and batch, batch >= 1)")


def decode_kv_lens(kvp_h: list[int], last_h: list[int], num_indices: int, page_size: int) -> list[int]:
    """The requests' kv lengths from host copies of paged_kv_indptr and paged_kv_last_page_len,
    checked (``num_indices``: entries of paged_kv_indices); LaunchError naming the argument."""
    check_indptr_starts("plan()", paged_kv_indptr=kvp_h[0])
    kv_lens = []
    for b in range(len(last_h)):
        npages, lp = kvp_h[b + 1] - kvp_h[b], last_h[b]
        if npages < 0:
            raise LaunchError(f"plan(): request {b}: paged_kv_indptr must be non-decreasing")
        if npages == 0:
            raise LaunchError(f"plan(): request {b} has no pages; a decode query is its request's last "
                              "token, so every request needs kv_len >= 1")
        if not 1 <= lp <= page_size:
            raise LaunchError(f"plan(): paged_kv_last_page_len[{b}]={lp}: expected 1..{page_size}")
        kv_lens.append((npages - 1) * page_size + lp)
    if kvp_h[-1] > num_indices:
        raise LaunchError(f"plan(): paged_kv_indices has {num_indices} entries, paged_kv_indptr needs {kvp_h[-1]}")
    check_total_keys(kv_lens, page_size)
    return kv_lens


def read_decode_batch(paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any, page_size: int,
                      ) -> tuple[list[int], list[int], list[int]]:
    """check_decode_arguments, host copies and decode_kv_lens, for a route without DecodeWrapper's
    reads of the page list (the flex route reads its bounds with its plan): (paged_kv_indptr,
    paged_kv_last_page_len, kv lengths)."""
    check_decode_arguments(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
    kvp_h, last_h = host_lists(paged_kv_indptr, paged_kv_last_page_len)
    return kvp_h, last_h, decode_kv_lens(kvp_h, last_h, paged_kv_indices.numel(), page_size)


def gather_page_ranges(kv_indices: torch.Tensor, ranges: list[tuple[int, int]], staging: HostStaging) -> torch.Tensor:
    """int32 page list on the staging device: for each (first, count) of ``ranges``,
    kv_indices[first : first + count], back to back. The ranges' starts go over in one staged
    copy; a search + index in torch ops gathers (no repeat_interleave, which syncs here)."""
    starts, shifts, total = [], [], 0
    for first, count in ranges:
        if count:
            starts.append(total)
            shifts.append(first - total)
            total += count
    out = torch.empty(total, dtype=torch.int32, device=staging.device)
    if total == 0:
        return out
    table = staging.to_device(starts + shifts, torch.int64).view(2, -1)
    # output entry k lies in range i = the last range starting at or before k
    k = torch.arange(total, device=staging.device)
    i = torch.searchsorted(table[0], k, right=True) - 1
    return out.copy_(kv_indices.to(staging.device)[k + table[1][i]])
