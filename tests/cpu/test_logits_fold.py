"""Logits transforms at the cost of their math (logits_fold.py): launch-uniform positive outer
factors go to the softmax scale, a common factor of every ``logits`` use to the score scale, and
launch-uniform subtrees are computed once per CTA. Held to the transform as written: in torch
(the evaluator the reference uses) and in C++ (the generated code compiled for the host)."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
import torch

import variantgen
from variantgen.codegen import expressions as codegen
from variantgen.codegen import logits_fold, render
from variantgen.codegen.logits_fold import fold
from variantgen.lang import nodes
from variantgen.lang.evaluate import Evaluator
from variantgen.lang.spec import parse_spec

SCALARS = """scalars:
  soft_cap: {dtype: float, default: 50.0, positive: true}
  temp: {dtype: float, default: 0.7, min: 0.25}
  t: {dtype: float, default: 2.0}
  neg: {dtype: float, default: -1.5}
  n: {dtype: int, default: 3, min: 1}
"""


def spec_with(logits: str, extra: str = ""):
    return parse_spec(f"name: f\n{SCALARS}{extra}mask: kv_pos <= q_pos\nlogits: {logits}\n")


# (transform, out factor, score factor, body, hoisted) as spec text; "" = nothing folded there
CASES = [
    ("soft_cap * tanh(logits / soft_cap)", "soft_cap", "1 / soft_cap", "tanh(logits)", []),
    ("tanh(logits * 0.02) * 50.0", "50.0", "0.02", "tanh(logits)", []),
    ("soft_cap * tanh(logits / soft_cap) / 2.0", "soft_cap / 2.0", "1 / soft_cap", "tanh(logits)", []),
    ("n * tanh(logits / temp)", "n", "1 / temp", "tanh(logits)", []),
    ("(soft_cap / temp) * sigmoid(logits)", "(soft_cap / temp)", "", "sigmoid(logits)", []),
    # not provably positive: a negative constant, a scalar with no positive range
    ("-3.0 * tanh(logits)", "", "", "(-3.0 * tanh(logits))", []),
    ("t * tanh(logits)", "", "", "(t * tanh(logits))", []),
    ("neg * tanh(logits / soft_cap)", "", "1 / soft_cap", "(neg * tanh(logits))", []),
    # logits read twice with the same factor: folded; with different ones: left as written
    ("(logits / temp) + (logits / temp) * (logits / temp)", "", "1 / temp", "(logits + (logits * logits))", []),
    ("2.0 * (logits / temp) + (logits / temp) * (logits / temp)", "", "",
     "((2.0 * (logits / temp)) + ((logits / temp) * (logits / temp)))", []),
    ("soft_cap * tanh(logits / soft_cap) + logits", "", "", "((soft_cap * tanh((logits / soft_cap))) + logits)", []),
    # launch-uniform subtrees hoisted out of the element loop
    ("logits * (t / temp) + sqrt(soft_cap)", "", "(t / temp)", "(logits + sqrt(soft_cap))", ["sqrt(soft_cap)"]),
    ("tanh(logits) * exp(t) + t * t", "", "", "((tanh(logits) * exp(t)) + (t * t))", ["exp(t)", "(t * t)"]),
    # per-element terms stay
    ("logits + 0.5 * float(kv_pos - q_pos)", "", "", "(logits + (0.5 * float((kv_pos - q_pos))))", []),
]


@pytest.mark.parametrize(("logits", "out", "score", "body", "hoisted"), CASES)
def test_what_is_folded(logits, out, score, body, hoisted):
    f = fold(spec_with(logits))
    assert (f.out_scale.source() if f.out_scale else "") == out
    assert (f.in_scale.source() if f.in_scale else "") == score
    assert nodes.to_source(f.body) == body
    assert [nodes.to_source(n) for n in f.hoisted] == hoisted


ARGS = [{}, {"soft_cap": 0.3, "temp": 4.0, "t": -0.25, "neg": 3.0, "n": 7}, {"soft_cap": 1e4, "t": 11.0}]


@pytest.mark.parametrize("args", ARGS)
@pytest.mark.parametrize("logits", [c[0] for c in CASES])
def test_the_folded_transform_is_the_transform_in_the_kernels_log2_domain(logits, args):
    """What the softmax exponentiates (and takes the max and LSE of): the transform times
    log2(e) as written, the body times out_scale x log2(e) folded - equal, -inf included."""
    spec = spec_with(logits)
    torch.manual_seed(0)
    scores = torch.cat([torch.randn(400) * 30, torch.tensor([0.0, 1e-3, -1e-3, 200.0, -200.0])]).view(1, 1, -1)
    env = {"q_pos": torch.arange(5).view(1, -1, 1), "kv_pos": torch.arange(scores.shape[-1]).view(1, 1, -1)}
    written = Evaluator(spec, env, args, logits=scores).as_float(spec.logits)
    folded = logits_fold.evaluate(fold(spec), spec, env, args, scores)
    torch.testing.assert_close(folded.expand_as(written), written, rtol=2e-5, atol=2e-5)
    masked = torch.where(env["kv_pos"] <= env["q_pos"], folded, -math.inf)  # the mask after the fold
    assert torch.isneginf(masked[..., 5:]).all()


def test_every_shipped_transform_folded_is_the_transform():
    """Every shipped spec's transform, at its defaults, over a request's grid (heads, rows, keys):
    the folded form the kernels and the fakes run against the one the reference runs."""
    seen = 0
    for name in sorted(variantgen.lang.library.shipped_specs()):
        spec = variantgen.resolve_spec(name)
        if spec.logits is None:
            assert fold(spec) is None
            continue
        seen += 1
        h, q, k = 4, 6, 9
        env = {"q_pos": torch.arange(k - q, k).view(1, -1, 1), "kv_pos": torch.arange(k).view(1, 1, -1),
               "qo_head": torch.arange(h).view(-1, 1, 1), "kv_head": torch.arange(h).view(-1, 1, 1) // 2}
        args = {t.name: torch.rand(h) + 0.5 for t in spec.tensors}  # per-head floats (ALiBi's slopes)
        scores = torch.randn(h, q, k) * 20
        written = Evaluator(spec, env, args, logits=scores).as_float(spec.logits)
        folded = logits_fold.evaluate(fold(spec), spec, env, args, scores)
        torch.testing.assert_close(folded.expand_as(written), written.expand_as(folded), rtol=2e-5, atol=2e-5)
    assert seen >= 2  # softcap and alibi
    f = fold(variantgen.resolve_spec("softcap"))
    assert (f.out_scale.source(), f.in_scale.source(), nodes.to_source(f.body)) == ("soft_cap", "1 / soft_cap",
                                                                                  "tanh(logits)")


def test_the_generated_variants_run_the_folded_transform():
    """fa2 and fa3 variants of softcap: the element hook is tanh of the score alone; the
    constructor folds 1/soft_cap into the score scale and soft_cap into sm_scale_log2, after
    the scalar is read."""
    spec = variantgen.resolve_spec("softcap")
    for backend in ("fa2", "fa3"):
        config = render.ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", backend)
        variant = render.render_module(config).files["variant.cuh"]
        params = "args" if backend == "fa3" else "params"
        assert f"sm_scale = float({params}.sm_scale) / (arg_soft_cap);" in variant
        assert "sm_scale_log2 = (arg_soft_cap) * math::log2e;" in variant
        assert variant.index(f"arg_soft_cap = float({params}.soft_cap);") < variant.index("sm_scale_log2 = (arg_soft")
        hook = variant[variant.index("REGISTER_LOGITS_TRANSFORM"):]
        assert "vg_tanh(score)" in hook and "arg_soft_cap" not in hook.split("})")[0], hook


def test_hoisted_subtrees_become_members_set_once():
    spec = spec_with("logits * (t / temp) + sqrt(soft_cap)")
    variant = render.render_module(render.ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a",
                                                       "fa2")).files["variant.cuh"]
    assert "  float vg_uniform0;" in variant and "vg_uniform0 = vg_sqrt(arg_soft_cap);" in variant
    assert "sm_scale = float(params.sm_scale) * (vg_div(arg_t, arg_temp));" in variant
    assert "return T((score + vg_uniform0));" in variant


# ----------------------------------------------------------------------------- the C++ itself

CXX = shutil.which("c++") or shutil.which("g++")
DRIVER = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#define __device__
#define __forceinline__ inline
{helpers}
namespace math {{ constexpr float log2e = 1.44269504088896340736f; }}
int main() {{
  float raw, sm_scale_in;
{decls}
  std::scanf("{scan}", {scan_args});
  while (std::scanf("%f", &raw) == 1) {{
    float written, folded;
    {{  // as written: the transform of the scaled score, times log2(e)
      const float score = raw * sm_scale_in;
      written = ({written}) * math::log2e;
    }}
    {{  // folded: the variant constructor's scales and members, then the element hook
      const float sm_scale = sm_scale_in{score_scale};
      const float sm_scale_log2 = {softmax}math::log2e;
{hoisted}
      const float score = raw * sm_scale;
      folded = ({body}) * sm_scale_log2;
    }}
    std::printf("%.9g %.9g\n", written, folded);
  }}
  return 0;
}}
"""


@pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (c++ or g++)")
@pytest.mark.parametrize("logits", [c[0] for c in CASES if "kv_pos" not in c[0]])
def test_the_generated_cxx_of_both_forms_agrees(tmp_path, logits):
    """The emitted C++ (codegen.emit_logits as written, emit_logits_folded as the variants run it)
    compiled for the host with the expression helpers: the same log2-domain logit per score."""
    spec = spec_with(logits)
    written = codegen.emit_logits(spec, "score")
    folded = codegen.emit_logits_folded(spec, "score")
    assert not written.builtins and not folded.builtins
    scalars = spec.scalars
    types = {"float": ("float", "%f"), "int": ("int32_t", "%d"), "bool": ("bool", "%d")}
    decls = "\n".join(f"  {types[s.dtype][0]} arg_{s.name};" for s in scalars)
    hoisted = "\n".join(f"      const {t} {name} = {value};" for t, name, value in folded.hoisted)
    source = DRIVER.format(
        helpers=render.environment().get_template("common/helpers.cuh.jinja").render(), decls=decls,
        scan=" ".join(["%f"] + [types[s.dtype][1] for s in scalars]),
        scan_args=", ".join(["&sm_scale_in"] + [f"&arg_{s.name}" for s in scalars]),
        written=written.code, score_scale=folded.score_scale,
        softmax=f"{folded.softmax_scale} * " if folded.softmax_scale else "", hoisted=hoisted, body=folded.code)
    (tmp_path / "d.cpp").write_text(source)
    binary = tmp_path / "d"
    subprocess.run([CXX, "-std=c++17", "-O1", "-o", str(binary), str(tmp_path / "d.cpp")], check=True,
                   capture_output=True, timeout=120)
    torch.manual_seed(1)
    raws = [0.0, 1.0, -1.0, 1e-4, 500.0, -500.0] + (torch.randn(200) * 40).tolist()
    for args in ({}, {"soft_cap": 0.3, "temp": 4.0, "t": -0.25, "neg": 3.0, "n": 7}):
        values = [str(args.get(s.name, s.default)) for s in scalars]
        stdin = " ".join(["0.0883883"] + values) + "\n" + "\n".join(map(str, raws)) + "\n"
        out = subprocess.run([str(binary)], input=stdin, capture_output=True, text=True, check=True, timeout=60)
        pairs = [tuple(map(float, line.split())) for line in out.stdout.splitlines()]
        assert len(pairs) == len(raws)
        for w, f in pairs:
            assert math.isclose(w, f, rel_tol=1e-5, abs_tol=1e-5), (logits, args, w, f)


FOLDING = """
name: folding
scalars:
  soft_cap: {dtype: float, default: 30.0, positive: true}
  temp: {dtype: float, default: 2.0, min: 0.5}
mask: kv_pos <= q_pos
logits: soft_cap * tanh(logits * (sqrt(temp) / soft_cap) + sqrt(temp))
"""


@pytest.mark.nvcc
@pytest.mark.parametrize(("backend", "kind", "unit"), [
    ("fa2", "prefill", "paged_kernel_cta16.cu"), ("fa2", "decode", "decode_kernel.cu"),
    ("fa3", "prefill", "paged_kernel_custom.cu")])
def test_folded_variants_compile(vg_env, toolchain, tmp_path, backend, kind, unit):
    """The folded scales and a hoisted member in each variant template, compiled by nvcc against
    FlashInfer's headers with the module's flags (one kernel unit each)."""
    from test_build_nvcc import _compile_units

    spec = variantgen.parse_spec(FOLDING, "folding.yaml")
    f = fold(spec)
    assert (f.out_scale.source(), f.in_scale.source(), [nodes.to_source(n) for n in f.hoisted]) == (
        "soft_cap", "(sqrt(temp) / soft_cap)", ["sqrt(temp)"])
    config = render.ModuleConfig(spec, 64, 64, "bf16", "bf16", "bf16", "9.0a", backend, kind=kind)
    module = render.render_module(config)
    variant = module.files["variant.cuh"]
    assert unit in module.compile_units and "vg_uniform0 = vg_sqrt(arg_temp);" in variant
    # a device helper in the score scale and a hoisted member: a __host__ __device__ constructor (fa2)
    # computes them on the device only (calling vg_sqrt from the host side failed to compile)
    assert "sm_scale = float(" in variant and ".sm_scale) * (vg_div(vg_sqrt(arg_temp), arg_soft_cap));" in variant
    _compile_units(toolchain, tmp_path, module, config, [unit])
    assert (tmp_path / f"{unit.removesuffix('.cu')}.o").stat().st_size > 0
