"""CUDA-graph mode for the paged prefill wrapper: fixed launch slots, fixed-capacity buffers.

A captured graph replays the kernel launches ``run()`` made during capture with the same
arguments: the same device pointers, the same grid, the same plan_info, the same scalars
(fa3's left window among them). The interval planner's output changes with every batch (how
many launch requests each mask mode gets, how many pages they read), so in graph mode the
launch builder (templates/plan/launches.h, with the capacity in its options)

* always makes the same launches - *slots*: custom, causal, none, then on fa2 the tail slot
  (draft-tree rows: causal, the mask on the diagonal tile), on fa3 (which takes its left
  window per launch) a causal slot per window width. The widths are fixed for the
  wrapper's life: ``GraphCapacity.window_widths`` names them, or the first plan() pins the
  ones its batch has (up to FA3_MAX_WINDOW_LAUNCHES); window rows of any other width run in
  the custom slot, with the mask (exact, slower). A slot with no launch requests in a batch
  still launches; its CTAs find nothing to do;
* lays every slot out at offsets that depend on the capacity only, in one device workspace
  allocated at the first plan(): metadata (q_starts, kv_indptr, last_page_len, vg_meta) for
  ``max_launch_requests`` launch requests padded with empty ones (no rows, no pages), a page
  list of ``max_launch_pages`` entries, and a schedule sized for ``max_total_q`` rows with
  split-KV off - so plan_info (tile size, grid size, workspace offsets) is the same for every
  batch that fits.

This module keeps the capacity, that workspace and what must not change once a run() was
captured: each slot's plan_info, the window widths, the heads and page size. A plan() that
would change one raises instead of leaving a captured graph to replay stale launch
parameters; one that does not fit the capacity names the field to raise.

So: plan() (outside the graph) before each replay, run() once under capture. Decode uses it
on the tensor-core path (decode.py), whose kernel is the paged prefill one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..abi.table import FA3_MAX_WINDOW_LAUNCHES
from ..core.errors import LaunchError
from ..lang.nodes import INT32_MAX


def _positive(name: str, value: object) -> int:
    """A count that sizes int32 buffers (indptrs, page lists) and their entries."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= INT32_MAX:
        raise LaunchError(f"GraphCapacity: {name}={value!r}: expected a positive int below 2**31 "
                          "(the buffers index it in int32)")
    return value


@dataclass(frozen=True)
class GraphCapacity:
    """The largest batch a graph-mode wrapper plans; buffers are allocated for it once.

    max_batch_size / max_total_q / max_kv_pages: caller requests, query rows (sum of
    qo lengths) and entries of paged_kv_indices (paged_kv_indptr[-1]) per plan().
    max_launch_requests: launch requests per launch slot (the planner splits a request where
    its rows' key intervals change shape, custom runs every 128 rows); default 16 per request
    + one per 64 rows, at most max_total_q.
    max_launch_pages: page-list entries per launch slot after the planner trimmed each launch
    request's pages (requests split in several read overlapping pages); default 8 x
    max_kv_pages. plan() names the field to raise when a batch needs more.
    window_widths (fa3): the left-window widths that get their own causal launch slot (at most
    FA3_MAX_WINDOW_LAUNCHES, e.g. the spec's sliding window); default: the widths of the
    first plan()'s batch. Window rows of other widths run in the custom slot (exact, slower).
    fa2 takes the window per launch request and ignores this.
    max_qo_len: the most query rows of one request in any plan (decode: q_len_per_request);
    default max_total_q - max_batch_size + 1. On fa3 the launches are GQA-packed when it times
    the GQA group fits one query tile (planner.Planner.pack_gqa): say it for decode graphs.
    """

    max_batch_size: int
    max_total_q: int
    max_kv_pages: int
    max_launch_requests: int | None = None
    max_launch_pages: int | None = None
    window_widths: tuple[int, ...] | None = None
    max_qo_len: int | None = None

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
        if self.max_qo_len is not None:
            n = _positive("max_qo_len", self.max_qo_len)
            if n > self.max_total_q:
                raise LaunchError(f"GraphCapacity: max_qo_len={n} exceeds max_total_q={self.max_total_q}")
        if self.window_widths is not None:
            widths = self.window_widths
            ints = isinstance(widths, tuple) and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0
                                                     for w in widths)
            if not ints or len(widths) > FA3_MAX_WINDOW_LAUNCHES or len(set(widths)) != len(widths):
                raise LaunchError(f"GraphCapacity: window_widths={widths!r}: expected a tuple of at most "
                                  f"{FA3_MAX_WINDOW_LAUNCHES} distinct ints >= 0 (left-window widths)")

    @property
    def longest_request(self) -> int:
        """The most query rows one request of a plan may have."""
        return self.max_qo_len if self.max_qo_len is not None else self.max_total_q - self.max_batch_size + 1

    def check_batch(self, batch_size: int, total_q: int, kv_pages: int, longest: int = 0) -> None:
        """plan()'s batch against the capacity (``longest``: its longest request's query rows);
        the error names the field to raise."""
        for name, value, field, limit in (
                ("batch size", batch_size, "max_batch_size", self.max_batch_size),
                ("total query rows", total_q, "max_total_q", self.max_total_q),
                ("paged_kv_indptr[-1] (page-list entries)", kv_pages, "max_kv_pages", self.max_kv_pages),
                ("a request's query rows", longest, "max_qo_len", self.longest_request)):
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
        return self.max_launch_pages if self.max_launch_pages is not None else min(8 * self.max_kv_pages, INT32_MAX)


SLOT_NAMES = ("custom", "causal", "none")  # the first launch slots, in order; fa3 then one per window width


def slot_name(slot: int, fa3: bool, widths: tuple[int, ...] | None = None) -> str:
    """A launch slot's name in messages: custom, causal, none, then fa2's tail slot or fa3's
    window slots (by width once pinned)."""
    if slot < len(SLOT_NAMES):
        return SLOT_NAMES[slot]
    if not fa3:
        return "tail"
    at = slot - len(SLOT_NAMES)
    return f"window {widths[at]}" if widths and at < len(widths) else f"window slot {at}"


class GraphBuffers:
    """What one graph-mode wrapper keeps from plan to plan: its capacity, the device workspace
    the launch slots live in (with its page-locked host mirror; allocated at the first plan, at
    the size the launch builder asks for, never again: captured launches hold its addresses),
    and the pins - each slot's plan_info, the window widths, the heads and page size."""

    def __init__(self, capacity: GraphCapacity, device: torch.device, fa3: bool = False):
        self.capacity = capacity
        self.fa3 = fa3
        self.device = device
        self.workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self.plan_info: dict[int, list[int]] = {}
        self.windows: tuple[int, ...] | None = capacity.window_widths
        self.shape: tuple[int, int, int] | None = None  # (num_qo_heads, num_kv_heads, page_size) of the first plan
        self.pack_gqa: int | None = None  # fa3 GQA packing, pinned by the first plan (the capture's copies)
        # the planned batch's query rows on the device: a packed run's unpack writes only those
        self.rows = torch.zeros(1, dtype=torch.int32, device=device)

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' workspace, made at the first plan (``nbytes``: the builder's answer); a later
        plan that needs more is a bug in the fixed layout."""
        if self.workspace is not None:
            raise LaunchError(f"internal: the CUDA-graph layout grew to {nbytes} bytes after the first plan "
                              f"({self.workspace[0].numel()}); please report it with the batch")
        self.workspace = (torch.empty(nbytes, dtype=torch.uint8, device=self.device),
                          torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda"))
        return self.workspace

    def check_shape(self, num_qo_heads: int, num_kv_heads: int, page_size: int) -> None:
        """Heads and page size are part of every captured launch: the first plan's stay."""
        shape = (num_qo_heads, num_kv_heads, page_size)
        if self.shape is None:
            self.shape = shape
        elif shape != self.shape:
            raise LaunchError(f"plan(): num_qo_heads, num_kv_heads, page_size = {shape}, but this CUDA-graph wrapper "
                              f"planned {self.shape} first (a captured graph replays launches for those); make another "
                              "wrapper for these")

    def pin_windows(self, widths: tuple[int, ...]) -> None:
        """fa3: the window widths of the first plan, when GraphCapacity named none."""
        if self.windows is None:
            self.windows = widths

    def check_plan_info(self, slot: int, plan_info: list[int]) -> None:
        """The schedule of launch slot ``slot`` must be the one the graph was captured with."""
        name = slot_name(slot, self.fa3, self.windows)
        self.plan_info[slot] = pin_plan_info(self.plan_info.get(slot), plan_info, f"the {name!r} launch slot")


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
