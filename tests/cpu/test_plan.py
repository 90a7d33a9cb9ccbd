"""The Plan value (variantgen/planning/plan.py) on the CPU: what plan() returns and keeps as
``last_plan``, its summary, its launch requests and ``to_dense()`` - checked against the
reference mask: an element a launch shows as VISIBLE (no mask evaluated) must be visible, and
no visible element may be left unvisited."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_SPECS, SPECS_DIR
from test_wrapper_cpu import batch_of, make

import variantgen
from variantgen.abi.table import MaskMode, RowClass
from variantgen.planning.plan import MASKED, NOT_VISITED, VISIBLE, LaunchRequest
from variantgen.testing.harness import random_spec_args, spans_to_ranges
from variantgen.wrappers.reference import RequestGrid, mask_for_request


def reference_masks(spec, batch, args) -> list[torch.Tensor]:
    """Per request, bool [qo_len, kv_len]: the mask (head 0; the shipped specs' masks are per head
    only where the planner is off anyway)."""
    out, row = [], 0
    kv_row = 0
    for r, (q, k) in enumerate(zip(batch.qo_lens, batch.kv_lens)):
        grid = RequestGrid(r, q, k, row, kv_row, 1, 1, torch.device("cpu"))
        out.append(mask_for_request(spec, grid, args)[0].clone())
        row, kv_row = row + q, kv_row + k
    return out


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("skip_tiles", [True, False], ids=["planned", "planner_off"])
@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_to_dense_covers_the_mask_and_shows_visible_only_what_is_visible(spec_name, skip_tiles, backend):
    spec = variantgen.load_spec(SPECS_DIR / f"{spec_name}.yaml")
    batch = batch_of([37, 1, 20, 0, 64], [37, 90, 61, 9, 200], 4, seed=3)
    args = random_spec_args(spec, batch, seed=3)
    w, _ = make(spec, backend=backend)
    plan = w.plan(*batch.plan_args(), skip_tiles=skip_tiles, **(args if skip_tiles else {}))
    assert plan is w.last_plan and plan.planner == ("module" if skip_tiles else "off")
    for r, (grid, mask) in enumerate(zip(plan.to_dense(), reference_masks(spec, batch, args))):
        assert grid.shape == mask.shape
        assert not (mask & (grid == NOT_VISITED)).any(), f"request {r}: a visible element is not visited"
        assert mask[grid == VISIBLE].all(), f"request {r}: an element shown visible without the mask is masked"
    rows = [r.rows for r in plan.launch_requests]
    assert rows == sorted(rows) and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # a partition of the rows
    assert sum(la.num_requests for la in plan.launches) == len(plan.launch_requests)
    assert sum(la.num_rows for la in plan.launches) == batch.q.shape[0]
    if not skip_tiles:
        assert {r.cls for r in plan.launch_requests} == {RowClass.CUSTOM}
        assert all(grid[grid != NOT_VISITED].eq(MASKED).all() for grid in plan.to_dense())


def test_the_summary_says_what_the_plan_does():
    spec = variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")
    qo_lens = kv_lens = [512, 512]
    batch = batch_of(qo_lens, kv_lens, 16, seed=11)
    args = {"ranges": spans_to_ranges(qo_lens, kv_lens, [[(37, 100)], [(0, 63), (480, 511)]])}
    w, _ = make(spec)
    plan = w.plan(*batch.plan_args(), **args)
    text = str(plan)
    assert text.startswith("Plan(2 requests, 1024 query rows, 4/2 heads, page size 16; fa2; interval planner "
                           "(planner module))")
    for la in plan.launches:
        assert f"{la.mask_mode:6} {la.num_requests:5} launch requests, {la.num_rows} rows" in text
    work = plan.work()
    assert work["full"] == 2 * 512 * 512 and 0 < work["visited"] < work["full"] and work["masked"] < work["visited"]
    assert work["pages_given"] == 2 * 32 and work["pages_read"] >= 2 * 32  # runs split at spans re-read pages
    assert f"(query, key) pairs visited {work['visited']} of {work['full']}" in text
    assert "launch requests by class: dense" in text
    off = w.plan(*batch.plan_args(), skip_tiles=False)
    assert "planner off: skip_tiles=False" in str(off) and off.work()["masked"] == off.work()["visited"]


def test_a_kept_plan_stays_readable_after_the_next_plan():
    """The launch requests are read from the workspace's host mirror, which the next plan()
    rewrites: a Plan still referenced then keeps a copy."""
    spec = variantgen.load_spec(SPECS_DIR / "sliding_window.yaml")
    w, _ = make(spec)
    first = batch_of([40, 90], [40, 300], 16, seed=1)
    plan = w.plan(*first.plan_args(), window=20)
    before = list(plan.launch_requests)
    plan._requests = None  # read again from the mirror, after the next plan
    second = batch_of([7, 300, 5], [7, 300, 900], 16, seed=2)
    w.plan(*second.plan_args(), window=5)
    assert plan.launch_requests == before and w.last_plan is not plan
    assert [r.window for r in before if r.cls == RowClass.WINDOW] and all(
        r.window == 20 for r in before if r.cls == RowClass.WINDOW)


def test_to_dense_refuses_a_large_batch():
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    w, _ = make(spec)
    batch = batch_of([4096], [4097], 16)
    plan = w.plan(*batch.plan_args())
    with pytest.raises(ValueError, match=r"Plan.to_dense\(\): 16781312 query-key pairs; it draws at most 16777216"):
        plan.to_dense()


def test_launch_request_from_a_segment_and_what_it_visits():
    # rows 10..13 of request 2, window 3, keys 16..40 (page 8), first query at position 30
    r = LaunchRequest.from_segment([10, 14, 2, int(RowClass.WINDOW), 3, 16, 34, 30, 0, -1], 8)
    assert (r.rows, r.request, r.cls, r.mode, r.window, r.keys, r.pages, r.q_pos) == (
        (10, 14), 2, RowClass.WINDOW, MaskMode.CAUSAL, 3, (16, 34), 3, 30)
    assert r.visited() == 4 * 4  # each row sees itself and 3 keys back
    causal = LaunchRequest.from_segment([0, 3, 0, int(RowClass.CAUSAL), -1, 0, 8, 5, 0, -1], 8)
    assert causal.visited() == 6 + 7 + 8
    dense = LaunchRequest.from_segment([0, 3, 0, int(RowClass.DENSE), -1, 8, 20, 30, 0, -1], 8)
    assert dense.visited() == 3 * 12 and dense.pages == 2


# ----------------------------------------------------------------------------- query-tile alignment


def tiles_of(plan, rows_per_tile: int) -> int:
    return sum(-(-(r.rows[1] - r.rows[0]) // rows_per_tile) for r in plan.launch_requests)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_mm_prefix_on_the_benchmark_spans_costs_the_query_tiles_causal_does(backend):
    """The benchmark's three 1024-row spans per 8192-token request: each span's last row sees
    what the span rows see (dense) and is causal-shaped; the builder runs it with the span, so
    every run is whole tiles and the plan pays causal's tile count (fa3: 128-row tiles; fa2: 64
    rows of 2 query heads) - not three part-filled ones more per request (6% of the kernel)."""
    from _fake_modules import FakeModules

    from variantgen.testing.fuzz_cases import ModuleKey, Target
    from variantgen.testing.harness import PREFILL_BENCH_SPANS, random_paged_batch

    lens = [8192, 8192]
    batch = random_paged_batch(lens, lens, num_qo_heads=2, num_kv_heads=1, head_dim=128, page_size=16, seed=4)
    ranges = spans_to_ranges(lens, lens, [PREFILL_BENCH_SPANS] * 2)
    rows_per_tile = 128 if backend == "fa3" else 64
    plans = {}
    for name, args in (("causal", {}), ("mm_prefix", {"ranges": ranges})):
        w = FakeModules().wrapper(Target("t", backend, "prefill", "prefill"), ModuleKey(name))
        plans[name] = w.plan(*batch.plan_args(), skip_tiles=True, **args)
    reqs = plans["mm_prefix"].launch_requests
    assert {r.cls for r in reqs} == {RowClass.DENSE, RowClass.CAUSAL} and len(reqs) == 2 * 7
    assert all((r.rows[1] - r.rows[0]) % rows_per_tile == 0 for r in reqs), [r.rows for r in reqs]
    assert tiles_of(plans["mm_prefix"], rows_per_tile) == tiles_of(plans["causal"], rows_per_tile) == 2 * 8192 // (
        rows_per_tile)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_a_span_row_moved_into_the_dense_run_is_exact(backend):
    """Spans whose rows stop one short of a tile (fa3: 192-row tiles at head dim 64; fa2: 64 rows
    of 2 query heads), in full and chunked prefill: the moved row runs dense, the output matches
    the reference."""
    from test_wrapper_cpu import check

    spec = variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")
    qo_lens, kv_lens = [576, 192, 200], [576, 192, 384]
    spans = [[(192, 383)], [(64, 127)], [(256, 319)]]
    batch = batch_of(qo_lens, kv_lens, 16, seed=5)
    args = {"ranges": spans_to_ranges(qo_lens, kv_lens, spans)}
    w, _ = check(spec, batch, args, skip_tiles=True, backend=backend, label=f"aligned spans {backend}")
    dense = [(r.request, r.keys, r.rows[1] - r.rows[0]) for r in w.last_plan.launch_requests if r.cls == RowClass.DENSE]
    # fa3: request 0's span rows 192..382 and its last row, one 192-row tile; fa2: request 1's and
    # request 2's (chunked: its rows at key positions 184..383), one 64-row tile each
    want = [(0, (0, 384), 192)] if backend == "fa3" else [(1, (0, 128), 64), (2, (0, 320), 64)]
    assert all(d in dense for d in want), dense


def test_to_dense_shows_a_tail_run_masked_from_its_first_query_on():
    """fa2's tail launch runs causal with the mask evaluated on each launch request's diagonal
    tile: to_dense shows its context keys (before the run's first query position) VISIBLE and
    every key from that position to the row's own MASKED - the first query's own key included,
    which the kernel evaluates the mask on like any key of the draft."""
    spec = variantgen.load_spec(SPECS_DIR / "tree_verify.yaml")
    batch = batch_of([4, 5], [10, 40], 4, seed=5)
    args = {"tree_bits": variantgen.tree_bits([[-1, 0, 0, 1], [-1, 0, 1, -1, 3]])}
    w, _ = make(spec)
    plan = w.plan(*batch.plan_args(), **args)
    tails = [r for r in plan.launch_requests if r.cls == RowClass.TAIL]
    assert {r.request for r in tails} == {0, 1}, plan.launch_requests
    grids = plan.to_dense()
    starts = batch.qo_indptr.tolist()
    for r in tails:
        grid, (kb, ke) = grids[r.request], r.keys
        for i in range(r.rows[0] - starts[r.request], r.rows[1] - starts[r.request]):
            q_pos = r.q_pos + i - (r.rows[0] - starts[r.request])
            want = [VISIBLE if k < r.q_pos else MASKED if k <= q_pos else NOT_VISITED for k in range(kb, ke)]
            assert grid[i, kb:ke].tolist() == want, (r, i)


# ----------------------------------------------------------------------------- every kind's Plan

KIND_TARGETS = [  # (kind, backend, module kind, tensor cores): every FlashInfer route on the fakes
    ("prefill", "fa2", "prefill", False), ("prefill", "fa3", "prefill", False),
    ("decode", "fa2", "decode", False), ("decode", "fa2", "prefill", True), ("decode", "fa3", "prefill", True),
    ("ragged", "fa2", "ragged", False), ("ragged", "fa3", "ragged", False),
]


def _plan_kind(w, kind, batch, spec_args, **kw):
    if kind == "ragged":
        return w.plan(batch.qo_indptr, batch.kv_indptr, batch.num_qo_heads, batch.num_kv_heads, **spec_args)
    plan_args = batch.plan_args()[1:] if kind == "decode" else batch.plan_args()
    return w.plan(*plan_args, **kw, **spec_args)


def _kind_batch(kind, seed=1):
    from variantgen.testing.harness import random_paged_batch

    qo = [1, 1, 1] if kind == "decode" else [5, 0, 9]
    return random_paged_batch(qo, [40, 7, 33], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                              page_size=1 if kind == "ragged" else 4, seed=seed)


def _check_kind_plan(w, plan, kind, backend):
    from variantgen.planning.plan import Plan

    assert isinstance(plan, Plan) and plan is w.last_plan
    assert plan.kind == kind and plan.backend == backend
    text = str(plan)
    assert text.startswith("Plan(") and (kind in text or kind == "prefill")
    stats = plan.stats()
    assert "launches" in stats and ("planner_off" in stats) == (plan.planner == "off")
    if plan.planner == "off":
        assert plan.reason and plan.reason in text


@pytest.mark.parametrize("skip_tiles", [None, False], ids=["default", "off"])
@pytest.mark.parametrize("spec_name", ["causal", "sliding_window"])
@pytest.mark.parametrize("kind,backend,module_kind,tensor_cores", KIND_TARGETS)
def test_every_kind_plan_returns_its_plan(kind, backend, module_kind, tensor_cores, spec_name, skip_tiles):
    """plan() of every FlashInfer kind (on the fakes) returns a Plan, kept as last_plan, printable,
    naming its kind and backend and why the interval planner is off where it is; a failed plan()
    leaves last_plan None."""
    from _fake_modules import FakeModules

    from variantgen.core.errors import LaunchError
    from variantgen.testing.fuzz_cases import ModuleKey, Target

    spec = variantgen.load_spec(SPECS_DIR / f"{spec_name}.yaml")
    target = Target("t", backend, kind, module_kind, tensor_cores=tensor_cores)
    w = FakeModules().wrapper(target, ModuleKey(spec_name, 64, 64))
    batch = _kind_batch(kind)
    args = random_spec_args(spec, batch, seed=1)
    kw = {} if kind == "ragged" else {"skip_tiles": skip_tiles}
    plan = _plan_kind(w, kind, batch, args, **kw)
    _check_kind_plan(w, plan, kind, backend)
    if skip_tiles is False:
        assert plan.planner == "off"
    if kind == "decode" and not tensor_cores:
        assert plan.planner == ("off" if skip_tiles is False else "key trimming")
        assert plan.stats() == w.plan_stats
    if kind == "ragged":
        assert plan.planner == "off" and "ragged" in plan.reason and plan.stats()["launches"] == w.plan_stats[
            "launches"]
    with pytest.raises(LaunchError):
        if kind == "ragged":
            w.plan(batch.qo_indptr, batch.kv_indptr, 4, 3)
        else:
            w.plan(*(batch.plan_args()[1:4] if kind == "decode" else batch.plan_args()[:4]), 4, 3, batch.page_size)
    assert w.last_plan is None


@pytest.mark.parametrize("skip_tiles", [None, False], ids=["default", "off"])
@pytest.mark.parametrize("spec_name", ["causal", "sliding_window"])
@pytest.mark.parametrize("kind", ["prefill", "decode", "ragged"])
def test_every_flex_kind_plan_returns_its_plan(kind, spec_name, skip_tiles):
    """The flex route's plan() (on the CPU) returns a Plan too: kind, backend "flex", how Flex's
    block lists are found, and last_plan None after a failed plan()."""
    from variantgen.core.errors import LaunchError
    from variantgen.wrappers.flex_wrapper import make_flex_wrapper

    spec = variantgen.load_spec(SPECS_DIR / f"{spec_name}.yaml")
    w = make_flex_wrapper(spec, torch.empty(0, dtype=torch.uint8), head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16",
                          kind=kind)
    batch = _kind_batch(kind)
    args = random_spec_args(spec, batch, seed=1)
    kw = {} if kind == "ragged" else {"skip_tiles": skip_tiles}
    plan = _plan_kind(w, kind, batch, args, **kw)
    _check_kind_plan(w, plan, kind, "flex")
    assert "Flex" in plan.scheduled_by
    if kind != "ragged":
        assert plan.planner == ("off" if skip_tiles is False else "intervals" if kind == "prefill" else "key trimming")
    with pytest.raises(LaunchError):
        if kind == "ragged":
            w.plan(batch.qo_indptr, batch.kv_indptr, 4, 3)
        else:
            w.plan(*(batch.plan_args()[1:4] if kind == "decode" else batch.plan_args()[:4]), 4, 3, batch.page_size)
    assert w.last_plan is None


def test_multi_token_decode_plans_are_decode_plans():
    """Multi-token decode runs the prefill launches (tensor cores, the flex prefill route): its Plan says decode."""
    from variantgen.wrappers.flex_wrapper import make_flex_wrapper

    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    w = make_flex_wrapper(spec, torch.empty(0, dtype=torch.uint8), head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16",
                          kind="decode")
    batch = _kind_batch("decode")
    plan = w.plan(*batch.plan_args()[1:], q_len_per_request=2)
    _check_kind_plan(w, plan, "decode", "flex")
