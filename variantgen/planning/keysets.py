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

Runs whose pages are all live keep their hull (no list). Not in CUDA-graph mode (the tables are
sized per batch; the fixed slots would need a capacity for them): there such rows run over their
hull, as before.
"""

from __future__ import annotations

from typing import Any

import torch

from ..abi.table import SEG_FIELDS, RowClass, SegField
from ..lang.evaluate import Evaluator
from ..lang.values import VariantSpec
from .intervals import IntervalForm, decided_terms
from .rowrules import RowTerms, rows_of_segments


def has_key_sets(form: IntervalForm, spec: VariantSpec, args: dict[str, Any]) -> bool:
    """Whether some term of this spec (for these scalar values) shows its rows a key set."""
    return form.planner_ready and any(t.key_set for t in decided_terms(form, spec, args))


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
    if not any(t.key_set for t in terms) or not bool(custom.any()):
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
    for t, lo, hi, ok in zip(terms, bounds.lo, bounds.hi, bounds.ok):
        r_lo, r_hi = run_span(lo, hi, ok)
        a, b = torch.maximum(p_lo, r_lo[cand_run]), torch.minimum(p_hi, r_hi[cand_run])  # its keys on the page
        meets = a <= b
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

