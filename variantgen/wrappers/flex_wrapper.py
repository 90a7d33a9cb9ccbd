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
_gather), calls Flex, and writes o / lse. run() is differentiable in q, k, v and float spec tensors
(Flex's backward pass where it runs compiled, on CUDA; the dense path of flex_dense.py without
compile=True, the CPU's default). No CUDA-graph mode (plan() and run() sync with the host).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from ..core.errors import BackendError, LaunchError
from ..core.flags import check_flags
from ..lang.evaluate import Evaluator
from ..lang.expr import names_used
from ..lang.library import resolve_spec
from ..lang.spec import VariantSpec
from ..planning.intervals import row_intervals, usable_form
from ..planning.plan import Batch
from ..planning.rowrules import row_env
from ..routing.capabilities import FLEX, KINDS, canonical_dtype, graph_problem
from . import flex_blocks as flex
from .base import TORCH_DTYPES, WrapperBase
from .checks import check_plan_sizes
from .flex_blocks import BLOCK, Blocks, FlexLayout, RowBlocks
from .flex_dense import dense_attend
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


def _values_of(args: dict[str, Any], names: Collection[str]) -> ArgValues:
    """The values of the arguments ``names`` as they are now (tensors copied): what a plan found
    from them holds while run() gets equal ones. (A tensor's address and version would not do:
    memory refilled outside torch - numpy, DLPack, another library's kernel - keeps both.)"""
    return tuple((n, v.detach().clone() if isinstance(v, torch.Tensor) else v)
                 for n, v in sorted(args.items()) if n in names)


def _same_values(values: ArgValues, args: dict[str, Any]) -> bool:
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

    def _page_lists(self) -> list[torch.Tensor]:
        return []  # (run() gathers the planned keys itself: no kernel reads the caller's page list)

    def _dim_capacity(self) -> dict[str, int]:
        return {}  # (no graph mode)

    # ------------------------------------------------------------------ plan helpers
    def _reset(self) -> None:
        self._batch, self._plan, self._planned_args, self._run_blocks = None, None, {}, None

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

    # ------------------------------------------------------------------ run helpers
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
        if self._run_blocks is None or not _same_values(self._run_blocks[0], args):
            self._run_blocks = (_values_of(args, read), flex.blocks_from_mask(plan.layout, plan.reach, mods, self.spec))
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


# ----------------------------------------------------------------------------- paged prefill


class FlexPrefillWrapper(FlexWrapperBase):
    """Paged-KV prefill on FlexAttention (kind "prefill"); make_wrapper(..., backend="flex")."""

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, page_size: int,
             *, skip_tiles: bool | None = None, disable_split_kv: bool = False, **spec_args: Any) -> None:
        """Plan a batch (VariantWrapper.plan's arguments; ``disable_split_kv`` has no effect:
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
            return
        intervals = self._plan_intervals(paged.qo_indptr, list(b.kv_lens), skip_tiles, spec_args)
        plan = self._packed_plan(paged.qo_indptr, list(b.kv_lens), paged.kv_indptr[:-1], intervals, page_size)
        self._set_pages(plan, paged_kv_indices, *plan.source)
        self._finish_plan(plan, paged_kv_indices, paged.kv_indptr[-1])

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
             *, disable_split_kv: bool = False, **spec_args: Any) -> None:
        """Plan a batch from its indptrs. Spec arguments may be passed here as to the FlashInfer
        ragged wrapper: checked, not used (the block mask comes from run()'s arguments)."""
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
            return
        self._plan = self._ragged_plan(None)
        self._finish_plan(self._plan)

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
        if self._interval_plan_of is None or not _same_values(self._interval_plan_of[0], args):
            self._staging.begin()
            plan = self._ragged_plan(self._row_intervals(self._qo_h, list(self._batch.kv_lens), args))
            self._finish_plan(plan)
            self._interval_plan_of = (_values_of(args, self._interval_facts.args), plan)
        return self._interval_plan_of[1]


# ----------------------------------------------------------------------------- decode


class FlexDecodeWrapper(FlexWrapperBase):
    """Paged-KV decode on FlexAttention (kind "decode"): DecodeWrapper's plan()/run(), one query
    per request (its last token), one Flex batch row per request."""

    _multi: FlexPrefillWrapper | None = None  # multi-token decode: the prefill route plans and runs it
    _prefill_route: FlexPrefillWrapper | None = None  # made on the first multi-token plan, then kept

    def plan(self, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, page_size: int,
             *, q_len_per_request: int = 1, skip_tiles: bool | None = None, **spec_args: Any) -> None:
        """Plan a decode batch. ``skip_tiles`` turns key trimming on/off (default: on where the
        spec's key intervals are known and plan() was given the tensors they read): only the
        keys a query can see are gathered, and the block mask comes from the intervals.
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
            self._batch = multi._batch
            return
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
