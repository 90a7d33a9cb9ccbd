"""Module identity: a module is its spec's content, not the file it was read from.

An operator precompiles from one copy of a spec (a build box's checkout, a shipped name);
the serving host reads another (its own path, a config store's text) with JIT off. The
same content must give the same URI, and the precompiled module must be found. Builds are
faked here (tests/fakes/_cache_procs.py); test_build_nvcc.py does the same with a real fa3 module.
"""

from __future__ import annotations

import importlib

import _cache_procs as procs
import pytest
import torch
from click.testing import CliRunner
from conftest import SPECS_DIR

import variantgen
from variantgen.build import builder as build
from variantgen.build.builder import rendered_sources
from variantgen.build.cache import Cache
from variantgen.codegen.render import ModuleConfig
from variantgen.core.errors import JitDisabledError, ToolchainError
from variantgen.planning.rowplan import PlannerConfig
from variantgen.tools.cli import main

probe_mod = importlib.import_module("variantgen.api.probing")
TEXT = (SPECS_DIR / "mm_prefix.yaml").read_text()


@pytest.fixture
def box(vg_env, monkeypatch, tmp_path):
    """Fake toolchain and builder; the same spec content under three names and as text."""
    monkeypatch.setattr(build, "toolchain", procs.fake_toolchain)
    monkeypatch.setattr(build, "flashinfer_info", lambda: procs.FAKE_FLASHINFER)
    monkeypatch.setattr(build, "_build_locked", procs.FakeBuilder())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probe_mod.cache_clear()
    (tmp_path / "build_box").mkdir()
    (tmp_path / "server").mkdir()
    first = tmp_path / "build_box" / "mm_prefix.yaml"
    first.write_text(TEXT)
    second = tmp_path / "server" / "layer7_mask.yaml"
    second.write_text(TEXT)
    # other comments and description: neither reaches the generated sources
    edited = tmp_path / "server" / "edited.yaml"
    edited.write_text("# the serving host's own copy\n" + TEXT.replace("description: >", "description: >\n  Ours."))
    assert variantgen.load_spec(edited).description != variantgen.load_spec(first).description
    yield first, [variantgen.load_spec(second), variantgen.load_spec(edited), variantgen.parse_spec(TEXT),
                  variantgen.resolve_spec("mm_prefix")]
    probe_mod.cache_clear()


def config(spec: variantgen.VariantSpec) -> ModuleConfig:
    return ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", "fa2")


def test_same_content_same_uri(box):
    first, others = box
    tc = procs.fake_toolchain()
    key = build.module_key(rendered_sources(config(variantgen.load_spec(first))), tc)
    planner_key = build.module_key(rendered_sources(PlannerConfig(variantgen.load_spec(first), "9.0a")), tc)
    for spec in others:
        assert spec.path != str(first)
        assert build.module_key(rendered_sources(config(spec)), tc) == key
        assert build.module_key(PlannerConfig(spec, "9.0a").render(), tc) == planner_key
    # ... while a change of meaning is another module
    changed = variantgen.parse_spec(TEXT.replace("kv_pos <= q_pos", "kv_pos < q_pos"))
    assert build.module_key(rendered_sources(config(changed)), tc).uri != key.uri


def test_precompiled_from_one_file_is_found_for_the_others_with_jit_off(box, vg_env, monkeypatch):
    first, others = box
    r = CliRunner().invoke(main, ["precompile", str(first), "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a",
                                  "--backend", "fa2"])
    assert r.exit_code == 0, r.output
    assert "2 built, 0 cached, 0 failed" in r.stdout  # the kernel module and the spec's planner module
    cache = Cache(vg_env.cache_dir)
    published = {uri for uri, _ in cache.entries()}
    assert len(published) == 2

    vg_env.set(VARIANTGEN_DISABLE_JIT="1")
    for spec in others:
        kernel = build.build_module(config(spec), cache)
        planner = build.build_module(PlannerConfig(spec, "9.0a"), cache)
        assert not kernel.built and not planner.built
        assert {kernel.entry.uri, planner.entry.uri} == published
        assert kernel.entry.uri.startswith("vg_mm_prefix_fa2_prefill_") and planner.entry.uri.startswith(
            "vg_mm_prefix_planner_sm90a_")
        result = variantgen.probe(spec, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", arch="9.0a", backend="fa2",
                                  build=False, runtime=False)
        assert result and result.source == "cache" and result.uri == kernel.entry.uri
    # by path and by name through probe's own loading, too
    for arg in (others[0].path, "mm_prefix"):
        assert variantgen.probe(arg, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", arch="9.0a", backend="fa2",
                                build=False, runtime=False).source == "cache"

    # A serving host without nvcc: looked up by the build's inputs, whatever toolchain built it.
    def no_toolchain():
        raise ToolchainError("nvcc not found")

    vg_env.set(VARIANTGEN_DISABLE_JIT=None)
    monkeypatch.setattr(build, "toolchain", no_toolchain)
    for spec in others:
        found = build.build_module(config(spec), cache, allow_build=False)
        assert not found.built and found.entry.uri.startswith("vg_mm_prefix_fa2_prefill_")
    # and a spec of other content is not mistaken for it
    changed = variantgen.parse_spec(TEXT.replace("kv_pos <= q_pos", "kv_pos < q_pos"))
    with pytest.raises(JitDisabledError, match=r"^building not allowed and module vg_mm_prefix_fa2_prefill_"):
        build.build_module(config(changed), cache, allow_build=False)
