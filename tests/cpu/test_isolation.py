"""One request's NaN or inf stays in that request on the flex route - its dense CPU path and
Flex's compiled kernel (which computes whole blocks, as on the GPU) - for paged prefill, ragged
and decode batches: every other request's rows are finite and equal to the reference's."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SPECS_DIR

import variantgen
from variantgen.testing.harness import assert_close_with_nans, poison_keys, random_paged_batch, rows_of_requests
from variantgen.wrappers.flex_wrapper import make_flex_wrapper
from variantgen.wrappers.ragged import random_ragged_batch, reference_ragged
from variantgen.wrappers.reference import reference_attention

WS = torch.empty(0, dtype=torch.uint8)
QO, KV = [5, 1, 7], [9, 6, 20]  # the report's batch: request 0's keys are seen by its rows only
HQ, HKV, D, PAGE = 4, 2, 64, 4


def causal():
    return variantgen.load_spec(SPECS_DIR / "causal.yaml")


def paged(value: float, request: int = 0, qo=QO, kv=KV):
    b = random_paged_batch(qo, kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                           dtype=torch.float32)
    poison_keys(b.k_cache, b.v_cache, kv, request, value, kv_indptr=b.kv_indptr.tolist(), kv_indices=b.kv_indices,
                page_size=PAGE)
    return b


def ref_paged(spec, b, **kw):
    return reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                               b.last_page_len, {}, **kw)


def assert_isolated(out, ref, qo, request, label):
    """Rows of every other request finite and equal to the reference's."""
    others = ~rows_of_requests(qo, [request])
    assert torch.isfinite(out[others]).all(), f"{label}: NaN/inf in rows of requests other than {request}"
    assert_close_with_nans(out[others], ref[others], atol=2e-5, rtol=2e-5, label=label)


# ----------------------------------------------------------------------------- the flex route


@pytest.mark.parametrize("compiled", [False, True], ids=["dense", "compiled"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_flex_prefill_keeps_a_bad_value_in_its_request(compiled, value):
    spec = causal()
    b = paged(value)
    w = make_flex_wrapper(spec, WS, head_dim_qk=D, q_dtype="fp32", kv_dtype="fp32", compile=compiled)
    w.plan(*b.plan_args())
    out = w.run(b.q, (b.k_cache, b.v_cache))
    ref = ref_paged(spec, b)
    assert_isolated(out, ref, QO, 0, f"flex prefill {'compiled' if compiled else 'dense'} {value}")
    if not compiled:  # the dense path keeps the reference's own semantics inside the request too
        assert_close_with_nans(out, ref, atol=2e-5, rtol=2e-5, label="flex prefill dense")


@pytest.mark.parametrize("compiled", [False, True], ids=["dense", "compiled"])
def test_flex_prefill_isolates_a_middle_request_with_the_planner_on(compiled):
    """Request 1 poisoned, its neighbours on both sides checked; the interval planner on."""
    spec = causal()
    b = paged(math.nan, request=1, qo=[3, 4, 6], kv=[3, 130, 6])
    w = make_flex_wrapper(spec, WS, head_dim_qk=D, q_dtype="fp32", kv_dtype="fp32", compile=compiled)
    w.plan(*b.plan_args(), skip_tiles=True)
    out = w.run(b.q, (b.k_cache, b.v_cache))
    assert_isolated(out, ref_paged(spec, b), [3, 4, 6], 1, "flex prefill, planner on")


@pytest.mark.parametrize("compiled", [False, True], ids=["dense", "compiled"])
def test_flex_ragged_keeps_a_nan_in_its_request(compiled):
    spec = causal()
    b = random_ragged_batch(QO, KV, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, dtype=torch.float32)
    poison_keys(b.k, b.v, KV, 0, math.nan)
    w = make_flex_wrapper(spec, WS, head_dim_qk=D, q_dtype="fp32", kv_dtype="fp32", kind="ragged",
                          compile=compiled)
    w.plan(*b.plan_args())
    out = w.run(b.q, b.k, b.v)
    ref = reference_ragged(spec, b.q, b.k, b.v, b.qo_indptr, b.kv_indptr, {})
    assert_isolated(out, ref, QO, 0, "flex ragged")


@pytest.mark.parametrize("compiled", [False, True], ids=["dense", "compiled"])
def test_flex_decode_keeps_a_nan_in_its_request(compiled):
    spec = causal()
    qo = [1, 1, 1]
    b = paged(math.nan, qo=qo)
    w = make_flex_wrapper(spec, WS, head_dim_qk=D, q_dtype="fp32", kv_dtype="fp32", kind="decode",
                          compile=compiled)
    w.plan(*b.plan_args()[1:])
    out = w.run(b.q, (b.k_cache, b.v_cache))
    assert_isolated(out, ref_paged(spec, b), qo, 0, "flex decode")
