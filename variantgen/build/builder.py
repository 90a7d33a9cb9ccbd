"""Build and load modules: toolchain discovery, ninja files, cache publishing, loading.

We write our own ninja file rather than going through FlashInfer's JitSpec: the build
happens in a staging folder of *our* cache (so publishing is one rename), only the
mask modes and the paged surface the wrapper calls are compiled (one .cu per mask mode
and CTA tile, so a many-core box builds them all at once), and a cached module is loaded
with ``tvm_ffi.load_module`` without running ninja again - which is what makes a
precompiled cache work on a server with JIT disabled and no compiler.

A build runs under the module's lock. Waiters see the builder's pid in the lock; a build
that fails is recorded in ``.failed/<uri>``, and processes that were waiting for it report
that failure instead of compiling the same failing module again one after another.
Running ninja (progress, log, ending the compilers on errors) is ninja.py's part.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._version import __version__
from ..codegen import fi_versions
from ..codegen.render import RenderedModule, SharedUnit, canonical_arch, render_module
from ..core.env import NVCC_FLAG_VARIABLES, settings
from ..core.errors import BuildError, JitDisabledError, ToolchainError, first_compiler_error, system_failure
from ..core.progress import BuildProgress
from ..lang.values import VariantSpec
from . import ninja as _ninja_run
from . import objects as _objects
from . import place as _place
from .cache import Cache, Entry, LockHolder, LockTimeout, ModuleKey, path_error

log = logging.getLogger("variantgen.build.builder")


def rendered_sources(config: Any) -> RenderedModule:
    """A configuration's sources: a kernel module's (ModuleConfig) from codegen.render; a config of
    a layer above (the planner's row kernel) renders itself."""
    own = getattr(config, "render", None)
    return own() if own is not None else render_module(config)


class Buildable(Protocol):
    """What build_module builds: a kernel module's render.ModuleConfig, or a spec's planner module
    (rowplan.PlannerConfig) - anything that renders its sources and names its module."""

    spec: VariantSpec
    arch: str
    kind: str

    @property
    def uri_prefix(self) -> str: ...

    def render(self) -> RenderedModule: ...

    def describe(self) -> dict[str, object]: ...


# ----------------------------------------------------------------------------- toolchain


@dataclass(frozen=True)
class FlashInferInfo:
    version: str
    include_dirs: tuple[Path, ...]  # -I (flashinfer, csrc, cccl)
    system_include_dirs: tuple[Path, ...]  # -isystem (cutlass, spdlog, tvm-ffi, dlpack, python)
    csrc_dir: Path  # FlashInfer's host sources (a module compiles the ones its kind names)
    tvm_ffi_version: str


@functools.lru_cache(maxsize=1)
def flashinfer_package_dir() -> Path:
    """Where the flashinfer package lives, found without importing it."""
    import importlib.util

    found = importlib.util.find_spec("flashinfer")
    if found is None or not found.submodule_search_locations:
        raise ImportError("flashinfer is not installed")
    return Path(list(found.submodule_search_locations)[0])


@functools.lru_cache(maxsize=1)
def flashinfer_info() -> FlashInferInfo:
    """Paths and versions of the installed flashinfer / tvm-ffi (ImportError if absent)."""
    import sysconfig

    import flashinfer
    import tvm_ffi
    from flashinfer.jit import env as fi_env

    csrc = Path(fi_env.FLASHINFER_CSRC_DIR)
    cccl = tuple(Path(p) for p in getattr(fi_env, "CCCL_INCLUDE_DIRS", ()))
    system = [Path(p) for p in getattr(fi_env, "CUTLASS_INCLUDE_DIRS", ())]
    if hasattr(fi_env, "SPDLOG_INCLUDE_DIR"):
        system.append(Path(fi_env.SPDLOG_INCLUDE_DIR))
    system += [Path(tvm_ffi.libinfo.find_include_path()), Path(tvm_ffi.libinfo.find_dlpack_include_path()),
               Path(sysconfig.get_path("include"))]
    return FlashInferInfo(
        version=str(flashinfer.__version__),
        include_dirs=(Path(fi_env.FLASHINFER_INCLUDE_DIR), csrc, *cccl),
        system_include_dirs=tuple(system),
        csrc_dir=csrc,
        tvm_ffi_version=str(getattr(tvm_ffi, "__version__", "unknown")),
    )


@dataclass(frozen=True)
class Toolchain:
    cuda_home: Path
    nvcc: Path
    nvcc_version: str  # e.g. 'V13.0.88'
    cxx: str  # links the module
    cxx_version: str
    # The compiler nvcc compiles host code with (passed as -ccbin, so it is the one keyed); ""
    # leaves the choice to nvcc (test toolchains only)
    host_cc: str = ""
    host_cc_version: str = ""


VERSION_TIMEOUT_S = 10.0
"""How long a compiler's ``--version`` may take: a hung or broken nvcc must not stall a lookup."""


def _run_version(cmd: list[str], what: str) -> str:
    """The output of ``cmd`` (a compiler's --version); ToolchainError naming ``what`` and the path
    if it cannot run, fails or does not answer within VERSION_TIMEOUT_S."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, errors="replace", start_new_session=True)
    except OSError as e:
        raise ToolchainError(f"cannot run {what} {cmd[0]}: {e.strerror or e}") from None
    try:
        out, _ = proc.communicate(timeout=VERSION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # the whole group: a wrapper script's children would hold the pipe open
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise ToolchainError(f"{what} {cmd[0]} did not answer `--version` within {VERSION_TIMEOUT_S:g}s") from None
    if proc.returncode != 0:
        raise ToolchainError(f"{what} {cmd[0]} --version failed (exit {proc.returncode}): {out.strip()[:200]}")
    return out


def find_cuda_home() -> tuple[Path | None, list[str]]:
    """CUDA_HOME if set, else nvcc's parent on PATH, else /usr/local/cuda. Also: paths tried."""
    tried = []
    s = settings()
    candidates: list[Path] = []
    if s.cuda_home is not None:
        candidates.append(s.cuda_home)
    else:
        nvcc = shutil.which("nvcc")
        if nvcc:
            candidates.append(Path(nvcc).resolve().parent.parent)
        candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        tried.append(str(home / "bin" / "nvcc"))
        # A toolkit has its headers beside nvcc; a wrapper script on PATH (e.g.
        # /usr/local/bin/nvcc) does not, and its parent is no CUDA home.
        if (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime.h").is_file():
            return home, tried
        if s.cuda_home is not None:
            break  # an explicit CUDA_HOME that lacks nvcc is an error, not a fallback
    return None, tried


def nvcc_host_compiler() -> str:
    """The host compiler nvcc would use: NVCC_CCBIN (a compiler, or a folder holding gcc), else
    gcc on PATH (nvcc's default on Linux). An absolute path; ToolchainError if there is none, or
    if NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS choose one themselves (the key could not name it)."""
    s = settings()
    for name, value in s.nvcc_env:
        if any(f == "-ccbin" or f.startswith(("-ccbin=", "--compiler-bindir")) for f in value.split()):
            raise ToolchainError(f"{name}={value!r} sets nvcc's host compiler; set NVCC_CCBIN instead, so that "
                                 "the module key names the compiler")
    wanted = s.nvcc_ccbin or "gcc"
    if s.nvcc_ccbin and Path(wanted).is_dir():
        wanted = str(Path(wanted) / "gcc")
    found = shutil.which(wanted)
    if found is None:
        where = f"NVCC_CCBIN={s.nvcc_ccbin!r}" if s.nvcc_ccbin else "PATH"
        raise ToolchainError(f"nvcc's host compiler {wanted!r} not found ({where}); install gcc or set NVCC_CCBIN")
    return os.path.abspath(found)


def _probe_toolchain() -> Toolchain:
    home, tried = find_cuda_home()
    if home is None:
        via = "CUDA_HOME" if settings().cuda_home is not None else "PATH and /usr/local/cuda"
        raise ToolchainError(f"nvcc not found (looked in {via}: tried {', '.join(tried)}); "
                             "install the CUDA toolkit or set CUDA_HOME")
    nvcc = home / "bin" / "nvcc"
    text = _run_version([str(nvcc), "--version"], "nvcc")
    m = re.search(r"V(\d+\.\d+\.\d+)", text)
    if not m:
        raise ToolchainError(f"could not read the version of {nvcc}: {text.strip()[:200]}")
    cxx = os.environ.get("CXX", "c++")
    cxx_path = shutil.which(cxx)
    if cxx_path is None:
        raise ToolchainError(f"host C++ compiler {cxx!r} not found on PATH (set CXX)")
    cxx_path = os.path.abspath(cxx_path)  # CXX=./g++: ninja links in the staging folder
    cxx_version = _run_version([cxx_path, "--version"], "host C++ compiler").splitlines()[0].strip()
    host_cc = nvcc_host_compiler()
    host_cc_version = _run_version([host_cc, "--version"], "nvcc's host compiler").splitlines()[0].strip()
    return Toolchain(home, nvcc, "V" + m.group(1), cxx_path, cxx_version, host_cc, host_cc_version)


@functools.lru_cache(maxsize=1)
def _toolchain_or_error() -> Toolchain | ToolchainError:
    try:
        return _probe_toolchain()
    except ToolchainError as e:
        return e


def toolchain() -> Toolchain:
    """The toolchain builds use (ToolchainError if there is none). Probed once per process, a
    failure too: a lookup with JIT disabled asks for it, and a hung nvcc must cost one
    VERSION_TIMEOUT_S, not one per module."""
    found = _toolchain_or_error()
    if isinstance(found, ToolchainError):
        raise ToolchainError(str(found))
    return found


toolchain.cache_clear = _toolchain_or_error.cache_clear  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- flags


def gencode_flags(arch: str) -> list[str]:
    tag = canonical_arch(arch).replace(".", "")
    return [f"-gencode=arch=compute_{tag},code=sm_{tag}"]


def semantic_flags(config: Buildable) -> dict[str, list[str]]:
    """Flags that change the machine code (hashed into the key); paths are added at build."""
    return {
        "cuda": [
            "-std=c++17", "-O3", "-DNDEBUG", "-use_fast_math", "--expt-relaxed-constexpr",
            "-Xfatbin=-compress-all", "--compress-mode=size", "-static-global-template-stub=false",
            "--compiler-options=-fPIC",
            "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16",
            "-DFLASHINFER_ENABLE_FP8_E4M3", "-DFLASHINFER_ENABLE_FP8_E5M2",
            *gencode_flags(config.arch),
        ],
        # No -lcuda: the module uses the runtime API only, and build boxes without a
        # driver have no libcuda to link against.
        "ld": ["-shared", "-lcudart"],
    }


def module_key(rendered: RenderedModule, tc: Toolchain | None) -> ModuleKey:
    cfg = rendered.config
    fi_version, tvm_ffi_version = fi_versions.package_versions()
    inputs = (
        ("sources", rendered.source_digest()),
        ("templates", rendered.template_digest),
        ("flags", ModuleKey("", (("f", repr(semantic_flags(cfg))),)).digest),
        ("flashinfer", fi_version),
        ("tvm_ffi", tvm_ffi_version),
        ("arch", canonical_arch(cfg.arch)),
        ("variantgen", __version__),
    )
    s = settings()
    if s.split_compile > 1:  # nvcc's split optimizer allocates registers differently: other machine code
        inputs += (("nvcc_split_compile", str(s.split_compile)),)
    # nvcc adds NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS to every command (-G, -O0, ...); the build
    # gets exactly these values (build_env)
    inputs += tuple((name.lower(), value) for name, value in s.nvcc_env)
    tool: tuple[tuple[str, str], ...] = ()
    if tc is not None:
        tool = (("nvcc", tc.nvcc_version), ("cxx", tc.cxx_version))
        if tc.host_cc:
            tool += (("host_cc", f"{tc.host_cc_version} ({tc.host_cc})"),)
    return ModuleKey(cfg.uri_prefix, inputs, tool)


def build_env(tc: Toolchain) -> dict[str, str]:
    """The environment ninja and the compilers run in: ours, with the nvcc variables the key names
    (settings' snapshot of them, whatever os.environ holds now) and no NVCC_CCBIN (the ninja file
    passes the keyed host compiler as -ccbin)."""
    nvcc_vars = ("NVCC_CCBIN", *NVCC_FLAG_VARIABLES)
    env = {k: v for k, v in os.environ.items() if k not in nvcc_vars}
    env.update(settings().nvcc_env)
    env["CUDA_HOME"] = str(tc.cuda_home)
    return env


def shared_object_key(rendered: RenderedModule, unit: SharedUnit, tc: Toolchain) -> ModuleKey:
    """The key of a shared unit's object (objects.py): the module's key with the unit and the
    module files it includes in place of the module's sources - the templates, flags, versions,
    arch and toolchain stay."""
    module = module_key(rendered, tc)
    inputs = (("unit", rendered.unit_digest(unit.file)), *((k, v) for k, v in module.inputs if k != "sources"))
    return ModuleKey(unit.prefix, inputs, module.toolchain)


# ----------------------------------------------------------------------------- ninja


def _ninja_file(rendered: RenderedModule, tc: Toolchain, src_dir: Path, out_name: str,
                shared: dict[str, tuple[ModuleKey, Path]] | None = None, store: Path | None = None) -> str:
    """The module's build.ninja. Every path is escaped (ninja's ``$ ``, ``$:``, ``$$`` in build
    lines; shell quoting and ``$$`` in command variables): cache and toolkit paths may hold
    spaces, colons and dollars. ``src_dir``: the rendered sources as the file names them (builds
    pass ``src``, relative to the folder ninja runs in). ``shared``: unit file -> (object key, its
    description file) for the units compiled once per cache (objects.py) in ``store``."""
    fi = flashinfer_info()
    flags = semantic_flags(rendered.config)
    includes = [f"-I{src_dir}"] + [f"-I{p}" for p in fi.include_dirs]
    for p in (*fi.system_include_dirs, tc.cuda_home / "include"):
        includes += ["-isystem", str(p)]
    # --threads leaves the machine code of one target as it is (not in the key); --split-compile
    # does not (module_key names it); -ccbin: the host compiler the key names (its version and
    # path), not whatever nvcc would find on the PATH ninja runs with
    nvcc_only = [f"--threads={settings().nvcc_threads}"]
    if settings().split_compile > 1:
        nvcc_only.append(f"--split-compile={settings().split_compile}")
    if tc.host_cc:
        nvcc_only += ["-ccbin", tc.host_cc]
    args = _ninja_run.shell_args
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {args([tc.nvcc])}",
        f"cxx = {args([tc.cxx])}",
        f"includes = {args(includes)}",
        f"cuda_flags = {args(flags['cuda'] + nvcc_only)}",
        "ldflags = " + args([*flags["ld"], f"-L{tc.cuda_home / 'lib64'}"]),
        "",
        "rule cuda_compile",
        "  command = $nvcc --generate-dependencies-with-compile -MF $out.d $cuda_flags $includes -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $in",
        "",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = link $out",
        "",
    ]
    shared = shared or {}
    if shared:
        assert store is not None
        package_parent = Path(__file__).resolve().parents[2]  # `python -m variantgen.build.shared_compile` finds us
        path = os.pathsep.join([str(package_parent), *filter(None, [os.environ.get("PYTHONPATH")])])
        python = sys.executable or shutil.which("python3") or "python3"
        helper = ["env", f"PYTHONPATH={path}", python, "-m", "variantgen.build.shared_compile", "--store", str(store),
                  "--lock-timeout", f"{settings().lock_timeout_s:g}"]
        lines += [
            f"objects = {args(helper)}",
            "rule shared_compile",
            f"  command = $objects --uri $uri --describe $describe --out $out -- $nvcc $cuda_flags $includes "
            f"-c $in -o {_objects.PLACEHOLDER}",
            "  description = nvcc $in (shared object $uri)",
            "",
        ]
    objects = []
    units = [src_dir / u for u in rendered.compile_units] + [fi.csrc_dir / h for h in rendered.host_sources]
    for unit in units:
        obj = f"obj/{unit.stem}.o"
        objects.append(obj)
        if unit.name in shared and unit.parent == src_dir:
            key, describe = shared[unit.name]
            lines += [f"build {obj}: shared_compile {_ninja_run.escape_path(unit)}", f"  uri = {args([key.uri])}",
                      f"  describe = {args([describe])}"]
        else:
            lines.append(f"build {obj}: cuda_compile {_ninja_run.escape_path(unit)}")
    lines += ["", f"build {out_name}: link {' '.join(objects)}", f"default {out_name}", ""]
    return "\n".join(lines)


# (uri, compile units, config kind) -> what reports the build's progress (progress.BuildProgress)
ProgressFactory = Callable[[str, int, str], BuildProgress]


@dataclass(frozen=True)
class BuildResult:
    entry: Entry
    key: ModuleKey
    built: bool  # False: found in the cache
    seconds: float


def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return os.path.abspath(found)  # ninja starts in the build folder (ninja.run's wrapper)
    bindir = Path(sys.executable).parent / "ninja"
    if bindir.exists():
        return str(bindir)
    raise ToolchainError("ninja not found on PATH (pip install ninja)")


def lookup_module(config: Buildable, cache: Cache, *,
                  rendered: RenderedModule | None = None) -> tuple[BuildResult | None, ModuleKey, list[str]]:
    """What a server with JIT disabled loads for ``config``, without building: the exact key
    (with this machine's toolchain, when it has one), else a build of the same inputs by any
    toolchain. Also: the key, and why entries that would have matched are unusable (damaged,
    corrupted: the reasons name their paths)."""
    t0 = time.perf_counter()
    rendered = rendered or rendered_sources(config)
    try:
        tc: Toolchain | None = toolchain()
    except ToolchainError:
        tc = None
    key = module_key(rendered, tc)
    found = cache.lookup(key.uri)
    if found:
        return BuildResult(found.entry, key, False, time.perf_counter() - t0), key, []
    damaged = [] if found.reason == "not in cache" else [found.reason]
    same = cache.find_same_inputs(config.uri_prefix, key.inputs_digest)
    if same:
        return BuildResult(same[0], key, False, time.perf_counter() - t0), key, []
    damaged += [r for r in cache.damaged_same_inputs(config.uri_prefix, key.inputs_digest) if r not in damaged]
    return None, key, damaged


def build_module(config: Buildable, cache: Cache, *, jobs: int | None = None,
                 rendered: RenderedModule | None = None, allow_build: bool = True,
                 lock_timeout: float | None = None, progress: ProgressFactory | None = None) -> BuildResult:
    """Find ``config``'s module (a kernel module, or a spec's planner module) in the cache, or
    build and publish it.

    With JIT disabled (or ``allow_build=False``) this only looks up (lookup_module):
    JitDisabledError if the module is not there (``damaged`` lists unusable entries).
    ``lock_timeout``: how long to wait for another process's build of the same module
    (default VARIANTGEN_LOCK_TIMEOUT; LockTimeout names the holder). A build that failed in
    another process while this one waited is reported (BuildError), not run again.
    ``progress``: makes the build's BuildProgress from (uri, units, kind), to report
    differently (precompile drops finished bars); default: progress.BuildProgress.
    """
    t0 = time.perf_counter()
    rendered = rendered or rendered_sources(config)
    s = settings()
    jit_off = s.jit_disabled or not allow_build
    if jit_off:
        result, key, damaged = lookup_module(config, cache, rendered=rendered)
        if result is not None:
            if result.entry.uri != key.uri and key.toolchain:
                log.warning("using %s built by nvcc %s (local nvcc %s): JIT is disabled", result.entry.uri,
                            result.entry.manifest.get("toolchain", {}).get("nvcc"), dict(key.toolchain)["nvcc"])
            return result
        why = f"JIT disabled by {s.jit_disabled_by}" if s.jit_disabled else "building not allowed"
        state = f"unusable: {'; '.join(damaged)}" if damaged else "not in cache"
        raise JitDisabledError(f"{why} and module {key.uri} is not precompiled in {cache.root} ({state})",
                               damaged=damaged)
    tc = toolchain()
    key = module_key(rendered, tc)
    found = cache.lookup(key.uri)
    if found:
        return BuildResult(found.entry, key, False, time.perf_counter() - t0)
    ok, why = cache.writable()
    if not ok:
        raise JitDisabledError(f"{why}; module {key.uri} is not in it and cannot be built there")

    def waiting(holder: LockHolder | None) -> None:
        log.info("waiting for %s: being built by %s", key.uri, holder.describe() if holder else "another process")

    waited_since = time.time()
    with cache.lock(key.uri, timeout=s.lock_timeout_s if lock_timeout is None else lock_timeout, on_wait=waiting,
                    check=_ninja_run.check_abort):
        found = cache.lookup(key.uri)  # another process may have finished it meanwhile
        if found:
            return BuildResult(found.entry, key, False, time.perf_counter() - t0)
        failed = cache.failure(key.uri)
        if failed is not None and failed.key_digest == key.digest and failed.failed_at >= waited_since:
            ago = max(0.0, time.time() - failed.failed_at)
            raise BuildError(f"building module {key.uri} failed in pid {failed.pid} on {failed.host} {ago:.0f}s ago, "
                             f"while this process waited for that build; not tried again ({failed.message})",
                             log_path=failed.log_path, first_error=failed.first_error)
        if found.reason != "not in cache":
            log.warning("rebuilding %s: %s", key.uri, found.reason)
        entry = _build_locked(rendered, key, tc, cache, jobs, progress)
    return BuildResult(entry, key, True, time.perf_counter() - t0)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise path_error(e, path, "write") from None


def _end_killed(cache: Cache, uri: str) -> list[Path]:
    """The staging folders killed builds of ``uri`` left, their compilers ended where they still
    run (call with the URI's lock held: no live build of it has one)."""
    attempts = cache.attempts(uri)
    for old in attempts:
        if _ninja_run.end_recorded(old):
            log.warning("ended the compilers of a killed build of %s (%s)", uri, old)
        _place.forget(old)
    return attempts


def discard_killed_builds(cache: Cache) -> int:
    """Remove what killed builds left in ``cache`` (and in its shared objects' store): staging
    folders, their compilers first, and lock files. Only of URIs no process builds now (their lock
    is taken without waiting). How many URIs had something removed. (A later build of the same
    URI removes them too, but a changed key - a new FlashInfer or nvcc - never builds it again.)"""
    cleaned = 0
    for store in (cache, _objects.object_cache(cache)):
        for uri in store.in_flight():
            try:
                with store.lock(uri, timeout=0):
                    for old in _end_killed(store, uri):
                        store.discard_staging(old)
            except LockTimeout:
                continue  # being built
            cleaned += 1
    return cleaned


def _build_locked(rendered: RenderedModule, key: ModuleKey, tc: Toolchain, cache: Cache,
                  jobs: int | None, progress: ProgressFactory | None = None) -> Entry:
    """Build ``key``'s module in a fresh staging folder and publish it; call with the lock held.
    Whatever happens, no staging folder and no compiler process outlives a failed call."""
    _end_killed(cache, key.uri)
    staging = cache.new_staging(key.uri)  # removes the killed builds' folders
    try:
        return _build_in(staging, rendered, key, tc, cache, jobs, progress)
    except BaseException:
        cache.discard_staging(staging)  # gone already if it was kept as failed or published
        raise


def _build_in(staging: Path, rendered: RenderedModule, key: ModuleKey, tc: Toolchain, cache: Cache,
              jobs: int | None, progress: ProgressFactory | None) -> Entry:
    src_dir = staging / "src"
    try:
        src_dir.mkdir()
    except OSError as e:
        raise path_error(e, src_dir, "create") from None
    for name, text in rendered.files.items():
        _write(src_dir / name, text)
    out_name = f"{key.uri}.so"
    store = _objects.object_cache(cache)
    shared: dict[str, tuple[ModuleKey, Path]] = {}
    for unit in rendered.shared_units:  # compiled once per cache, linked here (objects.py)
        unit_key = shared_object_key(rendered, unit, tc)
        describe = Path(f"{Path(unit.file).stem}.object.json")  # relative to the staging folder, as in src_dir
        _write(staging / describe, json.dumps({"unit": unit.file, "inputs": dict(unit_key.inputs),
                                     "inputs_digest": unit_key.inputs_digest, "toolchain": dict(unit_key.toolchain),
                                     "key_digest": unit_key.digest, "first_module": key.uri}, indent=1))
        shared[unit.file] = (unit_key, describe)
    # Paths inside the folder are written relative to it (ninja runs in it): a failed build kept
    # in .failed/<uri>, or a published entry, re-runs there as it is.
    # The store through a link in the build folder: its path may hold anything (build_place.py)
    _write(staging / "build.ninja", _ninja_file(rendered, tc, Path("src"), out_name, shared, Path(_place.STORE_LINK)))
    with _place.compile_dir(staging, store.root) as where:
        return _run_and_publish(where, staging, rendered, key, tc, cache, jobs, progress, out_name, shared)


def _run_and_publish(where: Path, staging: Path, rendered: RenderedModule, key: ModuleKey, tc: Toolchain,
                     cache: Cache, jobs: int | None, progress: ProgressFactory | None, out_name: str,
                     shared: dict[str, tuple[ModuleKey, Path]]) -> Entry:
    """Run ninja in ``where`` (the staging folder, or a plain-named copy of it: build_place.py);
    publish the staging folder, or keep it as failed."""
    cmd = [_ninja(), "-C", str(where), "-f", "build.ninja"]
    s = settings()
    jobs = jobs or s.build_jobs
    if jobs:
        cmd += ["-j", str(jobs)]
    env = _place.build_env(build_env(tc), where)
    if s.nvcc_env:
        log.info("building %s with %s (part of its key)", key.uri,
                 ", ".join(f"{name}={value!r}" for name, value in s.nvcc_env))
    units = len(rendered.compile_units) + len(rendered.host_sources)
    report = (progress or BuildProgress)(key.uri, units, rendered.config.kind)
    ok = False
    try:
        run = _ninja_run.run(cmd, cwd=where, env=env, log_path=staging / "build.log", timeout=s.build_timeout_s,
                             on_status=report.update, record_dir=staging)
        ok = run.returncode == 0 and not run.timed_out and (where / out_name).is_file()
        if ok:
            _place.bring_back(where, staging, out_name)
    finally:
        report.close(ok)
    (staging / _place.BUILD_DIR_RECORD).unlink(missing_ok=True)  # for killed builds only; ours ends below
    if not ok:
        if run.timed_out:
            what = f"timed out after {run.seconds:.0f}s (VARIANTGEN_BUILD_TIMEOUT={s.build_timeout_s:g}); ended"
        else:
            what = f"ninja exit {run.returncode} after {run.seconds:.1f}s"
        message = f"building module {key.uri} failed ({what})"
        cause = system_failure(run.output)
        if cause:  # the tools' last words ("ld returned 1 exit status") hide it
            message += f": {cause} (in the cache {cache.root}, or the build's temporary folder {where})"
        kept = cache.keep_failed(key.uri, staging, {"key_digest": key.digest, "message": what,
                                                   "first_error": first_compiler_error(run.output)})
        raise BuildError(
            message + (f"; {run.log_problem}" if run.log_problem else ""),
            log_path=str(kept / "build.log"),
            command=_place.reproduce_command(kept, "".join(f"{name}={shlex.quote(value)} "
                                                           for name, value in s.nvcc_env)),
            output=run.output,
        )
    if run.log_problem:
        log.warning("module %s built; its build.log is incomplete: %s", key.uri, run.log_problem)
    # Keep what explains the module (sources, ninja file, log); drop the bulky objects.
    shutil.rmtree(staging / "obj", ignore_errors=True)
    shutil.rmtree(staging / "tmp", ignore_errors=True)
    for junk in (".ninja_deps", ".ninja_log", _place.STORE_LINK):
        (staging / junk).unlink(missing_ok=True)
    manifest = {
        "module_file": out_name,
        "config": rendered.config.describe(),
        "spec_digest": rendered.config.spec.digest,
        "inputs": dict(key.inputs),
        "inputs_digest": key.inputs_digest,
        "toolchain": dict(key.toolchain),
        "key_digest": key.digest,
        "shared_objects": {unit: unit_key.uri for unit, (unit_key, _) in shared.items()},
        "tensor_args": [a.name for a in rendered.tensor_args],
        "scalar_args": [a.name for a in rendered.scalar_args],
        "build_command": " ".join(shlex.quote(c) for c in cmd),
        "build_seconds": round(run.seconds, 2),
        "built_at": time.time(),
        "built_by_pid": os.getpid(),
        "host": os.uname().nodename,
    }
    return cache.publish(key.uri, staging, manifest)


# ----------------------------------------------------------------------------- loading


@functools.lru_cache(maxsize=64)
def _load(path: str, sha: str) -> Any:
    import tvm_ffi

    return tvm_ffi.load_module(path)


def load_module(entry: Entry) -> Any:
    """Load a published module (once per process per file content)."""
    return _load(str(entry.module_path), entry.manifest["module_sha256"])


def default_cache() -> Cache:
    return Cache(settings().cache_dir)
