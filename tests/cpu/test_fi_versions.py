"""The FlashInfer versions variantgen builds against: each version's facts, rendered into the
module sources the templates read them from (fi_facts.h), and named by the module key."""

from __future__ import annotations

import pytest

import variantgen
from variantgen.build import builder as build
from variantgen.codegen import fi_versions, render
from variantgen.codegen.render import ModuleConfig
from variantgen.core.errors import ToolchainError


def test_each_checked_version_has_its_facts():
    old, new = (fi_versions.facts(v) for v in fi_versions.CHECKED)
    assert (old.version, old.plan_fixed_uniform_q_len, old.fa3_epilogue_fix, old.checked) == (
        "0.7.2.post1", False, True, True)
    assert (new.version, new.plan_fixed_uniform_q_len, new.fa3_epilogue_fix, new.checked) == (
        "0.7.4", True, True, True)


def test_a_version_newer_than_the_newest_checked_is_built_on_its_facts_and_keeps_the_epilogue_fix():
    f = fi_versions.facts("0.7.6")
    assert f.plan_fixed_uniform_q_len and f.fa3_epilogue_fix and not f.checked
    assert "newer than 0.7.4, the newest checked" in fi_versions.header_text(f)


@pytest.mark.parametrize("version", ["0.7.2", "0.6.18.post1", "0.2.0"])
def test_an_older_flashinfer_is_refused_naming_the_version_and_the_oldest(version):
    with pytest.raises(ToolchainError, match=rf"flashinfer-python {version} is installed; variantgen builds against "
                                             r"0\.7\.2\.post1 or newer"):
        fi_versions.facts(version)


def test_a_version_that_is_no_version_is_refused():
    with pytest.raises(ToolchainError, match="flashinfer-python 'dev-build': not a version number"):
        fi_versions.facts("dev-build")


def _config(backend: str) -> ModuleConfig:
    spec = variantgen.resolve_spec("causal")
    return ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", backend, mask_modes=("causal",))


@pytest.mark.parametrize(("version", "fixed"), [("0.7.2.post1", "0"), ("0.7.4", "1")])
def test_the_installed_version_decides_the_plan_call_and_the_key(monkeypatch, version, fixed):
    monkeypatch.setattr(fi_versions, "package_versions", lambda: (version, "0.1.15"))
    rendered = render.render_module(_config("fa2"))
    facts = rendered.files[fi_versions.HEADER_NAME]
    assert f"#define VG_FI_PLAN_FIXED_UNIFORM_Q_LEN {fixed}" in facts and f"against: {version}" in facts
    assert '#include "fi_facts.h"' in rendered.files["prefill_plan.cuh"]
    assert fi_versions.HEADER_NAME in rendered.includes("binding.cu")
    key = build.module_key(rendered, None)
    assert ("flashinfer", version) in key.inputs


def test_modules_of_two_versions_have_different_keys(monkeypatch):
    keys = []
    for version in fi_versions.CHECKED:
        monkeypatch.setattr(fi_versions, "package_versions", lambda v=version: (v, "0.1.15"))
        keys.append(build.module_key(render.render_module(_config("fa3")), None).uri)
    assert keys[0] != keys[1]


def test_every_fa3_kernel_unit_reads_the_epilogue_fact(monkeypatch):
    monkeypatch.setattr(fi_versions, "package_versions", lambda: ("0.7.4", "0.1.15"))
    rendered = render.render_module(_config("fa3"))
    assert "#define VG_FI_FA3_EPILOGUE_FIX 1" in rendered.files[fi_versions.HEADER_NAME]
    kernels = [u for u in rendered.compile_units if "kernel" in u]
    assert kernels and all(fi_versions.HEADER_NAME in rendered.includes(u) for u in kernels)


def test_versions_sort_as_pip_sorts_them():
    order = ["0.6.18.post1", "0.7.2", "0.7.2.post1", "0.7.4", "0.7.5.dev1", "0.7.5rc1", "0.7.5", "0.7.5.post2",
             "0.7.10"]
    assert sorted(order, key=fi_versions.version_key) == order
    assert fi_versions.version_key("0.7.4+cu130") == fi_versions.version_key("0.7.4")
