"""Shared fixtures of the test suite: tests/cpu (CI), tests/gpu (`pytest -m gpu` on a GPU) and the
stand-ins they run against, tests/fakes (fake kernel modules, the real launch builder on the CPU,
fake toolchains, cache-race processes, the fuzz corpus), importable from every test.

* ``spec_text(text, name=...)`` writes dedented YAML into tmp_path and returns the path;
* ``spec_from(text)`` parses dedented YAML into a VariantSpec (path ``spec.yaml``);
* ``vg_env`` points VARIANTGEN_CACHE_DIR at a fresh tmp folder (and lets a test set more
  variables), re-reading the settings before and after;
* tests marked ``gpu`` are skipped (at collection) when torch sees no CUDA device;
* with VARIANTGEN_TEST_SKIP_UNBUILT=1 (GPU runs against a precompiled cache with JIT disabled),
  a test that stops at a module the cache lacks (JitDisabledError) is reported as skipped, with
  the module's name, rather than failed.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))  # `from _fake_kernel import ...`

import pytest

import variantgen
from variantgen.core import env as vg_env_mod
from variantgen.core.env import REPO_DIR, SPECS_DIR, TEMPLATES_DIR  # noqa: F401 - tests import them from here

SPEC_FILES = sorted(SPECS_DIR.glob("*.yaml"))
ALL_SPECS = [p.stem for p in SPEC_FILES]
# The CPU kernel emulations' batch: full prefill, chunked prefill (qo_len < kv_len),
# single-token requests, requests with no queries (one with no keys either).
CPU_QO_LENS = [37, 1, 20, 0, 64, 0, 5, 1]
CPU_KV_LENS = [37, 90, 61, 9, 200, 0, 5, 1]
# Scalars that make the masks bite at those lengths (the defaults are mostly larger).
CPU_SMALL_SCALARS = {
    "streaming_sink": {"num_sink": 3, "window": 7},
    "attention_sink_learned": {"window": 11},
    "gemma4_sliding": {"window": 9},
    "chunked_local": {"chunk_size": 13},
    "mm_prefix": {"causal_window_left": 6, "range_window_left": 5},
    "sliding_window": {"window": 9},
    "softcap": {"soft_cap": 2.0, "window": 17},
}

# Every variable variantgen.core.env reads: a test environment starts without them.
VG_VARIABLES = (
    "VARIANTGEN_CACHE_DIR", "VARIANTGEN_DISABLE_JIT", "FLASHINFER_DISABLE_JIT", "VARIANTGEN_ARCH",
    "VARIANTGEN_BUILD_JOBS", "MAX_JOBS", "VARIANTGEN_NVCC_THREADS", "VARIANTGEN_SPLIT_COMPILE",
    "VARIANTGEN_TEMPLATE_DIR",
    "VARIANTGEN_LOCK_TIMEOUT", "VARIANTGEN_CHECK_PLAN", "VARIANTGEN_BUILD_TIMEOUT", "CUDA_HOME", "CUDA_PATH",
    "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN",
)


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where torch sees a CUDA device. Skipped at collection, so
    that none of their fixtures (module-scoped CUDA workspaces, wrappers) is set up: a skip
    from a function-scoped fixture comes after those and turns into an error on a CPU box."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """VARIANTGEN_TEST_SKIP_UNBUILT=1: a JitDisabledError (module not precompiled) is a skip."""
    outcome = yield
    report = outcome.get_result()
    if (call.excinfo is not None and report.failed and os.environ.get("VARIANTGEN_TEST_SKIP_UNBUILT") == "1"
            and call.excinfo.errisinstance(variantgen.core.errors.JitDisabledError)):
        report.outcome = "skipped"
        message = str(call.excinfo.value).splitlines()[0]
        report.longrepr = (str(item.path), item.location[1] or 0, f"not precompiled: {message}")


@pytest.fixture
def spec_text(tmp_path):
    """Write (dedented) YAML to a file under tmp_path; returns its Path."""

    def write(text: str | bytes, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return path

    return write


@pytest.fixture
def spec_from():
    """Parse (dedented) YAML text into a VariantSpec; errors name ``spec.yaml``."""

    def parse(text: str, path: str = "spec.yaml") -> variantgen.VariantSpec:
        return variantgen.parse_spec(textwrap.dedent(text).lstrip("\n"), path)

    return parse


class VgEnv:
    """Set variantgen environment variables for one test; settings are re-read each time."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cache_dir: Path):
        self._mp = monkeypatch
        self.cache_dir = cache_dir

    def set(self, **variables: str | os.PathLike | None):
        for name, value in variables.items():
            if value is None:
                self._mp.delenv(name, raising=False)
            else:
                self._mp.setenv(name, str(value))
        return vg_env_mod.reload_settings()

    @property
    def settings(self):
        return vg_env_mod.settings()


@pytest.fixture
def vg_env(tmp_path, monkeypatch):
    """A private cache dir (tmp_path/cache) and a clean variantgen environment."""
    for name in VG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("VARIANTGEN_CACHE_DIR", str(cache_dir))
    vg_env_mod.reload_settings()
    try:
        yield VgEnv(monkeypatch, cache_dir)
    finally:
        monkeypatch.undo()
        vg_env_mod.reload_settings()


@pytest.fixture
def template_copy(tmp_path, vg_env):
    """A private copy of templates/, selected through VARIANTGEN_TEMPLATE_DIR."""
    dest = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, dest)
    vg_env.set(VARIANTGEN_TEMPLATE_DIR=dest)
    return dest


@pytest.fixture(scope="module")
def workspace():
    """The float workspace of the GPU tests (128 MiB on the current CUDA device)."""
    import torch

    return torch.empty(128 << 20, dtype=torch.uint8, device="cuda")


@pytest.fixture
def toolchain(vg_env):
    """The real nvcc toolchain for the `nvcc`-marked builds; the test is skipped without one."""
    from variantgen.build import builder as build
    from variantgen.core.errors import ToolchainError

    try:
        tc = build.toolchain()
    except ToolchainError as e:
        pytest.skip(str(e))
    # Fail fast (before minutes of compiling) when discovery picked a CUDA_HOME that cannot link,
    # e.g. the parent of a wrapper script `nvcc` on PATH (see test_toolchain.py).
    assert (tc.cuda_home / "lib64").is_dir(), (
        f"CUDA_HOME was discovered as {tc.cuda_home}, which has no lib64/ (libcudart): set CUDA_HOME")
    return tc


@pytest.fixture
def host_modules(monkeypatch):
    """make_wrapper may wrap a module over a CPU workspace: the CPU tests' fake modules run on the
    host (make_wrapper refuses that for a real module, whose kernels run on a GPU)."""
    from variantgen.api import factory

    monkeypatch.setattr(factory, "module_workspace_problem", lambda workspace: "")
