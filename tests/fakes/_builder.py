"""The launch builder for the CPU tests: the real one, built with nvcc once.

Every plan() path builds its launches with the launch builder (templates/plan/launches.h),
compiled into the planner module and every paged-prefill module. The CPU fakes
(_fake_kernel.py) take its host entry point, ``build_launches``, from one nvcc-built planner
module (the causal spec's: every module exports the same builder), and do the device part
(the copy to the workspace, the page gather) in torch ops. The module is built into a
persistent cache folder keyed by its sources (VARIANTGEN_TEST_BUILDER_CACHE, default
$TMPDIR/variantgen-test-builder-<uid>), so a test session builds it once and later sessions
find it; without nvcc the tests that need it are skipped.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from variantgen.abi.table import HeaderField, Status
from variantgen.core.env import SPECS_DIR, reload_settings

JIT_VARIABLES = ("VARIANTGEN_DISABLE_JIT", "FLASHINFER_DISABLE_JIT", "VARIANTGEN_CACHE_DIR", "VARIANTGEN_TEMPLATE_DIR")


def cache_dir() -> Path:
    return Path(os.environ.get("VARIANTGEN_TEST_BUILDER_CACHE")
                or Path(tempfile.gettempdir()) / f"variantgen-test-builder-{os.getuid()}")


@functools.cache
def _build() -> Any:
    from variantgen.build import builder as build
    from variantgen.build.cache import Cache
    from variantgen.lang.spec import load_spec
    from variantgen.planning.rowplan import PlannerConfig

    saved = {name: os.environ.pop(name, None) for name in JIT_VARIABLES}  # the checkout's templates, JIT on
    reload_settings()
    try:
        config = PlannerConfig(load_spec(SPECS_DIR / "causal.yaml"), "9.0a")
        return build.load_module(build.build_module(config, Cache(cache_dir())).entry)
    finally:
        for name, value in saved.items():
            if value is not None:
                os.environ[name] = value
        reload_settings()


def plan_builder() -> Any:
    """The loaded module whose ``build_launches`` the fakes call (skips the test without nvcc)."""
    from variantgen.build import builder as build
    from variantgen.core.errors import ToolchainError

    try:
        build.toolchain()
    except ToolchainError as e:
        pytest.skip(f"the launch builder needs an nvcc build: {e}")
    return _build()


def finish_on_cpu(desc: torch.Tensor, workspace_host: torch.Tensor, workspace: torch.Tensor,
                  kv_indices: torch.Tensor) -> None:
    """What plan_batch / plan_direct do after the builder, on the device: the host mirror's
    first COPY_BYTES into the workspace, then every range of the gather table."""
    d = desc.tolist()
    if d[HeaderField.STATUS] != Status.OK:
        return
    n = d[HeaderField.COPY_BYTES]
    workspace[:n] = workspace_host[:n]
    ranges, table_at = d[HeaderField.RANGES], d[HeaderField.TABLE_OFFSET]
    table = workspace[table_at:table_at + 12 * ranges].view(torch.int32).view(3, ranges)
    pages_at, extent = d[HeaderField.PAGES_OFFSET], d[HeaderField.PAGES_EXTENT]
    out = workspace[pages_at:pages_at + 4 * extent].view(torch.int32)
    src = kv_indices.to(torch.int32)
    for first, shift, count in table.t().tolist():
        assert 0 <= first + shift and first + shift + count <= src.numel(), "gather reads past the page list"
        assert 0 <= first and first + count <= extent, "gather writes past its extent"
        out[first:first + count] = src[first + shift:first + shift + count]
