"""The cost of a mask before a GPU: keys the planned launches read against keys the mask shows.

For a batch of requests (or one request, as ``variantgen explain`` takes it) this counts, per
query row,

* keys visible: the keys the mask shows the row. Where the planner's interval terms are exact
  (intervals.analyze) a row's visible keys are the union of its terms' intervals, counted by
  interval arithmetic; rows with a hull term (a key set the planner does not bound) evaluate the
  mask element by element inside their hull, a block of rows at a time - so a 65536-token
  request costs about its hull area, never a dense grid;
* keys read: what the launch requests of the plan let the kernel see (plan.LaunchRequest.visited:
  a causal or window run's triangle, a dense or custom run's rectangle of keys). They come from
  the planner's own rules: rowrules.classify_rows and segments, the torch reference of the row
  kernel the GPU runs, laid out as plan.LaunchRequest.from_segment lays out fa2's launches; or,
  for a Plan made by plan(), from its launch requests. With the planner off, every row reads every
  key of its request.

Both are reported per launch class (dense, causal, window, custom, tail) and in total; their ratio
is the planned work per visible key (1.0: no key read that the mask hides).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..abi.table import RowClass
from ..lang.evaluate import Evaluator
from ..lang.values import VariantSpec
from .intervals import IntervalForm, analyze, decided_terms, row_intervals
from .plan import LaunchRequest

BLOCK_ELEMENTS = 1 << 22  # query-key pairs evaluated at once where the mask is counted element by element
OFF = "off"  # the class of every row with the planner off: one custom launch per request


@dataclass(frozen=True)
class ClassCost:
    launch_requests: int = 0
    rows: int = 0
    keys_read: int = 0
    keys_visible: int = 0


@dataclass(frozen=True)
class Cost:
    keys_read: int
    keys_visible: int
    rows: int
    keys_total: int  # every (query, key) pair of the requests
    planner: str  # "module" (the interval planner) or "off"
    reason: str = ""  # why the planner is off
    by_class: dict[str, ClassCost] = field(default_factory=dict)
    hull_rows: int = 0  # rows whose visible keys were counted element by element

    @property
    def ratio(self) -> float:
        """Keys read per visible key (1.0 at best); inf where nothing is visible but keys are read."""
        if self.keys_visible:
            return self.keys_read / self.keys_visible
        return 1.0 if not self.keys_read else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {"keys_read": self.keys_read, "keys_visible": self.keys_visible,
                "read_per_visible": round(self.ratio, 4) if self.ratio != float("inf") else None,
                "keys_total": self.keys_total, "rows": self.rows, "planner": self.planner,
                **({"planner_off": self.reason} if self.planner == OFF else {}),
                "by_class": {k: vars(v) for k, v in self.by_class.items()}}


# ----------------------------------------------------------------------------- keys visible


def _env(qo_lens: Sequence[int], kv_lens: Sequence[int]) -> dict[str, torch.Tensor]:
    from .rowrules import row_env

    starts = [0]
    for n in qo_lens:
        starts.append(starts[-1] + n)
    return row_env(starts, list(kv_lens), torch.device("cpu"))


def _union_count(lo: torch.Tensor, hi: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Per row, keys in the union of intervals [lo[:, t], hi[:, t]] where live[:, t]."""
    big = torch.iinfo(torch.int64).max // 4
    lo = torch.where(live, lo, torch.full_like(lo, big))
    hi = torch.where(live, hi, torch.full_like(hi, -big))
    order = lo.argsort(1)
    lo, hi = lo.gather(1, order), hi.gather(1, order)
    reach = torch.full_like(lo[:, 0], -big)
    total = torch.zeros_like(reach)
    for t in range(lo.shape[1]):  # sweep in order of first key: count what extends the reach
        start = torch.maximum(lo[:, t], reach + 1)
        total += (hi[:, t] - start + 1).clamp(min=0)
        reach = torch.maximum(reach, hi[:, t])
    return total


def visible_keys(spec: VariantSpec, args: Mapping[str, Any], qo_lens: Sequence[int], kv_lens: Sequence[int],
                 ) -> tuple[torch.Tensor, int]:
    """Per query row of the batch (int64 [total_q]) the keys its mask shows (query head 0 where the
    mask reads the head), and how many rows were counted element by element."""
    env = _env(qo_lens, kv_lens)
    kv_len = env["kv_len"]
    n = kv_len.shape[0]
    form = analyze(spec)
    need = torch.ones(n, dtype=torch.bool)
    count = torch.zeros(n, dtype=torch.int64)
    lo, hi = torch.zeros(n, dtype=torch.int64), kv_len - 1
    if form.planner_ready and n:
        terms = decided_terms(form, spec, args)
        if not terms:
            return count, 0
        los, his, lives, sure = [], [], [], torch.ones(n, dtype=torch.bool)
        for t in terms:  # one term at a time: row_intervals gives its interval, exact or a hull
            iv = row_intervals(IntervalForm((t,), True), spec, env, args)
            live = ~iv.empty
            los.append(iv.lo)
            his.append(iv.hi)
            lives.append(live)
            sure &= iv.exact | iv.empty
        lo_t, hi_t, live_t = torch.stack(los, 1), torch.stack(his, 1), torch.stack(lives, 1)
        count = torch.where(sure, _union_count(lo_t, hi_t, live_t), count)
        need = ~sure
        # the hull of the terms a row may see: the element count stays inside it
        lo = torch.where(live_t, lo_t, torch.full_like(lo_t, 1 << 40)).amin(1).clamp(min=0)
        hi = torch.minimum(torch.where(live_t, hi_t, torch.full_like(hi_t, -1)).amax(1), kv_len - 1)
    rows = need.nonzero().squeeze(1)
    if rows.numel():
        count[rows] = _count_elementwise(spec, args, env, rows, lo[rows], hi[rows])
    return count, int(rows.numel())


def _count_elementwise(spec: VariantSpec, args: Mapping[str, Any], env: Mapping[str, torch.Tensor],
                       rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The mask evaluated on keys [lo, hi] of each of ``rows``, a block of rows at a time."""
    out = torch.zeros(rows.numel(), dtype=torch.int64)
    kv_base = env["q_kv_row"] - env["q_pos"]  # the request's first key row
    heads = {"qo_head": torch.zeros((), dtype=torch.int64), "kv_head": torch.zeros((), dtype=torch.int64)}
    width = (hi - lo + 1).clamp(min=0)
    i = 0
    while i < rows.numel():
        w = max(int(width[i]), 1)
        j = min(rows.numel(), i + max(1, BLOCK_ELEMENTS // w))
        span = int((hi[i:j].max() - lo[i:j].min() + 1).clamp(min=1))
        while j - i > 1 and (j - i) * span > 2 * BLOCK_ELEMENTS:  # rows with much wider hulls: fewer at once
            j = i + (j - i) // 2
            span = int((hi[i:j].max() - lo[i:j].min() + 1).clamp(min=1))
        r = rows[i:j]
        k0 = lo[i:j].min()
        kv_pos = k0 + torch.arange(span, dtype=torch.int64).view(1, -1)
        block = {name: env[name][r].view(-1, 1) for name in ("q_pos", "q_idx", "q_row", "q_kv_row", "request",
                                                            "qo_len", "kv_len")}
        block["kv_pos"] = kv_pos
        block["kv_row"] = kv_base[r].view(-1, 1) + kv_pos
        m = Evaluator(spec, block | heads, args).ev(spec.mask).to(torch.bool)
        inside = (kv_pos >= lo[i:j].view(-1, 1)) & (kv_pos <= hi[i:j].view(-1, 1))
        out[i:j] = (m & inside).sum(1)
        i = j
    return out


# ----------------------------------------------------------------------------- keys read


def planned_requests(spec: VariantSpec, args: Mapping[str, Any], qo_lens: Sequence[int], kv_lens: Sequence[int],
                     page_size: int) -> tuple[list[LaunchRequest], str]:
    """The launch requests the planner makes for the batch, on the CPU (rowrules: the row kernel's
    reference), and why the planner is off ("" when on: then the list is empty)."""
    from .assembly import TableRules, segment_table

    form = analyze(spec)
    if not form.planner_ready:
        return [], form.reason
    missing = sorted(set(form.names) & {t.name for t in spec.tensors} - set(args))
    if missing:
        raise ValueError(f"the key intervals of `{spec.name}` read {', '.join(missing)}: pass them")
    starts = [0]
    for n in qo_lens:
        starts.append(starts[-1] + n)
    # plan()'s eager fa2 table: rows of several intervals split into pieces, key-set runs listed
    rules = TableRules.of(form, spec, dict(args))
    found = segment_table(spec, form, starts, list(kv_lens), page_size, dict(args), torch.device("cpu"), rules)
    return found.launch_requests(page_size), ""


def cost_of(requests: Sequence[LaunchRequest], visible: torch.Tensor, qo_lens: Sequence[int],
            kv_lens: Sequence[int], *, reason: str = "", hull_rows: int = 0, planner_on: bool = True) -> Cost:
    """Keys read by ``requests`` (rows numbered across the batch) against ``visible`` (per row)."""
    total = sum(q * k for q, k in zip(qo_lens, kv_lens))
    rows = int(visible.numel())
    if not planner_on:
        read = total
        return Cost(read, int(visible.sum()), rows, total, OFF, reason,
                    {OFF: ClassCost(len(qo_lens), rows, read, int(visible.sum()))}, hull_rows)
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), visible.cumsum(0)])
    by: dict[str, ClassCost] = {}
    for r in requests:
        c = by.get(r.cls.label, ClassCost())
        # a row split into pieces counts once (its rows, its visible keys), with its first piece
        first = r.piece <= 0
        vis = int(prefix[r.rows[1]] - prefix[r.rows[0]]) if first else 0
        own_rows = r.rows[1] - r.rows[0] if first else 0
        by[r.cls.label] = ClassCost(c.launch_requests + 1, c.rows + own_rows, c.keys_read + r.visited(),
                                    c.keys_visible + vis)
    order = [c.label for c in RowClass]
    by = {k: by[k] for k in sorted(by, key=order.index)}
    return Cost(sum(c.keys_read for c in by.values()), int(visible.sum()), rows, total, "module", reason, by,
                hull_rows)


def batch_cost(spec: VariantSpec, args: Mapping[str, Any], qo_lens: Sequence[int], kv_lens: Sequence[int], *,
               page_size: int = 16) -> Cost:
    """The planner's cost for a batch of requests (queries at the last positions of each), on the CPU."""
    for q, k in zip(qo_lens, kv_lens):
        if not 0 <= q <= k:
            raise ValueError(f"a request of {q} queries and {k} keys: expected 0 <= queries <= keys")
    visible, hull_rows = visible_keys(spec, args, qo_lens, kv_lens)
    requests, reason = planned_requests(spec, args, qo_lens, kv_lens, page_size)
    return cost_of(requests, visible, qo_lens, kv_lens, reason=reason, hull_rows=hull_rows, planner_on=not reason)


def plan_cost(plan: Any, spec: VariantSpec, args: Mapping[str, Any]) -> Cost:
    """The cost of a Plan made by plan(): its launch requests against the mask's visible keys."""
    b = plan.batch
    visible, hull_rows = visible_keys(spec, args, b.qo_lens, b.kv_lens)
    if plan.planner != "module":
        return cost_of([], visible, b.qo_lens, b.kv_lens, reason=plan.reason, hull_rows=hull_rows, planner_on=False)
    return cost_of(plan.launch_requests, visible, b.qo_lens, b.kv_lens, hull_rows=hull_rows)
