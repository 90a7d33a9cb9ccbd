"""Sparse key sets as page lists: custom runs that read only the pages holding a key their rows see.

Some masks show a row keys that no interval bounds: Longformer / BigBird-style global tokens
(``is_global[kv_row] != 0``), the summary keys of fixed sparse attention (``kv_pos % block >=
block - c``). intervals.py keeps such an atom - one that reads the key but not the row - as the
term's *key set* (``Term.keys``): the term shows a row the keys of its bounds that are in the set,
the same set for every row of a request. The row pass still runs these rows custom over their
hull (the union of their terms' bounds, often the whole request); here each such custom run gets
a page list instead: the pages that hold a key some row of the run may see -

* for an exact or opaque term: every page of the union of its rows' bounds (the term's keys may
  be any of them);
* for a key-set term: the pages of that union that hold a key of the set (the set is evaluated
  once per key of the batch, its pages found by prefix sums);

in ascending order (SegField.PAGE_LIST_*; the launch builder lays the pages out and writes each
listed page's key position into a table after the launch's metadata, MetaColumn.PAGE_TABLE_AT,
which the generated variants' ``key_pos`` reads). The mask still runs on every key read but those
known visible to the whole run, so the output is the mask's whatever the list: the list only has
to hold every key a row sees, which the bounds guarantee. Block-sparse attention on the paged
cache, derived from the spec: no hand-written block mask.

A term may also read the key and the row in a way no interval bounds (BigBird's random blocks,
``bit(random_blocks[q_pos // block], kv_pos // block)``). Where its atoms read the row only by
blocks (``q_pos // D``, one divisor D of scalars), every row of a block sees the same keys there,
so the term's pages are found by evaluating its atoms once per (row block, key block) of each
candidate (run, page) - a handful per pair, where evaluating every element would be the mask
itself (row_blocks). Atoms that read the row by position (``(q_pos - kv_pos) % stride == 0``)
show a 128-row run nearly every page: such terms keep their pages (every page of their bounds),
and so does a term whose blocks would take more than BLOCK_EVALUATIONS evaluations.

Runs whose pages are all live keep their hull (no list). Not in CUDA-graph mode (the tables are
sized per batch; the fixed slots would need a capacity for them): there such rows run over their
hull, as before.
"""

from __future__ import annotations

from typing import Any

import torch

from ..abi.table import SEG_FIELDS, RowClass, SegField
from ..lang.evaluate import Evaluator
from ..lang.reads import KEY_NAMES, ROW_NAMES, Blocks, reads
from ..lang.values import VariantSpec
from .intervals import IntervalForm, Term, decided_terms
from .rowrules import RowTerms, rows_of_segments

# A term's atoms evaluated at most this many times per table (per (row block, key block) of its
# candidate pages); beyond it the term keeps every page of its bounds. Bounds the host memory of
# the evaluation (about ten int64 tensors of this length, in slices of EVALUATION_SLICE).
BLOCK_EVALUATIONS = 1 << 23
EVALUATION_SLICE = 1 << 20


def has_key_sets(form: IntervalForm, spec: VariantSpec, args: dict[str, Any]) -> bool:
    """Whether some term of this spec (for these scalar values) shows its rows a key set, or keys
    its atoms pick per block of rows (row_blocks)."""
    return form.planner_ready and any(t.key_set or t.row_blocked for t in decided_terms(form, spec, args))


def row_blocks(term: Term) -> tuple[Blocks | None, Blocks | None] | None:
    """For a term whose atoms read the row only by blocks (``Term.row_blocked``): how its atoms
    read the row and the key (_block_pages evaluates them per block pair). None for any other
    term (exact, a key set, or the row read by position)."""
    if not term.row_blocked:
        return None
    atoms = term.pairs + term.keys
    return reads(atoms, ROW_NAMES), reads(atoms, KEY_NAMES)


def _key_env(kv_lens: list[int], qo_lens: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The builtins a key-set atom may read, for every key of the batch (int64 [total_kv] each)."""
    i64 = torch.int64
    kv = torch.tensor(kv_lens, dtype=i64, device=device)
    request = torch.repeat_interleave(torch.arange(len(kv_lens), device=device), kv)
    kv_row = torch.arange(int(kv.sum()), dtype=i64, device=device)
    kv_pos = kv_row - (torch.cumsum(kv, 0) - kv)[request]
    qo = torch.tensor(qo_lens, dtype=i64, device=device)
    return {"kv_pos": kv_pos, "kv_row": kv_row, "request": request, "kv_len": kv[request], "qo_len": qo[request]}


def list_pages(table: torch.Tensor, spec: VariantSpec, rows: RowTerms, page_size: int,
               args: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """``table`` (host int64 [n, SEG_FIELDS], read_segments' order) with page lists for its custom
    runs in place without gaps whose rows' terms (``rows``: the batch's rows and term bounds)
    leave pages of their hull without a visible key: the table with the lists' rows appended, and
    how many rows that is (PlanOption.LIST_ROWS)."""
    terms, bounds, kv_lens, qo_indptr = rows.terms, rows.bounds, rows.kv_lens, rows.qo_indptr
    device = rows.env["q_pos"].device
    seg = table
    custom = ((seg[:, SegField.CLASS] == RowClass.CUSTOM) & (seg[:, SegField.PIECE] == -1)
              & (seg[:, SegField.GAP_TO_1] == 0) & (seg[:, SegField.KV_END] > seg[:, SegField.KV_BEGIN]))
    blocks = [row_blocks(t) for t in terms]
    if not any(t.key_set or b is not None for t, b in zip(terms, blocks)) or not bool(custom.any()):
        return table, 0
    runs = custom.nonzero().squeeze(1)
    which, run_rows = rows_of_segments(seg[runs])  # (rows of the batch, from qo_indptr[0] = 0)
    rows_d, which_d = run_rows.to(device), which.to(device)
    n_runs = runs.numel()

    # Per run and term: the union of its rows' bounds, [lo, hi] (empty: lo > hi).
    def run_span(lo: torch.Tensor, hi: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        big = torch.iinfo(torch.int64).max
        lo_r = torch.full((n_runs,), big, dtype=torch.int64, device=device)
        hi_r = torch.full((n_runs,), -big, dtype=torch.int64, device=device)
        on = ok[rows_d]
        lo_r.scatter_reduce_(0, which_d, torch.where(on, lo[rows_d], big), "amin")
        hi_r.scatter_reduce_(0, which_d, torch.where(on, hi[rows_d], -big), "amax")
        return lo_r.cpu(), hi_r.cpu()

    # Every candidate (run, page): the pages of each run's hull.
    ps = page_size
    first_page = seg[runs, SegField.KV_BEGIN] // ps
    n_pages = -(-seg[runs, SegField.KV_END] // ps) - first_page
    cand_run = torch.repeat_interleave(torch.arange(n_runs), n_pages)
    page = first_page[cand_run] + torch.arange(int(n_pages.sum())) - (torch.cumsum(n_pages, 0) - n_pages)[cand_run]
    request = seg[runs, SegField.REQUEST][cand_run]
    kv_len = torch.tensor(kv_lens, dtype=torch.int64)[request]
    p_lo, p_hi = page * ps, torch.minimum(page * ps + ps, kv_len) - 1  # the page's keys (request-local)
    live = torch.zeros(page.numel(), dtype=torch.bool)
    key_env = None
    key_start = torch.cumsum(torch.tensor([0] + list(kv_lens), dtype=torch.int64), 0)
    for t, by, lo, hi, ok in zip(terms, blocks, bounds.lo, bounds.hi, bounds.ok):
        r_lo, r_hi = run_span(lo, hi, ok)
        a, b = torch.maximum(p_lo, r_lo[cand_run]), torch.minimum(p_hi, r_hi[cand_run])  # its keys on the page
        meets = a <= b
        if by is not None:
            first_row = seg[runs, SegField.FIRST_ROW][cand_run]
            rows_of = seg[runs, SegField.END_ROW][cand_run] - first_row
            seen = _block_pages(t, by, spec, args, rows.env, meets, first_row, rows_of, a, b, key_start[request])
            live |= meets if seen is None else meets & seen
            continue
        if not t.key_set:
            live |= meets
            continue
        if key_env is None:
            qo_lens = [qo_indptr[i + 1] - qo_indptr[i] for i in range(len(kv_lens))]
            key_env = _key_env(kv_lens, qo_lens, device)
        ev = Evaluator(spec, key_env, args)
        in_set = torch.ones(key_env["kv_pos"].shape[0], dtype=torch.bool, device=device)
        for k in t.keys:
            in_set &= ev.ev(k).to(torch.bool).expand_as(in_set)
        count = torch.cat([torch.zeros(1, dtype=torch.int64), in_set.cpu().long().cumsum(0)])
        base, last = key_start[request], count.numel() - 1
        # (where the page meets none of the term's keys - a run none of whose rows it shows a key
        # has an unbounded span - a and b are anything: clamped into the prefix sums, not used)
        held = count[(base + b.clamp(-1, last) + 1).clamp(0, last)] - count[(base + a.clamp(0, last)).clamp(0, last)]
        live |= meets & (held > 0)
    # A run keeps its hull where every page is live (nothing to skip) or none is (its rows see no
    # key: the builder needs a page to lay out, and the mask hides them all).
    live_count = torch.zeros(n_runs, dtype=torch.int64).index_add_(0, cand_run, live.long())
    listed = (live_count > 0) & (live_count < n_pages)
    if not bool(listed.any()):
        return table, 0
    keep = live & listed[cand_run]
    pages = page[keep]
    lengths = live_count * listed
    at = torch.cumsum(lengths, 0) - lengths
    out = table.clone()
    out[runs, SegField.PAGE_LIST_AT] = torch.where(listed, at, 0)
    out[runs, SegField.PAGE_LIST_LEN] = lengths
    n_rows = -(-pages.numel() // SEG_FIELDS)
    lists = torch.zeros(n_rows * SEG_FIELDS, dtype=torch.int64)
    lists[:pages.numel()] = pages
    return torch.cat([out, lists.view(n_rows, SEG_FIELDS)]), n_rows



def _blocks_met(first: torch.Tensor, count: torch.Tensor, divisor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of ``count`` consecutive values from ``first`` (int64 each): how many blocks of
    ``divisor`` values (value // divisor) each meets, and the first of them."""
    start = torch.div(first, divisor, rounding_mode="floor")
    return torch.div(first + count - 1, divisor, rounding_mode="floor") - start + 1, start


def _block_pages(term: Term, by: tuple[Blocks | None, Blocks | None], spec: VariantSpec, args: dict[str, Any],
                 env: dict[str, torch.Tensor], meets: torch.Tensor, first_row: torch.Tensor, rows: torch.Tensor,
                 key_lo: torch.Tensor, key_hi: torch.Tensor, key_base: torch.Tensor) -> torch.Tensor | None:
    """Per candidate (run, page) (host int64 each: the run's first batch row and row count, the
    page's keys [key_lo, key_hi] the term's bounds leave, request-local, and the request's first
    key row): whether the term's atoms hold for some (row block, key block) of it - one row and
    one key of each block pair evaluated, every row of a block reading the same values. Only
    candidates that ``meets`` are evaluated. None where that would take more than BLOCK_EVALUATIONS."""
    row_by, key_by = by
    ev_args = Evaluator(spec, {"kv_pos": torch.zeros(1, dtype=torch.int64)}, args)

    def divisor(side: Blocks | None) -> int:
        if side is None or side.divisor is None:
            return 1
        value = int(ev_args.ev(side.divisor).reshape(-1)[0])
        return value if value > 0 else 1  # (floor division by <= 0: read by position, which is exact)

    cand = meets.nonzero().squeeze(1)
    if cand.numel() == 0:
        return torch.zeros_like(meets)
    # the side's coordinate: the builtin read, for the run's first row and the page's first key
    row_name = row_by.name if row_by is not None else "q_pos"
    row_first = env[row_name].cpu()[first_row[cand]]
    key_name = key_by.name if key_by is not None else "kv_pos"
    k_lo, k_hi = key_lo[cand], key_hi[cand]
    key_first = k_lo + (key_base[cand] if key_name == "kv_row" else 0)
    # (a side the atoms do not read: one block, the first value)
    d_row, d_key = divisor(row_by), divisor(key_by)
    n_row, row_block = _blocks_met(row_first, rows[cand], d_row) if row_by else (torch.ones_like(cand), row_first)
    n_key, key_block = (_blocks_met(key_first, k_hi - k_lo + 1, d_key) if key_by
                        else (torch.ones_like(cand), key_first))
    per = n_row * n_key
    total = int(per.sum())
    if total > BLOCK_EVALUATIONS:
        return None
    found = torch.zeros(cand.numel(), dtype=torch.int64)
    offsets = torch.cumsum(per, 0) - per
    device = env["q_pos"].device
    atoms = term.pairs + term.keys
    first_row, key_base = first_row[cand], key_base[cand]
    for s in range(0, total, EVALUATION_SLICE):
        flat = torch.arange(s, min(total, s + EVALUATION_SLICE), dtype=torch.int64)
        c = torch.searchsorted(offsets, flat, right=True) - 1
        local = flat - offsets[c]
        i, j = torch.div(local, n_key[c], rounding_mode="floor"), local % n_key[c]
        # the first value of block i (j), but not before the run's first row (the page's first key)
        row_off = torch.clamp((row_block[c] + i) * d_row - row_first[c], min=0)
        key_off = torch.clamp((key_block[c] + j) * d_key - key_first[c], min=0)
        row = (first_row[c] + row_off).to(device)
        kv_pos = (k_lo[c] + key_off).to(device)
        at = {name: env[name][row] for name in ("q_pos", "q_idx", "q_row", "q_kv_row", "request", "qo_len", "kv_len")}
        at["kv_pos"] = kv_pos
        at["kv_row"] = key_base[c].to(device) + kv_pos
        ev = Evaluator(spec, at, args)
        holds = torch.ones(flat.numel(), dtype=torch.bool, device=device)
        for atom in atoms:
            holds &= ev.ev(atom).to(torch.bool).expand_as(holds)
        found.index_add_(0, c, holds.cpu().long())
    out = torch.zeros_like(meets)
    out[cand] = found > 0
    return out
