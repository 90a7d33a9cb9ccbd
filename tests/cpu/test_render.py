"""Rendering FA2 module sources: hooks, sanitising, argument order, config validation."""

from __future__ import annotations

import collections
import re

import jinja2
import pytest
from conftest import SPEC_FILES, SPECS_DIR

import variantgen
from variantgen.abi import table as plan_abi
from variantgen.codegen import expressions as codegen
from variantgen.codegen import render
from variantgen.codegen.render import ModuleConfig, kernel_args, render_module
from variantgen.routing.capabilities import FA3

FA3_WHY = FA3.arch_why


def config(spec, **overrides) -> ModuleConfig:
    kw = dict(head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", arch="9.0a")
    kw.update(overrides)
    return ModuleConfig(spec, **kw)


def shipped(name: str):
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


def all_text(module) -> str:
    return "\n".join(module.files.values())


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Every render test reads the checkout's templates and a private cache dir."""


# ----------------------------------------------------------------------------- hooks


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_every_shipped_spec_renders(path):
    spec = variantgen.load_spec(path)
    module = render_module(config(spec))
    variant = module.files["variant.cuh"]
    assert "REGISTER_LOGITS_MASK" in variant
    assert ("REGISTER_LOGITS_TRANSFORM" in variant) == (spec.logits is not None)
    assert "window_left =" in variant
    assert codegen.emit_mask(spec).broken().replace("\n", "\n        ") in variant  # return's continuation lines
    if spec.logits is not None:
        assert codegen.emit_logits_folded(spec).code in variant  # as the kernel runs it (logits_fold.py)
    assert f"struct {render.struct_name(spec)}" in variant
    # on sm90 one kernel unit per CTA tile (every run() code in it, FlashInfer's KV tile pinned),
    # plus the binding and the launch builder
    assert module.compile_units == ("binding.cu", "plan.cu",
                                    *(f"paged_kernel_cta{cta}.cu" for cta in render.FA2_CTA_TILES_Q))
    assert set(module.compile_units) <= set(module.files)
    assert {"variant.cuh", "batch_prefill_config.inc"} <= set(module.files)
    assert "{{" not in all_text(module) and "{%" not in all_text(module)
    assert len(module.source_digest()) == 64 and len(module.template_digest) == 64


def test_learned_sink_in_every_kernel_kind(spec_from):
    """fa2 prefill / ragged: an m/d update (first KV chunk only) and an output transform with its
    scale; fa2 decode: the output transform joins the sink once per thread (first chunk only);
    fa3: the constructor computes the head's sink and the updater joins it. Specs without a sink
    render none of it."""
    spec = spec_from("name: s\ntensors:\n  b: {dtype: float32, shape: [batch, num_kv_heads]}\nmask: kv_pos <= q_pos\n"
                     "sink: b[request, kv_head] + float(qo_len)\n")
    for kind in ("prefill", "ragged"):
        variant = render_module(config(spec, kind=kind)).files["variant.cuh"]
        assert "REGISTER_M_D_UPDATE(params, kv_tile_idx, qo_head_idx, m, d, scale, {" in variant
        assert "if (kv_tile_idx == 0) {" in variant
        assert "return output * scale * d_rcp * get_v_scale(params);" in variant
        heads = "int32_t(params.num_kv_heads)" if kind == "ragged" else "int32_t(params.paged_kv.num_heads)"
        assert f"const int32_t kv_head = int32_t(qo_head_idx) / (int32_t(params.num_qo_heads) / {heads});" in variant
        assert "log2_sink = float((params.b[(request) * " in variant
        assert "+ float(req_qo_len))) * math::log2e;" in variant
    decode = render_module(config(spec, kind="decode")).files["variant.cuh"]
    assert "REGISTER_M_D_UPDATE" not in decode
    assert "if (!params.partition_kv || params.kv_tile_indices[batch_idx] == 0) {" in decode
    assert "bool vg_sink_joined;" in decode and "vg_sink_joined = false;" in decode
    fa3 = render_module(config(spec, backend="fa3")).files["variant.cuh"]
    assert "struct VgSinkSoftmax : flashinfer::OnlineSoftmax<NUM_ROWS_PER_THREAD, /*WITH_SCALE=*/true>" in fa3
    # one variant template serves the plain and the masked launches
    assert fa3.count("return VgSinkSoftmax<NUM_ROWS_PER_THREAD>(sm_scale_log2, log2_sink);") == 1
    assert "const int32_t kv_head = int32_t(kv_head_idx);" in fa3
    for kind, backend in (("prefill", "fa2"), ("decode", "fa2"), ("prefill", "fa3")):
        plain = render_module(config(shipped("causal"), kind=kind, backend=backend)).files["variant.cuh"]
        assert "sink" not in plain.lower(), (kind, backend)


def test_query_clamp_guards_padding_lanes():
    variant = render_module(config(shipped("causal"))).files["variant.cuh"]
    assert "qo_idx < qo_len ? qo_idx : qo_len - 1" in variant
    assert "const int32_t q_pos = q_pos_base + q_local;" in variant
    assert "const int32_t kv_pos = key_pos(kv_local);" in variant
    # key_pos: through the page list's table, or past the gaps a page list skips
    assert "vg::vg_listed_key_pos(page_table, list_page_size, i)" in variant
    assert "vg::vg_key_pos(kv_pos_base, i, gap_at, gap_len)" in variant


def test_transform_only_with_logits():
    assert "REGISTER_LOGITS_TRANSFORM" not in render_module(config(shipped("sliding_window"))).files["variant.cuh"]
    softcap = render_module(config(shipped("softcap"))).files["variant.cuh"]
    assert "REGISTER_LOGITS_TRANSFORM" in softcap
    assert "vg_tanh(" in softcap and "arg_soft_cap" in softcap


def test_locals_only_for_used_builtins():
    causal = render_module(config(shipped("causal"))).files["variant.cuh"]
    assert "const int32_t q_row =" not in causal and "const int32_t kv_row =" not in causal
    document = render_module(config(shipped("document"))).files["variant.cuh"]
    assert "const int32_t kv_row = kv_row_base + kv_pos;" in document
    assert "const int32_t q_kv_row = kv_row_base + q_pos;" in document


def test_mask_modes_and_dtypes(spec_from):
    spec = spec_from("name: x\nmask: kv_pos <= q_pos\n")
    module = render_module(config(spec, kv_dtype="fp8_e4m3", o_dtype="fp16", mask_modes=("custom",),
                                  head_dim_qk=64, head_dim_vo=64))
    assert module.compile_units == ("binding.cu", "plan.cu", "paged_kernel_cta16.cu", "paged_kernel_cta64.cu",
                                    "paged_kernel_cta128.cu")
    assert all(module.files[f"paged_kernel_cta{cta}.cu"].count("false, MaskMode::kCustom,") == 1
               for cta in (16, 64, 128))
    inc = module.files["batch_prefill_config.inc"]
    assert "using DTypeKV = __nv_fp8_e4m3;" in inc and "using DTypeO = half;" in inc
    assert "using DTypeQ = nv_bfloat16;" in inc
    assert "constexpr int HEAD_DIM_QK = 64;" in inc
    assert "MaskMode::kCustom" in inc and "MaskMode::kCausal" not in inc


def test_rendering_is_deterministic():
    a = render_module(config(shipped("mm_prefix")))
    b = render_module(config(shipped("mm_prefix")))
    assert a.files == b.files and a.source_digest() == b.source_digest()
    c = render_module(config(shipped("mm_prefix"), head_dim_qk=256, head_dim_vo=256))
    assert c.source_digest() != a.source_digest()


def test_uri_prefix_and_struct_name():
    cfg = config(shipped("mm_prefix"), kv_dtype="fp8_e5m2", arch="sm_100a")
    assert cfg.uri_prefix == "vg_mm_prefix_fa2_prefill_qbf16_kvfp8_e5m2_obf16_hd128x128_sm100a"
    assert cfg.arch_tag == "100a"
    assert render.struct_name(cfg.spec) == "VG_MmPrefix"
    assert cfg.describe()["arch"] == "10.0a"


# ----------------------------------------------------------------------------- argument order


def test_kernel_argument_order(spec_from):
    spec = spec_from(
        """
        name: order
        tensors:
          zeta: {dtype: float32, shape: [num_qo_heads]}
          alpha: {dtype: int32, shape: [total_kv]}
        scalars:
          win: {dtype: int, default: 4}
          cap: {dtype: float, default: 1.0}
          on_off: {dtype: bool, default: true}
        mask: "kv_pos <= q_pos and alpha[kv_row - 1] >= 0 and (on_off or win > 0)"
        logits: logits * cap + zeta[qo_head]
        """
    )
    module = render_module(config(spec))
    assert [(a.name, a.cpp_type) for a in module.tensor_args] == [
        ("zeta", "float"), ("alpha", "int32_t"), ("vg_meta", "int32_t")]
    assert [(a.name, a.cpp_type) for a in module.scalar_args] == [
        ("win", "int64_t"), ("cap", "double"), ("on_off", "bool"), ("sm_scale", "double"), ("v_scale", "double")]
    inc = module.files["batch_prefill_config.inc"]
    params = re.search(r"#define ADDITIONAL_FUNC_PARAMS (.*)", inc).group(1)
    # (as vg_arg_<name>: a spec's name never meets a local of FlashInfer's run function)
    assert params == (", ffi::Tensor vg_arg_zeta, ffi::Tensor vg_arg_alpha, ffi::Tensor vg_arg_vg_meta, "
                      "int64_t vg_arg_win, double vg_arg_cap, bool vg_arg_on_off, double vg_arg_sm_scale, "
                      "double vg_arg_v_scale")
    variant = module.files["variant.cuh"]
    # an offset row is clamped to its request's rows, from what the hook knows (no extra argument)
    assert "params.alpha[vg_request_row(kv_row - kv_pos, int64_t(kv_pos) - int32_t(1), req_kv_len)]" in variant
    assert "params.zeta[qo_head]" in variant  # in range by construction: no clamp


def test_no_v_scale_without_qkv_scales(spec_from):
    spec = spec_from("name: x\nmask: kv_pos <= q_pos\nscales: {qkv_scales: false}\n")
    tensors, scalars = kernel_args(spec)
    assert [a.name for a in tensors] == ["vg_meta"]
    assert [a.name for a in scalars] == ["sm_scale"]


def test_kernel_args_of_shipped_specs():
    tensors, scalars = kernel_args(shipped("mm_prefix"))
    assert [a.name for a in tensors] == ["ranges", "vg_meta"]
    assert [a.name for a in scalars] == ["causal_window_left", "range_window_left", "sm_scale", "v_scale"]


# ----------------------------------------------------------------------------- codegen


def test_codegen_of_constants_and_operators(spec_from):
    spec = spec_from(
        "name: x\nscalars:\n  d: {dtype: int, default: 3}\n"
        "mask: 'kv_pos // d == q_pos % d and -5 < kv_pos and not (kv_pos / 2 > 1.5e-07) and abs(-kv_pos) >= 0'\n"
    )
    code = codegen.emit_mask(spec).code
    # (by a scalar: the variant's divisor member, a multiply-shift set once per CTA)
    assert "vg_floordiv_by(kv_pos, vg_divisor0)" in code and "vg_mod_by(q_pos, vg_divisor0)" in code
    assert "int32_t(-5LL)" in code
    assert "vg_fdiv_rn(float(kv_pos), float(int32_t(2)))" in code  # (IEEE-rounded in a mask)
    assert "1.5e-07f" in code and "(!" in code and "vg_abs((-kv_pos))" in code
    assert codegen.emit_mask(spec).builtins == {"kv_pos", "q_pos"}


def test_codegen_bit(spec_from):
    spec = spec_from("name: x\ntensors:\n  b: {dtype: int32, shape: [total_q, 2]}\n"
                     "mask: kv_pos <= q_pos and bit(b[q_row, 1], (q_pos - kv_pos) % 32)\n")
    code = codegen.emit_mask(spec).code
    assert "vg_bit(params.b[(q_row) * int32_t(2) + int32_t(1)], vg_mod((q_pos - kv_pos), int32_t(32)))" in code
    variant = render_module(ModuleConfig(spec, 64, 64, "fp16", "fp16", "fp16", "8.0")).files["variant.cuh"]
    helpers = render.static_source("common/vg_helpers.cuh")
    assert "__device__ __forceinline__ bool vg_bit(int32_t x, int32_t i)" in helpers
    assert '#include "vg_helpers.cuh"' in variant


def test_codegen_index_flattening(spec_from):
    spec = spec_from("name: x\ntensors:\n  r: {dtype: int32, shape: [total_q, 2]}\nmask: r[q_row, 1] <= kv_pos\n")
    snippet = codegen.emit_mask(spec)
    assert snippet.code == "(params.r[(q_row) * int32_t(2) + int32_t(1)] <= kv_pos)"
    assert snippet.builtins == {"q_row", "kv_pos"}
    spec = spec_from("name: x\ntensors:\n  r: {dtype: int32, shape: [total_q, 2]}\nmask: r[q_row, q_idx] <= kv_pos\n")
    assert "vg_clamp(q_idx, int32_t(2))" in codegen.emit_mask(spec).code
    spec = spec_from("name: x\ntensors:\n  r: {dtype: float32, shape: [total_kv, num_kv_heads, 3]}\n"
                     "mask: r[kv_row, kv_head, 2] > 0.0\n")
    assert codegen.emit_mask(spec).code == ("(params.r[((kv_row) * int32_t(params.paged_kv.num_heads) + kv_head) "
                                            "* int32_t(3) + int32_t(2)] > 0.0f)")


OFFSETS_SPEC = """\
name: offsets
tensors:
  kt: {dtype: int32, shape: [total_kv]}
  qt: {dtype: int32, shape: [total_q, 2]}
  ht: {dtype: float32, shape: [num_qo_heads]}
scalars:
  lag: {dtype: int, default: 1}
mask: kv_pos <= q_pos and kv_pos >= qt[q_row + 1, 0] and kt[kv_row - lag] == kt[q_kv_row - 2]
logits: logits + ht[qo_head + 1]
"""
OFFSET_CODE = {  # what each index becomes in every hook (FA2 and FA3 spell the arguments differently)
    "qt": "qt[(vg_request_row(q_row - q_idx, int64_t(q_idx) + int32_t(1), req_qo_len)) * int32_t(2) + int32_t(0)]",
    "kt_kv": "kt[vg_request_row(kv_row - kv_pos, int64_t(kv_pos) - arg_lag, req_kv_len)]",
    "kt_q": "kt[vg_request_row(q_kv_row - q_pos, int64_t(q_pos) - int32_t(2), req_kv_len)]",
}


@pytest.mark.parametrize(("backend", "kind"), [("fa2", "prefill"), ("fa2", "decode"), ("fa2", "ragged"),
                                               ("fa3", "prefill")])
def test_offset_rows_in_every_kernel(spec_from, backend, kind):
    """Each hook clamps an offset row to its request's rows from the locals it defines."""
    spec = spec_from(OFFSETS_SPEC)
    module = render_module(config(spec, backend=backend, kind=kind))
    variant = module.files["variant.cuh"]
    args = "params.additional_params." if backend == "fa3" else "params."
    for code in OFFSET_CODE.values():
        assert args + code in variant, code
    heads = "params.additional_params.vg_num_qo_heads" if backend == "fa3" else "params.num_qo_heads"
    assert f"{args}ht[vg_clamp(int64_t(qo_head) + int32_t(1), int32_t({heads}))]" in variant
    # the key/value head count as each kernel's params hold it
    kv_spec = spec_from("name: kvh\ntensors:\n  g: {dtype: float32, shape: [num_kv_heads]}\n"
                        "mask: g[kv_head + 1] > 0.0\n")
    kv_heads = {"fa3": "params.additional_params.vg_num_kv_heads", "ragged": "params.num_kv_heads"}.get(
        backend if backend == "fa3" else kind, "params.paged_kv.num_heads")
    kv_variant = render_module(config(kv_spec, backend=backend, kind=kind)).files["variant.cuh"]
    assert f"vg_clamp(int64_t(kv_head) + int32_t(1), int32_t({kv_heads}))" in kv_variant
    for local in ("const int32_t q_idx =", "const int32_t q_row =", "const int32_t kv_row =",
                  "const int32_t q_kv_row =", "const int32_t kv_pos ="):
        assert local in variant, local
    assert "req_qo_len = meta[VG_META_REQ_QO_LEN];" in variant and "req_kv_len = meta[VG_META_REQ_KV_LEN];" in variant
    assert [a.name for a in module.scalar_args] == ["lag", "sm_scale", "v_scale"]


def test_offset_rows_in_the_planner_row_kernel(spec_from):
    """The interval planner evaluates row-only bounds (here qt[q_row + 1, 0]) with the same clamp."""
    from variantgen.planning import intervals, rowplan

    spec = spec_from(OFFSETS_SPEC)
    assert intervals.analyze(spec).planner_ready
    text = rowplan.render_planner(rowplan.PlannerConfig(spec, "9.0a")).files["planner.cu"]
    # (ints in int64 there: its bounds are the mask rewritten, which may leave the int32 range)
    assert ("p.spec.qt[(vg_request_row(int64_t(q_row) - int64_t(q_idx), int64_t(q_idx) + int64_t(1), "
            "int64_t(req_qo_len))) * int32_t(2) + int64_t(0)]") in text
    assert "const int32_t q_idx = int32_t(row - p.q_start[request]);" in text
    assert "const int32_t req_qo_len =" in text


# ----------------------------------------------------------------------------- sanitising


EVIL_TEXTS = ["*/ #include <evil.h> /*", "line one\n#error injected\nline three", "\\", "??/", "\u202e rtl"]


def test_description_and_docs_never_reach_the_sources(spec_from):
    spec = spec_from(
        """
        name: evil
        description: "MARK_DESC */ #include <evil.h> /*\\n#error MARK_DESC_LINE\\n"
        tensors:
          ids: {dtype: int32, shape: [total_kv], doc: "MARK_TDOC */ asm(\\"MARK_ASM\\");"}
        scalars:
          w: {dtype: int, default: 1, doc: "MARK_SDOC\\n#define x"}
        mask: kv_pos <= q_pos and ids[kv_row] >= w  # MARK_COMMENT
        """
    )
    text = all_text(render_module(config(spec)))
    for marker in ("MARK_DESC", "MARK_DESC_LINE", "MARK_TDOC", "MARK_SDOC", "MARK_COMMENT", "evil.h", "MARK_ASM",
                   "#error", "#define x"):
        assert marker not in text, marker


@pytest.mark.parametrize("how", ["file", "path"])
def test_spec_file_name_never_reaches_the_sources(spec_text, how):
    """A module is what its kernel is made of: where the spec file lives (or a hostile name)
    is not part of its sources, so the same content under any name has one URI."""
    text = "name: x\nmask: kv_pos <= q_pos\n"
    if how == "file":  # a file name can hold anything but '/' and NUL
        spec = variantgen.load_spec(spec_text(text, name="a *\\ b\n#error BROKEN\\\n.yaml"))
    else:
        spec = variantgen.parse_spec(text, "dir/a *\r\n#error BROKEN /* x \\")
    plain = variantgen.parse_spec(text)
    got, want = render_module(config(spec)), render_module(config(plain))
    assert got.files == want.files and got.source_digest() == want.source_digest()
    assert "BROKEN" not in all_text(got)


def test_expression_comments_come_from_the_tree(spec_from):
    spec = spec_from("name: x\nmask: kv_pos <= q_pos   # MARK_TRAILING\n")
    variant = render_module(config(spec)).files["variant.cuh"]
    assert "MARK_TRAILING" not in variant
    assert "// mask:   kv_pos <= q_pos\n//   i.e.  (kv_pos <= q_pos)\n" in variant


@pytest.mark.parametrize("text", EVIL_TEXTS)
def test_comment_text_is_one_safe_line(text):
    out = codegen.comment_text(text)
    assert "\n" not in out and "\r" not in out
    assert "*/" not in out and "/*" not in out and "\\" not in out
    assert all(32 <= ord(ch) < 127 for ch in out)


def test_comment_text_truncates():
    out = codegen.comment_text("x" * 1000)
    assert out == "x" * 300 + " ..."


def test_spec_names_reach_cpp_only_as_checked_identifiers(spec_from):
    spec = spec_from("name: a_b9\ntensors:\n  t_1: {dtype: int32, shape: [batch]}\nmask: t_1[request] > 0\n")
    module = render_module(config(spec))
    idents = set(re.findall(r"params\.([A-Za-z_][A-Za-z0-9_]*)", all_text(module)))
    assert "t_1" in idents
    assert render.struct_name(spec) == "VG_AB9"


# ----------------------------------------------------------------------------- templates


def test_strict_undefined_raises():
    env = render.environment()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("x = {{ not_defined }};").render()
    with pytest.raises(jinja2.UndefinedError):
        env.get_template("fa2/variant.cuh.jinja").render({"vg_version": "0"})


def test_missing_context_variable_raises(monkeypatch):
    real = render.environment

    class Shim:
        def __init__(self, env):
            self.env = env

        def get_template(self, name):
            template = self.env.get_template(name)

            class Wrapped:
                def render(self, ctx, **kw):
                    ctx = {k: v for k, v in ctx.items() if k != "struct_name"}
                    return template.render(ctx, **kw)

            return Wrapped()

    monkeypatch.setattr(render, "environment", lambda: Shim(real()))
    with pytest.raises(jinja2.UndefinedError, match="struct_name"):
        render_module(config(shipped("causal")))


def test_template_files_listed():
    paths = render.template_files()
    names = [f"{p.parent.name}/{p.name}" for p in paths]
    assert "fa2/variant.cuh.jinja" in names and "common/helpers.cuh.jinja" in names
    assert paths == sorted(paths)


# ----------------------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"q_dtype": "fp8_e4m3"}, "q_dtype=fp8_e4m3: fp8 query is not supported by fa2 (its tensor-core path needs "
                                  "16-bit queries); use bf16 or fp16 queries with an fp8 KV cache"),
        ({"o_dtype": "fp8_e5m2"}, "o_dtype=fp8_e5m2: fp8 output is not supported by fa2"),
        ({"head_dim_qk": 96, "head_dim_vo": 96}, "head_dim_qk=96, head_dim_vo=96: fa2 prefill modules support head "
                                                 "dims 64, 128, 256 (qk/vo where they differ)"),
        ({"head_dim_vo": 64}, "head_dim_qk=128, head_dim_vo=64: fa2 prefill modules support head dims 64, 128, 256 "
                              "(qk/vo where they differ)"),
        ({"head_dim_qk": 192, "head_dim_vo": 128, "kind": "ragged"}, None),
        ({"head_dim_qk": 192, "head_dim_vo": 128}, "head_dim_qk=192, head_dim_vo=128: fa2 prefill modules support "
                                                   "head dims 64, 128, 256 (qk/vo where they differ)"),
        ({"kind": "append"}, "kind='append': expected one of ['prefill', 'ragged', 'decode']"),
        ({"backend": "fa3", "kind": "decode"}, "kind='decode': backend 'fa3' has no decode module; its decode runs its "
                                               "prefill module (kind='prefill')"),
        ({"backend": "fa3", "kind": "ragged"}, None),
        ({"backend": "fa3", "kind": "ragged", "head_dim_qk": 192, "head_dim_vo": 128}, None),
        ({"backend": "fa3", "head_dim_qk": 192, "head_dim_vo": 128}, "head_dim_qk=192, head_dim_vo=128: fa3 prefill "
                                                                     "modules support head dims 64, 128, 256 (qk/vo "
                                                                     "where they differ)"),
        ({"backend": "fa3", "arch": "8.0"}, "arch=8.0: fa3 modules run on sm90 (Hopper) only, compiled for 9.0a "
         f"({FA3_WHY})"),
        ({"backend": "fa3", "arch": "9.0a", "kv_dtype": "fp8_e4m3"}, "kv_dtype=fp8_e4m3: fa3 variant modules need "
                                                                     "kv_dtype == q_dtype (bf16); use backend fa2 for "
                                                                     "an fp8 KV cache"),
        ({"backend": "fa3", "arch": "9.0a"}, None),
        ({"backend": "fa3", "o_dtype": "fp16"}, "o_dtype=fp16: fa3 variant modules write o in the query dtype (bf16); "
                                                "use backend fa2 for another output dtype"),
        ({"arch": "7.5"}, "arch=7.5: fa2 needs sm80 or newer"),
        ({"arch": "hopper"}, "arch='hopper': expected a compute capability such as 8.0, 9.0a or 10.0a"),
        ({"kv_dtype": "float32"}, "kv_dtype='float32': expected one of ['bf16', 'fp16', 'fp8_e4m3', 'fp8_e5m2']"),
        ({"mask_modes": ()}, "mask_modes=(): expected a non-empty subset of ['none', 'causal', 'custom']"),
        ({"mask_modes": ("causal", "sliding")}, "mask_modes=('causal', 'sliding'): expected a non-empty subset of "
                                                "['none', 'causal', 'custom']"),
        ({"backend": "fa4"}, "backend='fa4': expected one of ['fa2', 'fa3']"),
    ],
)
def test_module_config_validation(overrides, message):
    if message is None:  # a valid combination
        assert config(shipped("causal"), **overrides).problems() == []
        return
    with pytest.raises(ValueError) as info:
        config(shipped("causal"), **overrides)
    assert str(info.value) == message


def test_backend_not_allowed_by_spec(spec_from):
    spec = spec_from("name: x\nmask: kv_pos <= q_pos\nbackends: [fa3]\n")
    with pytest.raises(ValueError, match=re.escape("backend='fa2': spec `x` allows only ['fa3']")):
        config(spec)


def test_problems_lists_everything():
    cfg = config(shipped("causal"))
    object.__setattr__(cfg, "q_dtype", "fp8_e4m3")
    object.__setattr__(cfg, "arch", "7.0")
    problems = cfg.problems()
    assert len(problems) == 2 and problems[0].startswith("q_dtype=fp8_e4m3") and problems[1] == (
        "arch=7.0: fa2 needs sm80 or newer")


# ----------------------------------------------------------------------------- static sources

MODULE_KINDS = [("fa2", "prefill"), ("fa2", "ragged"), ("fa2", "decode"), ("fa3", "prefill"), ("fa3", "ragged")]
# Included by name from FlashInfer's csrc folder (the build's include path), not from the module.
# FlashInfer's csrc files the module includes by name: TVM-FFI's helpers, and its batch-decode host
# code, which decode_exact_host.cu compiles a second time for the exact variant
EXTERNAL_LOCAL_INCLUDES = {"tvm_ffi_utils.h", "batch_decode.cu"}


@pytest.mark.parametrize(("backend", "kind"), MODULE_KINDS)
def test_every_local_include_is_a_file_of_the_module(backend, kind):
    """A module's sources are self-contained: each `#include "x"` names one of its files (the
    static sources are copied in), or FlashInfer's / TVM-FFI's headers (a folder, or csrc)."""
    module = render_module(config(shipped("mm_prefix"), backend=backend, kind=kind))
    for name, text in module.files.items():
        for header in re.findall(r'#include "([^"]+)"', text):
            assert header in module.files or "/" in header or header in EXTERNAL_LOCAL_INCLUDES, (name, header)


# the launch builder (templates/plan/), in every paged-prefill module
PLAN_FILES = {name: f"plan/{name}" for name in (*render.PLAN_HEADERS, "plan.cu")}
STATIC_FILES = {
    ("fa2", "prefill"): {"vg_helpers.cuh": "common/vg_helpers.cuh", "config_prelude.cuh": "fa2/config_prelude.cuh",
                         "kernel_params.cuh": "fa2/kernel_params.cuh", "prefill_plan.cuh": "fa2/prefill_plan.cuh",
                         "binding.cu": "fa2/paged_binding.cu", "pinned_kv_tile.cuh": "fa2/pinned_kv_tile.cuh",
                         **PLAN_FILES},
    ("fa2", "ragged"): {"vg_helpers.cuh": "common/vg_helpers.cuh", "config_prelude.cuh": "fa2/config_prelude.cuh",
                        "kernel_params.cuh": "fa2/kernel_params.cuh", "prefill_plan.cuh": "fa2/prefill_plan.cuh",
                        "pinned_kv_tile.cuh": "fa2/pinned_kv_tile.cuh"},
    ("fa2", "decode"): {"vg_helpers.cuh": "common/vg_helpers.cuh", "config_prelude.cuh": "fa2/config_prelude.cuh",
                        "kernel_params.cuh": "fa2/kernel_params.cuh", "binding.cu": "fa2/decode_binding.cu",
                        "read_indices.cuh": "plan/read_indices.cuh",
                        "decode_exact_host.cu": "fa2/decode_exact_host.cu"},
    ("fa3", "prefill"): {"vg_helpers.cuh": "common/vg_helpers.cuh", "cutlass_prelude.cuh": "fa3/cutlass_prelude.cuh",
                         "kernel_params.cuh": "fa3/kernel_params.cuh", "fill_params.cuh": "fa3/fill_params.cuh",
                         "epilogue_barrier.cuh": "fa3/epilogue_barrier.cuh", "run.cuh": "fa3/run.cuh",
                         "plain_variant.cuh": "fa3/plain_variant.cuh", **PLAN_FILES},
    ("fa3", "ragged"): {"vg_helpers.cuh": "common/vg_helpers.cuh", "cutlass_prelude.cuh": "fa3/cutlass_prelude.cuh",
                        "kernel_params.cuh": "fa3/kernel_params.cuh", "fill_params.cuh": "fa3/fill_params.cuh",
                        "epilogue_barrier.cuh": "fa3/epilogue_barrier.cuh", "ragged_run.cuh": "fa3/ragged_run.cuh",
                        "plain_variant.cuh": "fa3/plain_variant.cuh", "fa3_worklist.h": "plan/fa3_worklist.h"},
}


def test_module_kinds_are_the_table():
    assert set(MODULE_KINDS) == set(render.RENDERERS) == set(variantgen.routing.capabilities.HEAD_DIMS)


@pytest.mark.parametrize("dims", [(128, 128), (192, 128)], ids=["hd128", "hd192x128"])
def test_fa3_ragged_renders_one_kernel_unit_per_mask_mode(dims):
    """fa3 ragged: our plan and ragged_run binding (no FlashInfer host code), one kernel unit per
    mask mode; custom is the masked variant in a non-causal launch; the variant is the paged
    module's."""
    spec = shipped("mm_prefix")
    module = render_module(config(spec, backend="fa3", kind="ragged", head_dim_qk=dims[0], head_dim_vo=dims[1]))
    assert module.compile_units == ("binding.cu", "ragged_kernel_none.cu", "ragged_kernel_causal.cu",
                                    "ragged_kernel_custom.cu") and module.host_sources == ()
    text = "\n".join(module.files.values())
    assert "{{" not in text and "{%" not in text
    cfg = module.files["batch_prefill_sm90_config.inc"]
    assert f"constexpr int HEAD_DIM_QK = {dims[0]};" in cfg and f"constexpr int HEAD_DIM_VO = {dims[1]};" in cfg
    binding = module.files["binding.cu"]
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, VgRaggedPlan);" in binding
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(ragged_run, VariantgenRaggedRun);" in binding
    assert "LaunchRagged<MaskMode::kNone, VG_MmPrefixMasked>(params, enable_pdl, stream);" in binding  # custom
    assert (f"BatchPrefillWithRaggedKVCacheDispatched<\n    {dims[0]}, {dims[1]}, MaskMode::kCausal, "
            "/*LEFT_SLIDING_WINDOW=*/false,") in module.files["ragged_kernel_causal.cu"]
    paged = render_module(config(spec, backend="fa3"))
    if dims == (128, 128):
        assert module.files["variant.cuh"] == paged.files["variant.cuh"]
    assert module.tensor_args == paged.tensor_args and module.scalar_args == paged.scalar_args
    one = render_module(config(spec, backend="fa3", kind="ragged", mask_modes=("causal",)))
    assert one.compile_units == ("binding.cu", "ragged_kernel_causal.cu")


@pytest.mark.parametrize(("backend", "kind"), MODULE_KINDS)
def test_static_sources_are_copied_as_they_are(backend, kind):
    """FlashInfer's habit: static C++ lives in real files, copied byte for byte; Jinja renders
    only the config, the variant and the per-mode instantiations."""
    module = render_module(config(shipped("softcap"), backend=backend, kind=kind))
    for name, source in STATIC_FILES[backend, kind].items():
        assert module.files[name] == render.static_source(source), name
        assert "{{" not in module.files[name] and "{%" not in module.files[name]
    rendered = set(module.files) - set(STATIC_FILES[backend, kind])
    # rendered: the variant, the config, the instantiations, the plan ABI's generated header and the
    # installed FlashInfer's facts
    generated = ("variant.cuh", "binding.cu", "vg_plan_abi.h", "fi_facts.h")
    assert all(name in generated or name.endswith((".inc", ".cu")) for name in rendered), rendered


def test_no_template_without_jinja():
    """A template of common/, fa2/ or fa3/ that renders nothing is a static file instead (the
    planner's meta.inc and the fa3 scheduler belong to the planning code)."""
    root = render.template_root()
    for folder in ("common", "fa2", "fa3"):
        for path in sorted((root / folder).glob("*.jinja")):
            if path.name == "meta.inc.jinja":
                continue
            text = re.sub(r"\{#.*?#\}", "", path.read_text(), flags=re.S)
            assert "{{" in text or "{%" in text, f"{folder}/{path.name} has no Jinja: make it a static file"
    for path in root.glob("*/*"):
        if path.suffix in (".cuh", ".cu"):
            assert "{{" not in path.read_text() and "{%" not in path.read_text(), path


def test_the_template_digest_covers_the_static_sources(tmp_path, vg_env):
    import shutil

    before = render.template_digest("fa2")
    copy = tmp_path / "templates"
    shutil.copytree(render.template_root(), copy)
    (copy / "fa2" / "kernel_params.cuh").write_text((copy / "fa2" / "kernel_params.cuh").read_text() + "// edited\n")
    vg_env.set(VARIANTGEN_TEMPLATE_DIR=copy)
    assert render.template_digest("fa2") != before
    assert render_module(config(shipped("causal"))).files["kernel_params.cuh"].endswith("// edited\n")


def test_the_fa3_variants_are_one_template():
    variant = render_module(config(shipped("mm_prefix"), backend="fa3")).files["variant.cuh"]
    assert variant.count("struct VG_MmPrefixVariant {") == 1
    assert "template <bool MASKED, bool LISTED = false>" in variant
    assert "using VG_MmPrefix = VG_MmPrefixVariant<false>;" in variant
    assert "using VG_MmPrefixMasked = VG_MmPrefixVariant<true>;" in variant
    assert variant.count("if constexpr (MASKED) {") == 1 and variant.count("REGISTER_LOGITS_TRANSFORM") == 1


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_the_custom_variant_reads_no_page_table(backend):
    """Only the listed variant looks a key's position up in a page list's table: compiled into the
    custom launch's variant, that lookup (an integer division and a load per element) made every
    custom launch about 1.8x slower on an H100 (streaming_sink's hull 49 ms for 27)."""
    spec = variantgen.parse_spec("name: g\ntensors:\n  is_global: {dtype: int32, shape: [total_kv]}\n"
                                 "mask: kv_pos <= q_pos and (q_pos - kv_pos < 8 or is_global[kv_row] != 0)\n")
    variant = render_module(config(spec, backend=backend)).files["variant.cuh"]
    key_pos = variant[variant.index("int32_t key_pos(int32_t i) const {"):]
    key_pos = key_pos[:key_pos.index("\n  }\n")]
    assert key_pos.count("if constexpr (LISTED) {") == 1 and key_pos.count("vg_listed_key_pos") == 1
    assert key_pos.index("vg_listed_key_pos") < key_pos.index("} else {") < key_pos.index("vg_key_pos(kv_pos_base")
    listed_only = variant.count("if constexpr (LISTED) {")
    assert listed_only == 2 and variant.count("page_table = ") == 1  # (the constructor's, and key_pos's)
    masked = "VG_GMasked" if backend == "fa3" else "VG_G"
    files = render_module(config(spec, backend=backend)).files
    custom = files["paged_kernel_custom.cu"] if backend == "fa3" else files["batch_prefill_config.inc"]
    assert f"using AttentionVariant = {masked};" in custom or f", {masked}, PagedParams>" in custom


def test_the_listed_variant_is_built_where_the_planner_may_list():
    """A mask with a key set (global tokens' flags) or keys picked per row block gets the listed
    launch's kernel (run() code LISTED_RUN_CODE) in its paged prefill modules; other masks do not,
    and the ragged kind never (no page lists there)."""
    listed = variantgen.parse_spec("name: g\ntensors:\n  is_global: {dtype: int32, shape: [total_kv]}\n"
                                   "mask: kv_pos <= q_pos and (q_pos - kv_pos < 8 or is_global[kv_row] != 0)\n")
    case = "static_cast<MaskMode>(vg_abi::kListedRunCode)"
    for spec, want in ((listed, True), (shipped("mm_prefix"), False), (shipped("streaming_sink"), False)):
        fa3 = render_module(config(spec, backend="fa3")).files
        assert ("paged_kernel_custom_listed.cu" in fa3) is want, spec.name
        assert (f"case {plan_abi.LISTED_RUN_CODE}:" in fa3["binding.cu"]) is want, spec.name
        fa2 = render_module(config(spec)).files
        assert (case in fa2["batch_prefill_config.inc"]) is want, spec.name
        assert any(f"{render.struct_name(spec)}Listed" in text for name, text in fa2.items()
                   if name.startswith("paged_kernel")) is want, spec.name
    unit = render_module(config(listed, backend="fa3")).files["paged_kernel_custom_listed.cu"]
    assert "VG_GListed" in unit
    ragged = render_module(config(listed, backend="fa3", kind="ragged")).files
    assert not any("listed" in name for name in ragged)


def test_the_masked_fa3_transform_defines_each_local_once():
    """The logits transform's locals come first; the mask's branch adds only the ones it lacks."""
    spec = variantgen.parse_spec("name: x\nscalars:\n  w: {dtype: int, default: 4}\n"
                                 "mask: kv_pos <= q_pos and q_row >= 0\nlogits: logits + float(q_pos - kv_pos) * 0.0\n")
    variant = render_module(config(spec, backend="fa3")).files["variant.cuh"]
    for local in ("q_local", "q_pos", "kv_local", "kv_pos", "q_row"):
        assert variant.count(f"const int32_t {local} =") == 1, local
    body = variant[variant.index("if constexpr (MASKED)"):]
    assert "const int32_t q_row =" in body and "const int32_t q_pos =" not in body


def test_fa3_hooks_map_gqa_packed_rows_through_the_helpers():
    """fa3's query row and head locals go through vg_packed_row / vg_packed_head (tested against
    floor division in test_helpers_cxx.py), which leave unpacked rows whole: a multiply-shift on
    every row would wrap past 2^16 rows in a long request's launch. fa2 reads them directly."""
    spec = shipped("alibi")  # the logits read qo_head and q_pos
    fa3 = render_module(config(spec, backend="fa3")).files["variant.cuh"]
    assert "const int32_t q_local = vg_packed_row(uint32_t(qo_idx < qo_len ? qo_idx : qo_len - 1), pack_gqa" in fa3
    assert "const int32_t qo_head = vg_packed_head(uint32_t(qo_idx), int32_t(qo_head_idx)" in fa3
    assert ">> 16" not in fa3
    fa2 = render_module(config(spec, backend="fa2")).files["variant.cuh"]
    assert "vg_packed" not in fa2 and "const int32_t qo_head = int32_t(qo_head_idx);" in fa2


# ----------------------------------------------------------------------------- comments and line breaks


def test_the_mask_comment_keeps_the_spec_text_next_to_the_canonical_form():
    spec = shipped("mm_prefix")
    for backend in ("fa2", "fa3"):
        variant = render_module(config(spec, backend=backend)).files["variant.cuh"]
        header = variant[:variant.index("Do not edit")]
        text_lines = codegen.comment_lines(spec.mask_text)
        assert text_lines[0].startswith("(kv_pos <= q_pos and (causal_window_left < 0 or")
        assert f"// mask:   {text_lines[0]}\n" in header
        assert all(f"//         {line}\n" in header for line in text_lines[1:])
        assert f"//   i.e.  {codegen.comment_lines(variantgen.lang.nodes.to_source(spec.mask))[0]}\n" in header
        # and in the hook, above the code
        hook = variant[variant.index("REGISTER_LOGITS_"):]
        assert all(f"// {line}\n" in hook for line in text_lines)
    assert all(len(line) <= 84 for line in codegen.comment_lines(spec.mask_text))


def test_the_logits_comment_keeps_the_spec_text():
    variant = render_module(config(shipped("softcap"))).files["variant.cuh"]
    assert "// logits: soft_cap * tanh(logits / soft_cap)\n" in variant
    assert "    // soft_cap * tanh(logits / soft_cap)\n    return T(" in variant


def test_long_masks_break_at_their_top_level_operator(spec_from):
    mm = render_module(config(shipped("mm_prefix"))).files["variant.cuh"]
    assert "    return ((kv_pos <= q_pos) && ((arg_causal_window_left < int32_t(0)) || " in mm
    assert "\n        || (((params.ranges[(q_row) * int32_t(2) + int32_t(0)] <= kv_pos)" in mm
    fa3 = render_module(config(shipped("mm_prefix"), backend="fa3")).files["variant.cuh"]
    assert "        const bool visible = ((kv_pos <= q_pos) && " in fa3
    assert "\n            || (((params.additional_params.ranges[" in fa3
    # the keys the plan proved visible to every query of a launch request skip the expression
    assert "      if (vg_key < vis_lo || vg_key > vis_hi) {" in fa3
    # (fa2: but for the kernel window, which its kernel leaves to the variant)
    assert ("    if (vg_key >= vis_lo && vg_key <= vis_hi) return kv_idx + qo_len + window_left >= kv_len + qo_idx;"
            in mm)
    chunked = render_module(config(shipped("chunked_local"))).files["variant.cuh"]
    assert "    return (kv_pos <= q_pos)\n        && (vg_floordiv_by(kv_pos, vg_divisor0) == " in chunked
    assert "  vg::vg_int_divisor vg_divisor0;  // the mask divides by arg_chunk_size" in chunked
    assert "    vg_divisor0.set(arg_chunk_size);" in chunked
    short = render_module(config(shipped("causal"))).files["variant.cuh"]
    assert "    return (kv_pos <= q_pos);\n" in short  # short: one line
    three = spec_from("name: x\nmask: kv_pos < 1000000 or kv_pos == q_pos - 1000000 or kv_pos == q_pos + 1000000 "
                      "or kv_pos >= q_pos\n")
    body = render_module(config(three)).files["variant.cuh"]
    assert body.count("\n        || ") == 3  # one line per operand of the chain, however it nests


def test_the_broken_mask_is_the_same_expression():
    for path in SPEC_FILES:
        mask = codegen.emit_mask(variantgen.load_spec(path))
        flat = mask.broken().replace("\n", " ")
        if mask.terms and len(mask.code) > codegen.BREAK_WIDTH:
            assert f"({flat})" == mask.code, path.stem
        else:
            assert flat == mask.code


def test_whitespace_of_the_mask_text_does_not_change_the_module(spec_from):
    """The spec text reaches only comments, its whitespace normalised: a re-wrapped mask is the
    same module (a precompiled cache still serves a server's reformatted copy)."""
    one = spec_from("name: x\nmask: kv_pos <= q_pos and (q_pos - kv_pos < 64)\n")
    two = spec_from("name: x\nmask: |\n  kv_pos <= q_pos\n      and   (q_pos - kv_pos < 64)\n")
    for backend in ("fa2", "fa3"):
        a, b = render_module(config(one, backend=backend)), render_module(config(two, backend=backend))
        assert a.files == b.files and a.source_digest() == b.source_digest()


@pytest.mark.parametrize("text", EVIL_TEXTS + ["x" * 400, "a " * 200])
def test_comment_lines_are_safe_and_wrapped(text):
    lines = codegen.comment_lines(text)
    for line in lines:
        assert "\n" not in line and "\\" not in line and "*/" not in line and "/*" not in line
        assert all(32 <= ord(ch) < 127 for ch in line)
        assert len(line) <= 84 or " " not in line  # a word longer than the width stays whole
    assert " ".join(lines) == codegen.comment_text(text)


@pytest.mark.parametrize("kind", ["prefill", "ragged"])
@pytest.mark.parametrize("name", ["mm_prefix", "softcap"])
def test_fa3_kernel_units_take_the_fixed_output_store(kind, name):
    """Every fa3 kernel unit declares FlashInfer's epilogue for its variant as variantgen's
    (epilogue_barrier.cuh: the output tile synced once before it is copied out), after the
    variant and before the kernel is instantiated - the spec's variant, or the plain one in a
    shared unit; the header travels with the module."""
    spec = shipped(name)
    module = render_module(config(spec, backend="fa3", kind=kind))
    units = [name for name in module.compile_units if name.startswith(("paged_kernel_", "ragged_kernel_"))]
    assert len(units) >= 3
    shared = {u.file for u in module.shared_units}
    for unit in units:
        text = module.files[unit]
        variant, header = (("vg::Fa3PlainVariant", "plain_variant.cuh") if unit in shared else
                           (f"{render.struct_name(spec)}Variant", "batch_prefill_sm90_config.inc"))
        declared = text.index(f"VG_FA3_EPILOGUE_FOR({variant})")
        assert text.index(f'#include "{header}"') < declared < text.index("template cudaError_t")
    header = module.files["epilogue_barrier.cuh"]
    assert "struct CollectiveEpilogue<" in header and "NamedBarrier::arrive" not in header


SHAREABLE = [name for name in variantgen.shipped_specs() if render.plain_is_shared(shipped(name))]


def test_which_specs_share_the_plain_kernel_units():
    """A spec without a logits transform or a sink runs its plain launches on the shared plain
    kernel (its q/k/v scales are the kernel's argument); one with either runs its own."""
    assert sorted(set(variantgen.shipped_specs()) - set(SHAREABLE)) == ["alibi", "attention_sink_learned", "softcap"]
    assert "streaming_sink" in SHAREABLE  # its sink is a mask (always-visible keys), not a learned logit


@pytest.mark.parametrize("kind", ["prefill", "ragged"])
def test_shared_plain_units_are_the_same_text_for_every_spec(kind):
    """The object cache (objects.py) links one compile of each shared unit into every module that
    has it: so its text must not depend on the spec, and it must include nothing a spec renders -
    only static files - or another spec's module would link a kernel of the wrong variant."""
    static = {name for name, source in STATIC_FILES["fa3", kind].items() if source.endswith((".cuh", ".h"))}
    digests: dict[str, set[str]] = {}
    for name in SHAREABLE:
        module = render_module(config(shipped(name), backend="fa3", kind=kind))
        plain = {u.file for u in module.shared_units if u.file != "plan.cu"}
        expected = {"paged_kernel_none.cu", "paged_kernel_causal.cu", "paged_kernel_causal_window.cu"}
        assert plain == (expected if kind == "prefill" else {"ragged_kernel_none.cu", "ragged_kernel_causal.cu"})
        for unit in module.shared_units:
            if unit.file == "plan.cu":
                continue
            text = module.files[unit.file]
            digests.setdefault(unit.prefix, set()).add(module.unit_digest(unit.file))
            assert name not in text and render.struct_name(shipped(name)) not in text
            # (fi_facts.h: rendered from the FlashInfer version, the same for every spec)
            assert set(module.includes(unit.file)) <= static | {"fi_facts.h"}, unit.file
            assert "plain_variant.cuh" in module.includes(unit.file)
            assert unit.prefix.endswith("_qbf16_kvbf16_obf16_hd128x128_sm90a")
    assert digests and all(len(v) == 1 for v in digests.values()), {k: len(v) for k, v in digests.items()}
    other = render_module(config(shipped("causal"), backend="fa3", kind=kind, head_dim_qk=64, head_dim_vo=64))
    for unit in other.shared_units:
        if unit.file != "plan.cu":
            assert other.unit_digest(unit.file) not in digests[unit.prefix.replace("hd64x64", "hd128x128")]


def test_the_launch_builder_unit_is_shared_by_every_paged_prefill_module():
    """plan.cu (templates/plan/) is static: one object per backend and arch serves every spec's
    paged-prefill module; its key covers the plan ABI's generated header it includes. Modules
    that do not plan (decode, ragged) have no such unit."""
    for backend in ("fa2", "fa3"):
        digests = set()
        for name in variantgen.shipped_specs():
            module = render_module(config(shipped(name), backend=backend))
            assert render.SharedUnit("plan.cu", f"vg_{backend}_plan_sm90a") in module.shared_units
            assert "vg_plan_abi.h" in module.includes("plan.cu")
            digests.add(module.unit_digest("plan.cu"))
        assert len(digests) == 1
    for backend, kind in (("fa2", "decode"), ("fa2", "ragged"), ("fa3", "ragged")):
        module = render_module(config(shipped("causal"), backend=backend, kind=kind))
        assert "plan.cu" not in {u.file for u in module.shared_units}
    assert render_module(config(shipped("softcap"), backend="fa2")).shared_units == (
        render.SharedUnit("plan.cu", "vg_fa2_plan_sm90a"),)  # fa2's kernel units stay each module's own


@pytest.mark.parametrize("name", ["alibi", "attention_sink_learned", "softcap"])
def test_specs_with_a_transform_or_a_sink_keep_their_own_plain_units(name):
    for kind in ("prefill", "ragged"):
        module = render_module(config(shipped(name), backend="fa3", kind=kind))
        assert [u.file for u in module.shared_units] == (["plan.cu"] if kind == "prefill" else [])
        binding = module.files["binding.cu"]
        assert "LaunchPlain<" not in binding and "LaunchRaggedPlain<" not in binding


@pytest.mark.parametrize("qkv_scales", [True, False])
def test_the_binding_hands_the_shared_kernel_its_value_scale(qkv_scales):
    """The shared plain kernel applies the value scale: run()'s v_scale where the spec takes
    q/k/v scales, 1 where it does not; the masked launch stays the spec's variant."""
    text = (SPECS_DIR / "mm_prefix.yaml").read_text()
    spec = variantgen.parse_spec(text + f"\nscales:\n  qkv_scales: {str(qkv_scales).lower()}\n")
    assert spec.qkv_scales is qkv_scales
    paged = render_module(config(spec, backend="fa3")).files["binding.cu"]
    ragged = render_module(config(spec, backend="fa3", kind="ragged")).files["binding.cu"]
    value = "vg_arg_v_scale" if qkv_scales else "1.0"
    assert f"LaunchPlain<MaskMode::kCausal, true>(params, {value}, enable_pdl, stream);" in paged
    assert f"LaunchPlain<MaskMode::kNone, false>(params, {value}, enable_pdl, stream);" in paged
    assert f"LaunchRaggedPlain<MaskMode::kCausal>(params, {value}, enable_pdl, stream);" in ragged
    assert "Launch<MaskMode::kNone, false, VG_MmPrefixMasked>(params, enable_pdl, stream);" in paged


def test_fa2_exact_launches_compile_no_spec_mask():
    """fa2 paged prefill: the exact launches' codes (none, causal) instantiate the variant without
    the spec's mask (only the kernel window); the tail launch's code runs causal with the masked
    variant, custom the masked one. A variant that can evaluate the mask slowed FlashInfer's
    fa2 causal kernel by ~10% on the H200 even where the mask ran on no tile."""
    spec = variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")
    name = render.struct_name(spec)
    module = render_module(config(spec))
    variant = module.files["variant.cuh"]
    exact = variant[variant.index(f"struct {name}Exact : {name}"):]
    assert "return kv_idx + qo_len + window_left >= kv_len + qo_idx;" in exact
    assert "ranges" not in exact  # nothing of the spec's mask
    for arch, unit_of in (("9.0a", "paged_kernel_cta{cta}.cu"), ("8.0", "paged_kernel_{mode}_cta{cta}.cu")):
        module = render_module(config(spec, arch=arch))
        units = {u: module.files[u] for u in module.compile_units if u.startswith("paged_kernel_")}
        instantiated = collections.Counter()
        for cta in render.FA2_CTA_TILES_Q:
            for mode, literal, variant_name in (("none", "kNone", f"{name}Exact"),
                                                ("causal", "kCausal", f"{name}Exact"),
                                                ("causal_tail", "kCausal", name), ("custom", "kCustom", name)):
                unit = unit_of.format(mode=mode, cta=cta)
                assert (f"// {mode}: MaskMode::{literal} with {variant_name}\n"
                        "template cudaError_t BatchPrefillWithPagedKVCacheDispatched<\n"
                        f"    /*SAME_KV_STRIDES=*/true, /*CTA_TILE_Q=*/{cta}, 128, 128,") in units[unit], (arch, mode)
                instantiated[unit] += 1
        assert all(text.count("template cudaError_t") == instantiated[unit] for unit, text in units.items())
        assert set(instantiated) == set(units)
    dispatch = module.files["batch_prefill_config.inc"]
    tail = dispatch[dispatch.index("case static_cast<MaskMode>(vg_abi::kFa2TailRunCode)"):]
    assert tail.index("MaskMode::kCausal") < tail.index(f"using AttentionVariant = {name};") < tail.index("break")
    assert f"constexpr int32_t kFa2TailRunCode = {plan_abi.FA2_TAIL_RUN_CODE};" in module.files["vg_plan_abi.h"]
    # ragged: none and causal launch only a mask that is exactly the mode (ragged.launch_mask_mode),
    # so they run the exact variant too; no tail launch. Every kernel the host code can name is a
    # unit's or a declared stub, with the variant of its code.
    ragged = render_module(config(spec, kind="ragged"))
    cfg, binding = ragged.files["batch_prefill_config.inc"], ragged.files["binding.cu"]
    for cta in render.FA2_CTA_TILES_Q:
        unit = ragged.files[f"ragged_kernel_cta{cta}.cu"]
        assert unit.count("template cudaError_t") == 3
        for literal, variant_name in (("kNone", f"{name}Exact"), ("kCausal", f"{name}Exact"), ("kCustom", name)):
            assert f"MaskMode::{literal}, {variant_name}, RaggedParams>" in unit, (cta, literal)
            assert f"MaskMode::{literal}, {variant_name}, PagedParams>" in cfg and binding.count(
                f"MaskMode::{literal}, {variant_name}, PagedParams>") == len(render.FA2_DISPATCHED_CTA_TILES_Q)
    assert "case MaskMode::kCausal: {  /* causal */" in cfg and "kFa2TailRunCode" not in cfg
    causal = cfg[cfg.index("case MaskMode::kCausal:"):]
    assert causal.index(f"using AttentionVariant = {name}Exact;") < causal.index("break")
