"""One request's NaN or inf stays in that request on the flex route - its dense CPU path and
Flex's compiled kernel (which computes whole blocks, as on the GPU) - for paged prefill, ragged
and decode batches, and on the fa2 / fa3 ragged routes over the fake kernels (the fa3 fake loads
whole KV tiles past a request's last key, as FlashInfer's sm90 kernel does): every other
request's rows are finite and equal to the reference's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _fake_ragged import FakeFa3RaggedModule, FakeRaggedModule
from conftest import SPECS_DIR

import variantgen
from variantgen.abi.table import RAGGED_KV_GAP
from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import render
from variantgen.testing.harness import assert_close_with_nans, poison_keys, random_paged_batch, rows_of_requests
from variantgen.wrappers.flex_wrapper import make_flex_wrapper
from variantgen.wrappers.ragged import RaggedWrapper, random_ragged_batch, reference_ragged
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


# ----------------------------------------------------------------------------- the fa2 / fa3 ragged routes


def ragged_wrapper(spec, backend: str, kv_layout: str):
    """RaggedWrapper (bf16, head dim 64) on the fake module of ``backend`` (tests/fakes/_fake_ragged.py)."""
    config = render.ModuleConfig(spec, D, D, "bf16", "bf16", "bf16", "9.0a", backend, kind="ragged")
    manifest = {"scalar_args": [a.name for a in render.render_module(config).scalar_args], "module_sha256": "x",
                "module_file": "x.so"}
    fake = {"fa2": FakeRaggedModule, "fa3": FakeFa3RaggedModule}[backend](spec)
    build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                        built=False, seconds=0.0)
    return RaggedWrapper(spec, config, fake, build, torch.empty(1 << 20, dtype=torch.uint8), kv_layout), fake


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("spec_name", ["causal", "document"])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_ragged_kernels_keep_a_bad_value_in_its_request(backend, spec_name, value, kv_layout):
    """Request 1's first and last key poisoned, in K and V. The fa3 fake reads request 0's keys in
    a whole 128-row tile - without the gap run() puts between requests, request 1's and 2's keys
    too, and 0 x NaN reaches request 0's rows (the bug found on an H100). ``document`` reads a
    [total_kv] tensor by kv_row: the caller's rows, whatever rows the kernel loads keys from."""
    spec = variantgen.load_spec(SPECS_DIR / f"{spec_name}.yaml")
    qo, kv = [5, 3, 7], [9, 40, 20]
    b = random_ragged_batch(qo, kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, seed=4)
    poison_keys(b.k, b.v, kv, 1, value)
    args = {"doc_ids": torch.cat([torch.arange(n, dtype=torch.int32) // 4 for n in kv])} if spec_name == "document" \
        else {}
    k, v = (b.k, b.v) if kv_layout == "NHD" else (b.k.transpose(0, 1).contiguous(), b.v.transpose(0, 1).contiguous())
    w, fake = ragged_wrapper(spec, backend, kv_layout)
    w.plan(*b.plan_args())
    out = w.run(b.q, k, v, **args)
    ref = reference_ragged(spec, b.q, b.k, b.v, b.qo_indptr, b.kv_indptr, args)
    others = ~rows_of_requests(qo, [1])
    label = f"{backend} ragged {spec_name} {value} {kv_layout}"
    assert torch.isfinite(out[others].float()).all(), f"{label}: NaN/inf in rows of requests other than 1"
    err = ((out[others].float() - ref[others]).norm() / ref[others].norm()).item()
    assert err < 1e-2, f"{label}: rel. error {err:.2e}"
    assert not torch.isfinite(ref[~others]).all()  # (the poison reached its own request in the reference)
    if backend == "fa3":  # the kernel read the padded copy: each request's keys then RAGGED_KV_GAP zero rows
        (call,) = fake.ragged_calls
        assert call["kv_rows"] == sum(kv) + len(kv) * RAGGED_KV_GAP
        assert call["kv_first"] == [0, 9 + RAGGED_KV_GAP, 49 + 2 * RAGGED_KV_GAP]
