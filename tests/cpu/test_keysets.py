"""Sparse key sets as page lists (variantgen/planning/keysets.py): custom runs of rows that see a
key set (global tokens, the summary keys of fixed sparse attention) read only the pages holding a
key one of their rows sees. The terms intervals.py finds, the page lists against the mask (no
visible key is ever left out), the launch builder's checks of a list and the tables it writes, and
whole plans through the wrapper on the CPU fakes (fa2 and fa3, the real launch builder; the fakes
place list keys through the page table as the variants' key_pos does) against the derived reference."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from _fake_kernel import assert_plan_matches_reference
from test_pieces import HEAD_DIM, HKV, HQ, _spec, make, visible_keys

import variantgen
from variantgen import GraphCapacity
from variantgen.abi.table import SEG_FIELDS, PlanOption, RecField, RowClass, SegField
from variantgen.core.errors import LaunchError
from variantgen.lang.nodes import Name
from variantgen.lang.reads import Blocks
from variantgen.planning.assembly import TableRules, segment_table
from variantgen.planning.cost import batch_cost
from variantgen.planning.intervals import analyze
from variantgen.planning.keysets import has_key_sets, row_blocks
from variantgen.planning.plan import LaunchRequest
from variantgen.planning.rowrules import classify_rows, row_env
from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.reference import reference_attention

MASKS = Path(__file__).resolve().parents[2] / "bench" / "masks"


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


@functools.cache
def specs() -> dict[str, variantgen.VariantSpec]:
    flags = "tensors:\n  is_global:\n    dtype: int32\n    shape: [total_kv]\n"
    return {
        "global_window": variantgen.load_spec(MASKS / "global_window.yaml"),
        "fixed_sparse": variantgen.load_spec(MASKS / "fixed_sparse.yaml"),
        # global keys seen causally beside a causal window: two exact-bounded terms and a key set
        "causal_global": _spec("causal_global",
                               "kv_pos <= q_pos and (q_pos - kv_pos <= window or is_global[kv_row] != 0)",
                               {"window": 6}, flags),
        # every stride-th key (a key set without a tensor) and a window
        "strided_keys": _spec("strided_keys", "kv_pos <= q_pos and (kv_pos % stride == 0 or q_pos - kv_pos < 4)",
                              {"stride": 23}),
        # global keys seen only by the queries from position `from_q` on: runs before it show no key
        # of the set (the term's rows are none of theirs)
        "late_global": _spec("late_global", "kv_pos <= q_pos and (q_pos - kv_pos <= window or "
                                            "(q_pos >= from_q and is_global[kv_row] != 0))",
                             {"window": 6, "from_q": 170}, flags),
        # keys picked per block of rows (BigBird's random blocks): row_blocks' pages
        "bigbird": variantgen.load_spec(MASKS / "bigbird.yaml"),
        # the same with other row and key divisors (neither a page multiple) and the key read by kv_row
        "block_random": _spec("block_random", "kv_pos <= q_pos and (q_pos - kv_pos < 4 or "
                                              "bit(picks[q_pos // rb % 16], kv_row // kb % 32))",
                              {"rb": 7, "kb": 5}, "tensors:\n  picks: {dtype: int32, shape: [16]}\n"),
    }


def spec_args(name: str, kv_lens: list[int], seed: int = 0, share: float = 0.03) -> dict:
    spec = specs()[name]
    args = {s.name: s.default for s in spec.scalars}
    if name == "global_window":
        args["window"] = 5
    if name == "fixed_sparse":
        args.update(block=48, c=3)
    if name == "bigbird":
        args.update(block=8, global_blocks=1)
    if name in ("bigbird", "block_random"):  # a few random key blocks per row block
        g = torch.Generator().manual_seed(seed)
        tensor = spec.tensors[0]
        words = ((torch.rand(tensor.shape[0], 32, generator=g) < 0.1).long() << torch.arange(32)).sum(1)
        args[tensor.name] = (words - (words >= 2**31).long() * 2**32).to(torch.int32)
    if any(t.name == "is_global" for t in spec.tensors):
        g = torch.Generator().manual_seed(seed)
        args["is_global"] = (torch.rand(sum(kv_lens), generator=g) < share).to(torch.int32)
    return args


def lists_of(table: torch.Tensor, list_rows: int) -> tuple[list[list[int]], list[int]]:
    rows = table.tolist()
    segs = rows[:len(rows) - list_rows]
    return segs, [x for row in rows[len(rows) - list_rows:] for x in row]


def test_a_key_only_atom_is_a_key_set_and_one_that_reads_the_row_is_not():
    terms = {name: analyze(spec).terms for name, spec in specs().items()}
    assert [t.key_set for t in terms["global_window"]] == [False, True, False]  # window, is_global[kv_row], row flag
    assert [t.key_set for t in terms["fixed_sparse"]] == [False, True]
    assert "(key set)" in terms["fixed_sparse"][1].describe()
    bigbird = analyze(variantgen.load_spec(MASKS / "bigbird.yaml"))  # bit(random_blocks[q_pos // block], ...)
    strided = analyze(variantgen.load_spec(MASKS / "strided.yaml"))  # (q_pos - kv_pos) % stride: reads the row
    assert not any(t.key_set for t in bigbird.terms) and any(t.opaque for t in bigbird.terms)
    assert not any(t.key_set for t in strided.terms)
    # bigbird's bit reads the row by blocks (q_pos // block): its pages per block pair; strided's
    # atom reads the row by position: its term keeps its pages
    (random,) = [t for t in bigbird.terms if t.opaque]
    assert row_blocks(random) == (Blocks("q_pos", Name(id="block")), Blocks("kv_pos", Name(id="block")))
    assert all(row_blocks(t) is None for t in strided.terms)
    block_random = next(t for t in analyze(specs()["block_random"]).terms if t.opaque)
    assert row_blocks(block_random) == (Blocks("q_pos", Name(id="rb")), Blocks("kv_row", Name(id="kb")))
    assert "is_global" in analyze(specs()["global_window"]).names  # plan() needs the flags


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", sorted(specs()))
def test_a_page_list_holds_every_key_its_rows_see(name, page_size):
    spec = specs()[name]
    kv_lens, qo_indptr = [300, 97, 180], [0, 300, 301, 381]
    args = spec_args(name, kv_lens, seed=page_size)
    form = analyze(spec)
    assert has_key_sets(form, spec, args)
    cpu = torch.device("cpu")
    base = segment_table(spec, form, qo_indptr, kv_lens, page_size, args, cpu, TableRules()).table
    found = segment_table(spec, form, qo_indptr, kv_lens, page_size, args, cpu, TableRules(lists=True))
    table, list_rows = found.table, found.list_rows
    assert torch.equal(found.segments, table[:base.shape[0]])
    segs, lists = lists_of(table, list_rows)
    assert torch.equal(torch.tensor(segs)[:, :SegField.PAGE_LIST_AT], base[:, :SegField.PAGE_LIST_AT])
    env = row_env(qo_indptr, kv_lens, torch.device("cpu"))
    listed_runs = 0
    for seg in segs:
        n = seg[SegField.PAGE_LIST_LEN]
        if not n:
            continue
        listed_runs += 1
        assert seg[SegField.CLASS] == RowClass.CUSTOM and seg[SegField.PIECE] == -1
        pages = lists[seg[SegField.PAGE_LIST_AT]:seg[SegField.PAGE_LIST_AT] + n]
        first, end = seg[SegField.KV_BEGIN] // page_size, -(-seg[SegField.KV_END] // page_size)
        assert pages == sorted(set(pages)) and first <= pages[0] and pages[-1] < end and len(pages) < end - first
        kv_len = kv_lens[seg[SegField.REQUEST]]
        on = torch.zeros(max(kv_len, end * page_size), dtype=torch.bool)
        for p in pages:
            on[p * page_size:(p + 1) * page_size] = True
        for row in range(seg[SegField.FIRST_ROW], seg[SegField.END_ROW]):
            seen = visible_keys(spec, env, args, row, kv_len)
            assert not (seen & ~on[:kv_len]).any(), f"{name} ps{page_size}: row {row} sees a key off its list"
    assert listed_runs > 0, f"{name} ps{page_size}: no run read through a page list"


def test_the_lists_cut_the_keys_read_to_about_the_live_pages():
    """The CPU cost (bench_planner's figure) of the collection's key-set masks at 8192 tokens, 0.5 %
    global tokens: about the page-granular live area, against 6-7x with the hull."""
    for name, file in (("global_window", "global_window.yaml"), ("fixed_sparse", "fixed_sparse.yaml")):
        spec = variantgen.load_spec(MASKS / file)
        args = {s.name: s.default for s in spec.scalars}
        if name == "global_window":
            g = torch.Generator().manual_seed(0)
            args["is_global"] = (torch.rand(4096, generator=g) < 0.005).to(torch.int32)
        cost = batch_cost(spec, args, [4096], [4096])
        assert cost.planner == "module" and cost.keys_read < 2.5 * cost.keys_visible, (name, cost.to_json())


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", sorted(specs()))
def test_key_set_rows_read_their_page_lists_and_match_the_reference(name, page_size, backend):
    spec = specs()[name]
    qo_lens, kv_lens = [200, 1, 60], [260, 150, 60]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=page_size, seed=page_size)
    args = spec_args(name, kv_lens, seed=page_size)
    visited = {}
    for lists in (True, False):
        w, fake = make(spec, backend)
        w.planner.key_set_lists = lists
        plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        listed = [r for r in plan.launch_requests if r.cls == RowClass.CUSTOM and r.gaps]
        assert bool(listed) == lists, (lists, plan)
        # (page lists run in the listed launch, the custom launch keeps the variant without tables)
        assert [la.listed for la in plan.launches].count(True) == int(lists), plan
        visited[lists] = plan.work()["visited"]
        out = torch.full((batch.q.shape[0], HQ, HEAD_DIM), math.nan, dtype=torch.bfloat16)
        got, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), out=out, return_lse=True, **args)
        ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                           batch.kv_indptr, batch.kv_indices, batch.last_page_len, args,
                                           return_lse=True)
        assert_plan_matches_reference(out, lse, ref, ref_lse, None, 0.0, f"{name} {backend} ps{page_size} {lists=}")
    assert visited[True] < visited[False], visited


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_lists_with_fa3_gqa_packing(page_size):
    """Decode-like requests (a few queries each) are GQA-packed on fa3: their page lists too."""
    spec = specs()["causal_global"]
    qo_lens, kv_lens = [1, 3, 2], [400, 250, 90]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=page_size, seed=3)
    args = spec_args("causal_global", kv_lens, seed=3)
    w, _ = make(spec, "fa3")
    plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
    assert plan.pack_gqa > 1 and any(r.gaps for r in plan.launch_requests), plan
    got, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, return_lse=True)
    assert_plan_matches_reference(got, lse, ref, ref_lse, None, 0.0, f"packed ps{page_size}")


def test_plan_without_the_tensor_a_row_block_test_reads_is_named():
    """BigBird's random blocks decide its page lists, so plan(skip_tiles=True) needs them as it
    needs global tokens' flags: without them it raised a KeyError from inside the page-list
    evaluation; now a LaunchError names the tensor."""
    spec = specs()["bigbird"]
    assert "random_blocks" in analyze(spec).names
    batch = random_paged_batch([200], [260], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=16)
    args = spec_args("bigbird", [260])
    args.pop("random_blocks")
    w, _ = make(spec, "fa2")
    with pytest.raises(LaunchError, match="read random_blocks; pass them to plan"):
        w.plan(*batch.plan_args(), skip_tiles=True, **args)


def test_the_next_plan_does_not_read_the_last_plans_lists():
    """PlanOption.LIST_ROWS is shared with the row kernel's call: after a plan with page lists, a
    plan whose rows need none (late_global's rows before from_q: exact windows) is the row kernel's
    table alone, not its last rows read as lists; and the plan after it lists again."""
    spec = specs()["late_global"]
    late = ([70, 1, 33], [260, 190, 33])  # rows past from_q = 170: custom, with page lists
    early = ([40, 1, 60], [120, 90, 160])  # every row before it
    w, _ = make(spec, "fa2")
    for (qo_lens, kv_lens), listed in ((late, True), (early, False), (late, True)):
        batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                                   page_size=4, seed=5)
        args = spec_args("late_global", kv_lens, seed=5, share=0.05)
        plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        assert w.planner._opt[PlanOption.LIST_ROWS] == 0
        assert any(r.gaps for r in plan.launch_requests) is listed, plan
        fresh, _ = make(spec, "fa2")
        assert plan.launch_requests == fresh.plan(*batch.plan_args(), skip_tiles=True, **args).launch_requests
        got, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
        ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                           batch.kv_indptr, batch.kv_indices, batch.last_page_len, args,
                                           return_lse=True)
        assert_plan_matches_reference(got, lse, ref, ref_lse, None, 0.0, f"{listed=}")


def test_graph_mode_keeps_the_hull_for_key_set_rows():
    """The page tables are sized per batch: CUDA-graph mode's fixed slots run such rows over their
    hull, exactly as before."""
    spec = specs()["causal_global"]
    batch = random_paged_batch([64, 40], [120, 90], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=5)
    args = spec_args("causal_global", [120, 90])
    w, _ = make(spec, "fa2", graph=GraphCapacity(max_batch_size=2, max_total_q=128, max_kv_pages=64))
    plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
    assert not any(r.gaps for r in plan.launch_requests), plan
    got, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, return_lse=True)
    assert_plan_matches_reference(got, lse, ref, ref_lse, None, 0.0, "graph mode")


def test_a_row_whose_exact_terms_cover_its_hull_is_exact():
    """A global token's row sees every key (``is_global[q_kv_row] != 0``): exact and dense, though
    another of the mask's terms is a key set - not a custom row that would make its whole run
    read every page."""
    spec = specs()["global_window"]
    kv_lens = [64]
    args = spec_args("global_window", kv_lens) | {"is_global": torch.zeros(64, dtype=torch.int32)}
    args["is_global"][[10, 40]] = 1
    rec = classify_rows(spec, analyze(spec), [0, 64], kv_lens, 4, args, torch.device("cpu"))
    assert rec[RecField.CLASS, 10] == RowClass.DENSE and rec[RecField.CLASS, 40] == RowClass.DENSE
    assert rec[RecField.CLASS, 20] == RowClass.CUSTOM


# ----------------------------------------------------------------------------- the launch builder


def _build(table: list[list[int]], lists: list[int], kv_len: int, page_size: int):
    from _builder import plan_builder

    builder = plan_builder()
    n_rows = -(-len(lists) // SEG_FIELDS)
    flat = lists + [0] * (n_rows * SEG_FIELDS - len(lists))
    rows = torch.tensor(table + ([flat[i:i + SEG_FIELDS] for i in range(0, len(flat), SEG_FIELDS)]),
                        dtype=torch.int64)
    pages = -(-kv_len // page_size)
    qo = table[-1][SegField.END_ROW]
    indices = torch.tensor([0, qo, 0, pages, kv_len - (pages - 1) * page_size], dtype=torch.int32)
    options = _options(page_size, n_rows)
    host = torch.zeros(1 << 16, dtype=torch.uint8)
    desc = torch.zeros(_desc_len(), dtype=torch.int64)
    builder.build_launches(indices, rows, options, host, desc)
    return host, desc


def _options(page_size: int, list_rows: int) -> torch.Tensor:
    from variantgen.abi.table import OPTION_FIELDS
    o = torch.zeros(OPTION_FIELDS, dtype=torch.int64)
    o[PlanOption.PAGE_SIZE], o[PlanOption.NUM_SM], o[PlanOption.FA3_CTA_TILE_Q] = page_size, 132, 128
    o[PlanOption.NUM_QO_HEADS], o[PlanOption.NUM_KV_HEADS] = 4, 1
    o[PlanOption.HEAD_DIM_QK] = o[PlanOption.HEAD_DIM_VO] = 64
    o[PlanOption.KV_DTYPE_BYTES] = 2
    o[PlanOption.LIST_ROWS] = list_rows
    o[PlanOption.WINDOW_COUNT] = -1
    return o


def _desc_len() -> int:
    from variantgen.abi.table import HEADER_FIELDS, LAUNCH_FIELDS, MAX_LAUNCHES
    return HEADER_FIELDS + LAUNCH_FIELDS * MAX_LAUNCHES


def _segment(first: int, end: int, kv_end: int, at: int, n: int) -> list[int]:
    """A custom run of rows first..end-1 (the request's last queries) over keys [0, kv_end)."""
    seg = [0] * SEG_FIELDS
    seg[SegField.FIRST_ROW], seg[SegField.END_ROW], seg[SegField.CLASS] = first, end, RowClass.CUSTOM
    seg[SegField.WINDOW], seg[SegField.KV_END], seg[SegField.Q_POS] = -1, kv_end, kv_end - end + first
    seg[SegField.VIS_HI], seg[SegField.PIECE] = -1, -1
    seg[SegField.PAGE_LIST_AT], seg[SegField.PAGE_LIST_LEN] = at, n
    return seg


@pytest.mark.parametrize("pages, pattern", [
    ([3, 1], "page list that is not ascending"),
    ([2, 12], "page list that is not ascending"),  # past its keys (40 keys of page 4: pages 0-9)
    ([1, 1], "page list that is not ascending"),
])
def test_a_bad_page_list_is_named(pages, pattern):
    seg = _segment(0, 4, 40, 0, len(pages))
    with pytest.raises(Exception, match=pattern):
        _build([seg], pages, 40, 4)


def test_the_builder_lays_a_page_list_out_with_its_key_positions():
    seg = _segment(0, 4, 40, 0, 3)
    host, desc = _build([seg], [0, 4, 9], 40, 4)
    from variantgen.abi.table import HEADER_FIELDS, META_COLUMNS, HeaderField, LaunchField, MetaColumn

    assert desc[HeaderField.STATUS] == 0
    d = desc[HEADER_FIELDS:].tolist()
    ints = host.view(torch.int32)
    at, n = d[LaunchField.OFFSET] // 4, d[LaunchField.SLOT]
    kv_indptr = ints[at + n + 1:at + 2 * n + 2].tolist()
    last = ints[at + 2 * n + 2:at + 3 * n + 2].tolist()
    meta_at = at + 3 * n + 2
    row = ints[meta_at:meta_at + META_COLUMNS].tolist()
    assert kv_indptr == [0, 3] and last == [4]  # three pages, the last (page 9: keys 36-39) whole
    table = ints[meta_at + row[MetaColumn.PAGE_TABLE_AT]:][:3].tolist()
    assert table == [0, 16, 36] and row[MetaColumn.LIST_PAGE_SIZE] == 4
    request = LaunchRequest.from_segment(seg, 4, [0, 4, 9])
    assert request.gaps == ((4, 16), (20, 36)) and request.keys_read == 12 and request.pages == 3
