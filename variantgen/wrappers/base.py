"""What every kind's wrapper shares: ``WrapperBase``, a spec's module behind ``plan(...)`` /
``run(..., <args by name>)``, with the checks of the spec's named arguments, scales, outputs
and (paged kinds) the page list, and the interface each kind provides.

A kind's wrapper (paged.VariantWrapper, ragged.RaggedWrapper, decode.DecodeWrapper, the flex
route's flex_wrapper classes) implements the hooks WrapperBase declares: ``plan()`` (sets
``_batch`` and returns the batch's plan.Plan, kept as ``last_plan``), ``run()``,
``_page_lists()`` (the page lists run()'s kernels read, for the page guard) and
``_dim_capacity()`` (graph mode's largest batch-dependent dims). A hook a kind does not
provide raises NotImplementedError naming the kind.

Also here: the dtype and layout tables the kernels take, and the host copies of small index
tensors (host_indices) that plan() reads.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Any, NamedTuple

import torch

from ..abi.table import READ_INDICES_EXTRA
from ..build.builder import BuildResult
from ..codegen.render import KernelArg, ModuleConfig, kernel_args
from ..core.env import settings
from ..core.errors import LaunchError
from ..core.flags import check_flags
from ..core.staging import HostStaging, IntWorkspaces
from ..lang.nodes import FLOAT32_MAX
from ..lang.values import VariantSpec, shown_value
from ..planning.intervals import IntervalForm, analyze, args_read, tensors_read
from ..planning.plan import Plan
from .checks import (
    KV_LAYOUTS,
    PageGuard,
    PlanCheck,
    check_known,
    check_kv_layout,
    check_scale_values,
    check_spec_args,
    refuse_grad,
    spec_dims,
    split_paged_cache,
)

log = logging.getLogger("variantgen.wrappers.base")

TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp32": torch.float32,  # the flex route only (FlashInfer modules take 16-bit queries)
}
LAYOUT_CODES = {layout: code for code, layout in enumerate(KV_LAYOUTS)}  # the kernels' kv_layout codes
ALIGN_BYTES = 16  # the kernels move q/k/v/o rows in 16-byte vectors (cp.async, TMA)
MAX_SM_SCALE = FLOAT32_MAX / math.log2(math.e)  # its product with log2(e) is a finite float32


class PagedRun(NamedTuple):
    """A paged run()'s checked arguments (WrapperBase._check_paged_run)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    args: dict[str, Any]  # the spec's
    out: torch.Tensor
    lse: torch.Tensor | None


class IntervalFacts(NamedTuple):
    form: IntervalForm  # intervals.analyze(spec)
    args: frozenset[str]  # spec arguments the intervals read
    tensors: frozenset[str]  # ... of them the tensors (plan() needs them)


class WrapperBase:
    """What every kernel kind's wrapper shares: the module, the float workspace, and the
    checks of the spec's named arguments, scales, outputs and (paged kinds) page list.

    The interface each kind provides (declared below; a hook a kind leaves out raises
    NotImplementedError naming the kind): ``plan(...)``, which sets ``_batch`` (a plan.Batch:
    the fields ``_dims`` reads) and ``last_plan``; ``run(...)``; ``_page_lists()`` and
    ``_dim_capacity()``.

    ``check_plan`` (default: VARIANTGEN_CHECK_PLAN): debug mode, in which run() verifies that
    the spec tensors plan() planned from still hold what plan() saw (checks.PlanCheck; a
    device sync per run())."""

    # The kernels take one set of strides for both caches (the flex route gathers each on its own)
    _equal_kv_strides = True
    _trains = False  # run() refuses inputs that require grad (the flex route, which has a backward, says True)

    def __init__(self, spec: VariantSpec, config: ModuleConfig, module: Any, build: BuildResult | None,
                 float_workspace: torch.Tensor, kv_layout: str = "NHD", *, check_plan: bool | None = None):
        check_kv_layout(kv_layout)
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
        self._int_workspaces = IntWorkspaces(self.device)  # FlashInfer's schedulers' (decode, ragged)
        self._tensor_names = [t.name for t in spec.tensors]
        self._scalar_names = [s.name for s in spec.scalars]
        self._batch = None
        self._pdl: bool | None = None
        self._planned_args: dict[str, Any] = {}
        self._plan_stats: dict[str, Any] = {}
        self._off_logged = ""  # the last reason logged for the planner being off
        self._staging = HostStaging(self.device)  # plan()'s host-to-device copies
        self.check_plan = settings().check_plan if check_plan is None else check_plan
        self._plan_check = PlanCheck() if self.check_plan else None
        # The planned page list's bounds, and run()'s guard where they are still on their way (checks.py).
        self._pages = PageGuard()
        self._index_scratch: torch.Tensor | None = None  # the GPU side of plan()'s index read-back

    # ------------------------------------------------------------------ the interface each kind provides
    _batch: Any  # the planned batch (plan.Batch; None: no plan, or it failed), set by plan()
    last_plan: Plan | None  # what the last plan() decided (None: no plan, or it failed)

    def _not_provided(self, hook: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} (kind {self.config.kind!r}) does not provide {hook}")

    def plan(self, *args: Any, **spec_args: Any) -> Plan:
        """Plan a batch: check the arguments, set ``_batch`` and ``last_plan`` (None first, so a
        plan() that fails leaves none), return the plan (plan.Plan, or a plan.ScheduledPlan where
        the launch builder does not lay out the launches)."""
        raise self._not_provided("plan()")

    def run(self, *args: Any, **spec_args: Any) -> Any:
        """Attention over the planned batch: ``out``, or ``(out, lse)`` with ``return_lse=True``."""
        raise self._not_provided("run()")

    def _page_lists(self) -> list[torch.Tensor]:
        """The wrapper's copies of the page list that run()'s kernels read (the guard clamps them;
        [] where none is read: a ragged kind, or a route that gathers its keys itself)."""
        raise self._not_provided("_page_lists()")

    def _dim_capacity(self) -> dict[str, int]:
        """Graph mode: the largest size each batch-dependent dim may have (static buffers; {}
        without graph mode)."""
        raise self._not_provided("_dim_capacity()")

    def _workspace(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The i-th (int workspace, page-locked host mirror) pair for FlashInfer's scheduler."""
        return self._int_workspaces.get(i)

    @property
    def plan_stats(self) -> dict[str, Any]:
        """What the last plan() did, as a dict: "launches" [(mask mode, launch requests)], and
        "planner_off" (why) or the planner's figures."""
        return self._plan_stats

    def _pdl_default(self) -> bool:
        if self._pdl is None:
            self._pdl = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] >= 9
        return self._pdl

    @functools.cached_property
    def _interval_facts(self) -> IntervalFacts:
        """The spec's key intervals and the arguments they read (asked on every plan())."""
        form = analyze(self.spec)
        return IntervalFacts(form, frozenset(args_read(form, self.spec)), frozenset(tensors_read(form, self.spec)))

    def _intervals_off(self, spec_args: dict[str, Any], what: str) -> str:
        """Why ``what`` (the interval planner, decode's key trimming) is off by default ("": it is
        on): the mask's key intervals are not known, or plan() was not given the spec tensors
        they read (logged when the reason changes)."""
        form, _, tensors = self._interval_facts
        if not form.planner_ready:
            return form.reason
        missing = sorted(tensors - set(spec_args))
        if not missing:
            self._off_logged = ""
            return ""
        reason = f"plan() was not given {', '.join(missing)}, which the key intervals read"
        if reason != self._off_logged:
            log.info("%s off for %s %s: %s", what, self.spec.name, self.config.kind, reason)
            self._off_logged = reason
        return reason

    def _off_reason(self, skip_tiles: bool | None, spec_args: dict[str, Any], what: str) -> str:
        """Why ``what`` (the interval planner, decode's key trimming) is off for this plan() ("":
        it is on): skip_tiles=False, or its default (_intervals_off)."""
        return "skip_tiles=False" if skip_tiles is False else "" if skip_tiles else self._intervals_off(spec_args, what)

    def _accept_unplanned_args(self, spec_args: dict[str, Any]) -> None:
        """One plan() contract whatever the planner decides: plan() takes every spec argument
        run() takes. Without the interval planner (or decode's key trimming) it reads none of
        them, but checks them as run() does (a misspelt name or a misshapen tensor is refused
        here as well) and keeps none: run() gets its own."""
        if spec_args:
            self._check_args(spec_args, where="plan()", require_tensors_from="intervals")

    def _sm_scale(self, q_scale: float | None, k_scale: float | None) -> float:
        """The softmax scale of the logits: the spec's (default 1/sqrt(head_dim_qk)) times q_scale * k_scale."""
        base = self.spec.sm_scale if self.spec.sm_scale is not None else 1.0 / math.sqrt(self.config.head_dim_qk)
        return float(base * (q_scale if q_scale is not None else 1.0) * (k_scale if k_scale is not None else 1.0))

    # ------------------------------------------------------------------ argument checks
    # ------------------------------------------------------------------ the page list (checks.py)
    def _read_indptrs(self, kv_indices: torch.Tensor, kv_indptr: torch.Tensor, *indptrs: torch.Tensor,
                      ) -> tuple[list[list[int]], torch.Tensor, list[int]]:
        """Host copies of ``indptrs`` (int lists, and back to back in one CPU int32 tensor) and,
        where they and the page list are on one GPU, the page list's (min, max) over its first
        ``kv_indptr[-1]`` entries read in the same copy (the module's read_indices: one kernel,
        one copy; for begin_pages): (lists, flat, folded bounds or [])."""
        device = kv_indices.device
        if device.type != "cuda" or not kv_indices.numel() or any(t.device != device for t in (kv_indptr, *indptrs)):
            lists, flat = host_indices(*indptrs)
            return lists, flat, []
        parts = [t if t.is_contiguous() else t.contiguous() for t in (kv_indices, kv_indptr, *indptrs)]
        total = sum(t.numel() for t in indptrs)
        host = torch.empty(total + READ_INDICES_EXTRA, dtype=torch.int32)
        scratch = self._index_scratch
        if scratch is None or scratch.numel() < host.numel() * 4:
            scratch = self._index_scratch = torch.empty(max(4096, 8 * host.numel()), dtype=torch.uint8, device=device)
        self.module.read_indices(*parts, *[None] * (3 - len(indptrs)), scratch, host)
        values = host.tolist()
        return split_values(values, indptrs), host[:total], values[total:total + 2]

    def _begin_pages(self, kv_indices: torch.Tensor, entries: int, folded: list[int]) -> None:
        """plan(): start reading the bounds of the batch's page list ``kv_indices[:entries]``."""
        self._pages.begin(kv_indices, entries, folded)

    def _finish_pages(self) -> None:
        """plan()'s end (after its reads back): negative entries are refused here, and in CUDA-graph
        mode entries outside the captured cache; the rest is for run(), which has the cache. Bounds
        still on their way are run()'s to guard (checks.py)."""
        self._pages.finish()

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
        assert self._batch is not None
        return spec_dims(self._batch)

    def _check_known(self, given: dict[str, Any], where: str) -> None:
        """LaunchError for keywords that are no spec argument, with the closest name (a spec
        argument, or the method's own keyword: `skip_tile=` for skip_tiles)."""
        method = getattr(type(self), where.removesuffix("()"), None)
        own = [n for n, p in inspect.signature(method).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY] if method is not None else []
        check_known(self.spec, given, where, own, " (plus q_scale, k_scale, v_scale, out, return_lse in run())")

    def _check_args(self, given: dict[str, Any], *, where: str, require_tensors_from: str | None = None,
                    ) -> dict[str, Any]:
        self._check_known(given, where)
        return check_spec_args(self.spec, given, self._dims(), self.device, where=where,
                               required=require_tensors_from is None, caps=self._dim_capacity())

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
        given = {n: v for n, v in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)) if v is not None}
        check_scale_values("run()", **given)
        # The kernels multiply the logits by the softmax scale times log2(e), in float32.
        sm_scale = self._sm_scale(q_scale, k_scale)
        if abs(sm_scale) > MAX_SM_SCALE:
            folded = " and ".join(f"{n}={shown_value(v)}" for n, v in given.items() if n != "v_scale")
            base = f"{self.spec.sm_scale:.7g}" if self.spec.sm_scale is not None else \
                f"1/sqrt(head_dim_qk={self.config.head_dim_qk})"
            raise LaunchError(f"run(): {folded or 'no scales'} fold into the softmax scale {sm_scale:.7g} (the spec's "
                              f"{base} x q_scale x k_scale), which the kernels take as a float32 times log2(e): "
                              f"expected |softmax scale| <= {MAX_SM_SCALE:.7g}")

    @functools.cached_property
    def _abi_args(self) -> tuple[tuple[KernelArg, ...], tuple[KernelArg, ...]]:
        return kernel_args(self.spec)

    def _kernel_args(self, args: dict[str, Any], q_scale: float | None, k_scale: float | None,
                     v_scale: float | None) -> tuple[list[torch.Tensor], list[Any]]:
        """The module's extra run() arguments in the order of its ABI, which codegen.render.kernel_args
        defines once for the generated binding and for this call: (spec tensors, scalars with
        sm_scale and v_scale). vg_meta, the tensor after the spec's, the caller inserts."""
        tensor_args, scalar_args = self._abi_args
        own = len(self.spec.scalars)  # the spec's scalars first, then what the wrapper computes
        computed = {"sm_scale": self._sm_scale(q_scale, k_scale),
                    "v_scale": float(v_scale) if v_scale is not None else 1.0}
        tensors = [args[a.name] for a in tensor_args[:len(self.spec.tensors)]]
        scalars = [args[a.name] for a in scalar_args[:own]] + [computed[a.name] for a in scalar_args[own:]]
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
                         scales: tuple[Any, Any, Any], spec_args: dict[str, Any], out: torch.Tensor | None,
                         return_lse: bool, enable_pdl: bool | None) -> PagedRun:
        """run()'s checks over a paged KV cache, in order: return_lse and enable_pdl, q
        (``q_shape``; its rows are the outputs'), the cache, q/k/v scales, the spec's arguments
        (and that they are what plan() planned with), the outputs; last, every planned page
        inside the cache (or, where plan() left the page list's bounds on their way, the kernels'
        copies of the list clamped to it: a run() refused after that would leave the list clamped
        and the run recorded without a launch). First, a report of an earlier run() that read a
        page list clamped by the guard (checks.py)."""
        capturing = self._capturing()
        if not capturing:  # (no event queries under capture)
            self._pages.poll("run()")
        check_flags("run()", return_lse=return_lse, enable_pdl=enable_pdl)
        self._check_rows("q", q, TORCH_DTYPES[self.config.q_dtype], q_shape)
        k_cache, v_cache = self._check_paged_cache(paged_kv_cache)
        self._check_scales(*scales)
        args = self._check_args(spec_args, where="run()")
        if not self._trains:
            refuse_grad("run()", self.config.backend, {"q": q, "k_cache": k_cache, "v_cache": v_cache, **args})
        self._check_planned_args(args)
        self._verify_planned()
        out, lse = self._outputs(out, return_lse, q_shape[0])
        self._pages.check_run(k_cache.shape[0], capturing, self._page_lists)
        return PagedRun(k_cache, v_cache, args, out, lse)

    def _check_paged_cache(self, paged_kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) from a pair or a [pages, 2, ...] tensor, checked against the plan:
        shapes, strides the kernel can take, page counts (the planned pages are _check_paged_run's)."""
        b, cfg = self._batch, self.config
        kvdt = TORCH_DTYPES[cfg.kv_dtype]
        k_cache, v_cache = split_paged_cache("run()", paged_kv_cache)
        for name, t, head_dim in (("k_cache", k_cache, cfg.head_dim_qk), ("v_cache", v_cache, cfg.head_dim_vo)):
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
        if self._equal_kv_strides and k_cache.stride() != v_cache.stride():
            raise LaunchError(f"run(): k_cache and v_cache must have identical strides (got {k_cache.stride()} and "
                              f"{v_cache.stride()}); this module is compiled for equal K/V strides")
        num_pages = k_cache.shape[0]
        if v_cache.shape[0] != num_pages:
            raise LaunchError(f"run(): k_cache has {num_pages} pages and v_cache {v_cache.shape[0]}; expected the "
                              "same page count (a page number addresses both)")
        return k_cache, v_cache


def host_lists(*tensors: torch.Tensor) -> list[list[int]]:
    """Host copies of small index tensors as int lists (see host_indices)."""
    return host_indices(*tensors)[0]


def host_indices(*tensors: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Host copies of small 1-D index tensors of one dtype: as int lists, and back to back in one
    CPU tensor. One device-to-host copy for all of them when they share a CUDA device (each
    copy is a sync)."""
    devices = {t.device for t in tensors}
    if len(devices) == 1:
        flat = torch.cat(tensors)
        if next(iter(devices)).type != "cpu":  # (on the host already: no call; plan()'s torch calls are budgeted)
            flat = flat.cpu()
    else:
        flat = torch.cat([t.cpu() for t in tensors])
    return split_values(flat.tolist(), tensors), flat


def split_values(values: list[int], tensors: tuple[torch.Tensor, ...]) -> list[list[int]]:
    """``values``, the entries of ``tensors`` back to back (and anything after them), cut into
    one list per tensor."""
    out, at = [], 0
    for t in tensors:
        n = t.numel()
        out.append(values[at:at + n])
        at += n
    return out
