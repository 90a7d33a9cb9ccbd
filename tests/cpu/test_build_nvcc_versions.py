"""Real nvcc builds (no GPU) against the other FlashInfer versions and GPU archs variantgen supports:
slow, deselect with -m 'not nvcc'.

* FlashInfer: engines pin their own, so the newest checked version (fi_versions.NEWEST_CHECKED,
  installed by scripts/setup.sh into .fi/VERSION; VARIANTGEN_SECOND_FLASHINFER_DIR names another
  folder) builds an fa2 and an fa3 module here too, in a subprocess that puts it first on sys.path.
  test_build_nvcc.py builds the same kinds against the venv's own (the oldest supported).
* Blackwell: an fa2 causal module for sm100a, as `precompile --arch 10.0a` builds it on a build
  box. Only 10.0a is compiled in CI (12.0a takes the same path: the arch is only nvcc's target);
  no Blackwell GPU was available to run it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import variantgen
from variantgen.build import builder as build
from variantgen.build.cache import Cache
from variantgen.codegen import fi_versions
from variantgen.codegen.render import ModuleConfig
from variantgen.core.env import REPO_DIR
from variantgen.tools.cli import main

pytestmark = pytest.mark.nvcc

BUILD_ONE = r"""
import json, sys
import variantgen
from variantgen.build import builder as build
from variantgen.build.cache import Cache
from variantgen.codegen.render import ModuleConfig
backend, cache_dir = sys.argv[1:3]
config = ModuleConfig(variantgen.resolve_spec("causal"), 128, 128, "bf16", "bf16", "bf16", "9.0a", backend,
                      mask_modes=("causal",))
result = build.build_module(config, Cache(cache_dir))
module = build.load_module(result.entry)
print(json.dumps({"version": build.flashinfer_info().version, "include": str(build.flashinfer_info().include_dirs[0]),
                  "uri": result.entry.uri, "inputs": result.entry.manifest["inputs"],
                  "facts": result.entry.path.joinpath("src", "fi_facts.h").read_text(),
                  "exports": sorted(n for n in ("plan", "paged_run", "plan_direct") if hasattr(module, n))}))
"""


def second_flashinfer() -> Path:
    """The folder holding the second FlashInfer (its `flashinfer` package and dist-info)."""
    raw = os.environ.get("VARIANTGEN_SECOND_FLASHINFER_DIR")
    folder = Path(raw) if raw else REPO_DIR / ".fi" / fi_versions.NEWEST_CHECKED
    if not (folder / "flashinfer").is_dir():
        pytest.skip(f"no second FlashInfer in {folder} (scripts/setup.sh installs flashinfer-python "
                    f"{fi_versions.NEWEST_CHECKED} there)")
    return folder


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_a_module_builds_against_the_newest_checked_flashinfer(vg_env, toolchain, backend):
    folder = second_flashinfer()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO_DIR)]), "VARIANTGEN_BUILD_JOBS": "2"}
    done = subprocess.run([sys.executable, "-c", BUILD_ONE, backend, str(vg_env.cache_dir)], env=env,
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    version = out["version"]
    assert fi_versions.facts(version).checked, f"{version}: newer than the newest checked; compare its headers"
    assert Path(out["include"]).is_relative_to(folder)  # its headers, not the venv's FlashInfer
    assert out["inputs"]["flashinfer"] == version  # the key names the version it was built against
    facts = fi_versions.header_text(fi_versions.facts(version))
    assert out["facts"] == facts
    assert out["uri"].startswith(f"vg_causal_{backend}_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_")
    exports = ["paged_run", "plan", "plan_direct"] if backend == "fa2" else ["paged_run", "plan_direct"]
    assert out["exports"] == exports
    # the same module against the venv's FlashInfer is another module
    if fi_versions.package_versions()[0] != version:
        config = ModuleConfig(variantgen.resolve_spec("causal"), 128, 128, "bf16", "bf16", "bf16", "9.0a", backend,
                              mask_modes=("causal",))
        assert build.module_key(build.rendered_sources(config), build.toolchain()).uri != out["uri"]


def test_an_fa2_causal_module_for_blackwell(vg_env, toolchain):
    """`precompile --arch 10.0a` of an fa2 module on a CPU build box: it plans fa2 (fa3 skipped with
    the reason) and the module compiles for sm_100a with FlashInfer's fa2 headers."""
    out = CliRunner().invoke(main, ["precompile", "causal", "--head-dim", "128", "--dtype", "bf16", "--arch", "10.0a",
                                    "--backend", "fa2,fa3", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "backend=fa3 kind=prefill: arch=10.0a: fa3 modules run on sm90 (Hopper) only" in out.output, out.output
    assert "FlashInfer's FA3 kernel is sm90-only" in out.output
    assert "vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm100a" in out.output, out.output
    vg_env.set(VARIANTGEN_BUILD_JOBS="2")
    config = ModuleConfig(variantgen.resolve_spec("causal"), 128, 128, "bf16", "bf16", "bf16", "10.0a", "fa2",
                          mask_modes=("causal",))
    result = build.build_module(config, Cache(vg_env.cache_dir))
    assert result.built and result.entry.uri.startswith("vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm100a_")
    module = result.entry.module_path
    assert module.read_bytes()[:4] == b"\x7fELF"
    assert "-gencode=arch=compute_100a,code=sm_100a" in (result.entry.path / "build.ninja").read_text()
    cuobjdump = toolchain.cuda_home / "bin" / "cuobjdump"  # (not in every toolkit install: then the flags say it)
    if cuobjdump.is_file() or shutil.which("cuobjdump"):
        listed = subprocess.run([str(cuobjdump if cuobjdump.is_file() else "cuobjdump"), "--list-elf", str(module)],
                                capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr
        assert "sm_100a" in listed.stdout and "sm_90" not in listed.stdout, listed.stdout
    assert callable(build.load_module(result.entry).paged_run)
