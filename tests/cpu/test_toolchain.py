"""Toolchain discovery, compiler flags and the generated ninja file (no compiler runs:
`nvcc` here is a fake script that only prints a version)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import _cache_procs as procs
import pytest
from conftest import SPECS_DIR

import variantgen
from variantgen.build import builder as build
from variantgen.build.builder import rendered_sources
from variantgen.codegen.render import ModuleConfig, render_module
from variantgen.core.errors import ToolchainError

VERSION_TEXT = "nvcc: NVIDIA (R) Cuda compiler driver\\nCuda compilation tools, release 12.8, V12.8.93\\n"


def fake_cuda(root: Path, *, lib: bool = True) -> Path:
    """A CUDA_HOME with bin/nvcc (prints a version) and, optionally, lib64/."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f'#!/bin/sh\nprintf "{VERSION_TEXT}"\n')
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    if lib:
        (root / "lib64").mkdir()
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("")
    return root


@pytest.fixture
def fresh_toolchain():
    build.toolchain.cache_clear()
    yield
    build.toolchain.cache_clear()


def test_explicit_cuda_home(vg_env, tmp_path, fresh_toolchain):
    home = fake_cuda(tmp_path / "cuda-12.8")
    vg_env.set(CUDA_HOME=home)
    found, tried = build.find_cuda_home()
    assert found == home and tried == [str(home / "bin" / "nvcc")]
    tc = build.toolchain()
    assert tc.cuda_home == home and tc.nvcc == home / "bin" / "nvcc" and tc.nvcc_version == "V12.8.93"


def test_relative_cuda_home_and_cxx_are_made_absolute(vg_env, tmp_path, monkeypatch, fresh_toolchain):
    """A regression: CUDA_HOME=../cuda or CXX=./bin/g++ (relative to where variantgen runs) went
    into build.ninja as they were - doctor said ok, and every build failed with `/bin/sh:
    ../cuda/bin/nvcc: not found`, ninja running the compilers in the staging folder."""
    home = fake_cuda(tmp_path / "cuda-12.8")
    cxx = _compiler(tmp_path / "bin", "g++", "g++ (fake) 12.2.0")
    monkeypatch.setattr(build, "flashinfer_info", lambda: procs.FAKE_FLASHINFER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CXX", "./bin/g++")
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        vg_env.set(**{name: "cuda-12.8" if name == variable else None for name in ("CUDA_HOME", "CUDA_PATH")})
        build.toolchain.cache_clear()
        tc = build.toolchain()
        assert tc.cuda_home == home and tc.nvcc == home / "bin" / "nvcc" and tc.cxx == str(cxx)
        text = build._ninja_file(render_module(_config()), tc, tmp_path / "src", "m.so")
        assert f"nvcc = {home}/bin/nvcc" in text and f"cxx = {cxx}" in text


def test_explicit_cuda_home_without_nvcc_is_an_error(vg_env, tmp_path, fresh_toolchain):
    empty = tmp_path / "no-cuda"
    empty.mkdir()
    vg_env.set(CUDA_HOME=empty)
    found, tried = build.find_cuda_home()
    assert found is None and tried == [str(empty / "bin" / "nvcc")]  # no fallback to PATH
    with pytest.raises(ToolchainError, match=r"^nvcc not found \(looked in CUDA_HOME: tried .*no-cuda/bin/nvcc\); "
                                             r"install the CUDA toolkit or set CUDA_HOME$"):
        build.toolchain()


def test_cuda_path_is_read_too(vg_env, tmp_path):
    home = fake_cuda(tmp_path / "cuda")
    vg_env.set(CUDA_HOME=None, CUDA_PATH=home)
    assert build.find_cuda_home()[0] == home


def test_nvcc_symlink_on_path(vg_env, tmp_path, monkeypatch):
    home = fake_cuda(tmp_path / "cuda-12.8")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvcc").symlink_to(home / "bin" / "nvcc")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert build.find_cuda_home()[0] == home


def test_nvcc_wrapper_script_on_path(vg_env, tmp_path, monkeypatch):
    home = fake_cuda(tmp_path / "cuda-12.8")
    local = tmp_path / "local"
    (local / "bin").mkdir(parents=True)
    wrapper = local / "bin" / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {home / "bin" / "nvcc"} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{local / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    found, _ = build.find_cuda_home()
    assert found is not None and (found / "lib64").is_dir(), found


def test_gencode_flags():
    assert build.gencode_flags("sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert build.gencode_flags("10.0a") == ["-gencode=arch=compute_100a,code=sm_100a"]
    assert build.gencode_flags("8.0") == ["-gencode=arch=compute_80,code=sm_80"]


def _config(**kw) -> ModuleConfig:
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    args = dict(head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", arch="9.0a")
    args.update(kw)
    return ModuleConfig(spec, **args)


def test_semantic_flags_hold_no_paths():
    flags = build.semantic_flags(_config())
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags["cuda"]
    assert "-lcuda" not in flags["ld"] and "-lcudart" in flags["ld"]
    assert not any("/" in f for f in flags["cuda"] + flags["ld"])  # the key must not depend on paths


def test_ninja_file(vg_env, tmp_path, monkeypatch):
    monkeypatch.setattr(build, "flashinfer_info", lambda: procs.FAKE_FLASHINFER)
    vg_env.set(VARIANTGEN_NVCC_THREADS="3")
    rendered = render_module(_config(mask_modes=("causal", "custom")))
    tc = procs.fake_toolchain()
    text = build._ninja_file(rendered, tc, tmp_path / "src", "mod.so")
    lines = text.splitlines()
    builds = [line for line in lines if line.startswith("build obj/")]
    assert len(builds) == len(rendered.compile_units) + 1  # + FlashInfer's paged host code
    assert builds[-1] == "build obj/batch_prefill_paged.o: cuda_compile /nonexistent/batch_prefill_paged.cu"
    assert f"build obj/binding.o: cuda_compile {tmp_path / 'src' / 'binding.cu'}" in lines
    assert "--threads=3" in text and "-gencode=arch=compute_90a,code=sm_90a" in text
    assert "nvcc = /opt/fake-cuda/bin/nvcc" in lines
    assert any(line.startswith("build mod.so: link obj/binding.o ") for line in lines)
    assert "default mod.so" in lines
    assert "-L/opt/fake-cuda/lib64" in text


def _compiler(folder: Path, name: str, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text(f'#!/bin/sh\necho "{version}"\n')
    script.chmod(0o755)
    return script


def test_the_key_names_the_host_compiler_nvcc_uses(vg_env, tmp_path, monkeypatch, fresh_toolchain):
    """nvcc compiles host code with the gcc it finds on PATH (or NVCC_CCBIN), while the key named
    `c++ --version` only: another gcc first on PATH built other code under the same URI. The
    toolchain resolves nvcc's compiler as nvcc does, keys its version and path, and the build
    passes it as -ccbin."""
    vg_env.set(CUDA_HOME=fake_cuda(tmp_path / "cuda"))
    old = _compiler(tmp_path / "old", "gcc", "gcc (Fake) 9.1.0")
    new = _compiler(tmp_path / "new", "gcc", "gcc (Fake) 13.2.0")
    rendered = render_module(_config())
    keys = {}
    for folder in (old.parent, new.parent):
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}/usr/bin{os.pathsep}/bin")
        build.toolchain.cache_clear()
        tc = build.toolchain()
        assert tc.host_cc == str(folder / "gcc") and tc.host_cc_version.startswith("gcc (Fake) ")
        keys[folder] = build.module_key(rendered, tc)
    assert keys[old.parent].uri != keys[new.parent].uri
    assert dict(keys[old.parent].toolchain)["host_cc"] == f"gcc (Fake) 9.1.0 ({old})"
    # NVCC_CCBIN: a compiler, or the folder holding gcc, whatever PATH says
    for ccbin in (old, old.parent):
        vg_env.set(NVCC_CCBIN=ccbin)
        build.toolchain.cache_clear()
        assert build.toolchain().host_cc == str(old)
    vg_env.set(NVCC_CCBIN=tmp_path / "nowhere" / "g++")
    build.toolchain.cache_clear()
    with pytest.raises(ToolchainError, match=r"nvcc's host compiler '.*nowhere/g\+\+' not found \(NVCC_CCBIN="):
        build.toolchain()
    vg_env.set(NVCC_CCBIN=None, NVCC_PREPEND_FLAGS=f"-O3 -ccbin {new}")
    build.toolchain.cache_clear()
    with pytest.raises(ToolchainError, match=r"NVCC_PREPEND_FLAGS=.* sets nvcc's host compiler; set NVCC_CCBIN"):
        build.toolchain()


def test_nvcc_that_cannot_run_is_a_toolchain_error(vg_env, tmp_path, monkeypatch, fresh_toolchain):
    """An nvcc that is not executable gave a raw PermissionError; one that hangs, a 60 s wait and a
    TimeoutExpired traceback; one that fails, an unreadable version."""
    home = fake_cuda(tmp_path / "cuda")
    nvcc = home / "bin" / "nvcc"
    vg_env.set(CUDA_HOME=home)
    nvcc.chmod(0o644)
    with pytest.raises(ToolchainError, match=rf"^cannot run nvcc {nvcc}: Permission denied$"):
        build.toolchain()
    nvcc.write_text("#!/bin/sh\necho 'libcuda: broken install' >&2\nexit 7\n")
    nvcc.chmod(0o755)
    build.toolchain.cache_clear()
    with pytest.raises(ToolchainError, match=rf"^nvcc {nvcc} --version failed \(exit 7\): libcuda: broken install$"):
        build.toolchain()
    nvcc.write_text("#!/bin/sh\nsleep 100 &\nsleep 100\n")  # a child holds the pipe open too
    monkeypatch.setattr(build, "VERSION_TIMEOUT_S", 0.5)
    build.toolchain.cache_clear()
    t0 = time.monotonic()
    with pytest.raises(ToolchainError, match=rf"^nvcc {nvcc} did not answer `--version` within 0.5s$"):
        build.toolchain()
    with pytest.raises(ToolchainError):  # remembered: a lookup per module does not wait again
        build.toolchain()
    assert time.monotonic() - t0 < 5


def test_serving_and_cache_checks_do_not_need_a_working_nvcc(vg_env, tmp_path, fresh_toolchain):
    """With an nvcc that cannot run, a JIT-disabled lookup of a precompiled module raised a raw
    PermissionError, `precompile --check` printed it, probe(runtime=False) said "internal error"
    and `doctor` stopped at it. A cache lookup needs no toolchain; doctor reports nvcc as
    unusable and goes on."""
    from click.testing import CliRunner

    from variantgen.api.probing import probe
    from variantgen.build.cache import Cache
    from variantgen.planning.rowplan import planner_configs
    from variantgen.tools.cli import main
    from variantgen.tools.cli_build import expand_matrix

    cache = Cache(vg_env.cache_dir)
    configs, _ = expand_matrix(["causal"], [128], ["bf16"], None, None, ["9.0a"], ["fa3"])
    for config in [*configs, *planner_configs(configs)]:
        procs.publish_fake(cache, build.module_key(rendered_sources(config), procs.fake_toolchain()))
    home = fake_cuda(tmp_path / "cuda")
    (home / "bin" / "nvcc").chmod(0o644)
    vg_env.set(CUDA_HOME=home, VARIANTGEN_DISABLE_JIT="1")
    found = build.build_module(configs[0], cache)
    assert not found.built and found.entry.uri.startswith(configs[0].uri_prefix)
    answer = probe("causal", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="fa3", arch="9.0a",
                   runtime=False)
    assert answer.ok and answer.source == "cache", answer.reason
    r = CliRunner().invoke(main, ["precompile", "causal", "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a",
                                  "--backend", "fa3", "--check"])
    assert r.exit_code == 0 and "2 of 2 module(s)" in r.output, r.output
    r = CliRunner().invoke(main, ["doctor", "--need", "build"])
    assert r.exit_code == 1 and r.exception is None or isinstance(r.exception, SystemExit), r.output
    assert f"cannot run nvcc {home / 'bin' / 'nvcc'}: Permission denied" in r.output
    assert "build: no (missing: nvcc" in r.output and "JIT " in r.output
