"""Gradients through the flex route on the GPU (Flex's backward pass): q, the K/V caches and ALiBi's
slopes against the gradients of the float64 reference, for every shipped spec.
Run with `pytest -m gpu tests/gpu/test_gpu_flex_grad.py`."""

from __future__ import annotations

import pytest
import torch
from _gpu import ALL_SPECS, SPECS

import variantgen
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QO, KV = [37, 300, 1, 129], [37, 812, 700, 129]


@pytest.fixture(scope="module")
def ws():
    return torch.empty(0, dtype=torch.uint8, device="cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()


# alibi on an H100 (torch 2.11): Flex's compiled backward failed in inductor ("Cannot broadcast, rank
# mismatch: ['1'], [16, 16]") for the gradient of the per-head slopes the logits transform reads
# (bench/logs/2026-12-07-h100/pytest-isolation-grad-b630f7a.log). Open: a strict xfail until fixed.
SLOPES_GRAD = pytest.mark.xfail(strict=True, reason="Flex's GPU backward: inductor fails on alibi's slopes gradient")


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOPES_GRAD) if n == "alibi" else n for n in ALL_SPECS])
def test_flex_gradients_match_the_float64_reference(ws, name):
    spec = variantgen.load_spec(SPECS / f"{name}.yaml")
    b = random_paged_batch(QO, KV, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32,
                           device="cuda", seed=5)
    args = random_spec_args(spec, b, seed=5)
    floats = [n for n, v in args.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=64, q_dtype="fp32", kv_dtype="fp32", backend="flex")
    w.plan(*b.plan_args())
    inputs = {"q": b.q, "k_cache": b.k_cache, "v_cache": b.v_cache, **{n: args[n] for n in floats}}
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
    out = w.run(leaves["q"], (leaves["k_cache"], leaves["v_cache"]), **{**args, **{n: leaves[n] for n in floats}})
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    (out * g).sum().backward()
    ref_leaves = {n: t.detach().clone().to(torch.float64 if n in ("q", "k_cache", "v_cache") else t.dtype)
                  .requires_grad_(True) for n, t in inputs.items()}
    ref = reference_attention(spec, ref_leaves["q"], (ref_leaves["k_cache"], ref_leaves["v_cache"]), b.qo_indptr,
                              b.kv_indptr, b.kv_indices, b.last_page_len,
                              {**args, **{n: ref_leaves[n] for n in floats}})
    (ref * g.double()).sum().backward()
    assert rel(out, ref) < 5e-3, name
    for n in inputs:  # (Flex's kernel may use TF32 for float32 dot products)
        assert leaves[n].grad is not None, f"{name}: no gradient for {n}"
        assert rel(leaves[n].grad, ref_leaves[n].grad) < 1e-2, f"{name}: d/d{n}"
