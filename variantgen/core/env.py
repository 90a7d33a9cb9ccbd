"""Every environment variable variantgen reads, read in one place.

``settings()`` reads the environment once per process and returns a frozen snapshot;
``reload_settings()`` re-reads it (tests, or a CLI flag that overrides a variable).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # variantgen/, above core/
REPO_DIR = PACKAGE_DIR.parent
"""The folder above the package: the checkout's root when variantgen runs from a checkout."""
IN_CHECKOUT = (REPO_DIR / "pyproject.toml").is_file()
"""True in an editable install (or with the checkout on PYTHONPATH); False for an installed wheel."""


def _data_dir(name: str) -> Path:
    """A data folder of the package: inside it in an installed wheel (variantgen/templates/),
    beside it in a checkout, whose layout keeps templates/ and specs/ at the top level."""
    shipped = PACKAGE_DIR / name
    if not shipped.is_dir() and IN_CHECKOUT:
        return REPO_DIR / name
    return shipped  # where an installed package has it (a broken install is reported at this path)


TEMPLATES_DIR = _data_dir("templates")
"""The Jinja templates and static sources modules are rendered from."""
SPECS_DIR = _data_dir("specs")
"""The shipped specs (variantgen.lang.library)."""

MAX_COUNT = 2**31 - 1
"""The largest job or thread count: ninja -j and nvcc --threads / --split-compile read a 32-bit int
(a larger one failed every build in ninja or nvcc, naming neither the variable nor the option)."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
NVCC_FLAG_VARIABLES = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")
"""Variables nvcc itself reads and adds to its command line."""


def _flag(name: str) -> bool:
    """An on/off variable; any other value is an error (VARIANTGEN_DISABLE_JIT=Y or =disable was
    read as off: the server built modules it was told not to)."""
    raw = os.environ.get(name, "")
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected 1, true, yes or on (or 0, false, no, off, "
                     "or unset)")


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    """Root of the module cache (VARIANTGEN_CACHE_DIR, made absolute; default: <checkout>/cache)."""
    jit_disabled: bool
    """VARIANTGEN_DISABLE_JIT=1 or FLASHINFER_DISABLE_JIT=1: load from the cache, never build."""
    jit_disabled_by: str | None
    """Which variable disabled JIT, for reasons shown to users."""
    cuda_home: Path | None
    """CUDA_HOME (or CUDA_PATH), made absolute (ninja runs the compilers in the staging folder);
    None means: look for nvcc on PATH and /usr/local/cuda."""
    arch: str | None
    """VARIANTGEN_ARCH, e.g. '9.0a': the target when no GPU is visible (build boxes, CI)."""
    build_jobs: int | None
    """VARIANTGEN_BUILD_JOBS (or MAX_JOBS): ninja parallelism within one module."""
    nvcc_threads: int
    """VARIANTGEN_NVCC_THREADS: nvcc --threads per compile (default 1)."""
    split_compile: int
    """VARIANTGEN_SPLIT_COMPILE: nvcc --split-compile per compile unit (threads for its optimizer;
    default 1, off): lets a module's longest unit use cores its other units leave idle. It changes
    the machine code (register allocation), so the module key names it."""
    template_dir: Path
    """VARIANTGEN_TEMPLATE_DIR: where the Jinja templates live (default: TEMPLATES_DIR, the package's)."""
    lock_timeout_s: float
    """VARIANTGEN_LOCK_TIMEOUT: seconds make_wrapper / precompile wait for another process's build
    of a module (default 1800; probe() waits a few seconds only)."""
    build_timeout_s: float
    """VARIANTGEN_BUILD_TIMEOUT: seconds one module's build may take before it is ended (default 3600)."""
    nvcc_env: tuple[tuple[str, str], ...]
    """NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS, those set: nvcc adds them to every command line, so
    they change the machine code (the module key names them; builds get exactly these)."""
    nvcc_ccbin: str | None
    """NVCC_CCBIN: the host compiler nvcc compiles with (a compiler, or the folder holding gcc);
    None: gcc on PATH, nvcc's own default."""
    check_plan: bool
    """VARIANTGEN_CHECK_PLAN=1: wrappers check in run() that the tensors plan() planned from are
    unchanged (debug mode; the default of make_wrapper(check_plan=...))."""


def _default_cache_dir() -> Path:
    # A checkout keeps its cache beside the code (cache/ is git-ignored); an installed
    # package without a checkout falls back to the user's cache directory.
    if IN_CHECKOUT:
        return REPO_DIR / "cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "variantgen"


def _cache_dir() -> Path:
    raw = os.environ.get("VARIANTGEN_CACHE_DIR")
    if not raw:
        return _default_cache_dir()
    path = Path(os.path.abspath(Path(raw).expanduser()))
    if path.exists() and not path.is_dir():  # else `list` said "no modules" and builds "not writable"
        raise ValueError(f"environment variable VARIANTGEN_CACHE_DIR={raw!r}: expected a folder, {path} is not one")
    return path


def _int_or_none(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected a whole number") from None
    if value < 1:
        raise ValueError(f"environment variable {name}={raw!r}: expected a number >= 1")
    if value > MAX_COUNT:
        raise ValueError(f"environment variable {name}={raw!r}: expected a number <= {MAX_COUNT}")
    return value


def _seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected a number of seconds") from None
    if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
        least = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
        raise ValueError(f"environment variable {name}={raw!r}: expected {least}")
    return value


def _read() -> Settings:
    if _flag("VARIANTGEN_DISABLE_JIT"):
        disabled_by = "VARIANTGEN_DISABLE_JIT"
    elif _flag("FLASHINFER_DISABLE_JIT"):
        disabled_by = "FLASHINFER_DISABLE_JIT"
    else:
        disabled_by = None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return Settings(
        cache_dir=_cache_dir(),
        jit_disabled=disabled_by is not None,
        jit_disabled_by=disabled_by,
        cuda_home=Path(os.path.abspath(Path(cuda_home).expanduser())) if cuda_home else None,
        arch=os.environ.get("VARIANTGEN_ARCH") or None,
        build_jobs=_int_or_none("VARIANTGEN_BUILD_JOBS") or _int_or_none("MAX_JOBS"),
        nvcc_threads=_int_or_none("VARIANTGEN_NVCC_THREADS") or 1,
        split_compile=_int_or_none("VARIANTGEN_SPLIT_COMPILE") or 1,
        template_dir=Path(os.environ["VARIANTGEN_TEMPLATE_DIR"])
        if os.environ.get("VARIANTGEN_TEMPLATE_DIR")
        else TEMPLATES_DIR,
        lock_timeout_s=_seconds("VARIANTGEN_LOCK_TIMEOUT", 1800.0, zero_ok=True),
        build_timeout_s=_seconds("VARIANTGEN_BUILD_TIMEOUT", 3600.0),
        nvcc_env=tuple((name, os.environ[name].strip()) for name in NVCC_FLAG_VARIABLES
                       if os.environ.get(name, "").strip()),
        nvcc_ccbin=os.environ.get("NVCC_CCBIN", "").strip() or None,
        check_plan=_flag("VARIANTGEN_CHECK_PLAN"),
    )


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    return _read()


def reload_settings() -> Settings:
    settings.cache_clear()
    return settings()
