"""GPU correctness of offset row indices (`kv_row - lag`, `q_row - 1`, `q_kv_row + lag`,
`qo_head + 1`): the kernels clamp each to the rows of its request exactly as the reference
does, on every kernel kind, both backends and both plan paths (the interval planner reads
`start[q_row - 1]` in its row kernel). Run: pytest -m gpu tests/gpu/test_gpu_index_kinds.py
"""

from __future__ import annotations

import pytest
import torch
from _gpu import KV_LENS, QO_LENS, check, rel_error

import variantgen
from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.ragged import random_ragged_batch, reference_ragged
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OFFSET_ROWS = """
name: offset_rows
tensors:
  keep: {dtype: int32, shape: [total_kv]}
  start: {dtype: int32, shape: [total_q]}
  bias: {dtype: float32, shape: [num_qo_heads]}
scalars:
  lag: {dtype: int, default: 1}
mask: kv_pos <= q_pos and kv_pos >= start[q_row - 1] and (keep[kv_row - lag] != 0 or kv_pos == q_pos)
logits: logits + bias[qo_head + 1] + 0.5 * float(keep[q_kv_row + lag])
"""
# 2**31 - 1: the offset must not wrap before the clamp (kv_row - lag is the request's first key).
LAGS = [1, 3, -2, 2**31 - 1]
HEADS = (32, 8)


@pytest.fixture(scope="module")
def spec():
    return variantgen.parse_spec(OFFSET_ROWS, "offset_rows.yaml")


def offset_args(qo_lens, kv_lens, lag, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "keep": torch.randint(0, 2, (sum(kv_lens),), generator=g, dtype=torch.int32).cuda(),
        "start": torch.randint(-3, 60, (sum(qo_lens),), generator=g, dtype=torch.int32).cuda(),
        "bias": torch.randn(HEADS[0], generator=g).cuda(),
        "lag": lag,
    }


@pytest.mark.parametrize("skip_tiles", [False, True], ids=["direct", "planned"])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("lag", LAGS)
def test_offset_rows_paged_prefill(spec, workspace, backend, skip_tiles, lag):
    check("offset_rows", workspace, spec=spec, backend=backend, skip_tiles=skip_tiles, heads=HEADS,
          args=offset_args(QO_LENS, KV_LENS, lag))


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
@pytest.mark.parametrize("lag", LAGS)
def test_offset_rows_decode(spec, workspace, tensor_cores, lag):
    kv_lens = [1, 37, 700, 4097, 16]
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                backend="fa2", use_tensor_cores=tensor_cores)
    b = random_paged_batch([1] * len(kv_lens), kv_lens, num_qo_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim=128,
                           page_size=16, dtype=torch.bfloat16, device="cuda", seed=lag % 7)
    args = offset_args([1] * len(kv_lens), kv_lens, lag)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HEADS[0], HEADS[1], 16, **args)
    out = w.run(b.q, (b.k_cache, b.v_cache), **args)
    qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32, device="cuda")
    ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), qo_indptr, b.kv_indptr, b.kv_indices,
                              b.last_page_len, args)
    err = rel_error(out, ref)
    assert err < 1e-2, f"decode tensor_cores={tensor_cores} lag={lag}: rel. error {err:.3e}"


@pytest.mark.parametrize("lag", LAGS)
def test_offset_rows_ragged(spec, workspace, lag):
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="ragged",
                                backend="fa2")
    b = random_ragged_batch(QO_LENS, KV_LENS, num_qo_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim_qk=128,
                            dtype=torch.bfloat16, device="cuda", seed=lag % 7)
    args = offset_args(QO_LENS, KV_LENS, lag)
    w.plan(*b.plan_args())
    out = w.run(b.q, b.k, b.v, **args)
    ref = reference_ragged(spec, b.q, b.k, b.v, b.qo_indptr, b.kv_indptr, args)
    err = rel_error(out, ref)
    assert err < 1e-2, f"ragged lag={lag}: rel. error {err:.3e}"
