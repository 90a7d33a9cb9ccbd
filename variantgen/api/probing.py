"""Can this spec run here, now? One call that answers yes, or no with the reason.

``probe`` is what a serving engine calls at startup before it advertises a variant
backend. It is truthy only when the spec can run on this machine now: a GPU of the
target arch is visible, the module was found in the cache (or built, where JIT is on) and
it loaded - or a module-less route (flex) ran a small batch here. It never raises and never
waits long: every failure, expected or not, becomes ``reason``, and a build another process
holds the lock for is reported after PROBE_LOCK_WAIT_S seconds ("being built by pid N ..."),
not waited for. A reason never asks a serving box to do something that starts a compile there.

Which backend answers is resolver.resolve's choice, made for this machine with the same
inputs make_wrapper gives it (factory.module_site): probe says yes exactly when make_wrapper
with the same settings succeeds without building.

``probe(..., runtime=False)`` answers another question, for build boxes and deployment
checks: is the module a server with JIT disabled would load for ``arch`` in the cache
(no GPU needed; nothing is built or loaded)? ``variantgen precompile ... --check`` asks it
for a whole matrix.

Checks run in this order, and the first failing one is reported:

1. the spec (file) is valid, the arguments well formed;
2. a backend serves the combination (dtypes, head dims, backend, kernel kind, CUDA-graph
   mode, page size) at all: the capability table (capabilities.py);
3. for the module backends: flashinfer is importable and new enough (>= 0.7.2:
   ``batch_prefill_paged.cu`` and ``PrefillPlan`` in ``scheduler.cuh``), apache-tvm-ffi is
   importable; a GPU of sm80 or newer is visible (and of ``arch`` when one is given); with
   ``runtime=False``: a target arch is known (``arch=``, the visible GPU, VARIANTGEN_ARCH);
   then the resolver's choice for this machine (where modules cannot be built: among what
   the cache holds);
4. with JIT disabled, ``build=False`` or ``runtime=False``: the module is in the cache, and
   intact (a truncated or corrupted entry is named with its path);
5. nvcc is found (CUDA_HOME);
6. the cache directory is writable (only when the module is absent);
7. no other process is building it (or it finishes within PROBE_LOCK_WAIT_S), and the
   build succeeds;
8. the module loads (not with ``runtime=False``).

Results are memoized per argument combination (and environment snapshot) for the life
of the process; ``probe.cache_clear()`` forgets them. A negative result caused by another
process's build in progress, or by the cache's file system (a full disk), is not memoized
(``ProbeResult.transient``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ..build import builder as _build
from ..build.cache import Cache, LockTimeout
from ..codegen import fi_versions, render
from ..codegen.render import ModuleConfig
from ..core import env
from ..core.errors import BuildError, CacheError, JitDisabledError, SpecError, ToolchainError
from ..core.flags import flag_problem
from ..lang.library import resolve_spec
from ..lang.values import VariantSpec
from ..routing import capabilities
from ..routing.capabilities import BACKENDS, ArgNames, Request, Site, canonical_arch
from ..routing.resolver import Resolution, resolve
from .factory import arch_mismatch, device_arch, module_site, target_arch

log = logging.getLogger("variantgen.probe")

NEEDED_FLASHINFER = fi_versions.OLDEST  # the oldest FlashInfer the templates were checked against
PROBE_LOCK_WAIT_S = 5.0  # how long probe() waits for another process's build of the module
PROBE_NAMES = ArgNames(graph="cuda_graph=True")
NO_GPU_REASON = ("no CUDA device visible: probe() answers whether the module runs here, and nothing can run "
                 "without a GPU (to check a cache for another machine: probe(..., runtime=False, arch=...) or "
                 "`variantgen precompile ... --check`)")


@dataclass(frozen=True)
class ProbeResult:
    """The answer of :func:`probe`. Truthy exactly when ``ok``."""

    ok: bool
    reason: str = ""
    """Why not ("" when ok): one or a few lines a user can act on."""
    uri: str | None = None
    """The module's cache URI, once the configuration is known."""
    source: str = "not built"
    """'cache' (found), 'built' (built by this call), 'not built', or 'torch' (a module-less
    route: torch runs it)."""
    module_path: str | None = None
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    transient: bool = False
    """The answer may change with nothing changed here (another process's build in progress, a
    full disk, an unexpected failure): not memoized, worth asking again."""

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"ok: {self.uri or self.details.get('backend')} ({self.source})"
        return f"no: {self.reason}"


class _Fail(Exception):
    """Internal: stop probing with this reason (and whether it may be memoized)."""

    def __init__(self, reason: str, *, transient: bool = False, **details: Any):
        super().__init__(reason)
        self.reason = reason
        self.transient = transient
        self.details = details


def _memoized(fn: Callable[..., ProbeResult]) -> Callable[..., ProbeResult]:
    """probe()'s memo, per argument combination (defaults bound) and environment snapshot,
    with ``cache_clear`` as lru_cache has; a transient result is not kept."""
    memo: dict[tuple, ProbeResult] = {}
    lock = threading.Lock()
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def probe(*args: Any, **kwargs: Any) -> ProbeResult:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        spec, given = bound.arguments.pop("spec"), bound.arguments
        try:
            key = _memo_key(spec, given)
        except Exception:  # unhashable oddities: just do not memoize
            key = None
        if key is not None:
            with lock:
                hit = memo.get(key)
            if hit is not None:
                return hit
        result = fn(spec, **given)
        if key is not None and not result.transient:
            with lock:
                memo[key] = result
        return result

    def cache_clear() -> None:
        """Forget every memoized probe result (tests, or after installing a toolkit)."""
        with lock:
            memo.clear()

    probe.cache_clear = cache_clear  # type: ignore[attr-defined]
    return probe


# ----------------------------------------------------------------------------- public


@_memoized
def probe(
    spec: VariantSpec | str | Path,
    *,
    head_dim_qk: int,
    head_dim_vo: int | None = None,
    q_dtype: Any,
    kv_dtype: Any,
    o_dtype: Any = None,
    backend: str | None = None,
    page_size: int | None = None,
    device: Any = None,
    build: bool = True,
    cache_dir: str | Path | None = None,
    arch: str | None = None,
    kind: str = "prefill",
    cuda_graph: bool = False,
    runtime: bool = True,
    use_tensor_cores: bool = False,
) -> ProbeResult:
    """Say whether ``spec`` can run here, now, with these settings; never raises.

    Truthy only when a GPU is visible, the module is found in the cache or built (JIT on,
    ``build=True``) and loaded on it - or, for a module-less route (flex), when that route ran
    a small batch here: then ``make_wrapper`` with the same settings succeeds without building.
    ``reason`` says why not, in words an operator can act on.

    ``kind`` is the kernel ("prefill", "ragged", "decode"); ``use_tensor_cores=True`` with
    kind "decode" asks for fa2's tensor-core decode, as make_wrapper takes it (the prefill
    module; fa3's decode always runs its prefill module).
    ``backend`` is "fa2", "fa3", "flex", or None for the one make_wrapper(backend=None) picks
    here (resolver.resolve: fa3 where an fa3 module runs, for decode fa2 first; on a server that cannot build, fa2
    where only its module is precompiled and the flex route where neither is, with
    ``details["note"]`` saying so); ``details["backend"]`` says which and
    ``details["not_chosen"]`` why each other backend was not. See :func:`probe_backends` for
    every backend at once.

    ``spec`` is a VariantSpec, a path to a spec file, or a shipped spec's name ("mm_prefix").
    ``device`` selects the GPU (default: the current one). ``arch``: the GPU's arch is checked
    against it. ``build=False`` only looks in the cache. ``cache_dir`` defaults to
    VARIANTGEN_CACHE_DIR. ``cuda_graph=True``: for a wrapper made with
    ``graph=GraphCapacity(...)`` (the backends and kinds whose table entry has a CUDA-graph mode:
    fa2 and fa3 paged prefill and decode): other kinds and backends are demoted with the reason;
    backend=None picks one that has it, as make_wrapper does.

    ``runtime=False``: whether the cache holds the module a server with JIT disabled would load
    for ``arch`` (or the visible GPU, or VARIANTGEN_ARCH) - no GPU needed, nothing built or
    loaded, module-less routes not considered; ``source`` is "cache" when it does.
    ``variantgen precompile ... --check`` asks this for a whole matrix.
    """
    t0 = time.perf_counter()
    try:
        result = _probe(spec, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype, kv_dtype=kv_dtype,
                        o_dtype=o_dtype, backend=backend, page_size=page_size, device=device, build=build,
                        cache_dir=cache_dir, arch=arch, kind=kind, cuda_graph=cuda_graph, runtime=runtime,
                        use_tensor_cores=use_tensor_cores)
        result = dataclasses.replace(result, seconds=time.perf_counter() - t0)
    except _Fail as f:
        result = ProbeResult(False, f.reason, f.details.pop("uri", None), "not built", None,
                             time.perf_counter() - t0, f.details, f.transient)
    except BaseException as e:  # noqa: BLE001 - probe never raises, whatever happens
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        log.debug("probe failed unexpectedly", exc_info=True)
        # an unexpected failure may not repeat; do not pin it
        result = ProbeResult(False, f"internal error: {type(e).__name__}: {e}", None, "not built", None,
                             time.perf_counter() - t0, {}, True)
    if result.ok:
        # the module's URI, or the spec and route for a module-less one (flex has no URI)
        what = result.uri or f"{_spec_label(spec)} ({result.details.get('backend', '?')} route)"
        log.info("probe %s: ok (%s, %.2fs)", what, result.source, result.seconds)
    else:
        log.debug("probe %s: %s", _spec_label(spec), result.reason)
    return result


cache_clear = probe.cache_clear  # type: ignore[attr-defined]


def probe_backends(spec: VariantSpec | str | Path, *, kinds: tuple[str, ...] = ("prefill",),
                   backends: tuple[str, ...] = BACKENDS, **kwargs: Any) -> dict[tuple[str, str], ProbeResult]:
    """:func:`probe` for every (backend, kind): what an engine logs at startup to say which
    kernels it may advertise for this layer and why the others are demoted. Never raises."""
    return {(b, k): probe(spec, backend=b, kind=k, **kwargs) for k in kinds for b in backends}


# ----------------------------------------------------------------------------- the checks


def _probe(spec_arg: Any, *, head_dim_qk: Any, head_dim_vo: Any, q_dtype: Any, kv_dtype: Any, o_dtype: Any,
           backend: Any, page_size: Any, device: Any, build: bool, cache_dir: Any, arch: Any, kind: Any,
           cuda_graph: Any, runtime: Any, use_tensor_cores: Any = False) -> ProbeResult:
    # 1. the spec and the arguments
    flags = {"build": build, "runtime": runtime, "cuda_graph": cuda_graph, "use_tensor_cores": use_tensor_cores}
    problem = next(filter(None, (flag_problem(n, v) for n, v in flags.items())), "")
    if problem:  # (not any truthy value: cuda_graph="no" asked for CUDA-graph mode)
        raise _Fail(problem)
    spec = _load(spec_arg)
    try:
        request = Request.of(spec, kind=kind, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype,
                             kv_dtype=kv_dtype, o_dtype=o_dtype, backend=backend, graph=cuda_graph,
                             tensor_cores=use_tensor_cores, names=PROBE_NAMES)
        explicit_arch = canonical_arch(arch) if arch is not None else None
    except ValueError as e:
        raise _Fail(str(e)) from None
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1):
        raise _Fail(f"page_size={page_size!r}: expected a positive whole number")
    if cache_dir is not None and (not isinstance(cache_dir, (str, os.PathLike)) or not str(cache_dir).strip()):
        # "" was the current folder (a build went there); an int an internal error's TypeError
        raise _Fail(f"cache_dir={cache_dir!r}: expected a folder, or None for VARIANTGEN_CACHE_DIR")
    routes = capabilities.installed_routes() if runtime else ()
    no_route = "" if runtime else "runtime=False checks the module cache; the flex route has no module"
    # 2. a backend for it at all (the target arch, when given)
    served = resolve(request, Site(arch=explicit_arch, routes=routes, no_route=no_route))
    if not served:
        raise _Fail(served.reason)
    try:
        s = env.settings()
    except ValueError as e:  # a malformed environment variable
        raise _Fail(str(e)) from None
    cache = Cache(cache_dir) if cache_dir is not None else build_default_cache()

    # 3. where modules would run, and the resolver's choice for here
    where = _module_target(request, explicit_arch, device, runtime, routes)
    site = module_site(where.arch, cache, build=build and runtime, no_modules=where.no_modules, routes=runtime,
                       arch_source=where.source)
    resolution = resolve(request, dataclasses.replace(site, no_route=no_route))
    if not resolution:
        raise _Fail(resolution.reason)
    details: dict[str, Any] = {"arch": where.arch, "device_arch": where.gpu, "backend": resolution.backend,
                               "cuda_graph": request.graph, "cache_dir": str(cache.root)}
    if resolution.note:
        details["note"] = resolution.note
    details["not_chosen"] = dict(resolution.rejected)
    if resolution.route is not None:
        return _probe_route(request, resolution, device, page_size, details, where.no_modules)
    config = resolution.config
    assert config is not None
    details["config"] = config.describe()

    # 4-7. find (or build)
    rendered = render.render_module(config)
    details["uri"] = _expected_uri(rendered)
    result = _find(config, cache, rendered, s, build=build, runtime=runtime, details=details)
    entry = result.entry
    details.pop("uri")
    details["built"] = result.built
    details["loaded"] = False

    # 8. load
    if runtime:
        try:
            _build.load_module(entry)
        except Exception as e:
            raise _Fail(f"module {entry.uri} was found but failed to load: {type(e).__name__}: {e}",
                        uri=entry.uri, **details) from None
        details["loaded"] = True
    if config.kind in ("prefill", "decode"):
        details["row_planner"] = _row_planner_status(config, cache, build and runtime)
    else:  # every answer has the key (an engine logs it whatever the kind)
        details["row_planner"] = f"none: {config.kind} modules have no interval planner (the mask on every tile)"
    return ProbeResult(True, "", entry.uri, "built" if result.built else "cache", str(entry.module_path), 0.0,
                       details)


class _Where(NamedTuple):
    arch: str | None  # the arch to find modules for
    no_modules: str  # why no module can run here, or ""
    source: str  # where ``arch`` came from, when not from arch=
    gpu: str | None  # the visible GPU's arch (None: none, or not asked)


def _module_target(request: Request, explicit: str | None, device: Any, runtime: bool,
                   routes: tuple[str, ...]) -> _Where:
    """Where modules would run. A problem of the machine (no flashinfer, no GPU) fails the
    probe at once, unless a module-less route could still serve the request here."""
    fallback = bool(routes) and bool(resolve(request, Site(modules=False, routes=routes)))

    def unusable(reason: str) -> _Where:
        if not fallback:
            raise _Fail(reason)
        return _Where(explicit, reason, "", None)

    problem = flashinfer_problem()
    if problem:
        return unusable(problem)
    if not runtime:
        try:
            found = target_arch(explicit, device) if explicit is None else explicit  # no GPU query when named
        except ValueError as e:
            raise _Fail(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a broken driver is a reason
            raise _Fail(_query_failure(device, e)) from None
        if found is None:
            raise _Fail("runtime=False: no target arch (pass arch=, e.g. arch='9.0a', or set VARIANTGEN_ARCH) "
                        "and no CUDA device visible to take it from")
        return _Where(found, "", "", None)
    if device is not None and not _is_cuda_device(device):  # e.g. "cpu": only a module-less route runs there
        return unusable(f"device={device!r} is not a CUDA device: the compiled modules run on NVIDIA GPUs")
    if not _cuda_available():
        if device is not None:  # "cuda:0" named on a box without CUDA: nothing runs on it, no route either
            raise _Fail(NO_GPU_REASON)
        return unusable(NO_GPU_REASON)
    try:
        gpu = device_arch(device)
    except Exception as e:  # noqa: BLE001 - a broken driver, a bad index: the reason
        raise _Fail(_query_failure(device, e)) from None
    if gpu is None:
        return unusable(NO_GPU_REASON)
    wrong = arch_mismatch(explicit, gpu) if explicit is not None else ""
    if wrong:  # a question about that arch: not one a module-less route answers
        raise _Fail(f"{wrong} (probe(..., runtime=False) checks a cache for another GPU)")
    return _Where(gpu, "", "" if explicit is not None else "the visible GPU's", gpu)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    import torch

    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError, ValueError):
        return False  # not a device at all: no module runs on it either


def _query_failure(device: Any, e: Exception) -> str:
    where = f"CUDA device {device}" if device is not None else "the CUDA device"
    return f"cannot query {where}: {type(e).__name__}: {e}"


def _probe_route(request: Request, resolution: Resolution, device: Any, page_size: Any,
                 details: dict[str, Any], no_modules: str) -> ProbeResult:
    """A module-less route (flex): its own probe runs a small batch where it will run. Where
    backend=None took it because no module can run here (``no_modules``), a failure says both."""
    route = resolution.route
    assert route is not None
    answer = route.load(route.probe)(
        request.spec, head_dim_qk=request.head_dim_qk, head_dim_vo=request.head_dim_vo, q_dtype=request.q_dtype,
        kv_dtype=request.kv_dtype, o_dtype=request.o_dtype, kind=request.kind, device=device,
        cuda_graph=request.graph, page_size=page_size)
    details = {**details, **answer.get("details", {})}
    # the key every backend's details have, so an engine can log it whatever the route
    details.setdefault("row_planner", f"none needed: the {resolution.backend} route has no planner module (plan() "
                                      "builds its block mask in torch)")
    if not answer["ok"]:
        reason = answer["reason"] if not no_modules or request.backend is not None else (
            f"{no_modules}; and the {resolution.backend} route cannot run either: {answer['reason']}")
        raise _Fail(reason, **details)
    return ProbeResult(True, "", None, "torch", None, 0.0, details)


def _find(config: ModuleConfig, cache: Cache, rendered: render.RenderedModule, s: env.Settings, *, build: bool,
          runtime: bool, details: dict[str, Any]) -> _build.BuildResult:
    """Steps 5-8: the module from the cache, or built (runtime probes with JIT on)."""
    uri = details["uri"]
    if not runtime:
        found, _, damaged = _build.lookup_module(config, cache, rendered=rendered)
        if found is not None:
            return found
        raise _Fail(_missing_reason("runtime=False (a cache check)", uri, cache, config, damaged, here=True),
                    **details)
    try:
        return _build_module(config, cache, rendered=rendered, allow_build=build, lock_timeout=PROBE_LOCK_WAIT_S)
    except JitDisabledError as e:
        if s.jit_disabled or not build:
            why = f"JIT disabled by {s.jit_disabled_by}" if s.jit_disabled else "building disabled (build=False)"
            raise _Fail(_missing_reason(why, uri, cache, config, e.damaged), **details) from None
        raise _Fail(str(e), **details) from None  # cache not writable
    except ToolchainError as e:
        text = str(e)
        if _same_inputs_cached(cache, rendered):
            text += ("\n  (a module with the same inputs built by another toolchain is in the cache; "
                     "set VARIANTGEN_DISABLE_JIT=1 to use it without nvcc)")
        else:
            text += ("\n  (or, to serve without a compiler: precompile it on a build box, copy the cache here and "
                     f"set VARIANTGEN_DISABLE_JIT=1: {precompile_command(config, cache.root)})")
        raise _Fail(text, **details) from None
    except BuildError as e:
        reason = f"building module {uri} failed"
        if e.first_error:
            reason += f": {e.first_error}"
        if e.log_path:
            reason += f" (full log: {e.log_path})"
        raise _Fail(reason, first_error=e.first_error, log_path=e.log_path, **details) from None
    except LockTimeout as e:
        who = e.holder.describe() if e.holder else "another process"
        if e.holder:
            details["building_pid"] = e.holder.pid
        raise _Fail(f"module {uri} is being built by {who} (lock {cache.lock_path(uri)}); probe() waits "
                    f"{PROBE_LOCK_WAIT_S:g}s at most: probe again when that build is done", transient=True,
                    **details) from None
    except CacheError as e:  # a full disk, an unwritable lock folder: may be fixed while we run
        raise _Fail(str(e), transient=True, **details) from None


def _missing_reason(why: str, uri: str, cache: Cache, config: ModuleConfig, damaged: list[str], *,
                    here: bool = False) -> str:
    """Why a module that is not built here is not usable, and the fix: done on a build box,
    unless ``here`` (a cache check, asked on the build box itself)."""
    command = precompile_command(config, cache.root)
    if damaged:
        fix = f"rebuild it: {command}" if here else f"copy a good one from the build box's cache (or rebuild it " \
                                                    f"there: {command})"
        return f"{why} and module {uri} in {cache.root} is corrupted: {damaged[0]}; {fix}"
    fix = f"build it: {command}" if here else f"build it where nvcc is (a build box) and copy the cache folder " \
                                              f"here: {command}"
    return f"{why} and module {uri} is not precompiled in {cache.root}; {fix}"


def _row_planner_status(config: ModuleConfig, cache: Cache, build: bool) -> str:
    """How plan() will plan: with the spec's planner module (cached, or built by make_wrapper in
    ~10 s), or without it and why - prefill: one custom launch per request, the mask on every
    element (slower kernels, the same results: no reason to demote; the wrapper's Plan says the
    same); CUDA-core decode: key trimming's intervals in torch ops (a slower plan()). Only looks
    in the cache."""
    from ..planning.intervals import analyze
    from ..planning.rowplan import PlannerConfig

    form = analyze(config.spec)
    if not form.planner_ready:
        return f"none: the interval planner is off for this spec ({form.reason})"
    planner = PlannerConfig(config.spec, config.arch)
    off = PLANNER_OFF[config.kind]
    try:
        rendered = planner.render()
        uri = _expected_uri(rendered)
        if cache.lookup(uri):
            return f"cached: {uri}"
        s = env.settings()
        if not s.jit_disabled and build and _has_toolchain():
            return f"built by make_wrapper on first use: {uri}"
        if s.jit_disabled and _same_inputs_cached(cache, rendered):
            return f"cached (another toolchain's build): {planner.uri_prefix}"
        return (f"{off}: {planner.uri_prefix} is not precompiled in {cache.root}; "
                "`variantgen precompile` on a build box builds it with the prefill and decode modules")
    except Exception as e:  # noqa: BLE001 - informational: plan() runs planner-off then
        return f"{off}: {type(e).__name__}: {e}"


# What plan() does without the planner module, per module kind.
PLANNER_OFF = {
    "prefill": "planner off (one custom launch per request: the mask on every element, slower kernels)",
    "decode": "key trimming in torch ops (the same pages, a slower plan())",
}


def _has_toolchain() -> bool:
    try:
        _build.toolchain()
        return True
    except ToolchainError:
        return False


def _build_module(config: ModuleConfig, cache: Cache, **kwargs: Any):
    return _build.build_module(config, cache, **kwargs)


def build_default_cache() -> Cache:
    return _build.default_cache()


def _load(spec_arg: Any) -> VariantSpec:
    if isinstance(spec_arg, VariantSpec):
        return spec_arg
    if isinstance(spec_arg, (str, os.PathLike)):
        try:
            return resolve_spec(spec_arg)
        except SpecError as e:
            raise _Fail(str(e)) from None
    raise _Fail(f"spec must be a VariantSpec, a path to a spec file or a shipped spec name, "
                f"got {type(spec_arg).__name__}")


def _expected_uri(rendered: render.RenderedModule) -> str:
    """The URI build_module looks up (its key includes the toolchain when there is one)."""
    try:
        tc = _build.toolchain()
    except ToolchainError:
        tc = None
    return _build.module_key(rendered, tc).uri


def _same_inputs_cached(cache: Cache, rendered: render.RenderedModule) -> bool:
    try:
        key = _build.module_key(rendered, None)
        return bool(cache.find_same_inputs(rendered.config.uri_prefix, key.inputs_digest))
    except Exception:
        return False


def precompile_command(config: ModuleConfig, cache_root: Path | str) -> str:
    """The `variantgen precompile` command that puts ``config``'s module into ``cache_root``."""
    spec_path = config.spec.path
    if not spec_path or spec_path.startswith("<"):
        spec_path = f"<{config.spec.name}.yaml>"
    else:
        spec_path = shlex.quote(spec_path)
    parts = ["variantgen", "precompile", spec_path, "--head-dim", str(config.head_dim_qk),
             "--dtype", config.q_dtype, "--kv-dtype", config.kv_dtype]
    if config.o_dtype != config.q_dtype:
        parts += ["--o-dtype", config.o_dtype]
    if config.head_dim_vo != config.head_dim_qk:
        parts += ["--head-dim-vo", str(config.head_dim_vo)]
    parts += ["--backend", config.backend]  # explicit: precompile's default (auto) may pick another
    if config.kind != "prefill":
        parts += ["--kind", config.kind]
    parts += ["--arch", canonical_arch(config.arch), "--cache-dir", shlex.quote(str(cache_root))]
    return " ".join(parts)


# ----------------------------------------------------------------------------- flashinfer


def flashinfer_problem() -> str | None:
    """Why the installed flashinfer / tvm-ffi cannot be used, or None."""
    needed = f"variantgen needs flashinfer-python >= {NEEDED_FLASHINFER}"
    # Found through package metadata and files, without importing flashinfer (seconds of
    # import time a serving engine's startup should not pay for a cache lookup).
    try:
        package = _build.flashinfer_package_dir()
        found, _ = fi_versions.package_versions()
    except Exception as e:
        return (f"flashinfer is not installed ({type(e).__name__}: {e}); {needed} "
                "(pip install --no-deps flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2)")
    if not _version_at_least(found, NEEDED_FLASHINFER):
        return (f"flashinfer {found} is too old: {needed} (for csrc/batch_prefill_paged.cu and "
                "PrefillPlan in scheduler.cuh)")
    host = package / "data" / "csrc" / "batch_prefill_paged.cu"
    if not host.is_file():
        return f"flashinfer {found} lacks {host}; {needed} with its CUDA sources (a full wheel)"
    scheduler = package / "data" / "include" / "flashinfer" / "attention" / "scheduler.cuh"
    if not _mentions(str(scheduler), "PrefillPlan"):
        return f"flashinfer {found}: {scheduler} lacks PrefillPlan; {needed}"
    return None


def _version_at_least(found: str, needed: str) -> bool:
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging is nearly always there; compare the numeric prefix otherwise
        def nums(v: str) -> tuple[int, ...]:
            out = []
            for part in v.split("."):
                digits = "".join(c for c in part if c.isdigit())
                if not digits:
                    break
                out.append(int(digits))
            return tuple(out)

        return bool(nums(found)) and nums(found) >= nums(needed)
    try:
        return Version(found) >= Version(needed)
    except InvalidVersion:
        return False


@functools.lru_cache(maxsize=8)
def _mentions_cached(path: str, word: str, mtime_ns: int) -> bool:
    try:
        return word in Path(path).read_text(errors="replace")
    except OSError:
        return False


def _mentions(path: str, word: str) -> bool:
    try:
        mtime = Path(path).stat().st_mtime_ns
    except OSError:
        return False
    return _mentions_cached(path, word, mtime)


# ----------------------------------------------------------------------------- memo


def _spec_label(spec: Any) -> str:
    if isinstance(spec, VariantSpec):
        return spec.name
    return str(spec)


def _token(value: Any) -> Any:
    """A hashable stand-in for an argument (dtypes by name, devices by str)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    return (type(value).__name__, str(value))


def _memo_key(spec: Any, args: dict[str, Any]) -> tuple:
    if isinstance(spec, VariantSpec):
        spec_key: tuple = ("spec", spec.digest, spec.backends, spec.path)
    else:
        p = Path(spec)
        try:
            st = p.stat()
            spec_key = ("file", str(p), str(p.resolve()), st.st_mtime_ns, st.st_size)
        except OSError:
            spec_key = ("file", str(p), None, None)
    arg_key = tuple((k, _token(v)) for k, v in sorted(args.items()))
    return spec_key, arg_key, env.settings()

