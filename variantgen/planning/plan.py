"""A plan as a value: what plan() decided for a batch, to run and to look at.

``Plan`` holds the batch, its kernel launches (``Launch``: a mask mode, the device views
run() passes, the schedule's plan_info) and how it was planned: by the spec's planner module
(the interval planner's row pass) or planner-off, and then why. Printing it gives a summary
in the spirit of FlexAttention's BlockMask: launches by mask mode, their launch requests and
rows, the pages and (query, key) pairs visited against the full rectangle, the share of work
skipped and the share that evaluates the mask. ``launch_requests`` lists what the launch
builder laid out (``LaunchRequest``: rows, request, class, keys, pages, window) and
``to_dense()`` draws, per request, which elements the kernel visits and how - for debugging
small batches. ``stats()`` is the dict that ``wrapper.plan_stats`` shows.

Every wrapper kind's plan() returns a Plan (``wrapper.last_plan``): paged prefill (and decode on
tensor cores, which runs it) the launch builder's, and ``ScheduledPlan`` where the launches are
laid out elsewhere - decode on CUDA cores and ragged prefill (FlashInfer's own scheduler, one
launch) and the flex route (Flex's block lists) - with the same printable summary and stats().

The launch requests are read from the plan's metadata in the workspace's host mirror, which
the next plan() rewrites; a Plan that is still referenced then takes a copy first
(planner.Planner does that), so every Plan stays readable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..abi.table import MAX_KEY_GAPS, META_COLUMNS, LaunchArray, MaskMode, MetaColumn, RowClass, Schedule, SegField

NOT_VISITED, VISIBLE, MASKED = 0, 1, 2  # to_dense(): the kernel skips / visits, all visible / evaluates the mask
DENSE_LIMIT = 1 << 24  # query-key pairs to_dense() draws at most


@dataclass(frozen=True)
class Batch:
    """The caller's batch as plan() saw it (host copies), to check run() against."""

    batch_size: int
    total_q: int
    total_kv: int
    num_qo_heads: int
    num_kv_heads: int
    page_size: int
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def q_starts(self) -> list[int]:
        out = [0]
        for n in self.qo_lens:
            out.append(out[-1] + n)
        return out


@dataclass(frozen=True)
class LaunchRequest:
    """Rows of one request the kernel sees as one request of a launch: rows [first, end) of the
    batch, keys [kv_begin, kv_end) of the request (its page list), and how they are masked."""

    rows: tuple[int, int]
    request: int
    cls: RowClass
    mode: MaskMode  # of the launch it runs in
    window: int  # the kernel's left window (causal mode), -1: none
    keys: tuple[int, int]
    pages: int
    q_pos: int  # position of its first query
    visible: tuple[int, int] = (0, -1)  # keys every row sees (custom, tail): custom mode skips the mask there
    # -1: writes its rows' output in place; p: the rows' p-th key interval, a partial output run() merges
    piece: int = -1
    # key ranges [from, to) of ``keys`` its page list skips (a custom run over its rows' intervals)
    gaps: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_segment(cls, seg: list[int], page_size: int, lists: list[int] | None = None) -> LaunchRequest:
        """A segment of the row pass (SegField order) as fa2 runs it: the mask mode of its class.
        ``lists``: the page lists' entries after the segments (keysets.py), where it has one."""
        c = RowClass(seg[SegField.CLASS])
        begin, end = seg[SegField.KV_BEGIN], seg[SegField.KV_END]
        gaps = tuple((seg[f], seg[f + 1]) for f in range(SegField.GAP_FROM_1, min(len(seg), SegField.GAP_TO_3 + 1), 2)
                     if seg[f + 1] > seg[f])  # (a segment of before the gaps has none)
        pages = -(-(end - begin) // page_size) - sum(t - f for f, t in gaps) // page_size
        listed = seg[SegField.PAGE_LIST_LEN] if len(seg) > SegField.PAGE_LIST_LEN else 0
        if listed:  # (as the builder lays it out: its keys end on its last listed page)
            assert lists is not None, "a segment with a page list, without the lists"
            on = lists[seg[SegField.PAGE_LIST_AT]:seg[SegField.PAGE_LIST_AT] + listed]
            end = min(end, on[-1] * page_size + page_size)
            gaps, pages = listed_gaps(begin, end, on, page_size), listed
        return cls((seg[SegField.FIRST_ROW], seg[SegField.END_ROW]), seg[SegField.REQUEST], c, c.mode,
                   seg[SegField.WINDOW], (begin, end), pages, seg[SegField.Q_POS],
                   (seg[SegField.VIS_LO], seg[SegField.VIS_HI]),
                   seg[SegField.PIECE] if len(seg) > SegField.PIECE else -1, gaps)  # (a segment of before pieces)

    @property
    def keys_read(self) -> int:
        """Keys its page list holds: its range's, less the gaps'."""
        return self.keys[1] - self.keys[0] - sum(t - f for f, t in self.gaps)

    @property
    def diagonal(self) -> int:
        """The last key its first row sees in causal mode: the kernel's diagonal is kv_len - qo_len,
        so its keys end at its last row's position plus the same shift (0 but for a band)."""
        return self.keys[1] - (self.rows[1] - self.rows[0])

    def masked(self) -> int:
        """The pairs of visited() the mask is evaluated on: all in custom mode; a tail run's keys
        from its first query position on (its diagonal tile); none in the others."""
        if self.mode == MaskMode.CUSTOM:  # less the keys known visible to every row
            n = self.rows[1] - self.rows[0]
            return self.visited() - n * max(0, self.visible[1] - self.visible[0] + 1)
        if self.cls == RowClass.TAIL:
            n = self.rows[1] - self.rows[0]
            return n * (n + 1) // 2
        return 0

    def visited(self) -> int:
        """(query, key) pairs its mode lets the kernel see (tiles further trim causal ones)."""
        n, kb, q0 = self.rows[1] - self.rows[0], self.keys[0], self.diagonal
        if self.mode != MaskMode.CAUSAL:
            return n * self.keys_read
        # (q0: the first row's diagonal, past its position where the rows see a band ahead)
        if self.window < 0:  # row q sees [kb, q]
            return n * (q0 - kb + 1) + n * (n - 1) // 2
        # row q sees [max(kb, q - w), q]: q - kb + 1 keys until q reaches kb + w, then w + 1
        head = min(max(kb + self.window - q0, 0), n)
        return head * (q0 - kb + 1) + head * (head - 1) // 2 + (n - head) * (self.window + 1)


@dataclass
class Launch:
    """One kernel launch: launch requests that share a mask mode (and, fa3, a window).
    The tensors are views of the plan's device workspace; in CUDA-graph mode they are the same
    every plan (a launch slot) and hold ``meta.shape[0]`` launch requests, the first
    ``num_requests`` real, the rest empty."""

    mode: MaskMode
    window_left: int  # fa3: the launch's left window (-1: none); fa2 takes it per launch request (vg_meta)
    num_requests: int
    num_rows: int  # query rows of its launch requests
    q_starts: torch.Tensor  # the kernel's q_indptr: first row of each launch request in q / o
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    meta: torch.Tensor  # [launch requests, META_COLUMNS] int32
    plan_info: Any
    int_workspace: torch.Tensor
    float_workspace: torch.Tensor
    schedule: Schedule = Schedule.FLASHINFER
    tail: bool = False  # fa2's tail launch: causal, the mask on each launch request's diagonal tile
    piece: int = -1  # -1: writes o / lse in place; p: partial output p, merged by run() (pieces.py)
    listed: bool = False  # custom launch requests over page lists: the listed variant (LISTED_RUN_CODE)

    @property
    def mask_mode(self) -> str:
        return "listed" if self.listed else self.mode.label

    @property
    def exact(self) -> bool:
        """Its mode and window are its launch requests' whole mask (not custom, not fa2's tail
        launch): vg_meta marks every key known visible, so no spec mask is evaluated."""
        return self.mode != MaskMode.CUSTOM and not self.tail


@dataclass(frozen=True)
class LaunchLayout:
    """Where a launch's metadata lies in the workspace's host mirror (the launch builder's
    descriptor): byte offset, launch requests laid out and real ones."""

    offset: int
    slot: int
    requests: int
    table_room: int = 0  # int32 entries after its metadata that may hold page-list tables (at most its pages)


class Plan:
    """The plan of one batch (see the module docstring). ``planner``: "module" (the spec's
    planner module classified the rows) or "off" (one custom launch per request: the spec's
    mask on every element), ``reason``: why it is off. ``kind``: the wrapper kind that planned
    it ("prefill"; "decode" on tensor cores, whose launches are the prefill module's)."""

    def __init__(self, batch: Batch, launches: list[Launch], *, backend: str, planner: str, reason: str = "",
                 counts: dict[str, int] | None = None, host: torch.Tensor | None = None,
                 layouts: tuple[LaunchLayout, ...] = (), pages_given: int = 0, graph: bool = False,
                 pack_gqa: int = 1, merge: Any = None, kind: str = "prefill"):
        self.batch = batch
        self.kind = kind
        self.launches = launches
        self.backend = backend
        self.planner = planner
        self.reason = reason
        self.counts = dict(counts or {})  # launch requests per row class, custom rows (planner on)
        self.pages_given = pages_given
        self.graph = graph
        # fa3 GQA packing: the launches see q / o as [rows x pack_gqa, num_kv_heads, dim] (1: off)
        self.pack_gqa = pack_gqa
        # pieces.MergeRows: the rows whose key intervals ran as pieces, which run() merges (None: none)
        self.merge = merge
        self._host = host  # the workspace's host mirror (shared with the next plan) or this plan's copy
        self._layouts = layouts
        self._requests: list[LaunchRequest] | None = None

    # ------------------------------------------------------------------ what plan_stats shows
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"launches": [(la.mask_mode, la.num_requests) for la in self.launches if la.num_requests]}
        if self.pack_gqa > 1:
            out["pack_gqa"] = self.pack_gqa
        if self.merge is not None:
            out["pieces"] = {"rows": int(self.merge.rows.numel()), "max": self.merge.pieces}
        if self.planner == "module":
            out["row_planner"] = "kernel"
            out["segments"] = dict(self.counts)
        else:
            out["planner_off"] = self.reason
        return out

    # ------------------------------------------------------------------ launch requests
    def keep(self) -> None:
        """Copy what launch_requests reads out of the shared host mirror (the planner calls it
        before the next plan() rewrites the mirror, when this Plan is still referenced)."""
        if self._host is None or self._requests is not None or not self._layouts:
            return
        end = max(la.offset + 4 * (_metadata_ints(la.slot) + la.table_room) for la in self._layouts)
        self._host = self._host[:end].clone()

    @property
    def launch_requests(self) -> list[LaunchRequest]:
        """Every launch request, in row order, as the launch builder laid it out."""
        if self._requests is None:
            self._requests = self._read_requests()
        return self._requests

    def _read_requests(self) -> list[LaunchRequest]:
        if self._host is None:
            return []
        ints = self._host.view(torch.int32)
        ps = self.batch.page_size
        out = []
        for launch, lay in zip(self.launches, self._layouts):
            at, n = lay.offset // 4, lay.slot
            arrays = ints[at:at + _metadata_ints(n)].split([a.ints(n) for a in LaunchArray])
            kv_indptr = arrays[LaunchArray.KV_INDPTR].tolist()
            last = arrays[LaunchArray.LAST_PAGE_LEN].tolist()
            meta = arrays[LaunchArray.META].view(n, META_COLUMNS).tolist()
            meta_at = at + sum(a.ints(n) for a in LaunchArray if a < LaunchArray.META)
            for b in range(lay.requests):
                row = meta[b]
                pages = kv_indptr[b + 1] - kv_indptr[b]
                begin = row[MetaColumn.KV_POS_BASE]
                gaps, skipped = [], 0
                for j in range(MAX_KEY_GAPS):
                    gap_at, length = row[MetaColumn.GAP_AT_1 + 2 * j], row[MetaColumn.GAP_LEN_1 + 2 * j]
                    if length > 0:
                        gaps.append((begin + gap_at + skipped, begin + gap_at + skipped + length))
                        skipped += length
                end = begin + (pages - 1) * ps + last[b] + skipped if pages else begin
                if row[MetaColumn.PAGE_TABLE_AT] >= 0 and pages:  # a page list: its table of key positions
                    table_at = meta_at + row[MetaColumn.PAGE_TABLE_AT]
                    listed = [pos // ps for pos in ints[table_at:table_at + pages].tolist()]
                    end = listed[-1] * ps + last[b]
                    gaps = list(listed_gaps(begin, end, listed, ps))
                window = row[MetaColumn.KERNEL_WINDOW]  # a window run's width (fa3: its launch's, or custom)
                mode = launch.mode
                cls = (RowClass.DENSE if mode == MaskMode.NONE else RowClass.WINDOW if window >= 0
                       else RowClass.TAIL if launch.tail
                       else RowClass.CAUSAL if mode == MaskMode.CAUSAL else RowClass.CUSTOM)
                first = row[MetaColumn.Q_ROW_BASE]
                # (an exact run's row says every key: its mode and window are its whole mask)
                visible = (row[MetaColumn.VIS_LO], row[MetaColumn.VIS_HI]) if mode == MaskMode.CUSTOM else (0, -1)
                out.append(LaunchRequest((first, first + row[MetaColumn.LAUNCH_QO_LEN]), row[MetaColumn.REQUEST], cls,
                                         mode, window if mode == MaskMode.CAUSAL else -1, (begin, end), pages,
                                         row[MetaColumn.Q_POS_BASE], visible, launch.piece, tuple(gaps)))
        out.sort(key=lambda r: (r.rows, r.piece))
        return out

    # ------------------------------------------------------------------ looking at it
    def work(self) -> dict[str, int]:
        """(query, key) pairs: of the full rectangles, visited, visited in custom launches."""
        full = sum(q * k for q, k in zip(self.batch.qo_lens, self.batch.kv_lens))
        reqs = self.launch_requests
        # (the pairs of a first piece the merge computes: merge.inline_pairs, no launch request's)
        inline = self.merge.inline_pairs if self.merge is not None and self.merge.inline is not None else 0
        visited = sum(r.visited() for r in reqs) + inline
        masked = sum(r.masked() for r in reqs)
        return {"full": full, "visited": visited, "masked": masked,
                "pages_read": sum(r.pages for r in reqs), "pages_given": self.pages_given}

    def keys_read(self) -> dict[str, int]:
        """Keys its launch requests read (the (query, key) pairs of visited()), per launch class and
        in total ("total"); cost.plan_cost sets them against the keys the mask shows."""
        out: dict[str, int] = {}
        for r in self.launch_requests:
            out[r.cls.label] = out.get(r.cls.label, 0) + r.visited()
        return out | {"total": sum(out.values())}

    def __repr__(self) -> str:
        b = self.batch
        how = "interval planner (planner module)" if self.planner == "module" else f"planner off: {self.reason}"
        packed = f", GQA-packed ({self.pack_gqa} query heads per row)" if self.pack_gqa > 1 else ""
        of = f"{self.kind}: " if self.kind != "prefill" else ""
        lines = [f"Plan({of}{b.batch_size} requests, {b.total_q} query rows, {b.num_qo_heads}/{b.num_kv_heads} heads, "
                 f"page size {b.page_size}; {self.backend}{', CUDA-graph slots' if self.graph else ''}{packed}; {how})"]
        for i, la in enumerate(self.launches):
            window = f", window {la.window_left}" if la.window_left >= 0 else ""
            piece = f", key interval {la.piece} of its rows (merged)" if la.piece >= 0 else ""
            lines.append(f"  launch {i}: {la.mask_mode:6} {la.num_requests:5} launch requests, {la.num_rows} rows"
                         f"{window}{piece}")
        if self.counts:
            lines.append("  launch requests by class: " + ", ".join(f"{k} {v}" for k, v in self.counts.items()))
        if self.merge is not None and self.merge.inline is not None:
            lines.append(f"  {self.merge.rows.numel()} rows see two key intervals: the second launched in place, the "
                         f"first (a few keys, {self.merge.inline_pairs} (query, key) pairs) computed by the merge")
        elif self.merge is not None:
            lines.append(f"  {self.merge.rows.numel()} rows see several key intervals (up to {self.merge.pieces}): "
                         "one launch request per interval, merged by LSE")
        lines += self._piece_lines()
        if b.total_q:
            w = self.work()
            skipped = 1 - w["visited"] / w["full"] if w["full"] else 0.0
            lines.append(f"  pages read {w['pages_read']} of {w['pages_given']} given; (query, key) pairs visited "
                         f"{w['visited']} of {w['full']} ({skipped:.1%} skipped), {w['masked']} of them evaluate the "
                         "mask")
        return "\n".join(lines)

    __str__ = __repr__

    def _piece_lines(self) -> list[str]:
        """Per launch class and piece of a plan with pieces: launch requests, rows and keys read."""
        if self.merge is None:
            return []
        groups: dict[tuple[str, int], list[int]] = {}
        for r in self.launch_requests:
            g = groups.setdefault((r.cls.label, r.piece), [0, 0, 0])
            g[0] += 1
            g[1] += r.rows[1] - r.rows[0]
            g[2] += r.visited()
        return [f"    {cls:6} {'in place' if piece < 0 else f'piece {piece}':8}: {n} launch requests, {rows} rows, "
                f"{keys} (query, key) pairs" for (cls, piece), (n, rows, keys) in sorted(groups.items())]

    def to_dense(self) -> list[torch.Tensor]:
        """Per request, int8 [qo_len, kv_len]: NOT_VISITED (0), VISIBLE (1: visited, every key
        visible by the plan), MASKED (2: visited, the mask evaluated) - element by element what
        each launch request's mode shows the kernel (its tiles skip more). Small batches only."""
        b = self.batch
        pairs = sum(q * k for q, k in zip(b.qo_lens, b.kv_lens))
        if pairs > DENSE_LIMIT:
            raise ValueError(f"Plan.to_dense(): {pairs} query-key pairs; it draws at most {DENSE_LIMIT} (a small "
                             "batch, for debugging)")
        grids = [torch.zeros(q, k, dtype=torch.int8) for q, k in zip(b.qo_lens, b.kv_lens)]
        starts = b.q_starts
        for r in self.launch_requests:
            grid = grids[r.request]
            i0, i1 = r.rows[0] - starts[r.request], r.rows[1] - starts[r.request]
            kb, ke = r.keys
            value = MASKED if r.mode == MaskMode.CUSTOM else VISIBLE
            if r.mode != MaskMode.CAUSAL:
                grid[i0:i1, kb:ke] = value
                if r.visible[1] >= r.visible[0]:  # a custom launch request skips the mask on these keys
                    grid[i0:i1, r.visible[0]:r.visible[1] + 1] = VISIBLE
                for f, t in r.gaps:  # keys its page list skips
                    grid[i0:i1, f:t] = NOT_VISITED
                continue
            q = torch.arange(r.diagonal, r.diagonal + i1 - i0).view(-1, 1)  # each row's last key
            k = torch.arange(kb, ke).view(1, -1)
            seen = (k <= q) & ((k >= q - r.window) if r.window >= 0 else torch.ones((), dtype=torch.bool))
            grid[i0:i1, kb:ke][seen] = value
            if r.cls == RowClass.TAIL:  # its diagonal tile: the mask from its first query position on
                grid[i0:i1, kb:ke][seen & (k >= r.q_pos)] = MASKED
        return grids


class ScheduledPlan(Plan):
    """The plan of a batch whose launches the launch builder does not lay out: decode on CUDA
    cores and ragged prefill (FlashInfer's scheduler, or fa3's work list, schedules one launch
    over the batch) and the flex route (Flex's block lists). ``scheduled_by`` says how the work
    was laid out; ``runs``: (label, requests) per launch; ``planner``: "key trimming" (decode's
    page lists narrowed to the visible keys), "intervals" (the flex route's keys and block lists
    from the key intervals) or "off", ``reason`` saying why; ``figures``: the kind's own numbers
    (pages given and visited, the decode variant, keys gathered, blocks), as stats() shows them.
    It has no launch requests (``launch_requests`` is empty; work() and to_dense() refuse)."""

    def __init__(self, batch: Batch, *, kind: str, backend: str, scheduled_by: str, planner: str, reason: str = "",
                 runs: list[tuple[str, int]] | None = None, figures: dict[str, Any] | None = None):
        super().__init__(batch, [], backend=backend, planner=planner, reason=reason, kind=kind)
        self.scheduled_by = scheduled_by
        self.runs = list(runs or [])
        self.figures = dict(figures or {})

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"launches": list(self.runs), **self.figures}
        if self.planner == "off":
            out["planner_off"] = self.reason
        return out

    def _no_requests(self, what: str) -> ValueError:
        return ValueError(f"Plan.{what}: a {self.kind} plan on {self.backend} is scheduled by {self.scheduled_by}; "
                          "it has no launch requests to look at (those are the paged prefill launch builder's)")

    def work(self) -> dict[str, int]:
        raise self._no_requests("work()")

    def keys_read(self) -> dict[str, int]:
        raise self._no_requests("keys_read()")

    def to_dense(self) -> list[torch.Tensor]:
        raise self._no_requests("to_dense()")

    def __repr__(self) -> str:
        b = self.batch
        how = f"planner off: {self.reason}" if self.planner == "off" else self.planner
        lines = [f"Plan({self.kind}: {b.batch_size} requests, {b.total_q} query rows, {b.num_qo_heads}/"
                 f"{b.num_kv_heads} heads, page size {b.page_size}; {self.backend}; {how})",
                 f"  scheduled by {self.scheduled_by}"]
        for i, (label, n) in enumerate(self.runs):
            lines.append(f"  launch {i}: {label:6} {n:5} requests")
        if self.figures:
            lines.append("  " + "; ".join(f"{k} {v}" for k, v in self.figures.items()))
        return "\n".join(lines)

    __str__ = __repr__


def _metadata_ints(n: int) -> int:
    return sum(a.ints(n) for a in LaunchArray)


def listed_gaps(begin: int, end: int, pages: list[int], page_size: int) -> tuple[tuple[int, int], ...]:
    """The key ranges of [begin, end) a page list leaves out (pages ascending, request-local)."""
    gaps, at = [], begin
    for p in pages:
        if p * page_size > at:
            gaps.append((at, p * page_size))
        at = p * page_size + page_size
    if at < end:
        gaps.append((at, end))
    return tuple(gaps)
