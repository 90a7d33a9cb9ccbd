"""Build and load modules: toolchain discovery, ninja files, cache publishing, loading.

We write our own ninja file rather than going through FlashInfer's JitSpec: the build
happens in a staging folder of *our* cache (so publishing is one rename), only the
mask modes and the paged surface the wrapper calls are compiled (one .cu per mask mode
and CTA tile, so a many-core box builds them all at once), and a cached module is loaded
with ``tvm_ffi.load_module`` without running ninja again - which is what makes a
precompiled cache work on a server with JIT disabled and no compiler.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .cache import Cache, Entry, ModuleKey
from .env import settings
from .errors import BuildError, JitDisabledError, ToolchainError
from .render import ModuleConfig, RenderedModule, canonical_arch

if TYPE_CHECKING:
    from .rowplan import PlannerConfig

log = logging.getLogger("variantgen.build")


# ----------------------------------------------------------------------------- toolchain


@dataclass(frozen=True)
class FlashInferInfo:
    version: str
    include_dirs: tuple[Path, ...]  # -I (flashinfer, csrc, cccl)
    system_include_dirs: tuple[Path, ...]  # -isystem (cutlass, spdlog, tvm-ffi, dlpack, python)
    csrc_dir: Path  # FlashInfer's host sources (a module compiles the ones its kind names)
    tvm_ffi_version: str


@functools.lru_cache(maxsize=1)
def package_versions() -> tuple[str, str]:
    """(flashinfer, tvm-ffi) versions from package metadata: no import, so a cache lookup on
    a serving host stays cheap. PackageNotFoundError if either is missing."""
    from importlib.metadata import version

    return version("flashinfer-python"), version("apache-tvm-ffi")


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
    cxx: str
    cxx_version: str


def _run_version(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


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


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    home, tried = find_cuda_home()
    if home is None:
        via = "CUDA_HOME" if settings().cuda_home is not None else "PATH and /usr/local/cuda"
        raise ToolchainError(f"nvcc not found (looked in {via}: tried {', '.join(tried)}); "
                             "install the CUDA toolkit or set CUDA_HOME")
    nvcc = home / "bin" / "nvcc"
    text = _run_version([str(nvcc), "--version"])
    m = re.search(r"V(\d+\.\d+\.\d+)", text)
    if not m:
        raise ToolchainError(f"could not read the version of {nvcc}: {text.strip()[:200]}")
    cxx = os.environ.get("CXX", "c++")
    cxx_path = shutil.which(cxx)
    if cxx_path is None:
        raise ToolchainError(f"host C++ compiler {cxx!r} not found on PATH (set CXX)")
    cxx_version = _run_version([cxx_path, "--version"]).splitlines()[0].strip()
    return Toolchain(home, nvcc, "V" + m.group(1), cxx_path, cxx_version)


# ----------------------------------------------------------------------------- flags


def gencode_flags(arch: str) -> list[str]:
    tag = canonical_arch(arch).replace(".", "")
    return [f"-gencode=arch=compute_{tag},code=sm_{tag}"]


def semantic_flags(config: ModuleConfig | PlannerConfig) -> dict[str, list[str]]:
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
    fi_version, tvm_ffi_version = package_versions()
    inputs = (
        ("sources", rendered.source_digest()),
        ("templates", rendered.template_digest),
        ("flags", ModuleKey("", (("f", repr(semantic_flags(cfg))),)).digest),
        ("flashinfer", fi_version),
        ("tvm_ffi", tvm_ffi_version),
        ("arch", canonical_arch(cfg.arch)),
        ("variantgen", __version__),
    )
    tool = (("nvcc", tc.nvcc_version), ("cxx", tc.cxx_version)) if tc is not None else ()
    return ModuleKey(cfg.uri_prefix, inputs, tool)


# ----------------------------------------------------------------------------- ninja


def _ninja_file(rendered: RenderedModule, tc: Toolchain, src_dir: Path, out_name: str) -> str:
    fi = flashinfer_info()
    flags = semantic_flags(rendered.config)
    includes = [f"-I{src_dir}"] + [f"-I{p}" for p in fi.include_dirs]
    includes += [f"-isystem {p}" for p in fi.system_include_dirs]
    includes += [f"-isystem {tc.cuda_home / 'include'}"]
    nvcc_threads = f"--threads={settings().nvcc_threads}"
    q = shlex.quote
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {q(str(tc.nvcc))}",
        f"cxx = {q(tc.cxx)}",
        "includes = " + " ".join(includes),
        "cuda_flags = " + " ".join(flags["cuda"] + [nvcc_threads]),
        f"ldflags = {' '.join(flags['ld'])} -L{tc.cuda_home / 'lib64'}",
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
    objects = []
    units = [src_dir / u for u in rendered.compile_units] + [fi.csrc_dir / h for h in rendered.host_sources]
    for unit in units:
        obj = f"obj/{unit.stem}.o"
        objects.append(obj)
        lines.append(f"build {obj}: cuda_compile {unit}")
    lines += ["", f"build {out_name}: link {' '.join(objects)}", f"default {out_name}", ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class BuildResult:
    entry: Entry
    key: ModuleKey
    built: bool  # False: found in the cache
    seconds: float


def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    bindir = Path(sys.executable).parent / "ninja"
    if bindir.exists():
        return str(bindir)
    raise ToolchainError("ninja not found on PATH (pip install ninja)")


def build_module(config: ModuleConfig | PlannerConfig, cache: Cache, *, jobs: int | None = None,
                 rendered: RenderedModule | None = None, allow_build: bool = True) -> BuildResult:
    """Find ``config``'s module (a kernel module, or a spec's planner module) in the cache, or
    build and publish it.

    With JIT disabled (or ``allow_build=False``) this only looks up: the exact key when a
    toolchain is present, else any toolchain's build of the same inputs.
    """
    t0 = time.perf_counter()
    rendered = rendered or config.render()
    s = settings()
    jit_off = s.jit_disabled or not allow_build
    try:
        tc: Toolchain | None = toolchain()
    except ToolchainError:
        if not jit_off:
            raise
        tc = None
    key = module_key(rendered, tc)
    found = cache.lookup(key.uri)
    if found:
        return BuildResult(found.entry, key, False, time.perf_counter() - t0)
    if jit_off:
        same = cache.find_same_inputs(config.uri_prefix, key.inputs_digest)
        if same:
            if tc is not None:
                log.warning("using %s built by %s (local nvcc %s): JIT is disabled", same[0].uri,
                            same[0].manifest.get("toolchain", {}).get("nvcc"), tc.nvcc_version)
            return BuildResult(same[0], key, False, time.perf_counter() - t0)
        why = f"JIT disabled by {s.jit_disabled_by}" if s.jit_disabled else "building not allowed"
        raise JitDisabledError(f"{why} and module {key.uri} is not precompiled in {cache.root} "
                               f"({found.reason})")
    assert tc is not None
    ok, why = cache.writable()
    if not ok:
        raise JitDisabledError(f"{why}; module {key.uri} is not in it and cannot be built there")
    with cache.lock(key.uri, timeout=s.lock_timeout_s):
        found = cache.lookup(key.uri)  # another process may have finished it meanwhile
        if found:
            return BuildResult(found.entry, key, False, time.perf_counter() - t0)
        if found.reason != "not in cache":
            log.warning("rebuilding %s: %s", key.uri, found.reason)
        entry = _build_locked(rendered, key, tc, cache, jobs)
    return BuildResult(entry, key, True, time.perf_counter() - t0)


def _build_locked(rendered: RenderedModule, key: ModuleKey, tc: Toolchain, cache: Cache,
                  jobs: int | None) -> Entry:
    staging = cache.new_staging(key.uri)
    src_dir = staging / "src"
    src_dir.mkdir()
    for name, text in rendered.files.items():
        (src_dir / name).write_text(text)
    out_name = f"{key.uri}.so"
    (staging / "build.ninja").write_text(_ninja_file(rendered, tc, src_dir, out_name))
    cmd = [_ninja(), "-C", str(staging), "-f", "build.ninja"]
    jobs = jobs or settings().build_jobs
    if jobs:
        cmd += ["-j", str(jobs)]
    env = dict(os.environ, CUDA_HOME=str(tc.cuda_home))
    log.info("building %s (%d compile units)", key.uri, len(rendered.compile_units) + len(rendered.host_sources))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    (staging / "build.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not (staging / out_name).is_file():
        kept = cache.keep_failed(key.uri, staging)
        raise BuildError(
            f"building module {key.uri} failed (ninja exit {proc.returncode} after {seconds:.1f}s)",
            log_path=str(kept / "build.log"),
            command=f"ninja -C {shlex.quote(str(kept))} -f build.ninja  "
                    "(paths inside point at the original staging folder; re-run the variantgen command "
                    "to regenerate)",
            output=proc.stdout + proc.stderr,
        )
    # Keep what explains the module (sources, ninja file, log); drop the bulky objects.
    shutil.rmtree(staging / "obj", ignore_errors=True)
    for junk in (".ninja_deps", ".ninja_log"):
        (staging / junk).unlink(missing_ok=True)
    manifest = {
        "module_file": out_name,
        "config": rendered.config.describe(),
        "spec_digest": rendered.config.spec.digest,
        "inputs": dict(key.inputs),
        "inputs_digest": key.inputs_digest,
        "toolchain": dict(key.toolchain),
        "key_digest": key.digest,
        "tensor_args": [a.name for a in rendered.tensor_args],
        "scalar_args": [a.name for a in rendered.scalar_args],
        "build_command": " ".join(shlex.quote(c) for c in cmd),
        "build_seconds": round(seconds, 2),
        "built_at": time.time(),
        "built_by_pid": os.getpid(),
        "host": os.uname().nodename,
    }
    entry = cache.publish(key.uri, staging, manifest)
    log.info("built %s in %.1fs", key.uri, seconds)
    return entry


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
