"""`variantgen doctor`: can this machine build modules, and run them?

Each check is one line - ok / warn / missing, what was found, and the fix - about what a
build or a run here needs: FlashInfer and tvm-ffi, nvcc, the host compilers, ninja, the
CUDA runtime headers and library, every header the rendered fa2 and fa3 modules (and the
FlashInfer host sources they compile) include, the cache folder, the JIT setting, the GPU.
Nothing is built or written; the GPU is queried as probe() does (torch.cuda).

Two routes run a spec: FlashInfer modules on a GPU (need "gpu") and torch's FlexAttention (the
flex route, need "flex"), which runs every spec on any torch device, the CPU included. Need
"run" is met by either, so a CPU machine can run (the flex route) and a serving box that must
run modules asks for "gpu".
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..build import builder as build
from ..codegen import fi_versions
from ..core import env
from ..core.errors import ToolchainError

OK, WARN, MISSING = "ok", "warn", "missing"
BUILD, RUN, GPU, FLEX = "build", "run", "gpu", "flex"
NEEDS = (BUILD, RUN, GPU, FLEX)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.MULTILINE)
_FALLBACK_INCLUDE_DIRS = (Path("/usr/include"), Path("/usr/local/include"))  # the host compiler's own


@dataclass(frozen=True)
class Check:
    """One line of the report. ``needed_for``: what a failure of it rules out (build, run)."""

    name: str
    status: str  # OK, WARN or MISSING
    detail: str
    fix: str = ""
    needed_for: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]

    def can(self, what: str) -> bool:
        if what == RUN:  # either route runs a spec
            return self.can(GPU) or self.can(FLEX)
        return all(c.status != MISSING for c in self.checks if what in c.needed_for)

    def blockers(self, what: str) -> list[Check]:
        if what == RUN:
            return [] if self.can(RUN) else self.blockers(GPU) + self.blockers(FLEX)
        return [c for c in self.checks if what in c.needed_for and c.status == MISSING]


def run_checks() -> Report:
    s = env.settings()
    checks: list[Check] = [_flashinfer()]
    tc, tc_checks = _toolchain()
    checks += tc_checks
    checks.append(_ninja())
    fi = None
    if checks[0].status == OK:
        try:
            fi = build.flashinfer_info()
        except Exception as e:  # noqa: BLE001 - an unusable install is a finding, not a crash
            checks.append(Check("flashinfer paths", MISSING, f"{type(e).__name__}: {e}",
                                "reinstall flashinfer-python and apache-tvm-ffi", (BUILD,)))
    for backend in ("fa2", "fa3"):
        checks.append(_headers(backend, fi, tc))
    checks.append(_cache(s.cache_dir))
    checks.append(Check("JIT", OK, f"disabled by {s.jit_disabled_by}: modules are loaded from the cache only"
                        if s.jit_disabled else "on: a module missing from the cache is built on first use"))
    checks.append(_gpu())
    checks.append(_flex())
    return Report(tuple(checks))


# ----------------------------------------------------------------------------- the checks


def _flashinfer() -> Check:
    from ..api.probing import flashinfer_problem

    problem = flashinfer_problem()
    if problem:
        return Check("flashinfer", MISSING, problem, "pip install --no-deps flashinfer-python==0.7.2.post1 "
                     "apache-tvm-ffi==0.1.15.post2", (BUILD, GPU))
    fi_version, tvm_version = fi_versions.package_versions()
    return Check("flashinfer", OK, f"flashinfer-python {fi_version}, apache-tvm-ffi {tvm_version} "
                 f"({build.flashinfer_package_dir()})", needed_for=(BUILD, GPU))


def _toolchain() -> tuple[build.Toolchain | None, list[Check]]:
    try:
        tc = build.toolchain()
    except ToolchainError as e:  # nvcc absent, not runnable, hung; or a compiler beside it missing
        home, _ = build.find_cuda_home()
        why = str(e)
        checks = [Check("nvcc", MISSING, why, "install the CUDA toolkit (12.0 or newer) or set CUDA_HOME", (BUILD,))]
        if home is not None and why.startswith("host C++ compiler"):  # nvcc is there; the linker is not
            checks = [Check("nvcc", OK, f"{home / 'bin' / 'nvcc'}", needed_for=(BUILD,)),
                      Check("host compiler", MISSING, why, "install g++ or set CXX", (BUILD,))]
        elif home is not None and why.startswith("nvcc's host compiler"):
            checks = [Check("nvcc", OK, f"{home / 'bin' / 'nvcc'}", needed_for=(BUILD,)),
                      Check("nvcc host compiler", MISSING, why, "install gcc (e.g. apt-get install g++) or set "
                            "NVCC_CCBIN", (BUILD,))]
        return None, checks
    major = int(tc.nvcc_version.lstrip("V").split(".")[0])
    nvcc = Check("nvcc", OK if major >= 12 else WARN, f"{tc.nvcc} {tc.nvcc_version} (CUDA_HOME {tc.cuda_home})",
                 "" if major >= 12 else "fa3 (sm90a) modules need nvcc 12.0 or newer", (BUILD,))
    checks = [nvcc, Check("host compiler", OK, f"{tc.cxx} ({tc.cxx_version}) links modules", needed_for=(BUILD,)),
              Check("nvcc host compiler", OK, f"{tc.host_cc} ({tc.host_cc_version}) compiles host code (-ccbin)",
                    needed_for=(BUILD,))]
    runtime = tc.cuda_home / "include" / "cuda_runtime.h"
    cudart = sorted((tc.cuda_home / "lib64").glob("libcudart.so*"))
    if runtime.is_file() and cudart:
        checks.append(Check("CUDA runtime", OK, f"{runtime}, {cudart[0]}", needed_for=(BUILD,)))
    else:
        missing = [str(p) for p, ok in ((runtime, runtime.is_file()),
                                        (tc.cuda_home / "lib64" / "libcudart.so", bool(cudart))) if not ok]
        checks.append(Check("CUDA runtime", MISSING, f"not found: {', '.join(missing)}",
                            "install the CUDA toolkit's runtime headers and libraries (cuda-cudart-dev)", (BUILD,)))
    return tc, checks


def _ninja() -> Check:
    try:
        path = build._ninja()
    except ToolchainError as e:
        return Check("ninja", MISSING, str(e), "pip install ninja", (BUILD,))
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError as e:
        return Check("ninja", MISSING, f"{path}: {e.strerror or e}", "pip install ninja", (BUILD,))
    except subprocess.TimeoutExpired:
        return Check("ninja", MISSING, f"{path} did not answer `--version` within 30s", "pip install ninja", (BUILD,))
    return Check("ninja", OK, f"{path} {version}", needed_for=(BUILD,))


def _headers(backend: str, fi: build.FlashInferInfo | None, tc: build.Toolchain | None) -> Check:
    """Every header the rendered ``backend`` modules and the FlashInfer host sources they
    compile include, found in the build's include path (or the host compiler's)."""
    name = f"{backend} headers"
    if fi is None or tc is None:
        return Check(name, MISSING, "not checked: needs flashinfer and nvcc (above)", needed_for=(BUILD,))
    from ..codegen.render import ModuleConfig, render_module
    from ..lang.spec import parse_spec
    from ..routing.capabilities import HEAD_DIMS

    spec = parse_spec("name: doctor\nmask: kv_pos <= q_pos\n", "<doctor>")
    arch = "9.0a" if backend == "fa3" else "8.0"
    search = [*fi.include_dirs, *fi.system_include_dirs, tc.cuda_home / "include"]
    texts: list[str] = []
    local: set[str] = set()
    missing_sources: list[str] = []
    for b, kind in HEAD_DIMS:
        if b != backend:
            continue
        rendered = render_module(ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", arch, backend, kind=kind))
        texts += rendered.files.values()
        local |= set(rendered.files)
        for host in rendered.host_sources:
            path = fi.csrc_dir / host
            if path.is_file():
                texts.append(path.read_text(errors="replace"))
            else:
                missing_sources.append(str(path))
    wanted = sorted({h for t in texts for h in _INCLUDE.findall(t)} - local)
    unresolved = [h for h in wanted if _is_project_header(h) and not _found(h, search)]
    absent_dirs = [str(d) for d in search if not d.is_dir()]
    if missing_sources or unresolved or absent_dirs:
        what = [f"FlashInfer host sources {', '.join(missing_sources)}"] if missing_sources else []
        what += [f"headers {', '.join(unresolved)}"] if unresolved else []
        what += [f"include dirs {', '.join(absent_dirs)}"] if absent_dirs else []
        return Check(name, MISSING, f"not found: {'; '.join(what)} (searched {', '.join(map(str, search))})",
                     "reinstall flashinfer-python (a full wheel, with data/include, data/csrc and data/cutlass) and "
                     "the CUDA toolkit headers", (BUILD,))
    return Check(name, OK, f"{len(wanted)} headers found ({len(search)} include dirs)", needed_for=(BUILD,))


def _is_project_header(header: str) -> bool:
    """<vector>, <cstdint>: the C++ library's (the host compiler finds them); anything with a
    path or an extension is looked up."""
    return "/" in header or "." in header


def _found(header: str, dirs: Iterable[Path]) -> bool:
    return any((d / header).is_file() for d in (*dirs, *_FALLBACK_INCLUDE_DIRS))


def _cache(root: Path) -> Check:
    from ..build.cache import Cache

    cache = Cache(root)
    entries = sum(1 for _ in cache.entries(verify=False))
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    writable = existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)
    where = str(root) if root.exists() else f"{root} (not created yet; {existing} is {'' if writable else 'not '}" \
                                            "writable)"
    detail = f"{where}: {entries} module(s)"
    if writable:
        return Check("cache", OK, detail + ", writable", needed_for=(BUILD,))
    # missing, not a warning: `--need build` must not pass where no build can publish
    return Check("cache", MISSING, detail + ", not writable (a read-only deployed cache "
                 "serves modules; building needs a writable one)", "set VARIANTGEN_CACHE_DIR (or --cache-dir) to a "
                 "writable folder to build", (BUILD,))


def _gpu() -> Check:
    try:
        import torch

        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return Check("GPU", MISSING, f"no CUDA device visible to torch{why}", "run where an NVIDIA GPU (sm80 or "
                         "newer) and its driver are present; a build box needs none (variantgen doctor --need build)",
                         (GPU,))
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
    except Exception as e:  # noqa: BLE001 - a broken driver is a finding
        return Check("GPU", MISSING, f"cannot query the GPU: {type(e).__name__}: {e}", "check the NVIDIA driver",
                     (GPU,))
    from ..routing.capabilities import MODULE_BACKENDS, TABLE, arch_of_capability

    arch = arch_of_capability(major, minor)
    detail = f"cuda:{index} {name}, sm{major}{minor} (arch {arch}; {torch.cuda.device_count()} visible)"
    if major < 8:
        return Check("GPU", MISSING, detail, "variantgen modules need sm80 or newer", (GPU,))
    # the capability table's answer: which module backends run on this arch, and why the others not
    runs = [b for b in MODULE_BACKENDS if not TABLE[b].archs or arch in TABLE[b].archs]
    not_here = "".join(f" ({b}: {TABLE[b].arch_why})" for b in MODULE_BACKENDS if b not in runs and TABLE[b].arch_why)
    return Check("GPU", OK, f"{detail}; {' and '.join(runs)} modules{not_here}", needed_for=(GPU,))


def _flex() -> Check:
    """The flex route: torch's FlexAttention, on the GPU if one is visible, else on the CPU."""
    import torch

    from ..wrappers.flex_blocks import flex_problem

    problem = flex_problem()
    if problem:
        return Check("flex route", MISSING, problem, "install torch 2.5 or newer", (FLEX,))
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a broken driver: the CPU still runs it
        device = "cpu"
    return Check("flex route", OK, f"torch {torch.__version__} FlexAttention on {device}: every spec runs "
                 "(no module; slower than FlashInfer's kernels on a GPU)", needed_for=(FLEX,))


# ----------------------------------------------------------------------------- report


def render(report: Report, needed: tuple[str, ...]) -> str:
    width = max(len(c.name) for c in report.checks)
    lines = [f"variantgen {__version__} (python {sys.version.split()[0]})"]
    for c in report.checks:
        lines.append(f"{c.status:8} {c.name.ljust(width)}  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"{'':8} {''.ljust(width)}  fix: {c.fix}")
    for what in (BUILD, RUN):
        blockers = report.blockers(what)
        verdict = "yes" if not blockers else "no (missing: " + ", ".join(c.name for c in blockers) + ")"
        if what == RUN and verdict == "yes":  # which routes
            routes = [name for need, name in ((GPU, "FlashInfer modules on the GPU"), (FLEX, "the flex route"))
                      if report.can(need)]
            missing = ", ".join(c.name for c in report.blockers(GPU))
            verdict = "yes: " + " and ".join(routes) + ("" if report.can(GPU) else
                                                        f" (FlashInfer modules: no, missing: {missing})")
        lines.append(f"{what + ':':6} {verdict}")
    ok = all(report.can(what) for what in needed)
    lines.append(f"needed here: {', '.join(needed)} -> {'ok' if ok else 'not ok'} (exit {0 if ok else 1})")
    return "\n".join(lines)
