"""Ragged-KV prefill (kind "ragged") on the CPU: rendering, RaggedWrapper against a fake
module that emulates FlashInfer's ragged kernel, argument errors, and (marked nvcc) a
real compile of a 192/128 module.

The fake ``ragged_run`` does what the kernel does with the wrapper's arguments: request
b reads q rows from ``q_indptr[b]`` (``vg_meta[b][8]`` of them), keys ``kv_indptr[b] ..
kv_indptr[b+1]`` of k / v, writes o / lse at the plan's packed ``o_indptr``; mask mode
custom evaluates the spec's mask with the positions and rows from vg_meta, causal is
purely geometric, none sees every key.
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from _fake_kernel import assert_lse_matches
from _fake_ragged import FakeFa3RaggedModule, FakeRaggedModule
from conftest import ALL_SPECS, SPECS_DIR
from conftest import CPU_KV_LENS as KV_LENS
from conftest import CPU_QO_LENS as QO_LENS
from conftest import CPU_SMALL_SCALARS as SMALL_SCALARS

import variantgen
import variantgen.build.builder as build_mod
from variantgen.abi.table import MAX_KEY_GAPS, META_COLUMNS, NO_GAP_AT, RAGGED_KV_GAP
from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import render
from variantgen.core.errors import LaunchError
from variantgen.testing.harness import random_spec_args
from variantgen.wrappers.ragged import (
    RaggedWrapper,
    launch_mask_mode,
    padded_kv_rows,
    random_ragged_batch,
    reference_ragged,
)

HQ, HKV = 4, 2


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


@functools.cache
def shipped(name: str) -> variantgen.VariantSpec:
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


def ragged_config(spec, qk=128, vo=128, **kw) -> render.ModuleConfig:
    kw = dict(dict(q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", arch="9.0a", kind="ragged"), **kw)
    return render.ModuleConfig(spec, qk, vo, **kw)


# ----------------------------------------------------------------------------- rendering


def define_lines(text: str, prefix: str) -> list[str]:
    return [" ".join(line.split("//")[0].split()) for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("spec_name", ALL_SPECS)
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)], ids=["hd128", "hd192x128"])
def test_every_shipped_spec_renders_ragged(spec_name, dims):
    spec = shipped(spec_name)
    module = render.render_module(ragged_config(spec, *dims))
    assert module.host_sources == ("batch_prefill.cu",)
    assert module.compile_units[0] == "binding.cu"
    kernels = [f"ragged_kernel_cta{c}.cu" for c in (16, 64, 128)]  # sm90: every mode of a CTA tile in one unit
    assert list(module.compile_units[1:]) == kernels
    assert set(module.files) == {"vg_plan_abi.h", "fi_facts.h", "variant.cuh", "batch_prefill_config.inc",
                                 "binding.cu", *kernels, "vg_helpers.cuh", "config_prelude.cuh", "kernel_params.cuh",
                                 "prefill_plan.cuh", "pinned_kv_tile.cuh"}
    text = "\n".join(module.files.values())
    assert "{{" not in text and "{%" not in text
    config = module.files["batch_prefill_config.inc"]
    assert "struct RaggedParams : vg::RaggedPrefillFields<" in config and "struct PagedParams : " in config
    assert f"constexpr int HEAD_DIM_QK = {dims[0]};" in config and f"constexpr int HEAD_DIM_VO = {dims[1]};" in config
    binding = module.files["binding.cu"]
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, VariantgenPrefillPlan);" in binding
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(ragged_run, BatchPrefillWithRaggedKVCacheRun);" in binding
    assert '#include "prefill_plan.cuh"' in binding
    assert "HEAD_DIM_QK, HEAD_DIM_VO, page_size" in module.files["prefill_plan.cuh"]  # both head dims
    unit = module.files["ragged_kernel_cta64.cu"]
    assert (f"BatchPrefillWithRaggedKVCacheDispatched<\n    /*CTA_TILE_Q=*/64, {dims[0]}, {dims[1]}, "
            "PosEncodingMode::kNone") in unit
    assert f"MaskMode::kCustom, {render.struct_name(spec)}, RaggedParams>" in unit
    # the variant struct is the one every FA2 kind shares
    prefill = render.render_module(render.ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a"))
    if dims == (128, 128):
        assert module.files["variant.cuh"] == prefill.files["variant.cuh"]
    assert module.tensor_args == prefill.tensor_args and module.scalar_args == prefill.scalar_args


def test_vg_meta_layout_matches_the_prefill_module():
    """variant.cuh reads vg_meta through VG_META_*: every FA2 kind includes the same columns
    (the plan ABI's header)."""
    spec = shipped("mm_prefix")
    ragged = render.render_module(ragged_config(spec))
    prefill = render.render_module(render.ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a"))
    assert '#include "vg_plan_abi.h"' in ragged.files["batch_prefill_config.inc"]
    mine = define_lines(ragged.files["vg_plan_abi.h"], "#define VG_META_")
    assert len(mine) == META_COLUMNS + 1
    assert mine == define_lines(prefill.files["vg_plan_abi.h"], "#define VG_META_")
    assert f"#define VG_META_STRIDE {META_COLUMNS}" in mine


def test_every_dispatched_kernel_is_defined():
    """FlashInfer's host code names CTA tiles 16/32/64/128 and (batch_prefill.cu) the paged kernels
    too, each with the variant of its run() code (causal: the exact one): what the kernel units do
    not instantiate is explicitly specialised (to refuse)."""
    spec = shipped("causal")
    module = render.render_module(ragged_config(spec, 192, 128, mask_modes=("causal", "custom")))
    config, binding = module.files["batch_prefill_config.inc"], module.files["binding.cu"]
    for text in (config, binding):
        for mode, variant in (("kCausal", "VG_CausalExact"), ("kCustom", "VG_Causal")):
            for cta in (16, 32, 64, 128):
                assert (f"/*SAME_KV_STRIDES=*/true, {cta}, 192, 128, PosEncodingMode::kNone,\n    false, "
                        f"MaskMode::{mode}, {variant}, PagedParams>") in text
            assert (f"    32, 192, 128, PosEncodingMode::kNone, false, MaskMode::{mode},\n    {variant}, "
                    "RaggedParams>") in text
            for cta in (16, 64, 128):
                assert f"    {cta}, 192, 128, PosEncodingMode::kNone, false, MaskMode::{mode}," not in text
        assert "kNone" not in text.replace("PosEncodingMode::kNone", "")
    assert binding.count("return cudaErrorNotSupported;") == 2 * (4 + 1)


def test_head_dims_per_kind():
    spec = shipped("causal")
    ragged_config(spec, 192, 128)
    for hd in (64, 128, 256):
        ragged_config(spec, hd, hd)
    with pytest.raises(ValueError, match="fa2 prefill modules support head dims 64, 128, 256"):
        render.ModuleConfig(spec, 192, 128, "bf16", "bf16", "bf16", "9.0a")
    with pytest.raises(ValueError, match=r"fa2 ragged modules support head dims 64, 128, 256, 192/128"):
        ragged_config(spec, 192, 192)
    assert ragged_config(spec, 192, 128).uri_prefix.endswith("_fa2_ragged_qbf16_kvbf16_obf16_hd192x128_sm90a")


# ----------------------------------------------------------------------------- the wrapper on the fake module


def make(spec, qk=64, vo=None, *, kv_layout="NHD", mask_modes=("none", "causal", "custom"), kv_dtype="bf16",
         workspace=None, backend="fa2"):
    config = ragged_config(spec, qk, vo or qk, kv_dtype=kv_dtype, mask_modes=mask_modes, backend=backend)
    rendered = render.render_module(config)
    manifest = {"scalar_args": [a.name for a in rendered.scalar_args], "module_sha256": "x", "module_file": "x.so"}
    fake = {"fa2": FakeRaggedModule, "fa3": FakeFa3RaggedModule}[backend](spec)
    build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                        built=False, seconds=0.0)
    ws = workspace if workspace is not None else torch.empty(1 << 20, dtype=torch.uint8)
    return RaggedWrapper(spec, config, fake, build, ws, kv_layout), fake


def batch_of(qo_lens=QO_LENS, kv_lens=KV_LENS, qk=64, vo=None, seed=0, kv_layout="NHD", **kw):
    return random_ragged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=qk,
                               head_dim_vo=vo, seed=seed, kv_layout=kv_layout, **kw)


def check(spec, batch, args, *, qk=64, vo=None, scales=None, kv_layout="NHD", label="", backend="fa2"):
    w, fake = make(spec, qk, vo, kv_layout=kv_layout, backend=backend)
    w.plan(*batch.plan_args())
    out = torch.full((batch.q.shape[0], HQ, vo or qk), math.nan, dtype=torch.bfloat16)
    scales = scales or {}
    got, lse = w.run(batch.q, batch.k, batch.v, out=out, return_lse=True, **scales, **args)
    assert got is out
    ref, ref_lse = reference_ragged(spec, batch.q, batch.k, batch.v, batch.qo_indptr, batch.kv_indptr, args,
                                    kv_layout=kv_layout, return_lse=True, **scales)
    assert not torch.isnan(out.float()).any(), f"{label}: rows left unwritten"
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert err < 1e-2, f"{label}: rel. error {err:.2e}"
    assert_lse_matches(lse, ref_lse, label)
    return w, fake


# ----------------------------------------------------------------------------- correctness via the fake


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("spec_name, scalars", [(n, "defaults") for n in ALL_SPECS]
                         + [(n, "small") for n in sorted(SMALL_SCALARS)])
def test_shipped_spec_matches_reference(spec_name, scalars, kv_layout):
    spec = shipped(spec_name)
    seed = len(spec_name) + (kv_layout == "HND")
    batch = batch_of(seed=seed, kv_layout=kv_layout)
    args = random_spec_args(spec, batch, seed=seed)
    if scalars == "small":
        args.update(SMALL_SCALARS[spec_name])
    w, fake = check(spec, batch, args, kv_layout=kv_layout, label=f"{spec_name} {scalars} {kv_layout}")
    (call,) = fake.ragged_calls
    assert call["mode"] == ("causal" if spec_name in ("causal", "alibi") else "custom")
    assert call["layout"] == {"NHD": 0, "HND": 1}[kv_layout]
    assert w.plan_stats["launches"] == [(call["mode"], len(QO_LENS))]


@pytest.mark.parametrize("spec_name", ["mm_prefix", "causal", "softcap"])
def test_mla_head_dims_192_128(spec_name):
    spec = shipped(spec_name)
    batch = batch_of([3, 17, 1], [40, 17, 9], qk=192, vo=128, seed=2)
    args = random_spec_args(spec, batch, seed=2)
    w, fake = check(spec, batch, args, qk=192, vo=128, label=spec_name)
    # the default softmax scale is 1/sqrt(head_dim_qk)
    assert fake.ragged_calls[0]["sm_scale"] == pytest.approx(1 / math.sqrt(192))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("spec_name", ["causal", "mm_prefix", "attention_sink_learned"])
def test_fa3_ragged_matches_reference(spec_name, kv_layout):
    """fa3's ragged module (its plan writes the sm90 work list, ragged_run takes no indptrs):
    GQA heads, both layouts, the LSE; the plan is causal only for the causal spec."""
    spec = shipped(spec_name)
    seed = len(spec_name) + (kv_layout == "HND")
    batch = batch_of(seed=seed, kv_layout=kv_layout)
    args = random_spec_args(spec, batch, seed=seed)
    args.update(SMALL_SCALARS.get(spec_name, {}))
    w, fake = check(spec, batch, args, kv_layout=kv_layout, backend="fa3", label=f"fa3 {spec_name} {kv_layout}")
    assert isinstance(fake, FakeFa3RaggedModule) and HQ // HKV == 2
    (plan,) = fake.plan_calls
    assert plan == dict(qo_indptr=batch.qo_indptr.tolist(), kv_indptr=batch.kv_indptr.tolist(),
                        causal=spec_name == "causal")
    (call,) = fake.ragged_calls
    assert call["mode"] == ("causal" if spec_name == "causal" else "custom") and call["lse"] is True
    assert call["layout"] == {"NHD": 0, "HND": 1}[kv_layout]
    assert w.plan_stats["launches"] == [(call["mode"], len(QO_LENS))]


def test_fa3_ragged_mla_head_dims():
    spec = shipped("mm_prefix")
    batch = batch_of([3, 17, 1], [40, 17, 9], qk=192, vo=128, seed=2)
    args = random_spec_args(spec, batch, seed=2)
    _, fake = check(spec, batch, args, qk=192, vo=128, backend="fa3", label="fa3 192/128")
    assert fake.ragged_calls[0]["sm_scale"] == pytest.approx(1 / math.sqrt(192))
    assert ragged_config(spec, 192, 128, backend="fa3").uri_prefix.endswith(
        "_fa3_ragged_qbf16_kvbf16_obf16_hd192x128_sm90a")
    with pytest.raises(ValueError, match=r"kv_dtype=fp8_e4m3: fa3 variant modules need kv_dtype == q_dtype"):
        ragged_config(spec, 192, 128, backend="fa3", kv_dtype="fp8_e4m3")


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_plan_waits_for_the_last_copies_before_the_module_plans(backend, monkeypatch):
    """The module's plan rewrites the page-locked mirror its previous copy into the int
    workspace may still read (queued behind busy kernels): staging.begin(), which waits for the
    last plan's copies, comes first; the mirror's copy is then marked and recorded."""
    w, fake = make(shipped("causal"), backend=backend)
    events = []
    for name in ("begin", "queued", "record"):
        real = getattr(w._staging, name)
        monkeypatch.setattr(w._staging, name, lambda real=real, name=name: events.append(name) or real())
    real_plan = fake.plan
    monkeypatch.setattr(fake, "plan", lambda *a: events.append("plan") or real_plan(*a))
    batch = batch_of([4, 2], [4, 9])
    for _ in range(2):
        w.plan(*batch.plan_args())
        w.run(batch.q, batch.k, batch.v)
    assert events == ["begin", "plan", "queued", "record"] * 2


@pytest.mark.parametrize("spec_name", ["causal", "alibi", "softcap"])
def test_qkv_scales_and_lse(spec_name):
    spec = shipped(spec_name)
    batch = batch_of([9, 3], [9, 40], seed=3)
    args = random_spec_args(spec, batch)
    scales = dict(q_scale=0.5, k_scale=1.75, v_scale=0.25)
    _, fake = check(spec, batch, args, scales=scales, label=spec_name)
    call = fake.ragged_calls[0]
    assert call["sm_scale"] == pytest.approx(0.5 * 1.75 / 8.0) and call["v_scale"] == 0.25
    assert call["args"] == {s.name: args.get(s.name, s.default) for s in spec.scalars}


def test_what_reaches_the_module():
    """vg_meta rows, indptrs and the plan call of a ragged batch."""
    spec = shipped("mm_prefix")
    batch = batch_of([3, 0, 5, 1], [10, 4, 5, 7], seed=5)
    w, fake = make(spec)
    w.plan(*batch.plan_args(), disable_split_kv=True)
    (plan,) = fake.plan_calls
    assert plan.qo_indptr == [0, 3, 3, 8, 9] and plan.kv_indptr == [0, 10, 14, 19, 26]
    assert (plan.total_rows, plan.batch_size, plan.num_qo_heads, plan.num_kv_heads, plan.page_size) == (9, 4, 4, 2, 1)
    assert plan.disable_split_kv is True and plan.enable_cuda_graph is False and plan.window_left == -1
    args = random_spec_args(spec, batch)
    w.run(batch.q, batch.k, batch.v, enable_pdl=False, **args)
    (call,) = fake.ragged_calls
    # [q_row_base, q_pos_base, kv_pos_base, request, kv_row_base, req_qo_len, req_kv_len, window, qo_len,
    #  vis_lo, vis_hi (no keys known visible: the mask on every key)]
    no_gaps = [NO_GAP_AT, 0] * MAX_KEY_GAPS + [-1, 0]  # (then (gap_at, gap_len) x 3: no gaps; no page list)
    assert call["meta"] == [[0, 7, 0, 0, 0, 3, 10, -1, 3, 0, -1, *no_gaps],
                            [3, 4, 0, 1, 10, 0, 4, -1, 0, 0, -1, *no_gaps],
                            [3, 0, 0, 2, 14, 5, 5, -1, 5, 0, -1, *no_gaps],
                            [8, 6, 0, 3, 19, 1, 7, -1, 1, 0, -1, *no_gaps]]
    assert call["qo_indptr"] == plan.qo_indptr and call["kv_indptr"] == plan.kv_indptr
    assert call["lse"] is False and call["mode"] == "custom"
    w.plan(*batch.plan_args())
    assert fake.plan_calls[-1].disable_split_kv is False


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_doc_ids_read_by_kv_row(backend):
    """A [total_kv] tensor is indexed by kv_row = kv_indptr[request] + kv_pos (on fa3 too, whose
    kernel reads the keys from the padded copy: the caller's rows, not the copy's)."""
    spec = shipped("document")
    batch = batch_of([4, 6, 2], [30, 6, 11], seed=6)
    ids = torch.cat([torch.arange(30) // 7, torch.arange(6) // 2, torch.arange(11) // 5]).to(torch.int32)
    check(spec, batch, {"doc_ids": ids}, label=f"document {backend}", backend=backend)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_fa3_runs_over_k_and_v_padded_between_requests(kv_layout):
    """fa3: the module's plan starts request b's keys at kv_indptr[b] + b x RAGGED_KV_GAP, and
    run() gives the kernel K / V with the keys there and zeros in the RAGGED_KV_GAP rows after
    each request (the last included); the caller's tensors are left as they were."""
    gap = RAGGED_KV_GAP
    kv_indptr = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    key_rows, gap_rows = padded_kv_rows(kv_indptr, 8)
    assert key_rows.dtype == gap_rows.dtype == torch.int64
    assert key_rows.tolist() == [0, 1, 2, 2 * gap + 3, 2 * gap + 4, 2 * gap + 5, 2 * gap + 6, 2 * gap + 7]
    assert gap_rows.tolist() == [*range(3, 3 + gap), *range(3 + gap, 3 + 2 * gap), *range(8 + 2 * gap, 8 + 3 * gap)]
    spec = shipped("causal")
    batch = batch_of([2, 0, 4], [3, 0, 5], kv_layout=kv_layout, seed=8)
    w, fake = make(spec, kv_layout=kv_layout, backend="fa3")
    w.plan(*batch.plan_args())
    seen = {}
    real = fake.ragged_run
    fake.ragged_run = lambda *a: seen.update(k=a[4].clone(), v=a[5].clone()) or real(*a)
    k_before, v_before = batch.k.clone(), batch.v.clone()
    w.run(batch.q, batch.k, batch.v)
    dim = 0 if kv_layout == "NHD" else 1
    for name, given in (("k", batch.k), ("v", batch.v)):
        padded = seen[name]
        assert padded.shape[dim] == 8 + 3 * gap and padded.is_contiguous()
        assert torch.equal(padded.index_select(dim, key_rows), given), name
        assert not padded.index_select(dim, gap_rows).any(), f"{name}: a gap row is not zero"
    assert torch.equal(batch.k, k_before) and torch.equal(batch.v, v_before)
    (call,) = fake.ragged_calls
    assert call["kv_first"] == [0, None, 2 * gap + 3]  # (request 1 has no queries: no work item)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_strided_views_are_accepted(backend):
    """v split off a wider tensor (as vLLM's MLA prefill does) and a q view with padded heads."""
    spec = shipped("causal")
    batch = batch_of([5, 2], [5, 30], qk=192, vo=128, seed=7)
    kv = torch.randn(35, HKV, 128 + 128).to(torch.bfloat16)
    v = kv[..., 128:]
    q_wide = torch.zeros(7, HQ + 2, 192, dtype=torch.bfloat16)
    q_wide[:, :HQ] = batch.q
    q = q_wide[:, :HQ]
    assert not v.is_contiguous() and not q.is_contiguous()
    w, _ = make(spec, 192, 128, backend=backend)
    w.plan(*batch.plan_args())
    out, lse = w.run(q, batch.k, v, return_lse=True)
    ref, ref_lse = reference_ragged(spec, batch.q, batch.k, v, batch.qo_indptr, batch.kv_indptr, return_lse=True)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.allclose(lse, ref_lse, atol=1e-4)


def test_mask_mode_choice():
    compiled = ("none", "causal", "custom")
    assert launch_mask_mode(shipped("causal"), compiled) == "causal"
    assert launch_mask_mode(shipped("alibi"), compiled) == "causal"
    for name in ("mm_prefix", "softcap", "sliding_window", "document", "prefix_lm", "chunked_local"):
        assert launch_mask_mode(shipped(name), compiled) == "custom", name
    everything = variantgen.parse_spec("name: everything\nmask: \"true\"\n")
    assert launch_mask_mode(everything, compiled) == "none"
    assert launch_mask_mode(shipped("causal"), ("custom",)) == "custom"
    with pytest.raises(LaunchError, match=r"spec `mm_prefix` needs 'custom' or 'custom'"):
        launch_mask_mode(shipped("mm_prefix"), ("causal",))
    # auto_mask_mode off: always kCustom
    batch = batch_of([4, 2], [4, 9])
    w, fake = make(shipped("causal"))
    w.auto_mask_mode = False
    w.plan(*batch.plan_args())
    w.run(batch.q, batch.k, batch.v)
    assert fake.ragged_calls[0]["mode"] == "custom"


def test_no_queries():
    w, fake = make(shipped("causal"))
    batch = batch_of([0, 0], [3, 0])
    w.plan(*batch.plan_args())
    assert fake.plan_calls == [] and w.plan_stats["launches"] == []
    out, lse = w.run(batch.q, batch.k, batch.v, return_lse=True)
    assert out.shape == (0, HQ, 64) and lse.shape == (0, HQ) and fake.ragged_calls == []


def test_plan_takes_spec_arguments_and_checks_them():
    spec = shipped("mm_prefix")
    batch = batch_of([3, 2], [3, 8])
    args = random_spec_args(spec, batch)
    w, _ = make(spec)
    w.plan(*batch.plan_args(), **args)  # checked, not used
    w.plan(*batch.plan_args(), causal_window_left=4)  # tensors are optional in plan()
    with pytest.raises(LaunchError, match=exact("plan(): `ranges`: expected shape [total_q=5, 2], got [4, 2]")):
        w.plan(*batch.plan_args(), ranges=args["ranges"][:4].contiguous())
    with pytest.raises(LaunchError, match=r"^plan\(\): unexpected argument\(s\) window; spec `mm_prefix` takes"):
        w.plan(*batch.plan_args(), window=3)
    with pytest.raises(LaunchError, match=r"^run\(\) called before plan\(\)"):  # the failed plan left nothing
        w.run(batch.q, batch.k, batch.v, **args)


@pytest.mark.parametrize("arch, backend, fake_class", [("9.0a", "fa3", FakeFa3RaggedModule),
                                                       ("8.0", "fa2", FakeRaggedModule)])
@pytest.mark.usefixtures("host_modules")
def test_make_wrapper_builds_a_ragged_module(monkeypatch, arch, backend, fake_class):
    """backend=None: fa3's ragged module on sm90 (192/128 included), fa2's elsewhere."""
    built = []

    def fake_build(config, cache, **kw):
        built.append(config)
        manifest = {"scalar_args": ["sm_scale", "v_scale"], "module_sha256": "x", "module_file": "x.so"}
        return BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix, manifest), key=None, built=True,
                           seconds=0.0)

    monkeypatch.setattr(build_mod, "build_module", fake_build)
    monkeypatch.setattr(build_mod, "load_module", lambda entry: fake_class(shipped("causal")))
    w = variantgen.make_wrapper(shipped("causal"), torch.empty(1 << 20, dtype=torch.uint8), head_dim_qk=192,
                                head_dim_vo=128, q_dtype=torch.bfloat16, kv_dtype="bf16", kind="ragged", arch=arch)
    assert isinstance(w, RaggedWrapper) and isinstance(w.module, fake_class)
    (config,) = built
    assert (config.kind, config.head_dim_qk, config.head_dim_vo, config.backend) == ("ragged", 192, 128, backend)
    batch = batch_of([2, 3], [2, 10], qk=192, vo=128)
    w.plan(*batch.plan_args())
    out = w.run(batch.q, batch.k, batch.v)
    ref = reference_ragged(shipped("causal"), batch.q, batch.k, batch.v, batch.qo_indptr, batch.kv_indptr)
    assert out.shape == (5, HQ, 128) and ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def mm():
    spec = shipped("mm_prefix")
    batch = batch_of([7, 5], [7, 30], qk=192, vo=128, seed=4)
    args = random_spec_args(spec, batch)
    w, fake = make(spec, 192, 128)
    return w, fake, batch, args


def test_run_before_plan(mm):
    w, _, batch, args = mm
    with pytest.raises(LaunchError, match=exact("run() called before plan(): call plan(qo_indptr, kv_indptr, "
                                                "num_qo_heads, num_kv_heads) first")):
        w.run(batch.q, batch.k, batch.v, **args)


@pytest.mark.parametrize("case, message", [
    ("qo_dtype", "plan(): `qo_indptr`: expected a 1-D torch.int32 tensor [batch + 1], got torch.int64 tensor of "
                 "shape [3]"),
    ("kv_list", "plan(): `kv_indptr`: expected a 1-D torch.int32 tensor [batch + 1], got list"),
    ("lengths", "plan(): inconsistent batch: `qo_indptr` has 3 entries and `kv_indptr` 4 (expected batch + 1 "
                "each, batch >= 1)"),
    ("empty", "plan(): inconsistent batch: `qo_indptr` has 1 entries and `kv_indptr` 1 (expected batch + 1 each, "
              "batch >= 1)"),
    ("offset", "plan(): `kv_indptr`[0]=2: expected 0 (rows are packed from the first row of the tensor)"),
    ("decreasing", "plan(): `qo_indptr` decreases at request 1: indptrs must be non-decreasing"),
    ("too_many_queries", "plan(): request 0 has 7 queries but only 6 keys; the queries must be the last qo_len "
                         "tokens of the request's KV (qo_len <= kv_len)"),
    ("heads", "plan(): num_kv_heads=0: expected a positive int below 2**31"),
    ("group", "plan(): num_qo_heads=4 is not a multiple of num_kv_heads=3"),
    ("split", "plan(): `disable_split_kv`='yes': expected True or False"),
])
def test_plan_errors(mm, case, message):
    w, _, batch, _ = mm
    i32 = dict(dtype=torch.int32)
    qo, kv, hq, hkv, kw = batch.qo_indptr, batch.kv_indptr, HQ, HKV, {}
    if case == "qo_dtype":
        qo = qo.long()
    elif case == "kv_list":
        kv = kv.tolist()
    elif case == "lengths":
        kv = torch.tensor([0, 7, 37, 40], **i32)
    elif case == "empty":
        qo, kv = torch.tensor([0], **i32), torch.tensor([0], **i32)
    elif case == "offset":
        kv = kv + 2
    elif case == "decreasing":
        qo = torch.tensor([0, 7, 5], **i32)
    elif case == "too_many_queries":
        kv = torch.tensor([0, 6, 36], **i32)
    elif case == "heads":
        hkv = 0
    elif case == "group":
        hkv = 3
    elif case == "split":
        kw = dict(disable_split_kv="yes")
    with pytest.raises(LaunchError, match=exact(message)):
        w.plan(qo, kv, hq, hkv, **kw)


@pytest.mark.parametrize("case, message", [
    ("q_dtype", "run(): `q`: expected dtype torch.bfloat16 (the wrapper was built for it), got torch.float16"),
    ("q_shape", "run(): `q`: expected shape [12, 4, 192] [total_q, num_qo_heads, head_dim_qk], got [12, 4, 128]"),
    ("k_shape", "run(): `k`: expected shape [37, 2, 192] [total_kv, num_kv_heads, head_dim_qk], got [36, 2, 192]"),
    ("v_head_dim", "run(): `v`: expected shape [37, 2, 128] [total_kv, num_kv_heads, head_dim_vo], got "
                   "[37, 2, 192]"),
    ("v_dtype", "run(): `v`: expected dtype torch.bfloat16 (the wrapper was built for it), got torch.float32"),
    ("k_list", "run(): `k`: expected a tensor [total_kv, num_kv_heads, head_dim_qk], got list"),
    ("k_device", "run(): `k` is on meta, expected cpu"),
    ("v_last_dim", "run(): `v` must have a contiguous last dimension (stride (1, 37, 74))"),
    ("q_misaligned", "run(): `q`: rows must start at 16-byte boundaries (data pointer and strides [772, 193, 1] "
                     "in multiples of 8 elements); call .contiguous()"),
    ("out_shape", "run(): `out`: expected shape [12, 4, 128], got [12, 4, 192]"),
    ("out_strided", "run(): `out` must be contiguous (the kernel writes rows of num_qo_heads * head_dim_vo "
                    "elements back to back; got strides [1024, 256, 1])"),
    ("return_lse", "run(): `return_lse`=1: expected True or False"),
    ("missing", "run(): missing tensor argument `ranges` (int32, shape ['total_q', 2]: inclusive absolute key span "
                "[start, end] each query token sees; (-1, -1) for none)"),
    ("unknown", "run(): unexpected argument(s) bogus; spec `mm_prefix` takes: ranges, causal_window_left, "
                "range_window_left (plus q_scale, k_scale, v_scale, out, return_lse in run())"),
])
def test_run_errors(mm, case, message):
    w, _, batch, args = mm
    w.plan(*batch.plan_args())
    q, k, v, kw = batch.q, batch.k, batch.v, dict(args)
    if case == "q_dtype":
        q = q.half()
    elif case == "q_shape":
        q = q[..., :128]
    elif case == "k_shape":
        k = k[:36]
    elif case == "v_head_dim":
        v = k
    elif case == "v_dtype":
        v = v.float()
    elif case == "k_list":
        k = k.tolist()
    elif case == "k_device":
        k = torch.empty(k.shape, dtype=k.dtype, device="meta")
    elif case == "v_last_dim":
        v = v.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    elif case == "q_misaligned":
        q = torch.zeros(12, 4, 193, dtype=torch.bfloat16)[..., :192]
    elif case == "out_shape":
        kw["out"] = torch.empty(12, 4, 192, dtype=torch.bfloat16)
    elif case == "out_strided":
        kw["out"] = torch.empty(12, 8, 128, dtype=torch.bfloat16)[:, ::2]
    elif case == "return_lse":
        kw["return_lse"] = 1
    elif case == "missing":
        del kw["ranges"]
    elif case == "unknown":
        kw["bogus"] = 1
    with pytest.raises(LaunchError, match=exact(message)):
        w.run(q, k, v, **kw)


def test_hnd_shapes_in_errors():
    spec = shipped("causal")
    batch = batch_of([2], [5], kv_layout="HND")
    w, _ = make(spec, kv_layout="HND")
    w.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match=exact(
            "run(): `k`: expected shape [2, 5, 64] [num_kv_heads, total_kv, head_dim_qk] (HND), got [5, 2, 64]")):
        w.run(batch.q, batch.k.transpose(0, 1), batch.v)
    w.run(batch.q, batch.k, batch.v)


def test_scales_refused_without_qkv_scales(spec_from):
    spec = spec_from("""
        name: noscale
        mask: kv_pos <= q_pos
        scales: {qkv_scales: false}
    """)
    w, _ = make(spec)
    batch = batch_of([2], [5])
    w.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match="q_scale/k_scale/v_scale are not accepted"):
        w.run(batch.q, batch.k, batch.v, k_scale=2.0)


# ----------------------------------------------------------------------------- real compile


@pytest.mark.nvcc
def test_build_a_real_ragged_module(vg_env, toolchain):
    """hd 192/128 with one mask mode (the CPU box compiles 3 kernel units + host code)."""
    from variantgen.build import builder as build
    from variantgen.build.cache import Cache

    vg_env.set(VARIANTGEN_BUILD_JOBS="2")
    config = ragged_config(shipped("softcap"), 192, 128, mask_modes=("custom",))
    result = build.build_module(config, Cache(vg_env.cache_dir))
    assert result.built and result.entry.module_path.read_bytes()[:4] == b"\x7fELF"
    assert result.entry.manifest["config"]["kind"] == "ragged"
    nm = subprocess.run(["nm", "-C", "-u", str(result.entry.module_path)], capture_output=True, text=True)
    if nm.returncode == 0:
        undefined = [line for line in nm.stdout.splitlines() if "Dispatched" in line]
        assert not undefined, f"kernels the host code names but the module lacks: {undefined}"


def test_fa3_runs_a_single_request_over_the_callers_k_and_v():
    """One request has no neighbour to read into (its tiles past the last key lie past the
    tensor's end, which the TMA load fills with zeros): run() passes the caller's K and V."""
    spec = shipped("causal")
    batch = batch_of([5], [40], seed=9)
    w, fake = make(spec, backend="fa3")
    w.plan(*batch.plan_args())
    seen = {}
    real = fake.ragged_run
    fake.ragged_run = lambda *a: seen.update(k=a[4], v=a[5]) or real(*a)
    out = w.run(batch.q, batch.k, batch.v)
    assert seen["k"] is batch.k and seen["v"] is batch.v
    check(spec, batch, {}, label="causal fa3 one request", backend="fa3")
    assert torch.isfinite(out).all()
