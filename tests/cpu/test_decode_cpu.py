"""Batch decode (kind "decode") on the CPU: rendering, DecodeWrapper checks and plumbing.

The CUDA-core path runs against tests/fakes/_fake_decode.py (an emulation of the generated
decode module's plan/run ABI); the tensor-core path against tests/fakes/_fake_kernel.py (the
prefill module's). Results are compared with the dense reference with one query per
request (``qo_indptr = arange(batch + 1)``): decode is prefill with qo_len 1.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
import torch
from _fake_decode import FakeDecodeModule
from _fake_kernel import FakeFa3Module, FakeModule, FakeRowPlanner, assert_matches_reference
from conftest import ALL_SPECS, SPEC_FILES, SPECS_DIR
from conftest import CPU_SMALL_SCALARS as SMALL_SCALARS

import variantgen
import variantgen.build.builder as build_mod
import variantgen.wrappers.base as wrapper_mod
from variantgen.abi.table import MAX_KEY_GAPS, META_COLUMNS, NO_GAP_AT
from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import render
from variantgen.codegen.render import ModuleConfig, kernel_args, render_module
from variantgen.core.errors import LaunchError
from variantgen.planning.intervals import analyze
from variantgen.routing import capabilities
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.decode import CudaCoreDecodeWrapper, DecodeWrapper, TensorCoreDecodeWrapper, exact_window
from variantgen.wrappers.reference import reference_attention

HQ, HKV, HEAD_DIM = 8, 2, 64
# kv_len 1, shorter than a page, exactly a page, a page + 1, long ones.
KV_LENS = [1, 3, 16, 17, 90, 130, 41]


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


@functools.cache
def shipped(name: str) -> variantgen.VariantSpec:
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


def make(spec, *, tensor_cores: bool = False, kv_layout: str = "NHD", kv_dtype: str = "bf16",
         hq: int = HQ, hkv: int = HKV, backend: str = "fa2"):
    """A DecodeWrapper on a fake module: decode (CUDA cores) or prefill (tensor cores, with the
    fake planner module, as make_wrapper sets the spec's on CUDA); backend "fa3": its prefill
    module (fa3's decode is always on tensor cores)."""
    tensor_cores = tensor_cores or backend == "fa3"
    config = ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", kv_dtype, "bf16", "9.0a", backend,
                          kind="prefill" if tensor_cores else "decode")
    manifest = {"scalar_args": [a.name for a in kernel_args(spec)[1]],
                "module_sha256": "x", "module_file": "x.so"}
    fake = (FakeFa3Module if backend == "fa3" else FakeModule if tensor_cores else FakeDecodeModule)(spec)
    build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                        built=False, seconds=0.0)
    w = DecodeWrapper(spec, config, fake, build, torch.empty(1 << 20, dtype=torch.uint8), kv_layout)
    if tensor_cores and analyze(spec).planner_ready:
        w.set_row_planner(FakeRowPlanner(spec))
    return w, fake


def decode_batch(kv_lens, page_size, seed=0, kv_dtype=None, hq=HQ, hkv=HKV, q_len=1):
    """One query per request (``q_len`` > 1: multi-token decode, the last q_len tokens)."""
    return random_paged_batch([q_len] * len(kv_lens), kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM,
                              page_size=page_size, seed=seed, kv_dtype=kv_dtype)


def plan_args(batch):
    return (batch.kv_indptr, batch.kv_indices, batch.last_page_len, batch.num_qo_heads, batch.num_kv_heads,
            batch.page_size)


def cache_of(batch, kv_layout):
    if kv_layout == "HND":
        return batch.k_cache.transpose(1, 2).contiguous(), batch.v_cache.transpose(1, 2).contiguous()
    return batch.k_cache, batch.v_cache


def check(spec, batch, args, *, skip_tiles=None, tensor_cores=False, kv_layout="NHD", scales=None, label="",
          plan_extra=None, backend="fa2"):
    """Plan + run through the fake module and compare with the reference; returns (wrapper, fake, out, lse).
    A batch of decode_batch(q_len=T > 1) is planned with q_len_per_request=T."""
    w, fake = make(spec, tensor_cores=tensor_cores, kv_layout=kv_layout, backend=backend)
    plan_kw = dict(plan_extra if plan_extra is not None else args)
    if skip_tiles is not None:
        plan_kw["skip_tiles"] = skip_tiles
    if skip_tiles is False and plan_extra is None:
        plan_kw = {"skip_tiles": False}
    n, per = len(batch.kv_lens), batch.qo_lens[0]
    if per > 1:
        plan_kw["q_len_per_request"] = per
    w.plan(*plan_args(batch), **plan_kw)
    out = torch.full((n * per, batch.num_qo_heads, HEAD_DIM), math.nan, dtype=torch.bfloat16)
    scales = scales or {}
    got, lse = w.run(batch.q, cache_of(batch, kv_layout), out=out, return_lse=True, **scales, **args)
    assert got is out
    qo_indptr = torch.arange(0, per * (n + 1), per, dtype=torch.int32)  # the last `per` tokens of each request
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), qo_indptr, batch.kv_indptr,
                                       batch.kv_indices, batch.last_page_len, args, return_lse=True, **scales)
    assert_matches_reference(out, lse, ref, ref_lse, label, unit="requests")
    return w, fake, out, lse


# ----------------------------------------------------------------------------- rendering


def decode_config(spec, **overrides) -> ModuleConfig:
    kw = dict(head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", arch="9.0a",
              kind="decode")
    kw.update(overrides)
    return ModuleConfig(spec, **kw)


def meta_defines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#define VG_META_")]


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_every_shipped_spec_renders_a_decode_module(path):
    spec = variantgen.load_spec(path)
    module = render_module(decode_config(spec))
    assert set(module.files) == {"vg_plan_abi.h", "fi_facts.h", "variant.cuh", "batch_decode_config.inc", "binding.cu",
                                 "decode_kernel.cu", "vg_helpers.cuh", "config_prelude.cuh", "kernel_params.cuh",
                                 "read_indices.cuh", "decode_exact_host.cu"}
    assert module.files["binding.cu"] == render.static_source("fa2/decode_binding.cu")  # no Jinja in it
    assert module.compile_units == ("binding.cu", "decode_kernel.cu", "decode_exact_host.cu")
    assert module.host_sources == ("batch_decode.cu",)
    text = "\n".join(module.files.values())
    assert "{{" not in text and "{%" not in text and "{#" not in text
    # the variant struct is the prefill module's, unchanged (a sink's hook differs: decode has no m/d update)
    prefill = render_module(decode_config(spec, kind="prefill"))
    assert (module.files["variant.cuh"] == prefill.files["variant.cuh"]) == (spec.sink is None)
    struct = render.struct_name(spec)
    config = module.files["batch_decode_config.inc"]
    # vg_meta's columns: the plan ABI's header, which every kind's config includes
    for text in (config, prefill.files["batch_prefill_config.inc"]):
        assert '#include "vg_plan_abi.h"' in text
    assert module.files["vg_plan_abi.h"] == prefill.files["vg_plan_abi.h"]
    assert len(meta_defines(module.files["vg_plan_abi.h"])) == META_COLUMNS + 1 and not meta_defines(config)
    # the spec's variant, unless the second copy of FlashInfer's host code (run_exact) names the exact one
    assert f"#ifndef VG_DECODE_VARIANT\n#define VG_DECODE_VARIANT {struct}\n#endif" in config
    assert "using AttentionVariant = VG_DECODE_VARIANT;" in config
    exact_host = module.files["decode_exact_host.cu"]
    assert exact_host.index("#define VG_DECODE_VARIANT VariantgenExactVariant") < exact_host.index(
        '#include "batch_decode.cu"')
    assert "#define BatchDecodeWithPagedKVCacheRun BatchDecodeWithPagedKVCacheRunExact" in exact_host
    assert "struct Params : vg::DecodeFields<DTypeQ, DTypeKV, DTypeO, IdType> {" in config
    assert config.rstrip().endswith('#include "variant.cuh"')
    # every run() extra argument: in the ABI in order (as vg_arg_<name>), and a Params member
    abi = [f"ffi::Tensor vg_arg_{a.name}" for a in module.tensor_args] + [f"{a.cpp_type} vg_arg_{a.name}"
                                                                          for a in module.scalar_args]
    func_params = re.search(r"#define ADDITIONAL_FUNC_PARAMS (.*)", config).group(1)
    assert [p.strip() for p in func_params.split(",") if p.strip()] == abi
    for a in (*module.tensor_args, *module.scalar_args):
        star = "*" if a in module.tensor_args else ""
        assert f"  {a.cpp_type}{star} {a.name};" in config, a.name
        assert f"params.{a.name} = " in config
    assert "get_qo_len(uint32_t batch_idx) const { return 1; }" in module.files["kernel_params.cuh"]
    assert f"using VariantgenVariant = {struct};" in module.files["variant.cuh"]  # the name binding.cu uses
    assert f"using VariantgenExactVariant = {struct}Exact;" in module.files["variant.cuh"]
    kernel = module.files["decode_kernel.cu"]
    for variant in (struct, f"{struct}Exact"):
        assert f"BatchDecodeWithPagedKVCacheDispatched<\n    128, PosEncodingMode::kNone, {variant}, Params>" in kernel
    binding = module.files["binding.cu"]
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, VariantgenDecodePlan);" in binding
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, BatchDecodeWithPagedKVCacheRun);" in binding
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_exact, BatchDecodeWithPagedKVCacheRunExact);" in exact_host
    assert "BatchDecodeWithPagedKVCacheWorkEstimationDispatched<\n        GROUP_SIZE, HEAD_DIM_QK, " \
           "POS_ENCODING_MODE, VariantgenVariant, Params>" in binding
    assert module.config.uri_prefix.startswith(f"vg_{spec.name}_fa2_decode_")


@pytest.mark.parametrize("head_dim", [qk for qk, _ in capabilities.HEAD_DIMS["fa2", "decode"]])
@pytest.mark.parametrize("q_dtype, kv_dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8_e4m3"),
                                               ("fp16", "fp8_e5m2")])
def test_decode_dtypes_and_head_dims(head_dim, q_dtype, kv_dtype):
    module = render_module(decode_config(shipped("softcap"), head_dim_qk=head_dim, head_dim_vo=head_dim,
                                         q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=q_dtype))
    config = module.files["batch_decode_config.inc"]
    assert f"using DTypeQ = {render.DTYPES[q_dtype][0]};" in config
    assert f"using DTypeKV = {render.DTYPES[kv_dtype][0]};" in config
    assert f"constexpr int HEAD_DIM_QK = {head_dim};" in config
    assert f"Dispatched<\n    {head_dim}, " in module.files["decode_kernel.cu"]


def test_decode_rendering_is_deterministic_and_keyed_apart_from_prefill():
    spec = shipped("document")
    a, b = render_module(decode_config(spec)), render_module(decode_config(spec))
    assert a.files == b.files and a.source_digest() == b.source_digest()
    prefill = render_module(decode_config(spec, kind="prefill"))
    assert prefill.source_digest() != a.source_digest()
    assert decode_config(spec).uri_prefix != decode_config(spec, kind="prefill").uri_prefix


@pytest.mark.parametrize("template", ["fa2/decode_config.inc.jinja", "fa2/decode_kernel.cu.jinja"])
def test_decode_templates_are_strict(template):
    env = render.environment()
    assert env.undefined is jinja2.StrictUndefined
    ctx = render.render_context(decode_config(shipped("mm_prefix"))).variables()
    env.get_template(template).render(ctx)  # the shared context is enough
    for missing in ("struct_name", "uri", "vg_version"):
        with pytest.raises(jinja2.UndefinedError, match=missing):
            env.get_template(template).render({k: v for k, v in ctx.items() if k != missing})


def test_decode_templates_are_part_of_the_fa2_digest():
    names = [f"{p.parent.name}/{p.name}" for p in render.template_files("fa2")]
    assert {"fa2/decode_config.inc.jinja", "fa2/decode_binding.cu", "fa2/decode_kernel.cu.jinja"} <= set(names)


def test_decode_config_validation():
    with pytest.raises(ValueError, match=re.escape(
            "head_dim_qk=96, head_dim_vo=96: fa2 decode modules support head dims 64, 128, 256")):
        decode_config(shipped("causal"), head_dim_qk=96, head_dim_vo=96)
    with pytest.raises(ValueError, match="fa2 decode modules support head dims"):
        decode_config(shipped("causal"), head_dim_qk=128, head_dim_vo=64)


# ----------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("skip_tiles", [False, None], ids=["trim_off", "trim_default"])
@pytest.mark.parametrize("spec_name, scalars", [(n, "defaults") for n in ALL_SPECS]
                         + [(n, "small") for n in sorted(SMALL_SCALARS)])
def test_shipped_spec_decode_matches_reference(spec_name, scalars, skip_tiles):
    spec = shipped(spec_name)
    page_size = (1, 4, 16)[(len(spec_name) + len(scalars) + (skip_tiles is None)) % 3]
    seed = page_size * 3 + len(spec_name)
    batch = decode_batch(KV_LENS, page_size, seed=seed)
    args = random_spec_args(spec, batch, seed=seed)
    if scalars == "small":
        args.update(SMALL_SCALARS[spec_name])
    w, fake, _, _ = check(spec, batch, args, skip_tiles=skip_tiles, label=f"{spec_name} ps{page_size} {scalars}")
    (run,) = fake.run_calls
    pages_given = sum(-(-k // page_size) for k in KV_LENS)
    if skip_tiles is False:
        assert run.kv_indptr == batch.kv_indptr.tolist() and "pages" in w.plan_stats
        assert [m[2] for m in run.meta] == [0] * len(KV_LENS)
    assert w.plan_stats["pages"]["given"] == pages_given
    assert w.plan_stats["pages"]["visited"] == run.kv_indptr[-1] - run.kv_indptr[0] <= pages_given


@pytest.mark.parametrize("spec_name", ["mm_prefix", "softcap", "document"])
def test_tensor_core_path_matches_reference(spec_name):
    spec = shipped(spec_name)
    batch = decode_batch(KV_LENS, 4, seed=11)
    args = random_spec_args(spec, batch, seed=11)
    args.update(SMALL_SCALARS.get(spec_name, {}))
    for skip in (False, None):
        w, fake, _, _ = check(spec, batch, args, skip_tiles=skip, tensor_cores=True, label=spec_name)
        assert w.use_tensor_cores and isinstance(fake, FakeModule)
        # one query per request: the prefill plan sees qo_indptr = arange(batch + 1)
        plan = w.last_plan
        assert plan is not None and plan.batch.qo_lens == (1,) * len(KV_LENS)
        assert [la.rows for la in plan.launch_requests] == [(r, r + 1) for r in range(len(KV_LENS))]
        if skip is False:
            assert plan.planner == "off" and [c.mask_mode for c in fake.run_calls] == ["custom"]
        assert sum(c.rows for c in fake.run_calls) == len(KV_LENS)


# kv_len >= 4 everywhere (multi-token decode's queries are the last T tokens)
MULTI_KV_LENS = [4, 5, 16, 17, 90, 130, 41]


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("spec_name", ["mm_prefix", "causal", "attention_sink_learned"])
def test_fa3_decode_runs_its_prefill_module(spec_name, q_len):
    """fa3's decode: DecodeWrapper on the fa3 prefill module (always tensor cores), one query per
    request or the last q_len_per_request tokens; the planner off and on."""
    spec = shipped(spec_name)
    batch = decode_batch(MULTI_KV_LENS, 4, seed=12, q_len=q_len)
    args = random_spec_args(spec, batch, seed=12)
    args.update(SMALL_SCALARS.get(spec_name, {}))
    for skip in (False, None):
        w, fake, _, _ = check(spec, batch, args, skip_tiles=skip, backend="fa3", label=f"fa3 {spec_name} T={q_len}")
        assert w.use_tensor_cores and w.config.backend == "fa3" and isinstance(fake, FakeFa3Module)
        plan = w.last_plan
        assert plan.batch.qo_lens == (q_len,) * len(MULTI_KV_LENS) and plan.batch.total_q == q_len * len(MULTI_KV_LENS)
        assert sum(c.rows for c in fake.run_calls) == q_len * len(MULTI_KV_LENS)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("spec_name", ["causal", "sliding_window", "document", "mm_prefix", "softcap", "alibi"])
def test_fa3_decode_packs_gqa_groups(spec_name, q_len):
    """fa3 decode and multi-token decode run GQA-packed (a key/value head's 4 query heads as rows
    of one tile): q / out / lse packed and unpacked around the launches, causal and window runs
    laid out dense or custom (the kernel's causal mask would compare packed rows), the output
    the reference's; the same with packing switched off."""
    spec = shipped(spec_name)
    batch = decode_batch(MULTI_KV_LENS, 4, seed=21, q_len=q_len)
    args = random_spec_args(spec, batch, seed=21)
    args.update(SMALL_SCALARS.get(spec_name, {}))
    if spec_name == "sliding_window":
        args["window"] = 5  # window edges inside pages: the first page's keys before the window are masked
    w, fake, out, lse = check(spec, batch, args, backend="fa3", label=f"fa3 packed {spec_name} T={q_len}")
    plan = w.last_plan
    assert plan.pack_gqa == HQ // HKV and plan.stats()["pack_gqa"] == HQ // HKV
    assert "GQA-packed (4 query heads per row)" in repr(plan)
    assert all(la.mode != variantgen.planning.plan.MaskMode.CAUSAL for la in plan.launches)
    # packing off: the same numbers from unpacked launches
    w._prefill.planner.pack_gqa_enabled = False
    w.plan(*plan_args(batch), **({"q_len_per_request": q_len} if q_len > 1 else {}), **args)
    assert w.last_plan.pack_gqa == 1
    again, lse_again = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    assert (again.float() - out.float()).abs().max().item() < 2e-2
    assert (lse_again - lse).abs().max().item() < 1e-3


def test_fa3_packing_is_refused_where_it_would_be_wrong_or_slow():
    """No GQA packing for a learned sink (one sink per tile head), for requests whose packed
    rows exceed one query tile (192 at hd 64) - the kernel's causal launch serves those - or
    without a GQA group."""
    batch = decode_batch(MULTI_KV_LENS, 4, seed=22)
    spec = shipped("attention_sink_learned")
    args = random_spec_args(spec, batch, seed=22)
    w, _, _, _ = check(spec, batch, args, backend="fa3", label="fa3 sink")
    assert w.last_plan.pack_gqa == 1
    w, _, _, _ = check(shipped("causal"), decode_batch([60, 90], 4, seed=22, q_len=49), {}, backend="fa3",
                       label="fa3 49 x 4 rows")
    causal = variantgen.planning.plan.MaskMode.CAUSAL
    assert w.last_plan.pack_gqa == 1 and any(la.mode == causal for la in w.last_plan.launches)
    w, _, _, _ = check(shipped("causal"), decode_batch([60, 90], 4, seed=22, q_len=48), {}, backend="fa3",
                       label="fa3 48 x 4 rows")
    assert w.last_plan.pack_gqa == 4


@pytest.mark.parametrize("spec_name", ["mm_prefix", "sliding_window"])
def test_fa2_tensor_core_multi_token_decode(spec_name):
    spec = shipped(spec_name)
    batch = decode_batch(MULTI_KV_LENS, 4, seed=13, q_len=3)
    args = random_spec_args(spec, batch, seed=13)
    args.update(SMALL_SCALARS.get(spec_name, {}))
    for skip in (False, None):
        w, fake, _, _ = check(spec, batch, args, skip_tiles=skip, tensor_cores=True, label=f"fa2 {spec_name} T=3")
        assert isinstance(fake, FakeModule) and w.last_plan.batch.qo_lens == (3,) * len(MULTI_KV_LENS)
        if skip is False:  # planner off: one launch request per request, its 3 rows
            assert [la.rows for la in w.last_plan.launch_requests] == [
                (3 * r, 3 * r + 3) for r in range(len(MULTI_KV_LENS))]


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "2", None])
@pytest.mark.parametrize("backend, tensor_cores", [("fa2", False), ("fa2", True), ("fa3", True)])
def test_q_len_per_request_must_be_a_whole_number(value, backend, tensor_cores):
    spec = shipped("causal")
    batch = decode_batch([5, 17, 1], 4, seed=1)
    w, fake = make(spec, backend=backend, tensor_cores=tensor_cores)
    with pytest.raises(LaunchError, match=exact(f"plan(): q_len_per_request={value!r}: expected a whole number >= 1")):
        w.plan(*plan_args(batch), q_len_per_request=value)
    assert fake.plan_calls == [] and getattr(fake, "direct_calls", 0) == 0


def test_multi_token_decode_needs_tensor_cores():
    spec = shipped("causal")
    batch = decode_batch([5, 17, 3], 4, seed=1, q_len=2)
    w, fake = make(spec)
    with pytest.raises(LaunchError, match=exact(
            "plan(): q_len_per_request=2: multi-token decode runs on the prefill kernel; make the wrapper with "
            "use_tensor_cores=True (or backend='fa3' on sm90)")):
        w.plan(*plan_args(batch), q_len_per_request=2)
    assert fake.plan_calls == []
    w.plan(*plan_args(batch), q_len_per_request=1)  # one query per request is every path's
    assert len(fake.plan_calls) == 1


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_multi_token_decode_checks_the_batch(backend):
    spec = shipped("causal")
    w, _ = make(spec, backend=backend, tensor_cores=True)
    short = decode_batch([5, 17, 3, 1], 4, seed=1)
    with pytest.raises(LaunchError, match=exact(
            "plan(): request 2 has kv_len 3 < q_len_per_request=4 (its queries are its last q_len_per_request "
            "tokens)")):
        w.plan(*plan_args(short), q_len_per_request=4)
    batch = decode_batch([5, 17, 4], 4, seed=1, q_len=4)
    w.plan(*plan_args(batch), q_len_per_request=4)
    kv = (batch.k_cache, batch.v_cache)
    with pytest.raises(LaunchError, match=exact(
            "run(): `q`: expected shape [batch * q_len_per_request=3 * 4, num_qo_heads=8, head_dim=64] (4 queries "
            "per request), got [3, 8, 64]")):
        w.run(batch.q[::4].contiguous(), kv)
    assert w.run(batch.q, kv).shape == (12, HQ, HEAD_DIM)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_kv_layouts(kv_layout):
    spec = shipped("sliding_window")
    batch = decode_batch(KV_LENS, 4, seed=2)
    _, fake, _, _ = check(spec, batch, {"window": 9}, kv_layout=kv_layout)
    assert fake.run_calls[0].layout == wrapper_mod.LAYOUT_CODES[kv_layout]


def test_one_tensor_kv_cache_and_strided_q():
    spec = shipped("causal")
    batch = decode_batch(KV_LENS, 4, seed=4)
    w, fake = make(spec)
    w.plan(*plan_args(batch))
    kv = torch.stack([batch.k_cache, batch.v_cache], dim=1)  # [pages, 2, page, heads, dim]
    wide = torch.cat([batch.q, batch.q], dim=-1)[..., :HEAD_DIM]  # rows strided, last dim contiguous
    out = w.run(wide, kv)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), torch.arange(len(KV_LENS) + 1,
                              dtype=torch.int32), batch.kv_indptr, batch.kv_indices, batch.last_page_len)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("spec_name", ["causal", "alibi", "softcap"])
def test_qkv_scales_fold_into_sm_scale_and_output(spec_name):
    spec = shipped(spec_name)
    batch = decode_batch([9, 40, 2], 4, seed=3)
    args = random_spec_args(spec, batch)
    scales = dict(q_scale=0.5, k_scale=1.75, v_scale=0.25)
    for tensor_cores in (False, True):
        _, fake, _, _ = check(spec, batch, args, scales=scales, tensor_cores=tensor_cores, label=spec_name)
        if not tensor_cores:
            run = fake.run_calls[0]
            assert run.sm_scale == pytest.approx(0.5 * 1.75 / math.sqrt(HEAD_DIM))
            assert run.v_scale == 0.25
            assert run.scalars == {s.name: args.get(s.name, s.default) for s in spec.scalars}


def test_fp8_kv_cache():
    spec = shipped("softcap")
    batch = decode_batch(KV_LENS, 16, seed=8, kv_dtype=torch.float8_e4m3fn)
    w, fake = make(spec, kv_dtype="fp8_e4m3")
    w.plan(*plan_args(batch))
    out = w.run(batch.q, (batch.k_cache, batch.v_cache), k_scale=0.5, v_scale=2.0)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache),
                              torch.arange(len(KV_LENS) + 1, dtype=torch.int32), batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, k_scale=0.5, v_scale=2.0)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    with pytest.raises(LaunchError, match=re.escape("run(): `k_cache`: expected dtype torch.float8_e4m3fn")):
        w.run(batch.q, (batch.k_cache.to(torch.bfloat16), batch.v_cache.to(torch.bfloat16)))


# ----------------------------------------------------------------------------- key trimming


def test_sliding_window_visits_only_the_window_pages():
    spec = shipped("sliding_window")
    kv_lens = [200, 7, 64]
    batch = decode_batch(kv_lens, 4, seed=1)
    w, fake, _, _ = check(spec, batch, {"window": 9})
    run = fake.run_calls[0]
    # keys [190, 199] -> pages 47..49; [0, 6] -> pages 0..1; [54, 63] -> pages 13..15
    assert [m[2] for m in run.meta] == [188, 0, 52]
    assert run.kv_indptr == [0, 3, 5, 8] and run.last_page_len == [4, 3, 4]
    ind = batch.kv_indices.tolist()
    kvp = batch.kv_indptr.tolist()
    assert run.kv_indices == ind[kvp[0] + 47:kvp[0] + 50] + ind[kvp[1]:kvp[1] + 2] + ind[kvp[2] + 13:kvp[2] + 16]
    assert w.plan_stats["pages"] == {"given": 50 + 2 + 16, "visited": 8}
    assert [m[1] for m in run.meta] == [199, 6, 63]  # q_pos stays the request's last position
    # the window is part of the plan: run() with another one is refused
    with pytest.raises(LaunchError, match=exact(
            "run(): `window`=20 but plan() planned with 9 (the key intervals depend on it); pass window= to "
            "plan() as well, or plan again")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), window=20)
    # planned with the default window (4095): nothing to trim at these lengths
    w.plan(*plan_args(batch))
    assert w.plan_stats["pages"]["visited"] == 68
    w.plan(*plan_args(batch), skip_tiles=False)
    w.run(batch.q, (batch.k_cache, batch.v_cache), window=20)


def test_document_visits_only_the_current_document():
    spec = shipped("document")
    kv_lens = [40, 33]
    batch = decode_batch(kv_lens, 4, seed=5)
    doc_ids = torch.cat([torch.tensor([0] * 10 + [1] * 21 + [2] * 9), torch.tensor([5] * 33)]).to(torch.int32)
    _, fake, _, _ = check(spec, batch, {"doc_ids": doc_ids})
    run = fake.run_calls[0]
    assert [m[2] for m in run.meta] == [28, 0]  # document 2 starts at key 31 -> page 7
    assert run.kv_indptr == [0, 3, 12]
    # without doc_ids in plan(): trimming is off, and says why
    w, fake = make(spec)
    w.plan(*plan_args(batch))
    assert w.plan_stats["planner_off"] == "plan() was not given doc_ids, which the key intervals read"
    assert w.plan_stats["pages"]["visited"] == 19
    with pytest.raises(LaunchError, match=exact(
            "plan(skip_tiles=True): the key intervals of `document` read doc_ids; pass them to plan() by name too")):
        w.plan(*plan_args(batch), skip_tiles=True)


def test_keys_proved_visible_skip_the_mask(monkeypatch):
    """Key trimming tells the CUDA-core decode kernel which keys the query provably sees (the
    intervals' dense run, vg_meta VIS_LO..VIS_HI): the variant skips the spec's mask there. A
    window's keys are all of them, as are those from a per-request bound read from a spec
    tensor (none where it hides them all); with trimming off none are. Widening the range by a
    few keys breaks the output: the fake honours it as the kernel does, so every decode test
    checks the ranges plan() derives."""
    spec = shipped("sliding_window")
    batch = decode_batch([200, 7, 64], 4, seed=1)
    _, fake, _, _ = check(spec, batch, {"window": 9})
    assert [(m[9], m[10]) for m in fake.run_calls[0].meta] == [(190, 199), (0, 6), (54, 63)]
    _, fake, _, _ = check(spec, batch, {"window": 9}, skip_tiles=False)
    assert all(m[10] < m[9] for m in fake.run_calls[0].meta)
    lim_spec = variantgen.parse_spec("name: from_lim\ntensors:\n  lim: {dtype: int32, shape: [batch]}\n"
                                     "mask: kv_pos <= q_pos and kv_pos >= lim[request]\n")
    lim = torch.tensor([12, 100, 0], dtype=torch.int32)
    lim_batch = decode_batch([30, 9, 5], 4, seed=6)
    _, fake, _, _ = check(lim_spec, lim_batch, {"lim": lim})
    assert [(m[9], m[10]) for m in fake.run_calls[0].meta] == [(12, 29), (0, -1), (0, 4)]  # request 1 sees none

    # (request 1 sees no key: the plan runs the masked kernels, which read VIS_LO..VIS_HI)
    lim_batch = decode_batch([30, 9, 20], 4, seed=6)
    lim = torch.tensor([14, 100, 3], dtype=torch.int32)
    w, _ = make(lim_spec)
    w.plan(*plan_args(lim_batch), lim=lim)
    assert w.plan_stats["variant"] == "masked"
    good = w.run(lim_batch.q, (lim_batch.k_cache, lim_batch.v_cache), lim=lim).clone()
    real = CudaCoreDecodeWrapper._plan_cuda_cores

    def widened(self, *a, **kw):
        real(self, *a, **kw)
        self._launch.meta[[0, 2], 9] -= 2  # two keys before the bounds of 0 and 2 (on pages it reads): visible now
    monkeypatch.setattr(CudaCoreDecodeWrapper, "_plan_cuda_cores", widened)
    w.plan(*plan_args(lim_batch), lim=lim)
    bad = w.run(lim_batch.q, (lim_batch.k_cache, lim_batch.v_cache), lim=lim)
    assert (bad.float() - good.float()).abs().max() > 0.05


def test_exact_window():
    """The variant without the spec's mask applies where every key a request's kernel visits from
    its hull's first key on is provably visible; the window cuts the keys before it."""
    assert exact_window([190, 0, 54], [190, 0, 54], [199, 6, 63], [199, 6, 63]) == [9, 6, 9]
    assert exact_window([5], [0], [9], [9]) == [4]  # keys 0..4 provably visible too: the window still cuts them
    assert exact_window([5, 0], [5, 0], [9, -1], [9, 0]) is None  # request 1 sees no key
    assert exact_window([5], [6], [9], [9]) is None  # key 5 is in the hull but not provably visible
    assert exact_window([5], [5], [8], [9]) is None  # the last key visited (the query's own) is not
    assert exact_window([], [], [], []) is None


@pytest.mark.parametrize(("spec_name", "args", "kv_lens", "windows"), [
    ("causal", {}, [1, 3, 16, 17, 90], [0, 2, 15, 16, 89]),
    ("sliding_window", {"window": 9}, [200, 7, 64], [9, 6, 9]),
    ("document", "docs", [40, 33], [8, 32]),
    ("streaming_sink", {"num_sink": 4, "window": 1023}, [1, 3, 16, 17, 90], [0, 2, 15, 16, 89]),  # all in the window
    # request 4's sinks and window leave a hole in its hull: the mask must cut it, so the whole batch runs masked
    ("streaming_sink", {"num_sink": 4, "window": 8}, [1, 3, 16, 17, 90], None),
])
def test_cuda_core_decode_runs_the_exact_kernels_where_it_can(spec_name, args, kv_lens, windows):
    """plan() picks run_exact (the kernels without the spec's mask) where every visited key from
    the hull's first on is provably visible, with a kernel window cutting the keys before it
    (document 2 of request 0 starts inside its first page); otherwise run, with no window. The
    output is the reference's either way."""
    spec = shipped(spec_name)
    batch = decode_batch(kv_lens, 4, seed=5)
    if args == "docs":
        args = {"doc_ids": torch.cat([torch.tensor([0] * 10 + [1] * 21 + [2] * 9), torch.tensor([5] * 33)]).to(
            torch.int32)}
    w, fake, _, _ = check(spec, batch, args)
    run = fake.run_calls[-1]
    assert run.exact == (windows is not None) and w.plan_stats["variant"] == ("exact" if run.exact else "masked")
    assert [m[7] for m in run.meta] == (windows or [-1] * len(kv_lens))
    _, fake, _, _ = check(spec, batch, args, skip_tiles=False)  # no key known visible: the masked kernels
    assert not fake.run_calls[-1].exact


def test_a_mask_hiding_the_query_key_runs_the_masked_kernels():
    """The query's own key is visited but not visible (every hull ends before it on the query's
    page, so no page list is trimmed): the exact kernels would see it, so plan() keeps the masked
    ones. Where one request's hull ends a page earlier the lists are trimmed to the hulls' last
    keys, and the exact kernels are right."""
    spec = variantgen.parse_spec("name: before\nmask: kv_pos < q_pos\n")
    w, fake, _, _ = check(spec, decode_batch([6, 7, 40], 4, seed=2), {})
    assert not fake.run_calls[-1].exact and w.plan_stats["variant"] == "masked"
    w, fake, _, _ = check(spec, decode_batch([6, 17, 40], 4, seed=2), {})
    assert fake.run_calls[-1].exact and fake.run_calls[-1].last_page_len == [1, 4, 3]


def test_no_visible_key_gives_zero_and_minus_inf_lse():
    spec = variantgen.parse_spec("name: from_lim\ntensors:\n  lim: {dtype: int32, shape: [batch]}\n"
                                 "mask: kv_pos <= q_pos and kv_pos >= lim[request]\n")
    batch = decode_batch([30, 9, 5], 4, seed=6)
    lim = torch.tensor([12, 100, 0], dtype=torch.int32)
    for skip in (False, None):
        _, fake, out, lse = check(spec, batch, {"lim": lim}, skip_tiles=skip, label="from_lim")
        assert out[1].float().abs().max().item() == 0.0 and bool(torch.isinf(lse[1]).all())
        if skip is None:
            assert [m[2] for m in fake.run_calls[0].meta] == [12, 8, 0]  # request 1: only its own key


def test_spec_args_without_trimming_are_taken_by_plan_too():
    """One plan() contract: without key trimming plan() reads no spec argument but takes (and
    checks) the same ones run() takes."""
    spec = shipped("mm_prefix")
    batch = decode_batch(KV_LENS, 4)
    args = random_spec_args(spec, batch)
    check(spec, batch, args, skip_tiles=False, plan_extra={"skip_tiles": False, **args}, label="plan args, untrimmed")
    w, _ = make(spec)
    with pytest.raises(LaunchError, match=exact("plan(): `ranges`: expected shape [total_q=7, 2], got [2, 2]")):
        w.plan(*plan_args(batch), skip_tiles=False, ranges=args["ranges"][:2].contiguous())
    with pytest.raises(LaunchError, match=exact("run() called before plan(): call plan(paged_kv_indptr, "
                                                "paged_kv_indices, paged_kv_last_page_len, num_qo_heads, "
                                                "num_kv_heads, page_size) first")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)


def test_head_dependent_mask_runs_untrimmed():
    spec = variantgen.parse_spec("name: odd_heads\nmask: kv_pos <= q_pos and (qo_head % 2 == 0 or kv_pos == q_pos)\n")
    batch = decode_batch(KV_LENS, 4, seed=9)
    w, _, _, _ = check(spec, batch, {}, label="odd_heads")
    assert "head index" in w.plan_stats["planner_off"]
    with pytest.raises(LaunchError, match=re.escape("plan(skip_tiles=True): spec `odd_heads` has no usable key "
                                                    "intervals")):
        w.plan(*plan_args(batch), skip_tiles=True)


# ----------------------------------------------------------------------------- plumbing


def test_what_reaches_the_module():
    spec = shipped("mm_prefix")
    batch = decode_batch([5, 17, 1], 4, seed=7)
    args = random_spec_args(spec, batch, seed=7)
    w, fake = make(spec, kv_layout="HND")
    w.plan(*plan_args(batch), skip_tiles=False)
    (plan,) = fake.plan_calls
    assert plan.kv_indptr == batch.kv_indptr.tolist() == [0, 2, 7, 8]
    assert (plan.batch_size, plan.num_qo_heads, plan.num_kv_heads, plan.page_size) == (3, HQ, HKV, 4)
    assert plan.enable_cuda_graph is False
    k, v = cache_of(batch, "HND")
    w.run(batch.q, (k, v), enable_pdl=True, **args)
    w.run(batch.q, (k, v), **args)
    first, second = fake.run_calls
    assert first.enable_pdl is True and second.enable_pdl is False  # default: sm90+ only (no GPU here)
    assert first.layout == 1 and first.lse is False
    # vg_meta: [q_row_base, q_pos_base, kv_pos_base, request, kv_row_base, req_qo_len, req_kv_len, window, qo_len,
    #           vis_lo, vis_hi (none known visible), then (gap_at, gap_len) x 3 (no gaps), page_table_at,
    #           list_page_size (no page list)]
    no_gaps = [NO_GAP_AT, 0] * MAX_KEY_GAPS + [-1, 0]
    assert first.meta == [[0, 4, 0, 0, 0, 1, 5, -1, 1, 0, -1, *no_gaps],
                          [1, 16, 0, 1, 5, 1, 17, -1, 1, 0, -1, *no_gaps],
                          [2, 0, 0, 2, 22, 1, 1, -1, 1, 0, -1, *no_gaps]]
    assert first.sm_scale == pytest.approx(1 / math.sqrt(HEAD_DIM)) and first.v_scale == 1.0
    assert first.scalars == {"causal_window_left": -1, "range_window_left": -1}
    assert w.plan_stats["launches"] == [("decode", 3)]


@pytest.mark.usefixtures("host_modules")
def test_make_wrapper_builds_the_right_module(monkeypatch):
    built = []

    def fake_build(config, cache, jobs=None, allow_build=True):
        built.append(config)
        manifest = {"scalar_args": [a.name for a in kernel_args(config.spec)[1]], "module_sha256": "x"}
        return BuildResult(Entry(Path("/nonexistent"), config.uri_prefix + "_x", manifest), None, False, 0.0)

    monkeypatch.setattr(build_mod, "build_module", fake_build)
    monkeypatch.setattr(build_mod, "load_module", lambda entry: object())
    ws = torch.empty(16, dtype=torch.uint8)
    w = variantgen.make_wrapper(shipped("softcap"), ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="fp8_e4m3",
                                kind="decode", arch="9.0a", kv_layout="HND")
    assert isinstance(w, CudaCoreDecodeWrapper) and not w.use_tensor_cores and w.kv_layout == "HND"
    assert (built[-1].backend, built[-1].kind, built[-1].kv_dtype) == ("fa2", "decode", "fp8_e4m3")  # no fp8 on fa3
    for tensor_cores in (True, False):  # sm90, 16-bit KV, backend="fa3": fa3's prefill module either way
        w = variantgen.make_wrapper(shipped("softcap"), ws, head_dim_qk=64, q_dtype=torch.float16, backend="fa3",
                                    kv_dtype=torch.float16, kind="decode", arch="9.0a", use_tensor_cores=tensor_cores)
        assert isinstance(w, TensorCoreDecodeWrapper) and w.use_tensor_cores
        assert (built[-1].backend, built[-1].kind, built[-1].head_dim_qk) == ("fa3", "prefill", 64)
        # backend=None on sm90: fa2 first for decode (fa3's decode measured slower), tensor cores where asked
        w = variantgen.make_wrapper(shipped("softcap"), ws, head_dim_qk=64, q_dtype=torch.float16,
                                    kv_dtype=torch.float16, kind="decode", arch="9.0a", use_tensor_cores=tensor_cores)
        assert w.use_tensor_cores == tensor_cores
        assert (built[-1].backend, built[-1].kind) == ("fa2", "prefill" if tensor_cores else "decode")
    w = variantgen.make_wrapper(shipped("softcap"), ws, head_dim_qk=64, q_dtype="fp16", kv_dtype="fp16", kind="decode",
                                arch="8.0", use_tensor_cores=True)
    assert w.use_tensor_cores and (built[-1].backend, built[-1].kind) == ("fa2", "prefill")
    w = variantgen.make_wrapper(shipped("softcap"), ws, head_dim_qk=64, q_dtype="fp16", kv_dtype="fp16", kind="decode",
                                arch="8.0")
    assert not w.use_tensor_cores and (built[-1].backend, built[-1].kind) == ("fa2", "decode")


def test_wrapper_refuses_other_module_kinds():
    spec = shipped("causal")
    w, fake = make(spec)
    config = ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", kind="ragged")
    for cls in (DecodeWrapper, CudaCoreDecodeWrapper, TensorCoreDecodeWrapper):
        with pytest.raises(ValueError, match=re.escape("DecodeWrapper: needs a 'decode' module (CUDA cores) or a "
                                                       "'prefill' module (tensor cores), got kind='ragged'")):
            cls(spec, config, fake, w.build, torch.empty(16, dtype=torch.uint8))
    prefill = ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", kind="prefill")
    with pytest.raises(ValueError, match="got kind='prefill'"):  # a class and a module of the other path
        CudaCoreDecodeWrapper(spec, prefill, fake, w.build, torch.empty(16, dtype=torch.uint8))


def test_decode_is_two_classes_by_module_kind_without_branching_on_the_path():
    """DecodeWrapper(...) makes the class its module's kind names; neither branches on the other."""
    import inspect

    from variantgen.wrappers import decode

    for tensor_cores, cls in ((False, CudaCoreDecodeWrapper), (True, TensorCoreDecodeWrapper)):
        w, _ = make(shipped("causal"), tensor_cores=tensor_cores)
        assert type(w) is cls and isinstance(w, DecodeWrapper) and w.use_tensor_cores == tensor_cores
    for cls in (DecodeWrapper, CudaCoreDecodeWrapper, TensorCoreDecodeWrapper):
        source = inspect.getsource(cls)
        assert "_prefill is" not in source and "if self.use_tensor_cores" not in source, cls.__name__
    assert "_prefill" not in inspect.getsource(decode.CudaCoreDecodeWrapper)


# ----------------------------------------------------------------------------- argument errors


@pytest.fixture
def causal_batch():
    spec = shipped("causal")
    return spec, decode_batch([5, 17, 1], 4, seed=1)


@pytest.mark.parametrize("change, message", [
    (dict(num_qo_heads=0), "plan(): num_qo_heads=0: expected a positive int below 2**31"),
    (dict(page_size=4.0), "plan(): page_size=4.0: expected a positive int below 2**31"),
    (dict(num_kv_heads=3), "plan(): num_qo_heads=8 is not a multiple of num_kv_heads=3"),
    (dict(num_qo_heads=10), "plan(): GQA group size 5 (num_qo_heads=10 / num_kv_heads=2) is not one FlashInfer's "
                            "CUDA-core decode kernel supports [1, 2, 3, 4, 6, 8, 16]; build the wrapper with "
                            "use_tensor_cores=True"),
    (dict(paged_kv_indptr=torch.tensor([0, 2, 7, 8])),
     "plan(): `paged_kv_indptr`: expected a 1-D torch.int32 tensor [batch + 1], got torch.int64 tensor of "
     "shape [4]"),
    (dict(paged_kv_indices=[0, 1]), "plan(): `paged_kv_indices`: expected a 1-D torch.int32 tensor, got list"),
    (dict(paged_kv_last_page_len=torch.tensor([1, 1], dtype=torch.int32)),
     "plan(): inconsistent batch: paged_kv_indptr has 4 entries, paged_kv_last_page_len 2 (expected batch+1 and "
     "batch, batch >= 1)"),
    (dict(paged_kv_indptr=torch.tensor([0], dtype=torch.int32), paged_kv_last_page_len=torch.tensor(
        [], dtype=torch.int32)), "plan(): inconsistent batch: paged_kv_indptr has 1 entries, paged_kv_last_page_len "
                                 "0 (expected batch+1 and batch, batch >= 1)"),
    (dict(paged_kv_indptr=torch.tensor([0, 2, 2, 3], dtype=torch.int32)),
     "plan(): request 1 has no pages; a decode query is its request's last token, so every request needs "
     "kv_len >= 1"),
    (dict(paged_kv_indptr=torch.tensor([0, 2, 1, 3], dtype=torch.int32)),
     "plan(): request 1: paged_kv_indptr must be non-decreasing"),
    (dict(paged_kv_last_page_len=torch.tensor([1, 0, 1], dtype=torch.int32)),
     "plan(): paged_kv_last_page_len[1]=0: expected 1..4"),
    (dict(paged_kv_indices=torch.zeros(5, dtype=torch.int32)),
     "plan(): paged_kv_indices has 5 entries, paged_kv_indptr needs 8"),
])
def test_plan_errors(causal_batch, change, message):
    spec, batch = causal_batch
    w, fake = make(spec)
    kw = dict(zip(("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
                   "num_kv_heads", "page_size"), plan_args(batch)))
    kw.update(change)
    with pytest.raises(LaunchError, match=exact(message)):
        w.plan(**kw)
    assert fake.plan_calls == []


@pytest.mark.parametrize("spec_name", ["causal", "alibi", "attention_sink_learned"])
def test_tensor_cores_take_any_group_size(spec_name):
    """Group 5 (10 query heads on 2 kv heads), which the CUDA-core kernel refuses: the output is the
    reference's, per query head (alibi's slopes and the learned sinks read qo_head, so a head mapped
    to the wrong slope or sink shows)."""
    spec = shipped(spec_name)
    batch = decode_batch([5, 17, 1, 40], 4, seed=1, hq=10, hkv=2)
    args = random_spec_args(spec, batch, seed=3)
    args.update(SMALL_SCALARS.get(spec_name, {}))
    _, fake, out, _ = check(spec, batch, args, tensor_cores=True, label=f"{spec_name} group 5")
    assert fake.run_calls, "the tensor-core (prefill) kernel ran"
    # the heads of one group differ (the mapping is checked, not ten copies of one head)
    assert (out[:, 0].float() - out[:, 4].float()).abs().max() > 1e-3


def test_failed_plan_drops_the_previous_plan(causal_batch):
    spec, batch = causal_batch
    for tensor_cores in (False, True):
        w, _ = make(spec, tensor_cores=tensor_cores)
        w.plan(*plan_args(batch))
        w.run(batch.q, (batch.k_cache, batch.v_cache))
        with pytest.raises(LaunchError, match="paged_kv_last_page_len"):
            w.plan(batch.kv_indptr, batch.kv_indices, batch.last_page_len[:2], HQ, HKV, 4)
        with pytest.raises(LaunchError, match=r"^run\(\) called before plan\(\)"):
            w.run(batch.q, (batch.k_cache, batch.v_cache))


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_run_errors(causal_batch, tensor_cores):
    spec, batch = causal_batch
    w, fake = make(spec, tensor_cores=tensor_cores)
    kv = (batch.k_cache, batch.v_cache)
    with pytest.raises(LaunchError, match=r"^run\(\) called before plan\(\)"):
        w.run(batch.q, kv)
    w.plan(*plan_args(batch))
    with pytest.raises(LaunchError, match=exact(
            "run(): `q`: expected shape [batch=3, num_qo_heads=8, head_dim=64] (one query per request), got "
            "[3, 1, 8, 64]")):
        w.run(batch.q.unsqueeze(1), kv)
    with pytest.raises(LaunchError, match=exact(
            "run(): `q`: expected dtype torch.bfloat16 (the wrapper was built for it), got torch.float16")):
        w.run(batch.q.half(), kv)
    with pytest.raises(LaunchError, match=re.escape("run(): `k_cache`: expected [pages, page_size, kv_heads, "
                                                    "head_dim] with page_size=4, kv_heads=2, head_dim=64; got")):
        w.run(batch.q, (batch.k_cache[:, :2], batch.v_cache[:, :2]))
    with pytest.raises(LaunchError, match=re.escape("run(): unexpected argument(s) window; spec `causal` takes: "
                                                    "no extra arguments")):
        w.run(batch.q, kv, window=3)
    with pytest.raises(LaunchError, match=exact("run(): `q_scale`: expected a finite float, got nan "
                                                "(per-head scale tensors are not supported)")):
        w.run(batch.q, kv, q_scale=float("nan"))
    with pytest.raises(LaunchError, match=exact("run(): `out`: expected shape [3, 8, 64], got [3, 8, 32]")):
        w.run(batch.q, kv, out=torch.empty(3, HQ, 32, dtype=torch.bfloat16))
    out, lse = w.run(batch.q, kv, return_lse=True)
    assert out.shape == (3, HQ, HEAD_DIM) and lse.shape == (3, HQ) and lse.dtype == torch.float32


def test_run_errors_of_spec_arguments():
    spec = shipped("mm_prefix")
    batch = decode_batch([5, 17, 1], 4, seed=2)
    w, _ = make(spec)
    w.plan(*plan_args(batch), skip_tiles=False)
    kv = (batch.k_cache, batch.v_cache)
    with pytest.raises(LaunchError, match=re.escape("run(): missing tensor argument `ranges` (int32, shape "
                                                    "['total_q', 2]")):
        w.run(batch.q, kv)
    with pytest.raises(LaunchError, match=exact("run(): `ranges`: expected shape [total_q=3, 2], got [4, 2]")):
        w.run(batch.q, kv, ranges=torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(LaunchError, match=exact("run(): `out` must be contiguous (the kernel writes rows of "
                                                "num_qo_heads * head_dim_vo elements back to back; got strides "
                                                "[64, 192, 1])")):
        w.run(batch.q, kv, ranges=torch.zeros(3, 2, dtype=torch.int32),
              out=torch.empty(HQ, 3, HEAD_DIM, dtype=torch.bfloat16).transpose(0, 1))


def test_scales_refused_where_the_spec_says_so():
    spec = variantgen.parse_spec("name: plain\nmask: kv_pos <= q_pos\nscales:\n  qkv_scales: false\n")
    batch = decode_batch([5, 2], 4, seed=2)
    w, fake = make(spec)
    w.plan(*plan_args(batch))
    with pytest.raises(LaunchError, match=re.escape("run(): spec `plain` sets `scales.qkv_scales: false`")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), v_scale=2.0)
    w.run(batch.q, (batch.k_cache, batch.v_cache))
    assert fake.run_calls[0].v_scale == 1.0


# ----------------------------------------------------------------------------- a real compile


@pytest.mark.nvcc
def test_build_a_real_decode_module(vg_env, toolchain):
    from variantgen.build import builder as build
    from variantgen.build.cache import Cache

    vg_env.set(VARIANTGEN_BUILD_JOBS="2")
    config = ModuleConfig(shipped("mm_prefix"), 64, 64, "bf16", "bf16", "bf16", "9.0a", kind="decode")
    result = build.build_module(config, Cache(vg_env.cache_dir))
    entry = result.entry
    assert result.built and entry.module_path.read_bytes()[:4] == b"\x7fELF"
    assert entry.manifest["tensor_args"] == ["ranges", "vg_meta"]
    assert entry.manifest["scalar_args"] == ["causal_window_left", "range_window_left", "sm_scale", "v_scale"]
    assert "batch_decode.cu" in (entry.path / "build.ninja").read_text()
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(entry.module_path)], capture_output=True,
                                 text=True).stdout
        assert "__tvm_ffi_plan" in symbols and "__tvm_ffi_run" in symbols and "__tvm_ffi_run_exact" in symbols


def test_tensor_core_decode_plans_with_the_row_kernel_it_is_given():
    """make_wrapper hands the spec's planner module to the prefill wrapper behind tensor-core decode."""
    spec = variantgen.load_spec(SPECS_DIR / "sliding_window.yaml")
    w, _ = make(spec, tensor_cores=True)
    planner = FakeRowPlanner(spec)
    w.set_row_planner(planner)
    batch = decode_batch([1, 7, 16, 17, 90], 4)
    w.plan(*plan_args(batch), window=9)
    assert planner.calls == 1 and w.plan_stats["row_planner"] == "kernel" and w.last_plan.planner == "module"
    plain, _ = make(spec, tensor_cores=True)
    plain.set_row_planner(None, "test: none")  # planner-off, and why
    plain.plan(*plan_args(batch), window=9)
    assert plain.plan_stats["planner_off"] == "no planner module (test: none): one custom launch per request"
    kv = cache_of(batch, "NHD")
    assert torch.equal(w.run(batch.q, kv, window=9), plain.run(batch.q, kv, window=9))


@pytest.mark.parametrize("spec_name, source", [("document", "row kernel"), ("mm_prefix", "row kernel"),
                                               ("tree_verify", "host"), ("sliding_window", "host"),
                                               ("causal", "host")])
def test_cuda_core_decode_trims_keys_with_the_row_kernel_it_is_given(spec_name, source):
    """make_wrapper hands the CUDA-core decode wrapper the spec's planner module too: where key
    trimming's intervals read spec tensors (a read-back either way) they come from its row pass
    (one call) rather than torch ops on the GPU, with the same pages, known-visible keys and
    output. Intervals that read no tensor stay on the host: the row pass's read-back would make
    plan() wait for the GPU's queued work (tests/gpu/test_gpu_checks.py times that)."""
    spec = shipped(spec_name)
    batch = decode_batch([1, 7, 16, 17, 90, 130], 4, seed=11)
    args = {"window": 9} if spec_name == "sliding_window" else random_spec_args(spec, batch, seed=11)
    torch_path, torch_fake, want, _ = check(spec, batch, args, label=f"{spec_name} torch intervals")
    kernel_path, fake = make(spec)
    planner = FakeRowPlanner(spec)
    kernel_path.set_row_planner(planner)
    kernel_path.plan(*plan_args(batch), **args)
    got = kernel_path.run(batch.q, cache_of(batch, "NHD"), **args)
    assert planner.calls == (source == "row kernel")
    assert kernel_path.plan_stats["intervals"] == source
    assert torch_path.plan_stats["intervals"] == ("host" if source == "host" else "torch ops on the GPU")
    ours, theirs = fake.run_calls[-1], torch_fake.run_calls[-1]
    assert (ours.kv_indptr, ours.kv_indices, ours.meta) == (theirs.kv_indptr, theirs.kv_indices, theirs.meta)
    assert torch.equal(got, want)


def test_a_request_that_sees_no_key_through_the_row_kernel():
    """The row pass has no "provably empty" answer: a request whose query sees no key keeps its
    hull (every key of the request here) where the torch intervals visit only its own key. The
    mask rejects them all the same: output 0, LSE -inf, as on the torch path."""
    spec = variantgen.parse_spec("name: from_lim\ntensors:\n  lim: {dtype: int32, shape: [batch]}\n"
                                 "mask: kv_pos <= q_pos and kv_pos >= lim[request]\n")
    batch = decode_batch([30, 9, 5], 4, seed=6)
    lim = torch.tensor([12, 100, 0], dtype=torch.int32)
    _, torch_fake, want, _ = check(spec, batch, {"lim": lim}, label="from_lim torch intervals")
    w, fake = make(spec)
    w.set_row_planner(FakeRowPlanner(spec))
    w.plan(*plan_args(batch), lim=lim)
    out, lse = w.run(batch.q, cache_of(batch, "NHD"), lim=lim, return_lse=True)
    assert [m[2] for m in torch_fake.run_calls[-1].meta] == [12, 8, 0]
    assert [m[2] for m in fake.run_calls[-1].meta] == [12, 0, 0]  # request 1: its whole hull
    assert torch.equal(out, want) and out[1].float().abs().max().item() == 0.0 and bool(torch.isinf(lse[1]).all())
