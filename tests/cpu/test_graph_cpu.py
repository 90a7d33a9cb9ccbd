"""CUDA-graph mode of the paged prefill wrapper (graph.py), on the CPU fake kernel.

A captured graph replays run()'s kernel launches with the arguments they had at capture.
Here "capture" records every paged_run call of one run() (the tensor objects and the
plan_info), and "replay" calls the fake kernel again with exactly those recorded
arguments after a later plan(): the output must be that later batch's reference, which
only holds if plan() rewrote the same buffers in place and kept the schedule fixed.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from _fake_kernel import FakeFa3Module, FakeModule, FakeRowPlanner
from conftest import SPECS_DIR

import variantgen
from variantgen.abi.table import PlanOption, PrefillPlanInfo, Schedule
from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import render
from variantgen.core.errors import LaunchError
from variantgen.planning.graph import SLOT_NAMES, GraphCapacity, slot_name
from variantgen.planning.intervals import analyze
from variantgen.testing.harness import random_paged_batch, random_spec_args, spans_to_ranges
from variantgen.wrappers.paged import VariantWrapper
from variantgen.wrappers.reference import reference_attention

HQ, HKV, HEAD_DIM, PAGE = 4, 2, 64, 16


def slot_modes(backend: str) -> list[str]:
    """The mask modes of graph mode's fixed launches: custom, causal, none, and fa2's tail slot
    (causal; fa3 lays out a window slot per pinned width instead)."""
    return list(SLOT_NAMES) + (["causal"] if backend == "fa2" else [])
CAP = GraphCapacity(max_batch_size=4, max_total_q=192, max_kv_pages=48)


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def make(spec_name: str, capacity: GraphCapacity = CAP, backend: str = "fa2", planner_module: bool = True,
         ) -> tuple[VariantWrapper, FakeModule]:
    """A graph-mode wrapper on a fake module, with the fake planner module (or planner-off)."""
    spec = variantgen.load_spec(SPECS_DIR / f"{spec_name}.yaml")
    config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", backend)
    manifest = {"scalar_args": [a.name for a in render.kernel_args(spec)[1]],
                "module_sha256": "x", "module_file": "x.so"}
    fake = (FakeFa3Module if backend == "fa3" else FakeModule)(spec)
    build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                        built=False, seconds=0.0)
    w = VariantWrapper(spec, config, fake, build, torch.empty(1 << 20, dtype=torch.uint8), graph=capacity)
    if planner_module and analyze(spec).planner_ready:
        w.set_row_planner(FakeRowPlanner(spec))
    return w, fake


class Engine:
    """What a serving engine keeps for graph replay: static q/out, one KV cache, and a
    static buffer per spec tensor, all sized for the capacity."""

    def __init__(self, w: VariantWrapper, capacity: GraphCapacity = CAP):
        rows = capacity.max_total_q
        self.w = w
        self.q = torch.full((rows, HQ, HEAD_DIM), math.nan, dtype=torch.bfloat16)
        self.out = torch.full((rows, HQ, HEAD_DIM), math.nan, dtype=torch.bfloat16)
        self.k = torch.zeros(capacity.max_kv_pages, PAGE, HKV, HEAD_DIM, dtype=torch.bfloat16)
        self.v = torch.zeros_like(self.k)
        self.dims = {"total_q": rows, "total_kv": capacity.max_kv_pages * PAGE, "batch": capacity.max_batch_size,
                     "num_qo_heads": HQ, "num_kv_heads": HKV}
        self.static: dict[str, torch.Tensor] = {}

    def load(self, batch, args: dict) -> dict:
        """Copy a batch into the static buffers; returns the spec arguments as the engine passes them."""
        tq, pages = batch.q.shape[0], batch.k_cache.shape[0]
        self.q[:tq] = batch.q
        self.q[tq:] = math.nan
        self.k[:pages] = batch.k_cache
        self.v[:pages] = batch.v_cache
        out = dict(args)
        for t in self.w.spec.tensors:
            value = args[t.name]
            if t.name not in self.static:
                shape = tuple(self.dims[d] if isinstance(d, str) else d for d in t.shape)
                self.static[t.name] = torch.zeros(shape, dtype=value.dtype)
            buf = self.static[t.name]
            buf.fill_(-1 if t.name == "ranges" else 0)  # (what lies past the batch is never read)
            buf[tuple(slice(0, n) for n in value.shape)] = value
            out[t.name] = buf
        return out


def record_calls(fake, attr: str, fn) -> list[tuple]:
    """Run fn() while recording every call of fake.<attr>: the kernel launches a graph captures."""
    calls, real = [], getattr(fake, attr)

    def record(*args):
        calls.append(args)
        return real(*args)

    setattr(fake, attr, record)
    try:
        fn()
    finally:
        setattr(fake, attr, real)
    return calls


def capture(w: VariantWrapper, fake: FakeModule, engine: Engine, static_args: dict) -> list[tuple]:
    """run() once on the static buffers, recording each kernel launch's arguments."""
    engine.out.fill_(math.nan)
    return record_calls(fake, "paged_run",
                        lambda: w.run(engine.q, (engine.k, engine.v), out=engine.out, **static_args))


def replay(fake: FakeModule, engine: Engine, calls: list[tuple]) -> None:
    engine.out.fill_(math.nan)
    fake.row_writes = None
    for args in calls:
        fake.paged_run(*args)


def capture_or_replay(w: VariantWrapper, fake: FakeModule, engine: Engine, static_args: dict,
                      calls: list[tuple] | None) -> list[tuple]:
    """The first batch's run() captured (``calls`` None), a later batch's the captured calls
    replayed: the captured calls."""
    if calls is None:
        return capture(w, fake, engine, static_args)
    replay(fake, engine, calls)
    return calls


def check_replayed(spec, engine: Engine, batch, args: dict, label: str) -> None:
    """The replayed output rows are the batch's reference (bf16 tolerance); rows past it untouched."""
    tq = batch.q.shape[0]
    if tq:
        ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                                  batch.kv_indices, batch.last_page_len, args)
        got = engine.out[:tq].float()
        assert not torch.isnan(got).any(), f"{label}: rows left unwritten"
        ref_bf16 = ref.to(torch.bfloat16).float()
        err = ((got - ref_bf16).norm() / ref_bf16.norm().clamp_min(1e-12)).item()
        bad = ((got - ref).abs() > (2.0 ** -7) * ref.abs() + 1e-4).flatten(1).any(1).nonzero().flatten().tolist()
        assert err < 1e-3 and not bad, f"{label}: rel. error {err:.2e}; rows off: {bad[:20]}"
    assert torch.isnan(engine.out[tq:].float()).all(), f"{label}: rows past total_q were written"


def mm_batch(qo_lens, kv_lens, spans, seed):
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=PAGE, seed=seed)
    return batch, {"ranges": spans_to_ranges(qo_lens, kv_lens, spans)}


MM_BATCHES = [  # (qo_lens, kv_lens, spans): different request counts, rows, launch-request counts
    ([40, 24], [64, 40], [[(8, 30)], [(0, 5), (20, 39)]]),
    ([16, 70, 30, 9], [16, 150, 30, 200], [[], [(3, 90), (100, 140)], [(0, 29)], [(150, 197)]]),
    ([1], [33], [[(0, 32)]]),
    ([64, 64], [64, 64], [[], []]),
]


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("skip_tiles", [True, False])
def test_replay_after_replanning_matches_each_batch(skip_tiles, backend):
    """Capture once, then plan four different batches and replay the captured launches."""
    w, fake = make("mm_prefix", backend=backend)
    engine = Engine(w)
    batch, args = mm_batch(*MM_BATCHES[0], seed=0)
    static = engine.load(batch, args)
    w.plan(*batch.plan_args(), skip_tiles=skip_tiles, **(static if skip_tiles else {}))
    calls = capture(w, fake, engine, static)
    modes = slot_modes(backend)
    assert [c.mask_mode for c in fake.run_calls[-len(modes):]] == modes
    check_replayed(w.spec, engine, batch, args, "captured batch")
    plan_info = [list(c[2]) for c in calls]
    for i, spec_batch in enumerate(MM_BATCHES[1:] + MM_BATCHES[:1]):
        batch, args = mm_batch(*spec_batch, seed=i + 1)
        static = engine.load(batch, args)
        w.plan(*batch.plan_args(), skip_tiles=skip_tiles, **(static if skip_tiles else {}))
        assert [la.plan_info for la in w._launches] == plan_info
        replay(fake, engine, calls)
        check_replayed(w.spec, engine, batch, args, f"replay {i} ({skip_tiles=})")
    # every slot has the launch builder's CUDA-graph work list over the capacity (split-KV off)
    assert not fake.plan_calls
    if backend == "fa3":  # (the sm90 work lists: sized for the capacity, checked by the fake and the pins)
        assert all(la.schedule == Schedule.FA3 and la.meta.shape[0] == CAP.launch_requests for la in w._launches)
        return
    for la in w._launches:
        info = la.plan_info
        assert la.schedule == Schedule.FA2 and info[PrefillPlanInfo.ENABLE_CUDA_GRAPH]
        assert not info[PrefillPlanInfo.SPLIT_KV]
        assert info[PrefillPlanInfo.TOTAL_NUM_ROWS] == CAP.max_total_q and la.meta.shape[0] == CAP.launch_requests


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_launch_tensors_keep_their_addresses(backend):
    w, _ = make("mm_prefix", backend=backend)
    engine = Engine(w)
    seen = None
    for i, spec_batch in enumerate(MM_BATCHES):
        batch, args = mm_batch(*spec_batch, seed=i)
        w.plan(*batch.plan_args(), **engine.load(batch, args))
        ptrs = [(la.mask_mode, la.q_starts.data_ptr(), la.kv_indptr.data_ptr(), la.kv_indices.data_ptr(),
                 la.last_page_len.data_ptr(), la.meta.data_ptr(), la.int_workspace.data_ptr(),
                 la.float_workspace.data_ptr(), la.meta.shape[0]) for la in w._launches]
        assert seen is None or ptrs == seen
        seen = ptrs
    assert [p[0] for p in seen] == slot_modes(backend)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("spec_name", ["causal", "document", "prefix_lm", "sliding_window", "softcap",
                                       "streaming_sink"])
def test_other_specs_replay(spec_name, backend):
    """Specs whose tensors are [total_kv] / [batch] sized, or that have none; streaming_sink's rows
    of two intervals run past their gaps (their page lists change with every batch)."""
    w, fake = make(spec_name, backend=backend)
    engine = Engine(w)
    shapes = [([30, 50], [60, 50]), ([100, 3, 7], [120, 3, 300]), ([5], [5])]
    calls = None
    for i, (ql, kl) in enumerate(shapes):
        batch = random_paged_batch(ql, kl, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE,
                                   seed=i)
        args = random_spec_args(w.spec, batch, seed=i)
        static = engine.load(batch, args)
        w.plan(*batch.plan_args(), **static)
        calls = capture_or_replay(w, fake, engine, static, calls)
        check_replayed(w.spec, engine, batch, args, f"{spec_name} batch {i}")


def test_capacity_sized_spec_tensors_are_accepted_and_trimmed_for_the_planner():
    """document's doc_ids [total_kv] may be a static buffer longer than this batch's keys."""
    w, fake = make("document")
    batch = random_paged_batch([20, 10], [40, 30], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=PAGE, seed=3)
    args = random_spec_args(w.spec, batch, seed=3)
    static_ids = torch.full((CAP.max_kv_pages * PAGE,), 7, dtype=torch.int32)
    static_ids[:70] = args["doc_ids"]
    engine = Engine(w)
    engine.load(batch, args)
    w.plan(*batch.plan_args(), doc_ids=static_ids)
    assert w.plan_stats["row_planner"] == "kernel"  # planned from the first 70 ids only
    capture(w, fake, engine, {"doc_ids": static_ids})
    check_replayed(w.spec, engine, batch, args, "static doc_ids")
    too_long = torch.zeros(CAP.max_kv_pages * PAGE + 1, dtype=torch.int32)
    with pytest.raises(LaunchError, match=r"`doc_ids`: expected shape \[total_kv=70\] \(batch-sized dims up to"):
        w.plan(*batch.plan_args(), doc_ids=too_long)


def test_empty_batch_still_plans_the_fixed_launches():
    w, fake = make("mm_prefix")
    engine = Engine(w)
    batch, args = mm_batch(*MM_BATCHES[0], seed=0)
    w.plan(*batch.plan_args(), **engine.load(batch, args))
    calls = capture(w, fake, engine, engine.load(batch, args))
    empty = random_paged_batch([0], [20], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE)
    w.plan(*empty.plan_args(), ranges=engine.static["ranges"])
    assert [la.mask_mode for la in w._launches] == slot_modes("fa2") and w._launches[3].tail
    assert all(la.q_starts[0].item() == 0 for la in w._launches)
    assert w.plan_stats["launches"] == []
    replay(fake, engine, calls)
    assert torch.isnan(engine.out.float()).all()  # nothing written: every launch request is padding


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_capacity_errors_name_the_field_and_leave_the_buffers_alone(backend):
    cap = GraphCapacity(max_batch_size=2, max_total_q=96, max_kv_pages=16, max_launch_requests=3,
                        max_launch_pages=20)
    w, _ = make("mm_prefix", cap, backend=backend)
    batch, args = mm_batch([40, 24], [64, 40], [[(8, 30)], []], seed=0)
    w.plan(*batch.plan_args(), **args)
    before = w._graph.workspace[0].clone()
    cases = [
        (([10, 10, 10], [10, 10, 10], [[], [], []]), r"batch size 3 exceeds .* max_batch_size=2"),
        (([90, 10], [90, 10], [[], []]), r"total query rows 100 exceeds .* max_total_q=96"),
        (([20, 20], [250, 20], [[], []]), r"paged_kv_indptr\[-1\] \(page-list entries\) 18 exceeds .* max_kv_pages=16"),
        (([64, 30], [64, 30], [[(4, 8), (20, 24)], [(3, 9), (15, 17)]]),
         r"the '\w+' launch needs \d+ launch requests; .* max_launch_requests=3"),
        # causal rows in three runs, each reading [0, its last row]: 11 + 13 + 16 pages (fa3: custom ones,
        # as this capacity's requests (at most 95 rows x group 2) run GQA-packed)
        (([90], [250], [[(170, 180), (200, 210)]]), rf"the '{'custom' if backend == 'fa3' else 'causal'}' launch "
                                                    r"reads 40 page-list entries; .* max_launch_pages=20"),
    ]
    for (ql, kl, spans), pattern in cases:
        b, a = mm_batch(ql, kl, spans, seed=1)
        with pytest.raises(LaunchError, match=pattern):
            w.plan(*b.plan_args(), **a)
        assert torch.equal(w._graph.workspace[0], before)


def test_plan_info_change_is_refused():
    """A schedule that would differ from the captured one (here: sized for other rows) raises."""
    w, fake = make("causal")
    batch = random_paged_batch([30], [40], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE)
    w.plan(*batch.plan_args())
    w.planner.options[PlanOption.GRAPH_ROWS] -= 1
    with pytest.raises(LaunchError, match=r"schedule for the 'custom' launch slot changed .* variantgen bug"):
        w.plan(*batch.plan_args())
    assert w.last_plan is None


def test_heads_and_page_size_stay_those_of_the_first_plan():
    w, _ = make("causal")
    batch = random_paged_batch([30], [40], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE)
    w.plan(*batch.plan_args())
    other = random_paged_batch([30], [40], num_qo_heads=2 * HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE)
    with pytest.raises(LaunchError, match=re.escape(
            "plan(): num_qo_heads, num_kv_heads, page_size = (8, 2, 16), but this CUDA-graph wrapper planned "
            "(4, 2, 16) first")):
        w.plan(*other.plan_args())


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(max_batch_size=0, max_total_q=8, max_kv_pages=8), r"max_batch_size=0: expected a positive int"),
    (dict(max_batch_size=2, max_total_q=8, max_kv_pages=2**31), r"max_kv_pages=2147483648: expected a positive int "
                                                                  r"below 2\*\*31 \(the buffers index it in int32\)"),
    (dict(max_batch_size=2, max_total_q=2**40, max_kv_pages=8), r"max_total_q=1099511627776: expected a positive int "
                                                                 r"below 2\*\*31"),
    (dict(max_batch_size=2, max_total_q=True, max_kv_pages=8), r"max_total_q=True: expected a positive int"),
    (dict(max_batch_size=9, max_total_q=8, max_kv_pages=8), r"max_batch_size=9 exceeds max_total_q=8"),
    (dict(max_batch_size=2, max_total_q=8, max_kv_pages=8, max_launch_requests=9),
     r"max_launch_requests=9: expected max_batch_size <= it <= max_total_q \(2..8\)"),
    (dict(max_batch_size=2, max_total_q=8, max_kv_pages=8, max_launch_pages=4),
     r"max_launch_pages=4 is below max_kv_pages=8"),
    (dict(max_batch_size=2, max_total_q=8, max_kv_pages=8, max_qo_len=0), r"max_qo_len=0: expected a positive int"),
    (dict(max_batch_size=2, max_total_q=8, max_kv_pages=8, max_qo_len=9), r"max_qo_len=9 exceeds max_total_q=8"),
])
def test_graph_capacity_checks(kwargs, pattern):
    with pytest.raises(LaunchError, match=pattern):
        GraphCapacity(**kwargs)


def test_graph_capacity_limits_are_inclusive():
    """Each limit the checks above refuse past is itself accepted: as many launch pages as the
    caller's pages, launch requests from max_batch_size to max_total_q, max_qo_len = max_total_q."""
    cap = GraphCapacity(max_batch_size=2, max_total_q=8, max_kv_pages=8, max_launch_pages=8)
    assert cap.launch_pages == 8
    for n in (2, 8):
        cap = GraphCapacity(max_batch_size=2, max_total_q=8, max_kv_pages=8, max_launch_requests=n)
        assert cap.launch_requests == n
    assert GraphCapacity(max_batch_size=2, max_total_q=8, max_kv_pages=8, max_qo_len=8).longest_request == 8


def test_capacity_defaults():
    cap = GraphCapacity(max_batch_size=8, max_total_q=65536, max_kv_pages=4096)
    assert cap.launch_requests == 16 * 8 + 65536 // 64 and cap.launch_pages == 8 * 4096
    assert GraphCapacity(max_batch_size=2, max_total_q=4, max_kv_pages=1).launch_requests == 4
    # one per 64 rows, a part of 64 rows counting as one: 100 rows are 2 (with the 16 of the one request)
    assert GraphCapacity(max_batch_size=1, max_total_q=100, max_kv_pages=1).launch_requests == 16 + 2
    assert GraphCapacity(max_batch_size=1, max_total_q=129, max_kv_pages=1).launch_requests == 16 + 3
    assert cap.longest_request == 65536 - 8 + 1  # every other request one row
    assert GraphCapacity(max_batch_size=8, max_total_q=64, max_kv_pages=1, max_qo_len=8).longest_request == 8
    assert variantgen.GraphCapacity is GraphCapacity
    big = GraphCapacity(max_batch_size=8, max_total_q=64, max_kv_pages=2**30)  # (8x would pass int32)
    assert big.launch_pages == 2**31 - 1


def test_graph_mode_refusals():
    w, _ = make("causal")
    with pytest.raises(LaunchError, match=r"graph=\{'max_batch_size': 4\}: expected a variantgen.GraphCapacity"):
        VariantWrapper(w.spec, w.config, w.module, w.build, torch.empty(8, dtype=torch.uint8),
                       graph={"max_batch_size": 4})
    ws = torch.empty(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^graph=: CUDA-graph mode is for kind 'prefill' and 'decode' "
                                         r"\(got 'ragged'\); ragged wrappers allocate their metadata per plan\(\)$"):
        variantgen.make_wrapper(SPECS_DIR / "causal.yaml", ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16",
                                arch="9.0a", kind="ragged", graph=CAP)


def test_static_q_larger_than_capacity_is_refused():
    w, _ = make("causal")
    batch = random_paged_batch([30], [40], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE)
    w.plan(*batch.plan_args())
    q = torch.zeros(CAP.max_total_q + 1, HQ, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match=r"run\(\): `q`: expected shape \[30, 4, 64\]"):
        w.run(q, (batch.k_cache, batch.v_cache))


def fake_decode_wrapper(spec, cap: GraphCapacity, *, tensor_cores: bool, backend: str = "fa2"):
    """A graph-mode DecodeWrapper on a fake module: the prefill one (tensor cores; fa3's) or decode."""
    from _fake_decode import FakeDecodeModule

    from variantgen.wrappers.decode import DecodeWrapper

    config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", backend,
                                 kind="prefill" if tensor_cores else "decode")
    manifest = {"scalar_args": [a.name for a in render.kernel_args(spec)[1]], "module_sha256": "x",
                "module_file": "x.so"}
    fake = (FakeFa3Module if backend == "fa3" else FakeModule)(spec) if tensor_cores else FakeDecodeModule(spec)
    build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                        built=False, seconds=0.0)
    w = DecodeWrapper(spec, config, fake, build, torch.empty(1 << 20, dtype=torch.uint8), graph=cap)
    if tensor_cores:
        w.set_row_planner(FakeRowPlanner(spec))
    return w, fake


def replay_fake_decode(w, fake, spec, cap: GraphCapacity, batches: list[list[int]], launch: str) -> None:
    """Static q/out of capacity rows; capture a run() after the first plan, then re-plan every
    batch (one query per request, window 20) and replay the recorded ``launch`` calls."""
    q = torch.full((cap.max_batch_size, HQ, HEAD_DIM), math.nan, dtype=torch.bfloat16)
    out = torch.full_like(q, math.nan)
    k = torch.zeros(cap.max_kv_pages, PAGE, HKV, HEAD_DIM, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    calls = None
    for seed, kv_lens in enumerate(batches):
        n = len(kv_lens)
        b = random_paged_batch([1] * n, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=PAGE, seed=seed)
        q[:n], q[n:] = b.q, math.nan
        k[:b.k_cache.shape[0]], v[:b.v_cache.shape[0]] = b.k_cache, b.v_cache
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, PAGE, window=20)
        if calls is None:
            calls = record_calls(fake, launch, lambda: w.run(q, (k, v), out=out, window=20))
        out.fill_(math.nan)
        for args in calls:
            getattr(fake, launch)(*args)
        ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), torch.arange(n + 1, dtype=torch.int32),
                                  b.kv_indptr, b.kv_indices, b.last_page_len, {"window": 20})
        got = out[:n].float()
        assert not torch.isnan(got).any() and torch.isnan(out[n:].float()).all(), f"batch {seed}"
        err = ((got - ref.to(torch.bfloat16).float()).norm() / ref.norm()).item()
        assert err < 1e-2, f"batch {seed}: replay rel. error {err:.2e}"


def test_tensor_core_decode_replays_after_replanning():
    """Decode on the tensor-core path (the prefill kernel, one query per request) in graph mode:
    re-planned batches of other sizes replay from one capture."""
    spec = variantgen.load_spec(SPECS_DIR / "sliding_window.yaml")
    cap = GraphCapacity(max_batch_size=6, max_total_q=6, max_kv_pages=40)
    w, fake = fake_decode_wrapper(spec, cap, tensor_cores=True)
    replay_fake_decode(w, fake, spec, cap, [[30, 100, 7], [1, 16, 17, 200, 50, 9], [64]], "paged_run")


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_tensor_core_decode_of_sinks_and_a_window_replays_past_the_gaps(backend):
    """streaming_sink decode in graph mode: each request's one query sees its sinks and its
    window, read as one gapped launch request (not the hull between them), replayed across
    re-planned batches."""
    spec = variantgen.load_spec(SPECS_DIR / "streaming_sink.yaml")
    cap = GraphCapacity(max_batch_size=6, max_total_q=6, max_kv_pages=80)
    w, fake = fake_decode_wrapper(spec, cap, tensor_cores=True, backend=backend)
    batches = [[300, 100, 7], [1, 16, 170, 200, 50, 9], [400]]
    if backend == "fa2":
        replay_fake_decode(w, fake, spec, cap, batches, "paged_run")
    else:  # (fa3 packs GQA: run() copies q and out around the launches, which this replay does not record)
        for seed, kv_lens in enumerate(batches):
            b = random_paged_batch([1] * len(kv_lens), kv_lens, num_qo_heads=HQ, num_kv_heads=HKV,
                                   head_dim=HEAD_DIM, page_size=PAGE, seed=seed)
            w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, PAGE, window=20)
            got = w.run(b.q, (b.k_cache, b.v_cache), window=20).float()
            ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                      b.last_page_len, {"window": 20})
            err = ((got - ref.to(torch.bfloat16).float()).norm() / ref.norm()).item()
            assert err < 1e-2, f"batch {seed}: rel. error {err:.2e}"
    plan = w.plan(*random_paged_batch([1], [400], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                                      page_size=PAGE).plan_args()[1:4], HQ, HKV, PAGE, window=20)
    assert any(r.gaps for r in plan.launch_requests), plan
    assert plan.work()["visited"] < HQ * 100, plan  # (sinks' page + the window's pages, not 400 keys)


def test_cuda_core_decode_replays_after_replanning():
    """CUDA-core decode in graph mode: batches of max_batch_size requests with other lengths and
    key-trimmed page lists (sliding window), replayed from one capture."""
    spec = variantgen.load_spec(SPECS_DIR / "sliding_window.yaml")
    cap = GraphCapacity(max_batch_size=4, max_total_q=4, max_kv_pages=64)
    w, fake = fake_decode_wrapper(spec, cap, tensor_cores=False)
    replay_fake_decode(w, fake, spec, cap, [[30, 100, 7, 64], [1, 200, 17, 300], [16, 16, 16, 16]], "run")
    b = random_paged_batch([1] * 4, [1, 200, 17, 300], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                           page_size=PAGE)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, PAGE, window=20)
    assert w.plan_stats["pages"]["visited"] < w.plan_stats["pages"]["given"]  # the page lists were trimmed
    assert all(c.enable_cuda_graph for c in fake.plan_calls)
    # every key of these windows is provably visible, but the captured launch keeps the masked kernels
    assert w.plan_stats["variant"] == "masked" and not any(c.exact for c in fake.run_calls)
    b = random_paged_batch([1] * 3, [5, 5, 5], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE)
    with pytest.raises(LaunchError, match=r"plans exactly max_batch_size=4 requests .* got 3; pad the batch"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, PAGE, window=20)
    b = random_paged_batch([1] * 4, [300, 300, 300, 300], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                           page_size=PAGE)
    with pytest.raises(LaunchError, match=r"paged_kv_indptr\[-1\] \(page-list entries\) 76 exceeds .* "
                                          r"max_kv_pages=64"):
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, PAGE, window=20)


def test_cuda_core_decode_q_is_the_batch():
    """On CUDA cores the decode kernel takes q's rows as the batch: q must have exactly its rows,
    also in graph mode (a regression: q of up to max_total_q rows was let through, as on tensor
    cores, and reached the kernel)."""
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    cap = GraphCapacity(max_batch_size=4, max_total_q=8, max_kv_pages=24)
    b = random_paged_batch([1] * 4, [1, 3, 16, 17], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                           page_size=PAGE)
    q = torch.zeros(6, HQ, HEAD_DIM, dtype=torch.bfloat16)
    q[:4] = b.q
    for tensor_cores in (False, True):
        w, fake = fake_decode_wrapper(spec, cap, tensor_cores=tensor_cores)
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, PAGE)
        if tensor_cores:  # a static buffer of up to max_total_q rows
            w.run(q, (b.k_cache, b.v_cache))
            continue
        for out in (None, torch.empty(6, HQ, HEAD_DIM, dtype=torch.bfloat16)):
            with pytest.raises(LaunchError, match=re.escape(
                    f"run(): `q`: expected shape [batch=4, num_qo_heads={HQ}, head_dim={HEAD_DIM}] (one query per "
                    "request), got [6, 4, 64]")):
                w.run(q, (b.k_cache, b.v_cache), out=out)
        assert not fake.run_calls


# ----------------------------------------------------------------------------- fa3: window slots
WIDTHS_SPEC = ("name: widths\ntensors:\n  w: {dtype: int32, shape: [batch]}\n"
               "mask: kv_pos <= q_pos and q_pos - kv_pos <= w[request]\n")


def make_widths(capacity: GraphCapacity) -> tuple[VariantWrapper, FakeModule]:
    """fa3 graph mode on a spec whose window width is a per-request tensor: each batch brings
    its own widths, and the captured launches have fixed ones."""
    spec = variantgen.parse_spec(WIDTHS_SPEC)
    config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", "fa3")
    manifest = {"scalar_args": [a.name for a in render.kernel_args(spec)[1]], "module_sha256": "x",
                "module_file": "x.so"}
    fake = FakeFa3Module(spec)
    build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                        built=False, seconds=0.0)
    w = VariantWrapper(spec, config, fake, build, torch.empty(1 << 20, dtype=torch.uint8), graph=capacity)
    w.set_row_planner(FakeRowPlanner(spec))
    return w, fake


WIDTH_BATCHES = [  # (qo_lens, kv_lens, per-request widths)
    ([64, 64], [200, 120], [40, 90]),
    ([30, 50, 20], [100, 150, 40], [90, 7, 40]),
    ([100], [190], [13]),
    ([10, 10, 10, 10], [70, 80, 90, 100], [40, 40, 90, 90]),
]


@pytest.mark.parametrize("named", [True, False], ids=["named_widths", "first_plan_pins"])
def test_fa3_window_slots_stay_fixed_and_other_widths_run_custom(named):
    """The window slots' widths are fixed for the capture (named by the capacity, or the first
    plan's); a replayed batch whose rows have other widths runs them in the custom slot - exact."""
    cap = GraphCapacity(max_batch_size=4, max_total_q=192, max_kv_pages=48,
                        window_widths=(40, 90) if named else None)
    w, fake = make_widths(cap)
    engine = Engine(w, cap)
    calls = None
    for i, (qo, kv, widths) in enumerate(WIDTH_BATCHES):
        batch = random_paged_batch(qo, kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE,
                                   seed=i)
        args = {"w": torch.tensor(widths, dtype=torch.int32)}
        static = engine.load(batch, args)
        plan = w.plan(*batch.plan_args(), **static)
        slots = [(la.mask_mode, la.window_left) for la in plan.launches]
        assert slots == [("custom", -1), ("causal", -1), ("none", -1), ("causal", 40), ("causal", 90)]
        kept = {40, 90}
        for r in plan.launch_requests:  # a window run in its width's slot, or (other widths) custom
            if r.cls.name == "WINDOW":
                assert (r.mode.label, r.window) == (("causal", widths[r.request]) if widths[r.request] in kept
                                                   else ("custom", -1)), r
        calls = capture_or_replay(w, fake, engine, static, calls)
        check_replayed(w.spec, engine, batch, args, f"widths batch {i}")
    assert w._graph.windows == (40, 90)


def test_fa3_first_plan_without_windows_pins_none():
    """Pinned at the first plan: a batch without window rows leaves no window slot, and later
    window rows all run custom (name the widths in GraphCapacity to keep their slots)."""
    cap = GraphCapacity(max_batch_size=4, max_total_q=192, max_kv_pages=48)
    w, fake = make_widths(cap)
    engine = Engine(w, cap)
    batch = random_paged_batch([20], [20], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE)
    args = {"w": torch.tensor([1000], dtype=torch.int32)}  # wider than the request: plain causal rows
    w.plan(*batch.plan_args(), **engine.load(batch, args))
    calls = capture(w, fake, engine, engine.static)
    assert w._graph.windows == () and [la.mask_mode for la in w._launches] == list(SLOT_NAMES)
    qo, kv, widths = WIDTH_BATCHES[0]
    batch = random_paged_batch(qo, kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE, seed=3)
    args = {"w": torch.tensor(widths, dtype=torch.int32)}
    plan = w.plan(*batch.plan_args(), **engine.load(batch, args))
    assert all(r.mode.label == "custom" for r in plan.launch_requests if r.cls.name == "WINDOW")
    replay(fake, engine, calls)
    check_replayed(w.spec, engine, batch, args, "windows after a pin to none")


@pytest.mark.parametrize("widths", [[40], (40, 40), (-1,), (1, 2, 3, 4, 5), (True,)])
def test_window_widths_are_checked(widths):
    with pytest.raises(LaunchError, match=r"GraphCapacity: window_widths=.*: expected a tuple of at most 4 distinct "
                                          r"ints >= 0"):
        GraphCapacity(max_batch_size=2, max_total_q=8, max_kv_pages=8, window_widths=widths)


def test_slot_names_in_messages():
    """Capacity and schedule errors name the slot: fa2's fourth is its tail slot, fa3's later ones
    its window slots (by width once pinned)."""
    assert [slot_name(i, False) for i in range(4)] == ["custom", "causal", "none", "tail"]
    assert [slot_name(i, True, (64, 8)) for i in range(3, 7)] == ["window 64", "window 8", "window slot 2",
                                                                  "window slot 3"]
    assert slot_name(3, True) == "window slot 0"


# ----------------------------------------------------------------------------- fa3: GQA packing


def test_fa3_graph_mode_packs_gqa_for_short_requests():
    """GraphCapacity(max_qo_len=4): fa3 graph mode runs GQA-packed (4 rows x group 2 fit a tile),
    fixed from the first plan; each re-planned batch's run() writes its rows (the reference) and
    leaves the static out's rows past it alone; a longer request is refused naming max_qo_len; the
    default capacity (longest request 189 rows x 2 > 192) runs unpacked."""
    cap = GraphCapacity(max_batch_size=4, max_total_q=16, max_kv_pages=48, max_qo_len=4)
    w, _ = make("mm_prefix", cap, backend="fa3")
    engine = Engine(w, cap)
    spec = w.spec
    for seed, (qo_lens, kv_lens, spans) in enumerate([
            ([1, 1, 1], [64, 40, 9], [[(8, 30)], [], [(0, 5)]]),
            ([4, 2, 3, 1], [16, 150, 30, 200], [[], [(3, 90)], [(0, 29)], [(150, 197)]]),
            ([3], [33], [[(0, 32)]])]):
        batch, args = mm_batch(qo_lens, kv_lens, spans, seed=seed)
        static = engine.load(batch, args)
        w.plan(*batch.plan_args(), **static)
        assert w.last_plan.pack_gqa == HQ // HKV
        engine.out.fill_(math.nan)
        w.run(engine.q, (engine.k, engine.v), out=engine.out, **static)
        check_replayed(spec, engine, batch, args, f"packed batch {seed}")
    batch, args = mm_batch([5], [40], [[]], seed=9)
    with pytest.raises(LaunchError, match=re.escape("a request's query rows 5 exceeds the wrapper's CUDA-graph "
                                                    "capacity max_qo_len=4")):
        w.plan(*batch.plan_args(), **engine.load(batch, args))
    w.planner.pack_gqa_enabled = False
    batch, args = mm_batch([1], [40], [[]], seed=10)
    with pytest.raises(LaunchError, match="GQA packing 1 differs from the 2 this CUDA-graph wrapper planned first"):
        w.plan(*batch.plan_args(), **engine.load(batch, args))
    plain, _ = make("mm_prefix", backend="fa3")
    batch, args = mm_batch([1, 1], [64, 40], [[], []], seed=11)
    plain.plan(*batch.plan_args(), **Engine(plain).load(batch, args))
    assert plain.last_plan.pack_gqa == 1
