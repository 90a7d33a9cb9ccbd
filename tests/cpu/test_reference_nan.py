"""A NaN in means NaN out: the reference (the oracle of the GPU tests and the fuzzer) keeps a NaN
of a visible score or value in the rows that see it, and never lets a masked key contribute,
whatever it holds."""

from __future__ import annotations

import math

import torch
from conftest import SPECS_DIR

import variantgen
from variantgen.testing.harness import assert_close_with_nans, nan_positions_differ, random_paged_batch
from variantgen.wrappers.reference import reference_attention, softmax_attention

QO, KV = [5, 1, 7], [9, 6, 20]
HQ, HKV, D, PAGE = 4, 2, 64, 4


def ref_paged(spec, b, **kw):
    return reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                               b.last_page_len, {}, **kw)


# ----------------------------------------------------------------------------- the reference


def test_a_nan_score_makes_its_row_nan_and_only_its_row():
    scores = torch.tensor([[[0.5, math.nan, 1.0], [0.5, 0.25, 1.0]]])
    v = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    out, lse = softmax_attention(scores, v)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


def test_a_masked_key_never_contributes_whatever_its_value_holds():
    scores = torch.tensor([[[0.5, -math.inf, 1.0], [0.5, 0.25, 1.0]]])
    v = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    clean, _ = softmax_attention(scores, v)
    for bad in (math.nan, math.inf, -math.inf):
        v_bad = v.clone()
        v_bad[1] = bad  # key 1: masked for row 0, visible to row 1
        out, _ = softmax_attention(scores, v_bad)
        assert torch.equal(out[0], clean[0]), bad
        assert not torch.isfinite(out[1]).any(), bad


def test_the_reference_keeps_nan_in_the_request_that_holds_it():
    """Causal: request 0's last key is seen by its last query only; its first key by all its queries."""
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    b = random_paged_batch(QO, KV, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                           dtype=torch.float32)
    clean, clean_lse = ref_paged(spec, b, return_lse=True)
    last = KV[0] - 1
    page = int(b.kv_indices[b.kv_indptr[0] + last // PAGE])
    b.v_cache[page, last % PAGE, 0, 0] = math.nan
    out, lse = ref_paged(spec, b, return_lse=True)
    nan_rows = torch.isnan(out).flatten(1).any(dim=1)
    assert nan_rows.nonzero().flatten().tolist() == [QO[0] - 1]  # the one row that sees the key
    assert torch.equal(out[~nan_rows], clean[~nan_rows])
    b.q[2, 1, 0] = math.nan  # a NaN query: every score of row 2, head 1 is NaN
    out, lse = ref_paged(spec, b, return_lse=True)
    assert torch.isnan(out[2, 1]).all() and torch.isnan(lse[2, 1])
    assert torch.isfinite(lse[2, 0]) and torch.equal(lse[5:], clean_lse[5:])


def test_comparisons_require_equal_nan_positions():
    ref = torch.tensor([[1.0, math.nan], [2.0, math.inf], [3.0, 4.0]])
    same = ref.clone()
    assert not nan_positions_differ(same, ref).any()
    assert_close_with_nans(same, ref, atol=0, rtol=0)
    out = torch.tensor([[1.0, 0.0], [2.0, math.nan], [math.nan, 4.0]])  # NaN lost, NaN for inf, NaN added
    assert nan_positions_differ(out, ref).tolist() == [True, True, True]
    try:
        assert_close_with_nans(out, ref, atol=1, rtol=1, label="case")
    except AssertionError as e:
        assert "3 rows have NaN/inf" in str(e)
    else:
        raise AssertionError("a lost NaN passed")
