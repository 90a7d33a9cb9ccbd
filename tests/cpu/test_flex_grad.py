"""Gradients through the flex route on the CPU (its dense path: torch's FlexAttention has no CPU
backward): run() is differentiable in q, the K/V caches (or ragged k / v) and the float spec
tensors, and for every shipped spec the gradients match those of the float64 reference."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_SPECS, SPECS_DIR

import variantgen
from variantgen.core.errors import LaunchError
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.flex_wrapper import make_flex_wrapper
from variantgen.wrappers.ragged import random_ragged_batch, reference_ragged
from variantgen.wrappers.reference import reference_attention

WS = torch.empty(0, dtype=torch.uint8)
QO, KV = [6, 1, 9], [6, 11, 20]
HQ, HKV, D, PAGE = 4, 2, 16, 4


def leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


def float_args(args: dict) -> list[str]:
    return [n for n, v in args.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]


def assert_grads_match(got: dict, want: dict, label: str) -> None:
    for name, g in got.items():
        w = want[name]
        assert g is not None, f"{label}: no gradient for {name}"
        err = (g.double() - w).abs().max().item()
        scale = w.abs().max().item()
        assert err <= 1e-4 * max(scale, 1.0), f"{label}: d/d{name} off by {err:.3g} (max |grad| {scale:.3g})"


@pytest.mark.parametrize("name", ALL_SPECS)
def test_paged_prefill_gradients_match_the_float64_reference(name):
    spec = variantgen.load_spec(SPECS_DIR / f"{name}.yaml")
    b = random_paged_batch(QO, KV, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                           dtype=torch.float32, seed=3)
    args = random_spec_args(spec, b, seed=3)
    trained = float_args(args)
    w = make_flex_wrapper(spec, WS, head_dim_qk=D, q_dtype="fp32", kv_dtype="fp32")
    w.plan(*b.plan_args())
    inputs = {"q": leaf(b.q), "k_cache": leaf(b.k_cache), "v_cache": leaf(b.v_cache),
              **{n: leaf(args[n]) for n in trained}}
    out, lse = w.run(inputs["q"], (inputs["k_cache"], inputs["v_cache"]), return_lse=True,
                     **{**args, **{n: inputs[n] for n in trained}})
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    g_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2))
    seen = torch.isfinite(lse)  # (rows with no visible key: LSE -inf, no gradient through it)
    ((out * g_out).sum() + (torch.where(seen, lse, 0) * g_lse).sum()).backward()
    got = {n: t.grad for n, t in inputs.items()}

    # (spec tensors stay float32, the dtype a spec declares; the attention itself runs in float64)
    ref_in = {n: leaf(t, torch.float64 if n in ("q", "k_cache", "v_cache") else None) for n, t in inputs.items()}
    ref, ref_lse = reference_attention(spec, ref_in["q"], (ref_in["k_cache"], ref_in["v_cache"]), b.qo_indptr,
                                       b.kv_indptr, b.kv_indices, b.last_page_len,
                                       {**args, **{n: ref_in[n] for n in trained}}, return_lse=True)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5), name
    ((ref * g_out.double()).sum() + (torch.where(seen, ref_lse, 0) * g_lse.double()).sum()).backward()
    assert_grads_match(got, {n: t.grad for n, t in ref_in.items()}, name)


@pytest.mark.parametrize("kind", ["ragged", "decode"])
def test_ragged_and_decode_gradients_match_the_float64_reference(kind):
    spec = variantgen.load_spec(SPECS_DIR / "alibi.yaml")  # a logits transform reading a float tensor
    if kind == "ragged":
        b = random_ragged_batch(QO, KV, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, dtype=torch.float32)
        tensors = {"q": b.q, "k": b.k, "v": b.v}
    else:
        b = random_paged_batch([1, 1, 1], KV, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                               dtype=torch.float32)
        tensors = {"q": b.q, "k": b.k_cache, "v": b.v_cache}
    slopes = leaf(torch.linspace(0.1, 0.9, HQ))
    w = make_flex_wrapper(spec, WS, head_dim_qk=D, q_dtype="fp32", kv_dtype="fp32", kind=kind)
    inputs = {n: leaf(t) for n, t in tensors.items()}
    if kind == "ragged":
        w.plan(*b.plan_args())
        out = w.run(inputs["q"], inputs["k"], inputs["v"], slopes=slopes)
    else:
        w.plan(*b.plan_args()[1:])
        out = w.run(inputs["q"], (inputs["k"], inputs["v"]), slopes=slopes)
    out.square().sum().backward()
    got = {**{n: t.grad for n, t in inputs.items()}, "slopes": slopes.grad}
    ref_in = {n: leaf(t, torch.float64) for n, t in tensors.items()}
    ref_slopes = leaf(slopes)
    if kind == "ragged":
        ref = reference_ragged(spec, ref_in["q"], ref_in["k"], ref_in["v"], b.qo_indptr, b.kv_indptr,
                               {"slopes": ref_slopes})
    else:
        ref = reference_attention(spec, ref_in["q"], (ref_in["k"], ref_in["v"]), b.qo_indptr, b.kv_indptr,
                                  b.kv_indices, b.last_page_len, {"slopes": ref_slopes})
    ref.square().sum().backward()
    assert_grads_match(got, {**{n: t.grad for n, t in ref_in.items()}, "slopes": ref_slopes.grad}, kind)


def test_the_compiled_cpu_kernel_refuses_gradients_naming_the_fix():
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    b = random_paged_batch(QO, KV, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                           dtype=torch.float32)
    w = make_flex_wrapper(spec, WS, head_dim_qk=D, q_dtype="fp32", kv_dtype="fp32", compile=True)
    w.plan(*b.plan_args())
    with pytest.raises(LaunchError, match="compile=False"):
        w.run(leaf(b.q), (b.k_cache, b.v_cache))
    with torch.no_grad():  # no gradient wanted: it runs
        assert torch.isfinite(w.run(leaf(b.q), (b.k_cache, b.v_cache))).all()
