"""The interval planner: split query rows into launch requests by the shape of their key
interval, so the kernel evaluates the mask only where the answer is not known.

Per row (intervals.row_intervals, computed on the device from the same tensors the mask
reads) each row is classified:

  dense   every key of [lo, hi] is visible, lo page-aligned      -> MaskMode::kNone
  causal  keys [lo, q_pos], lo fixed and page-aligned           -> MaskMode::kCausal
  window  keys [q_pos - w, q_pos], w fixed                       -> kCausal + kernel window w
  custom  anything else (not exact, several intervals, unaligned) -> kCustom over the hull

Consecutive rows of a request with the same class and parameters form one launch
request (custom ones capped at CUSTOM_ROWS rows, to keep hulls tight), with its own page
list trimmed to the interval. In kNone/kCausal launches the kernel still calls the
generated mask on its boundary tiles (diagonal, window edge), so partial tiles stay exact;
interior tiles are known to be fully visible. Rows are partitioned: every output row is
written by exactly one launch, in place, so nothing is gathered, scattered or merged.
Metadata is O(segments); the only host sync is reading the segment boundaries back.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from .intervals import IntervalForm, row_intervals, usable_form

if TYPE_CHECKING:
    from .spec import VariantSpec
    from .staging import HostStaging
    from .wrapper import VariantWrapper

DENSE, CAUSAL, WINDOW, CUSTOM = 0, 1, 2, 3
CLASS_MODE = {DENSE: "none", CAUSAL: "causal", WINDOW: "causal", CUSTOM: "custom"}
CUSTOM_ROWS = 128


def row_env(qo_indptr: list[int], kv_lens: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The builtins of every query row of a batch (int64 [total_q] each; rows from qo_indptr[0]),
    as intervals.row_intervals reads them, plus ``vg_kv_lens`` (the requests' kv lengths)."""
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


def classify_rows(spec: VariantSpec, form: IntervalForm, qo_indptr: list[int], kv_lens: list[int], page_size: int,
                  args: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The row pass in torch ops (any device): int64 [7, total_q], per query row (fields in
    rowplan.REC_FIELDS order) whether it starts a launch request, its request, class, class
    parameter, interval [lo, hi] (on a custom run's first row: the run's hull) and q_pos.
    rowplan's generated kernel computes the same."""
    dev, ps, i64 = device, page_size, torch.int64
    total_q = qo_indptr[-1]
    env = row_env(qo_indptr, kv_lens, dev)
    request, q_idx, q_pos = env["request"], env["q_idx"], env["q_pos"]
    iv = row_intervals(form, spec, env, args)
    lo, hi = iv.lo, iv.hi

    # Classify each row.
    causal_end = iv.exact & (hi == q_pos)
    aligned = lo % ps == 0
    prev_lo = torch.cat([lo[:1] - 1, lo[:-1]])
    next_lo = torch.cat([lo[1:], lo[-1:] - 1])
    same_req_prev = torch.cat([torch.zeros(1, dtype=torch.bool, device=dev), request[1:] == request[:-1]])
    same_req_next = torch.cat([request[1:] == request[:-1], torch.zeros(1, dtype=torch.bool, device=dev)])
    fixed_lo = ((lo == prev_lo) & same_req_prev) | ((lo == next_lo) & same_req_next)
    # A window class needs the same width on neighbouring rows; otherwise every row would be
    # its own launch request (e.g. a fixed but unaligned start: those go to custom chunks).
    width = q_pos - lo
    fixed_width = (((width == torch.cat([width[:1] - 1, width[:-1]])) & same_req_prev)
                   | ((width == torch.cat([width[1:], width[-1:] - 1])) & same_req_next))
    cls = torch.full_like(lo, CUSTOM)
    cls = torch.where(causal_end & fixed_width, torch.full_like(lo, WINDOW), cls)
    cls = torch.where(causal_end & aligned & (fixed_lo | (lo == 0)), torch.full_like(lo, CAUSAL), cls)
    # Dense rows must share [lo, hi] with a neighbour for the same reason (e.g. `kv_pos < q_pos`
    # moves hi every row: custom chunks, not one launch request per row).
    prev_hi = torch.cat([hi[:1] - 1, hi[:-1]])
    next_hi = torch.cat([hi[1:], hi[-1:] - 1])
    fixed_span = (((lo == prev_lo) & (hi == prev_hi) & same_req_prev)
                  | ((lo == next_lo) & (hi == next_hi) & same_req_next))
    cls = torch.where(iv.exact & ~causal_end & aligned & fixed_span, torch.full_like(lo, DENSE), cls)
    # Parameters that must stay fixed within a launch request.
    param_a = torch.where(cls == WINDOW, q_pos - lo, lo)
    param_b = torch.where(cls == DENSE, hi, torch.zeros_like(hi))
    chunk = torch.where(cls == CUSTOM, q_idx // CUSTOM_ROWS, torch.zeros_like(q_idx))
    param_a = torch.where(cls == CUSTOM, chunk, param_a)
    key = torch.stack([request, cls, param_a, param_b], 1)
    starts = torch.ones(total_q, dtype=i64, device=dev)
    starts[1:] = (key[1:] != key[:-1]).any(1)
    # A custom launch request reads the hull of its rows: put it on the run's first row.
    seg_id = torch.cumsum(starts, 0) - 1
    nseg = int(seg_id[-1]) + 1 if total_q else 0
    seg_lo = torch.full((nseg,), 1 << 40, dtype=i64, device=dev).scatter_reduce(0, seg_id, lo, "amin")
    seg_hi = torch.full((nseg,), -1, dtype=i64, device=dev).scatter_reduce(0, seg_id, hi, "amax")
    custom_start = (starts == 1) & (cls == CUSTOM)
    lo = torch.where(custom_start, seg_lo[seg_id], lo)
    hi = torch.where(custom_start, seg_hi[seg_id], hi)
    return torch.stack([starts, request, cls, param_a, lo, hi, q_pos])


def _segments(rec: torch.Tensor, total_q: int) -> torch.Tensor:
    """The launch requests of the row pass, on the host: int64 [n, 9], per run of rows with one
    key [first row, end row, request, class, param_a, lo, hi, first q_pos, last q_pos] (lo/hi:
    the first row's interval, the hull for custom runs). The planner's one device-to-host sync."""
    seg_start = rec[0].nonzero().squeeze(1)
    seg_end = torch.cat([seg_start[1:], seg_start.new_full((1,), total_q)])
    table = torch.cat([seg_start[None], seg_end[None], rec[1:, seg_start], rec[6:, seg_end - 1]])
    return table.t().contiguous().cpu()


def row_segments(w: VariantWrapper, qo_h: list[int], kv_lens: list[int], args: dict[str, Any]) -> torch.Tensor:
    """The row pass over a batch, compacted on the host (_segments' table): by the spec's
    generated row kernel where the wrapper has one, else by the torch rules."""
    spec, b, dev = w.spec, w._batch, w.device
    assert b is not None
    form = usable_form(spec, args)
    kernel = w.row_planner
    if kernel is None:
        w.plan_stats["row_planner"] = "torch" + (f" ({w.row_planner_reason})" if w.row_planner_reason else "")
        return _segments(classify_rows(spec, form, qo_h, kv_lens, b.page_size, args, dev), b.total_q)
    from .rowplan import plan_rows, read_segments

    rows = plan_rows(kernel, spec, form, args, qo_h, kv_lens, b.page_size, dev, w._staging,
                     segment_capacity=w.segment_capacity, buffers=w.row_buffers)
    host = read_segments(kernel, rows, expect=w.segment_read)
    # room for twice this batch's launch requests next time (one pass, not two), and a first
    # read-back of that many (not the whole buffer)
    w.segment_capacity = max(w.segment_capacity, 1 << (2 * len(host)).bit_length())
    w.segment_read = max(64, 2 * len(host))
    w.plan_stats["row_planner"] = "kernel"
    return host


def plan_launches(w: VariantWrapper, qo_h: list[int], kvp_h: list[int], kv_lens: list[int],
                  args: dict[str, Any]) -> list[dict]:
    """The interval plan of a batch as launches (host lists; pages as ranges of the caller's
    page list). ``qo_h``/``kvp_h``: host copies of qo_indptr and paged_kv_indptr."""
    return launches_from_segments(w, row_segments(w, qo_h, kv_lens, args).tolist(), kvp_h, kv_lens)


def launches_from_segments(w: VariantWrapper, host: list[list[int]], kvp_h: list[int], kv_lens: list[int],
                           ) -> list[dict]:
    """The launches of row_segments' table (as lists): launch requests grouped by mask mode.
    The planner module does the same in C++ (plan_batch, native_plan.py)."""
    b = w._batch
    assert b is not None
    ps = b.page_size
    kv_row_base_h = list(accumulate(kv_lens, initial=0))
    by_mode: dict[str, dict[str, list]] = {}
    stats = {"dense": 0, "causal": 0, "window": 0, "custom": 0, "custom_rows": 0}
    for r0, r1, req, c, pa, slo, shi, q_first, q_last in host:
        if c == DENSE:
            page0, kv_end, window = slo // ps, shi + 1, -1
        elif c == CAUSAL:
            page0, kv_end, window = pa // ps, q_last + 1, -1
        elif c == WINDOW:
            page0, kv_end, window = max(q_first - pa, 0) // ps, q_last + 1, pa
        else:
            page0, kv_end, window = slo // ps, shi + 1, -1
            stats["custom_rows"] += r1 - r0
        stats[["dense", "causal", "window", "custom"][c]] += 1
        kv_pos_base = page0 * ps
        n_pages = -(-(kv_end - kv_pos_base) // ps)
        launch_kv_len = kv_end - kv_pos_base
        mode = CLASS_MODE[c]
        d = by_mode.setdefault(mode, {"q_starts": [], "plan_qo": [0], "kv_indptr": [0], "page_ranges": [],
                                      "last_page_len": [], "meta": []})
        d["q_starts"].append(r0)
        d["plan_qo"].append(d["plan_qo"][-1] + (r1 - r0))
        d["kv_indptr"].append(d["kv_indptr"][-1] + n_pages)
        d["page_ranges"].append((kvp_h[req] + page0, n_pages))
        d["last_page_len"].append(launch_kv_len - (n_pages - 1) * ps)
        d["meta"].append([r0, q_first, kv_pos_base, req, kv_row_base_h[req], b.qo_lens[req], kv_lens[req],
                          window, r1 - r0])
    w.plan_stats["segments"] = stats
    launches = []
    for mode in ("custom", "causal", "none"):
        if mode not in by_mode:
            continue
        d = by_mode[mode]
        d["q_starts"].append(b.total_q)
        # page_ranges: (first, count) in the caller's page list per launch request; the wrapper
        # gathers every launch's pages in one go.
        launches.append(dict(mask_mode=mode, q_starts=d["q_starts"], plan_qo=d["plan_qo"],
                             kv_indptr=d["kv_indptr"], page_ranges=d["page_ranges"],
                             last_page_len=d["last_page_len"], meta=d["meta"],
                             packed=d["q_starts"] == d["plan_qo"]))
    return launches


def page_gather_table(ranges: list[tuple[int, int]]) -> tuple[list[int], int]:
    """For gather_pages: per non-empty (first, count) range its first entry in the output,
    then per range its shift into kv_indices ([starts..., shifts...]); and the total entries."""
    starts, shifts, total = [], [], 0
    for first, count in ranges:
        if count:
            starts.append(total)
            shifts.append(first - total)
            total += count
    return starts + shifts, total


def gather_pages(kv_indices: torch.Tensor, table: torch.Tensor, total: int, device: torch.device,
                 kernel: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 page list on ``device``: the ranges of ``table`` (page_gather_table's, int32
    [2, ranges] on the device) back to back - with the planner module's gather kernel
    (``kernel``), or a search + index in torch ops (no repeat_interleave, which syncs here).
    ``out``: int32 [total] on ``device`` to write it to (default: a new tensor)."""
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=device)
    if total == 0:
        return out
    if kernel is not None and device.type == "cuda":
        kernel.gather_pages(kv_indices.to(device).contiguous(), table, out)
        return out
    # output entry k lies in range i = the last range starting at or before k
    table = table.to(torch.int64)
    k = torch.arange(total, device=device)
    i = torch.searchsorted(table[0], k, right=True) - 1
    return out.copy_(kv_indices.to(device)[k + table[1][i]])


def gather_page_ranges(kv_indices: torch.Tensor, ranges: list[tuple[int, int]], staging: HostStaging,
                       kernel: Any = None) -> torch.Tensor:
    """int32 page list on the staging device: for each (first, count) of ``ranges``,
    kv_indices[first : first + count], back to back; the table goes over in one staged copy
    (no sync)."""
    flat, total = page_gather_table(ranges)
    table = staging.to_device(flat, torch.int32).view(2, -1) if total else None
    return gather_pages(kv_indices, table, total, staging.device, kernel)


# ----------------------------------------------------------------------------- fa3
FA3_MAX_WINDOW_LAUNCHES = 4  # distinct window widths given their own launch; more go custom


def regroup_for_fa3(launches: list[dict]) -> list[dict]:
    """Reshape launches for the fa3 kernel, which takes its left window per launch (not per
    launch request): window rows get a causal launch per width (up to
    FA3_MAX_WINDOW_LAUNCHES widths; rows of other widths go to a custom launch)."""
    out: list[dict] = []
    for launch in launches:
        if launch["mask_mode"] != "causal":
            out.append(dict(launch, window_left=-1))
            continue
        widths = sorted({row[7] for row in launch["meta"]} - {-1})
        kept = set(widths[:FA3_MAX_WINDOW_LAUNCHES])
        groups: dict[tuple[str, int], list[int]] = {}
        for i, row in enumerate(launch["meta"]):
            w = row[7]
            key = ("causal", w) if w == -1 or w in kept else ("custom", -1)
            groups.setdefault(key, []).append(i)
        for (mode, window), idx in groups.items():
            out.append(dict(_select(launch, idx), mask_mode=mode, window_left=window))
    return out


def _select(launch: dict, idx: list[int]) -> dict:
    """The launch restricted to launch requests ``idx`` (in order), re-packed."""
    q_starts, plan_qo, kv_indptr = launch["q_starts"], launch["plan_qo"], launch["kv_indptr"]
    new_qo = list(accumulate((plan_qo[i + 1] - plan_qo[i] for i in idx), initial=0))
    new_kv = list(accumulate((kv_indptr[i + 1] - kv_indptr[i] for i in idx), initial=0))
    if "page_ranges" in launch:
        pages = {"page_ranges": [launch["page_ranges"][i] for i in idx]}
    else:  # the caller's page list (planner off): its ranges, by kv_indptr
        pages = {"page_ranges": [(kv_indptr[i], kv_indptr[i + 1] - kv_indptr[i]) for i in idx]}
    launch = {k: v for k, v in launch.items() if k != "kv_indices"}
    return dict(launch, **pages, q_starts=[q_starts[i] for i in idx] + [q_starts[-1]], plan_qo=new_qo,
                kv_indptr=new_kv, last_page_len=[launch["last_page_len"][i] for i in idx],
                meta=[launch["meta"][i] for i in idx], packed=False)
