"""The interval planner's row rules in torch ops: the reference for the row pass.

Per query row (intervals.row_intervals, from the same tensors the mask reads) each row is
classified by the shape of its key interval:

  dense   every key of [lo, hi] is visible, lo page-aligned      -> MaskMode::kNone
  causal  keys [lo, q_pos], lo fixed and page-aligned           -> MaskMode::kCausal
  window  keys [q_pos - w, q_pos], w fixed                       -> kCausal + kernel window w
  tail    keys [lo, q_pos], lo fixed and page-aligned, exact up to a fixed mask_from >= the
          request's first q_pos, in a request of at most TAIL_MAX_QO_LEN queries (a draft tree
          after its context)                              -> kCausal, the mask on the diagonal
  custom  anything else (not exact, several intervals, unaligned) -> kCustom over the hull

Consecutive rows of a request with the same class and parameters form one launch request (a
*segment*; custom ones capped at CUSTOM_ROWS rows, to keep hulls tight) that reads only the
pages of its keys. In kNone/kCausal launches the kernel still calls the generated mask on its
boundary tiles (diagonal, window edge), so partial tiles stay exact; interior tiles are known
to be fully visible. A tail run is exact in fa2's kCausal launch only while it is one query tile
(its diagonal tile then starts at or before mask_from): the launch builder checks that and
sends the others, and every tail run on fa3, to the custom launch. Rows are partitioned: every
output row is written by exactly one launch, in place, so nothing is gathered, scattered or
merged.

plan() never runs these: the spec's planner module does (its row kernel, rowplan.py, renders
the same rules for one spec's interval terms, on the GPU), and the launch builder lays its
segments out (templates/plan/launches.h). They are the reference that kernel is compared with
(tests/gpu/test_gpu_planner.py), what the CPU tests' stand-in planner module runs, and what
`variantgen explain` shows on a machine without a GPU - which is why they live in the package
rather than beside the tests.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..abi.table import CUSTOM_ROWS, NO_INTERVAL, SEG_FIELDS, TAIL_MAX_QO_LEN, RecField, RowClass, SegField
from ..lang.values import VariantSpec
from .intervals import IntervalForm, RowIntervals, Term, TermBounds, decided_terms, row_intervals, term_bounds

DENSE, CAUSAL, WINDOW, CUSTOM, TAIL = RowClass


def row_env(qo_indptr: list[int], kv_lens: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The builtins of every query row of a batch (int64 [total_q] each; rows from qo_indptr[0]),
    as intervals.row_intervals reads them, plus ``vg_kv_lens`` (the requests' kv lengths): what
    classify_rows and the flex route evaluate the spec's key intervals over."""
    dev, i64 = device, torch.int64
    batch = len(kv_lens)
    qo_lens = torch.tensor([qo_indptr[i + 1] - qo_indptr[i] for i in range(batch)], dtype=i64, device=dev)
    kv_len_req = torch.tensor(kv_lens, dtype=i64, device=dev)
    q_start = torch.tensor(qo_indptr[:-1], dtype=i64, device=dev)
    request = torch.repeat_interleave(torch.arange(batch, device=dev), qo_lens)
    rows = torch.arange(qo_indptr[0], qo_indptr[-1], device=dev, dtype=i64)
    q_idx = rows - q_start[request]
    kv_len = kv_len_req[request]
    q_pos = kv_len - qo_lens[request] + q_idx
    kv_row_base = torch.cumsum(kv_len_req, 0) - kv_len_req
    return {"q_pos": q_pos, "q_idx": q_idx, "q_row": rows, "q_kv_row": kv_row_base[request] + q_pos,
            "request": request, "qo_len": qo_lens[request], "kv_len": kv_len, "vg_kv_lens": kv_len_req}


class RowTerms(NamedTuple):
    """A batch's query rows (row_env) with the spec's decided terms evaluated over them: what the
    row rules, pieces.py and keysets.py read, evaluated once per table (assembly.py)."""

    qo_indptr: list[int]
    kv_lens: list[int]
    env: dict[str, torch.Tensor]
    terms: tuple[Term, ...]
    bounds: TermBounds


def row_terms(spec: VariantSpec, form: IntervalForm, qo_indptr: list[int], kv_lens: list[int], args: dict[str, Any],
              device: torch.device) -> RowTerms:
    """The rows of a batch and its spec's decided terms' bounds over them (``device``: any)."""
    env = row_env(qo_indptr, kv_lens, device)
    return RowTerms(list(qo_indptr), list(kv_lens), env, decided_terms(form, spec, args),
                    term_bounds(form, spec, env, args))


def classify_rows(spec: VariantSpec, form: IntervalForm, qo_indptr: list[int], kv_lens: list[int], page_size: int,
                  args: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The row pass in torch ops (any device): int64 [len(RecField), total_q], per query row
    (RecField order) whether it starts a launch request, its request, class, class parameter,
    interval [lo, hi] (on a custom run's first row: the run's hull), q_pos, the end of its dense
    prefix and (on a custom or tail run's first row) the keys every row of the run sees."""
    env = row_env(qo_indptr, kv_lens, device)
    return classify_intervals(env, row_intervals(form, spec, env, args), page_size)


def classify_intervals(env: dict[str, torch.Tensor], iv: RowIntervals, page_size: int,
                       run_key: torch.Tensor | None = None) -> torch.Tensor:
    """classify_rows' record for rows ``env`` (row_env) whose key intervals are ``iv``.
    ``run_key``: int64 [rows], rows with different values never share a launch request
    (pieces.py: rows written in place, a piece of rows that see several intervals, rows without
    that piece)."""
    ps, i64 = page_size, torch.int64
    request, q_idx, q_pos = env["request"], env["q_idx"], env["q_pos"]
    dev = q_pos.device
    total_q = q_pos.shape[0]
    lo, hi = iv.lo, iv.hi

    # Classify each row.
    causal_end = iv.exact & (hi == q_pos)
    aligned = lo % ps == 0
    same_req_prev = torch.cat([torch.zeros(1, dtype=torch.bool, device=dev), request[1:] == request[:-1]])
    same_req_next = torch.cat([request[1:] == request[:-1], torch.zeros(1, dtype=torch.bool, device=dev)])

    def fixed(value: torch.Tensor) -> torch.Tensor:  # the same value as a neighbour of its request
        return (((value == torch.cat([value[:1] - 1, value[:-1]])) & same_req_prev)
                | ((value == torch.cat([value[1:], value[-1:] - 1])) & same_req_next))

    prev_lo = torch.cat([lo[:1] - 1, lo[:-1]])
    next_lo = torch.cat([lo[1:], lo[-1:] - 1])
    fixed_lo = fixed(lo)
    # Rows whose keys end a fixed distance past their position (a bidirectional band, q_pos + b)
    # run in the kernel's causal and window modes too: a launch request's keys end at its last
    # row's hi, so the kernel's diagonal (kv_len - qo_len) is hi for each row, and no mask is
    # evaluated inside the band. The shift is a class parameter, like the window width; it must
    # be shared with a neighbour, as the width must (else a run per row).
    shift = hi - q_pos
    diagonal = iv.exact & ((shift == 0) | ((shift > 0) & fixed(shift)))
    # A window class needs the same width on neighbouring rows; otherwise every row would be
    # its own launch request (e.g. a fixed but unaligned start: those go to custom chunks).
    width = hi - lo
    cls = torch.full_like(lo, CUSTOM)
    cls = torch.where(diagonal & fixed(width), torch.full_like(lo, WINDOW), cls)
    cls = torch.where(diagonal & aligned & (fixed_lo | (lo == 0)), torch.full_like(lo, CAUSAL), cls)
    # Dense rows must share [lo, hi] with a neighbour for the same reason (e.g. `kv_pos < q_pos`
    # moves hi every row: custom chunks, not one launch request per row).
    prev_hi = torch.cat([hi[:1] - 1, hi[:-1]])
    next_hi = torch.cat([hi[1:], hi[-1:] - 1])
    fixed_span = (((lo == prev_lo) & (hi == prev_hi) & same_req_prev)
                  | ((lo == next_lo) & (hi == next_hi) & same_req_next))
    cls = torch.where(iv.exact & ~causal_end & aligned & fixed_span, torch.full_like(lo, DENSE), cls)
    # A hull that ends at q_pos with a dense prefix reaching the request's first query: only the
    # request's own keys need the mask (tree_verify's draft block after its context).
    mask_from = iv.dense_hi + 1
    qo_len = env["qo_len"]
    tail = (~iv.exact & (hi == q_pos) & aligned & (fixed_lo | (lo == 0)) & (mask_from > lo)
            & (mask_from >= env["kv_len"] - qo_len) & (qo_len <= TAIL_MAX_QO_LEN))
    cls = torch.where(tail, torch.full_like(lo, TAIL), cls)
    # Parameters that must stay fixed within a launch request.
    param_a = torch.where(cls == WINDOW, width, lo)
    geometric = (cls == CAUSAL) | (cls == WINDOW)
    param_b = torch.where(cls == DENSE, hi, torch.where(cls == TAIL, mask_from,
                                                        torch.where(geometric, shift, torch.zeros_like(hi))))
    chunk = torch.where(cls == CUSTOM, q_idx // CUSTOM_ROWS, torch.zeros_like(q_idx))
    param_a = torch.where(cls == CUSTOM, chunk, param_a)
    key = torch.stack([request, cls, param_a, param_b] + ([run_key] if run_key is not None else []), 1)
    starts = torch.ones(total_q, dtype=i64, device=dev)
    starts[1:] = (key[1:] != key[:-1]).any(1)
    # A custom launch request reads the hull of its rows: put it on the run's first row.
    seg_id = torch.cumsum(starts, 0) - 1
    nseg = int(seg_id[-1]) + 1 if total_q else 0
    seg_lo = torch.full((nseg,), NO_INTERVAL, dtype=i64, device=dev).scatter_reduce(0, seg_id, lo, "amin")
    seg_hi = torch.full((nseg,), -1, dtype=i64, device=dev).scatter_reduce(0, seg_id, hi, "amax")
    custom_start = (starts == 1) & (cls == CUSTOM)
    # Custom and tail runs: the keys every row of the run sees (the intersection of the rows'
    # dense [lo, dense_hi]), where the kernel need not evaluate the mask.
    vis_lo = torch.full((nseg,), -NO_INTERVAL, dtype=i64, device=dev).scatter_reduce(0, seg_id, lo, "amax")
    vis_hi = torch.full((nseg,), NO_INTERVAL, dtype=i64, device=dev).scatter_reduce(0, seg_id, iv.dense_hi, "amin")
    vis_lo, vis_hi = vis_lo[seg_id], vis_hi[seg_id]
    vis_run = (starts == 1) & ((cls == CUSTOM) | (cls == TAIL)) & (vis_lo <= vis_hi)
    vis_lo = torch.where(vis_run, vis_lo, torch.zeros_like(vis_lo))
    vis_hi = torch.where(vis_run, vis_hi, torch.full_like(vis_hi, -1))
    lo = torch.where(custom_start, seg_lo[seg_id], lo)
    hi = torch.where(custom_start, seg_hi[seg_id], hi)
    return torch.stack([starts, request, cls, param_a, lo, hi, q_pos, iv.dense_hi, vis_lo, vis_hi])


def segments(rec: torch.Tensor, page_size: int) -> torch.Tensor:
    """The launch requests of a row pass (classify_rows' rec), compacted: int64 [n, SEG_FIELDS]
    on the host, per run of rows with one key its rows, request, class, kernel window, the keys
    it reads [kv_begin, kv_end), its first q_pos and (custom and tail runs) the keys all its rows
    see - what the row kernel's segments pass writes.
    (The planner's one device-to-host copy.)"""
    total_q = rec.shape[1]
    if total_q == 0:
        return torch.empty(0, SEG_FIELDS, dtype=torch.int64)
    first = rec[RecField.STARTS].nonzero().squeeze(1)
    end = torch.cat([first[1:], first.new_full((1,), total_q)])
    cls, param = rec[RecField.CLASS, first], rec[RecField.PARAM_A, first]
    lo, hi, q_pos = rec[RecField.LO, first], rec[RecField.HI, first], rec[RecField.Q_POS, first]
    hi_last = rec[RecField.HI, end - 1]
    window_run = cls == WINDOW
    geometric = (cls == CAUSAL) | window_run | (cls == TAIL)  # keys up to the last row's hi (its diagonal)
    begin = torch.where(window_run, (hi - param).clamp(min=0), lo)
    out = torch.empty(len(SegField), first.numel(), dtype=torch.int64, device=rec.device)
    out[SegField.FIRST_ROW] = first
    out[SegField.END_ROW] = end
    out[SegField.REQUEST] = rec[RecField.REQUEST, first]
    out[SegField.CLASS] = cls
    out[SegField.WINDOW] = torch.where(window_run, param, torch.full_like(param, -1))
    out[SegField.KV_BEGIN] = torch.div(begin, page_size, rounding_mode="floor") * page_size
    out[SegField.KV_END] = torch.where(geometric, hi_last, hi) + 1
    out[SegField.Q_POS] = q_pos
    out[SegField.VIS_LO] = rec[RecField.VIS_LO, first]
    out[SegField.VIS_HI] = rec[RecField.VIS_HI, first]
    out[SegField.PIECE] = -1  # every row's output in place (pieces.py splits rows that see several intervals)
    out[SegField.GAP_FROM_1:] = 0  # every run's keys read whole (pieces.py may skip the gaps between intervals)
    return out.t().contiguous().cpu()


def rows_of_segments(seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row of the segments ``seg`` (host int64 [n, SEG_FIELDS]), segment by segment:
    (the index of its segment, the row)."""
    first, lengths = seg[:, SegField.FIRST_ROW], seg[:, SegField.END_ROW] - seg[:, SegField.FIRST_ROW]
    which = torch.repeat_interleave(torch.arange(seg.shape[0]), lengths)
    step = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths)[which]
    return which, first[which] + step
