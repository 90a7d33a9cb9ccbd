"""What reaches a kernel is checked (variantgen/wrappers/checks.py), on the CPU through the fake kernels.

* every entry of the planned page list is a page of the KV cache run() is given (run()
  raises; plan() for negative entries, and in CUDA-graph mode against the captured cache);
  the launches read plan()'s copy of the page list;
* where the list's bounds are still on their way from the GPU (emulated: BoundsOnTheirWay,
  with every wait for the GPU made to fail), plan() does not wait, run() clamps the kernels'
  copy of the list (the fake kernels refuse a page outside the cache), the next call reports;
  a captured run() records the clamp and the next plan() reports;
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
from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import render
from variantgen.core.errors import LaunchError
from variantgen.planning.graph import GraphCapacity
from variantgen.testing.harness import random_paged_batch, random_spec_args, spans_to_ranges
from variantgen.wrappers import checks
from variantgen.wrappers.base import WrapperBase
from variantgen.wrappers.checks import NO_PAGES, PageBounds, PageGuard
from variantgen.wrappers.decode import DecodeWrapper
from variantgen.wrappers.paged import VariantWrapper
from variantgen.wrappers.reference import reference_attention

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


# ----------------------------------------------------------------------------- lengths within int32

PAGED_ROUTES = ["fa2-direct", "fa2-planner", "fa3-direct", "fa3-planner", "decode-cuda_cores",
                "decode-tensor_cores", "flex-prefill", "flex-decode"]


def plan_route(route: str, kv_indptr, kv_indices, last_page_len, page_size: int) -> None:
    """plan() of a causal batch of one query per request on ``route`` (PAGED_ROUTES)."""
    spec = spec_named("causal")
    batch = kv_indptr.numel() - 1
    if route.startswith("flex"):
        from variantgen.wrappers.flex_wrapper import make_flex_wrapper

        kind = route.partition("-")[2]
        w = make_flex_wrapper(spec, torch.empty(16, dtype=torch.uint8), head_dim_qk=HEAD_DIM, q_dtype="bf16",
                              kv_dtype="bf16", kind=kind)
    elif route.startswith("decode"):
        w, _ = decoder(spec, tensor_cores=route.endswith("tensor_cores"))
        kind = "decode"
    else:
        backend, _, path = route.partition("-")
        w, _ = prefill(spec, backend)
        kind = "prefill"
    plan = (kv_indptr, kv_indices, last_page_len, HQ, HKV, page_size)
    if kind == "decode":
        w.plan(*plan)
    else:
        w.plan(torch.arange(batch + 1, dtype=torch.int32), *plan, skip_tiles=route.endswith("planner"))


@pytest.mark.parametrize("route", PAGED_ROUTES)
def test_plan_refuses_lengths_past_int32(route):
    """A batch's keys (the sum of its kv lengths) must fit the kernels' int32 positions and rows
    (a regression: fa2's vg_meta wrapped, fa3 raised from C++, CUDA-core decode raised from
    torch, flex tried to allocate the keys)."""
    i32 = dict(dtype=torch.int32)
    with pytest.raises(LaunchError, match=exact("plan(): page_size=2147483648: expected a positive int below 2**31")):
        plan_route(route, torch.tensor([0, 1], **i32), torch.zeros(1, **i32), torch.ones(1, **i32), 2**31)
    # three pages of 2**30 keys: one request past int32
    with pytest.raises(LaunchError, match=exact(
            "plan(): the batch has 2147483649 keys (request 0: 2147483649), expected at most 2**31 - 1 = 2147483647 "
            "(the kernels' key positions and rows are int32): check page_size=1073741824, paged_kv_indptr and "
            "paged_kv_last_page_len (a request's keys: (its pages - 1) * page_size + its last page's length)")):
        plan_route(route, torch.tensor([0, 3], **i32), torch.tensor([0, 1, 2], **i32), torch.ones(1, **i32), 2**30)
    # requests within int32, the batch past it (a page list reusing one page)
    pages, page_size = 1024, 2**20
    with pytest.raises(LaunchError, match=exact(
            "plan(): the batch has 3221225472 keys (request 0: 1073741824), expected at most 2**31 - 1 = 2147483647 "
            f"(the kernels' key positions and rows are int32): check page_size={page_size}, paged_kv_indptr and "
            "paged_kv_last_page_len (a request's keys: (its pages - 1) * page_size + its last page's length)")):
        plan_route(route, torch.arange(0, 4 * pages, pages, **i32), torch.zeros(3 * pages, **i32),
                   torch.full((3,), page_size, **i32), page_size)
    if route.startswith("flex"):
        return  # (flex would lay out every key of the batch at the limit)
    # at the limit: planned
    plan_route(route, torch.tensor([0, pages, 2 * pages], **i32), torch.zeros(2 * pages, **i32),
               torch.tensor([page_size, page_size - 1], **i32), page_size)


# ----------------------------------------------------------------------------- bool flags

FLAG_ROUTES = ["fa2-prefill", "fa3-prefill", "graph-prefill", "decode-cuda_cores", "decode-tensor_cores",
               "graph-decode-cuda_cores", "ragged-fa2", "ragged-fa3", "flex-prefill", "flex-decode", "flex-ragged"]


class FlagRoute:
    """A causal wrapper of one route (FLAG_ROUTES), its fake module (None on flex) and a batch,
    with plan() and run() taking the flags as keywords."""

    def __init__(self, route: str):
        from _fake_ragged import FakeFa3RaggedModule, FakeRaggedModule

        from variantgen.wrappers.flex_wrapper import make_flex_wrapper
        from variantgen.wrappers.ragged import RaggedWrapper, random_ragged_batch

        spec = spec_named("causal")
        kind = "ragged" if "ragged" in route else "decode" if "decode" in route else "prefill"
        self.kind, self.fake = kind, None
        if kind == "ragged":
            self.batch = random_ragged_batch([3, 5], [7, 5], num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=HEAD_DIM)
        else:
            qo = [1, 1, 1] if kind == "decode" else [3, 5, 1]
            self.batch = random_paged_batch(qo, [7, 5, 9], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                                            page_size=4)
        if route.startswith("flex"):
            self.w = make_flex_wrapper(spec, torch.empty(16, dtype=torch.uint8), head_dim_qk=HEAD_DIM,
                                       q_dtype="bf16", kv_dtype="bf16", kind=kind)
        elif kind == "ragged":
            backend = route.partition("-")[2]
            config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", backend,
                                         kind="ragged")
            self.fake = (FakeFa3RaggedModule if backend == "fa3" else FakeRaggedModule)(spec)
            self.w = RaggedWrapper(spec, config, self.fake, fake_build(spec, config),
                                   torch.empty(1 << 20, dtype=torch.uint8))
        elif kind == "decode":
            graph = GraphCapacity(max_batch_size=3, max_total_q=3, max_kv_pages=16) if route.startswith("graph") \
                else None
            self.w, self.fake = decoder(spec, tensor_cores=route.endswith("tensor_cores"), graph=graph)
        else:
            self.w, self.fake = prefill(spec, "fa3" if route.startswith("fa3") else "fa2",
                                        graph=CAP if route.startswith("graph") else None)
        self.plan_flags = {"decode": ["skip_tiles"], "ragged": ["disable_split_kv"]}.get(
            kind, ["skip_tiles", "disable_split_kv"])

    def plan(self, **flags) -> None:
        b = self.batch
        self.w.plan(*(b.plan_args()[1:] if self.kind == "decode" else b.plan_args()), **flags)

    def run(self, **flags):
        b = self.batch
        kv = (b.k, b.v) if self.kind == "ragged" else ((b.k_cache, b.v_cache),)
        return self.w.run(b.q, *kv, **flags)


@pytest.mark.parametrize("route", FLAG_ROUTES)
def test_bool_flags_are_bools(route):
    """skip_tiles, disable_split_kv, return_lse and enable_pdl take True or False (skip_tiles and
    enable_pdl also None), on every route: a truthy value is refused (a regression: skip_tiles=0
    or "false" turned the planner on, disable_split_kv="false" and return_lse="no" read as True,
    enable_pdl="no" reached the module)."""
    case = FlagRoute(route)
    for flag in case.plan_flags:
        optional = flag == "skip_tiles"
        for value in (0, 1, "false", torch.tensor(False), *(() if optional else (None,))):
            want = "True, False or None" if optional else "True or False"
            with pytest.raises(LaunchError, match=exact(f"plan(): `{flag}`={value!r}: expected {want}")):
                case.plan(**{flag: value})
        case.plan(**{flag: False})
    case.plan()
    for flag, optional in (("return_lse", False), ("enable_pdl", True)):
        for value in (0, "no", *(() if optional else (None,))):
            want = "True, False or None" if optional else "True or False"
            with pytest.raises(LaunchError, match=exact(f"run(): `{flag}`={value!r}: expected {want}")):
                case.run(**{flag: value})
    if case.fake is not None:
        assert not case.fake.run_calls
    out, lse = case.run(return_lse=True, enable_pdl=False)
    assert lse.shape == out.shape[:2]
    assert isinstance(case.run(enable_pdl=None), torch.Tensor)


# ----------------------------------------------------------------------------- index tensors plan() reads


@pytest.mark.parametrize("route", FLAG_ROUTES)
def test_index_tensors_plan_cannot_read_are_refused(route):
    """plan() reads its index tensors' values on the host: one on the meta device (no data) is
    refused naming it, on every route (a regression: torch's NotImplementedError "Cannot copy out
    of meta tensor" came from deep inside the read)."""
    case = FlagRoute(route)
    names = {"ragged": ["qo_indptr", "kv_indptr"], "decode": ["paged_kv_indptr", "paged_kv_indices",
             "paged_kv_last_page_len"]}.get(case.kind, ["qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                                                        "paged_kv_last_page_len"])
    given = case.batch.plan_args()[1:] if case.kind == "decode" else case.batch.plan_args()
    for i, name in enumerate(names):
        args = list(given)
        args[i] = args[i].to("meta")
        with pytest.raises(LaunchError, match=exact(
                f"plan(): `{name}` is on meta: expected a tensor on the CPU or a CUDA device (plan() reads its "
                "values)")):
            case.w.plan(*args)
    case.plan()  # the refused plans left nothing behind
    assert isinstance(case.run(), torch.Tensor)


# ----------------------------------------------------------------------------- q/k/v scales

SCALE_ROUTES = ["fa2-prefill", "fa3-prefill", "decode-cuda_cores", "decode-tensor_cores", "ragged-fa2",
                "flex-prefill", "flex-decode", "flex-ragged"]


@pytest.mark.parametrize("route", SCALE_ROUTES)
def test_scales_fit_float32(route):
    """The kernels take the softmax scale (the spec's times q_scale times k_scale, by log2(e)) and
    v_scale as float32: a scale outside float32 range, or a product outside it, is refused (a
    regression: q_scale=1e20, k_scale=1e20 folded into inf, and the output was not finite)."""
    case = FlagRoute(route)
    case.plan()
    for name, value in (("q_scale", 1e300), ("k_scale", -3.5e38), ("v_scale", 1e39)):
        with pytest.raises(LaunchError, match=exact(
                f"run(): `{name}`={value!r}: expected a float in float32 range (|x| <= 3.402823e+38): the kernels "
                "take it as a float32")):
            case.run(**{name: value})
    with pytest.raises(LaunchError, match=re.escape("run(): `k_scale`=10000000000") + ".* characters\\): expected"):
        case.run(k_scale=10**400)
    for scales, product in (({"q_scale": 1e20, "k_scale": 1e20}, "1.25e+39"), ({"q_scale": 3e38, "k_scale": -8},
                                                                                "-3e+38")):
        named = " and ".join(f"{n}={v!r}" for n, v in scales.items())
        with pytest.raises(LaunchError, match=exact(
                f"run(): {named} fold into the softmax scale {product} (the spec's 1/sqrt(head_dim_qk=64) x q_scale x "
                "k_scale), which the kernels take as a float32 times log2(e): expected |softmax scale| <= "
                "2.358657e+38")):
            case.run(**scales)
    if case.fake is not None:
        assert not case.fake.run_calls
    # within range: accepted, 0 too (every visible key weighs the same, as in the reference)
    for scales in ({"q_scale": 3.4e38, "k_scale": 5, "v_scale": -3.4e38}, {"q_scale": 0.0, "v_scale": 0.0}):
        case.run(**scales)


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


def test_page_bounds_on_the_host_read_nothing_back():
    reader = PageGuard()
    kv = torch.tensor([4, 2, 8, -1], dtype=torch.int32)
    reader.begin(kv, 3, [])
    assert reader.bounds == PageBounds(3, 2, 8)
    reader.begin(kv, 0, [])
    assert reader.bounds == NO_PAGES
    reader.begin(kv, 4, [-1, 8])  # values plan() read back with its indptrs
    assert reader.bounds == PageBounds(4, -1, 8)


# ----------------------------------------------------------------------------- the device guard


class InFlight:
    """The in_flight fixture: land() lands every copy on its way; with ``prompt`` set, new copies
    land at once (as where plan() reads something back after starting one)."""

    def __init__(self) -> None:
        self.copies: list[BoundsOnTheirWay] = []
        self.prompt = False

    def land(self) -> None:
        for c in self.copies:
            c.arrived = True


class BoundsOnTheirWay:
    """checks.BoundsCopy behind a busy GPU, emulated on the CPU: every page list counts as a
    device one, and its bounds land only when the test says so (InFlight). Asking whether they
    have (landed()) never waits; reading them before they landed fails the test, as does any
    wait for the GPU (the in_flight fixture makes those fail)."""

    control: InFlight

    @staticmethod
    def needed(kv_indices: torch.Tensor) -> bool:
        return True

    def __init__(self, device: torch.device) -> None:
        self.arrived, self._values = False, (0, -1)
        self.control.copies.append(self)

    def start(self, kv_indices: torch.Tensor) -> None:
        low, high = torch.aminmax(kv_indices)
        self.arrived, self._values = self.control.prompt, (int(low), int(high))

    def landed(self) -> bool:
        return self.arrived

    def values(self) -> tuple[int, int]:
        assert self.arrived, "the bounds were read before they landed: a wait for the GPU"
        return self._values


@pytest.fixture
def in_flight(monkeypatch):
    """Page-list bounds on their way until the test lands them (InFlight); waiting for the GPU
    (a device or event synchronize) fails the test."""
    control = InFlight()
    monkeypatch.setattr(checks, "BoundsCopy", type("Copy", (BoundsOnTheirWay,), {"control": control}))

    def waited(*args, **kwargs):
        raise AssertionError("waited for the GPU")

    for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "wait"),
                        (torch.cuda.Stream, "synchronize")):
        monkeypatch.setattr(owner, name, waited, raising=False)
    return control


class GuardCase:
    """A wrapper over a batch whose page list plan() is given as a device list with host indptrs
    (the layout in which its bounds may still be on their way in run())."""

    def __init__(self, kind: str):
        self.decode = kind.startswith("decode")
        if self.decode:
            self.spec = spec_named("sliding_window")
            self.batch = random_paged_batch([1] * 3, [5, 30, 9], num_qo_heads=HQ, num_kv_heads=HKV,
                                            head_dim=HEAD_DIM, page_size=4, seed=5)
            self.args = {"window": 6}
            trim = kind.endswith("trimmed")
            self.plan_kw = dict(skip_tiles=trim, **(self.args if trim else {}))
            self.w, self.fake = decoder(self.spec, tensor_cores=kind == "decode-tensor_cores")
            self.at = int(self.batch.kv_indptr[2]) - 1  # read with trimming too (the query's window)
        else:
            self.spec, self.batch, self.args = mm_case()
            backend, _, path = kind.partition("-")
            self.w, self.fake = prefill(self.spec, backend)
            self.planner = path == "planner"
            self.at = 6
        self.pages = self.batch.k_cache.shape[0]

    def plan(self, kv_indices: torch.Tensor | None = None) -> None:
        b = self.batch
        kv = b.kv_indices if kv_indices is None else kv_indices
        if self.decode:
            self.w.plan(b.kv_indptr, kv, b.last_page_len, HQ, HKV, 4, **self.plan_kw)
        else:
            plan_prefill(self.w, b, self.args, self.planner, kv)

    def run(self, cache=None) -> torch.Tensor:
        return self.w.run(self.batch.q, cache or (self.batch.k_cache, self.batch.v_cache), **self.args)

    def check(self, out: torch.Tensor, kv_indices: torch.Tensor | None = None, cache=None) -> None:
        qo = torch.arange(4, dtype=torch.int32) if self.decode else None
        assert_reference(self.spec, out, self.batch, self.args, kv_indices, cache, qo_indptr=qo)

    def bad(self, value: int) -> torch.Tensor:
        kv = self.batch.kv_indices.clone()
        kv[self.at] = value
        return kv


GUARD_KINDS = ["fa2-direct", "fa3-direct", "fa2-planner", "decode-cuda_cores", "decode-cuda_cores-trimmed",
               "decode-tensor_cores"]


def clamped_report(where: str, which: str, run: int, plan: int, value: int, pages: int) -> str:
    return exact(
        f"{where}: {which} (#{run} of this wrapper) read a page list with entries outside its KV cache: plan() "
        f"#{plan}'s paged_kv_indices held page {value} (the cache had {pages} pages: expected 0 <= page < {pages}). "
        "That run() ran with the list clamped to the cache on the GPU: it read nothing outside the cache, but its "
        "output is wrong. plan() had left the list's bounds to arrive from the GPU (a page list there with host "
        "indptrs, and nothing else read back); pass the page list on the host to have run() refuse such entries "
        "before the launch")


@pytest.mark.parametrize("kind", GUARD_KINDS)
def test_guard_clamps_where_the_bounds_are_on_their_way(in_flight, kind):
    """plan() does not wait for the bounds; run() clamps the kernels' copy of the page list on
    the device, and the next call raises once the bounds have landed."""
    case = GuardCase(kind)
    pages = case.pages
    bad = case.bad(pages)  # one past the last page
    case.plan(bad)  # no wait, no error: the bounds are on their way
    out = case.run()  # the fake kernel asserts that every page it reads is in the cache
    case.check(out, bad.clamp(0, pages - 1))
    calls = len(case.fake.run_calls)
    in_flight.land()
    with pytest.raises(LaunchError, match=clamped_report("run()", "the last run()", 1, 1, pages, pages)):
        case.run()
    # the bounds are known now: this plan's runs are refused before the launch ...
    with pytest.raises(LaunchError, match=exact(
            f"run(): paged_kv_indices[{case.at}]={pages} is not a page of the KV cache run() was given ({pages} "
            f"pages: expected 0 <= page < {pages})")):
        case.run()
    # ... also over a cache that has the page: the kernels' copy was clamped to the smaller one
    with pytest.raises(LaunchError, match=exact(
            f"run(): this plan's page list was clamped to the {pages} pages of run() #1's KV cache (it held page "
            f"{pages}), as reported; call plan() again")):
        case.run(with_extra_page(case.batch))
    assert len(case.fake.run_calls) == calls
    case.plan()
    case.check(case.run())
    in_flight.land()
    case.check(case.run())  # a good list's landed bounds report nothing


@pytest.mark.parametrize("kind", ["fa2-direct", "decode-cuda_cores"])
def test_guard_reports_at_the_next_call_once_the_bounds_landed(in_flight, kind):
    """Bounds still on their way at the next call are reported by a later one, which names the run()."""
    case = GuardCase(kind)
    pages = case.pages
    case.plan()
    case.run()  # run #1
    case.plan(case.bad(-3))
    out = case.run()  # run #2: page -3 read as page 0
    case.check(out, case.bad(0))
    case.plan()  # nothing has landed: nothing to report, no wait
    case.check(case.run())  # run #3
    in_flight.land()
    with pytest.raises(LaunchError, match=clamped_report("plan()", "the run() 1 before the last", 2, 2, -3, pages)):
        case.plan()
    case.plan()  # reported once
    case.check(case.run())
    # landed before run(): refused there, before the launch (the cache is known only there)
    case.plan(case.bad(pages + 5))
    calls = len(case.fake.run_calls)
    in_flight.land()
    with pytest.raises(LaunchError, match=exact(
            f"run(): paged_kv_indices[{case.at}]={pages + 5} is not a page of the KV cache run() was given ({pages} "
            f"pages: expected 0 <= page < {pages})")):
        case.run()
    assert len(case.fake.run_calls) == calls


def refused_arguments(case: GuardCase) -> list[tuple[dict, str]]:
    """run() arguments refused after the cache was checked (outputs last), and the message's start."""
    b = case.batch
    wrong_out = torch.empty(b.q.shape, dtype=torch.float16)
    cases = [({"out": wrong_out}, "run(): `out`: expected dtype torch.bfloat16"),
             ({"q_scale": float("nan")}, "run(): `q_scale`: expected a finite float")]
    if case.decode:
        cases.append(({"window": 1.5}, "run(): `window`: expected an int"))
    else:
        cases.append(({"ranges": case.args["ranges"].long()}, "run(): `ranges`: expected dtype torch.int32"))
    return cases


@pytest.mark.parametrize("kind", GUARD_KINDS)
def test_guard_clamps_only_for_a_run_that_launches(in_flight, kind):
    """A run() refused for any argument leaves the page list as it was and is not recorded (a
    regression: the guard clamped the list to the run()'s cache before the later checks, so the
    next, correct run() read a list clamped to a cache too small and returned a wrong output,
    and the report named the refused run())."""
    case = GuardCase(kind)
    case.plan()  # a good list; its bounds on their way
    small = (case.batch.k_cache[:3], case.batch.v_cache[:3])  # the list has pages past these
    for bad, message in refused_arguments(case):
        with pytest.raises(LaunchError, match="^" + re.escape(message)):
            case.w.run(case.batch.q, small, **{**case.args, **bad})
    assert not case.fake.run_calls
    case.check(case.run())  # the whole cache, the list as planned
    in_flight.land()
    case.check(case.run())  # nothing to report


@pytest.mark.parametrize("kind", GUARD_KINDS)
def test_guard_reports_every_run_that_read_the_list_clamped(in_flight, kind):
    """A run() over a cache that has every page still reads the list an earlier run() of the plan
    clamped to a smaller cache: it is recorded with that clamp, and the report names it too."""
    case = GuardCase(kind)
    pages, small = case.pages, 3
    case.plan()
    case.run((case.batch.k_cache[:small], case.batch.v_cache[:small]))  # run #1: clamped to 3 pages
    out = case.run()  # run #2: the list as run #1 left it
    case.check(out, case.batch.kv_indices.clamp(0, small - 1))
    case.run(with_extra_page(case.batch))  # run #3: the same
    in_flight.land()
    high = int(case.batch.kv_indices[:int(case.batch.kv_indptr[-1])].max())
    report = clamped_report("run()", "the run() 2 before the last", 1, 1, high, small)[:-1] + re.escape(
        ". Later run()s read the list clamped too, and their output is wrong as well: the run() 1 before the last "
        f"(#2): its cache had {pages} pages, but an earlier run() had clamped the list to {small}; the last run() "
        f"(#3): its cache had {pages + 1} pages, but an earlier run() had clamped the list to {small}") + "$"
    with pytest.raises(LaunchError, match=report):
        case.run()


def test_guard_refuses_a_cache_without_pages(in_flight):
    case = GuardCase("fa2-direct")
    case.plan()
    empty = case.batch.k_cache[:0]
    with pytest.raises(LaunchError, match=exact(
            "run(): the KV cache run() was given has no pages, and the planned page list has entries (expected 0 <= "
            "page < the cache's page count)")):
        case.run((empty, empty))
    w, _ = graph_prefill(spec_named("causal"))
    i32 = dict(dtype=torch.int32)
    w.plan(torch.zeros(2, **i32), torch.zeros(2, **i32), torch.empty(0, **i32), torch.zeros(1, **i32), HQ, HKV, 4)
    empty = torch.empty(0, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)
    q = torch.empty(0, HQ, HEAD_DIM, dtype=torch.bfloat16)
    w.run(q, (empty, empty))  # eager: nothing to read
    with pytest.raises(LaunchError, match=exact(
            "run(): the KV cache run() was given has no pages, and a captured run() reads later plans' page lists "
            "(expected 0 <= page < the cache's page count)")):
        capture(lambda: w.run(q, (empty, empty)))


# ----------------------------------------------------------------------------- CUDA-graph mode

CAP = GraphCapacity(max_batch_size=4, max_total_q=64, max_kv_pages=16)


def graph_prefill(spec, **kwargs):
    return prefill(spec, graph=CAP, **kwargs)


def capture(run):
    """run() as under CUDA-graph capture (WrapperBase._capturing): what a captured graph records."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WrapperBase, "_capturing", lambda self: True)
        return run()


@pytest.mark.parametrize("planner", [False, True], ids=["direct", "planner"])
def test_graph_plan_checks_pages_against_the_captured_cache(planner):
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
    capture(lambda: w.run(batch.q, (k, v), **args))
    with pytest.raises(LaunchError, match=exact(
            "plan(): paged_kv_indices[4]=16 is not a page of the KV cache the CUDA graph was captured with (16 pages: "
            "expected 0 <= page < 16)")):
        plan_prefill(w, batch, args, planner, bad)
    plan_prefill(w, batch, args, planner)  # the good batch plans again


def test_graph_plan_checks_pages_against_the_smallest_captured_cache():
    """One graph capturing several run()s (one per layer, each with its own KV cache): a later
    plan() must fit the smallest of them, whichever was captured last (a regression: only the
    last captured cache's size was kept, so a page of a smaller layer cache went unchecked)."""
    spec, batch, args = mm_case()
    w, _ = graph_prefill(spec)
    big = torch.zeros(CAP.max_kv_pages, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)
    small = torch.zeros(12, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)  # still holds every page the batch uses
    assert int(batch.kv_indices.max()) < 12
    plan_prefill(w, batch, args, False)
    capture(lambda: w.run(batch.q, (small, small), **args))  # layer 0
    capture(lambda: w.run(batch.q, (big, big), **args))  # layer 1, captured last
    bad = batch.kv_indices.clone()
    bad[4] = 12  # a page of the big cache, not of the small one
    with pytest.raises(LaunchError, match=exact(
            "plan(): paged_kv_indices[4]=12 is not a page of the KV cache the CUDA graph was captured with (12 pages: "
            "expected 0 <= page < 12)")):
        plan_prefill(w, batch, args, False, bad)
    plan_prefill(w, batch, args, False)


def test_graph_decode_on_cuda_cores_checks_pages_against_the_captured_cache():
    spec = spec_named("causal")
    cap = GraphCapacity(max_batch_size=2, max_total_q=2, max_kv_pages=8)
    w, _ = decoder(spec, tensor_cores=False, graph=cap)
    batch = random_paged_batch([1, 1], [5, 9], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4)
    k = torch.zeros(cap.max_kv_pages, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)
    plan = (batch.kv_indptr, batch.kv_indices, batch.last_page_len, HQ, HKV, 4)
    w.plan(*plan)
    capture(lambda: w.run(batch.q, (k, k)))
    bad = batch.kv_indices.clone()
    bad[0] = 8
    with pytest.raises(LaunchError, match=exact(
            "plan(): paged_kv_indices[0]=8 is not a page of the KV cache the CUDA graph was captured with (8 pages: "
            "expected 0 <= page < 8)")):
        w.plan(batch.kv_indptr, bad, *plan[2:])


class GraphGuardCase:
    """A graph-mode wrapper, its static cache (the capacity's pages) and a batch in it."""

    def __init__(self, kind: str):
        self.decode = kind == "decode-cuda_cores"
        if self.decode:
            self.spec = spec_named("causal")
            cap = GraphCapacity(max_batch_size=2, max_total_q=2, max_kv_pages=8)
            self.w, self.fake = decoder(self.spec, tensor_cores=False, graph=cap)
            self.batch = random_paged_batch([1, 1], [5, 9], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                                            page_size=4)
            self.args: dict = {}
            self.at = 0
        else:
            self.spec, self.batch, self.args = mm_case()
            self.w, self.fake = graph_prefill(self.spec)
            cap, self.planner, self.at = CAP, kind == "planner", 4
        self.pages = cap.max_kv_pages
        k = torch.zeros(self.pages, 4, HKV, HEAD_DIM, dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        k[:self.batch.k_cache.shape[0]], v[:self.batch.v_cache.shape[0]] = self.batch.k_cache, self.batch.v_cache
        self.cache = (k, v)

    def plan(self, value: int | None = None) -> None:
        b = self.batch
        kv = b.kv_indices.clone()
        if value is not None:
            kv[self.at] = value
        if self.decode:
            self.w.plan(b.kv_indptr, kv, b.last_page_len, HQ, HKV, 4)
        else:
            plan_prefill(self.w, b, self.args, self.planner, kv)

    def replay(self) -> torch.Tensor:
        """What a replay of the captured run() does (run()'s device work, the clamp included)."""
        return capture(lambda: self.w.run(self.batch.q, self.cache, **self.args))

    def check(self, out: torch.Tensor) -> None:
        qo = torch.arange(3, dtype=torch.int32) if self.decode else None
        assert_reference(self.spec, out, self.batch, self.args, cache=self.cache, qo_indptr=qo)


@pytest.mark.parametrize("kind", ["direct", "planner", "decode-cuda_cores"])
def test_graph_guard_is_captured_and_the_next_plan_reports(in_flight, kind):
    """Replays read later plans' page lists: the captured run() clamps them to the captured
    cache, and a plan() whose bounds were still on their way is reported by the next plan()."""
    case = GraphGuardCase(kind)
    pages = case.pages
    case.plan()
    case.w.run(case.batch.q, case.cache, **case.args)  # eager warm-up
    case.replay()  # the capture
    in_flight.land()
    case.plan(pages)  # outside the captured cache, but the bounds are on their way: no wait, no error
    case.replay()  # read clamped (the fake kernel asserts every page it reads is in the cache)
    in_flight.land()
    with pytest.raises(LaunchError, match=exact(
            f"plan(): plan() #2's paged_kv_indices held page {pages}, which is not a page of the KV cache the CUDA "
            f"graph was captured with ({pages} pages: expected 0 <= page < {pages}). Any replay of the captured run() "
            "after that plan() ran with the list clamped to the cache on the GPU: it read nothing outside the cache, "
            "but its output was wrong. plan() had left the list's bounds to arrive from the GPU (a page list there "
            "with host indptrs, and nothing else read back); pass the page list on the host to have run() refuse "
            "such entries before the launch")):
        case.plan()
    case.plan()  # reported once
    case.check(case.replay())
    # bounds that land during plan() (where it reads something back) are checked there, as on the host
    in_flight.prompt = True
    with pytest.raises(LaunchError, match=exact(
            f"plan(): paged_kv_indices[{case.at}]={pages} is not a page of the KV cache the CUDA graph was captured "
            f"with ({pages} pages: expected 0 <= page < {pages})")):
        case.plan(pages)
    with pytest.raises(LaunchError, match=exact(
            f"plan(): paged_kv_indices[{case.at}]=-2 is not a page number (expected 0 <= page < the KV cache's page "
            "count)")):
        case.plan(-2)


def test_capture_reads_no_page_list_back(in_flight):
    """Under capture a known bad bound is refused without reading the page list back (a device
    copy is not allowed while capturing): the message names the bound plan() read."""
    case = GraphGuardCase("direct")
    in_flight.prompt = True  # the bounds land during plan()
    case.plan(case.pages)  # no captured cache yet: run() checks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checks, "first_outside", lambda *a: pytest.fail("read the page list back under capture"))
        with pytest.raises(LaunchError, match=exact(
                f"run(): paged_kv_indices held page {case.pages} when plan() read it, which is not a page of the KV "
                f"cache run() was given ({case.pages} pages: expected 0 <= page < {case.pages})")):
            case.replay()


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


def test_check_plan_in_graph_mode_refuses_at_the_next_plan():
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
        capture(lambda: w.run(q, (k, k), out=out, ranges=static))

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
