"""The plan's ABI in one table: what Python and the generated C++ agree on.

The interval planner's row kernel, the launch builder and the attention variants exchange
int arrays whose layout both sides must read the same way: run()'s mask-mode codes, the row
classes, the columns of ``vg_meta``, the row pass's per-row record, the compacted launch
requests (segments), the plan descriptor the builder answers with, the schedule kinds and
the limits. They are declared here once. ``header_text()`` renders them as a C++ header,
``vg_plan_abi.h``, which render.py and rowplan.py put among every module's sources (so it
is hashed into the module's cache key like any source) and which every template includes
instead of spelling a constant; Python indexes the same arrays with these enums (MagiAttention's
habit: an enum with explicit int codes shared with C++). tests/cpu/test_plan_abi.py checks the
two sides agree.
"""

from __future__ import annotations

from enum import IntEnum

HEADER_NAME = "vg_plan_abi.h"


class MaskMode(IntEnum):
    """run()'s mask-mode code of a launch: FlashInfer's MaskMode for the fa2 kernels (fa3 has no
    kCustom: its binding runs code 2 as the masked variant in a non-causal launch). fa2's tail
    launch, in mode CAUSAL, runs under its own code (FA2_TAIL_RUN_CODE)."""

    NONE = 0  # every key of the launch request's range is visible (the mask runs on no tile)
    CAUSAL = 1  # keys up to the query's position (and a left window where one is given)
    CUSTOM = 2  # the spec's mask on every element

    @property
    def label(self) -> str:
        """'none', 'causal', 'custom': the names ModuleConfig.mask_modes and the plan use."""
        return self.name.lower()

    @property
    def literal(self) -> str:
        """FlashInfer's C++ enumerator."""
        return f"MaskMode::k{self.name.capitalize()}"

    @classmethod
    def of(cls, label: str) -> MaskMode:
        return cls[label.upper()]


class RowClass(IntEnum):
    """How the row pass classifies a query row by its key interval (see planner.py)."""

    DENSE = 0  # every key of [lo, hi] visible, lo page-aligned
    CAUSAL = 1  # keys [lo, q_pos], lo fixed and page-aligned
    WINDOW = 2  # keys [q_pos - w, q_pos], w fixed: causal with a kernel window w
    CUSTOM = 3  # anything else: the mask over the hull
    # keys [lo, q_pos], lo fixed and page-aligned, every key visible up to a fixed mask_from
    # that is at least the request's first query position, the mask deciding the rest (a draft
    # tree after its cached context): fa2 runs it causal, where the kernel evaluates the mask on
    # the diagonal tile, which holds every key from mask_from on while the launch request is one
    # query tile; otherwise (and on fa3, whose causal launch has no mask) it runs custom.
    TAIL = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def mode(self) -> MaskMode:
        """The mask mode the launch requests of this class run in."""
        return _CLASS_MODE[self]


_CLASS_MODE = {RowClass.DENSE: MaskMode.NONE, RowClass.CAUSAL: MaskMode.CAUSAL, RowClass.WINDOW: MaskMode.CAUSAL,
               RowClass.CUSTOM: MaskMode.CUSTOM, RowClass.TAIL: MaskMode.CAUSAL}


class MetaColumn(IntEnum):
    """The columns of ``vg_meta``: one int32 row per launch request, telling the variant where
    the launch request sits in the caller's batch (the planner may split a request)."""

    Q_ROW_BASE = 0  # global row of the first query, in the caller's q
    Q_POS_BASE = 1  # absolute position of the first query in its request
    KV_POS_BASE = 2  # absolute position of the first key of the page list
    REQUEST = 3  # index of the caller's request
    KV_ROW_BASE = 4  # first [total_kv] row of the caller's request
    REQ_QO_LEN = 5  # qo_len of the caller's request
    REQ_KV_LEN = 6  # kv_len of the caller's request
    KERNEL_WINDOW = 7  # window_left the kernel may prune with; -1: visit every tile
    LAUNCH_QO_LEN = 8  # queries of this launch request (rows from q_indptr[b] on)
    # keys [VIS_LO, VIS_HI] (absolute positions) are visible to every query of the launch request
    # but for the kernel window, so the generated mask is not evaluated there (the planner's exact
    # intervals say so): a custom run's keys all its rows see; every key (0, VIS_EVERY_KEY) of a
    # run its launch's mode and window make exact (dense, causal, window: not a tail run, whose
    # diagonal tile needs the mask); else empty (VIS_HI < VIS_LO)
    VIS_LO = 9
    VIS_HI = 10
    # A launch request whose page list skips the gaps between its rows' key intervals (SegField's
    # GAP_FROM / GAP_TO): its list key i sits at KV_POS_BASE + i plus GAP_LEN_j for every gap j with
    # GAP_AT_j <= i (list indices, ascending). No gap: GAP_AT_j = NO_GAP_AT, GAP_LEN_j = 0.
    GAP_AT_1 = 11
    GAP_LEN_1 = 12
    GAP_AT_2 = 13
    GAP_LEN_2 = 14
    GAP_AT_3 = 15
    GAP_LEN_3 = 16
    # A launch request over a page list (SegField's PAGE_LIST_*: a sparse key set, keysets.py): its
    # list key i sits at vg_meta[PAGE_TABLE_AT + i / LIST_PAGE_SIZE] + i % LIST_PAGE_SIZE, the
    # table (int32, one absolute key position per listed page) laid out after the launch's
    # metadata, PAGE_TABLE_AT counted in int32 from the launch's first vg_meta row. -1: no table
    # (the gaps above say where its keys sit).
    PAGE_TABLE_AT = 17
    LIST_PAGE_SIZE = 18


META_COLUMNS = len(MetaColumn)


def meta_rows(**columns: list[int]) -> list[int]:
    """``vg_meta`` rows, flat, from one list per column (keyword: the MetaColumn's name in lower
    case; the GAP_* and page-list columns may be left out: no gap, no page list): the one place
    outside the launch builder that lays a row out."""
    names = [c.name.lower() for c in MetaColumn]
    optional = {c.name.lower(): NO_GAP_AT if c.name.startswith("GAP_AT") else -1 if c is MetaColumn.PAGE_TABLE_AT else 0
                for c in MetaColumn if c.name.startswith("GAP_") or c in (MetaColumn.PAGE_TABLE_AT,
                                                                          MetaColumn.LIST_PAGE_SIZE)}
    given = set(columns)
    if not set(names) - set(optional) <= given <= set(names):
        raise ValueError(f"meta_rows: expected the columns {names} (the gap and page-list columns optional), "
                         f"got {sorted(given)}")
    n = len(next(iter(columns.values()))) if columns else 0
    for name, none in optional.items():
        columns.setdefault(name, [none] * n)
    return [x for row in zip(*(columns[n] for n in names)) for x in row]


class RecField(IntEnum):
    """The row pass's record, int64 [len(RecField), total_q]: per query row."""

    STARTS = 0  # 1 where the row starts a launch request
    REQUEST = 1  # the caller's request
    CLASS = 2  # its RowClass
    PARAM_A = 3  # dense/causal/tail: lo; window: the width; custom: the run's chunk (q_idx // CUSTOM_ROWS)
    LO = 4  # its key interval (on a custom run's first row: the run's hull)
    HI = 5
    Q_POS = 6  # the query's position
    DENSE_HI = 7  # every key of [lo, dense_hi] is visible to the row (lo - 1: none known)
    # on a custom or tail run's first row: the keys visible to every row of the run, the
    # intersection of their [lo, dense_hi] (empty: VIS_HI < VIS_LO); else 0, -1
    VIS_LO = 8
    VIS_HI = 9


class SegField(IntEnum):
    """A launch request as the row pass compacts it for the host (a *segment*, int64 fields):
    a run of rows of one request and class, and the keys it reads. The launch builder lays
    segments out as launches; the planner-off path gives it one custom segment per request."""

    FIRST_ROW = 0  # first query row (global)
    END_ROW = 1  # one past its last row
    REQUEST = 2
    CLASS = 3  # RowClass
    WINDOW = 4  # the kernel window of a window run; -1 for the other classes
    KV_BEGIN = 5  # first key it reads: page-aligned, request-local
    KV_END = 6  # one past the last key it reads
    Q_POS = 7  # q_pos of the first row
    # custom and tail runs: keys [VIS_LO, VIS_HI] are visible to all its rows (a tail run: from its
    # kv_begin; empty: VIS_HI < VIS_LO); the other classes: 0, -1
    VIS_LO = 8
    VIS_HI = 9
    # -1: its rows see one key interval and the launch request writes their output in place;
    # p >= 0: its rows see several disjoint key intervals (sinks + window, prefix + window ...),
    # this launch request reads the p-th of them (by position) into partial output p, and run()
    # merges a row's partial outputs by their LSE (variantgen/wrappers/merge.py)
    PIECE = 10
    # Keys [GAP_FROM_j, GAP_TO_j) of [KV_BEGIN, KV_END) that its page list skips (request-local,
    # page-aligned, ascending, inside the range with keys on both sides; no gap: 0, 0): a custom
    # launch request over the union of its rows' key intervals instead of their hull. Its keys are
    # no longer at KV_POS_BASE + list index: MetaColumn's GAP_AT / GAP_LEN tell the variant where.
    GAP_FROM_1 = 11
    GAP_TO_1 = 12
    GAP_FROM_2 = 13
    GAP_TO_2 = 14
    GAP_FROM_3 = 15
    GAP_TO_3 = 16
    # A custom launch request whose page list is any ascending set of its request's pages in
    # [KV_BEGIN, KV_END) (a sparse key set: the pages that hold a key one of its rows sees,
    # keysets.py): PAGE_LIST_LEN request-local page numbers, int64, at entry PAGE_LIST_AT of the
    # list rows that follow the segments in the builder's table (PlanOption.LIST_ROWS). 0, 0: none
    # (its pages are its range's, less the gaps). A list and gaps exclude each other.
    PAGE_LIST_AT = 17
    PAGE_LIST_LEN = 18


SEG_FIELDS = len(SegField)


class Schedule(IntEnum):
    """Who scheduled a launch's work list."""

    FLASHINFER = 0  # nobody yet: FlashInfer's fa2 scheduler plans it (it may split KV)
    FA2 = 1  # the launch builder's fa2 work list (no split-KV), in the schedule workspace
    FA3 = 2  # the launch builder's sm90 work list, in the schedule workspace


class PlanOption(IntEnum):
    """The launch builder's options, int64 (one host tensor kept by the planner)."""

    PAGE_SIZE = 0
    FA3 = 1  # 1: fa3 launches (one window per launch) and sm90 work lists; 0: fa2
    DIRECT = 2  # 1: planner off, one custom launch request per request (no segments given)
    NUM_SM = 3
    FA3_CTA_TILE_Q = 4  # query rows per tile of the sm90 kernel
    NUM_QO_HEADS = 5
    NUM_KV_HEADS = 6
    HEAD_DIM_QK = 7
    HEAD_DIM_VO = 8
    KV_DTYPE_BYTES = 9
    FA2_MIN_TILES = 10  # fa2: launches with fewer query tiles are left to FlashInfer's scheduler (0: none)
    MAX_WINDOW_LAUNCHES = 11  # fa3: window widths given their own launch; the others run custom
    READ_EXPECT = 12  # the row pass: launch requests to read back in the first copy
    GRAPH_REQUESTS = 13  # CUDA-graph mode (> 0): launch requests per launch slot
    GRAPH_PAGES = 14  # page-list entries per launch slot
    GRAPH_ROWS = 15  # query rows (max_total_q) the slots' schedules are sized for
    WINDOW_COUNT = 16  # fa3 graph mode: the pinned window widths (-1: choose them from this batch)
    PACK_GQA = 17  # fa3: > 1 folds each GQA group of that many query heads into rows (GQA packing; 0/1: off)
    # the row pass: rows whose visible keys are a union of 2..MAX_PIECES disjoint exact intervals
    # may be split into one launch request per interval (0: never; CUDA-graph mode and GQA
    # packing: 0). The launch builder takes piece segments only where this is on.
    MAX_PIECES = 18
    # rows at the end of the segment table that are not segments: the page lists of segments
    # with SegField.PAGE_LIST_LEN > 0, SEG_FIELDS int64 entries per row (0: none)
    LIST_ROWS = 19
    WINDOWS = 20  # then FA3_MAX_WINDOW_LAUNCHES widths


class Status(IntEnum):
    """How the launch builder answered (HeaderField.STATUS)."""

    OK = 0
    WORKSPACE = 1  # the workspace needs NEED bytes (nothing was written)
    SEGMENTS = 2  # the row pass found NEED launch requests, more than the read-back has room for
    SLOT_REQUESTS = 3  # CUDA-graph mode: launch slot AT needs NEED launch requests, over the capacity
    SLOT_PAGES = 4  # CUDA-graph mode: launch slot AT reads NEED page-list entries, over the capacity


class HeaderField(IntEnum):
    """The plan descriptor's header (int64), written by the launch builder."""

    STATUS = 0  # Status
    NEED = 1
    AT = 2
    SEGMENTS = 3  # launch requests
    COPY_BYTES = 4  # bytes of the workspace's host mirror to copy to the device
    TABLE_OFFSET = 5  # the page gather table: int32 [3, RANGES] (first output entry, shift, count)
    RANGES = 6
    PAGES_OFFSET = 7  # the gathered page lists (written on the device)
    PAGES_EXTENT = 8  # entries from there that the gather covers
    LAUNCHES = 9
    DENSE = 10  # launch requests per row class
    CAUSAL = 11
    WINDOW = 12
    CUSTOM = 13
    CUSTOM_ROWS = 14  # query rows in custom launch requests
    TAIL = 15  # launch requests of the tail class run causal (those that do not fit run custom)


class LaunchField(IntEnum):
    """One launch in the plan descriptor (int64), after the header."""

    MODE = 0  # MaskMode
    WINDOW_LEFT = 1  # the launch's left window (fa3; -1: none)
    REQUESTS = 2  # launch requests
    SLOT = 3  # launch requests laid out (CUDA-graph mode: the capacity, the rest empty)
    OFFSET = 4  # byte offset of its metadata (LaunchArray order)
    PACKED = 5  # its launch requests' rows are back to back in q / o
    SCHEDULE = 6  # Schedule
    ROWS = 7  # query rows
    PAGE_AT = 8  # its page list, in entries from PAGES_OFFSET
    PAGES = 9  # entries its launch requests read
    SLOT_PAGES = 10  # entries laid out (CUDA-graph mode: the capacity)
    TAIL = 11  # 1: fa2's tail launch (causal, the mask on each launch request's one diagonal tile)
    PIECE = 12  # -1: writes o and lse in place; p >= 0: writes partial output p (SegField.PIECE)
    LISTED = 13  # 1: custom launch requests over page lists (LISTED_RUN_CODE: the listed variant)
    INFO_LEN = 14  # then INFO_LEN plan_info values
    INFO = 15


class LaunchArray(IntEnum):
    """A launch's int32 metadata, back to back from its OFFSET, for n = SLOT launch requests."""

    Q_STARTS = 0  # [n + 1] first row of each launch request in q / o (the kernel's q_indptr)
    KV_INDPTR = 1  # [n + 1] its page list in the launch's
    LAST_PAGE_LEN = 2  # [n]
    META = 3  # [n, META_COLUMNS] vg_meta
    PLAN_QO = 4  # [n + 1] the rows packed (what a scheduler splits into tiles)

    def ints(self, n: int) -> int:
        """Entries of this array for n launch requests."""
        return {LaunchArray.LAST_PAGE_LEN: n, LaunchArray.META: META_COLUMNS * n}.get(self, n + 1)


class PrefillPlanInfo(IntEnum):
    """flashinfer::PrefillPlanInfo::ToVector(): an fa2 launch's plan_info (offsets into its int
    workspace), as FlashInfer's scheduler and the launch builder's fa2 work list write it."""

    PADDED_BATCH_SIZE = 0
    TOTAL_NUM_ROWS = 1
    TOTAL_NUM_ROWS_OFFSET = 2
    CTA_TILE_Q = 3
    REQUEST_INDICES_OFFSET = 4
    QO_TILE_INDICES_OFFSET = 5
    KV_TILE_INDICES_OFFSET = 6
    MERGE_INDPTR_OFFSET = 7
    O_INDPTR_OFFSET = 8
    KV_CHUNK_SIZE_PTR_OFFSET = 9
    V_OFFSET = 10
    S_OFFSET = 11
    BLOCK_VALID_MASK_OFFSET = 12
    ENABLE_CUDA_GRAPH = 13
    SPLIT_KV = 14


class SM90PlanInfo(IntEnum):
    """flashinfer::PrefillPlanSM90Info::ToVector(): an fa3 launch's plan_info."""

    QO_TILE_INDICES_OFFSET = 0
    QO_INDPTR_OFFSET = 1
    KV_INDPTR_OFFSET = 2
    QO_LEN_OFFSET = 3
    KV_LEN_OFFSET = 4
    HEAD_INDICES_OFFSET = 5
    WORK_INDPTR_OFFSET = 6
    BATCH_INDICES_OFFSET = 7
    SAME_SCHEDULE_FOR_ALL_HEADS = 8


MAX_PLAN_INFO = len(PrefillPlanInfo)
FA3_PLAN_INFO = len(SM90PlanInfo)
HEADER_FIELDS = len(HeaderField)
LAUNCH_FIELDS = LaunchField.INFO + MAX_PLAN_INFO
CUSTOM_ROWS = 128  # rows per custom launch request (a tight hull beats one long launch request)
TAIL_MAX_QO_LEN = 128  # tail rows only in requests of at most this many queries (fa2's largest query tile)
FA3_MAX_WINDOW_LAUNCHES = 4  # distinct window widths given their own fa3 launch; more go custom
# custom, causal, none; fa2 also its tail launch, fa3 a causal launch per window width (the other
# widths run custom)
FA2_LAUNCHES = 4
# key intervals a row's launch requests may read apart (SegField.PIECE): sinks + window, documents +
# global sinks, a tree's context + ancestors fit; rows with more run as one custom launch over the hull
MAX_PIECES = 4
# gaps a launch request's page list may skip (SegField.GAP_*, MetaColumn.GAP_*): its keys in up to
# MAX_PIECES ranges
MAX_KEY_GAPS = MAX_PIECES - 1
# MetaColumn.GAP_AT_j of no gap: past every list index
NO_GAP_AT = 2**31 - 1
# the launches of the rows written in place, then the same set again per piece, and the listed
# launch (in place)
MAX_LAUNCHES = max(FA2_LAUNCHES, 3 + FA3_MAX_WINDOW_LAUNCHES) * (1 + MAX_PIECES) + 1
OPTION_FIELDS = PlanOption.WINDOWS + FA3_MAX_WINDOW_LAUNCHES
DESC_FIELDS = HEADER_FIELDS + LAUNCH_FIELDS * MAX_LAUNCHES
ROW_BLOCK = 256  # query rows per block of the row kernels: one launch-request count each
NO_INTERVAL = 1 << 40  # "no interval" sentinel of the row pass (intervals.py's BIG)
# int32 entries plan()'s read-back of its index tensors needs past them: the page list's
# (min, max), and room for the two 8-byte keys they are folded in (templates/plan/read_indices.cuh)
READ_INDICES_EXTRA = 5
# VIS_HI of a launch request whose mode and kernel window are its whole mask: every key position
VIS_EVERY_KEY = 2**31 - 1
# run()'s code for fa2's tail launch: MaskMode CAUSAL with the spec's mask evaluated on the tiles
# the kernel masks. The codes of the exact launches (NONE, CAUSAL) run kernel units compiled
# without the spec's mask (only the kernel window); this one and CUSTOM run the masked variant.
FA2_TAIL_RUN_CODE = 3
# run()'s code for the launch of custom launch requests over page lists (LaunchField.LISTED): the
# masked variant that reads each key's position from its list's table. Its own kernel, so the
# custom launch's per-element code has no table lookup (with it, streaming_sink's custom hull
# took 49 ms for 27 on an H100): compiled where the mask has an atom the planner may list
# (lang/reads.py's page_list_atoms).
LISTED_RUN_CODE = 4
# fa3 ragged: zero rows run() puts after each request's keys in its padded copy of K and V, and the
# shift the module's plan adds to request b's first key (b x this). FlashInfer's sm90 ragged kernel
# loads whole KV tiles (TMA over the packed [total_kv, heads, dim] tensor) from the request's first
# key, so its last tile reads up to CTA_KV - 1 rows past the request's last key: without a gap those
# are the next request's keys, and a masked score's zero weight times a NaN / inf value there is NaN
# in this request's rows. At least the kernel's largest KV tile (192 rows at head dim 128;
# templates/fa3/ragged_run.cuh checks it against FlashInfer's tile sizes).
RAGGED_KV_GAP = 256


# ----------------------------------------------------------------------------- the C++ header
_WORDS = {"FLASHINFER": "FlashInfer"}  # C++ spelling of a name part, where capitalize() is wrong


def _enum_lines(enum: type[IntEnum], prefix: str, what: str) -> list[str]:
    lines = [f"// {what}"]
    for member in enum:
        name = "".join(_WORDS.get(part, part.capitalize()) for part in member.name.split("_"))
        lines.append(f"constexpr int32_t {prefix}{name} = {int(member)};")
    return lines


def header_text() -> str:
    """``vg_plan_abi.h``: this table as C++ (pure: the same text for the same table)."""
    meta = [f"#define VG_META_{c.name} {int(c)}" for c in MetaColumn] + [f"#define VG_META_STRIDE {META_COLUMNS}"]
    width = max(len(line) for line in meta)
    meta = [line.ljust(width) + f"  // {_COMMENTS[c]}" for line, c in zip(meta, MetaColumn)] + meta[-1:]
    lines = [
        "// The plan's ABI, generated from variantgen/abi/table.py (do not edit: change the table there).",
        "// Included by every generated module: the kernels, the row pass and the launch builder read",
        "// the plan's int arrays through these names, and Python through the same table.",
        "#pragma once",
        "#include <cstdint>",
        "",
        "// Columns of `vg_meta` (int32, one row per launch request the kernel sees): where it sits in",
        "// the caller's batch. The kernel finds launch request b's first row in q and o through its",
        "// indptr (fa2: q_indptr[b]; fa3: the work list's qo_indptr), its length here.",
        *meta,
        "",
        "namespace vg_abi {",
        *_enum_lines(MaskMode, "kMode", "run()'s mask-mode codes (render.MaskMode)"),
        *_enum_lines(RowClass, "k", "row classes of the interval planner"),
        *_enum_lines(RecField, "kRec", "the row pass's record rec[field][row] (int64)"),
        f"constexpr int kRecFields = {len(RecField)};",
        *_enum_lines(SegField, "kSeg", "a compacted launch request (segment, int64 fields)"),
        f"constexpr int kSegFields = {SEG_FIELDS};",
        *_enum_lines(Schedule, "kSchedule", "who scheduled a launch's work list"),
        *_enum_lines(PlanOption, "kOption", "the launch builder's options (int64)"),
        f"constexpr int kOptionFields = {OPTION_FIELDS};",
        *_enum_lines(Status, "kStatus", "how the launch builder answered"),
        *_enum_lines(HeaderField, "kHead", "the plan descriptor's header (int64)"),
        f"constexpr int kHeaderFields = {HEADER_FIELDS};",
        *_enum_lines(LaunchField, "kLaunch", "one launch of the plan descriptor (int64)"),
        f"constexpr int kLaunchFields = {LAUNCH_FIELDS};",
        *_enum_lines(LaunchArray, "kArray", "a launch's int32 metadata arrays, in this order"),
        *_enum_lines(PrefillPlanInfo, "kFa2Info", "an fa2 launch's plan_info (flashinfer::PrefillPlanInfo)"),
        *_enum_lines(SM90PlanInfo, "kFa3Info", "an fa3 launch's plan_info (flashinfer::PrefillPlanSM90Info)"),
        "// limits",
        f"constexpr int kMetaColumns = {META_COLUMNS};",
        f"constexpr int kMaxPlanInfo = {MAX_PLAN_INFO};",
        f"constexpr int kFa3PlanInfo = {FA3_PLAN_INFO};",
        f"constexpr int32_t kCustomRows = {CUSTOM_ROWS};",
        f"constexpr int32_t kTailMaxQoLen = {TAIL_MAX_QO_LEN};",
        f"constexpr int kFa2Launches = {FA2_LAUNCHES};",
        f"constexpr int kFa3MaxWindowLaunches = {FA3_MAX_WINDOW_LAUNCHES};",
        f"constexpr int kMaxLaunches = {MAX_LAUNCHES};",
        f"constexpr int kMaxPieces = {MAX_PIECES};",
        f"constexpr int kMaxKeyGaps = {MAX_KEY_GAPS};",
        f"constexpr int32_t kNoGapAt = {NO_GAP_AT};",
        f"constexpr int kRowBlock = {ROW_BLOCK};",
        f"constexpr int64_t kNoInterval = int64_t(1) << {NO_INTERVAL.bit_length() - 1};",
        f"constexpr int kReadIndicesExtra = {READ_INDICES_EXTRA};",
        f"constexpr int32_t kVisEveryKey = {VIS_EVERY_KEY};",
        f"constexpr int32_t kFa2TailRunCode = {FA2_TAIL_RUN_CODE};",
        f"constexpr int32_t kListedRunCode = {LISTED_RUN_CODE};",
        f"constexpr int32_t kRaggedKvGap = {RAGGED_KV_GAP};",
        "}  // namespace vg_abi",
        "",
    ]
    return "\n".join(lines)


_COMMENTS = {
    MetaColumn.Q_ROW_BASE: "global row of the first query, in the caller's q",
    MetaColumn.Q_POS_BASE: "absolute position of the first query in its request",
    MetaColumn.KV_POS_BASE: "absolute position of the first key of the page list",
    MetaColumn.REQUEST: "index of the caller's request",
    MetaColumn.KV_ROW_BASE: "first [total_kv] row of the caller's request",
    MetaColumn.REQ_QO_LEN: "qo_len of the caller's request",
    MetaColumn.REQ_KV_LEN: "kv_len of the caller's request",
    MetaColumn.KERNEL_WINDOW: "window_left the kernel may prune with; -1: visit every tile",
    MetaColumn.LAUNCH_QO_LEN: "queries of this launch request (rows from q_indptr[b] on)",
    MetaColumn.VIS_LO: "keys [VIS_LO, VIS_HI] (absolute) are visible to all its queries: no mask there",
    MetaColumn.VIS_HI: "but the kernel window (custom: known keys; exact runs: every key; else empty)",
    MetaColumn.GAP_AT_1: "from list key GAP_AT_j on (ascending; none: kNoGapAt) the keys sit",
    MetaColumn.GAP_LEN_1: "GAP_LEN_j positions further: the page list skipped a gap",
    MetaColumn.GAP_AT_2: "the second gap (as GAP_AT_1)",
    MetaColumn.GAP_LEN_2: "(as GAP_LEN_1)",
    MetaColumn.GAP_AT_3: "the third gap (as GAP_AT_1)",
    MetaColumn.GAP_LEN_3: "(as GAP_LEN_1)",
    MetaColumn.PAGE_TABLE_AT: "a page list's key positions: int32 per page from vg_meta + this (-1: none)",
    MetaColumn.LIST_PAGE_SIZE: "keys per page of that list (list key i: its page i / this)",
}
assert len([c for c in MetaColumn if c.name.startswith("GAP_AT_")]) == MAX_KEY_GAPS
assert [c.name for c in SegField][-2 * MAX_KEY_GAPS - 2:-2] == [f"GAP_{w}_{j}" for j in range(1, MAX_KEY_GAPS + 1)
                                                               for w in ("FROM", "TO")]
