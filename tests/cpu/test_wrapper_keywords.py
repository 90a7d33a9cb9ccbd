"""Misspelt keywords of plan() / run(): the error names the closest spec argument or keyword
(the wrappers take spec arguments as **kwargs, so Python cannot say it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _fake_decode import FakeDecodeModule
from _fake_kernel import FakeModule
from conftest import SPECS_DIR

import variantgen
from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import render
from variantgen.core.errors import LaunchError
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.decode import DecodeWrapper
from variantgen.wrappers.paged import VariantWrapper

MM = variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """A private cache dir."""


def _build(config: render.ModuleConfig) -> BuildResult:
    manifest = {"scalar_args": [a.name for a in render.kernel_args(config.spec)[1]],
                "module_sha256": "x", "module_file": "x.so"}
    return BuildResult(Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), None, False, 0.0)


@pytest.fixture
def prefill():
    config = render.ModuleConfig(MM, 64, 64, "bf16", "bf16", "bf16", "9.0a")
    w = VariantWrapper(MM, config, FakeModule(MM), _build(config),
                       torch.empty(1 << 20, dtype=torch.uint8))
    batch = random_paged_batch([5, 9], [12, 9], num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    return w, batch, random_spec_args(MM, batch)


def test_plan_suggests_the_spec_argument(prefill):
    w, batch, args = prefill
    with pytest.raises(LaunchError, match="^" + re.escape(
            "plan(): unexpected argument(s) range (did you mean `ranges`?); spec `mm_prefix` takes: ranges, "
            "causal_window_left, range_window_left (plus q_scale, k_scale, v_scale, out, return_lse in run())")):
        w.plan(*batch.plan_args(), skip_tiles=True, range=args["ranges"])


def test_plan_with_the_planner_off_by_default_suggests_it_too(prefill):
    """`rangs=`: the planner turned itself off (no `ranges` given), yet the misspelling is what to say."""
    w, batch, args = prefill
    with pytest.raises(LaunchError, match=re.escape("plan(): unexpected argument(s) rangs (did you mean `ranges`?);")):
        w.plan(*batch.plan_args(), rangs=args["ranges"])


def test_plan_suggests_its_own_keyword(prefill):
    w, batch, _ = prefill
    with pytest.raises(LaunchError, match=re.escape("unexpected argument(s) skip_tile (did you mean `skip_tiles`?), "
                                                    "zzz;")):
        w.plan(*batch.plan_args(), skip_tile=True, zzz=1, skip_tiles=True)


def test_run_suggests_the_spec_argument_and_its_own_keyword(prefill):
    w, batch, args = prefill
    w.plan(*batch.plan_args(), skip_tiles=False)
    with pytest.raises(LaunchError, match=re.escape("run(): unexpected argument(s) bogus, causal_window (did you "
                                                    "mean `causal_window_left`?); spec `mm_prefix` takes:")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), causal_window=3, bogus=1, **args)
    with pytest.raises(LaunchError, match=re.escape("run(): unexpected argument(s) q_scal (did you mean `q_scale`?)")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), q_scal=1.0, **args)


def test_decode_plan_suggests_too():
    config = render.ModuleConfig(MM, 64, 64, "bf16", "bf16", "bf16", "9.0a", kind="decode")
    w = DecodeWrapper(MM, config, FakeDecodeModule(MM), _build(config), torch.empty(1 << 20, dtype=torch.uint8))
    batch = random_paged_batch([1, 1], [12, 9], num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    args = random_spec_args(MM, batch)
    with pytest.raises(LaunchError, match=re.escape("plan(): unexpected argument(s) ranges_ (did you mean `ranges`?)")):
        w.plan(batch.kv_indptr, batch.kv_indices, batch.last_page_len, 4, 2, 4, ranges_=args["ranges"])
