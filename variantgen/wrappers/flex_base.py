"""What the flex route's wrappers share (flex_wrapper.py holds the kinds, the factory and the
probe): ``FlexConfig``, what a flex wrapper is specialised on; ``FlexPlan``, a planned batch's
layout, key sources and block lists; and ``FlexWrapperBase``, base.WrapperBase's checks plus
the layout tables plan() builds (the packed layout of prefill and ragged), the page list's
bounds, the gather of the planned keys, the call into Flex (compiled, or the dense path of
flex_dense.py) and the outputs (v_scale, the base-2 LSE, a spec's sink).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from ..core.errors import LaunchError
from ..lang.evaluate import Evaluator
from ..lang.nodes import names_used
from ..lang.values import VariantSpec
from ..planning.intervals import row_intervals, usable_form
from ..planning.plan import Plan, ScheduledPlan
from ..planning.rowrules import row_env
from . import flex_blocks as flex
from .base import WrapperBase
from .flex_blocks import Blocks, FlexLayout, RowBlocks
from .flex_dense import dense_attend


@dataclass(frozen=True)
class FlexConfig:
    """What a flex wrapper is specialised on (the fields of render.ModuleConfig that the shared
    wrapper checks read), and whether Flex runs compiled."""

    spec: VariantSpec
    head_dim_qk: int
    head_dim_vo: int
    q_dtype: str
    kv_dtype: str
    o_dtype: str
    kind: str
    compiled: bool
    backend: str = "flex"
    mask_modes: tuple[str, ...] = ()

    def describe(self) -> dict[str, object]:
        return {"spec": self.spec.name, "spec_file": self.spec.path, "backend": "flex", "kind": self.kind,
                "head_dim_qk": self.head_dim_qk, "head_dim_vo": self.head_dim_vo, "q_dtype": self.q_dtype,
                "kv_dtype": self.kv_dtype, "o_dtype": self.o_dtype, "compiled": self.compiled}


@dataclass
class FlexPlan:
    """A planned batch: the layout, where each gathered key comes from, the block mask's blocks
    (None: found from run()'s arguments), and each row's reachable keys (for that search)."""

    layout: FlexLayout
    gathered: int  # keys gathered (the rest of layout.kv_len is zero padding)
    source: tuple[torch.Tensor, ...]  # per key, on the device: (pages, offsets); ragged (rows,), or () for all
    dest: torch.Tensor | None  # each gathered key's row in the [batch * kv_len] buffer
    reach: RowBlocks
    blocks: Blocks | None
    q_rows: torch.Tensor | None = None  # packed: the Flex row of each of the caller's query rows


ArgValues = tuple[tuple[str, Any], ...]  # spec arguments by name: scalars, and copies of tensors


def values_of(args: dict[str, Any], names: Collection[str]) -> ArgValues:
    """The values of the arguments ``names`` as they are now (tensors copied): what a plan found
    from them holds while run() gets equal ones. (A tensor's address and version would not do:
    memory refilled outside torch - numpy, DLPack, another library's kernel - keeps both.)"""
    return tuple((n, v.detach().clone() if isinstance(v, torch.Tensor) else v)
                 for n, v in sorted(args.items()) if n in names)


def same_values(values: ArgValues, args: dict[str, Any]) -> bool:
    for name, old in values:
        new = args.get(name)
        if isinstance(old, torch.Tensor):
            if not (isinstance(new, torch.Tensor) and new.shape == old.shape and new.dtype == old.dtype
                    and new.device == old.device and torch.equal(new, old)):
                return False
        elif new != old:
            return False
    return True


class FlexWrapperBase(WrapperBase):
    """What the flex wrappers share: the layout tables, the block masks and the call."""

    _equal_kv_strides = False  # (K and V are gathered each with its own strides: qk and vo dims may differ)
    _trains = True  # run() is differentiable: Flex's backward on the GPU, the dense path on the CPU

    def __init__(self, spec: VariantSpec, config: FlexConfig, workspace: torch.Tensor, kv_layout: str = "NHD"):
        super().__init__(spec, config, None, None, workspace, kv_layout)  # type: ignore[arg-type]
        self._plan: FlexPlan | None = None
        self._qo_h: list[int] = []  # ragged: plan()'s host indptrs (run() plans the intervals)
        self._kv_h: list[int] = []
        # (the argument values they were found for, what was found): kept while run() gets the same values
        self._run_blocks: tuple[ArgValues, Blocks] | None = None  # the last run()'s blocks (planner off)
        self._interval_plan_of: tuple[ArgValues, FlexPlan] | None = None  # ragged: the last run()'s plan
        self.compiled = config.compiled
        self.plan_stats["backend"] = "flex"
        self.last_plan: Plan | None = None  # what the last plan() decided (None: no plan, or it failed)

    def _page_lists(self) -> list[torch.Tensor]:
        return []  # (run() gathers the planned keys itself: no kernel reads the caller's page list)

    def _dim_capacity(self) -> dict[str, int]:
        return {}  # (no graph mode)

    # ------------------------------------------------------------------ what the kinds' plan() share
    def _reset(self) -> None:
        self._batch, self._plan, self._planned_args, self._run_blocks = None, None, {}, None
        self.last_plan = None

    def _keep_plan(self, scheduled_by: str, reason: str, planner: str = "intervals") -> ScheduledPlan:
        """last_plan for this plan(): how the Flex call's work is laid out, and ``reason`` why the
        key intervals are not used ("": they are, ``planner`` names how)."""
        figures = {k: self.plan_stats[k] for k in ("keys_gathered", "blocks") if k in self.plan_stats}
        self.last_plan = ScheduledPlan(self._batch, kind=self.config.kind, backend="flex", scheduled_by=scheduled_by,
                                       planner="off" if reason else planner, reason=reason,
                                       runs=list(self.plan_stats.get("launches", [])), figures=figures)
        return self.last_plan

    def _note_off(self, reason: str) -> None:
        """plan_stats["planner_off"]: why the intervals are not used for this plan (none when they are)."""
        if reason:
            self.plan_stats["planner_off"] = reason
        else:
            self.plan_stats.pop("planner_off", None)

    def _row_intervals(self, qo_h: list[int], kv_lens: list[int], args: dict[str, Any]):
        """(row builtins, the spec's key intervals) of every query row: rowrules.row_env's rows."""
        form = usable_form(self.spec, args)
        env = row_env(qo_h, kv_lens, self.device)
        return env, row_intervals(form, self.spec, env, args)

    def _key_ranges(self, env: dict[str, torch.Tensor], iv: Any, batch: int) -> tuple[list[int], list[int]]:
        """Per request, the first kv_pos and the number of keys some query sees (host lists; one
        device-to-host copy): the hull of its rows' intervals."""
        seen = ~iv.empty & (iv.lo <= iv.hi)
        r = env["request"]
        big = torch.iinfo(torch.int64).max
        first = torch.full((batch,), big, dtype=torch.int64, device=self.device)
        first = first.scatter_reduce(0, r, torch.where(seen, iv.lo, big), "amin")
        end = torch.zeros(batch, dtype=torch.int64, device=self.device)
        end = end.scatter_reduce(0, r, torch.where(seen, iv.hi + 1, 0), "amax")
        first_h, end_h = torch.stack([first, end]).cpu().tolist()
        base = [f if e > 0 else 0 for f, e in zip(first_h, end_h)]
        count = [max(e - b, 0) for b, e in zip(base, end_h)]
        return base, count

    def _tables(self, values: list[list[int]]) -> list[torch.Tensor]:
        """Host int lists (one entry per request) as int64 device tensors, in one staged copy."""
        flat = [x for v in values for x in v]
        dev = self._staging.to_device(flat, torch.int64) if flat else torch.zeros(0, dtype=torch.int64,
                                                                                  device=self.device)
        return list(dev.split([len(v) for v in values]))

    def _keys(self, count: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request, index among its request's gathered keys) of each of ``total`` gathered keys."""
        r = torch.repeat_interleave(torch.arange(count.numel(), device=self.device), count, output_size=total)
        start = torch.cumsum(count, 0) - count
        return r, torch.arange(total, device=self.device) - start[r]

    def _packed_plan(self, qo_h: list[int], kv_lens: list[int], source_start: list[int], intervals: Any,
                     page_size: int | None) -> FlexPlan:
        """The packed layout (prefill, ragged): queries as in q, each request's gathered keys back
        to back. ``source_start``: per request, its first page-list entry (paged, ``page_size``
        given) or its first row of k (ragged); ``intervals``: (row env, RowIntervals), or None
        (every key gathered, blocks from the mask)."""
        b = self._batch
        assert b is not None
        batch, dev = b.batch_size, self.device
        if intervals is not None:
            env, iv = intervals
            base, count = self._key_ranges(env, iv, batch)
        else:
            base, count = [0] * batch, list(kv_lens)
        # Every request's queries and keys start at a multiple of BLOCK (flex.align_starts: no tile
        # mixes two requests, so one request's NaN or inf never reaches another's rows).
        key_start = flex.align_starts(count)
        gathered = sum(count)
        qo_lens = [qo_h[r + 1] - qo_h[r] for r in range(batch)]
        q_start = flex.align_starts(qo_lens)
        q_len, kv_len = q_start[-1], key_start[-1]
        kv_row_base = list(accumulate(kv_lens, initial=0))[:-1]
        t = self._tables([qo_lens, list(kv_lens), q_start[:-1], kv_row_base, key_start[:-1], base, count, source_start,
                          qo_h[:-1]])
        qo_len, key_start_t, key_base, key_count, src0 = t[0], t[4], t[5], t[6], t[7]
        rows_req = torch.repeat_interleave(torch.arange(batch, device=dev), qo_len, output_size=qo_h[-1] - qo_h[0])
        q_rows = t[2][rows_req] + torch.arange(qo_h[0], qo_h[-1], device=dev) - t[8][rows_req]
        q_request = torch.full((q_len,), -1, dtype=torch.int64, device=dev)
        q_request[q_rows] = rows_req
        key_r, local = self._keys(key_count, gathered)
        key_rows = key_start_t[key_r] + local  # each gathered key's Flex key row
        key_request = torch.full((kv_len,), -2, dtype=torch.int64, device=dev)
        key_request[key_rows] = key_r
        layout = FlexLayout(True, 1, q_len, kv_len, b.num_qo_heads, b.num_kv_heads, qo_len=qo_len, kv_len_req=t[1],
                            q_start=t[2], kv_row_base=t[3], key_start=key_start_t, key_base=key_base,
                            key_count=key_count, q_request=q_request, key_request=key_request, q_row_start=t[8])
        pos = key_base[key_r] + local  # each gathered key's kv_pos
        if page_size is not None:  # (page-list entry, offset in the page)
            source: tuple[torch.Tensor, ...] = (src0[key_r] + pos // page_size, pos % page_size)
        elif any(base) or count != list(kv_lens):  # ragged rows
            source = (src0[key_r] + pos,)
        else:  # every row of k in order: k is used as it is
            source = ()
        first = key_start_t[rows_req]
        reach = RowBlocks(torch.zeros_like(q_rows), q_rows, first, first + key_count[rows_req] - 1,
                          torch.zeros_like(q_rows, dtype=torch.bool))
        blocks = None
        if intervals is not None:
            env, iv = intervals
            shift = first - key_base[rows_req]
            seen = ~iv.empty & (iv.lo <= iv.hi)
            lo = iv.lo + shift
            hi = torch.where(seen, iv.hi + shift, lo - 1)
            blocks = flex.blocks_from_intervals(layout, RowBlocks(reach.b, q_rows, lo, hi, iv.exact & seen))
        return FlexPlan(layout, gathered, source, key_rows, reach, blocks, q_rows)

    def _finish_plan(self, plan: FlexPlan, kv_indices: torch.Tensor | None = None, entries: int = 0) -> None:
        """Keep the plan; read back (in one copy) the block counts and, paged, the bounds of the
        page list ``kv_indices[:entries]`` for _plan_pages."""
        self._staging.record()
        wanted = []
        folded = bool(entries) and kv_indices is not None and kv_indices.device == self.device
        if folded:
            wanted += [x.long() for x in torch.aminmax(kv_indices[:entries])]
        if plan.blocks is not None:
            wanted += [plan.blocks.kv_num.sum(), plan.blocks.full_num.sum()]
        values = torch.stack(wanted).cpu().tolist() if wanted else []
        if kv_indices is not None:
            bounds = values[:2] if folded else None
            values = values[2:] if folded else values
            self._plan_pages(kv_indices, entries, bounds)
        if plan.blocks is not None:
            total = plan.blocks.kv_num.numel() * plan.blocks.kv_idx.shape[-1]
            self.plan_stats["blocks"] = {"partial": values[0], "full": values[1], "total": total}
        else:
            self.plan_stats.pop("blocks", None)
        self._plan = plan
        self.plan_stats["launches"] = [("flex", self._batch.batch_size)] if self._batch.total_q else []
        self.plan_stats["keys_gathered"] = plan.gathered

    # ------------------------------------------------------------------ what the kinds' run() share
    def _check_planned(self) -> FlexPlan | None:
        """The plan (None for a batch without queries); LaunchError before any plan()."""
        if self._batch is None or (self._batch.total_q and self._plan is None):
            raise LaunchError("run() called before plan(): call plan(...) first")
        return self._plan

    def _blocks(self, plan: FlexPlan, mods: flex.FlexMods, args: dict[str, Any]) -> Blocks:
        """The planned blocks, or the ones found from the mask for these arguments (kept while
        run() gets the same tensors, unmodified, and scalars)."""
        if plan.blocks is not None:
            return plan.blocks
        read = names_used(self.spec.mask)
        if self._run_blocks is None or not same_values(self._run_blocks[0], args):
            self._run_blocks = (values_of(args, read), flex.blocks_from_mask(plan.layout, plan.reach, mods, self.spec))
            self.plan_stats["blocks"] = self._run_blocks[1].counts()
        return self._run_blocks[1]

    def _plan_pages(self, kv_indices: torch.Tensor, entries: int, bounds: list[int] | None) -> None:
        """The batch's page list ``kv_indices[:entries]`` to the page guard, as on the FlashInfer
        routes: every entry, gathered or not, must be a page of run()'s cache - negative ones are
        refused here, the rest by run() (checks.py). ``bounds``: its (min, max) if read back
        already. A failed plan() leaves no plan."""
        if bounds is None and entries:
            low, high = torch.aminmax(kv_indices[:entries])
            bounds = [int(low), int(high)]
        try:
            self._pages.begin(kv_indices, entries, bounds or [])
            self._pages.finish()
        except BaseException:
            self._reset()
            raise

    def _set_pages(self, plan: FlexPlan, indices: torch.Tensor, entries: torch.Tensor, offsets: torch.Tensor) -> None:
        """The page of each gathered key, read from paged_kv_indices now (run() gathers from this copy)."""
        pages = indices.to(self.device)[entries].to(torch.int64)
        plan.source = (pages, offsets)

    def _gather(self, plan: FlexPlan, cache: torch.Tensor, rows_shape: tuple[int, ...], dtype: torch.dtype,
                ) -> torch.Tensor:
        """The planned keys of ``cache`` (paged, in the wrapper's layout; or ragged rows) in one
        zero-padded ``dtype`` buffer of ``rows_shape`` rows, each at its Flex key row (plan.dest;
        zeros: a padding key must still be finite). Keys are read with one index_select where
        the cache's rows lie back to back (NHD): on the H200 it gathered 8 x 8192 keys (K and V)
        in 0.17 ms, where the advanced indexing of the other layouts took 1.0 ms
        (bench/results/2026-12-01-h200/flex-compile-standalone.log). Differentiable in ``cache``."""
        rows_view, index = None, None
        if len(plan.source) == 2:  # (pages, offsets)
            pages, offs = plan.source
            if self.kv_layout == "NHD" and cache.stride(0) == cache.shape[1] * cache.stride(1):
                rows_view, index = cache.flatten(0, 1), pages * cache.shape[1] + offs
        elif self.kv_layout == "NHD":  # ragged rows (all of them, in order, when the source is empty)
            rows_view, index = cache, (plan.source[0] if plan.source else None)
        if rows_view is not None:
            rows = rows_view if index is None else torch.index_select(rows_view, 0, index)
        elif len(plan.source) == 2:  # HND pages, or NHD pages not back to back
            rows = cache[pages, offs] if self.kv_layout == "NHD" else cache[pages, :, offs]
        else:  # ragged HND
            rows = (cache[:, plan.source[0]] if plan.source else cache).transpose(0, 1)
        out = torch.zeros(rows_shape, dtype=dtype, device=self.device)
        out[plan.dest] = rows.to(dtype)  # (fp8 keys: widened here)
        return out

    def _attend(self, plan: FlexPlan, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, args: dict[str, Any],
                q_scale: float | None, k_scale: float | None, want_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Flex over the laid-out tensors: (o, natural-log lse or an empty tensor)."""
        mods = flex.make_mods(self.spec, plan.layout, flex.capture_args(self.spec, args, self.device))
        scale = self._sm_scale(q_scale, k_scale)
        blocks = self._blocks(plan, mods, args)  # (also on the dense path: plan_stats report them, kept per args)
        if not self.compiled:  # the dense path: isolated per request, differentiable (flex_dense.py)
            return dense_attend(plan.layout, mods, q4, k4, v4, scale)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q4, k4, v4, *args.values())
                                               if isinstance(t, torch.Tensor))
        if grad and self.device.type == "cpu":
            raise LaunchError("run(): inputs that require grad: torch's compiled CPU FlexAttention has no backward "
                              "pass; make the wrapper with compile=False on the CPU (the default) to train")
        block_mask = blocks.block_mask(mods.mask_mod, plan.layout, backward=grad)
        want_lse = want_lse or self.spec.sink is not None  # the sink is applied from the LSE (_finish)
        if want_lse and self.device.type == "cpu":
            why = (f"spec `{self.spec.name}` has a sink, which the flex route applies from the LSE"
                   if self.spec.sink is not None else "run(return_lse=True)")
            raise LaunchError(f"{why}: torch's compiled CPU FlexAttention returns no LSE; make the wrapper with "
                              "compile=False on the CPU (the default)")
        return flex.flex_call(q4, k4, v4, mods, block_mask, scale, self.compiled, want_lse,
                              (self.spec.digest, plan.layout.packed), grad=grad)

    def _sink_logits(self, args: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The spec's sink logit for each output row and query head, float32 [rows, heads]: the
        builtins a sink may read (expr.SINK_BUILTINS) per row's request and per head."""
        b = self._batch
        assert b is not None and self.spec.sink is not None
        i64 = torch.int64
        qo_lens = torch.tensor(b.qo_lens, dtype=i64, device=device)
        kv_lens = torch.tensor(b.kv_lens, dtype=i64, device=device)
        request = torch.repeat_interleave(torch.arange(len(b.qo_lens), device=device), qo_lens).view(-1, 1)
        qo_head = torch.arange(b.num_qo_heads, dtype=i64, device=device).view(1, -1)
        env = {"request": request, "qo_len": qo_lens[request], "kv_len": kv_lens[request], "qo_head": qo_head,
               "kv_head": qo_head // (b.num_qo_heads // b.num_kv_heads)}
        value = Evaluator(self.spec, env, args).as_float(self.spec.sink)
        return value.expand(request.shape[0], b.num_qo_heads)

    def _finish(self, o: torch.Tensor, lse_n: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                v_scale: float | None, return_lse: bool, args: dict[str, Any]):
        """o / lse into the caller's outputs: o times v_scale in the output dtype, the LSE in base 2.
        A learned sink s (a logit with no value) joins each row's softmax here, from the LSE Flex
        returns: o *= sigmoid(lse - s) = sum / (sum + e^s), lse = logaddexp(lse, s)."""
        if self.spec.sink is not None:
            sink = self._sink_logits(args, o.device)
            # a -inf sink (no sink) keeps o, also on a row with no key (whose lse is -inf too)
            keep = torch.where(torch.isneginf(sink), torch.ones_like(sink), torch.sigmoid(lse_n.float() - sink))
            o = o * keep.unsqueeze(-1)  # (in float32: keep is)
            lse_n = torch.logaddexp(lse_n.float(), sink)
        out.copy_(o if v_scale is None else o * v_scale)
        if lse is not None:
            lse.copy_(lse_n / math.log(2.0))
        return (out, lse) if return_lse else out
