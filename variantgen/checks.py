"""What a wrapper's run() relies on from plan(): the page list's bounds, and the tensors the
plan was computed from.

Page bounds. The kernels read ``k_cache[paged_kv_indices[i]]`` unchecked, so an entry outside
the KV cache is an out-of-bounds read on the GPU. plan() takes the smallest and largest entry
of the batch's page list, ``paged_kv_indices[:paged_kv_indptr[-1]]``, and run() compares the
largest with the cache's page count (a host comparison: the cache is only known in run();
plan() refuses a negative smallest itself).
plan() reads the two values without a device sync of its own wherever it makes one anyway:

* a page list on the host: a min/max there (a few microseconds for thousands of entries);
* a page list on the device, indptrs on the device: the reduction is queued before plan()'s
  copy of the indptrs to the host and travels in that copy (PageBoundsReader.fold);
* a page list on the device, indptrs on the host: the reduction goes to page-locked memory
  without waiting; the interval planner's read-back of its launch requests (a sync) brings it
  over. Only where plan() reads nothing else back (the planner off; decode unless its key
  trimming reads spec tensors) does result() wait for it: one sync of its own, for the work
  queued before plan(). Pass the page list on the host to avoid it.

Every paged wrapper copies the page list in plan() (gathered per launch request, or copied as
it is), so the kernel reads exactly the entries that were checked, whatever the caller does to
its tensor afterwards.

Planned tensors (debug mode, ``check_plan=True`` / VARIANTGEN_CHECK_PLAN=1). The interval
planner reads spec tensors such as ``ranges`` or ``doc_ids`` once, in plan(); the kernel reads
them again in run(), but the launches' shapes were fixed from the values plan() saw. PlanCheck
keeps a device copy of each one: an eager run() compares (a sync) and raises; a run() under
CUDA-graph capture records the comparison in the graph (for the tensors of the plan it was
captured after), and the next plan() raises if any replay since the previous plan() found one
changed. A replay cannot refuse to run, so that report comes after the fact - but it names the
tensor, where the output alone would only be wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import LaunchError


@dataclass(frozen=True)
class PageBounds:
    """The smallest and largest entry of ``paged_kv_indices[:entries]`` when plan() read it."""

    entries: int
    low: int
    high: int  # -1 when entries == 0


NO_PAGES = PageBounds(0, 0, -1)


def used_bounds(kv_indices: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of ``kv_indices[:entries]`` as one-element tensors on its device, ``entries`` a
    one-element tensor there too (no host value needed: three kernels, no sync); ``positions``:
    0, 1, ... of kv_indices' length. Entries past ``entries`` count as page 0, always in range."""
    low, high = torch.aminmax(torch.where(positions < entries, kv_indices, 0))
    return low.view(1), high.view(1)


class PageBoundsReader:
    """plan()'s read of the page list's bounds (see the module doc); one per wrapper, reused."""

    def __init__(self) -> None:
        self._positions: torch.Tensor | None = None  # 0, 1, 2, ... on the device (the masked reduction)
        self._pinned: torch.Tensor | None = None  # page-locked int32 [2]: the bounds on their way over
        self._event: torch.cuda.Event | None = None
        self._entries = 0
        self._result: PageBounds | None = NO_PAGES

    def fold(self, kv_indices: torch.Tensor, kv_indptr: torch.Tensor) -> list[torch.Tensor]:
        """Where plan()'s copy of ``kv_indptr`` to the host is a device-to-host copy anyway and the
        page list is on that device: its (min, max) over the first ``kv_indptr[-1]`` entries as two
        one-element int32 device tensors, for plan() to append to that copy (and pass to begin()).
        Entries past the batch (a caller's larger buffer) count as page 0, which is always in range."""
        if kv_indices.device.type != "cuda" or kv_indptr.device != kv_indices.device or not kv_indices.numel():
            return []
        n = kv_indices.numel()
        if self._positions is None or self._positions.numel() < n or self._positions.device != kv_indices.device:
            self._positions = torch.arange(max(n, 2 * (self._positions.numel() if self._positions is not None else 0)),
                                           dtype=torch.int32, device=kv_indices.device)
        return list(used_bounds(kv_indices, kv_indptr[-1:], self._positions[:n]))

    def begin(self, kv_indices: torch.Tensor, entries: int, folded: list[int]) -> None:
        """Start reading the bounds of ``kv_indices[:entries]``: ``folded`` holds fold()'s values as
        plan() read them back (empty if fold() gave none)."""
        self._entries = entries
        if entries == 0:
            self._result = NO_PAGES
        elif folded:
            self._result = PageBounds(entries, folded[0], folded[1])
        elif kv_indices.device.type != "cuda":
            low, high = torch.aminmax(kv_indices[:entries].cpu())
            self._result = PageBounds(entries, int(low), int(high))
        else:  # over with the next read-back (result() waits only if there is none)
            if self._pinned is None:
                self._pinned = torch.empty(2, dtype=torch.int32, pin_memory=True)
                self._event = torch.cuda.Event()
            assert self._event is not None
            self._pinned.copy_(torch.stack(torch.aminmax(kv_indices[:entries])), non_blocking=True)
            self._event.record(torch.cuda.current_stream(kv_indices.device))
            self._result = None

    def result(self) -> PageBounds:
        if self._result is None:
            assert self._event is not None and self._pinned is not None
            self._event.synchronize()  # done already where plan() read something back after begin()
            low, high = self._pinned.tolist()
            self._result = PageBounds(self._entries, low, high)
        return self._result


def first_outside(kv_indices: torch.Tensor, entries: int, num_pages: int | None) -> tuple[int, int] | None:
    """(index, value) of the first of ``kv_indices[:entries]`` below 0 or (with ``num_pages``) at
    or above ``num_pages``; None if there is none (the tensor changed since plan() read it). For
    error messages only: it reads the tensor back."""
    used = kv_indices[:entries].cpu().long()
    bad = used < 0 if num_pages is None else (used < 0) | (used >= num_pages)
    hit = bad.nonzero()
    if not hit.numel():
        return None
    i = int(hit[0, 0])
    return i, int(used[i])


def check_page_low(bounds: PageBounds, kv_indices: torch.Tensor) -> None:
    """plan(): a negative page number is wrong whatever the cache."""
    if bounds.low < 0:
        where = first_outside(kv_indices, bounds.entries, None)
        entry = f"paged_kv_indices[{where[0]}]={where[1]}" if where else f"paged_kv_indices holds {bounds.low}, which"
        raise LaunchError(f"plan(): {entry} is not a page number (expected 0 <= page < the KV cache's page count)")


def check_page_high(where: str, bounds: PageBounds, kv_indices: torch.Tensor | None, num_pages: int,
                    cache: str) -> None:
    """``bounds`` against a KV cache of ``num_pages`` pages (``cache`` says which one, for the
    message); ``kv_indices``: the tensor they were read from (None only without entries)."""
    if bounds.high < num_pages:
        return
    assert kv_indices is not None
    hit = first_outside(kv_indices, bounds.entries, num_pages)
    if hit is not None:
        entry = f"paged_kv_indices[{hit[0]}]={hit[1]}"
    else:  # rewritten since plan() read it (the kernel reads plan()'s copy)
        entry = f"paged_kv_indices held page {bounds.high} when plan() read it, which"
    raise LaunchError(f"{where}: {entry} is not a page of {cache} ({num_pages} pages: expected 0 <= page < "
                      f"{num_pages})")


@dataclass
class PlannedCopy:
    name: str
    tensor: torch.Tensor  # what plan() was given (run() must pass the same tensor)
    copy: torch.Tensor  # its values when plan() read them


class PlanCheck:
    """Debug mode: device copies of the spec tensors plan() planned from (see the module doc).
    Copies and flags keep their addresses from plan to plan, so a captured comparison stays valid."""

    def __init__(self) -> None:
        self._copies: dict[str, PlannedCopy] = {}
        self._planned: list[PlannedCopy] = []
        self._flags: torch.Tensor | None = None  # bool [tensors]: a captured run() found it changed
        self._flag_names: list[str] = []
        self._captured = False  # a run() was captured: replays may set the flags

    def replays_changed(self) -> list[str]:
        """The tensors a replayed run() found changed since the plan it replayed (then forgotten).
        Reads the flags back: a sync (debug mode)."""
        if self._flags is None or not self._captured:
            return []
        hit = self._flags.tolist()
        self._flags.zero_()
        return [name for name, h in zip(self._flag_names, hit) if h]

    def snapshot(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy what plan() read (stream-ordered after the plan's own reads of them)."""
        self._planned = []
        for name, t in tensors.items():
            kept = self._copies.get(name)
            if kept is None or kept.copy.shape != t.shape or kept.copy.dtype != t.dtype or \
                    kept.copy.device != t.device:
                kept = self._copies[name] = PlannedCopy(name, t, torch.empty_like(t))
            kept.tensor = t
            kept.copy.copy_(t)
            self._planned.append(kept)
        names = [p.name for p in self._planned]
        if names and (self._flags is None or self._flag_names != names):
            device = self._planned[0].copy.device
            self._flags, self._flag_names = torch.zeros(len(names), dtype=torch.bool, device=device), names

    def clear(self) -> None:
        self._planned = []

    def verify(self, capturing: bool) -> None:
        """run(): the planned tensors still hold what plan() saw. Under capture the comparison is
        recorded in the graph (into the flags replays_changed() reads); else it is made here."""
        for i, p in enumerate(self._planned):
            if capturing:
                assert self._flags is not None
                self._captured = True
                self._flags[i:i + 1].logical_or_(torch.ne(p.tensor, p.copy).any().view(1))
            elif not torch.equal(p.tensor, p.copy):
                raise LaunchError(f"run(): `{p.name}` changed since plan() read it (check_plan=True): the launches "
                                  f"were planned from its old values, so the output would be wrong. Call plan() "
                                  f"again after changing `{p.name}`; run() does not re-plan")
