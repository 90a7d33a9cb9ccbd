"""`variantgen doctor`: one line per thing a build or a run needs, and an exit status that says
whether this machine can do what it is for (--need)."""

from __future__ import annotations

import json
import os

import _fake_toolchain as fake
import pytest
import torch
from click.testing import CliRunner

from variantgen.build import builder as build
from variantgen.core.errors import ToolchainError
from variantgen.tools import doctor
from variantgen.tools.cli import main


def run(*args: str):
    return CliRunner().invoke(main, ["doctor", *map(str, args)])


def lines_of(output: str) -> dict[str, str]:
    """check name -> its line (status first)."""
    out = {}
    for line in output.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0] in (doctor.OK, doctor.WARN, doctor.MISSING):
            name = line[9:].split("  ")[0].strip()
            out[name] = line
    return out


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """A toolkit that has everything but FlashInfer's headers (its include dirs are empty)."""
    tc, info = fake.make_toolchain(tmp_path / "tools")
    monkeypatch.setattr(build, "toolchain", lambda: tc)
    monkeypatch.setattr(build, "flashinfer_info", lambda: info)
    return tc, info


@pytest.fixture
def real_toolchain(vg_env):
    build.toolchain.cache_clear()
    try:
        return build.toolchain()
    except ToolchainError as e:
        pytest.skip(str(e))


def test_this_build_box_can_build(real_toolchain, vg_env, no_gpu):
    """The CPU build box (nvcc, FlashInfer's wheel, no GPU): every build check passes."""
    r = run("--need", "build")
    assert r.exit_code == 0, r.output
    checks = lines_of(r.output)
    for name in ("flashinfer", "nvcc", "host compiler", "nvcc host compiler", "CUDA runtime", "ninja",
                 "fa2 headers", "fa3 headers", "cache", "JIT"):
        assert checks[name].startswith("ok "), checks
    assert str(real_toolchain.nvcc) in checks["nvcc"] and real_toolchain.nvcc_version in checks["nvcc"]
    assert f"{vg_env.cache_dir} (not created yet; " in checks["cache"]
    assert checks["GPU"].startswith("missing ") and "build: yes" in r.output
    assert checks["flex route"].startswith("ok ") and "FlexAttention on cpu" in checks["flex route"]
    assert "run:   yes: the flex route (FlashInfer modules: no, missing: GPU)" in r.output
    assert r.output.rstrip().endswith("needed here: build -> ok (exit 0)")
    assert not vg_env.cache_dir.exists()  # doctor writes nothing
    # the default need: run, which the flex route meets on the CPU (building is for GPU modules)
    r = run()
    assert r.exit_code == 0 and r.output.rstrip().endswith("needed here: run -> ok (exit 0)"), r.output
    # a server that must run FlashInfer modules asks for the GPU
    r = run("--need", "gpu")
    assert r.exit_code == 1 and r.output.rstrip().endswith("needed here: gpu -> not ok (exit 1)"), r.output


def test_the_slow_checks_are_announced_on_stderr(vg_env, no_gpu):
    r = run("--need", "flex")
    assert r.exit_code == 0, r.output
    assert r.stderr == "checking the toolchain, FlashInfer's headers, the cache and the GPU (10-20 s)...\n"


def test_no_route_to_run(vg_env, no_gpu, monkeypatch):
    """No GPU and a torch without FlexAttention: nothing runs here, and both blockers are named."""
    import variantgen.wrappers.flex_blocks as flex

    monkeypatch.setattr(flex, "flex_problem", lambda: "torch 2.3.0 has no torch.nn.attention.flex_attention")
    r = run("--json")
    data = json.loads(r.stdout)
    assert r.exit_code == 1 and data["can_run"] is False and data["can_run_flex"] is False
    assert data["needed"] == ["run"] and data["can_run_modules"] is False
    r = run("--need", "run")
    assert r.exit_code == 1 and "run:   no (missing: GPU, flex route)" in r.stdout


def test_missing_flashinfer_headers_are_named(fake_tools, vg_env, gpu):
    r = run("--json")
    data = json.loads(r.stdout)
    assert r.exit_code == 1 and data["can_build"] is False and data["can_run"] is True
    by_name = {c["name"]: c for c in data["checks"]}
    fa2 = by_name["fa2 headers"]
    assert fa2["status"] == "missing" and "flashinfer/attention/prefill.cuh" in fa2["detail"]
    assert "cutlass/cutlass.h" in by_name["fa3 headers"]["detail"] and "reinstall flashinfer-python" in fa2["fix"]
    assert by_name["GPU"]["detail"].startswith("cuda:0 NVIDIA H200, sm90 (arch 9.0a; 8 visible)")
    assert run("--need", "run").exit_code == 0


def test_no_nvcc(vg_env, tmp_path, gpu):
    vg_env.set(CUDA_HOME=tmp_path / "nowhere")
    build.toolchain.cache_clear()
    try:
        r = run("--need", "build")
    finally:
        build.toolchain.cache_clear()
    checks = lines_of(r.output)
    assert r.exit_code == 1
    assert checks["nvcc"].startswith("missing ") and str(tmp_path / "nowhere" / "bin" / "nvcc") in checks["nvcc"]
    assert "fix: install the CUDA toolkit (12.0 or newer) or set CUDA_HOME" in r.output
    assert checks["fa2 headers"].startswith("missing ") and "needs flashinfer and nvcc" in checks["fa2 headers"]
    assert "build: no (missing: nvcc, fa2 headers, fa3 headers)" in r.output


def test_a_serving_box_with_jit_disabled_needs_to_run_only(vg_env, tmp_path, gpu, monkeypatch):
    vg_env.set(CUDA_HOME=tmp_path / "nowhere", VARIANTGEN_DISABLE_JIT="1")
    build.toolchain.cache_clear()
    monkeypatch.setattr(build, "_ninja", lambda: (_ for _ in ()).throw(ToolchainError("ninja not found on PATH")))
    try:
        r = run()
    finally:
        build.toolchain.cache_clear()
    checks = lines_of(r.output)
    assert r.exit_code == 0, r.output
    assert "disabled by VARIANTGEN_DISABLE_JIT" in checks["JIT"] and checks["ninja"].startswith("missing ")
    assert r.output.rstrip().endswith("needed here: run -> ok (exit 0)")


def test_a_read_only_cache_rules_out_building_only(vg_env, fake_tools, gpu, monkeypatch):
    """`doctor --need build` said "build: yes" (a warning) where no build could publish."""
    vg_env.cache_dir.mkdir()
    real_access = os.access
    monkeypatch.setattr(doctor.os, "access", lambda path, mode: False if str(path) == str(vg_env.cache_dir)
                        else real_access(path, mode))
    monkeypatch.setattr(doctor, "_headers", lambda backend, fi, tc: doctor.Check(f"{backend} headers", doctor.OK,
                                                                                  "found", needed_for=("build",)))
    r = run("--need", "build")
    checks = lines_of(r.output)
    assert checks["cache"].startswith("missing ") and "not writable (a read-only deployed cache" in checks["cache"]
    assert r.exit_code == 1 and "build: no (missing: cache)" in r.output
    assert run("--need", "run").exit_code == 0  # a read-only deployed cache serves modules


def test_old_nvcc_is_a_warning(fake_tools, vg_env, gpu, monkeypatch):
    tc, _ = fake_tools
    old = build.Toolchain(tc.cuda_home, tc.nvcc, "V11.8.89", tc.cxx, tc.cxx_version)
    monkeypatch.setattr(build, "toolchain", lambda: old)
    r = run()
    assert lines_of(r.output)["nvcc"].startswith("warn ") and "fa3 (sm90a) modules need nvcc 12.0" in r.output


def test_bad_need_is_a_usage_error():
    r = run("--need", "serve")
    assert r.exit_code == 2 and "serve: expected one of build, run, gpu, flex" in r.output


@pytest.mark.parametrize(("capability", "name", "arch", "modules"), [
    ((9, 0), "NVIDIA H200", "9.0a", "fa2 and fa3 modules"),
    ((10, 0), "NVIDIA B200", "10.0a", "fa2 modules (fa3: FlashInfer's FA3 kernel is sm90-only (wgmma); Blackwell "
                                      "(sm100 / sm120) and sm80 / sm89 run fa2)"),
    ((12, 0), "NVIDIA RTX PRO 6000", "12.0a", "fa2 modules (fa3: FlashInfer's FA3 kernel is sm90-only"),
    ((8, 6), "NVIDIA A10", "8.6", "fa2 modules (fa3: "),
])
def test_the_gpu_check_says_which_module_backends_run_on_it(gpu, monkeypatch, capability, name, arch, modules):
    """The capability table's answer for the visible GPU, Blackwell included (sm100 / sm120: fa2;
    answered from the table - no Blackwell GPU has run these modules)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    check = doctor._gpu()
    assert check.status == doctor.OK
    sm = f"sm{capability[0]}{capability[1]}"
    assert check.detail.startswith(f"cuda:0 {name}, {sm} (arch {arch}; 8 visible); {modules}"), check.detail
