"""Real builds with nvcc on the CPU (no GPU needed): slow, deselect with -m 'not nvcc'.

One module (causal spec, one mask mode) is compiled into a private cache, found again
without rebuilding, and found with JIT disabled; a broken template gives a BuildError
with the compiler's first error, a log and a kept failed build.
"""

from __future__ import annotations

import pytest
from conftest import SPECS_DIR

import variantgen
from variantgen import build
from variantgen.cache import Cache
from variantgen.errors import BuildError
from variantgen.render import ModuleConfig

pytestmark = pytest.mark.nvcc


def small_config() -> ModuleConfig:
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    return ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", mask_modes=("causal",))


def test_build_find_and_deploy_a_real_module(vg_env, toolchain):
    vg_env.set(VARIANTGEN_BUILD_JOBS="2")
    cache = Cache(vg_env.cache_dir)
    config = small_config()
    result = build.build_module(config, cache)
    assert result.built is True
    entry = result.entry
    assert entry.path.parent == vg_env.cache_dir and entry.uri == result.key.uri
    assert entry.module_path.read_bytes()[:4] == b"\x7fELF"
    manifest = entry.manifest
    assert manifest["toolchain"] == {"nvcc": toolchain.nvcc_version, "cxx": toolchain.cxx_version}
    assert manifest["inputs_digest"] == result.key.inputs_digest
    assert manifest["tensor_args"] == ["vg_meta"] and manifest["scalar_args"] == ["sm_scale", "v_scale"]
    assert manifest["config"]["mask_modes"] == ["causal"]
    # what explains the module is kept; the bulky objects are not
    assert (entry.path / "src" / "variant.cuh").is_file() and (entry.path / "build.ninja").is_file()
    assert (entry.path / "build.log").is_file() and not (entry.path / "obj").exists()
    assert list((vg_env.cache_dir / ".staging").iterdir()) == []

    again = build.build_module(config, cache)
    assert again.built is False and again.entry.uri == entry.uri

    vg_env.set(VARIANTGEN_DISABLE_JIT="1")
    deployed = build.build_module(config, cache)
    assert deployed.built is False and deployed.entry.module_path == entry.module_path


def test_broken_template_gives_a_build_error(vg_env, toolchain, template_copy):
    variant = template_copy / "fa2" / "variant.cuh.jinja"
    marker = "struct {{ struct_name }}"
    assert marker in variant.read_text()
    broken = variant.read_text().replace(marker, "#error variantgen-test-broken\n" + marker, 1)
    variant.write_text(broken)
    cache = Cache(vg_env.cache_dir)
    with pytest.raises(BuildError) as info:
        build.build_module(small_config(), cache)
    err = info.value
    assert err.first_error and "variantgen-test-broken" in err.first_error
    assert err.log_path and "variantgen-test-broken" in open(err.log_path).read()
    assert "\n  first error: " in str(err) and "\n  reproduce with: ninja -C " in str(err)
    failed = list((vg_env.cache_dir / ".failed").iterdir())
    assert len(failed) == 1 and (failed[0] / "src" / "variant.cuh").is_file()
    assert [uri for uri, _ in cache.entries()] == []
