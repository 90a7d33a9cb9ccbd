"""The segment table of a batch: the one assembly of the launch requests the row rules give it.

The launch builder (templates/plan/launches.h) lays out a table of segments - runs of rows of
one class over one key range - followed by the page lists of some of them. For most batches the
spec's planner module builds that table on the GPU (rowplan.py). Where rows may see several key
intervals or a key set, the rules in torch ops build it instead, in this order:

1. the spec's terms evaluated once over the batch's rows (rowrules.row_terms);
2. the rows' hulls classified into segments (rowrules); rows of several exact intervals split
   into pieces (pieces.py), or read in place past their gaps (gaps.py, CUDA-graph mode);
3. a first piece of a few keys left to run()'s merge (pieces.inline_first_pieces), if asked;
4. page lists for custom runs of rows that see a key set (keysets.py).

plan() (planner.py) and the cost model (cost.py: explain, bench_planner) both ask this module, so
the cost an author sees before a GPU is the plan the GPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..abi.table import MAX_PIECES
from ..lang.values import VariantSpec
from .intervals import IntervalForm, fold_terms
from .keysets import has_key_sets, list_pages
from .pieces import InlinePieces, inline_first_pieces, may_split, piece_table, pieces_of_terms
from .plan import LaunchRequest
from .rowrules import classify_intervals, row_terms, segments

SPLIT_HOWS = ("", "pieces", "gaps")


@dataclass(frozen=True)
class TableRules:
    """How a table treats rows of several intervals and key sets.

    ``split``: "" (such rows run over their hull), "pieces" (a launch request per interval, merged
    by LSE) or "gaps" (one in-place request skipping the gaps); ``lists``: key-set runs get page
    lists; ``max_pieces``: the most intervals a split row may have; ``window_launches``: fa3's
    window widths with a launch of their own (None: fa2); ``packed``: fa3 GQA packing;
    ``inline_keys``: a first piece of at most this many keys is left to the merge (0: never)."""

    split: str = ""
    lists: bool = False
    max_pieces: int = MAX_PIECES
    window_launches: int | None = None
    packed: bool = False
    inline_keys: int = 0

    def __post_init__(self) -> None:
        if self.split not in SPLIT_HOWS:
            raise ValueError(f"TableRules.split: {self.split!r}, expected one of {SPLIT_HOWS}")

    @classmethod
    def of(cls, form: IntervalForm, spec: VariantSpec, args: dict[str, Any], *, split_how: str = "pieces",
           max_pieces: int = MAX_PIECES, lists: bool = True, **options: Any) -> TableRules:
        """The rules this spec needs for these arguments: rows split ``split_how`` where they may
        see several intervals (and ``max_pieces`` > 0), lists where a term shows a key set (and
        ``lists``, and the module has the listed variant: ``form.page_lists``)."""
        split = split_how if max_pieces > 0 and may_split(form, spec, args) else ""
        listed = lists and form.page_lists and has_key_sets(form, spec, args)
        return cls(split=split, lists=listed,
                   max_pieces=min(max_pieces, MAX_PIECES) if split == "pieces" else MAX_PIECES, **options)

    @property
    def special(self) -> bool:
        """Whether the table needs these rules at all (else the row kernel's table is it)."""
        return bool(self.split) or self.lists


@dataclass(frozen=True)
class SegmentTable:
    """The launch builder's table (host int64 [n, SEG_FIELDS]): the segments, then ``list_rows``
    rows of page lists; ``inline``: the split rows whose first piece the merge computes."""

    table: torch.Tensor
    list_rows: int
    inline: InlinePieces | None

    @property
    def segments(self) -> torch.Tensor:
        """The table's segments (its rows before the page lists)."""
        return self.table[:self.table.shape[0] - self.list_rows]

    def launch_requests(self, page_size: int) -> list[LaunchRequest]:
        """The table as launch requests (rows numbered across the batch), their page lists read."""
        lists = self.table[self.segments.shape[0]:].flatten().tolist()
        return [LaunchRequest.from_segment(seg, page_size, lists) for seg in self.segments.tolist()]


def segment_table(spec: VariantSpec, form: IntervalForm, qo_indptr: list[int], kv_lens: list[int], page_size: int,
                  args: dict[str, Any], device: torch.device, rules: TableRules) -> SegmentTable:
    """The segment table of a batch (``qo_indptr`` from 0) under ``rules``, its row rules evaluated
    on ``device``."""
    rows = row_terms(spec, form, qo_indptr, kv_lens, args, device)
    iv = fold_terms(rows.bounds, rows.env["kv_len"])
    if rules.split:
        pieces = pieces_of_terms(rows.bounds, rules.max_pieces)
        table = piece_table(rows.env, iv, pieces, page_size, rules.split, rules.window_launches, rules.packed)
    else:
        table = segments(classify_intervals(rows.env, iv, page_size), page_size)
    inline = None
    if rules.split == "pieces" and rules.inline_keys > 0:
        found = inline_first_pieces(table, rules.inline_keys, rules.window_launches)
        if found is not None:
            table, inline = found
    list_rows = 0
    if rules.lists:
        table, list_rows = list_pages(table, spec, rows, page_size, args)
    return SegmentTable(table, list_rows, inline)
