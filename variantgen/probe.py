"""Can this spec run here, now? One call that answers yes, or no with the reason.

``probe`` is what a serving engine calls at startup before it advertises a variant
backend. It is truthy only when the module can run on this machine now: a GPU of the
target arch is visible, the module was found in the cache (or built, where JIT is on) and
it loaded. It never raises and never waits long: every failure, expected or not, becomes
``reason``, and a build another process holds the lock for is reported after
PROBE_LOCK_WAIT_S seconds ("being built by pid N ..."), not waited for. A reason never
asks a serving box to do something that starts a compile there.

``probe(..., runtime=False)`` answers another question, for build boxes and deployment
checks: is the module a server with JIT disabled would load for ``arch`` in the cache
(no GPU needed; nothing is built or loaded)? ``variantgen precompile ... --check`` asks it
for a whole matrix.

Checks run in this order, and the first failing one is reported:

1. the spec (file) is valid;
2. flashinfer is importable and new enough (>= 0.7.2: ``batch_prefill_paged.cu`` and
   ``PrefillPlan`` in ``scheduler.cuh``), apache-tvm-ffi is importable;
3. the combination (dtypes, head dims, backend, kernel kind, page size) is one the
   backend's modules support (fa3: sm90 only, 16-bit KV; see render.HEAD_DIMS);
4. a GPU of sm80 or newer is visible (and of ``arch`` when one is given); with
   ``runtime=False``: a target arch is known (``arch=``, the visible GPU, VARIANTGEN_ARCH);
5. with JIT disabled, ``build=False`` or ``runtime=False``: the module is in the cache, and
   intact (a truncated or corrupted entry is named with its path);
6. nvcc is found (CUDA_HOME);
7. the cache directory is writable (only when the module is absent);
8. no other process is building it (or it finishes within PROBE_LOCK_WAIT_S), and the
   build succeeds;
9. the module loads (not with ``runtime=False``).

Results are memoized per argument combination (and environment snapshot) for the life
of the process; ``probe.cache_clear()`` forgets them. A negative result caused by another
process's build in progress, or by the cache's file system (a full disk), is not memoized.
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import build as _build
from . import env, render
from .cache import Cache, LockTimeout
from .errors import BuildError, CacheError, JitDisabledError, SpecError, ToolchainError
from .library import resolve_spec
from .render import HEAD_DIMS, KINDS, ModuleConfig, canonical_arch, canonical_dtype
from .spec import BACKENDS, VariantSpec

log = logging.getLogger("variantgen.probe")

NEEDED_FLASHINFER = "0.7.2"
PROBE_LOCK_WAIT_S = 5.0  # how long probe() waits for another process's build of the module


@dataclass(frozen=True)
class ProbeResult:
    """The answer of :func:`probe`. Truthy exactly when ``ok``."""

    ok: bool
    reason: str = ""
    """Why not ("" when ok): one or a few lines a user can act on."""
    uri: str | None = None
    """The module's cache URI, once the configuration is known."""
    source: str = "not built"
    """'cache' (found), 'built' (built by this call), 'not built', or 'torch' (the flex route: no module)."""
    module_path: str | None = None
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"ok: {self.uri} ({self.source})"
        return f"no: {self.reason}"


class _Fail(Exception):
    """Internal: stop probing with this reason (and whether it may be memoized)."""

    def __init__(self, reason: str, *, transient: bool = False, **details: Any):
        super().__init__(reason)
        self.reason = reason
        self.transient = transient
        self.details = details


_memo: dict[tuple, ProbeResult] = {}
_memo_lock = threading.Lock()


def cache_clear() -> None:
    """Forget every memoized probe result (tests, or after installing a toolkit)."""
    with _memo_lock:
        _memo.clear()


# ----------------------------------------------------------------------------- public


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
) -> ProbeResult:
    """Say whether ``spec`` can run here, now, with these settings; never raises.

    Truthy only when a GPU is visible, the module is found in the cache or built (JIT on,
    ``build=True``) and loaded on it: then ``make_wrapper`` with the same settings succeeds
    without building. ``reason`` says why not, in words an operator can act on.

    ``kind`` is the kernel ("prefill", "ragged", "decode"; tensor-core decode runs the
    prefill module); ``backend`` "fa2" or "fa3", or None for the one make_wrapper(backend=None)
    picks here (build.select_backend: fa3 where valid; fa2 on a server that cannot build whose
    cache has the fa2 module but not the fa3 one, with ``details["note"]`` saying so);
    ``details["backend"]`` says which; "flex" asks whether torch's FlexAttention runs the spec on
    ``device`` (default: the current GPU, else the CPU) by running a small batch through it
    (flex_wrapper.probe_flex; no module, uri None). See :func:`probe_backends` for every backend
    at once.

    ``spec`` is a VariantSpec, a path to a spec file, or a shipped spec's name ("mm_prefix").
    ``device`` selects the GPU (default: the current one). ``arch``: the GPU's arch is checked
    against it. ``build=False`` only looks in the cache. ``cache_dir`` defaults to
    VARIANTGEN_CACHE_DIR. ``cuda_graph=True``: for a wrapper made with
    ``graph=GraphCapacity(...)`` (paged prefill on fa2, decode): other kinds and fa3 are demoted
    with the reason; no backend picks fa2, as make_wrapper does.

    ``runtime=False``: whether the cache holds the module a server with JIT disabled would load
    for ``arch`` (or the visible GPU, or VARIANTGEN_ARCH) - no GPU needed, nothing built or
    loaded; ``source`` is "cache" when it does. ``variantgen precompile ... --check`` asks this
    for a whole matrix.
    """
    t0 = time.perf_counter()
    args = dict(head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype, kv_dtype=kv_dtype,
                o_dtype=o_dtype, backend=backend, page_size=page_size, device=device, build=build,
                cache_dir=cache_dir, arch=arch, kind=kind, cuda_graph=cuda_graph, runtime=runtime)
    try:
        key = _memo_key(spec, args)
    except Exception:  # unhashable oddities: just do not memoize
        key = None
    if key is not None:
        with _memo_lock:
            hit = _memo.get(key)
        if hit is not None:
            return hit
    transient = False
    try:
        result = _probe(spec, t0, **args)
    except _Fail as f:
        transient = f.transient
        result = ProbeResult(False, f.reason, f.details.pop("uri", None), "not built", None,
                             time.perf_counter() - t0, f.details)
    except BaseException as e:  # noqa: BLE001 - probe never raises, whatever happens
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        log.debug("probe failed unexpectedly", exc_info=True)
        transient = True  # an unexpected failure may not repeat; do not pin it
        result = ProbeResult(False, f"internal error: {type(e).__name__}: {e}", None, "not built", None,
                             time.perf_counter() - t0, {})
    if result.ok:
        log.info("probe %s: ok (%s, %.2fs)", result.uri, result.source, result.seconds)
    else:
        log.debug("probe %s: %s", _spec_label(spec), result.reason)
    if key is not None and not transient:
        with _memo_lock:
            _memo[key] = result
    return result


# ----------------------------------------------------------------------------- the checks


def probe_backends(spec: VariantSpec | str | Path, *, kinds: tuple[str, ...] = ("prefill",),
                   backends: tuple[str, ...] = BACKENDS, **kwargs: Any) -> dict[tuple[str, str], ProbeResult]:
    """:func:`probe` for every (backend, kind): what an engine logs at startup to say which
    kernels it may advertise for this layer and why the others are demoted. Never raises."""
    return {(b, k): probe(spec, backend=b, kind=k, **kwargs) for k in kinds for b in backends}


def _probe(spec_arg: Any, t0: float, *, head_dim_qk: Any, head_dim_vo: Any, q_dtype: Any, kv_dtype: Any,
           o_dtype: Any, backend: Any, page_size: Any, device: Any, build: bool, cache_dir: Any,
           arch: Any, kind: Any, cuda_graph: Any = False, runtime: Any = True) -> ProbeResult:
    # 1. spec
    spec = _load(spec_arg)
    if backend == "flex":  # torch's FlexAttention: no flashinfer, module or nvcc (flex_wrapper.py)
        from .flex_wrapper import probe_flex

        answer = probe_flex(spec, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype,
                            kv_dtype=kv_dtype, o_dtype=o_dtype, kind=kind, device=device, cuda_graph=cuda_graph,
                            page_size=page_size)
        if not answer["ok"]:
            raise _Fail(answer["reason"], **answer["details"])
        return ProbeResult(True, "", None, "torch", None, time.perf_counter() - t0, answer["details"])
    if cuda_graph:  # what make_wrapper(graph=...) accepts
        if kind not in ("prefill", "decode"):
            raise _Fail(f"cuda_graph=True: CUDA-graph mode is for kind 'prefill' and 'decode' (got {kind!r}); "
                        "ragged wrappers allocate their metadata per plan()")
        if backend not in (None, "fa2"):
            raise _Fail(f"cuda_graph=True: CUDA-graph mode needs backend 'fa2' (got {backend!r}): the fa3 "
                        "planner's launch set depends on the batch")
        backend = "fa2"

    # 2. flashinfer
    problem = flashinfer_problem()
    if problem:
        raise _Fail(problem)

    # 3. the combination (with a placeholder arch when it is not known yet)
    config_fields = _config_fields(spec, head_dim_qk, head_dim_vo, q_dtype, kv_dtype, o_dtype, backend, kind)
    explicit_arch = None
    if arch is not None:
        try:
            explicit_arch = canonical_arch(arch)
        except ValueError as e:
            raise _Fail(str(e)) from None
    placeholder = "9.0a" if backend == "fa3" else "8.0"  # the arch check proper comes in step 4
    problems = ModuleConfig.problems_of(**dict(config_fields, backend=backend or "fa2"),
                                        arch=explicit_arch or placeholder)
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1):
        problems.append(f"page_size={page_size!r}: expected a positive whole number")
    if problems:
        raise _Fail("; ".join(problems))

    # 4. device / target arch
    try:
        s = env.settings()
    except ValueError as e:  # a malformed environment variable
        raise _Fail(str(e)) from None
    target, device_arch = _target_arch(explicit_arch, device, s.arch, runtime=bool(runtime))
    cache = Cache(cache_dir) if cache_dir is not None else build_default_cache()
    allow_build = bool(build) and bool(runtime)
    note = ""
    if backend is None:  # what make_wrapper(backend=None) picks here
        choice = _build.select_backend(spec, **{k: v for k, v in config_fields.items() if k not in ("spec", "backend")},
                                       arch=target, cache=cache, allow_build=allow_build)
        config_fields["backend"], note = choice.backend, choice.note
    try:
        config = ModuleConfig(**config_fields, arch=target)
    except ValueError as e:
        raise _Fail(str(e)) from None
    details: dict[str, Any] = {"arch": target, "device_arch": device_arch, "backend": config.backend,
                               "config": config.describe(), "cuda_graph": bool(cuda_graph),
                               "cache_dir": str(cache.root)}
    if note:
        details["note"] = note

    # 5-8. find (or build)
    rendered = render.render_module(config)
    details["uri"] = _expected_uri(rendered)
    result = _find(config, cache, rendered, s, build=bool(build), runtime=bool(runtime), details=details)
    entry = result.entry
    details.pop("uri")
    details["built"] = result.built
    details["loaded"] = False

    # 9. load
    if runtime:
        try:
            _build.load_module(entry)
        except Exception as e:
            raise _Fail(f"module {entry.uri} was found but failed to load: {type(e).__name__}: {e}",
                        uri=entry.uri, **details) from None
        details["loaded"] = True
    if config.kind == "prefill":
        details["row_planner"] = _row_planner_status(config, cache, allow_build)
    return ProbeResult(True, "", entry.uri, "built" if result.built else "cache", str(entry.module_path),
                       time.perf_counter() - t0, details)


def _target_arch(explicit: str | None, device: Any, env_arch: str | None, *, runtime: bool) -> tuple[str, str | None]:
    """(the arch to find the module for, the visible GPU's arch or None)."""
    if not runtime and explicit is not None:
        return explicit, None  # a cache check: no GPU query (build boxes have none)
    device_arch = _device_arch(device)
    if runtime:
        if device_arch is None:
            raise _Fail("no CUDA device visible: probe() answers whether the module runs here, and nothing can "
                        "run without a GPU (to check a cache for another machine: probe(..., runtime=False, "
                        "arch=...) or `variantgen precompile ... --check`)")
        if explicit is not None and explicit != device_arch:
            raise _Fail(f"arch={explicit} was given, but the visible GPU is {device_arch}: a module for {explicit} "
                        "does not run here (probe(..., runtime=False) checks a cache for another GPU)")
        return device_arch, device_arch
    if device_arch is not None:
        return device_arch, device_arch
    if env_arch:
        try:
            return canonical_arch(env_arch), None
        except ValueError as e:
            raise _Fail(f"VARIANTGEN_ARCH: {e}") from None
    raise _Fail("runtime=False: no target arch (pass arch=, e.g. arch='9.0a', or set VARIANTGEN_ARCH) and no "
                "CUDA device visible to take it from")


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
    """How plan() will classify rows: the spec's generated row kernel (cached, or built by
    make_wrapper in ~10 s), or the torch rules and why (a slower plan(), the same results: no
    reason to demote). Only looks in the cache."""
    from .intervals import analyze
    from .rowplan import PlannerConfig

    form = analyze(config.spec)
    if not form.planner_ready:
        return f"none: the interval planner is off for this spec ({form.reason})"
    planner = PlannerConfig(config.spec, config.arch)
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
        return (f"torch rules (slower plan()): {planner.uri_prefix} is not precompiled in {cache.root}; "
                "`variantgen precompile` on a build box builds it with the prefill modules")
    except Exception as e:  # noqa: BLE001 - informational: plan() falls back to the torch rules
        return f"torch rules (slower plan()): {type(e).__name__}: {e}"


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


def _config_fields(spec: VariantSpec, head_dim_qk: Any, head_dim_vo: Any, q_dtype: Any, kv_dtype: Any,
                   o_dtype: Any, backend: Any, kind: Any) -> dict[str, Any]:
    problems = []
    known = sorted({d for pairs in HEAD_DIMS.values() for pair in pairs for d in pair})
    dims = {}
    for name, value in (("head_dim_qk", head_dim_qk), ("head_dim_vo", head_dim_vo)):
        if value is None and name == "head_dim_vo":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name}={value!r}: expected a whole number, one of {known}")
        dims[name] = value
    dtypes = {}
    for name, value in (("q_dtype", q_dtype), ("kv_dtype", kv_dtype), ("o_dtype", o_dtype)):
        if value is None and name == "o_dtype":
            continue
        try:
            dtypes[name] = canonical_dtype(value, name)
        except ValueError as e:
            problems.append(str(e))
    if backend is not None and backend not in BACKENDS:
        problems.append(f"backend={backend!r}: expected one of {list(BACKENDS)}")
    if kind not in KINDS:
        problems.append(f"kind={kind!r}: expected one of {list(KINDS)}")
    if problems:
        raise _Fail("; ".join(problems))
    return {
        "spec": spec,
        "head_dim_qk": dims["head_dim_qk"],
        "head_dim_vo": dims.get("head_dim_vo", dims["head_dim_qk"]),
        "q_dtype": dtypes["q_dtype"],
        "kv_dtype": dtypes["kv_dtype"],
        "o_dtype": dtypes.get("o_dtype", dtypes["q_dtype"]),
        "backend": backend,
        "kind": kind,
    }


def _device_arch(device: Any) -> str | None:
    """The visible GPU's arch ('9.0a', '8.6'), None without CUDA; _Fail for GPUs fa2 cannot use."""
    import torch

    if device is None and not torch.cuda.is_available():
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except Exception as e:
        where = f"CUDA device {device}" if device is not None else "the CUDA device"
        raise _Fail(f"cannot query {where}: {type(e).__name__}: {e}") from None
    if major < 8:
        raise _Fail(f"GPU sm{major}{minor} is older than sm80, which fa2 needs")
    # Same rule as wrapper.device_arch, so probe finds the module make_wrapper will use.
    return canonical_arch(f"{major}.{minor}{'a' if major == 9 else ''}")


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
        found, _ = _build.package_versions()
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


probe.cache_clear = cache_clear  # type: ignore[attr-defined]
