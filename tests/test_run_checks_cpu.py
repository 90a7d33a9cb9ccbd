"""What reaches a kernel is checked (variantgen/checks.py), on the CPU through the fake kernels.

* every entry of the planned page list is a page of the KV cache run() is given (run()
  raises; plan() for negative entries, and in CUDA-graph mode against the captured cache);
  the launches read plan()'s copy of the page list;
* indptrs start at 0; out, q and the KV cache have the layout and alignment the kernels assume;
* check_plan=True: run() refuses spec tensors changed in place since plan() planned from
  them; a captured run() records the comparison and the next plan() refuses.

Each over the paths that build launches: prefill planner-off and interval-planned (the fake
planner module: the reference row rules, and the real launch builder), fa2 and fa3 fakes,
decode on CUDA cores (key trimming on and off) and tensor cores, graph mode.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from _fake_decode import FakeDecodeModule
from _fake_kernel import FakeFa3Module, FakeModule, FakeRowPlanner
from conftest import SPECS_DIR

import variantgen
from variantgen import render
from variantgen.build import BuildResult
from variantgen.cache import Entry
from variantgen.checks import PageBoundsReader, used_bounds
from variantgen.decode import DecodeWrapper
from variantgen.errors import LaunchError
from variantgen.graph import GraphCapacity
from variantgen.reference import reference_attention
from variantgen.testing import random_paged_batch, random_spec_args, spans_to_ranges
from variantgen.wrapper import VariantWrapper, WrapperBase

HQ, HKV, HEAD_DIM = 4, 2, 64
PREFILL_PATHS = [("fa2", False), ("fa2", True), ("fa3", False), ("fa3", True)]
PREFILL_IDS = ["fa2-direct", "fa2-planner", "fa3-direct", "fa3-planner"]


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


def spec_named(name: str) -> variantgen.VariantSpec:
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


def fake_build(spec, config) -> BuildResult:
    manifest = {"scalar_args": [a.name for a in render.kernel_args(spec)[1]],
                "module_sha256": "x", "module_file": "x.so"}
    return BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                       built=False, seconds=0.0)


def prefill(spec, backend="fa2", **kwargs) -> tuple[VariantWrapper, FakeModule]:
    config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", backend)
    fake = (FakeFa3Module if backend == "fa3" else FakeModule)(spec)
    w = VariantWrapper(spec, config, fake, fake_build(spec, config), torch.empty(1 << 20, dtype=torch.uint8),
                       **kwargs)
    w.set_row_planner(FakeRowPlanner(spec))
    return w, fake


def decoder(spec, *, tensor_cores: bool, **kwargs) -> tuple[DecodeWrapper, object]:
    config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", "fa2",
                                 kind="prefill" if tensor_cores else "decode")
    fake = FakeModule(spec) if tensor_cores else FakeDecodeModule(spec)
    w = DecodeWrapper(spec, config, fake, fake_build(spec, config), torch.empty(1 << 20, dtype=torch.uint8),
                      **kwargs)
    if tensor_cores:
        w.set_row_planner(FakeRowPlanner(spec))
    return w, fake


def mm_case(qo_lens=(7, 5), kv_lens=(7, 30), page_size=4, seed=4):
    spec = spec_named("mm_prefix")
    batch = random_paged_batch(list(qo_lens), list(kv_lens), num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=page_size, seed=seed)
    return spec, batch, random_spec_args(spec, batch, seed=seed)


def plan_prefill(w, batch, args, planner: bool, kv_indices=None, **overrides):
    plan = dict(zip(("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
                     "num_kv_heads", "page_size"), batch.plan_args()))
    if kv_indices is not None:
        plan["paged_kv_indices"] = kv_indices
    plan.update(overrides)
    w.plan(**plan, skip_tiles=planner, **(args if planner else {}))


def assert_reference(spec, out, batch, args, kv_indices=None, cache=None, qo_indptr=None):
    k, v = cache if cache is not None else (batch.k_cache, batch.v_cache)
    qo = qo_indptr if qo_indptr is not None else batch.qo_indptr
    ref = reference_attention(spec, batch.q, (k, v), qo, batch.kv_indptr,
                              batch.kv_indices if kv_indices is None else kv_indices, batch.last_page_len, args)
    ref_bf16 = ref.to(torch.bfloat16).float()
    err = ((out.float() - ref_bf16).norm() / ref_bf16.norm().clamp_min(1e-12)).item()
    assert err < 1e-3, f"rel. error {err:.2e}"


def with_extra_page(batch):
    """The batch's cache with one more page (number batch.k_cache.shape[0]) of random keys."""
    g = torch.Generator().manual_seed(99)
    extra = torch.randn(1, *batch.k_cache.shape[1:], generator=g).to(batch.k_cache.dtype)
    return torch.cat([batch.k_cache, extra]), torch.cat([batch.v_cache, -extra])


# ----------------------------------------------------------------------------- page numbers


@pytest.mark.parametrize("backend, planner", PREFILL_PATHS, ids=PREFILL_IDS)
def test_prefill_page_past_the_cache_is_refused_by_run(backend, planner):
    spec, batch, args = mm_case()
    pages = batch.k_cache.shape[0]
    assert pages == 10 and batch.kv_indptr[-1] == 10
    kv = batch.kv_indices.clone()
    kv[6] = pages  # one past the last page
    w, fake = prefill(spec, backend)
    plan_prefill(w, batch, args, planner, kv)
    with pytest.raises(LaunchError, match=exact(
            "run(): paged_kv_indices[6]=10 is not a page of the KV cache run() was given (10 pages: expected "
            "0 <= page < 10)")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    assert fake.run_calls == []  # nothing launched
    # the same plan on a cache that has page 10
    cache = with_extra_page(batch)
    out = w.run(batch.q, cache, **args)
    assert_reference(spec, out, batch, args, kv, cache)


@pytest.mark.parametrize("backend, planner", PREFILL_PATHS, ids=PREFILL_IDS)
def test_prefill_negative_page_is_refused_by_plan(backend, planner):
    spec, batch, args = mm_case()
    kv = batch.kv_indices.clone()
    kv[3] = -1
    w, fake = prefill(spec, backend)
    plan_prefill(w, batch, args, planner)  # a good plan first: a refused one must not leave it runnable
    with pytest.raises(LaunchError, match=exact(
            "plan(): paged_kv_indices[3]=-1 is not a page number (expected 0 <= page < the KV cache's page count)")):
        plan_prefill(w, batch, args, planner, kv)
    with pytest.raises(LaunchError, match=r"^run\(\) called before plan\(\)"):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)


@pytest.mark.parametrize("backend, planner", PREFILL_PATHS, ids=PREFILL_IDS)
def test_prefill_entries_past_the_batch_are_not_pages(backend, planner):
    """A caller's page buffer may be longer than paged_kv_indptr[-1]; what lies past it is not read."""
    spec, batch, args = mm_case()
    kv = torch.cat([batch.kv_indices, torch.tensor([-7, 1 << 30], dtype=torch.int32)])
    w, _ = prefill(spec, backend)
    plan_prefill(w, batch, args, planner, kv)
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)


@pytest.mark.parametrize("backend, planner", PREFILL_PATHS, ids=PREFILL_IDS)
def test_prefill_launches_read_plans_copy_of_the_page_list(backend, planner):
    """Changing paged_kv_indices after plan() changes nothing: the launches hold plan()'s copy
    (which is what was checked)."""
    spec, batch, args = mm_case()
    kv = batch.kv_indices.clone()
    w, _ = prefill(spec, backend)
    plan_prefill(w, batch, args, planner, kv)
    kv.fill_(1 << 20)  # every entry far outside the cache now
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)
    # ... and a bad entry plan() saw stays refused after the caller repaired its tensor
    kv.copy_(batch.kv_indices)
    kv[2] = 10
    plan_prefill(w, batch, args, planner, kv)
    kv[2] = batch.kv_indices[2]
    with pytest.raises(LaunchError, match=exact(
            "run(): paged_kv_indices held page 10 when plan() read it, which is not a page of the KV cache run() was "
            "given (10 pages: expected 0 <= page < 10)")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)


def test_empty_page_list_needs_no_pages():
    """Requests without keys (and so without queries): nothing to check against any cache."""
    spec = spec_named("causal")
    w, fake = prefill(spec)
    i32 = dict(dtype=torch.int32)
    w.plan(torch.zeros(3, **i32), torch.zeros(3, **i32), torch.empty(0, **i32), torch.zeros(2, **i32), HQ, HKV, 4)
    k = torch.empty(0, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)
    out = w.run(torch.empty(0, HQ, HEAD_DIM, dtype=torch.bfloat16), (k, k))
    assert out.shape == (0, HQ, HEAD_DIM) and fake.run_calls == []


@pytest.mark.parametrize("tensor_cores, trim", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["cuda_cores", "cuda_cores-trimmed", "tensor_cores", "tensor_cores-planner"])
def test_decode_page_numbers(tensor_cores, trim):
    spec = spec_named("sliding_window")
    batch = random_paged_batch([1] * 3, [5, 30, 9], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=4, seed=5)
    args = {"window": 6}
    pages = batch.k_cache.shape[0]
    kvp = batch.kv_indptr.tolist()
    plan_kw = dict(skip_tiles=trim, **(args if trim else {}))
    kv = (batch.k_cache, batch.v_cache)
    # the last page of the second request: read with trimming too (its query's window)
    at = kvp[2] - 1
    bad = batch.kv_indices.clone()
    bad[at] = pages
    w, fake = decoder(spec, tensor_cores=tensor_cores)
    w.plan(batch.kv_indptr, bad, batch.last_page_len, HQ, HKV, 4, **plan_kw)
    with pytest.raises(LaunchError, match=exact(
            f"run(): paged_kv_indices[{at}]={pages} is not a page of the KV cache run() was given ({pages} pages: "
            f"expected 0 <= page < {pages})")):
        w.run(batch.q, kv, **args)
    assert fake.run_calls == []
    bad[at] = -3
    with pytest.raises(LaunchError, match=exact(
            f"plan(): paged_kv_indices[{at}]=-3 is not a page number (expected 0 <= page < the KV cache's page "
            "count)")):
        w.plan(batch.kv_indptr, bad, batch.last_page_len, HQ, HKV, 4, **plan_kw)
    # plan()'s copy of the page list is what the kernel reads
    kv_indices = batch.kv_indices.clone()
    w.plan(batch.kv_indptr, kv_indices, batch.last_page_len, HQ, HKV, 4, **plan_kw)
    kv_indices.fill_(1 << 20)
    out = w.run(batch.q, kv, **args)
    assert_reference(spec, out, batch, args, qo_indptr=torch.arange(4, dtype=torch.int32))


# ----------------------------------------------------------------------------- indptrs start at 0


@pytest.mark.parametrize("planner", [False, True], ids=["direct", "planner"])
def test_prefill_indptrs_start_at_zero(planner):
    spec, batch, args = mm_case()
    w, fake = prefill(spec)
    with pytest.raises(LaunchError, match=exact(
            "plan(): `qo_indptr`[0]=2: expected 0 (rows are packed from the first row of the tensor)")):
        plan_prefill(w, batch, args, planner, qo_indptr=batch.qo_indptr + 2)
    shifted = torch.cat([torch.zeros(1, dtype=torch.int32), batch.kv_indices])
    with pytest.raises(LaunchError, match=exact(
            "plan(): `paged_kv_indptr`[0]=1: expected 0 (page lists are packed from the first entry of "
            "`paged_kv_indices`)")):
        plan_prefill(w, batch, args, planner, shifted, paged_kv_indptr=batch.kv_indptr + 1)
    assert fake.plan_calls == []


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_decode_page_indptr_starts_at_zero(tensor_cores):
    batch = random_paged_batch([1] * 2, [5, 9], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4)
    w, fake = decoder(spec_named("causal"), tensor_cores=tensor_cores)
    shifted = torch.cat([torch.zeros(2, dtype=torch.int32), batch.kv_indices])
    with pytest.raises(LaunchError, match=exact(
            "plan(): `paged_kv_indptr`[0]=2: expected 0 (page lists are packed from the first entry of "
            "`paged_kv_indices`)")):
        w.plan(batch.kv_indptr + 2, shifted, batch.last_page_len, HQ, HKV, 4)
    assert fake.plan_calls == []


# ----------------------------------------------------------------------------- out, q, the cache


def bad_outputs(rows: int) -> list[tuple[torch.Tensor, str]]:
    bf16 = torch.bfloat16
    transposed = torch.empty(HQ, rows, HEAD_DIM, dtype=bf16).transpose(0, 1)
    expanded = torch.empty(1, HQ, HEAD_DIM, dtype=bf16).expand(rows, HQ, HEAD_DIM)
    shifted = torch.empty(rows * HQ * HEAD_DIM + 1, dtype=bf16)[1:].view(rows, HQ, HEAD_DIM)
    contiguous = "run(): `out` must be contiguous (the kernel writes rows of num_qo_heads * head_dim_vo elements " \
                 "back to back; got strides {})"
    return [
        (transposed, contiguous.format([HEAD_DIM, rows * HEAD_DIM, 1])),
        (expanded, contiguous.format([0, HEAD_DIM, 1])),
        (shifted, "run(): `out` must start at a 16-byte boundary (the kernel writes 16-byte vectors); call "
                  ".contiguous() on a fresh tensor"),
    ]


@pytest.mark.parametrize("backend, planner", PREFILL_PATHS, ids=PREFILL_IDS)
def test_prefill_out_must_be_contiguous_and_aligned(backend, planner):
    spec, batch, args = mm_case()
    w, fake = prefill(spec, backend)
    plan_prefill(w, batch, args, planner)
    for out, message in bad_outputs(12):
        with pytest.raises(LaunchError, match=exact(message)):
            w.run(batch.q, (batch.k_cache, batch.v_cache), out=out, **args)
    assert fake.run_calls == []


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_decode_out_must_be_contiguous_and_aligned(tensor_cores):
    batch = random_paged_batch([1] * 3, [5, 9, 2], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4)
    w, fake = decoder(spec_named("causal"), tensor_cores=tensor_cores)
    w.plan(batch.kv_indptr, batch.kv_indices, batch.last_page_len, HQ, HKV, 4)
    for out, message in bad_outputs(3):
        with pytest.raises(LaunchError, match=exact(message)):
            w.run(batch.q, (batch.k_cache, batch.v_cache), out=out)
    assert fake.run_calls == []


@pytest.mark.parametrize("backend, planner", PREFILL_PATHS, ids=PREFILL_IDS)
def test_prefill_q_rows_strided_but_aligned(backend, planner):
    spec, batch, args = mm_case()
    w, _ = prefill(spec, backend)
    plan_prefill(w, batch, args, planner)
    wide = torch.cat([batch.q, batch.q], dim=-1)[..., :HEAD_DIM]  # row stride 2 * HQ * HEAD_DIM
    assert_reference(spec, w.run(wide, (batch.k_cache, batch.v_cache), **args), batch, args)
    odd = torch.zeros(12, HQ, HEAD_DIM + 1, dtype=torch.bfloat16)[..., :HEAD_DIM]
    odd.copy_(batch.q)
    with pytest.raises(LaunchError, match=exact(
            "run(): `q`: rows must start at 16-byte boundaries (data pointer and strides [260, 65, 1] in multiples "
            "of 8 elements); call .contiguous()")):
        w.run(odd, (batch.k_cache, batch.v_cache), **args)
    with pytest.raises(LaunchError, match=exact("run(): `q` must have a contiguous last dimension (stride "
                                                "(256, 1, 4))")):
        w.run(batch.q.transpose(1, 2).contiguous().transpose(1, 2), (batch.k_cache, batch.v_cache), **args)


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_paged_cache_strides_alignment_and_page_counts(tensor_cores):
    batch = random_paged_batch([1] * 3, [5, 9, 2], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4)
    w, fake = decoder(spec_named("causal"), tensor_cores=tensor_cores)
    w.plan(batch.kv_indptr, batch.kv_indices, batch.last_page_len, HQ, HKV, 4)
    pages = batch.k_cache.shape[0]

    def padded(t, width):
        wide = torch.zeros(*t.shape[:3], width, dtype=t.dtype)
        wide[..., :HEAD_DIM] = t
        return wide[..., :HEAD_DIM]

    k, v = padded(batch.k_cache, HEAD_DIM + 1), padded(batch.v_cache, HEAD_DIM + 1)
    with pytest.raises(LaunchError, match=exact(
            f"run(): `k_cache`: pages and rows must start at 16-byte boundaries (data pointer and strides "
            f"[{4 * HKV * 65}, {HKV * 65}, 65, 1] in multiples of 8 elements)")):
        w.run(batch.q, (k, v))
    # padded to a 16-byte multiple: fine (the kernels take the cache's strides)
    k, v = padded(batch.k_cache, HEAD_DIM + 8), padded(batch.v_cache, HEAD_DIM + 8)
    out = w.run(batch.q, (k, v))
    assert_reference(spec_named("causal"), out, batch, {}, qo_indptr=torch.arange(4, dtype=torch.int32))
    k, v = with_extra_page(batch)
    with pytest.raises(LaunchError, match=exact(
            f"run(): k_cache has {pages} pages and v_cache {pages + 1}; expected the same page count (a page number "
            "addresses both)")):
        w.run(batch.q, (batch.k_cache, v))


# ----------------------------------------------------------------------------- the device-side bounds


def test_used_bounds_ignores_entries_past_the_batch():
    """The reduction plan() folds into its read of device indptrs (checks.used_bounds), on CPU tensors."""
    kv = torch.tensor([5, 3, 9, -4, 1 << 30], dtype=torch.int32)
    positions = torch.arange(5, dtype=torch.int32)
    # entries past the batch count as page 0 (always in range): the low bound is only ever read for < 0
    for entries, want in ((3, (0, 9)), (4, (-4, 9)), (5, (-4, 1 << 30)), (0, (0, 0))):
        low, high = used_bounds(kv, torch.tensor([entries], dtype=torch.int32), positions)
        assert (int(low), int(high)) == want, entries


def test_page_bounds_on_the_host_read_nothing_back():
    reader = PageBoundsReader()
    kv = torch.tensor([4, 2, 8, -1], dtype=torch.int32)
    assert reader.fold(kv, torch.tensor([0, 3], dtype=torch.int32)) == []  # host tensors: no fold
    reader.begin(kv, 3, [])
    assert (reader.result().low, reader.result().high, reader.result().entries) == (2, 8, 3)
    reader.begin(kv, 0, [])
    assert reader.result().high == -1
    reader.begin(kv, 4, [-1, 8])  # values plan() read back with its indptrs
    assert (reader.result().low, reader.result().high) == (-1, 8)


# ----------------------------------------------------------------------------- CUDA-graph mode

CAP = GraphCapacity(max_batch_size=4, max_total_q=64, max_kv_pages=16)


def graph_prefill(spec, **kwargs):
    return prefill(spec, graph=CAP, **kwargs)


def capture(monkeypatch, w, run):
    """run() as under CUDA-graph capture (WrapperBase._capturing): what a captured graph records."""
    monkeypatch.setattr(WrapperBase, "_capturing", lambda self: True)
    try:
        return run()
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("planner", [False, True], ids=["direct", "planner"])
def test_graph_plan_checks_pages_against_the_captured_cache(monkeypatch, planner):
    spec, batch, args = mm_case()
    w, _ = graph_prefill(spec)
    k = torch.zeros(CAP.max_kv_pages, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)
    k[:batch.k_cache.shape[0]] = batch.k_cache
    v = torch.zeros_like(k)
    v[:batch.v_cache.shape[0]] = batch.v_cache
    bad = batch.kv_indices.clone()
    bad[4] = CAP.max_kv_pages
    # not captured yet: plan() has no cache to check against, run() has
    plan_prefill(w, batch, args, planner, bad)
    with pytest.raises(LaunchError, match=r"^run\(\): paged_kv_indices\[4\]=16 is not a page of the KV cache run\(\)"):
        w.run(batch.q, (k, v), **args)
    plan_prefill(w, batch, args, planner)
    w.run(batch.q, (k, v), **args)  # an eager warm-up records nothing
    plan_prefill(w, batch, args, planner, bad)
    plan_prefill(w, batch, args, planner)
    capture(monkeypatch, w, lambda: w.run(batch.q, (k, v), **args))
    with pytest.raises(LaunchError, match=exact(
            "plan(): paged_kv_indices[4]=16 is not a page of the KV cache the CUDA graph was captured with (16 pages: "
            "expected 0 <= page < 16)")):
        plan_prefill(w, batch, args, planner, bad)
    plan_prefill(w, batch, args, planner)  # the good batch plans again


def test_graph_decode_on_cuda_cores_checks_pages_against_the_captured_cache(monkeypatch):
    spec = spec_named("causal")
    cap = GraphCapacity(max_batch_size=2, max_total_q=2, max_kv_pages=8)
    w, _ = decoder(spec, tensor_cores=False, graph=cap)
    batch = random_paged_batch([1, 1], [5, 9], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4)
    k = torch.zeros(cap.max_kv_pages, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)
    plan = (batch.kv_indptr, batch.kv_indices, batch.last_page_len, HQ, HKV, 4)
    w.plan(*plan)
    capture(monkeypatch, w, lambda: w.run(batch.q, (k, k)))
    bad = batch.kv_indices.clone()
    bad[0] = 8
    with pytest.raises(LaunchError, match=exact(
            "plan(): paged_kv_indices[0]=8 is not a page of the KV cache the CUDA graph was captured with (8 pages: "
            "expected 0 <= page < 8)")):
        w.plan(batch.kv_indptr, bad, *plan[2:])


# ----------------------------------------------------------------------------- check_plan


def rewrite_ranges(ranges: torch.Tensor) -> None:
    """Every query sees only its own key from now on (a different interval plan)."""
    ranges[:, 0] = -1
    ranges[:, 1] = -1


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_check_plan_refuses_a_planned_tensor_changed_in_place(backend):
    spec, batch, args = mm_case(qo_lens=(20, 9), kv_lens=(40, 9), seed=6)
    w, fake = prefill(spec, backend, check_plan=True)
    assert w.check_plan
    plan_prefill(w, batch, args, True)
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)
    calls = len(fake.run_calls)
    rewrite_ranges(args["ranges"])
    with pytest.raises(LaunchError, match=exact(
            "run(): `ranges` changed since plan() read it (check_plan=True): the launches were planned from its old "
            "values, so the output would be wrong. Call plan() again after changing `ranges`; run() does not "
            "re-plan")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    assert len(fake.run_calls) == calls
    plan_prefill(w, batch, args, True)  # planned again: runs, and matches the new ranges
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)


def test_without_the_planner_the_kernel_reads_spec_tensors_in_run():
    """The contract's other half: what plan() does not plan from may change between runs (the
    kernel reads it), and check_plan has nothing to refuse then."""
    spec, batch, args = mm_case(qo_lens=(20, 9), kv_lens=(40, 9), seed=6)
    w, _ = prefill(spec, check_plan=True)
    plan_prefill(w, batch, args, False)
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)
    rewrite_ranges(args["ranges"])
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)


def test_check_plan_defaults_to_the_environment(vg_env):
    spec, batch, args = mm_case()
    assert not prefill(spec)[0].check_plan
    assert vg_env.set(VARIANTGEN_CHECK_PLAN="1").check_plan
    w, _ = prefill(spec)
    assert w.check_plan and not prefill(spec, check_plan=False)[0].check_plan
    plan_prefill(w, batch, args, True)
    args["ranges"][0, 1] += 1
    with pytest.raises(LaunchError, match=r"^run\(\): `ranges` changed since plan\(\) read it"):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    with pytest.raises(LaunchError, match=exact("check_plan='yes': expected a bool (or None: VARIANTGEN_CHECK_PLAN)")):
        prefill(spec, check_plan="yes")


def test_check_plan_in_graph_mode_refuses_at_the_next_plan(monkeypatch):
    """A replayed run() runs no host code: the captured comparison flags a planned tensor
    changed since the plan it replays, and the next plan() raises (then starts afresh)."""
    spec = spec_named("mm_prefix")
    w, fake = graph_prefill(spec, check_plan=True)
    qo_lens, kv_lens = [20, 9], [40, 9]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4,
                               seed=6)
    static = torch.full((CAP.max_total_q, 2), -1, dtype=torch.int32)  # the engine's static buffer
    static[:29] = spans_to_ranges(qo_lens, kv_lens, [[(0, 30)], [(2, 8)]])
    k = torch.zeros(CAP.max_kv_pages, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)
    k[:batch.k_cache.shape[0]] = batch.k_cache
    q = torch.full((CAP.max_total_q, HQ, HEAD_DIM), math.nan, dtype=torch.bfloat16)
    q[:29] = batch.q
    out = torch.empty_like(q)

    def replay():  # what the captured graph does on replay: run()'s device work
        capture(monkeypatch, w, lambda: w.run(q, (k, k), out=out, ranges=static))

    w.plan(*batch.plan_args(), ranges=static)
    replay()  # the capture itself
    static[:29] = spans_to_ranges(qo_lens, kv_lens, [[(5, 39)], []])  # the normal flow: new values, plan, replay
    w.plan(*batch.plan_args(), ranges=static)
    replay()
    w.plan(*batch.plan_args(), ranges=static)
    replay()
    static[3, 0] = 0  # changed between replays, without a plan()
    replay()
    replay()
    with pytest.raises(LaunchError, match=exact(
            "plan(): `ranges` changed after the previous plan() read it, and a replay of the captured run() ran with "
            "the new values (check_plan=True): that replay's launches were planned from the old values, so its "
            "output was wrong. Call plan() after changing a tensor the plan reads, before replaying")):
        w.plan(*batch.plan_args(), ranges=static)
    w.plan(*batch.plan_args(), ranges=static)  # reported once; this plan reads the new values
    replay()
    w.plan(*batch.plan_args(), ranges=static)
    # an eager run() in graph mode checks on the spot
    static[4, 1] = 1
    with pytest.raises(LaunchError, match=r"^run\(\): `ranges` changed since plan\(\) read it"):
        w.run(q, (k, k), out=out, ranges=static)


def test_check_plan_for_decode_key_trimming():
    """CUDA-core decode trims page lists from doc_ids in plan(); the tensor-core path hands
    check_plan to its prefill wrapper."""
    spec = spec_named("document")
    batch = random_paged_batch([1] * 3, [9, 30, 5], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4,
                               seed=2)
    args = random_spec_args(spec, batch, seed=2)
    for tensor_cores in (False, True):
        doc_ids = args["doc_ids"].clone()
        w, _ = decoder(spec, tensor_cores=tensor_cores, check_plan=True)
        w.plan(batch.kv_indptr, batch.kv_indices, batch.last_page_len, HQ, HKV, 4, skip_tiles=True, doc_ids=doc_ids)
        w.run(batch.q, (batch.k_cache, batch.v_cache), doc_ids=doc_ids)
        doc_ids[10] += 1
        with pytest.raises(LaunchError, match=r"^run\(\): `doc_ids` changed since plan\(\) read it"):
            w.run(batch.q, (batch.k_cache, batch.v_cache), doc_ids=doc_ids)
