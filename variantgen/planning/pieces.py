"""Rows that see several key intervals: one launch request per interval, merged by LSE.

A row whose visible keys are a union of disjoint intervals - StreamingLLM's sinks and window
past the first window, a prefix and a window, documents and global sinks, a tree's context and
its ancestors - has one hull that covers the gaps too. Run as one custom launch over that hull
it evaluates the mask on every key of the gap (streaming_sink at 8192 keys and window 1024:
22.8 ms on an H100 against 3.0 ms for the window alone). Here such a row's intervals become
*pieces*: the p-th interval (by position) of every row that has one is classified like any
row's interval (dense, causal, window or custom over the run's hull, rowrules.py) and laid out
by the launch builder as launch requests of piece p, which write partial output p and its LSE;
run() merges a row's pieces into o (merge.py). Rows of one interval keep writing in place.

Why separate launches merged by LSE, not one launch whose page list skips the gaps (the two
mechanisms the planner could use; the cost model, per row of n visible keys in k intervals):

* skipping the gaps in one launch reads ~n keys in one pass, but its keys are no longer at
  their positions: the kernel's causal mask and window (which prune tiles and decide the
  diagonal) compare virtual positions, so every such launch would have to run custom with a
  key-position map the variant reads - the mask on every element of n keys, plus the map's
  load per key. The custom variant costs about 2.5x a causal launch per visited key on fa3
  (README's Speed table: causal 8.5 ms vs the custom hull's 22.8 at 4.3x the keys);
* pieces read the same ~n keys (each piece rounded out to whole pages at its start: at most
  page_size - 1 keys more per piece) in launches of the existing exact classes (sinks: dense,
  the window: the kernel window), with no mask evaluated, plus per piece one more launch
  (~5-10 us each) and the merge: one read of k partial rows and one write per merged row
  (for 8 x 8192 rows, 32 heads, hd 128, two pieces: ~0.5 GB of traffic, ~0.2 ms on an H100),
  and a tile of a short piece (4 sink keys) is mostly empty: its cost is that of one key
  tile per query tile.
  So pieces win wherever the intervals are exact classes, which is every shape listed above;
  the gap-skipping launch would win only for rows of many short intervals, which the planner
  does not split (more than MAX_PIECES intervals: the custom hull, as before).

A first piece of at most INLINE_KEYS keys (sinks, a short prefix, a few global tokens) of rows
that see two can be left to the merge (inline_first_pieces, the planner's inline_keys): a launch
over a few keys still costs a whole key tile per query tile and a partial output written and
read back (0.57 ms of streaming_sink's 3.99 on an H100), so the rows' other piece runs in place
and run()'s merge computes the few keys' attention itself (merge_pieces.cuh's merge_inline):
streaming_sink 3.85 ms against 4.21 with the sinks launched (H100, 8 x 8192; its first kernel
took 2.04 ms, slower than the launch). Specs with a logits transform, and q / k / v / o of
different dtypes, always launch it as any piece.

Where a custom piece run's hull (or a window run's first page, should fa3 run it custom) would
reach into a row's neighbouring piece, the mask evaluated there would show those keys a second
time: such rows are not split (they run as before, over their hull). Rows of an inexact term
(the mask evaluated inside a hull) are never split.

The planner module's generated row kernel does not split rows yet: plan() runs these rules in
torch ops for specs whose rows can see several intervals (planner.py), and the launch builder
(templates/plan/launches.h) lays them out as it does the row kernel's segments.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..abi.table import MAX_PIECES, SEG_FIELDS, RowClass, SegField
from ..lang.values import VariantSpec
from .gaps import skip_gaps
from .intervals import BIG, IntervalForm, RowIntervals, TermBounds, decided_terms, term_bounds
from .rowrules import classify_intervals, rows_of_segments, segments

_SPLIT_ROUNDS = 4  # rows unsplit where a custom piece run would overreach, then the table again
# a first piece of at most this many keys (sinks) is computed by run()'s merge, not launched
# (inline_first_pieces); the merge kernel's own bound is larger (kMaxInlineKeys)
INLINE_KEYS = 16


class RowPieces(NamedTuple):
    """Per row, its visible keys as disjoint intervals (sorted, none adjacent to the next)."""

    lo: torch.Tensor  # int64 [rows, max_pieces]
    hi: torch.Tensor  # int64 [rows, max_pieces]
    count: torch.Tensor  # int64 [rows]: intervals, where 2..max_pieces and exact; else 0


def may_split(form: IntervalForm, spec: VariantSpec, args: dict[str, Any]) -> bool:
    """Whether rows of this spec may see several exact key intervals (for these scalar values):
    at least two exact interval terms, and no learned sink (a sink joins each row's softmax
    denominator once: merged partial outputs would count it once per piece)."""
    if spec.sink is not None or not form.planner_ready:
        return False
    return sum(t.exact for t in decided_terms(form, spec, args)) >= 2


def row_pieces(form: IntervalForm, spec: VariantSpec, env: dict[str, torch.Tensor], args: dict[str, Any],
               max_pieces: int = MAX_PIECES) -> RowPieces:
    """The disjoint intervals of every row's visible keys (``env``: rowrules.row_env's rows):
    the terms' intervals sorted by their first key and merged where they overlap or touch."""
    return pieces_of_terms(term_bounds(form, spec, env, args), max_pieces)


def pieces_of_terms(bounds: TermBounds, max_pieces: int = MAX_PIECES) -> RowPieces:
    """row_pieces from the rows' term bounds (intervals.term_bounds)."""
    n = bounds.lo[0].shape[0] if bounds.lo else 0
    dev = bounds.lo[0].device if bounds.lo else torch.device("cpu")
    none = RowPieces(torch.zeros(n, max_pieces, dtype=torch.int64, device=dev),
                     torch.full((n, max_pieces), -1, dtype=torch.int64, device=dev),
                     torch.zeros(n, dtype=torch.int64, device=dev))
    if len(bounds.lo) < 2 or n == 0:
        return none
    lo, hi = torch.stack(bounds.lo, 1), torch.stack(bounds.hi, 1)
    ok, exact = torch.stack(bounds.ok, 1), torch.stack(bounds.exact, 1)
    order = lo.argsort(1)  # (empty terms have lo = BIG: last)
    lo_s, hi_s, ok_s = lo.gather(1, order), hi.gather(1, order), ok.gather(1, order)
    reach = hi_s.cummax(1).values
    starts = ok_s.clone()
    starts[:, 1:] &= lo_s[:, 1:] > reach[:, :-1] + 1  # a new interval: past the keys so far, not touching
    group = starts.cumsum(1) - 1
    count = starts.sum(1)
    p_lo = torch.stack([torch.where(ok_s & (group == g), lo_s, BIG).amin(1) for g in range(max_pieces)], 1)
    p_hi = torch.stack([torch.where(ok_s & (group == g), hi_s, -BIG).amax(1) for g in range(max_pieces)], 1)
    usable = exact.all(1) & (count >= 2) & (count <= max_pieces)
    return RowPieces(torch.where(usable.view(-1, 1), p_lo, none.lo), torch.where(usable.view(-1, 1), p_hi, none.hi),
                     torch.where(usable, count, 0))


def piece_table(env: dict[str, torch.Tensor], iv: RowIntervals, pieces: RowPieces, page_size: int, how: str,
                fa3_window_launches: int | None = None, packed: bool = False) -> torch.Tensor:
    """The launch requests of a batch whose rows may see several intervals (``iv``: the rows'
    hulls, ``pieces``: their intervals), in the launch builder's order (read_segments): host int64
    [n, SEG_FIELDS]. ``how`` "pieces": first every row once (piece -1: in place, 0: a split row's
    first interval) in row order, then piece 1, 2 ... each in row order; rows whose pieces would
    overreach (below) run in place past their gaps. "gaps": every row in place, those of
    2..MAX_PIECES exact intervals in custom runs whose page lists skip their gaps (gaps.py).
    ``fa3_window_launches``: fa3's window widths given their own launch (the builder keeps the
    smallest widths of pieces first; a piece's window run of another width runs custom); None: fa2,
    whose window launches take any width. ``packed``: fa3 GQA packing, whose launch builder runs a
    piece's causal and window runs dense (one row seeing its whole run) or custom over their
    pages (pack_classes in launches.h): checked here as custom runs."""
    if how == "gaps":
        return _tables(env, iv, pieces, torch.zeros_like(pieces.count, dtype=torch.bool), page_size)
    split = pieces.count >= 2
    for _ in range(_SPLIT_ROUNDS):
        table = _tables(env, iv, pieces, split, page_size)
        bad = _overreaching_rows(table, pieces, split.shape[0], fa3_window_launches, packed)
        if not bad.any():
            return table
        split = split & ~bad.to(split.device)
    return _tables(env, iv, pieces, torch.zeros_like(split), page_size)


def _tables(env: dict[str, torch.Tensor], iv: RowIntervals, pieces: RowPieces, split: torch.Tensor,
            page_size: int) -> torch.Tensor:
    """The segment table for rows ``split`` into their pieces; the other rows in place, those of
    several exact intervals among them in custom runs of their own that skip their gaps (gaps.py:
    rather than their hull)."""
    lo0, hi0 = pieces.lo[:, 0], pieces.hi[:, 0]
    gapped = (pieces.count >= 2) & ~split
    dense_hi = iv.dense_hi if iv.dense_hi is not None else iv.lo - 1
    first = RowIntervals(lo=torch.where(split, lo0, iv.lo), hi=torch.where(split, hi0, iv.hi),
                         exact=(iv.exact | split) & ~gapped, empty=iv.empty & ~split & ~gapped,
                         # (a gapped row: custom, never a tail run, its known keys set by skip_gaps)
                         dense_hi=torch.where(split, hi0, torch.where(gapped, iv.lo - 1, dense_hi)))
    run_key = split.long() + 2 * gapped.long()
    base = _with_piece(segments(classify_intervals(env, first, page_size, run_key), page_size), split, 0)
    if bool(gapped.any()):
        on = gapped.cpu()[base[:, SegField.FIRST_ROW]] & (base[:, SegField.CLASS] == RowClass.CUSTOM)
        skip_gaps(base, on.nonzero().squeeze(1), pieces.lo.cpu(), pieces.hi.cpu(), pieces.count.cpu(), page_size)
    tables = [base]
    for p in range(1, pieces.lo.shape[1]):
        active = split & (pieces.count > p)
        if not bool(active.any()):
            break
        lo, hi = torch.where(active, pieces.lo[:, p], iv.lo), torch.where(active, pieces.hi[:, p], iv.hi)
        ivp = RowIntervals(lo=lo, hi=hi, exact=active, empty=torch.zeros_like(active),
                           dense_hi=torch.where(active, hi, lo - 1))
        seg = segments(classify_intervals(env, ivp, page_size, active.long()), page_size)
        keep = active.cpu()[seg[:, SegField.FIRST_ROW]]
        tables.append(_with_piece(seg[keep], None, p))
    return torch.cat(tables) if tables else torch.empty(0, SEG_FIELDS, dtype=torch.int64)


def _with_piece(seg: torch.Tensor, split: torch.Tensor | None, piece: int) -> torch.Tensor:
    """``seg`` with its PIECE column: ``piece``, or (the partition) -1 for rows not ``split``."""
    seg = seg.clone()
    if split is None:
        seg[:, SegField.PIECE] = piece
    else:
        on = split.cpu()[seg[:, SegField.FIRST_ROW]]
        seg[:, SegField.PIECE] = torch.where(on, piece, -1)
    return seg


def _overreaching_rows(table: torch.Tensor, pieces: RowPieces, rows: int,
                       fa3_window_launches: int | None, packed: bool = False) -> torch.Tensor:
    """bool [rows]: split rows in a launch request that may evaluate the mask on keys of one of
    the row's other pieces: a custom run over its hull from its first page, or a window run that
    fa3 runs custom (a width beyond the kept ones), or with GQA packing (``packed``) any causal or
    window run (custom over its pages there). A window run in a window launch sees each row's
    keys from q_pos - window on only (the kernel window)."""
    bad = torch.zeros(rows, dtype=torch.bool)
    piece = table[:, SegField.PIECE]
    cls = table[:, SegField.CLASS]
    window_run = (piece >= 0) & (cls == RowClass.WINDOW)
    kept = torch.ones_like(window_run)
    if fa3_window_launches is not None:
        widths = table[window_run, SegField.WINDOW].unique().sort().values[:fa3_window_launches]
        kept = torch.isin(table[:, SegField.WINDOW], widths)
    if packed:  # (a run of one row seeing all of it runs dense: checking it too only keeps rows unsplit)
        kept = torch.zeros_like(window_run)
    pick = (piece >= 0) & ((cls == RowClass.CUSTOM) | (window_run & ~kept) | (packed & (cls == RowClass.CAUSAL)))
    if not bool(pick.any()):
        return bad
    seg = table[pick]
    which, row = rows_of_segments(seg)
    p = seg[which, SegField.PIECE]
    begin, last = seg[which, SegField.KV_BEGIN], seg[which, SegField.KV_END] - 1
    lo, hi, count = pieces.lo.cpu()[row], pieces.hi.cpu()[row], pieces.count.cpu()[row]
    width = lo.shape[1]
    prev_hi = torch.where(p >= 1, hi.gather(1, (p - 1).clamp(min=0).view(-1, 1)).squeeze(1), -1)
    next_lo = torch.where(p + 1 < count, lo.gather(1, (p + 1).clamp(max=width - 1).view(-1, 1)).squeeze(1), BIG)
    over = (begin <= prev_hi) | (last >= next_lo)
    bad[row[over]] = True
    # window runs in a window launch: each row from its own window start (q_pos - window) on
    exact_window = window_run & kept
    if bool(exact_window.any()):
        seg = table[exact_window]
        which, row = rows_of_segments(seg)
        step = row - seg[which, SegField.FIRST_ROW]
        p = seg[which, SegField.PIECE]
        # (each row's last key is its q_pos plus the run's shift: a band's, else 0)
        shift = seg[which, SegField.KV_END] - seg[which, SegField.Q_POS] - (seg[which, SegField.END_ROW]
                                                                            - seg[which, SegField.FIRST_ROW])
        start = seg[which, SegField.Q_POS] + step + shift - seg[which, SegField.WINDOW]
        begin = torch.maximum(start, seg[which, SegField.KV_BEGIN])
        prev_hi = torch.where(p >= 1, pieces.hi.cpu()[row].gather(1, (p - 1).clamp(min=0).view(-1, 1)).squeeze(1), -1)
        bad[row[begin <= prev_hi]] = True  # (a window run ends at each row's own q_pos: its last piece)
    return bad


class MergeRows(NamedTuple):
    """The rows run() merges: their indices and how many pieces each has (int64), and the same as
    rows of the launches' outputs (``out_rows`` / ``out_counts``: with fa3 GQA packing the packed
    rows, row r's at r x pack + g for g < pack; else the rows themselves). ``inline``: the rows'
    first piece computed by the merge itself (inline_first_pieces), per out row (int32 on the
    device: the page-list entry holding its first key, that key's slot, its key count) with the
    page list they index; their other piece wrote o in place. None: every piece is a partial output."""

    rows: torch.Tensor
    counts: torch.Tensor
    pieces: int  # the most partial outputs of a row (run() allocates them; 0 with inline pieces)
    out_rows: torch.Tensor | None = None
    out_counts: torch.Tensor | None = None
    inline: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    kv_indices: torch.Tensor | None = None
    inline_pairs: int = 0  # (query, key) pairs of the inline pieces (Plan.work counts them)

    def packed(self, pack: int) -> MergeRows:
        """The same rows, with their rows in the launches' outputs for GQA packing ``pack``."""
        if pack == 1:
            return self._replace(out_rows=self.rows, out_counts=self.counts)
        out_rows = (self.rows.view(-1, 1) * pack + torch.arange(pack, device=self.rows.device)).flatten()
        inline = tuple(t.repeat_interleave(pack) for t in self.inline) if self.inline is not None else None
        return self._replace(out_rows=out_rows, out_counts=self.counts.repeat_interleave(pack), inline=inline)


def merge_rows(table: torch.Tensor, total_q: int) -> MergeRows:
    """The split rows of a segment table and their piece counts."""
    counts = torch.zeros(total_q, dtype=torch.int64)
    seg = table[table[:, SegField.PIECE] >= 0]
    for first, end, p in seg[:, [SegField.FIRST_ROW, SegField.END_ROW, SegField.PIECE]].tolist():
        counts[first:end] = torch.clamp(counts[first:end], min=p + 1)
    rows = counts.nonzero().flatten()
    return MergeRows(rows, counts[rows], int(counts.max()) if total_q else 0)


class InlinePieces(NamedTuple):
    """Split rows whose first piece the merge computes (inline_first_pieces): per row (int64,
    host) its request, its piece's first key and key count."""

    rows: torch.Tensor
    request: torch.Tensor
    first_key: torch.Tensor
    keys: torch.Tensor


def inline_first_pieces(table: torch.Tensor, max_keys: int = INLINE_KEYS,
                        fa3_window_launches: int | None = None) -> tuple[torch.Tensor, InlinePieces] | None:
    """The segment table with the split rows' first piece left to the merge, where every split row
    has two pieces and its first is a dense run of at most ``max_keys`` keys (StreamingLLM's sinks,
    a short system prompt, a few global tokens): the first piece's segments go, the second's write
    in place. A launch request over a few keys costs a whole key tile per query tile, and its
    partial output a write and a read of every split row; the merge computes those keys' attention
    from q, k and v while it reads the row once (merge_pieces.cuh's merge_inline). None where the
    table is not of that shape, or where (fa3: ``fa3_window_launches`` window widths get their own
    launch) the second pieces' window widths would no longer all keep theirs."""
    piece = table[:, SegField.PIECE]
    first, second = table[piece == 0], table[piece == 1]
    if first.shape[0] == 0 or bool((piece >= 2).any()):
        return None
    # The piece's keys: a dense run's [kv_begin, kv_end); a one-row custom run's known-visible keys
    # where they are all it reads past its page's start (a decode row's sinks); nothing else.
    cls = first[:, SegField.CLASS]
    one_row = (first[:, SegField.END_ROW] - first[:, SegField.FIRST_ROW]) == 1
    known = ((cls == RowClass.CUSTOM) & one_row & (first[:, SegField.VIS_LO] <= first[:, SegField.VIS_HI])
             & (first[:, SegField.VIS_HI] == first[:, SegField.KV_END] - 1))
    if not bool(((cls == RowClass.DENSE) | known).all()):
        return None
    first_key = torch.where(known, first[:, SegField.VIS_LO], first[:, SegField.KV_BEGIN])
    keys = first[:, SegField.KV_END] - first_key
    if int(keys.max()) > max_keys:
        return None
    which, rows = rows_of_segments(first)  # per split row: its segment
    covered = torch.zeros(int(table[:, SegField.END_ROW].max()), dtype=torch.int64)
    for f, e in second[:, [SegField.FIRST_ROW, SegField.END_ROW]].tolist():
        covered[f:e] += 1
    if not bool((covered[rows] == 1).all()):  # (every split row: one second piece)
        return None
    out = torch.cat([table[piece == -1], second])
    out[:, SegField.PIECE] = -1
    out = out[torch.argsort(out[:, SegField.FIRST_ROW], stable=True)]
    if fa3_window_launches is not None:
        window = out[:, SegField.CLASS] == RowClass.WINDOW
        widths = out[window, SegField.WINDOW].unique().sort().values
        kept = set(second[second[:, SegField.CLASS] == RowClass.WINDOW, SegField.WINDOW].tolist())
        if not kept <= set(widths[:fa3_window_launches].tolist()):
            return None
    return out, InlinePieces(rows, first[which, SegField.REQUEST], first_key[which], keys[which])
