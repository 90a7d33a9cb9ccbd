"""plan()'s planner: a batch, the checked spec arguments and its page list in, a Plan out.

Every launch of every path is built by one implementation, the launch builder
(templates/plan/launches.h), compiled into the spec's planner module and into every paged
prefill module; this module calls it and turns its answer into a plan.Plan:

* planned (the interval planner on, and the spec's planner module at hand): the planner
  module's ``plan_batch`` runs the row pass (rowplan.py), reads the launch requests back,
  builds the launches, copies them to the device and gathers their page lists - one host
  call (README: plan() time);
* planner off (asked for, the spec has no usable intervals, plan() was not given the tensors
  they read, or no planner module: JIT disabled and not precompiled, or a CPU wrapper): the
  kernel module's ``plan_direct`` lays out one custom launch request per request (the mask on
  every element) with the same builder; the Plan says why;
* CUDA-graph mode (graph.py): the same calls with the capacity in the builder's options, into
  the graph's fixed workspace; launch slots, window widths and plan_info pinned.

What is left in Python is reading the descriptor (plan_abi's layout) into device views, and
FlashInfer's own scheduler for the fa2 launches the builder leaves to it (below FlashInfer's
split-KV bar, where splitting KV may pay). The planner knows nothing of the wrapper: the
wrapper validates plan()'s arguments, asks its Planner, and runs the Plan.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from ..abi.table import (
    DESC_FIELDS,
    FA3_MAX_WINDOW_LAUNCHES,
    HEADER_FIELDS,
    LAUNCH_FIELDS,
    MAX_PIECES,
    OPTION_FIELDS,
    HeaderField,
    LaunchArray,
    LaunchField,
    MaskMode,
    PlanOption,
    PrefillPlanInfo,
    Schedule,
    Status,
)
from ..core.errors import LaunchError
from ..core.staging import INT_WORKSPACE_BYTES, HostStaging, IntWorkspaces
from ..lang.values import VariantSpec
from .assembly import TableRules, segment_table
from .graph import GraphBuffers, GraphCapacity, slot_name
from .intervals import analyze
from .pieces import INLINE_KEYS, InlinePieces, MergeRows, merge_rows
from .plan import Batch, Launch, LaunchLayout, Plan
from .rowplan import call_layout, kept_buffer, row_buffers

# How rows that see several key intervals run (Planner.split_rows): "pieces" or "gaps".
SPLIT_ROWS = "pieces"
H, L = HEADER_FIELDS, LAUNCH_FIELDS
# The table as plain values for plan()'s hot path (an enum lookup or call costs host time each plan).
_COUNTS = tuple((f.name.lower(), int(f)) for f in HeaderField if f >= HeaderField.DENSE)
_ARRAYS = tuple((a.ints(1) - a.ints(0), a.ints(0)) for a in LaunchArray)  # entries = k n + c, in order
_MODES, _SCHEDULES = tuple(MaskMode), tuple(Schedule)


def fa3_cta_tile_q(head_dim_vo: int) -> int:
    """Query rows per tile of FlashInfer's sm90 prefill kernel (its dispatch by head dim)."""
    return 192 if head_dim_vo == 64 else 128


def _metadata_sizes(n: int) -> list[int]:
    """Entries of a launch's metadata arrays (LaunchArray order) for n launch requests."""
    return [k * n + c for k, c in _ARRAYS]


class Planner:
    """Plans the batches of one paged-prefill wrapper. ``module``: the wrapper's kernel module
    (its ``plan_direct``; fa2: FlashInfer's ``plan`` too); ``graph``: CUDA-graph mode's
    capacity. It owns what plans need from one to the next: the row pass's buffers, how many
    launch requests to read back, the workspace the launches live in and its page-locked
    mirror, FlashInfer's int workspaces, and the staging of its host-to-device copies."""

    def __init__(self, module: Any, spec: VariantSpec, *, backend: str, head_dim_qk: int, head_dim_vo: int,
                 kv_dtype_bytes: int, device: torch.device, float_workspace: torch.Tensor,
                 graph: GraphCapacity | None = None):
        self.module = module
        self.spec = spec
        self.form = analyze(spec)
        self.fa3 = backend == "fa3"
        self.backend = backend
        self.device = device
        self.float_workspace = float_workspace
        self.staging = HostStaging(device)
        self.graph = GraphBuffers(graph, device, self.fa3) if graph is not None else None
        # The spec's planner module (rowplan.py); None: plans run planner-off, ``row_planner_reason`` says why.
        self.row_planner: Any = None
        self.row_planner_reason = ""
        self.segment_capacity = 1024  # launch requests the row pass's read-back has room for
        self.segment_read = 64  # launch requests plan_batch copies back at first (more: a second copy)
        self.row_buffers: dict[str, torch.Tensor] = {}  # the row pass's buffers, kept across plans
        self.workspace_bytes = INT_WORKSPACE_BYTES  # the launches' workspace, grown when the builder asks
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._flashinfer = IntWorkspaces(device)
        self._float_chunk_cache: dict[int, list[torch.Tensor]] = {}
        self.desc = torch.zeros(DESC_FIELDS, dtype=torch.int64)
        self.options = torch.zeros(OPTION_FIELDS, dtype=torch.int64)
        self._opt = self.options.numpy()  # written in place: no torch op per field
        o = self._opt
        o[PlanOption.FA3] = int(self.fa3)
        o[PlanOption.NUM_SM] = (torch.cuda.get_device_properties(device).multi_processor_count
                                if device.type == "cuda" else 1)
        o[PlanOption.FA3_CTA_TILE_Q] = fa3_cta_tile_q(head_dim_vo)
        o[PlanOption.HEAD_DIM_QK] = head_dim_qk
        o[PlanOption.HEAD_DIM_VO] = head_dim_vo
        o[PlanOption.KV_DTYPE_BYTES] = kv_dtype_bytes
        o[PlanOption.MAX_WINDOW_LAUNCHES] = FA3_MAX_WINDOW_LAUNCHES
        o[PlanOption.WINDOW_COUNT] = -1
        if self.graph is not None:
            cap = self.graph.capacity
            o[PlanOption.GRAPH_REQUESTS] = cap.launch_requests
            o[PlanOption.GRAPH_PAGES] = cap.launch_pages
            o[PlanOption.GRAPH_ROWS] = cap.max_total_q
            if self.graph.windows is not None:
                self._pin_windows(self.graph.windows)
        self._last: weakref.ref[Plan] | None = None
        # fa3 GQA packing for batches of short requests (pack_gqa below); a switch for comparisons.
        self.pack_gqa_enabled = True
        # Rows that see several key intervals (at most this many; 0: off, such rows run custom over
        # their hull) run as ``split_rows`` says: "gaps", custom launch requests whose page lists
        # skip the gaps between their rows' intervals (gaps.py), or "pieces", one launch request per
        # interval merged by LSE (pieces.py). Switches for comparisons. CUDA-graph mode always
        # runs gaps: they write in place, so the fixed launch slots and workspace hold them as
        # they are; pieces would need partial outputs and a merge sized per batch.
        self.max_pieces = MAX_PIECES
        self.split_rows = SPLIT_ROWS
        # A first piece of at most this many keys computed by run()'s merge (pieces.py's
        # inline_first_pieces; 0: launched as the other pieces); only for plain scores (no logits
        # transform) and q, k, v and o of one dtype (the wrapper keeps it 0 otherwise). Measured
        # faster than launching the sinks (H100, streaming_sink at 8 x 8192: 3.85 ms per run()
        # against 4.21, 3.89 against 4.04 back to back; bench/results/2026-12-07-h100/pieces-65ab64a.json).
        self.inline_keys = INLINE_KEYS
        self.inline_allowed = spec.logits is None
        # Custom runs of rows that see a key set read only the pages holding one (keysets.py; not
        # in CUDA-graph mode). A switch for comparisons.
        self.key_set_lists = True

    def pack_gqa(self, batch: Batch) -> int:
        """Query heads folded into each packed row group of this batch's fa3 launches (1: none).
        FlashInfer's sm90 kernel tiles 128 (hd 64: 192) query rows of one head, so a short request
        fills a tile with few rows and every query head of a GQA group reads the same keys again.
        Packing runs a key/value head's whole group as rows of one tile, which reads the keys once:
        done where every request's rows x group fit one tile (decode, multi-token decode, draft
        trees); in CUDA-graph mode where the capacity's longest request does (GraphCapacity's
        max_qo_len), fixed by the first plan. Not for a spec with a learned sink (its sink is per
        tile head)."""
        group = batch.num_qo_heads // batch.num_kv_heads
        if not self.fa3 or group == 1 or not self.pack_gqa_enabled or self.spec.sink is not None or not batch.qo_lens:
            pack = 1
        else:
            longest = self.graph.capacity.longest_request if self.graph is not None else max(batch.qo_lens)
            pack = group if longest * group <= int(self._opt[PlanOption.FA3_CTA_TILE_Q]) else 1
        if self.graph is not None:
            if self.graph.pack_gqa is None:
                self.graph.pack_gqa = pack
            elif pack != self.graph.pack_gqa:
                raise LaunchError(f"plan(): GQA packing {pack} differs from the {self.graph.pack_gqa} this CUDA-graph "
                                  "wrapper planned first with (a captured run packs q and out, or does not)")
        return pack

    @property
    def num_sms(self) -> int:
        """SMs the fa3 work lists are balanced over (and fa2's split-KV bar counts)."""
        return int(self._opt[PlanOption.NUM_SM])

    @num_sms.setter
    def num_sms(self, value: int) -> None:
        self._opt[PlanOption.NUM_SM] = value

    @property
    def max_window_launches(self) -> int:
        """fa3: window widths given their own launch (the others run custom)."""
        return int(self._opt[PlanOption.MAX_WINDOW_LAUNCHES])

    @max_window_launches.setter
    def max_window_launches(self, value: int) -> None:
        self._opt[PlanOption.MAX_WINDOW_LAUNCHES] = value

    def set_row_planner(self, module: Any, reason: str = "") -> None:
        """The spec's planner module (None: planner-off plans, ``reason`` says why)."""
        self.row_planner, self.row_planner_reason = module, reason

    def no_module_reason(self) -> str:
        why = self.row_planner_reason or (
            "a CPU wrapper" if self.device.type != "cuda" else "make_wrapper set none")
        return f"no planner module ({why}): one custom launch per request"

    def fa2_min_tiles(self, num_kv_heads: int, disable_split_kv: bool) -> int:
        """Query tiles from which an fa2 launch gets the builder's work list (no split-KV)
        rather than FlashInfer's scheduler. FlashInfer splits KV only when the tiles cannot fill
        its grid (2 CTAs per SM over the KV heads); with at least that many it would not split,
        and the builder's work list is its. 0: always (split-KV off, or CUDA-graph mode)."""
        if disable_split_kv or self.graph is not None:
            return 0
        return 2 * self.num_sms // num_kv_heads

    # ------------------------------------------------------------------ plan
    def plan(self, batch: Batch, indices: torch.Tensor, kv_indices: torch.Tensor, args: dict[str, Any] | None, *,
             disable_split_kv: bool = False, reason: str = "", pages_given: int = 0) -> Plan:
        """The Plan of a checked batch. ``indices``: plan()'s qo_indptr, paged_kv_indptr and
        last_page_len back to back on the host (int32); ``kv_indices``: its page list (at least
        paged_kv_indptr[-1] entries, any device); ``args``: the checked spec arguments the
        interval planner reads (None: planner off, ``reason`` says why); ``pages_given``:
        paged_kv_indptr[-1] (for the Plan's summary)."""
        previous = self._last() if self._last is not None else None
        if previous is not None:  # still referenced: it keeps a copy of what the next lines rewrite
            previous.keep()
        self.staging.begin()
        if self.graph is not None:
            self.graph.check_shape(batch.num_qo_heads, batch.num_kv_heads, batch.page_size)
        if args is not None and self.row_planner is None:
            args, reason = None, self.no_module_reason()
        planned = args is not None
        if batch.total_q == 0 and self.graph is None:  # nothing to compute; run() returns empty outputs
            plan = Plan(batch, [], backend=self.backend, planner="module" if planned else "off", reason=reason,
                        counts={}, pages_given=pages_given)
            self._last = weakref.ref(plan)
            return plan
        o = self._opt
        o[PlanOption.PAGE_SIZE] = batch.page_size
        o[PlanOption.NUM_QO_HEADS] = batch.num_qo_heads
        o[PlanOption.NUM_KV_HEADS] = batch.num_kv_heads
        o[PlanOption.FA2_MIN_TILES] = self.fa2_min_tiles(batch.num_kv_heads, disable_split_kv)
        pack = o[PlanOption.PACK_GQA] = self.pack_gqa(batch)
        if self.graph is not None and pack > 1:  # the rows a packed run unpacks, on the device
            self.graph.rows.copy_(self.staging.to_device([batch.total_q], torch.int32))
        row_pass = planned and batch.total_q > 0  # (an empty graph-mode batch: plan_direct lays out its slots)
        o[PlanOption.DIRECT] = int(not row_pass)
        o[PlanOption.MAX_PIECES] = 0
        o[PlanOption.LIST_ROWS] = 0
        kv_indices = self.staging.on_device(kv_indices).contiguous()  # (plan() never waits for the GPU)
        merge = None
        values = self._build(batch, indices, kv_indices, args if row_pass else None)
        # A row that sees several key intervals, or a key set, is a custom row of the row kernel's
        # plan: only then is the batch planned again with such rows split or read through page
        # lists (the row rules in torch ops, ms of host time at 64k rows: paid only by batches
        # that have custom rows).
        if row_pass and values[HeaderField.CUSTOM]:
            rules = self.table_rules(args, pack)
            if rules.special:
                o[PlanOption.MAX_PIECES] = rules.max_pieces if rules.split == "pieces" else 0
                self.staging.record()
                self.staging.begin()  # (the first plan's copies out of the mirror have run: it is free again)
                values, merge = self._build_split(batch, indices, kv_indices, args, pack, rules)
                o[PlanOption.LIST_ROWS] = 0
        device_ws, host_ws = self._workspace_pair()
        launches, layouts = self._launches(values, device_ws, host_ws, batch, disable_split_kv)
        self.staging.record()  # the copies out of page-locked memory run before the next plan rewrites it
        counts = {name: values[i] for name, i in _COUNTS} if planned else {}
        plan = Plan(batch, launches, backend=self.backend, planner="module" if planned else "off", reason=reason,
                    counts=counts, host=host_ws, layouts=tuple(layouts),
                    pages_given=pages_given, graph=self.graph is not None, pack_gqa=int(pack), merge=merge)
        self._last = weakref.ref(plan)
        return plan

    def table_rules(self, args: dict[str, Any], pack: int) -> TableRules:
        """How this plan's table treats rows of several intervals and key sets (assembly.py)."""
        return TableRules.of(self.form, self.spec, args, split_how=self.split_how, max_pieces=self.max_pieces,
                             lists=self.key_set_lists and self.graph is None,
                             window_launches=self.max_window_launches if self.fa3 else None, packed=pack > 1,
                             inline_keys=self.inline_keys if self.inline_allowed else 0)

    def _build_split(self, batch: Batch, indices: torch.Tensor, kv_indices: torch.Tensor, args: dict[str, Any],
                     pack: int, rules: TableRules) -> tuple[list[int], MergeRows | None]:
        """plan() for a spec whose rows may see several key intervals or a key set (``rules``):
        the table of assembly.py - the generated row kernel does none of this yet, so it costs the
        torch rules' dispatch, a few ms at 64k rows - then the launch builder on its segments, then
        its copy and page gather in torch ops. The descriptor's values and the rows run() merges
        (None: no row was split), with their rows in the launches' outputs (GQA packing ``pack``)."""
        found = segment_table(self.spec, self.form, batch.q_starts, list(batch.kv_lens), batch.page_size, args,
                              self.device, rules)
        table, segs, inline = found.table, found.segments, found.inline
        self._opt[PlanOption.LIST_ROWS] = found.list_rows
        for _ in range(4):  # a too-small workspace is answered with the size it needs
            device_ws, host_ws = self._workspace_pair()
            self.module.build_launches(indices, table, self.options, host_ws, self.desc)
            values = self.desc.tolist()
            if not self._built(values):
                continue
            finish_plan(values, host_ws, device_ws, kv_indices, self.staging)
            if inline is not None:
                return values, self._inline_merge(batch, indices, kv_indices, inline).packed(pack)
            split = merge_rows(segs, batch.total_q)
            if not split.pieces:
                return values, None
            merge = MergeRows(self.staging.to_device(split.rows, torch.int64),
                              self.staging.to_device(split.counts, torch.int64), split.pieces)
            return values, merge.packed(pack)
        raise LaunchError("internal: the launch builder still asks for room after the workspace grew")

    def _inline_merge(self, batch: Batch, indices: torch.Tensor, kv_indices: torch.Tensor,
                      inline: InlinePieces) -> MergeRows:
        """The merge of rows whose first piece run() computes: where each such piece's keys lie in
        the caller's page list (``indices``' page_start: the entry of the request's first page)."""
        n = batch.batch_size
        page_start = indices[n + 1:2 * n + 2].long()
        ps = batch.page_size
        entry = page_start[inline.request] + torch.div(inline.first_key, ps, rounding_mode="floor")
        on_device = [self.staging.to_device(t, torch.int32) for t in (entry, inline.first_key % ps, inline.keys)]
        rows = self.staging.to_device(inline.rows, torch.int64)
        counts = self.staging.to_device(torch.full_like(inline.rows, 2), torch.int64)
        return MergeRows(rows, counts, 0, inline=tuple(on_device), kv_indices=kv_indices,
                         inline_pairs=int(inline.keys.sum()))

    def _build(self, batch: Batch, indices: torch.Tensor, kv_indices: torch.Tensor,
               args: dict[str, Any] | None) -> list[int]:
        """One builder call (planned: plan_batch, else plan_direct), again while it asks for room:
        the descriptor's values."""
        if args is not None:
            tensor_names, scalar_names, defaults, sorted_count = call_layout(self.spec, self.form)
            spec_values = [args[n] for n in tensor_names] + [args.get(n, defaults[n]) for n in scalar_names]
        for _ in range(4):  # a too-small buffer is answered with the size it needs: one retry each
            device_ws, host_ws = self._workspace_pair()
            if args is not None:
                self._opt[PlanOption.READ_EXPECT] = self.segment_read
                bufs = row_buffers(self.row_buffers, batch.batch_size, batch.total_q, sorted_count,
                                   self.segment_capacity, self.device)
                seg_host = kept_buffer(self.row_buffers, "seg_host", bufs.seg.numel(), torch.int64,
                                       torch.device("cpu"), self.device)
                self.row_planner.plan_batch(indices, self.options, bufs.starts_page_locked, bufs.starts, bufs.rec,
                                            bufs.counts, bufs.seg, seg_host, bufs.scratch, kv_indices, device_ws,
                                            host_ws, self.desc, *spec_values)
            else:
                self.module.plan_direct(indices, self.options, kv_indices, device_ws, host_ws, self.desc)
            self.staging.queued()  # the starts and the workspace go over from kept page-locked buffers
            values = self.desc.tolist()
            if args is not None:
                # room for twice this batch's launch requests next time, and a first read-back of that many
                count = values[HeaderField.SEGMENTS]
                self.segment_capacity = max(self.segment_capacity, 1 << (2 * count).bit_length())
                self.segment_read = max(64, 2 * count)
            if self._built(values, segments_retry=args is not None):
                return values
        raise LaunchError("internal: the launch builder still asks for room after the buffers grew")

    @property
    def split_how(self) -> str:
        """How this plan runs rows of several key intervals: ``split_rows``, or "gaps" in CUDA-graph mode."""
        return "gaps" if self.graph is not None else self.split_rows

    def _built(self, values: list[int], segments_retry: bool = False) -> bool:
        """Whether the launch builder's answer is a plan: False where it asked for a larger
        workspace (grown here) or segment buffer (``segments_retry``: the caller grew it); a
        CUDA-graph launch slot that does not fit the capacity raises, naming the field to raise."""
        status = values[HeaderField.STATUS]
        if status == Status.OK:
            return True
        if status == Status.WORKSPACE:
            self._grow(values[HeaderField.NEED])
            return False
        if status in (Status.SLOT_REQUESTS, Status.SLOT_PAGES):
            raise self._capacity_error(status, values[HeaderField.AT], values[HeaderField.NEED])
        if status == Status.SEGMENTS and segments_retry:
            return False
        raise LaunchError(f"internal: the launch builder answered status {status}")

    def _capacity_error(self, status: int, slot: int, need: int) -> LaunchError:
        assert self.graph is not None
        cap = self.graph.capacity
        name = slot_name(slot, self.fa3, self.graph.windows)
        if status == Status.SLOT_REQUESTS:
            return LaunchError(f"plan(): the {name!r} launch needs {need} launch requests; the wrapper's CUDA-graph "
                               f"capacity max_launch_requests={cap.launch_requests} - make the wrapper with a larger "
                               "one")
        return LaunchError(f"plan(): the {name!r} launch reads {need} page-list entries; the wrapper's CUDA-graph "
                           f"capacity max_launch_pages={cap.launch_pages} - make the wrapper with a larger one")

    def _workspace_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(device workspace, page-locked mirror of the same size) the launches are laid out in."""
        if self.graph is not None:
            if self.graph.workspace is None:  # the first plan asks the builder for the layout's size
                return (torch.empty(16, dtype=torch.uint8, device=self.device), torch.empty(16, dtype=torch.uint8))
            return self.graph.workspace
        if self._workspace is None:
            self._grow(self.workspace_bytes)
        assert self._workspace is not None
        return self._workspace

    def _grow(self, nbytes: int) -> None:
        """A workspace of at least ``nbytes`` (staging.begin() waited for the copies out of the old
        mirror; the old device buffer is freed in stream order)."""
        if self.graph is not None:
            self.graph.allocate(nbytes)
            return
        size = max(nbytes, self.workspace_bytes)
        self._workspace = (torch.empty(size, dtype=torch.uint8, device=self.device),
                           torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda"))

    def _pin_windows(self, widths: tuple[int, ...]) -> None:
        o = self._opt
        o[PlanOption.WINDOW_COUNT] = len(widths)
        o[PlanOption.WINDOWS:PlanOption.WINDOWS + len(widths)] = np.asarray(widths, dtype=np.int64)

    def _float_chunks(self, n_launches: int) -> list[torch.Tensor]:
        """The float workspace cut into ``n_launches`` equal slices (split-KV scratch: one per
        launch); kept per count (views cost host time every plan)."""
        chunks = self._float_chunk_cache.get(n_launches)
        if chunks is None:
            ws = self.float_workspace
            chunk = ws.numel() // max(n_launches, 1)
            chunks = self._float_chunk_cache[n_launches] = [ws[i * chunk:(i + 1) * chunk] for i in range(n_launches)]
        return chunks

    # ------------------------------------------------------------------ the descriptor, as launches
    def _launches(self, values: list[int], device_ws: torch.Tensor, host_ws: torch.Tensor, batch: Batch,
                  disable_split_kv: bool) -> tuple[list[Launch], list[LaunchLayout]]:
        """The Launch views of a written plan. Every view comes from one split of the workspace
        (a view op costs microseconds of host time)."""
        n_launches = values[HeaderField.LAUNCHES]
        pages_off = values[HeaderField.PAGES_OFFSET] // 4
        rows = [values[H + i * L:H + (i + 1) * L] for i in range(n_launches)]
        ints = device_ws.view(torch.int32)
        # [gap, q_starts, kv_indptr, last_page_len, meta, plan_qo] per launch, a gap, then [gap, pages] per launch
        sizes, at = [], 0
        for d in rows:
            n, offset = d[LaunchField.SLOT], d[LaunchField.OFFSET] // 4
            sizes.append(offset - at)
            sizes += _metadata_sizes(n)
            at = offset + sum(sizes[-len(_ARRAYS):])
        sizes.append(pages_off - at)
        at = 0
        for d in rows:
            sizes += [d[LaunchField.PAGE_AT] - at, d[LaunchField.SLOT_PAGES]]
            at = d[LaunchField.PAGE_AT] + d[LaunchField.SLOT_PAGES]
        sizes.append(ints.numel() - pages_off - at)
        if min(sizes) < 0:
            raise LaunchError(f"internal: the launch builder's layout overlaps ({sizes})")
        views = ints.split_with_sizes(sizes)
        chunks = self._float_chunks(n_launches)
        graph, stride = self.graph, 1 + len(_ARRAYS)
        if graph is not None and self.fa3 and graph.windows is None:
            widths = tuple(d[LaunchField.WINDOW_LEFT] for d in rows[3:])
            graph.pin_windows(widths)
            self._pin_windows(widths)
        launches, layouts = [], []
        for i, d in enumerate(rows):
            n, info_len = d[LaunchField.SLOT], d[LaunchField.INFO_LEN]
            q_starts, kv_indptr, last_page_len, meta, _ = views[stride * i + 1:stride * (i + 1)]
            schedule = _SCHEDULES[d[LaunchField.SCHEDULE]]
            int_ws = device_ws
            if schedule == Schedule.FLASHINFER:  # fa2 where KV may be split: FlashInfer's scheduler
                int_ws, plan_info = self._flashinfer_plan(i, host_ws, d, batch, chunks[i], q_starts, disable_split_kv)
            else:
                plan_info = d[LaunchField.INFO:LaunchField.INFO + info_len]
            mode = _MODES[d[LaunchField.MODE]]
            if graph is not None:
                graph.check_plan_info(i, [int(mode), d[LaunchField.WINDOW_LEFT], *plan_info])
            launches.append(Launch(
                mode=mode, window_left=d[LaunchField.WINDOW_LEFT], num_requests=d[LaunchField.REQUESTS],
                piece=d[LaunchField.PIECE],
                num_rows=d[LaunchField.ROWS], q_starts=q_starts, kv_indptr=kv_indptr,
                kv_indices=views[stride * n_launches + 2 + 2 * i], last_page_len=last_page_len,
                meta=meta.view(n, -1), plan_info=plan_info, int_workspace=int_ws, float_workspace=chunks[i],
                schedule=schedule, tail=bool(d[LaunchField.TAIL]), listed=bool(d[LaunchField.LISTED])))
            layouts.append(LaunchLayout(d[LaunchField.OFFSET], n, d[LaunchField.REQUESTS],
                                        d[LaunchField.PAGES] if d[LaunchField.MODE] == MaskMode.CUSTOM else 0))
        return launches, layouts

    def _flashinfer_plan(self, i: int, host_ws: torch.Tensor, d: list[int], batch: Batch, float_ws: torch.Tensor,
                         q_starts: torch.Tensor, disable_split_kv: bool) -> tuple[torch.Tensor, Any]:
        """FlashInfer's fa2 scheduler for launch ``i`` (its host plan_qo / kv_indptr, in the
        mirror) in the i-th int workspace: (that workspace, plan_info)."""
        n, at = d[LaunchField.REQUESTS], d[LaunchField.OFFSET] // 4
        sizes = _metadata_sizes(n)
        host_ints = host_ws.view(torch.int32)
        kv_at = at + sizes[LaunchArray.Q_STARTS]
        qo_at = at + sum(sizes[:LaunchArray.PLAN_QO])
        packed = bool(d[LaunchField.PACKED])
        int_ws, pinned = self._flashinfer.get(i)
        plan_info = self.module.plan(
            float_ws, int_ws, pinned, host_ints[qo_at:qo_at + n + 1], host_ints[kv_at:kv_at + n + 1],
            d[LaunchField.ROWS], n, batch.num_qo_heads, batch.num_kv_heads, batch.page_size, False, -1, -1,
            bool(disable_split_kv or not packed))
        if not packed:
            # Launch requests are not back to back in q/o: the kernel takes each one's first
            # row from q_indptr (our q_starts) but writes o (and lse) at the plan's o_indptr,
            # which the scheduler packed. Point o_indptr at the same rows (split-KV is off for
            # such launches, so o_indptr has exactly one entry per launch request).
            info = list(plan_info)
            if info[PrefillPlanInfo.SPLIT_KV]:
                raise LaunchError("internal: a launch whose rows are not back to back must not split KV")
            offset = int(info[PrefillPlanInfo.O_INDPTR_OFFSET])
            int_ws[offset:offset + 4 * (n + 1)].view(torch.int32).copy_(q_starts)
        return int_ws, plan_info



def finish_plan(values: list[int], host_ws: torch.Tensor, device_ws: torch.Tensor, kv_indices: torch.Tensor,
                staging: HostStaging) -> None:
    """What plan_batch does on the device after the launch builder (plan_module.h's finish_plan),
    in torch ops: the host mirror's first COPY_BYTES into the workspace, then each launch's page
    list gathered from ``kv_indices`` by the builder's table (first entry, shift, count)."""
    n = values[HeaderField.COPY_BYTES]
    device_ws[:n].copy_(host_ws[:n], non_blocking=True)
    staging.queued()
    ranges, at = values[HeaderField.RANGES], values[HeaderField.TABLE_OFFSET]
    extent, pages_at = values[HeaderField.PAGES_EXTENT], values[HeaderField.PAGES_OFFSET]
    if not ranges or not extent:
        return
    first, shift, count = host_ws[at:at + 12 * ranges].view(torch.int32).view(3, ranges).long()
    which = torch.repeat_interleave(torch.arange(ranges), count)
    dst = first[which] + torch.arange(int(count.sum())) - (torch.cumsum(count, 0) - count)[which]
    src = dst + shift[which]
    pages = device_ws[pages_at:pages_at + 4 * extent].view(torch.int32)
    pages[staging.to_device(dst, torch.int64)] = kv_indices.to(torch.int32)[staging.to_device(src, torch.int64)]
