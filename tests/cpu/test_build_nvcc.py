"""Real builds with nvcc on the CPU (no GPU needed): slow, deselect with -m 'not nvcc'.

One fa2 module (causal spec, one mask mode) is compiled into a private cache, found again
without rebuilding, and found with JIT disabled; so is one fa3 (sm90a) module, as a build
box without a GPU precompiles it; a broken template gives a BuildError with the
compiler's first error, a log and a kept failed build.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SPECS_DIR

import variantgen
from variantgen.build import builder as build
from variantgen.build.builder import rendered_sources
from variantgen.build.cache import Cache
from variantgen.codegen import expressions as codegen
from variantgen.codegen import kv_tile, render
from variantgen.codegen.render import FA2_CTA_TILES_Q, ModuleConfig
from variantgen.core.errors import BuildError
from variantgen.lang.spec import WRAPPER_PARAMS
from variantgen.routing.resolver import choose_backend

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
    assert manifest["toolchain"] == {"nvcc": toolchain.nvcc_version, "cxx": toolchain.cxx_version,
                                     "host_cc": f"{toolchain.host_cc_version} ({toolchain.host_cc})"}
    assert manifest["inputs_digest"] == result.key.inputs_digest
    assert manifest["tensor_args"] == ["vg_meta"] and manifest["scalar_args"] == ["sm_scale", "v_scale"]
    assert manifest["config"]["mask_modes"] == ["causal"]
    # what explains the module is kept; the bulky objects are not
    assert (entry.path / "src" / "variant.cuh").is_file() and (entry.path / "build.ninja").is_file()
    assert (entry.path / "build.log").is_file() and not (entry.path / "obj").exists()
    assert list((vg_env.cache_dir / ".staging").iterdir()) == []
    assert exported_functions(entry.module_path) == {"plan", "paged_run", "build_launches", "plan_direct", "schedule",
                                                     "merge_pieces", "merge_inline", "read_indices", "classify_rows"}
    # sm90: one kernel per run() code (causal's exact and tail units) and CTA tile, at the KV tile
    # kv_tile.py pins - not FlashInfer's four
    pinned = {cta: kv_tile.fa2_num_mma_kv(cta, 128, 128, 2, 2, "9.0a") for cta in FA2_CTA_TILES_Q}
    assert kernel_instances(entry.module_path) == {(1, cta, pinned[cta]): 2 for cta in FA2_CTA_TILES_Q}

    again = build.build_module(config, cache)
    assert again.built is False and again.entry.uri == entry.uri

    vg_env.set(VARIANTGEN_DISABLE_JIT="1")
    deployed = build.build_module(config, cache)
    assert deployed.built is False and deployed.entry.module_path == entry.module_path


def kernel_instances(module: Path) -> collections.Counter:
    """FlashInfer fa2 paged-prefill kernels compiled into a module, counted by (mask mode, CTA
    tile, NUM_MMA_KV) from their host stubs' names."""
    out = subprocess.run([shutil.which("nm") or "nm", "-C", str(module)], capture_output=True, text=True, check=True)
    traits = re.compile(r"BatchPrefillWithPagedKVCacheKernel<[^<]*KernelTraits<\(flashinfer::MaskMode\)(\d+), "
                        r"(\d+)u, \d+u, (\d+)u,")
    return collections.Counter(tuple(map(int, m.groups())) for line in out.stdout.splitlines()
                               if (m := traits.search(line)))


def exported_functions(module: Path) -> set[str]:
    """The functions a module exports through tvm-ffi (TVM_FFI_DLL_EXPORT_TYPED_FUNC symbols)."""
    nm = shutil.which("nm")
    assert nm, "nm (binutils) not found: it comes with the host compiler's toolchain"
    out = subprocess.run([nm, "-D", "--defined-only", str(module)], capture_output=True, text=True, check=True)
    return {line.split()[-1].removeprefix("__tvm_ffi_") for line in out.stdout.splitlines()
            if line.split()[-1].startswith("__tvm_ffi_")}


def test_build_an_fa3_ragged_module_without_a_gpu(vg_env, toolchain):
    """An fa3 ragged-KV module at MLA's head dims (192/128), one mask mode, built on a box without a
    GPU: it exports its work-list plan and ragged_run, and loads."""
    vg_env.set(VARIANTGEN_BUILD_JOBS="2")
    spec = variantgen.resolve_spec("causal")
    config = ModuleConfig(spec, 192, 128, "bf16", "bf16", "bf16", "9.0a", "fa3", mask_modes=("causal",),
                          kind="ragged")
    result = build.build_module(config, Cache(vg_env.cache_dir))
    assert result.built is True
    assert result.entry.uri.startswith("vg_causal_fa3_ragged_qbf16_kvbf16_obf16_hd192x128_sm90a_")
    assert exported_functions(result.entry.module_path) == {"plan", "ragged_run"}
    module = build.load_module(result.entry)
    assert callable(module.plan) and callable(module.ragged_run)


def test_build_an_fa2_ragged_module_without_a_gpu(vg_env, toolchain):
    """An fa2 ragged-KV module at MLA's head dims: every kernel FlashInfer's host code names is a
    unit's or a declared stub (nothing left undefined), causal's kernels run the exact variant and
    custom's the masked one, one per CTA tile at the pinned KV tile; it exports plan and ragged_run."""
    vg_env.set(VARIANTGEN_BUILD_JOBS="2")
    spec = variantgen.resolve_spec("causal")
    config = ModuleConfig(spec, 192, 128, "bf16", "bf16", "bf16", "9.0a", "fa2", mask_modes=("causal", "custom"),
                          kind="ragged")
    result = build.build_module(config, Cache(vg_env.cache_dir))
    path = result.entry.module_path
    assert exported_functions(path) == {"plan", "ragged_run"}
    nm = subprocess.run([shutil.which("nm") or "nm", "-C", "-u", str(path)], capture_output=True, text=True, check=True)
    assert "Dispatched" not in nm.stdout
    kernels = subprocess.run([shutil.which("nm") or "nm", "-C", str(path)], capture_output=True, text=True,
                             check=True).stdout
    ragged = [line for line in kernels.splitlines() if "BatchPrefillWithRaggedKVCacheKernel<" in line]
    assert len(ragged) == 2 * len(FA2_CTA_TILES_Q)
    assert sum("MaskMode)1" in line and "VG_CausalExact" in line for line in ragged) == len(FA2_CTA_TILES_Q)
    assert sum("MaskMode)2" in line and "VG_CausalExact" not in line for line in ragged) == len(FA2_CTA_TILES_Q)
    module = build.load_module(result.entry)
    assert callable(module.plan) and callable(module.ragged_run)


def test_build_an_fa3_module_without_a_gpu(vg_env, toolchain, tmp_path):
    """What `variantgen precompile causal --arch 9.0a` does on a build box (backend auto is fa3
    there), kept to one mask mode: nvcc and the CUDA runtime headers are all it needs."""
    vg_env.set(VARIANTGEN_BUILD_JOBS="2")
    cache = Cache(vg_env.cache_dir)
    spec = variantgen.resolve_spec("causal")
    assert choose_backend(spec, kind="prefill", head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16",
                          o_dtype="bf16", arch="9.0a") == "fa3"
    config = ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", "fa3", mask_modes=("causal",))
    result = build.build_module(config, cache)
    assert result.built is True
    entry = result.entry
    assert entry.uri.startswith("vg_causal_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_")
    assert entry.module_path.read_bytes()[:4] == b"\x7fELF"
    assert entry.manifest["config"]["backend"] == "fa3" and entry.manifest["config"]["mask_modes"] == ["causal"]
    assert (entry.path / "src" / "cutlass_prelude.cuh").is_file()  # stands in for FlashInfer's cutlass_utils.cuh
    # what the fa3 wrapper calls, exported and loadable as a serving host loads it (no GPU needed to load)
    # (its work lists come from the launch builder, exported by every paged-prefill module)
    assert exported_functions(entry.module_path) == {"paged_run", "build_launches", "plan_direct", "schedule",
                                                     "merge_pieces", "merge_inline", "read_indices", "classify_rows"}
    module = build.load_module(entry)
    assert callable(module.paged_run) and callable(module.plan_direct)

    # Served with JIT off from another copy of the spec: the module is the spec's content, not its file.
    copy = tmp_path / "elsewhere" / "my_causal.yaml"
    copy.parent.mkdir()
    shutil.copyfile(SPECS_DIR / "causal.yaml", copy)
    vg_env.set(VARIANTGEN_DISABLE_JIT="1")
    for other in (variantgen.load_spec(copy), variantgen.parse_spec((SPECS_DIR / "causal.yaml").read_text())):
        deployed = build.build_module(dataclasses.replace(config, spec=other), cache)
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


# A spec with what issue 18 added to the generated C++: a learned sink (fa2's m/d update and
# output transform, fa2 decode's output transform, fa3's softmax updater) and bit().
SINK_AND_BITS = """\
name: sink_and_bits
tensors:
  sinks: {dtype: float32, shape: [num_qo_heads]}
  bits: {dtype: int32, shape: [total_q, 2]}
mask: kv_pos <= q_pos and (kv_pos < q_pos - 8 or bit(bits[q_row, (q_pos - kv_pos) // 32], (q_pos - kv_pos) % 32))
sink: sinks[qo_head] + float(kv_head)
"""


def _compile_units(toolchain, tmp_path, module, config, units: list[str]) -> None:
    """nvcc -c of ``units`` of a rendered module (FlashInfer host sources included), two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    for name, text in module.files.items():
        (tmp_path / name).write_text(text)
    fi = build.flashinfer_info()
    includes = [f"-I{tmp_path}"] + [f"-I{p}" for p in fi.include_dirs]
    for p in (*fi.system_include_dirs, toolchain.cuda_home / "include"):
        includes += ["-isystem", str(p)]

    def compile_one(unit: str) -> tuple[str, subprocess.CompletedProcess]:
        source = tmp_path / unit if (tmp_path / unit).exists() else fi.csrc_dir / unit
        cmd = [str(toolchain.nvcc), *build.semantic_flags(config)["cuda"], *includes, "-c", str(source),
               "-o", str(tmp_path / f"{Path(unit).stem}.o")]
        return unit, subprocess.run(cmd, capture_output=True, text=True, timeout=1200)

    with ThreadPoolExecutor(2) as pool:
        for unit, done in pool.map(compile_one, units):
            assert done.returncode == 0, f"{unit}:\n{done.stderr[-4000:]}"


@pytest.mark.parametrize(("backend", "kind", "unit"), [
    ("fa2", "prefill", "paged_kernel_cta16.cu"), ("fa2", "decode", "decode_kernel.cu"),
    ("fa3", "prefill", "paged_kernel_custom.cu")])
def test_sink_and_bit_kernels_compile(vg_env, toolchain, tmp_path, backend, kind, unit):
    """One kernel unit per way a sink is generated, compiled by nvcc against FlashInfer's headers
    with the module's own flags (a whole module is minutes more of the same)."""
    spec = variantgen.parse_spec(SINK_AND_BITS, "sink_and_bits.yaml")
    config = ModuleConfig(spec, 64, 64, "bf16", "bf16", "bf16", "9.0a", backend, kind=kind)
    module = render.render_module(config)
    assert unit in module.compile_units
    _compile_units(toolchain, tmp_path, module, config, [unit])
    assert (tmp_path / f"{Path(unit).stem}.o").stat().st_size > 0


LISTED = """\
name: listed
tensors:
  is_global: {dtype: int32, shape: [total_kv]}
  picks: {dtype: int32, shape: [16]}
scalars:
  block: {dtype: int, default: 64, positive: true}
mask: >
  kv_pos <= q_pos and (q_pos - kv_pos < 64 or is_global[kv_row] != 0
  or bit(picks[q_pos // block % 16], kv_pos // block % 32))
"""


def test_listed_kernels_compile(vg_env, toolchain, tmp_path):
    """The listed variant (keys through a page list's table: a key set and blocks picked per row
    block) in an fa2 prefill unit and fa3's own unit."""
    spec = variantgen.parse_spec(LISTED, "listed.yaml")
    units = []
    for backend, unit in (("fa2", "paged_kernel_cta16.cu"), ("fa3", "paged_kernel_custom_listed.cu")):
        config = ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", backend)
        module = render.render_module(config)
        assert "Listed" in module.files[unit]
        out = tmp_path / backend
        out.mkdir()
        units.append((config, module, unit, out))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda u: _compile_units(toolchain, u[3], u[1], u[0], [u[2]]), units))
    for _, _, unit, out in units:
        assert (out / f"{Path(unit).stem}.o").stat().st_size > 0


# Spec arguments named as the locals and parameters of the functions that take them (FlashInfer's
# host run functions, the fa3 bindings, the planner's entry points) and as PlanArgs' fields: the
# generated code passes them as vg_arg_<name> and keeps them in structs of their own.
LOCAL_NAMES = ("a b args batch batch_size capacity counts desc device_guard first flags key layout lo magic "
               "mask_mode mask_mode_code n options p pack_gqa page_size plan_info plan_info_vec rec row s scratch "
               "seg spec starts status stream total_kv total_q kv_start q_start maybe_lse float_workspace_buffer "
               "int_workspace_buffer paged_k_cache paged_kv_indices qo_indptr kv_indices kv_layout").split()
LOCAL_NAMES = [n for n in LOCAL_NAMES if n not in WRAPPER_PARAMS]  # (those the validator refuses: plan()'s own)
COLLIDING = ("name: colliding\ntensors:\n  keys: {dtype: int32, shape: [total_kv]}\nscalars:\n"
             + "".join(f"  {n}: {{dtype: int, default: 0}}\n" for n in LOCAL_NAMES)
             + 'mask: "kv_pos <= q_pos + ' + " + ".join(LOCAL_NAMES) + ' and keys[kv_row] == keys[q_kv_row]"\n')


@pytest.mark.parametrize(("backend", "kind"), [("fa2", "prefill"), ("fa3", "prefill"), ("fa3", "ragged"),
                                               ("planner", "")])  # (fa2 decode and ragged: the same macros)
def test_argument_names_never_meet_the_generated_codes_own(vg_env, toolchain, tmp_path, backend, kind):
    """A spec may name its arguments as anything the validator accepts: as a local of the run
    function its arguments are passed to, too (a scalar `stream` or `b` failed to compile)."""
    from variantgen.planning.rowplan import PlannerConfig

    spec = variantgen.parse_spec(COLLIDING, "colliding.yaml")
    if backend == "planner":
        config = PlannerConfig(spec, "9.0a")
        module = rendered_sources(config)
        units = list(module.compile_units)
    else:
        config = ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", backend, kind=kind)
        module = rendered_sources(config)
        # the functions that take the arguments: FlashInfer's run functions (fa2), the binding (fa3)
        units = list(module.host_sources) if backend == "fa2" else ["binding.cu"]
    _compile_units(toolchain, tmp_path, module, config, units)


FLOAT_MASK = """
name: floats
scalars:
  x: {dtype: float, default: 0.3}
mask: "float(kv_pos) * 0.1 - x < 0.0 and sqrt(float(q_pos)) / 3.0 >= 0.5 + float(kv_pos) * x"
logits: logits / (1.0 + float(kv_pos) * x)
"""


def test_a_masks_float_math_is_ieee_rounded_under_fast_math(toolchain, tmp_path):
    """The modules build with -use_fast_math: a mask's float math must not be fused into FMAs or
    approximated (the reference computes each operation rounded; a key at a threshold would flip).
    The mask's expression, compiled as a device function with the modules' flags, has only
    round-to-nearest arithmetic in its PTX; the logits transform keeps the fast forms."""
    spec = variantgen.parse_spec(FLOAT_MASK, "floats.yaml")
    mask, logits = codegen.emit_mask(spec).code, codegen.emit_logits(spec, "score").code
    helpers = render.static_source("common/vg_helpers.cuh")
    source = tmp_path / "m.cu"
    source.write_text(f"""{helpers}
struct P {{ float x; }};
extern "C" __global__ void mask(const P params, const int* pos, bool* out) {{
  const int32_t q_pos = pos[0], kv_pos = pos[1];
  const float arg_x = params.x;
  *out = {mask};
}}
extern "C" __global__ void logits(const P params, const int* pos, float* out) {{
  const int32_t kv_pos = pos[1];
  const float arg_x = params.x;
  const float score = out[0];
  *out = {logits};
}}
""")
    config = ModuleConfig(spec, 64, 64, "bf16", "bf16", "bf16", "9.0a", "fa2")
    ptx = tmp_path / "m.ptx"
    flags = [f for f in build.semantic_flags(config)["cuda"] if not f.startswith(("-Xfatbin", "--compress"))]
    done = subprocess.run([str(toolchain.nvcc), *flags, "-ptx", str(source), "-o", str(ptx)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = ptx.read_text()
    mask_ptx, logits_ptx = text.split(".entry logits")[0].split(".entry mask")[1], text.split(".entry logits")[1]
    ops = re.findall(r"^\s*((?:add|sub|mul|div|sqrt|fma|rcp)\.[\w.]+)", mask_ptx, re.M)
    float_ops = [o for o in ops if o.endswith("f32")]
    assert float_ops and all(".rn" in o for o in float_ops), float_ops
    assert not any(o.startswith("fma") or ".approx" in o for o in float_ops), float_ops
    assert re.search(r"^\s*(fma|div\.approx|rcp\.approx)", logits_ptx, re.M), "the logits transform got slower"
