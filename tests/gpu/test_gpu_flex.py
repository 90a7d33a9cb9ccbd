"""The flex route on a CUDA GPU: the compiled FlexAttention kernel (which trusts the block lists
that the CPU tests can only check against the mask) against the derived reference, for every
shipped spec and kind; fully masked rows; recompiles across batches of new lengths.
Run on the H200 with `pytest -m gpu tests/gpu/test_gpu_flex.py` (no module is built: no nvcc, no
flashinfer; the first call of each spec and kind compiles a kernel, a few seconds).
"""

from __future__ import annotations

import math

import pytest
import torch
from _gpu import ALL_SPECS, SPECS, rel_error

import variantgen
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.ragged import random_ragged_batch, reference_ragged
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Chunked prefill (kv_len > qo_len), one token, a request from position 0, several 128-blocks.
QO_LENS = [37, 300, 1, 129, 513]
KV_LENS = [37, 812, 700, 1000, 513]
DECODE_KV = [1, 7, 16, 17, 300, 1000, 2500, 129]
# Scalars that make the masks bite at these lengths (the defaults mostly exceed them).
SMALL_SCALARS = {
    "attention_sink": {"num_sink": 4, "window": 100},
    "chunked_local": {"chunk_size": 256},
    "mm_prefix": {"causal_window_left": 50, "range_window_left": 40},
    "sliding_window": {"window": 127},
    "softcap": {"soft_cap": 5.0, "window": 300},
}


@pytest.fixture(scope="module")
def ws():
    return torch.empty(0, dtype=torch.uint8, device="cuda")  # Flex needs no workspace


def spec_of(name):
    return variantgen.load_spec(SPECS / f"{name}.yaml")


def args_for(spec, batch, seed=0):
    args = random_spec_args(spec, batch, seed=seed)
    args.update(SMALL_SCALARS.get(spec.name, {}))
    return args


def assert_lse(lse, ref_lse, label):
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), f"{label}: -inf rows differ"
    fin = torch.isfinite(ref_lse)
    worst = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    assert worst < 2e-2, f"{label}: lse off by {worst:.3e}"  # bf16 q/k, float32 scores


@pytest.mark.parametrize("spec_name", ALL_SPECS)
@pytest.mark.parametrize("page_size,planner", [(16, True), (16, False), (1, True)],
                         ids=["page16-planner", "page16-noplanner", "page1-planner"])
def test_paged_prefill(ws, spec_name, page_size, planner):
    spec = spec_of(spec_name)
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="flex")
    assert w.compiled
    batch = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                               page_size=page_size, dtype=torch.bfloat16, device="cuda", seed=1)
    args = args_for(spec, batch)
    if planner:
        w.plan(*batch.plan_args(), skip_tiles=True, **args)
    else:
        w.plan(*batch.plan_args(), skip_tiles=False)
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, return_lse=True)
    label = f"{spec_name} page{page_size} planner={planner}"
    assert rel_error(out, ref) < 1e-2, label
    assert_lse(lse, ref_lse, label)
    blocks = w.plan_stats["blocks"]
    assert blocks["partial"] + blocks["full"] < blocks["total"], blocks  # requests' blocks only


@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_ragged(ws, spec_name):
    spec = spec_of(spec_name)
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=192, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16",
                                backend="flex", kind="ragged")
    rb = random_ragged_batch(QO_LENS, KV_LENS, num_qo_heads=16, num_kv_heads=16, head_dim_qk=192, head_dim_vo=128,
                             dtype=torch.bfloat16, device="cuda", seed=2)
    args = args_for(spec, rb)
    w.plan(*rb.plan_args())
    out, lse = w.run(rb.q, rb.k, rb.v, return_lse=True, **args)
    ref, ref_lse = reference_ragged(spec, rb.q, rb.k, rb.v, rb.qo_indptr, rb.kv_indptr, args, return_lse=True)
    assert rel_error(out, ref) < 1e-2, spec_name
    assert_lse(lse, ref_lse, spec_name)


@pytest.mark.parametrize("spec_name", ALL_SPECS)
@pytest.mark.parametrize("trim", [True, False], ids=["trimmed", "untrimmed"])
def test_decode(ws, spec_name, trim):
    spec = spec_of(spec_name)
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="flex",
                                kind="decode")
    batch = random_paged_batch([1] * len(DECODE_KV), DECODE_KV, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                               page_size=16, dtype=torch.bfloat16, device="cuda", seed=3)
    args = args_for(spec, batch)
    if trim:
        w.plan(*batch.plan_args()[1:], skip_tiles=True, **args)
    else:
        w.plan(*batch.plan_args()[1:], skip_tiles=False)
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    qo = torch.arange(len(DECODE_KV) + 1, dtype=torch.int32, device="cuda")
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), qo, batch.kv_indptr,
                                       batch.kv_indices, batch.last_page_len, args, return_lse=True)
    assert rel_error(out, ref) < 1e-2, spec_name
    assert_lse(lse, ref_lse, spec_name)


def test_scales_hnd_fp8_and_output_dtype(ws):
    spec = spec_of("softcap")
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="fp8_e4m3", o_dtype="fp16",
                                kv_layout="HND", backend="flex")
    batch = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, device="cuda", seed=4)
    args = args_for(spec, batch)
    w.plan(*batch.plan_args(), **args)
    hnd = (batch.k_cache.transpose(1, 2).contiguous(), batch.v_cache.transpose(1, 2).contiguous())
    out = w.run(batch.q, hnd, q_scale=0.8, k_scale=0.5, v_scale=2.0, **args)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args, q_scale=0.8, k_scale=0.5, v_scale=2.0)
    assert out.dtype == torch.float16
    assert rel_error(out, ref) < 1e-2


def test_rows_without_visible_keys_are_zero_with_minus_inf_lse(ws):
    """The compiled kernel's own handling of a row that sees nothing (a first query of a
    strictly-before mask): output 0, LSE -inf, as the reference and the FlashInfer routes."""
    spec = variantgen.parse_spec("name: strictly_before\nmask: kv_pos < q_pos\n")
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="flex")
    batch = random_paged_batch([300, 3], [300, 3], num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               dtype=torch.bfloat16, device="cuda")
    for planner in (True, False):
        w.plan(*batch.plan_args(), skip_tiles=planner)
        out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True)
        for row in (0, 300):
            assert torch.equal(out[row], torch.zeros_like(out[row])), planner
            assert torch.isneginf(lse[row]).all(), planner


def test_head_dependent_mask(ws):
    """A mask reading the head: no intervals; per-head block lists from the mask."""
    spec = variantgen.parse_spec("name: head_window\nmask: kv_pos <= q_pos and q_pos - kv_pos <= 64 * qo_head + 3\n")
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="flex")
    batch = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                               dtype=torch.bfloat16, device="cuda", seed=5)
    w.plan(*batch.plan_args())
    out = w.run(batch.q, (batch.k_cache, batch.v_cache))
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, {})
    assert rel_error(out, ref) < 1e-2
    assert w._run_blocks[1].kv_num.shape[1] == 8


def test_new_batch_lengths_do_not_recompile(ws):
    """Dynamic shapes with lengths padded to 128: once a batch with one query block and one with
    several have compiled (dynamo specializes sizes of 1), batches of other lengths and other
    window values reuse the compiled kernels."""
    from torch._dynamo.utils import counters

    spec = spec_of("sliding_window")
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="flex")

    def run(qo, kv, window, seed):
        b = random_paged_batch(qo, kv, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               dtype=torch.bfloat16, device="cuda", seed=seed)
        w.plan(*b.plan_args(), window=window)
        out = w.run(b.q, (b.k_cache, b.v_cache), window=window)
        ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                  b.last_page_len, {"window": window})
        assert rel_error(out, ref) < 1e-2

    warm = [([5, 7], [50, 60], 63), ([20], [900], 63), ([100, 30], [400, 30], 63), ([250, 7, 90], [900, 7, 300], 9)]
    for i, (qo, kv, window) in enumerate(warm):
        run(qo, kv, window, i)
    graphs = counters["stats"]["unique_graphs"]
    later = [([9, 3], [80, 40], 200), ([17], [1500], 5), ([17, 600], [17, 1200], 63), ([333, 1], [2000, 9], 200)]
    for i, (qo, kv, window) in enumerate(later):
        run(qo, kv, window, 10 + i)
    assert counters["stats"]["unique_graphs"] == graphs, "a new batch length or window recompiled the kernel"


def test_flex_agrees_with_the_fa2_route(ws):
    """Where a FlashInfer module can be built here, the two routes give the same output."""
    pytest.importorskip("flashinfer")
    spec = spec_of("mm_prefix")
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    try:
        fa2 = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16",
                                      backend="fa2")
    except variantgen.VariantgenError as e:
        pytest.skip(f"no fa2 module here: {e}")
    flex = variantgen.make_wrapper(spec, ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="flex")
    batch = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                               dtype=torch.bfloat16, device="cuda", seed=6)
    args = args_for(spec, batch)
    outs = []
    for w in (fa2, flex):
        w.plan(*batch.plan_args(), **args)
        outs.append(w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args))
    assert rel_error(outs[1][0], outs[0][0].float()) < 1e-2
    fin = torch.isfinite(outs[0][1])
    assert (outs[1][1][fin] - outs[0][1][fin]).abs().max() < 2e-2
    assert math.isclose(float(fin.float().mean()), float(torch.isfinite(outs[1][1]).float().mean()))
