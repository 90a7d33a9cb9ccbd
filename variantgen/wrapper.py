"""The wrapper factory: a spec's module behind ``plan(...)`` / ``run(..., <args by name>)``.

``run`` checks every argument (dtype, shape, contiguity, device) before any launch and
names the argument in the error. The kernel sees *launch requests*: in the direct path
one per caller request; with the interval planner (planner.py) a request's rows may be
split into several, grouped into up to three launches by mask mode. Each launch request
carries a row of ``vg_meta`` telling the variant where it sits in the caller's batch, so
the generated mask always sees true positions and rows; q and o are read and written in
place (launch requests need not be packed), so nothing is gathered or scattered.

The same wrapper drives fa2 and fa3 (sm90) prefill modules. With the spec's planner module
(the default on CUDA), plan() runs the row pass and builds every launch, its metadata and
its schedule in one C++ call (native_plan.py) with one copy. Otherwise the launches are
built here in Python: for fa3 reshaped by planner.regroup_for_fa3 and each planned by the
module's own all-heads work list (whose items carry their requests' first rows); fa2
launches without split-KV scheduled by the planner module when there is one (O(tiles) on
the host), else by FlashInfer's scheduler. Graph mode (graph.py) fixes the launches and
their buffers at a capacity. Decode and ragged KV have their own wrappers (decode.py,
ragged.py) on the shared checks of WrapperBase.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import math
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .build import BuildResult, build_module, default_cache, load_module, select_backend
from .cache import Cache
from .checks import PageGuard, PlanCheck
from .env import settings
from .errors import LaunchError
from .expr import FLOAT32_MAX
from .graph import META_COLUMNS, META_KERNEL_WINDOW, GraphBuffers, GraphCapacity
from .intervals import IntervalForm, analyze, args_read, tensors_read
from .library import resolve_spec
from .native_plan import DESC_FIELDS, has_native_plan, plan_batch
from .planner import gather_page_ranges, gather_pages, page_gather_table, plan_launches, regroup_for_fa3
from .render import MASK_MODES, ModuleConfig, canonical_arch, canonical_dtype
from .spec import VariantSpec, shown_value, value_fits
from .staging import HostStaging

log = logging.getLogger("variantgen.wrapper")

TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp32": torch.float32,  # the flex route only (FlashInfer modules take 16-bit queries)
}
SPEC_TENSOR_DTYPES = {"int32": torch.int32, "float32": torch.float32}
LAYOUT_CODES = {"NHD": 0, "HND": 1}
INT_WORKSPACE_BYTES = 8 << 20
DEFAULT_MASK_MODES = ("none", "causal", "custom")
ALIGN_BYTES = 16  # the kernels move q/k/v/o rows in 16-byte vectors (cp.async, TMA)


@dataclass
class Launch:
    """One kernel launch: a batch of launch requests that share a mask mode."""

    mask_mode: str
    q_starts: torch.Tensor  # kernel q_indptr: first row of each launch request in q / o
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    meta: torch.Tensor  # [n, META_COLUMNS] int32
    window_left: int  # fa3: the launch's left window (-1: none); fa2 takes it per request from meta
    plan_info: Any
    int_workspace: torch.Tensor
    float_workspace: torch.Tensor
    num_requests: int


class IntervalFacts(NamedTuple):
    form: IntervalForm  # intervals.analyze(spec)
    args: frozenset[str]  # spec arguments the intervals read
    tensors: frozenset[str]  # ... of them the tensors (plan() needs them)


@dataclass(frozen=True)
class Batch:
    """The caller's batch as plan() saw it (host copies), to check run() against."""

    batch_size: int
    total_q: int
    total_kv: int
    num_qo_heads: int
    num_kv_heads: int
    page_size: int
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class WrapperBase:
    """What every kernel kind's wrapper shares: the module, the float workspace, and the
    checks of the spec's named arguments, scales, outputs and (paged kinds) page list.
    Subclasses set ``_batch`` (an object with the fields ``_dims`` reads) in plan().

    ``check_plan`` (default: VARIANTGEN_CHECK_PLAN): debug mode, in which run() verifies that
    the spec tensors plan() planned from still hold what plan() saw (checks.PlanCheck; a
    device sync per run())."""

    def __init__(self, spec: VariantSpec, config: ModuleConfig, module: Any, build: BuildResult | None,
                 float_workspace: torch.Tensor, kv_layout: str = "NHD", *, check_plan: bool | None = None):
        if kv_layout not in LAYOUT_CODES:
            raise LaunchError(f"kv_layout={kv_layout!r}: expected 'NHD' or 'HND'")
        if not isinstance(float_workspace, torch.Tensor) or float_workspace.dtype != torch.uint8:
            raise LaunchError("workspace: expected a torch.uint8 tensor (e.g. 128 MiB on the GPU)")
        if not float_workspace.is_contiguous():  # the kernels take its address and byte count
            raise LaunchError(f"workspace: expected a contiguous tensor (got strides {list(float_workspace.stride())})")
        if check_plan is not None and not isinstance(check_plan, bool):
            raise LaunchError(f"check_plan={check_plan!r}: expected a bool (or None: VARIANTGEN_CHECK_PLAN)")
        self.spec = spec
        self.config = config
        self.module = module
        self.build = build
        self.uri = build.entry.uri if build is not None else None  # None: no module (the flex route)
        self.kv_layout = kv_layout
        self.device = float_workspace.device
        self._float_workspace = float_workspace
        self._int_workspaces: list[torch.Tensor] = []
        self._pinned: list[torch.Tensor] = []
        self._tensor_names = [t.name for t in spec.tensors]
        self._scalar_names = [s.name for s in spec.scalars]
        self._batch: Any = None
        self._pdl: bool | None = None
        self._sms: int | None = None
        self._sched_ws: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sched_end = 0
        self._planned_args: dict[str, Any] = {}
        self.plan_stats: dict[str, Any] = {}
        self._staging = HostStaging(self.device)  # plan()'s host-to-device copies
        self._float_chunk_cache: dict[int, list[torch.Tensor]] = {}
        self.check_plan = settings().check_plan if check_plan is None else check_plan
        self._plan_check = PlanCheck() if self.check_plan else None
        # The planned page list's bounds, and run()'s guard where they are still on their way (checks.py).
        self._pages = PageGuard()

    def _workspace(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The i-th (int workspace, page-locked host mirror) pair; one per launch."""
        while len(self._int_workspaces) <= i:
            self._int_workspaces.append(torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device))
            self._pinned.append(torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8,
                                            pin_memory=self.device.type == "cuda"))
        return self._int_workspaces[i], self._pinned[i]

    def _float_chunks(self, n_launches: int) -> list[torch.Tensor]:
        """The caller's float workspace cut into ``n_launches`` equal slices (split-KV scratch:
        one per launch); kept per count (views cost host time every plan)."""
        chunks = self._float_chunk_cache.get(n_launches)
        if chunks is None:
            chunk = self._float_workspace.numel() // max(n_launches, 1)
            chunks = self._float_chunk_cache[n_launches] = [
                self._float_workspace[i * chunk:(i + 1) * chunk] for i in range(n_launches)]
        return chunks

    def _schedule_workspace(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (int workspace, page-locked mirror) that launches scheduled by the planner
        module share (each at its own offset)."""
        if self._sched_ws is None:
            self._grow_schedule_workspace(INT_WORKSPACE_BYTES)
        assert self._sched_ws is not None
        return self._sched_ws

    def _grow_schedule_workspace(self, nbytes: int) -> None:
        """A schedule workspace of at least ``nbytes`` (plan() waited for the copies out of the
        old mirror in staging.begin(); the old device buffer is freed in stream order)."""
        size = max(nbytes, INT_WORKSPACE_BYTES)
        self._sched_ws = (torch.empty(size, dtype=torch.uint8, device=self.device),
                          torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda"))

    def _num_sms(self) -> int:
        if self._sms is None:
            self._sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.device.type == "cuda" else 1)
        return self._sms

    def _pdl_default(self) -> bool:
        if self._pdl is None:
            self._pdl = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] >= 9
        return self._pdl

    @functools.cached_property
    def _interval_facts(self) -> IntervalFacts:
        """The spec's key intervals and the arguments they read (asked on every plan())."""
        form = analyze(self.spec)
        return IntervalFacts(form, frozenset(args_read(form, self.spec)), frozenset(tensors_read(form, self.spec)))

    def _intervals_default(self, spec_args: dict[str, Any], what: str) -> bool:
        """Whether ``what`` (the interval planner, decode's key trimming) is on by default: the
        mask's key intervals are known and plan() was given the spec tensors they read.
        Otherwise ``plan_stats["planner_off"]`` says why."""
        form, _, tensors = self._interval_facts
        if not form.planner_ready:
            self.plan_stats["planner_off"] = form.reason
            return False
        missing = sorted(tensors - set(spec_args))
        if missing:
            reason = f"plan() was not given {', '.join(missing)}, which the key intervals read"
            if reason != self.plan_stats.get("planner_off"):
                log.info("%s off for %s %s: %s", what, self.spec.name, self.config.kind, reason)
            self.plan_stats["planner_off"] = reason
            return False
        self.plan_stats.pop("planner_off", None)
        return True

    def _refuse_plan_args(self, spec_args: dict[str, Any], skip_tiles: bool | None, what: str) -> None:
        """plan() without ``what`` (the interval planner, key trimming) reads no spec argument:
        a LaunchError if it was given some (they go to run())."""
        if spec_args:
            self._check_known(spec_args, "plan()")  # a misspelt name first: it may be why `what` is off
            why = self.plan_stats.get("planner_off") if skip_tiles is None else "skip_tiles=False"
            raise LaunchError(f"plan(): unexpected argument(s) {sorted(spec_args)}: without {what} ({why}) "
                              "spec arguments go to run() only")

    def _sm_scale(self, q_scale: float | None, k_scale: float | None) -> float:
        """The softmax scale of the logits: the spec's (default 1/sqrt(head_dim_qk)) times q_scale * k_scale."""
        base = self.spec.sm_scale if self.spec.sm_scale is not None else 1.0 / math.sqrt(self.config.head_dim_qk)
        return float(base * (q_scale if q_scale is not None else 1.0) * (k_scale if k_scale is not None else 1.0))

    # ------------------------------------------------------------------ argument checks
    @staticmethod
    def _check_plan_sizes(**sizes: Any) -> None:
        """plan()'s num_qo_heads, num_kv_heads (and page_size): positive ints, whole GQA groups."""
        for name, value in sizes.items():
            if not _is_int(value) or value <= 0:
                raise LaunchError(f"plan(): {name}={value!r}: expected a positive int")
        if sizes["num_qo_heads"] % sizes["num_kv_heads"]:
            raise LaunchError(f"plan(): num_qo_heads={sizes['num_qo_heads']} is not a multiple of "
                              f"num_kv_heads={sizes['num_kv_heads']}")

    @staticmethod
    def _check_index_tensors(**tensors: Any) -> None:
        """plan()'s paged index tensors: 1-D torch.int32 (any device; read on the host)."""
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
                got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise LaunchError(f"plan(): {name}: expected a 1-D torch.int32 tensor, got {got}")

    @staticmethod
    def _check_indptr_starts(**firsts: int) -> None:
        """plan()'s indptrs start at 0: the kernels index q / o rows and the page list from the
        first row and entry of their tensors (an offset would be applied nowhere)."""
        for name, first in firsts.items():
            if first != 0:
                what = ("page lists are packed from the first entry of `paged_kv_indices`" if name == "paged_kv_indptr"
                        else "rows are packed from the first row of the tensor")
                raise LaunchError(f"plan(): `{name}`[0]={first}: expected 0 ({what})")

    # ------------------------------------------------------------------ the page list (checks.py)
    def _read_indptrs(self, kv_indices: torch.Tensor, kv_indptr: torch.Tensor, *indptrs: torch.Tensor,
                      ) -> tuple[list[list[int]], torch.Tensor, list[int]]:
        """host_indices of ``indptrs`` with, where that is a copy from the page list's device, the
        page list's bounds in the same copy: (lists, flat, folded bounds for begin_pages)."""
        folded = self._pages.fold(kv_indices, kv_indptr)
        lists, flat = host_indices(*indptrs, *folded)
        if not folded:
            return lists, flat, []
        return lists[:-2], flat[:flat.numel() - 2], [lists[-2][0], lists[-1][0]]

    def _begin_pages(self, kv_indices: torch.Tensor, entries: int, folded: list[int]) -> None:
        """plan(): start reading the bounds of the batch's page list ``kv_indices[:entries]``."""
        self._pages.begin(kv_indices, entries, folded)

    def _finish_pages(self) -> None:
        """plan()'s end (after its reads back): negative entries are refused here, and in CUDA-graph
        mode entries outside the captured cache; the rest is for run(), which has the cache. Bounds
        still on their way are run()'s to guard (checks.py)."""
        self._pages.finish()

    def _page_lists(self) -> list[torch.Tensor]:
        """The wrapper's copies of the page list that run()'s kernels read (the guard clamps them)."""
        return []

    def _own_pages(self, kv_indices: torch.Tensor, count: int) -> torch.Tensor:
        """The wrapper's contiguous device copy of ``kv_indices[:count]`` (a launch's page list as
        it is): the kernel reads what plan() checked, whatever the caller does with its tensor."""
        src = kv_indices[:count]
        if src.device.type == "cpu" and self.device.type == "cuda":
            return self._staging.to_device(src)  # through page-locked memory: no sync
        return torch.empty(count, dtype=torch.int32, device=self.device).copy_(src)

    def _capturing(self) -> bool:
        """Whether run() is being captured into a CUDA graph (its host code will not run again)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    # ------------------------------------------------------------------ check_plan (debug mode)
    def _check_replays(self) -> None:
        """plan()'s start: refuse if an earlier run() or replay read a page list clamped by the
        guard (checks.py), or (debug mode) if a replayed run() found a planned tensor changed since
        the plan it replayed (the graph recorded the comparison; this reads it back)."""
        self._pages.poll("plan()")
        if self._plan_check is None:
            return
        self._plan_check.clear()
        changed = self._plan_check.replays_changed()
        if changed:
            names = ", ".join(f"`{n}`" for n in changed)
            raise LaunchError(f"plan(): {names} changed after the previous plan() read it, and a replay of the "
                              "captured run() ran with the new values (check_plan=True): that replay's launches "
                              "were planned from the old values, so its output was wrong. Call plan() after "
                              "changing a tensor the plan reads, before replaying")

    def _snapshot_planned(self) -> None:
        """plan()'s end, debug mode: copy the planned spec tensors."""
        if self._plan_check is not None:
            self._plan_check.snapshot({k: v for k, v in self._planned_args.items() if isinstance(v, torch.Tensor)})

    def _verify_planned(self) -> None:
        if self._plan_check is not None:
            self._plan_check.verify(self._capturing())

    def _dims(self) -> dict[str, int]:
        b = self._batch
        assert b is not None
        return {"total_q": b.total_q, "total_kv": b.total_kv, "batch": b.batch_size,
                "num_qo_heads": b.num_qo_heads, "num_kv_heads": b.num_kv_heads}

    def _dim_capacity(self) -> dict[str, int]:
        """Graph mode: the largest size each batch-dependent dim may have (static buffers)."""
        return {}

    def _check_known(self, given: dict[str, Any], where: str) -> None:
        """LaunchError for keywords that are no spec argument, with the closest name (a spec
        argument, or the method's own keyword: `skip_tile=` for skip_tiles)."""
        known = self._tensor_names + self._scalar_names
        extra = sorted(set(given) - set(known))
        if not extra:
            return
        method = getattr(type(self), where.removesuffix("()"), None)
        own = [n for n, p in inspect.signature(method).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY] if method is not None else []
        named = []
        for name in extra:
            close = difflib.get_close_matches(name, [*known, *own], n=1, cutoff=0.6)
            named.append(f"{name} (did you mean `{close[0]}`?)" if close else name)
        takes = ", ".join(known) or "no extra arguments"
        raise LaunchError(f"{where}: unexpected argument(s) {', '.join(named)}; spec `{self.spec.name}` takes: "
                          f"{takes} (plus q_scale, k_scale, v_scale, out, return_lse in run())")

    def _check_args(self, given: dict[str, Any], *, where: str, require_tensors_from: str | None = None,
                    ) -> dict[str, Any]:
        self._check_known(given, where)
        dims = self._dims()
        out: dict[str, Any] = {}
        for t in self.spec.tensors:
            if t.name not in given:
                if require_tensors_from is not None:
                    continue  # plan(): only what the intervals read is required (checked by the planner)
                raise LaunchError(f"{where}: missing tensor argument `{t.name}` "
                                  f"({t.dtype}, shape {list(t.shape)}: {t.doc or 'see the spec'})")
            value = given[t.name]
            want_shape = tuple(dims[d] if isinstance(d, str) else d for d in t.shape)
            shape_text = "[" + ", ".join(f"{d}={dims[d]}" if isinstance(d, str) else str(d) for d in t.shape) + "]"
            caps = self._dim_capacity()
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
            if value.device != self.device:
                raise LaunchError(f"{where}: `{t.name}` is on {value.device}, expected {self.device} "
                                  "(the device of the workspace)")
            if not value.is_contiguous():
                raise LaunchError(f"{where}: `{t.name}` must be contiguous (call .contiguous(); it is not copied "
                                  "implicitly so that CUDA-graph pointers stay stable)")
            out[t.name] = value
        for s in self.spec.scalars:
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

    def _check_tensor(self, name: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...],
                      layout_text: str = "") -> torch.Tensor:
        """A run() tensor: type, dtype, shape (``layout_text`` names the dims in messages), device."""
        layout = f" {layout_text}" if layout_text else ""
        if not isinstance(t, torch.Tensor):
            raise LaunchError(f"run(): `{name}`: expected a tensor{layout}, got {type(t).__name__}")
        if t.dtype != dtype:
            raise LaunchError(f"run(): `{name}`: expected dtype {dtype} (the wrapper was built for it), got {t.dtype}")
        if tuple(t.shape) != shape:
            raise LaunchError(f"run(): `{name}`: expected shape {list(shape)}{layout}, got {list(t.shape)}")
        if t.device != self.device:
            raise LaunchError(f"run(): `{name}` is on {t.device}, expected {self.device}")
        return t

    def _check_rows(self, name: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...], layout_text: str = "",
                    ) -> torch.Tensor:
        """A q/k/v tensor the kernel reads through its strides: the shared checks, then a contiguous
        last dim, 16-byte aligned rows and strides that fit the kernels' 32-bit stride fields."""
        self._check_tensor(name, t, dtype, shape, layout_text)
        if t.numel() == 0:
            return t
        *outer, last = strides = t.stride()
        if last != 1:
            raise LaunchError(f"run(): `{name}` must have a contiguous last dimension (stride {strides})")
        unit = ALIGN_BYTES // t.element_size()
        if t.data_ptr() % ALIGN_BYTES or any(s % unit for s in outer):
            raise LaunchError(f"run(): `{name}`: rows must start at {ALIGN_BYTES}-byte boundaries (data pointer and "
                              f"strides {list(strides)} in multiples of {unit} elements); call .contiguous()")
        if max(outer) >= 2**31:
            raise LaunchError(f"run(): `{name}`: strides {list(strides)} do not fit the kernel's 32-bit strides")
        return t

    def _check_scales(self, q_scale: Any, k_scale: Any, v_scale: Any) -> None:
        if not self.spec.qkv_scales and any(x is not None for x in (q_scale, k_scale, v_scale)):
            raise LaunchError(f"run(): spec `{self.spec.name}` sets `scales.qkv_scales: false`; "
                              "q_scale/k_scale/v_scale are not accepted")
        for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value)):
                raise LaunchError(f"run(): `{name}`: expected a finite float, got {value!r} "
                                  "(per-head scale tensors are not supported)")

    def _kernel_args(self, args: dict[str, Any], q_scale: float | None, k_scale: float | None,
                     v_scale: float | None) -> tuple[list[torch.Tensor], list[Any]]:
        """The module's extra run() arguments in ABI order, except vg_meta (which the caller
        inserts after the spec tensors): (spec tensors, scalars incl. sm_scale/v_scale)."""
        tensors = [args[t] for t in self._tensor_names]
        scalars = [args[s] for s in self._scalar_names] + [self._sm_scale(q_scale, k_scale)]
        if self.spec.qkv_scales:
            scalars.append(float(v_scale) if v_scale is not None else 1.0)
        return tensors, scalars

    def _check_planned_args(self, args: dict[str, Any]) -> None:
        for name, value in self._planned_args.items():
            if isinstance(value, torch.Tensor):
                if args[name].data_ptr() != value.data_ptr():
                    raise LaunchError(f"run(): `{name}` is not the tensor plan() was given; the interval plan "
                                      "was computed from that one - plan again with the new tensor")
            elif args[name] != value:
                raise LaunchError(f"run(): `{name}`={args[name]!r} but plan() planned with {value!r} (the key "
                                  f"intervals depend on it); pass {name}= to plan() as well, or plan again")

    def _outputs(self, out: torch.Tensor | None, return_lse: bool, rows: int | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out (checked, or allocated) and lse with ``rows`` rows (default: the batch's total_q)."""
        b, cfg = self._batch, self.config
        rows = b.total_q if rows is None else rows
        odt = TORCH_DTYPES[cfg.o_dtype]
        if out is None:
            out = torch.empty(rows, b.num_qo_heads, cfg.head_dim_vo, dtype=odt, device=self.device)
        else:
            # The fa2 kernels write o at row * num_qo_heads * head_dim_vo (their o strides are not
            # arguments); fa3 takes o's strides, but one rule for both backends.
            self._check_tensor("out", out, odt, (rows, b.num_qo_heads, cfg.head_dim_vo))
            if not out.is_contiguous():
                raise LaunchError(f"run(): `out` must be contiguous (the kernel writes rows of num_qo_heads * "
                                  f"head_dim_vo elements back to back; got strides {list(out.stride())})")
            if out.data_ptr() % ALIGN_BYTES:
                raise LaunchError(f"run(): `out` must start at a {ALIGN_BYTES}-byte boundary (the kernel writes "
                                  f"{ALIGN_BYTES}-byte vectors); call .contiguous() on a fresh tensor")
        lse = torch.empty(rows, b.num_qo_heads, dtype=torch.float32, device=self.device) if return_lse else None
        return out, lse

    def _check_paged_run(self, q: Any, q_shape: tuple[int, ...], paged_kv_cache: Any,
                         scales: tuple[Any, Any, Any], spec_args: dict[str, Any],
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """run()'s checks over a paged KV cache, in order: q, the cache, q/k/v scales, the
        spec's arguments (and that they are what plan() planned with). Returns (k_cache,
        v_cache, checked spec arguments). First, a report of an earlier run() that read a page
        list clamped by the guard (checks.py)."""
        if not self._capturing():  # (no event queries under capture)
            self._pages.poll("run()")
        self._check_rows("q", q, TORCH_DTYPES[self.config.q_dtype], q_shape)
        k_cache, v_cache = self._check_paged_cache(paged_kv_cache)
        self._check_scales(*scales)
        args = self._check_args(spec_args, where="run()")
        self._check_planned_args(args)
        self._verify_planned()
        return k_cache, v_cache, args

    def _check_paged_cache(self, paged_kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) from a pair or a [pages, 2, ...] tensor, checked against the plan:
        shapes, strides the kernel can take, and every planned page inside the cache (or, where
        plan() left the bounds on their way, the kernels' page lists clamped to it)."""
        b, cfg = self._batch, self.config
        kvdt = TORCH_DTYPES[cfg.kv_dtype]
        if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
            k_cache, v_cache = paged_kv_cache
        elif isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2:
            k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
        else:
            raise LaunchError("run(): `paged_kv_cache`: expected (k_cache, v_cache) or one tensor "
                              "[num_pages, 2, ...]")
        for name, t, head_dim in (("k_cache", k_cache, cfg.head_dim_qk), ("v_cache", v_cache, cfg.head_dim_vo)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise LaunchError(f"run(): `{name}`: expected a 4-D tensor")
            page_dim, head_axis = (1, 2) if self.kv_layout == "NHD" else (2, 1)
            if t.shape[page_dim] != b.page_size or t.shape[head_axis] != b.num_kv_heads or t.shape[3] != head_dim:
                layout = "[pages, page_size, kv_heads, head_dim]" if self.kv_layout == "NHD" else \
                    "[pages, kv_heads, page_size, head_dim]"
                raise LaunchError(f"run(): `{name}`: expected {layout} with page_size={b.page_size}, "
                                  f"kv_heads={b.num_kv_heads}, head_dim={head_dim}; got {list(t.shape)}")
            if t.dtype != kvdt:
                raise LaunchError(f"run(): `{name}`: expected dtype {kvdt}, got {t.dtype}")
            if t.device != self.device:
                raise LaunchError(f"run(): `{name}` is on {t.device}, expected {self.device}")
            *outer, last = strides = t.stride()
            if last != 1:
                raise LaunchError(f"run(): `{name}` must have a contiguous last dimension")
            # The kernels load 16-byte vectors through the cache's strides, stored as 32-bit fields.
            unit = ALIGN_BYTES // t.element_size()
            if (t.data_ptr() % ALIGN_BYTES or any(s % unit for s in outer)) and t.numel():
                raise LaunchError(f"run(): `{name}`: pages and rows must start at {ALIGN_BYTES}-byte boundaries "
                                  f"(data pointer and strides {list(strides)} in multiples of {unit} elements)")
            if max(outer) >= 2**32:
                raise LaunchError(f"run(): `{name}`: strides {list(strides)} do not fit the kernel's 32-bit strides")
        if k_cache.stride() != v_cache.stride():
            raise LaunchError(f"run(): k_cache and v_cache must have identical strides (got {k_cache.stride()} and "
                              f"{v_cache.stride()}); this module is compiled for equal K/V strides")
        num_pages = k_cache.shape[0]
        if v_cache.shape[0] != num_pages:
            raise LaunchError(f"run(): k_cache has {num_pages} pages and v_cache {v_cache.shape[0]}; expected the "
                              "same page count (a page number addresses both)")
        self._pages.check_run(num_pages, self._capturing(), self._page_lists)
        return k_cache, v_cache


class VariantWrapper(WrapperBase):
    """Paged-KV prefill for one spec, dtype and head-dim combination (see make_wrapper).
    ``graph``: CUDA-graph mode with buffers for at most that batch (graph.py)."""

    def __init__(self, *args: Any, graph: GraphCapacity | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._launches: list[Launch] = []
        self._graph: GraphBuffers | None = None
        if graph is not None:
            if not isinstance(graph, GraphCapacity):
                raise LaunchError(f"graph={graph!r}: expected a variantgen.GraphCapacity (or None)")
            if self.config.backend != "fa2":
                raise LaunchError(f"graph=: CUDA-graph mode needs the fa2 backend (this wrapper is "
                                  f"{self.config.backend}: its launch set depends on the batch); make the "
                                  "wrapper with backend='fa2'")
            self._graph = GraphBuffers(graph, self.device)
        # The spec's generated row kernel for the interval planner (rowplan.py), set by
        # make_wrapper on CUDA; None: plan() classifies rows with torch ops (and says why).
        self.row_planner: Any = None
        self.row_planner_reason = ""
        self.segment_capacity = 1024  # launch requests the row kernel's read-back has room for
        self.segment_read = 64  # launch requests plan() copies back at first (more: a second copy)
        self.row_buffers: dict[str, torch.Tensor] = {}  # the row kernel's outputs, kept across plans
        self._native_desc = torch.zeros(DESC_FIELDS, dtype=torch.int64)  # plan_batch's answer

    def _page_lists(self) -> list[torch.Tensor]:
        if self._graph is not None:  # every slot's whole buffer (what a captured launch reads)
            return [self._graph.kv_indices]
        return [la.kv_indices for la in self._launches]

    def _trim_to_batch(self, args: dict[str, Any]) -> dict[str, Any]:
        """Spec tensors given as capacity-sized static buffers, cut to this batch's sizes
        (views from the start: same data_ptr) for the planner, which sizes work by them."""
        dims = self._dims()
        out = dict(args)
        for t in self.spec.tensors:
            if t.name in out:
                out[t.name] = out[t.name][tuple(slice(0, dims[d] if isinstance(d, str) else d) for d in t.shape)]
        return out

    def _dim_capacity(self) -> dict[str, int]:
        if self._graph is None or self._batch is None:
            return {}
        cap = self._graph.capacity
        return {"total_q": cap.max_total_q, "batch": cap.max_batch_size,
                "total_kv": cap.max_kv_pages * self._batch.page_size}

    def _kv_dtype_bytes(self) -> int:
        return 1 if self.config.kv_dtype.startswith("fp8") else 2

    def _own_schedule_min_tiles(self, disable_split_kv: bool) -> int:
        """Query tiles from which a launch gets the planner module's fa2 work list (no split-KV)
        rather than FlashInfer's scheduler. FlashInfer splits KV only when the tiles cannot fill
        its grid (2 CTAs per SM over the KV heads); with at least that many it would not split,
        and the planner module's work list is its. 0: always (split-KV off, or graph mode)."""
        if disable_split_kv or self._graph is not None:
            return 0
        assert self._batch is not None
        return 2 * self._num_sms() // self._batch.num_kv_heads

    def set_row_planner(self, module: Any, reason: str = "") -> None:
        """Use the spec's row kernel in plan() (None: the torch rules, ``reason`` says why)."""
        self.row_planner, self.row_planner_reason = module, reason

    # ------------------------------------------------------------------ plan
    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, page_size: int,
             *, skip_tiles: bool | None = None, disable_split_kv: bool = False, **spec_args: Any) -> None:
        """Plan a batch. ``skip_tiles`` turns the interval planner on/off (default: on where
        the spec's intervals are known). With the planner on, spec tensors the intervals
        read must be passed here by name as well.

        The index tensors (int32, any device; indptrs starting at 0) are read here, once:
        the launches get their own copies of the indptrs, lengths and page list, so changing
        them after plan() changes nothing. Every entry of the batch's page list,
        ``paged_kv_indices[:paged_kv_indptr[-1]]``, must be a page of the KV cache run() is
        given: negative entries are refused here, the rest by run(), which has the cache (in
        CUDA-graph mode, where replays run no host code, also here against the cache the graph
        was captured with). plan() never waits for the GPU to read the list's bounds: with the
        page list on the GPU and the indptrs on the host, and nothing else read back, they may
        still be on their way when run() is called; run() then clamps the kernels' copy of the
        list to the cache on the GPU, and the next plan() or run() raises once they show entries
        outside it (checks.py). Pass the page list on the host to have them refused up front.

        Contract: the tensors plan() reads must not change until the next plan(). run()
        re-reads q, the KV cache and the spec tensors, but the launches - which rows go to
        which mask mode, which pages each reads - are fixed here from the values of the spec
        tensors the intervals read (e.g. ``ranges``, ``doc_ids``): rewriting those in place
        without planning again gives a wrong output. ``check_plan=True`` detects it.
        """
        # A plan() that fails must not leave the previous plan half-replaced.
        self._batch, self._launches, self._planned_args = None, [], {}
        self._check_replays()
        check_paged_arguments(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                              num_qo_heads, num_kv_heads, page_size)
        self._staging.begin()
        (qo_h, kvp_h, last_h), indices_h, folded = self._read_indptrs(
            paged_kv_indices, paged_kv_indptr, qo_indptr, paged_kv_indptr, paged_kv_last_page_len)
        batch_of = paged_batch(qo_h, kvp_h, last_h, paged_kv_indices.numel(), num_qo_heads, num_kv_heads, page_size)
        graph = self._graph
        if graph is not None:
            graph.capacity.check_batch(batch_of.batch_size, qo_h[-1], kvp_h[-1])
            disable_split_kv = True  # split-KV changes the schedule from batch to batch
        self._begin_pages(paged_kv_indices, kvp_h[-1], folded)
        self._batch = batch_of
        try:
            self._plan_batch(qo_h, kvp_h, last_h, indices_h, paged_kv_indices, skip_tiles, disable_split_kv,
                             spec_args)
            self._finish_pages()
            self._snapshot_planned()
        except BaseException:
            self._batch, self._launches, self._planned_args = None, [], {}
            raise

    def _plan_batch(self, qo_h: list[int], kvp_h: list[int], last_h: list[int], indices_h: torch.Tensor,
                    kv_indices: torch.Tensor, skip_tiles: bool | None, disable_split_kv: bool,
                    spec_args: dict[str, Any]) -> None:
        """plan() once the batch is checked: the launches, by the interval planner or direct."""
        b, graph = self._batch, self._graph
        assert b is not None
        if b.total_q == 0:  # nothing to compute; run() returns empty outputs
            self.plan_stats["launches"] = []
            if graph is not None:  # ... but a captured graph still replays: plan empty launches
                self._launches = self._make_launches(graph.slot_launches([]), kv_indices, True)
            return
        use_planner = (bool(skip_tiles) if skip_tiles is not None
                       else self._intervals_default(spec_args, "interval planner"))
        if use_planner:
            checked = self._check_args(spec_args, where="plan()", require_tensors_from="intervals")
            read = self._interval_facts.args
            self._planned_args = {k: v for k, v in checked.items() if k in read}
            if graph is not None:
                checked = self._trim_to_batch(checked)
            if graph is None and has_native_plan(self.row_planner):  # the whole plan in one C++ call
                self._launches = plan_batch(self, indices_h, checked, kv_indices, disable_split_kv)
                self._staging.record()
                return
            launches = plan_launches(self, qo_h, kvp_h, list(b.kv_lens), checked)
        else:
            self._refuse_plan_args(spec_args, skip_tiles, "the interval planner")
            kv_row = list(accumulate(b.kv_lens, initial=0))
            meta = [[qo_h[r], b.kv_lens[r] - b.qo_lens[r], 0, r, kv_row[r], b.qo_lens[r], b.kv_lens[r], -1,
                     b.qo_lens[r]] for r in range(b.batch_size)]
            launches = [dict(mask_mode="custom", q_starts=qo_h, plan_qo=qo_h, kv_indptr=kvp_h,
                             kv_indices=kv_indices, last_page_len=last_h, meta=meta)]
        if self.config.backend == "fa3":
            launches = regroup_for_fa3(launches)
        if graph is not None:
            launches = graph.slot_launches(launches)
        self._launches = self._make_launches(launches, kv_indices, disable_split_kv)
        self.plan_stats["launches"] = [(la["mask_mode"], len(la["meta"])) for la in launches if la["meta"]]

    def _make_launches(self, launches: list[dict], kv_indices: torch.Tensor, disable_split_kv: bool) -> list[Launch]:
        """Device metadata and a schedule per launch. Planned launches name ranges of the
        caller's page list (gathered here, all at once); the direct launch takes the list as it
        is. Everything the device needs goes over in two staged copies, not one per tensor.
        In graph mode both land in the wrapper's fixed buffers (the launches are its slots)."""
        dev = self.device
        staging = self._staging
        graph = self._graph
        ranges = [r for launch in launches for r in launch.get("page_ranges", ())]
        kernel = self.row_planner if hasattr(self.row_planner, "gather_pages") else None  # the planner module
        table, total = page_gather_table(ranges)
        self._sched_end = 0  # bytes of the shared schedule workspace used so far
        if graph is None:
            flat, sizes = list(table), [len(table)]  # the page gather's table and the launch metadata: one copy
            for launch in launches:
                n = len(launch["meta"])
                flat += launch["q_starts"]
                flat += launch["kv_indptr"]
                flat += launch["last_page_len"]
                for row in launch["meta"]:
                    flat += row
                sizes += [n + 1, n + 1, n, n * META_COLUMNS]
            parts = staging.to_device(flat, torch.int32).split(sizes)  # every view in one op
            pages = gather_pages(kv_indices, parts[0].view(2, -1), total, dev, kernel)
            padded: list[dict | None] = [None] * len(launches)
        else:
            pages = gather_page_ranges(kv_indices, ranges, staging, kernel)
            padded = [graph.write_slot(i, launch) for i, launch in enumerate(launches)]
            graph.metadata.copy_(graph.host, non_blocking=True)
        out, page_at = [], 0
        for i, launch in enumerate(launches):
            views = ({} if graph is not None else
                     dict(zip(("q_starts", "kv_indptr", "last_page_len", "meta"), parts[1 + 4 * i:5 + 4 * i])))
            count = launch["kv_indptr"][-1]
            if "page_ranges" in launch:
                views["kv_indices"] = pages[page_at:page_at + count]
                page_at += count
            elif graph is None:
                views["kv_indices"] = self._own_pages(launch["kv_indices"], count)
            else:  # into the graph's page list below
                views["kv_indices"] = launch["kv_indices"][:count]
            if graph is not None:
                fixed = graph.slot_views(i)
                fixed["kv_indices"][:count].copy_(views["kv_indices"])
                views = fixed
            # Split-KV writes partial rows packed and merges them into packed rows, so it is only
            # allowed where a launch's requests are back to back in q/o. Nor where a launch request
            # has a kernel window: FlashInfer's fa2 kernel sizes each request's split-KV partial rows
            # from the window it is run with (min(kv_len, window_left + CTA_TILE_Q)), its scheduler
            # from the window it is planned with - one per launch, while fa2 takes the window per
            # launch request (vg_meta). Planned with -1, a windowed request's partial rows land at
            # the wrong offsets: wrong rows, or NaN (tests/test_gpu_regressions.py).
            split_off = disable_split_kv or not launch.get("packed", True) or has_kernel_window(launch["meta"])
            out.append(self._make_launch(i, len(launches), launch, split_off, views, padded[i]))
        if self._sched_end:
            sched_ws, sched_pinned = self._schedule_workspace()
            sched_ws[:self._sched_end].copy_(sched_pinned[:self._sched_end], non_blocking=True)
        # Copies from page-locked memory (int workspace mirrors, graph metadata) are queued: the
        # next plan() rewrites that memory only after they ran.
        staging.record()
        return out

    def _make_launch(self, i: int, n_launches: int, launch: dict, disable_split_kv: bool,
                     views: dict[str, torch.Tensor], padded: dict[str, torch.Tensor] | None) -> Launch:
        """One launch's schedule: the planner module's where it has one and KV is not split
        (O(tiles) on the host), else FlashInfer's. ``padded``: graph mode's capacity-padded
        host indptrs (graph.write_slot)."""
        b, cfg, graph = self._batch, self.config, self._graph
        assert b is not None
        int_ws, pinned = self._workspace(i)
        if padded is not None:
            plan_qo, kv_indptr_h, q_starts_h = padded["plan_qo"], padded["kv_indptr"], padded["q_starts"]
        else:  # both host indptrs from one list (one tensor op)
            n = len(launch["meta"])
            both = torch.tensor(launch["plan_qo"] + launch["q_starts"], dtype=torch.int32)
            plan_qo, q_starts_h, kv_indptr_h = both[:n + 1], both[n + 1:], None
        n = plan_qo.numel() - 1
        float_ws = self._float_chunks(n_launches)[i]
        if cfg.backend == "fa3":
            plan_info = self._plan_fa3(launch, plan_qo, q_starts_h[:n], float_ws, int_ws, pinned)
        else:
            plan_info = self._schedule_fa2(plan_qo, q_starts_h, disable_split_kv)
            if plan_info is not None:  # in the shared schedule workspace, with o_indptr = q_starts
                int_ws = self._schedule_workspace()[0]
                if graph is not None:
                    graph.check_plan_info(i, plan_info)
            else:  # FlashInfer's scheduler; in graph mode its CUDA-graph scheduling over the capacity
                if kv_indptr_h is None:
                    kv_indptr_h = torch.tensor(launch["kv_indptr"], dtype=torch.int32)
                total_rows = graph.capacity.max_total_q if graph else int(plan_qo[-1])
                unpacked = not launch.get("packed", True)
                int_ws, plan_info = self._flashinfer_plan(i, plan_qo, kv_indptr_h, total_rows, float_ws,
                                                          disable_split_kv, views["q_starts"] if unpacked else None)
        q_starts = views["q_starts"]
        return Launch(
            mask_mode=launch["mask_mode"],
            q_starts=q_starts,
            kv_indptr=views["kv_indptr"],
            kv_indices=views["kv_indices"],
            last_page_len=views["last_page_len"],
            meta=views["meta"].view(n, META_COLUMNS),
            window_left=int(launch.get("window_left", -1)),
            plan_info=plan_info,
            int_workspace=int_ws,
            float_workspace=float_ws,
            num_requests=n,
        )

    def _flashinfer_plan(self, i: int, plan_qo: torch.Tensor, kv_indptr_h: torch.Tensor, total_rows: int,
                         float_ws: torch.Tensor, disable_split_kv: bool, o_rows: torch.Tensor | None,
                         ) -> tuple[torch.Tensor, Any]:
        """FlashInfer's fa2 scheduler for launch ``i`` (host plan_qo / kv_indptr) in the i-th
        int workspace: (that workspace, plan_info). ``o_rows`` (device, one entry per launch
        request + 1): where the launch requests' rows start in o when they are not back to back."""
        b = self._batch
        assert b is not None
        int_ws, pinned = self._workspace(i)
        n = plan_qo.numel() - 1
        plan_info = self.module.plan(
            float_ws, int_ws, pinned, plan_qo, kv_indptr_h, total_rows, n, b.num_qo_heads, b.num_kv_heads,
            b.page_size, self._graph is not None, -1, -1, bool(disable_split_kv or o_rows is not None))
        if self._graph is not None:
            self._graph.check_plan_info(i, plan_info)
        if o_rows is not None:
            # Launch requests are not back to back in q/o: the kernel takes each one's first
            # row from q_indptr (our q_starts) but writes o (and lse) at the plan's o_indptr,
            # which the scheduler packed. Point o_indptr at the same rows (split-KV is off for
            # such launches, so o_indptr has exactly one entry per launch request).
            info = list(plan_info)
            if info[14]:
                raise LaunchError("internal: a planned launch must not split KV")
            offset = int(info[8])
            int_ws[offset:offset + 4 * (n + 1)].view(torch.int32).copy_(o_rows)
        return int_ws, plan_info

    def _plan_fa3(self, launch: dict, plan_qo: torch.Tensor, q_starts_h: torch.Tensor, float_ws: torch.Tensor,
                  int_ws: torch.Tensor, pinned: torch.Tensor) -> Any:
        """The fa3 module's work list: it takes kv lengths, and each item's first row from
        ``q_starts_h`` (one per launch request)."""
        b = self._batch
        n = plan_qo.numel() - 1
        kv_indptr_h = torch.tensor(launch["kv_indptr"], dtype=torch.int32)
        pages = kv_indptr_h[1:] - kv_indptr_h[:-1]
        last = torch.tensor(launch["last_page_len"], dtype=torch.int32)
        kv_lens_h = torch.where(pages > 0, (pages - 1) * b.page_size + last, torch.zeros_like(pages))
        return self.module.plan(float_ws, int_ws, pinned, plan_qo, kv_indptr_h, kv_lens_h, q_starts_h,
                                int(plan_qo[-1]), n, b.num_qo_heads, b.num_kv_heads, b.page_size,
                                launch["mask_mode"] == "causal")

    def _schedule_fa2(self, plan_qo: torch.Tensor, q_starts_h: torch.Tensor, disable_split_kv: bool,
                      ) -> list[int] | None:
        """The planner module's work list for an fa2 launch (no split-KV, O(tiles) on the host),
        written at the next offset of the shared schedule workspace; None where there is no
        planner module, or where split-KV is allowed and could pay (then FlashInfer schedules)."""
        if not hasattr(self.row_planner, "schedule"):
            return None
        b, cfg, graph = self._batch, self.config, self._graph
        info = list(self.row_planner.schedule(
            self._schedule_workspace()[1], self._sched_end, plan_qo, q_starts_h, b.num_qo_heads, b.num_kv_heads,
            cfg.head_dim_qk, cfg.head_dim_vo, self._kv_dtype_bytes(), graph.capacity.max_total_q if graph else 0))
        end = info.pop()
        if info[0] < self._own_schedule_min_tiles(disable_split_kv):
            return None
        self._sched_end = -(-end // 16) * 16
        return info

    # ------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, paged_kv_cache: Any, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None, **spec_args: Any):
        """Attention of ``q`` [total_q, num_qo_heads, head_dim_qk] over ``paged_kv_cache`` ((k_cache,
        v_cache), or one [num_pages, 2, ...] tensor) for the planned batch; returns ``out``
        [total_q, num_qo_heads, head_dim_vo] (contiguous), or ``(out, lse)`` with ``return_lse=True``
        (base-2 LSE, float32 [total_q, num_qo_heads]). Spec arguments by name.

        run() reads q, the cache and the spec tensors; the launches are plan()'s (see its
        contract). It checks every argument first, and the planned page list against the
        cache's page count - or, where plan() left the list's bounds on their way, clamps the
        kernels' copy of it to the cache on the GPU before the launch; a later plan() or run()
        raises if they show that the clamp changed anything (checks.py). It raises first for
        such an earlier run(). Under CUDA-graph capture it records the clamp in the graph and
        remembers the cache's page count, which later plan()s check against (replays run no
        host code)."""
        if self._batch is None or (self._batch.total_q and not self._launches):  # none, or plan() failed
            raise LaunchError("run() called before plan(): call plan(qo_indptr, paged_kv_indptr, ...) first")
        b = self._batch
        cfg = self.config
        rows = b.total_q
        if self._graph is not None and isinstance(q, torch.Tensor) and q.dim() == 3:
            # Graph mode: q / out may be the capture's static buffers, up to capacity rows
            # (rows past this batch's total_q are neither read nor written).
            if b.total_q <= q.shape[0] <= self._graph.capacity.max_total_q:
                rows = q.shape[0]
        k_cache, v_cache, args = self._check_paged_run(
            q, (rows, b.num_qo_heads, cfg.head_dim_qk), paged_kv_cache, (q_scale, k_scale, v_scale), spec_args)
        out, lse = self._outputs(out, return_lse, rows)
        tensors, scalars = self._kernel_args(args, q_scale, k_scale, v_scale)
        layout = LAYOUT_CODES[self.kv_layout]
        if enable_pdl is None:  # programmatic dependent launch: sm90+, as FlashInfer defaults
            enable_pdl = self._pdl_default()
        fa3 = self.config.backend == "fa3"
        for la in self._launches:
            code = MASK_MODES[la.mask_mode][0]
            if fa3:
                self.module.paged_run(
                    la.float_workspace, la.int_workspace, la.plan_info, q, k_cache, v_cache, la.kv_indices, out,
                    lse, code, layout, la.window_left, enable_pdl, *tensors, la.meta, *scalars)
            else:
                self.module.paged_run(
                    la.float_workspace, la.int_workspace, la.plan_info, q, k_cache, v_cache, la.q_starts,
                    la.kv_indptr, la.kv_indices, la.last_page_len, out, lse, code, layout,
                    -1, enable_pdl, *tensors, la.meta, *scalars)
        return (out, lse) if return_lse else out


def has_kernel_window(meta: list[list[int]]) -> bool:
    """Whether a launch has a launch request that the kernel may prune with a left window."""
    return any(row[META_KERNEL_WINDOW] >= 0 for row in meta)


def host_lists(*tensors: torch.Tensor) -> list[list[int]]:
    """Host copies of small index tensors as int lists (see host_indices)."""
    return host_indices(*tensors)[0]


def host_indices(*tensors: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Host copies of small 1-D index tensors of one dtype: as int lists, and back to back in one
    CPU tensor. One device-to-host copy for all of them when they share a CUDA device (each
    copy is a sync)."""
    if len({t.device for t in tensors}) == 1:
        flat = torch.cat(tensors).cpu()
    else:
        flat = torch.cat([t.cpu() for t in tensors])
    values = flat.tolist()
    out, at = [], 0
    for t in tensors:
        out.append(values[at:at + t.numel()])
        at += t.numel()
    return out, flat


class PagedBatchLists(NamedTuple):
    """A paged batch as plan() checked it: the Batch and host copies of its index tensors."""

    batch: Batch
    qo_indptr: list[int]
    kv_indptr: list[int]
    last_page_len: list[int]
    host: torch.Tensor  # the three back to back on the host (host_indices)


def check_paged_arguments(qo_indptr: Any, paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any,
                          num_qo_heads: Any, num_kv_heads: Any, page_size: Any) -> None:
    """plan()'s checks of a paged batch's arguments before their values are read (sizes, index
    tensor types, entry counts), shared by every paged-prefill route."""
    WrapperBase._check_plan_sizes(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_size=page_size)
    WrapperBase._check_index_tensors(qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr,
                                     paged_kv_indices=paged_kv_indices, paged_kv_last_page_len=paged_kv_last_page_len)
    batch = qo_indptr.numel() - 1
    if batch < 1 or paged_kv_indptr.numel() != batch + 1 or paged_kv_last_page_len.numel() != batch:
        raise LaunchError(
            f"plan(): inconsistent batch: qo_indptr has {qo_indptr.numel()} entries, paged_kv_indptr "
            f"{paged_kv_indptr.numel()}, paged_kv_last_page_len {paged_kv_last_page_len.numel()} "
            "(expected batch+1, batch+1, batch)")


def paged_batch(qo_h: list[int], kvp_h: list[int], last_h: list[int], num_indices: int, num_qo_heads: int,
                num_kv_heads: int, page_size: int) -> Batch:
    """The Batch of a paged batch from host copies of its indptrs and last-page lengths (after
    check_paged_arguments), its per-request lengths checked; ``num_indices``: entries of
    paged_kv_indices. LaunchError naming the argument and request otherwise."""
    WrapperBase._check_indptr_starts(qo_indptr=qo_h[0], paged_kv_indptr=kvp_h[0])
    qo_lens, kv_lens = [], []
    for b in range(len(qo_h) - 1):
        ql, npages, lp = qo_h[b + 1] - qo_h[b], kvp_h[b + 1] - kvp_h[b], last_h[b]
        kl = 0 if npages == 0 else (npages - 1) * page_size + lp
        if ql < 0 or npages < 0:
            raise LaunchError(f"plan(): request {b}: indptrs must be non-decreasing")
        if npages and not 1 <= lp <= page_size:
            raise LaunchError(f"plan(): paged_kv_last_page_len[{b}]={lp}: expected 1..{page_size}")
        if ql > kl:
            raise LaunchError(f"plan(): request {b} has {ql} queries but only {kl} keys; the queries must be "
                              "the last qo_len tokens of the request's KV")
        qo_lens.append(ql)
        kv_lens.append(kl)
    if kvp_h[-1] > num_indices:
        raise LaunchError(f"plan(): paged_kv_indices has {num_indices} entries, paged_kv_indptr needs {kvp_h[-1]}")
    return Batch(len(qo_lens), qo_h[-1], sum(kv_lens), num_qo_heads, num_kv_heads, page_size, tuple(qo_lens),
                 tuple(kv_lens))


def read_paged_batch(qo_indptr: Any, paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any,
                     num_qo_heads: Any, num_kv_heads: Any, page_size: Any) -> PagedBatchLists:
    """check_paged_arguments, the host copies (one device-to-host copy) and paged_batch: a route
    that reads the batch without VariantWrapper's page-list guard (the flex route checks its pages
    itself)."""
    check_paged_arguments(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                          num_kv_heads, page_size)
    (qo_h, kvp_h, last_h), indices_h = host_indices(qo_indptr, paged_kv_indptr, paged_kv_last_page_len)
    batch = paged_batch(qo_h, kvp_h, last_h, paged_kv_indices.numel(), num_qo_heads, num_kv_heads, page_size)
    return PagedBatchLists(batch, qo_h, kvp_h, last_h, indices_h)


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return canonical_arch(f"{major}.{minor}{'a' if major == 9 else ''}")


# kind -> "module:class" of its wrapper (imported on first use)
WRAPPERS = {
    "prefill": "variantgen.wrapper:VariantWrapper",
    "ragged": "variantgen.ragged:RaggedWrapper",
    "decode": "variantgen.decode:DecodeWrapper",
}


def wrapper_class(kind: str) -> type[WrapperBase]:
    import importlib

    if kind not in WRAPPERS:
        raise ValueError(f"kind={kind!r}: expected one of {list(WRAPPERS)}")
    module, _, name = WRAPPERS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def make_wrapper(spec: VariantSpec | str | Path, workspace: torch.Tensor, *, head_dim_qk: int,
                 head_dim_vo: int | None = None, q_dtype: Any, kv_dtype: Any, o_dtype: Any = None,
                 backend: str | None = None, kind: str = "prefill", kv_layout: str = "NHD",
                 arch: str | None = None, cache: Cache | None = None, build: bool = True,
                 jobs: int | None = None, use_tensor_cores: bool = False,
                 graph: GraphCapacity | None = None, check_plan: bool | None = None) -> WrapperBase:
    """Build (or load from the cache) the spec's module for one kernel kind and wrap it.

    ``spec``: a VariantSpec, a spec file's path, or a shipped spec's name ("mm_prefix";
    variantgen.shipped_specs() lists them).
    ``kind``: "prefill" (paged KV), "ragged" (ragged KV) or "decode" (paged KV, one query
    per request). ``backend``: "fa2", "fa3", or None to let variantgen choose from the
    spec, dtypes, kind and GPU (build.select_backend: choose_backend's pick, except that with
    JIT disabled or ``build=False`` a precompiled fa2 module is used, with a warning, when
    the fa3 one is not in the cache - the choice probe() reports); "flex" runs the spec through
    torch's FlexAttention on any CUDA or CPU device, with no module (flex_wrapper.py).
    ``workspace`` is the float workspace (uint8, on the target GPU; 128 MiB is plenty).
    ``use_tensor_cores`` (decode only): run decode through the spec's prefill module (one
    query per request) instead of the CUDA-core decode kernel - FlashInfer's advice for large GQA groups. ``graph``
    (kind "prefill"): CUDA-graph mode with fixed buffers for at most that batch, so a
    captured run() can be replayed after each plan() (graph.py; fa2, chosen when backend
    is None); also kind "decode" (tensor cores: any batch up to the capacity; CUDA cores:
    exactly max_batch_size requests per plan, as FlashInfer's CUDA-graph decode).
    ``check_plan`` (default: the VARIANTGEN_CHECK_PLAN variable): debug mode, in which run()
    verifies that the spec tensors plan() planned from (e.g. ``ranges``) were not changed
    since, and raises naming the tensor (a device sync per run(); under CUDA-graph capture the
    comparison is recorded and the next plan() raises if a replay found a change).
    Raises SpecError / ValueError / BuildError / JitDisabledError with what went wrong;
    call variantgen.probe() first to get a reason instead of an exception.
    """
    spec = resolve_spec(spec)
    if backend == "flex":  # torch's FlexAttention: no module, no nvcc (flex_wrapper.py)
        from .flex_wrapper import make_flex_wrapper

        return make_flex_wrapper(spec, workspace, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype,
                                 kv_dtype=kv_dtype, o_dtype=o_dtype, kind=kind, kv_layout=kv_layout,
                                 use_tensor_cores=use_tensor_cores, graph=graph)
    q = canonical_dtype(q_dtype, "q_dtype")
    kv = canonical_dtype(kv_dtype, "kv_dtype")
    o = canonical_dtype(o_dtype, "o_dtype") if o_dtype is not None else q
    if arch is None:
        if not isinstance(workspace, torch.Tensor) or workspace.device.type != "cuda":
            raise ValueError("workspace: expected a CUDA tensor (or pass arch= to build for another GPU)")
        arch = device_arch(workspace.device)
    arch = canonical_arch(arch)
    hd_vo = head_dim_vo or head_dim_qk
    if graph is not None:
        if kind not in ("prefill", "decode"):
            raise ValueError(f"graph=: CUDA-graph mode is for kind='prefill' and kind='decode' (got kind={kind!r}); "
                             "ragged wrappers allocate their metadata per plan()")
        if backend is None:
            backend = "fa2"  # fa3's launch set depends on the batch
        elif backend != "fa2":
            raise ValueError(f"graph=: CUDA-graph mode needs backend='fa2' (got {backend!r}): the fa3 planner's "
                             "launch set depends on the batch")
    cache = cache or default_cache()
    if backend is None:  # the same choice probe(backend=None) reports
        choice = select_backend(spec, kind=kind, head_dim_qk=head_dim_qk, head_dim_vo=hd_vo, q_dtype=q,
                                kv_dtype=kv, o_dtype=o, arch=arch, cache=cache, allow_build=build)
        backend = choice.backend
        if choice.note:
            log.warning("make_wrapper(%s): %s", spec.name, choice.note)
    cls = wrapper_class(kind)
    if use_tensor_cores and kind != "decode":
        raise ValueError(f"use_tensor_cores=True: only for kind='decode' (got kind={kind!r})")
    module_kind = "prefill" if use_tensor_cores else kind  # tensor-core decode = prefill kernel, qo_len 1
    config = ModuleConfig(spec, head_dim_qk, hd_vo, q, kv, o, arch, backend, DEFAULT_MASK_MODES, module_kind)
    result = build_module(config, cache, jobs=jobs, allow_build=build)
    module = load_module(result.entry)
    extra = {"graph": graph} if graph is not None else {}
    wrapper = cls(spec, config, module, result, workspace, kv_layout, check_plan=check_plan, **extra)
    # The paged prefill kernel (also behind tensor-core decode) is planned by the interval planner.
    if module_kind == "prefill" and wrapper.device.type == "cuda" and analyze(spec).planner_ready:
        from .rowplan import load_planner

        wrapper.set_row_planner(*load_planner(spec, arch, cache, allow_build=build, jobs=jobs))
    return wrapper
