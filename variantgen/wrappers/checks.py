"""What a wrapper's run() relies on from plan(): the page list's bounds, and the tensors the
plan was computed from; and the checks of a batch's arguments every route shares with the dense
reference (reference.reference_attention): sizes, index tensors, per-request lengths, the spec's
arguments. ``where`` names the caller in their messages ("plan()", "run()", "reference_attention()").

Page bounds. The kernels read ``k_cache[paged_kv_indices[i]]`` unchecked, so an entry outside
the KV cache is an out-of-bounds read on the GPU. plan() takes the smallest and largest entry
of the batch's page list, ``paged_kv_indices[:paged_kv_indptr[-1]]``, and run() compares them
with the cache's page count (the cache is only known in run()). plan() never waits for the GPU
to read them:

* a page list on the host: a min/max there (a few microseconds for thousands of entries);
* a page list on the device, indptrs on the device: the module's read_indices reduces it in the
  kernel that packs the indptrs for plan()'s one copy to the host, and it travels in that copy;
* a page list on the device, indptrs on the host (serving engines' decode: vLLM plans every
  step while the GPU runs the previous one): the reduction goes to page-locked memory without
  waiting (BoundsCopy). Where plan() reads something back anyway (the interval planner's launch
  requests; decode key trimming that reads spec tensors) it has landed by plan()'s end; where
  plan() reads nothing back (the planner off; CUDA-core decode unless its key trimming reads
  spec tensors) it may still be on its way when run() is called.

Where the bounds are known, bad entries are refused before any launch: negative ones by
plan(), the rest by run() - and by plan() in CUDA-graph mode, against the cache the graph was
captured with (replays run no host code). Where they are not known yet, run() guards on the
device instead of waiting: it clamps the kernels' copy of the page list to the cache's pages
(``clamp_(0, pages - 1)`` before the launch, after every other check of run()), so the kernels
read nothing outside the cache, and notes the run and the page count its list was clamped to (the
clamp is in place: a later run() of the plan over a larger cache reads the list clamped to the
smaller one). The next plan() or run() of the wrapper asks the bounds' event (a query, never a
wait) and, once they have landed, raises a LaunchError naming those run()s: they read a clamped
list, so their output is wrong. A run() captured into a CUDA graph
always records the clamp (against the captured cache's page count), since its replays read
page lists of later plans; the next plan() reports a plan whose bounds landed outside that
cache. A report comes after the fact - a clamped launch cannot be refused - and on a later call
only if there is one; pass the page list on the host to have every bad entry refused before
the launch.

Cost, for the plan benchmark's 4096-entry page list (measured on an H200, torch 2.11, with
these torch ops queued back to back behind a sleeping kernel; bench/bench_page_guard.py measures
them through PageGuard): run()'s clamp is one elementwise kernel of 1.7 us (1.1 us inside a
CUDA graph) - 0.3% of a 0.5 ms decode kernel, 0.02% of a 9 ms prefill kernel - and 10-16 us of
host time to launch; each poll of an event is ~2 us of host time, the bookkeeping a few us more.
plan()'s reduction and copy to page-locked memory (for any device page list with host indptrs)
take 12 us of stream time (the 8-byte copy after the kernel is most of it; 2.5% of a 0.5 ms
decode kernel, 0.1% of 9 ms) and ~40 us of host time. What the guard replaces is a wait for
everything queued before plan() - in a decode loop, the rest of the previous step.

Every paged wrapper copies the page list in plan() (gathered per launch request, or copied as
it is), so the kernel reads exactly the entries that were checked - or clamped - whatever the
caller does to its tensor afterwards.

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

import difflib
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import LaunchError, user_text
from ..lang.nodes import FLOAT32_MAX, INT32_MAX
from ..lang.values import VariantSpec, shown_value, value_fits
from ..planning.plan import Batch

INT32_PAGES = 1 << 31  # int32 page numbers: a cache of more pages holds every one of them
SPEC_TENSOR_DTYPES = {"int32": torch.int32, "float32": torch.float32}
KV_LAYOUTS = ("NHD", "HND")  # in the order of the kernels' layout codes (base.LAYOUT_CODES)


def to_device(where: str, tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """``tensor`` on ``device`` (None: where it is), for a helper's ``device=`` argument;
    ValueError naming it where torch takes it for no device, or one it cannot reach."""
    if device is None:
        return tensor
    try:
        return tensor.to(torch.device(device))
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{where}: device={device!r}: expected a torch device this process can use ('cpu', "
                         f"'cuda', 'cuda:0', ...): {e}") from None


# Index tensors' shapes, for messages (paged_kv_indices may run past the batch's entries)
INDEX_SHAPES = {"qo_indptr": " [batch + 1]", "kv_indptr": " [batch + 1]", "paged_kv_indptr": " [batch + 1]",
                "paged_kv_last_page_len": " [batch]"}
READABLE_DEVICES = ("cpu", "cuda")  # where plan() can read an index tensor's values from


def check_index_tensors(where: str, **tensors: Any) -> None:
    """A batch's index tensors (indptrs, page list, last-page lengths), before their values are
    read on the host: 1-D torch.int32 on the CPU or any CUDA device. LaunchError naming the
    argument otherwise (torch's own error for a meta tensor comes from deep inside the copy)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            got = f"{t.dtype} tensor of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise LaunchError(f"{where}: `{name}`: expected a 1-D torch.int32 tensor{INDEX_SHAPES.get(name, '')}, "
                              f"got {got}")
        if t.device.type not in READABLE_DEVICES:
            raise LaunchError(f"{where}: `{name}` is on {t.device}: expected a tensor on the CPU or a CUDA device "
                              f"({where} reads its values)")


def check_plan_sizes(where: str, **sizes: Any) -> None:
    """num_qo_heads, num_kv_heads (and page_size): positive ints within int32 (as the kernels
    take them), whole GQA groups."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= INT32_MAX:
            raise LaunchError(f"{where}: {name}={value!r}: expected a positive int below 2**31")
    if sizes["num_qo_heads"] % sizes["num_kv_heads"]:
        raise LaunchError(f"{where}: num_qo_heads={sizes['num_qo_heads']} is not a multiple of "
                          f"num_kv_heads={sizes['num_kv_heads']}")


def check_indptr_starts(where: str, **firsts: int) -> None:
    """Indptrs start at 0: the kernels index q / o rows and the page list from the first row and
    entry of their tensors (an offset would be applied nowhere)."""
    for name, first in firsts.items():
        if first != 0:
            what = ("page lists are packed from the first entry of `paged_kv_indices`" if name == "paged_kv_indptr"
                    else "rows are packed from the first row of the tensor")
            raise LaunchError(f"{where}: `{name}`[0]={first}: expected 0 ({what})")


def check_paged_arguments(qo_indptr: Any, paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any,
                          num_qo_heads: Any, num_kv_heads: Any, page_size: Any, *, where: str = "plan()") -> None:
    """A paged batch's arguments before their values are read (sizes, index tensor types, entry
    counts), shared by every paged-prefill route and the reference."""
    check_plan_sizes(where, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_size=page_size)
    check_index_tensors(where, qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr,
                        paged_kv_indices=paged_kv_indices, paged_kv_last_page_len=paged_kv_last_page_len)
    batch = qo_indptr.numel() - 1
    if batch < 1:  # as decode and ragged say: an empty batch is refused by name, not as "inconsistent"
        raise LaunchError(f"{where}: empty batch: `qo_indptr` has {qo_indptr.numel()} "
                          f"entr{'y' if qo_indptr.numel() == 1 else 'ies'}; expected at least one request "
                          "(batch + 1 >= 2 entries)")
    if paged_kv_indptr.numel() != batch + 1 or paged_kv_last_page_len.numel() != batch:
        raise LaunchError(
            f"{where}: inconsistent batch: qo_indptr has {qo_indptr.numel()} entries, paged_kv_indptr "
            f"{paged_kv_indptr.numel()}, paged_kv_last_page_len {paged_kv_last_page_len.numel()} "
            "(expected batch+1, batch+1, batch)")


def paged_batch(qo_h: list[int], kvp_h: list[int], last_h: list[int], num_indices: int, num_qo_heads: int,
                num_kv_heads: int, page_size: int, *, where: str = "plan()") -> Batch:
    """The Batch of a paged batch from host copies of its indptrs and last-page lengths (after
    check_paged_arguments), its per-request lengths checked; ``num_indices``: entries of
    paged_kv_indices. LaunchError naming the argument and request otherwise."""
    check_indptr_starts(where, qo_indptr=qo_h[0], paged_kv_indptr=kvp_h[0])
    qo_lens, kv_lens = [], []
    for b in range(len(qo_h) - 1):
        ql, npages, lp = qo_h[b + 1] - qo_h[b], kvp_h[b + 1] - kvp_h[b], last_h[b]
        kl = 0 if npages == 0 else (npages - 1) * page_size + lp
        if ql < 0 or npages < 0:  # named, with its values (a negative key count read as "only -4 keys")
            name, ptr = ("qo_indptr", qo_h) if ql < 0 else ("paged_kv_indptr", kvp_h)
            raise LaunchError(f"{where}: `{name}` decreases at request {b} ({name}[{b}]={ptr[b]}, "
                              f"{name}[{b + 1}]={ptr[b + 1]}): indptrs must be non-decreasing")
        if npages and not 1 <= lp <= page_size:
            raise LaunchError(f"{where}: paged_kv_last_page_len[{b}]={lp}: expected 1..{page_size}")
        if ql > kl:
            raise LaunchError(f"{where}: request {b} has {ql} queries but only {kl} keys; the queries must be "
                              "the last qo_len tokens of the request's KV")
        qo_lens.append(ql)
        kv_lens.append(kl)
    if kvp_h[-1] > num_indices:
        raise LaunchError(f"{where}: paged_kv_indices has {num_indices} entries, paged_kv_indptr needs {kvp_h[-1]}")
    check_total_keys(kv_lens, page_size, where)
    return Batch(len(qo_lens), qo_h[-1], sum(kv_lens), num_qo_heads, num_kv_heads, page_size, tuple(qo_lens),
                 tuple(kv_lens))


def check_total_keys(kv_lens: list[int], page_size: int, where: str = "plan()") -> None:
    """The batch's keys (the sum of its requests' kv lengths) fit the kernels' int32 key
    positions and rows (vg_meta's kv lengths and KV_ROW_BASE, the row of a request's first key
    among the batch's): past 2**31 - 1 they would wrap. The lengths come from page_size,
    paged_kv_indptr and paged_kv_last_page_len, which a page list reusing pages can make large."""
    total = sum(kv_lens)
    if total > INT32_MAX:
        longest = max(range(len(kv_lens)), key=kv_lens.__getitem__)
        raise LaunchError(
            f"{where}: the batch has {total} keys (request {longest}: {kv_lens[longest]}), expected at most "
            f"2**31 - 1 = {INT32_MAX} (the kernels' key positions and rows are int32): check page_size={page_size}, "
            "paged_kv_indptr and paged_kv_last_page_len (a request's keys: (its pages - 1) * page_size + its last "
            "page's length)")


def check_kv_layout(kv_layout: Any, where: str = "") -> None:
    """``kv_layout`` is one the kernels take (``where``: the caller, for the message; none for a constructor)."""
    if kv_layout not in KV_LAYOUTS:
        raise LaunchError(f"{where}{': ' if where else ''}kv_layout={kv_layout!r}: expected 'NHD' or 'HND'")


def split_paged_cache(where: str, paged_kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of a paged KV cache given as a pair or as one [num_pages, 2, ...]
    tensor, each a 4-D tensor (their shapes are the caller's to check)."""
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k_cache, v_cache = paged_kv_cache
    elif isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2:
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        raise LaunchError(f"{where}: `paged_kv_cache`: expected (k_cache, v_cache) or one tensor [num_pages, 2, ...]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise LaunchError(f"{where}: `{name}`: expected a 4-D tensor")
    return k_cache, v_cache


def check_scale_values(where: str, **scales: Any) -> None:
    """Scales given (None: not given) are finite numbers in float32 range (the kernels take them as float32s)."""
    for name, value in scales.items():
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise LaunchError(f"{where}: `{name}`: expected a finite float, got {value!r} "
                              "(per-head scale tensors are not supported)")
        if abs(value) > FLOAT32_MAX:  # (an int too: compared exactly)
            raise LaunchError(f"{where}: `{name}`={shown_value(value)}: expected a float in float32 range (|x| <= "
                              f"{FLOAT32_MAX:.7g}): the kernels take it as a float32")


def spec_dims(batch: Batch) -> dict[str, int]:
    """The sizes a spec tensor's named dimensions take for ``batch``."""
    return {"total_q": batch.total_q, "total_kv": batch.total_kv, "batch": batch.batch_size,
            "num_qo_heads": batch.num_qo_heads, "num_kv_heads": batch.num_kv_heads}


def check_known(spec: VariantSpec, given: Mapping[str, Any], where: str, own: Collection[str] = (),
                also: str = "") -> None:
    """LaunchError for names in ``given`` that are no argument of ``spec``, with the closest name
    (a spec argument, or one of ``own``: the caller's own keywords); ``also``: what else the
    caller takes, for the message."""
    known = [t.name for t in spec.tensors] + [s.name for s in spec.scalars]
    extra = sorted(set(given) - set(known))
    if not extra:
        return
    named = []
    for name in extra:
        close = difflib.get_close_matches(name, [*known, *own], n=1, cutoff=0.6)
        named.append(f"{name} (did you mean `{close[0]}`?)" if close else name)
    takes = ", ".join(known) or "no extra arguments"
    raise LaunchError(f"{where}: unexpected argument(s) {', '.join(named)}; spec `{spec.name}` takes: {takes}{also}")


def check_spec_args(spec: VariantSpec, given: Mapping[str, Any], dims: dict[str, int], device: torch.device, *,
                    where: str, required: bool = True, caps: dict[str, int] | None = None,
                    device_of: str = "the workspace", contiguous: bool = True) -> dict[str, Any]:
    """The spec's arguments in ``given`` (names checked by check_known), checked: its tensors'
    dtype, shape (``dims``: the named dimensions' sizes; ``caps``: CUDA-graph mode's largest),
    device (``device``, ``device_of`` says whose) and, where ``contiguous`` (the kernels take
    their addresses), contiguity, each tensor required unless ``required`` is False; its scalars
    (their defaults where absent) of their type and range. The checked arguments by name."""
    out: dict[str, Any] = {}
    for t in spec.tensors:
        if t.name not in given:
            if not required:
                continue
            raise LaunchError(f"{where}: missing tensor argument `{t.name}` "
                              f"({t.dtype}, shape {list(t.shape)}: {user_text(t.doc) if t.doc else 'see the spec'})")
        value = given[t.name]
        want_shape = tuple(dims[d] if isinstance(d, str) else d for d in t.shape)
        shape_text = "[" + ", ".join(f"{d}={dims[d]}" if isinstance(d, str) else str(d) for d in t.shape) + "]"
        if caps and any(d in caps for d in t.shape if isinstance(d, str)):
            # Graph mode: a static buffer sized for the capacity is fine (rows past this
            # batch are not read).
            shape_text += " (batch-sized dims up to the CUDA-graph capacity)"
            if isinstance(value, torch.Tensor) and value.dim() == len(t.shape) and all(
                    want <= got <= caps.get(d, want) if isinstance(d, str) else want == got
                    for d, want, got in zip(t.shape, want_shape, value.shape)):
                want_shape = tuple(value.shape)
        if not isinstance(value, torch.Tensor):
            raise LaunchError(f"{where}: `{t.name}`: expected a torch.{t.dtype} tensor of shape {shape_text}, "
                              f"got {type(value).__name__}")
        if value.dtype != SPEC_TENSOR_DTYPES[t.dtype]:
            raise LaunchError(f"{where}: `{t.name}`: expected dtype torch.{t.dtype}, got {value.dtype}")
        if tuple(value.shape) != want_shape:
            raise LaunchError(f"{where}: `{t.name}`: expected shape {shape_text}, got {list(value.shape)}")
        if value.device != device:
            raise LaunchError(f"{where}: `{t.name}` is on {value.device}, expected {device} (the device of "
                              f"{device_of})")
        if contiguous and not value.is_contiguous():
            raise LaunchError(f"{where}: `{t.name}` must be contiguous (call .contiguous(); it is not copied "
                              "implicitly so that CUDA-graph pointers stay stable)")
        out[t.name] = value
    for s in spec.scalars:
        value = given.get(s.name, s.default)
        if not value_fits(value, s.dtype):
            want = {"bool": "a bool", "int": "an int in 32-bit range",
                    "float": f"a float in 32-bit float range (|x| <= {FLOAT32_MAX:.7g})"}[s.dtype]
            raise LaunchError(f"{where}: `{s.name}`: expected {want}, got {shown_value(value)} "
                              f"({type(value).__name__})")
        problem = s.out_of_range(value)
        if problem:
            raise LaunchError(f"{where}: `{s.name}`: {problem}")
        out[s.name] = float(value) if s.dtype == "float" else value
    return out


@dataclass(frozen=True)
class PageBounds:
    """The smallest and largest entry of ``paged_kv_indices[:entries]`` when plan() read it."""

    entries: int
    low: int
    high: int  # -1 when entries == 0

    def inside(self, num_pages: int | None) -> bool:
        """Every entry is a page number (with ``num_pages``: a page of a cache that many pages)."""
        return self.low >= 0 and (num_pages is None or self.high < num_pages)

    def worst(self) -> int:
        """The bound to name where ``inside`` is False: the smallest if negative, else the largest."""
        return self.low if self.low < 0 else self.high


NO_PAGES = PageBounds(0, 0, -1)


def read_bounds(kv_indices: torch.Tensor, entries: int) -> PageBounds:
    """The bounds of ``kv_indices[:entries]`` read on the host (for a device tensor: a copy, which waits)."""
    if entries == 0:
        return NO_PAGES
    low, high = torch.aminmax(kv_indices[:entries].cpu())
    return PageBounds(entries, int(low), int(high))


class BoundsCopy:
    """The (min, max) of a page list on the GPU on their way to page-locked memory: queued
    without waiting; ``landed()`` asks the event (a query, never a wait). Kept for reuse."""

    @staticmethod
    def needed(kv_indices: torch.Tensor) -> bool:
        """Whether the bounds of ``kv_indices`` come over from a device."""
        return kv_indices.device.type == "cuda"

    def __init__(self, device: torch.device) -> None:
        self._device = torch.empty(2, dtype=torch.int32, device=device)
        self._host = torch.empty(2, dtype=torch.int32, pin_memory=True)
        self._event = torch.cuda.Event()

    def start(self, kv_indices: torch.Tensor) -> None:
        # into a kept buffer: one reduction kernel (H200: 3 us of device, ~13 us of host time; stacking
        # aminmax's two results adds a kernel: 5 us, ~28 us)
        torch.aminmax(kv_indices, out=(self._device[0], self._device[1]))
        self._host.copy_(self._device, non_blocking=True)
        self._event.record(torch.cuda.current_stream(kv_indices.device))

    def landed(self) -> bool:
        return self._event.query()

    def values(self) -> tuple[int, int]:
        """(min, max), once landed."""
        low, high = self._host.tolist()
        return low, high


@dataclass(frozen=True)
class ClampedRun:
    """A run() that read a page list clamped on the device."""

    run: int  # the wrapper's run() count
    pages: int  # its cache's page count
    clamp: int  # the page count the list was clamped to: an earlier run() of the plan may have clamped it further


@dataclass
class InFlight:
    """One plan()'s page bounds on their way, and who read its page list clamped meanwhile."""

    plan: int  # the wrapper's plan() count
    entries: int
    copy: BoundsCopy
    runs: list[ClampedRun] = field(default_factory=list)
    graph_pages: int | None = None  # replays of a run() captured over a cache of this many pages read it


class PageGuard:
    """The page list's bounds from plan() to run(), and the device guard where they are still on
    their way (see the module doc); one per wrapper. plan() calls poll(), begin() and finish();
    run() calls poll() and check_run()."""

    def __init__(self) -> None:
        self._plans = 0  # plan()s that read a page list
        self._runs = 0  # run()s checked against a cache (a refused one is not counted: it left no trace)
        self._page_list: torch.Tensor | None = None  # the caller's tensor (for messages)
        self._bounds: PageBounds | None = NO_PAGES  # the current plan's; None while on their way
        self._current: InFlight | None = None  # ... on their way
        self._waiting: list[InFlight] = []  # earlier plans' on their way, whose lists a run() or replay read
        self._spare: list[BoundsCopy] = []  # landed copies, for reuse
        self._clamped: tuple[int, int] | None = None  # (run() count, pages): the current list was clamped so
        self.captured_pages: int | None = None  # the smallest cache a captured run() read (replays read them)

    @property
    def bounds(self) -> PageBounds | None:
        """The current plan's bounds as far as known (None: still on their way)."""
        return self._bounds

    # ------------------------------------------------------------------ plan()
    def begin(self, kv_indices: torch.Tensor, entries: int, folded: list[int]) -> None:
        """Start reading the bounds of ``kv_indices[:entries]``: ``folded`` holds the (min, max) plan()
        read back with its device indptrs (the module's read_indices), or is empty."""
        self._plans += 1
        previous, self._current = self._current, None
        if previous is not None and (previous.runs or previous.graph_pages is not None):
            self._waiting.append(previous)  # read clamped: reported once its bounds land
        self._page_list, self._clamped = kv_indices, None
        if entries == 0:
            self._bounds = NO_PAGES
        elif folded:
            self._bounds = PageBounds(entries, folded[0], folded[1])
        elif not BoundsCopy.needed(kv_indices):
            self._bounds = read_bounds(kv_indices, entries)
        else:  # on their way: landed by finish() where plan() read something back after this
            copy = self._spare.pop() if self._spare else BoundsCopy(kv_indices.device)
            copy.start(kv_indices[:entries])
            self._current = InFlight(self._plans, entries, copy, graph_pages=self.captured_pages)
            self._bounds = None

    def finish(self) -> None:
        """plan()'s end: the checks the bounds allow if they are here (raises). Negative entries
        are refused whatever the cache; in CUDA-graph mode the rest too, against the captured cache."""
        if self._current is not None and self._current.copy.landed():
            self._land(self._current)
        bounds = self._bounds
        if bounds is None:  # still on their way: run() guards
            return
        check_pages("plan()", bounds, self._page_list, None, "")
        if self.captured_pages is not None:
            check_pages("plan()", bounds, self._page_list, self.captured_pages,
                        "the KV cache the CUDA graph was captured with")

    # ------------------------------------------------------------------ run()
    def check_run(self, num_pages: int, capturing: bool, page_lists: Callable[[], list[torch.Tensor]]) -> None:
        """run(), against a cache of ``num_pages`` pages: refuse a planned page list known to hold
        an entry outside it; clamp the kernels' lists (``page_lists()``, the wrapper's copies) where
        the bounds are still on their way, and under CUDA-graph capture (replays read later plans).
        The wrapper calls it last, after every other check of run(): a run() refused later would
        have clamped the list and been recorded without a launch."""
        bounds = self._bounds
        if bounds is not None:
            check_pages("run()", bounds, self._page_list, num_pages, "the KV cache run() was given",
                        read_back=not capturing)
            if self._clamped is not None and not bounds.inside(self._clamped[1]):
                run, pages = self._clamped
                raise LaunchError(f"run(): this plan's page list was clamped to the {pages} pages of run() #{run}'s KV "
                                  f"cache (it held page {bounds.worst()}), as reported; call plan() again")
        if num_pages == 0 and (capturing or bounds is None):
            what = "a captured run() reads later plans' page lists" if capturing else \
                "the planned page list has entries"
            raise LaunchError(f"run(): the KV cache run() was given has no pages, and {what} (expected 0 <= page < "
                              "the cache's page count)")
        self._runs += 1
        if bounds is not None and not capturing:
            return
        top = min(num_pages, INT32_PAGES) - 1
        for pages in page_lists():
            pages.clamp_(0, top)  # in place: the wrapper's copy (under capture: recorded in the graph)
        if capturing:
            # One graph may capture several run()s (one per layer), each over its own cache: later
            # plans must fit the smallest, or a replay would clamp a page of that one silently.
            if self.captured_pages is None or num_pages < self.captured_pages:
                self.captured_pages = num_pages
            if self._current is not None:
                self._current.graph_pages = self.captured_pages
        else:
            assert self._current is not None
            # (clamped in place: after a run() over a smaller cache, this one reads the list clamped to that)
            clamp = num_pages if self._clamped is None else min(num_pages, self._clamped[1])
            self._current.runs.append(ClampedRun(self._runs, num_pages, clamp))
            if self._clamped is None or num_pages < self._clamped[1]:
                self._clamped = (self._runs, num_pages)

    # ------------------------------------------------------------------ reports
    def poll(self, where: str) -> None:
        """plan()'s and run()'s start (not under capture: no event queries there): read the bounds
        that have landed, in the order they were queued; raise for the first plan whose list a
        run() or replay read clamped to a cache it is not inside."""
        for rec in [*self._waiting, *([self._current] if self._current is not None else [])]:
            if not rec.copy.landed():
                break  # (the later ones were queued after it)
            bounds = self._land(rec)
            message = self._clamped_read(rec, bounds)
            if message:
                raise LaunchError(f"{where}: {message}")

    def _land(self, rec: InFlight) -> PageBounds:
        low, high = rec.copy.values()
        bounds = PageBounds(rec.entries, low, high)
        if rec is self._current:
            self._current, self._bounds = None, bounds
        else:
            self._waiting.remove(rec)
        self._spare.append(rec.copy)
        return bounds

    def _which(self, run: int) -> str:
        ago = self._runs - run
        return "the last run()" if ago == 0 else f"the run() {ago} before the last"

    def _clamped_read(self, rec: InFlight, bounds: PageBounds) -> str | None:
        """What went wrong where a run() or replay read ``rec``'s list clamped to a cache it is not inside."""
        wrong = [r for r in rec.runs if not bounds.inside(r.clamp)]
        if wrong:
            first, later = wrong[0], wrong[1:]
            pages = first.pages  # (the first such run() read the list clamped to its own cache)
            message = (f"{self._which(first.run)} (#{first.run} of this wrapper) read a page list with entries "
                       f"outside its KV cache: plan() #{rec.plan}'s paged_kv_indices held page {bounds.worst()} "
                       f"(the cache had {pages} pages: expected 0 <= page < {pages}). "
                       f"{_CLAMPED.format(what='That run()', was='is')}")
            if later:
                named = "; ".join(
                    f"{self._which(r.run)} (#{r.run}): " + (
                        f"its cache had {r.pages} pages" if r.clamp == r.pages else
                        f"its cache had {r.pages} pages, but an earlier run() had clamped the list to {r.clamp}")
                    for r in later)
                message += f". Later run()s read the list clamped too, and their output is wrong as well: {named}"
            return message
        pages = rec.graph_pages
        if pages is not None and not bounds.inside(pages):
            return (f"plan() #{rec.plan}'s paged_kv_indices held page {bounds.worst()}, which is not a page of "
                    f"the KV cache the CUDA graph was captured with ({pages} pages: expected 0 <= page < {pages}). "
                    f"{_CLAMPED.format(what='Any replay of the captured run() after that plan()', was='was')}")
        return None


_CLAMPED = ("{what} ran with the list clamped to the cache on the GPU: it read nothing outside the cache, but its "
            "output {was} wrong. plan() had left the list's bounds to arrive from the GPU (a page list there with host "
            "indptrs, and nothing else read back); pass the page list on the host to have run() refuse such entries "
            "before the launch")


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


def check_pages(where: str, bounds: PageBounds, kv_indices: torch.Tensor | None, num_pages: int | None,
                cache: str, *, read_back: bool = True) -> None:
    """``bounds`` against a KV cache of ``num_pages`` pages (``cache`` says which one, for the
    message), or (None) against page numbers alone; ``kv_indices``: the tensor they were read
    from (None only without entries), read back for the message where ``read_back``."""
    if bounds.inside(num_pages):
        return
    assert kv_indices is not None
    hit = first_outside(kv_indices, bounds.entries, num_pages) if read_back else None
    if hit is not None:
        entry = f"paged_kv_indices[{hit[0]}]={hit[1]}"
    else:  # rewritten since plan() read it (the kernel reads plan()'s copy), or not read back
        entry = f"paged_kv_indices held page {bounds.worst()} when plan() read it, which"
    if num_pages is None:
        raise LaunchError(f"{where}: {entry} is not a page number (expected 0 <= page < the KV cache's page count)")
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


def refuse_grad(where: str, route: str, tensors: dict[str, Any]) -> None:
    """LaunchError naming the first of ``tensors`` (name -> value) that requires grad while
    autograd records: the FlashInfer kernels have no backward pass, and their output would
    silently drop the gradient."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise LaunchError(f"{where}: `{name}` requires grad, but the {route} route runs inference kernels with "
                              "no backward pass; use the flex route (make_wrapper(..., backend=\"flex\")) to train, "
                              "or run under torch.no_grad() / pass detached tensors")
