"""Rows that see several key intervals, read in one pass: a custom launch request whose page list
skips the gaps between its rows' intervals.

The other mechanism for such rows (pieces.py) runs each interval as launch requests of its own
exact class and merges a row's partial outputs by their LSE: no mask is evaluated, but every
split row's output is written once per piece and read back by the merge (three row-sized
passes over o for two pieces). Here a run of up to CUSTOM_ROWS such rows is one custom launch
request in place: its page list holds the pages of the union of its rows' intervals (each
rounded out to whole pages, at most MAX_PIECES ranges: where the union has more, the shortest
gaps are read), and vg_meta's GAP_AT / GAP_LEN columns tell the variant where each list key
sits (``key_pos`` in the generated variants), so the mask sees true positions. The keys all its
rows see (the intersection of their last intervals: the window of sinks + window) are marked
known visible, where the mask is not evaluated; the mask runs on the rest (the sinks' page and
the window's ragged edges).

Measured against the pieces (bench/bench_pieces.py, H100, streaming_sink at 8 x 8192 with 4
sinks and a 1023-key window; bench/results/2026-12-07-h100/): fa3 5.31 ms with gaps, 4.06 ms
with pieces (the merge as one kernel), 2.74 ms for sliding_window alone; fa2 8.50 / 4.54 / 3.28
ms. The custom variant's per-element work (the key's position, the known-visible test, the mask
outside it) costs more than the pieces' merge, so pieces are the default (planner.SPLIT_ROWS).
Gaps run where pieces cannot: rows the pieces would leave on their hull, because a piece's
custom run or fa3 window run would read into the row's other pieces (pieces.py) - there they
replace the hull's keys by the union's - and every such row in CUDA-graph mode, whose fixed
launch slots and static workspace take in-place launch requests but no partial outputs.

Rows of an inexact term and rows of more than MAX_PIECES intervals (row_pieces: count 0) are
not touched: they run custom over their hull, as before.
"""

from __future__ import annotations

import torch

from ..abi.table import MAX_KEY_GAPS, SegField
from .intervals import BIG
from .rowrules import rows_of_segments


def skip_gaps(table: torch.Tensor, which: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, count: torch.Tensor,
              page_size: int) -> None:
    """Give the segments ``which`` of ``table`` (custom runs, in place, of rows that see 2..MAX_PIECES
    exact intervals: ``lo`` / ``hi`` [rows, MAX_PIECES], ``count`` [rows], as pieces.row_pieces
    finds them) the gaps between the page ranges of their rows' intervals (the longest
    MAX_KEY_GAPS) and, as known visible keys, the intersection of their rows' last intervals.
    In place."""
    ps = page_size
    seg = table[which]
    owner, row = rows_of_segments(seg)  # per row: its segment
    # Every interval of every row, as pages [p0, p1): sorted by (segment, p0), merged where they
    # overlap or touch (a running max of p1 that never crosses into the next segment: offsets).
    width = lo.shape[1]
    valid = torch.arange(width).view(1, -1) < count[row].view(-1, 1)
    p0 = torch.div(lo[row], ps, rounding_mode="floor")[valid]
    p1 = (torch.div(hi[row] + ps, ps, rounding_mode="floor"))[valid]  # ceil((hi + 1) / ps)
    own = owner.view(-1, 1).expand(-1, width)[valid]
    span = int(max(int(p1.max()), 1)) + 1
    key0, key1 = own * span + p0, own * span + p1
    order = torch.argsort(key0)
    key0, key1, own = key0[order], key1[order], own[order]
    reach = torch.cummax(key1, 0).values
    starts = torch.ones_like(key0, dtype=torch.bool)
    starts[1:] = key0[1:] > reach[:-1]  # a new range: past every page so far (and the segments differ)
    # The gaps: between a range's end (the running max before a start) and that start, same segment.
    at = starts.nonzero().squeeze(1)
    at = at[at > 0]
    at = at[own[at] == own[at - 1]]
    g_own, g_from, g_to = own[at], reach[at - 1] - own[at] * span, key0[at] - own[at] * span
    # Keep each segment's longest MAX_KEY_GAPS gaps (the others' pages are read), in key order.
    rank_key = g_own * span - (g_to - g_from)
    order = torch.argsort(rank_key, stable=True)
    g_own, g_from, g_to = g_own[order], g_from[order], g_to[order]
    first_of = torch.searchsorted(g_own, g_own, right=False)
    keep = torch.arange(g_own.numel()) - first_of < MAX_KEY_GAPS
    g_own, g_from, g_to = g_own[keep], g_from[keep], g_to[keep]
    order = torch.argsort(g_own * span + g_from)
    g_own, g_from, g_to = g_own[order], g_from[order], g_to[order]
    slot = torch.arange(g_own.numel()) - torch.searchsorted(g_own, g_own, right=False)
    fields = torch.zeros(seg.shape[0], 2 * MAX_KEY_GAPS, dtype=torch.int64)
    fields[g_own, 2 * slot] = g_from * ps
    fields[g_own, 2 * slot + 1] = g_to * ps
    seg[:, SegField.GAP_FROM_1:SegField.GAP_FROM_1 + 2 * MAX_KEY_GAPS] = fields
    # Known visible: the keys every row's last interval holds.
    last = (count[row] - 1).clamp(min=0).view(-1, 1)
    last_lo, last_hi = lo[row].gather(1, last).squeeze(1), hi[row].gather(1, last).squeeze(1)
    n = seg.shape[0]
    vis_lo = torch.full((n,), -BIG, dtype=torch.int64).scatter_reduce(0, owner, last_lo, "amax")
    vis_hi = torch.full((n,), BIG, dtype=torch.int64).scatter_reduce(0, owner, last_hi, "amin")
    known = vis_lo <= vis_hi
    seg[:, SegField.VIS_LO] = torch.where(known, vis_lo, 0)
    seg[:, SegField.VIS_HI] = torch.where(known, vis_hi, -1)
    table[which] = seg
