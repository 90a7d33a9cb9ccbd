"""GQA head mapping on the flex route: with several KV heads, a mask and a logits transform that
read ``kv_head`` / ``qo_head``, and K/V that differ per head, the output must be the reference's.
kv_head is qo_head // (num_qo_heads // num_kv_heads): query heads 0-3 over 2 KV heads map to
0, 0, 1, 1 - not 0, 1, 0, 1 (qo_head % num_kv_heads), which these tests tell apart."""

from __future__ import annotations

import pytest
import torch

from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.flex_wrapper import make_flex_wrapper
from variantgen.wrappers.ragged import random_ragged_batch, reference_ragged
from variantgen.wrappers.reference import reference_attention

WS = torch.empty(0, dtype=torch.uint8)
QO, KV = [7, 1, 20], [12, 9, 20]

MASK_READS_KV_HEAD = """
    name: kv_head_stride
    mask: kv_pos <= q_pos and (kv_pos % (kv_head + 2) == 0 or kv_pos == q_pos)
"""
LOGITS_READ_HEADS = """
    name: head_bias
    mask: kv_pos <= q_pos
    logits: logits * float(kv_head + 1) + 0.5 * float(qo_head) * float(kv_pos % 3)
"""


def paged(hq, hkv):
    b = random_paged_batch(QO, KV, num_qo_heads=hq, num_kv_heads=hkv, head_dim=16, page_size=4,
                           dtype=torch.float32, seed=11)
    assert not torch.allclose(b.k_cache[:, :, 0], b.k_cache[:, :, 1])  # per-head K/V differ
    return b


def reference(spec, b):
    return reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                               b.last_page_len, {})


@pytest.mark.parametrize("heads", [(4, 2), (6, 3), (8, 2)], ids=["4-2", "6-3", "8-2"])
@pytest.mark.parametrize("text", [MASK_READS_KV_HEAD, LOGITS_READ_HEADS], ids=["mask", "logits"])
def test_flex_prefill_maps_query_heads_to_their_kv_head(spec_from, text, heads):
    spec = spec_from(text)
    b = paged(*heads)
    w = make_flex_wrapper(spec, WS, head_dim_qk=16, q_dtype="fp32", kv_dtype="fp32")
    w.plan(*b.plan_args())
    out = w.run(b.q, (b.k_cache, b.v_cache))
    torch.testing.assert_close(out, reference(spec, b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("text", [MASK_READS_KV_HEAD, LOGITS_READ_HEADS], ids=["mask", "logits"])
def test_flex_compiled_kernel_maps_query_heads_to_their_kv_head(spec_from, text):
    """The compiled kernel (as on the GPU: Flex's own GQA and the per-head block lists)."""
    spec = spec_from(text)
    b = paged(4, 2)
    w = make_flex_wrapper(spec, WS, head_dim_qk=16, q_dtype="fp32", kv_dtype="fp32", compile=True)
    w.plan(*b.plan_args())
    out = w.run(b.q, (b.k_cache, b.v_cache))
    torch.testing.assert_close(out, reference(spec, b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["ragged", "decode"])
def test_flex_ragged_and_decode_map_query_heads_to_their_kv_head(spec_from, kind):
    spec = spec_from(MASK_READS_KV_HEAD)
    w = make_flex_wrapper(spec, WS, head_dim_qk=16, q_dtype="fp32", kv_dtype="fp32", kind=kind)
    if kind == "ragged":
        b = random_ragged_batch(QO, KV, num_qo_heads=4, num_kv_heads=2, head_dim_qk=16, dtype=torch.float32, seed=4)
        w.plan(*b.plan_args())
        out = w.run(b.q, b.k, b.v)
        ref = reference_ragged(spec, b.q, b.k, b.v, b.qo_indptr, b.kv_indptr, {})
    else:
        b = random_paged_batch([1, 1, 1], KV, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                               dtype=torch.float32, seed=4)
        w.plan(*b.plan_args()[1:])
        out = w.run(b.q, (b.k_cache, b.v_cache))
        ref = reference(spec, b)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
