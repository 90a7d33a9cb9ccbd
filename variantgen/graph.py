"""CUDA-graph mode for the paged prefill wrapper: fixed launches, fixed-capacity buffers.

A captured graph replays the kernel launches ``run()`` made during capture with the same
arguments: the same device pointers, the same grid, the same FlashInfer plan_info. The
interval planner's output changes with every batch (how many launch requests each mask
mode gets, how many pages they read), so in graph mode the wrapper

* always makes the same launches, one per mask mode in GRAPH_MODES (a mode with no
  launch requests in this batch still launches; its CTAs find nothing to do),
* writes each launch's metadata (q_starts, kv_indptr, last_page_len, vg_meta) and page
  list *in place* into device buffers allocated once at the capacities below, padded
  with empty launch requests (no rows, no pages),
* schedules every launch for ``max_launch_requests`` requests and ``max_total_q`` rows
  with split-KV off (the planner module's scheduler with graph_rows, or FlashInfer's
  CUDA-graph scheduling), which makes plan_info (tile size, grid size, workspace offsets)
  the same for every batch that fits, and checks that it is: a plan() that would change it
  raises instead of leaving a captured graph to replay stale launch parameters.

So: plan() (outside the graph) before each replay, run() once under capture. fa2 only (the
fa3 planner's launch set depends on the batch: one launch per window width); decode uses it
on the tensor-core path (decode.py), whose kernel is the paged prefill one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import LaunchError
from .plan_abi import META_COLUMNS, MetaColumn

GRAPH_MODES = ("custom", "causal", "none")  # the launches of a graph-mode plan, in order


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LaunchError(f"GraphCapacity: {name}={value!r}: expected a positive int")
    return value


@dataclass(frozen=True)
class GraphCapacity:
    """The largest batch a graph-mode wrapper plans; buffers are allocated for it once.

    max_batch_size / max_total_q / max_kv_pages: caller requests, query rows (sum of
    qo lengths) and entries of paged_kv_indices (paged_kv_indptr[-1]) per plan().
    max_launch_requests: launch requests per mask mode (the planner splits a request where
    its rows' key intervals change shape, custom runs every 128 rows); default
    16 per request + one per 64 rows, at most max_total_q.
    max_launch_pages: page-list entries per mask mode after the planner trimmed each launch
    request's pages (requests split in several read overlapping pages); default 8 x
    max_kv_pages. plan() names the field to raise when a batch needs more.
    """

    max_batch_size: int
    max_total_q: int
    max_kv_pages: int
    max_launch_requests: int | None = None
    max_launch_pages: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_total_q", "max_kv_pages"):
            _positive(name, getattr(self, name))
        if self.max_batch_size > self.max_total_q:
            raise LaunchError(f"GraphCapacity: max_batch_size={self.max_batch_size} exceeds max_total_q="
                              f"{self.max_total_q} (every request has at least one query row)")
        if self.max_launch_requests is not None:
            n = _positive("max_launch_requests", self.max_launch_requests)
            if not self.max_batch_size <= n <= self.max_total_q:
                raise LaunchError(f"GraphCapacity: max_launch_requests={n}: expected max_batch_size <= it <= "
                                  f"max_total_q ({self.max_batch_size}..{self.max_total_q}): the direct path "
                                  "needs one per request, and a launch request has at least one row")
        if self.max_launch_pages is not None:
            n = _positive("max_launch_pages", self.max_launch_pages)
            if n < self.max_kv_pages:
                raise LaunchError(f"GraphCapacity: max_launch_pages={n} is below max_kv_pages={self.max_kv_pages} "
                                  "(the direct path passes the caller's whole page list)")

    def check_batch(self, batch_size: int, total_q: int, kv_pages: int) -> None:
        """plan()'s batch against the capacity; the error names the field to raise."""
        for name, value, field, limit in (
                ("batch size", batch_size, "max_batch_size", self.max_batch_size),
                ("total query rows", total_q, "max_total_q", self.max_total_q),
                ("paged_kv_indptr[-1] (page-list entries)", kv_pages, "max_kv_pages", self.max_kv_pages)):
            if value > limit:
                raise LaunchError(f"plan(): {name} {value} exceeds the wrapper's CUDA-graph capacity "
                                  f"{field}={limit}; make the wrapper with a larger GraphCapacity")

    @property
    def launch_requests(self) -> int:
        if self.max_launch_requests is not None:
            return self.max_launch_requests
        return min(self.max_total_q, 16 * self.max_batch_size + -(-self.max_total_q // 64))

    @property
    def launch_pages(self) -> int:
        return self.max_launch_pages if self.max_launch_pages is not None else 8 * self.max_kv_pages


class GraphBuffers:
    """The device buffers of one graph-mode wrapper: per launch slot, metadata laid out as
    [q_starts R+1, kv_indptr R+1, last_page_len R, vg_meta 9R] int32 in one tensor (with a
    page-locked host mirror, copied over in one go), and a page list of launch_pages entries.
    Views of them are what run() passes to the kernel, so their addresses never change."""

    def __init__(self, capacity: GraphCapacity, device: torch.device):
        self.capacity = capacity
        self.requests = r = capacity.launch_requests
        self.pages = capacity.launch_pages
        self.slot_ints = (r + 1) * 2 + r + META_COLUMNS * r
        n = len(GRAPH_MODES)
        self.metadata = torch.zeros(n * self.slot_ints, dtype=torch.int32, device=device)
        self.host = torch.zeros(n * self.slot_ints, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.kv_indices = torch.zeros(n * self.pages, dtype=torch.int32, device=device)
        self.plan_info: list[list[int] | None] = [None] * n  # the scheduler's, from the first plan()

    def slot_launches(self, launches: list[dict]) -> list[dict]:
        """``launches`` (at most one per mask mode) as the fixed GRAPH_MODES slots (an empty
        launch where a mode has none); raises if a launch needs more requests or pages than
        the capacity. Nothing is written here, so a refused plan leaves the buffers as they were."""
        by_mode: dict[str, dict] = {}
        for launch in launches:
            mode = launch["mask_mode"]
            if mode in by_mode or mode not in GRAPH_MODES:
                raise LaunchError(f"internal: graph mode got a second or unknown {mode!r} launch")
            by_mode[mode] = launch
        out = []
        for mode in GRAPH_MODES:
            launch = by_mode.get(mode) or dict(mask_mode=mode, q_starts=[0], plan_qo=[0], kv_indptr=[0],
                                               page_ranges=[], last_page_len=[], meta=[])
            n = len(launch["meta"])
            if n > self.requests:
                raise LaunchError(f"plan(): the {mode!r} launch needs {n} launch requests; the wrapper's CUDA-graph "
                                  f"capacity max_launch_requests={self.requests} - make the wrapper with a larger "
                                  "one")
            if launch["kv_indptr"][-1] > self.pages:
                raise LaunchError(f"plan(): the {mode!r} launch reads {launch['kv_indptr'][-1]} page-list entries; "
                                  f"the wrapper's CUDA-graph capacity max_launch_pages={self.pages} - make the "
                                  "wrapper with a larger one")
            out.append(dict(launch, packed=False))
        return out

    def write_slot(self, i: int, launch: dict) -> dict[str, torch.Tensor]:
        """Launch slot i's metadata into the host mirror, padded to capacity with launch
        requests that have no rows (they start at the batch's end), no keys and no window.
        Returns the padded host tensors the scheduler takes: plan_qo, kv_indptr, q_starts."""
        r, n = self.requests, len(launch["meta"])
        total_q, pages = launch["q_starts"][-1], launch["kv_indptr"][-1]
        views = self._split(self.host[i * self.slot_ints:(i + 1) * self.slot_ints])
        i32 = torch.int32
        plan_qo = torch.full((r + 1,), launch["plan_qo"][-1], dtype=i32)
        plan_qo[:n + 1] = torch.tensor(launch["plan_qo"], dtype=i32)
        views["q_starts"].fill_(total_q)
        views["q_starts"][:n + 1] = torch.tensor(launch["q_starts"], dtype=i32)
        views["kv_indptr"].fill_(pages)
        views["kv_indptr"][:n + 1] = torch.tensor(launch["kv_indptr"], dtype=i32)
        views["last_page_len"].zero_()
        meta = views["meta"].view(r, META_COLUMNS)
        pad = [0] * META_COLUMNS
        pad[MetaColumn.Q_ROW_BASE], pad[MetaColumn.KERNEL_WINDOW] = total_q, -1
        meta[:] = torch.tensor(pad, dtype=i32)
        if n:
            views["last_page_len"][:n] = torch.tensor(launch["last_page_len"], dtype=i32)
            meta[:n] = torch.tensor(launch["meta"], dtype=i32)
        return {"plan_qo": plan_qo, "kv_indptr": views["kv_indptr"].clone(), "q_starts": views["q_starts"].clone()}

    def _split(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        r = self.requests
        views, at = {}, 0
        for name, size in (("q_starts", r + 1), ("kv_indptr", r + 1), ("last_page_len", r),
                           ("meta", r * META_COLUMNS)):
            views[name] = slot[at:at + size]
            at += size
        return views

    def slot_views(self, i: int) -> dict[str, torch.Tensor]:
        """Launch slot i's device buffers (what run() passes to the kernel)."""
        views = self._split(self.metadata[i * self.slot_ints:(i + 1) * self.slot_ints])
        views["kv_indices"] = self.kv_indices[i * self.pages:(i + 1) * self.pages]
        return views

    def check_plan_info(self, i: int, plan_info: list[int]) -> None:
        """The scheduler's plan_info for slot i must be the one the graph was captured with."""
        self.plan_info[i] = pin_plan_info(self.plan_info[i], plan_info, f"the {GRAPH_MODES[i]!r} launch")


def pin_plan_info(known: list[int] | None, plan_info: Any, what: str) -> list[int]:
    """The first plan_info of a graph-mode launch, kept; a later one that differs raises (a
    captured graph replays the launch parameters it was captured with)."""
    if known is None:
        return list(plan_info)
    if list(plan_info) != known:
        raise LaunchError(f"plan(): the schedule for {what} changed ({known} -> {list(plan_info)}); a captured "
                          "CUDA graph would replay the old launch parameters. This is a variantgen bug: please "
                          "report it with the batch")
    return known
