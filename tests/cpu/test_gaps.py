"""Rows that see several key intervals read in one pass (variantgen/planning/gaps.py): custom launch
requests whose page lists skip the gaps between their rows' intervals. The gaps against the mask
(no visible key is ever skipped), the launch builder's checks of a gap, the plan read back from
the launch metadata, and whole plans through the wrapper on the CPU fakes (fa2 and fa3, the real
launch builder; the fakes map list keys to positions as the variant's key_pos does) against the
derived reference."""

from __future__ import annotations

import math

import pytest
import torch
from _fake_kernel import assert_plan_matches_reference, gap_shift
from test_pieces import HEAD_DIM, HKV, HQ, make, spec_args, specs, visible_keys

from variantgen.abi.table import MAX_KEY_GAPS, NO_GAP_AT, MetaColumn, RowClass, SegField, meta_rows
from variantgen.planning.assembly import TableRules, segment_table
from variantgen.planning.intervals import analyze
from variantgen.planning.pieces import row_pieces
from variantgen.planning.plan import NOT_VISITED, LaunchRequest
from variantgen.planning.rowrules import row_env
from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.reference import reference_attention

NAMES = ["streaming_sink", "prefix_window", "document_sinks", "three", "four", "five"]


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def gaps_of(seg: list[int]) -> list[tuple[int, int]]:
    return [(seg[f], seg[f + 1]) for f in range(SegField.GAP_FROM_1, SegField.GAP_TO_3 + 1, 2) if seg[f + 1] > seg[f]]


def gap_table(spec, qo_indptr, kv_lens, page_size, args):
    """The rows' table as CUDA-graph mode plans it: rows of several intervals in place, past their gaps."""
    found = segment_table(spec, analyze(spec), qo_indptr, kv_lens, page_size, args, torch.device("cpu"),
                          TableRules(split="gaps"))
    return found.table


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", NAMES)
def test_a_gap_never_holds_a_key_one_of_its_rows_sees(name, page_size):
    spec = specs()[name]
    kv_lens = [150, 97, 45]
    qo_indptr = [0, 70, 71, 116]
    args = spec_args(name, kv_lens, page_size)
    table = gap_table(spec, qo_indptr, kv_lens, page_size, args)
    env = row_env(qo_indptr, kv_lens, torch.device("cpu"))
    split = int((row_pieces(analyze(spec), spec, env, args).count >= 2).sum())
    assert table[:, SegField.FIRST_ROW].tolist() == sorted(table[:, SegField.FIRST_ROW].tolist())
    assert (table[:, SegField.PIECE] == -1).all()  # every launch request writes in place
    gapped = 0
    for seg in table.tolist():
        gaps = gaps_of(seg)
        if not gaps:
            continue
        gapped += 1
        assert seg[SegField.CLASS] == RowClass.CUSTOM and len(gaps) <= MAX_KEY_GAPS
        begin, end = seg[SegField.KV_BEGIN], seg[SegField.KV_END]
        after = begin
        for f, t in gaps:  # page-aligned, ascending, apart, keys read on both sides
            assert f % page_size == 0 and t % page_size == 0 and after < f < t < end, (seg, gaps)
            after = t
        vis_lo, vis_hi = seg[SegField.VIS_LO], seg[SegField.VIS_HI]
        for row in range(seg[SegField.FIRST_ROW], seg[SegField.END_ROW]):
            kv_len = kv_lens[int(env["request"][row])]
            seen = visible_keys(spec, env, args, row, kv_len)
            for f, t in gaps:
                assert not seen[f:t].any(), f"{name} ps{page_size}: row {row} sees keys in the gap {f}-{t}"
            assert not seen[:begin].any() and not seen[end:].any()
            if vis_lo <= vis_hi:  # the known-visible keys: every row sees them
                assert seen[vis_lo:vis_hi + 1].all(), (row, vis_lo, vis_hi)
    if name != "five":
        assert gapped > 0 and split > 0, f"{name}: no run of several intervals"


def test_more_intervals_than_gaps_keep_the_longest_gaps():
    """A run whose rows' union has more than MAX_PIECES ranges reads the shortest gaps' pages."""
    spec = specs()["five"]
    kv_lens = [150]
    args = spec_args("five", kv_lens) | {"window": 6}
    table = gap_table(spec, [0, 1], kv_lens, 1, args)
    (seg,) = table.tolist()
    # one row: sinks [0, 2), [20, 24), [40, 42], 50, [143, 149]: five ranges, so it is not split
    # (more than MAX_PIECES intervals: row_pieces says 0) and runs custom over its hull
    assert gaps_of(seg) == [] and seg[SegField.CLASS] == RowClass.CUSTOM
    spec = specs()["four"]
    table = gap_table(spec, [0, 1], kv_lens, 1, spec_args("four", kv_lens))
    (seg,) = table.tolist()
    assert gaps_of(seg) == [(2, 20), (24, 40), (43, 143)]


def run_gaps(name: str, backend: str, qo_lens, kv_lens, page_size: int, seed: int = 0, **scalars):
    spec = specs()[name]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=page_size, seed=seed)
    args = spec_args(name, kv_lens, seed) | scalars
    w, fake = make(spec, backend)
    w.planner.split_rows = "gaps"
    plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
    out = torch.full((batch.q.shape[0], HQ, HEAD_DIM), math.nan, dtype=torch.bfloat16)
    fake.row_writes = None
    w.run(batch.q, (batch.k_cache, batch.v_cache), out=out, return_lse=True, **args)
    _, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, return_lse=True)
    label = f"{name} {backend} ps{page_size} (gaps)"
    assert_plan_matches_reference(out, lse, ref, ref_lse, None, float(batch.v_cache.abs().max()), label)
    assert plan.merge is None and fake.merge_calls == 0, f"{label}: nothing to merge"
    return plan, batch


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", NAMES)
def test_rows_of_several_intervals_run_past_their_gaps_and_match_the_reference(name, page_size, backend):
    plan, _ = run_gaps(name, backend, [70, 1, 45], [150, 97, 45], page_size, seed=page_size)
    gapped = [r for r in plan.launch_requests if r.gaps]
    if name == "five":
        return
    assert gapped and all(r.mode.label == "custom" and r.piece == -1 for r in gapped), plan
    for r in gapped:  # the page list holds the range less the gaps
        assert r.pages * page_size >= r.keys_read > (r.pages - 1) * page_size - page_size


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["streaming_sink", "document_sinks", "three"])
def test_gaps_run_with_fa3_gqa_packing(name, page_size):
    plan, _ = run_gaps(name, "fa3", [1, 1, 6, 3], [300, 97, 260, 180], page_size, seed=page_size)
    assert plan.pack_gqa == HQ // HKV and any(r.gaps for r in plan.launch_requests), plan


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_streaming_sink_past_its_gap_reads_about_its_visible_keys(backend):
    """A streaming_sink row past its first window reads its sinks' page and its window's pages
    in one launch request: its run's window (the window + CUSTOM_ROWS - 1 keys) and a page,
    against the hull's whole causal range."""
    qo_lens, kv_lens, window = [1200], [1200], 255
    plan, _ = run_gaps("streaming_sink", backend, qo_lens, kv_lens, 16, num_sink=4, window=window)
    live = sum(min(q + 1, 4 + window + 1) for q in range(1200))
    hull = sum(q + 1 for q in range(1200))
    visited = plan.work()["visited"]
    assert visited < 1.5 * live and hull > 2.5 * live, (visited, live, hull)


def test_to_dense_and_the_launch_requests_show_the_gaps():
    plan, batch = run_gaps("streaming_sink", "fa3", [40], [200], 4, num_sink=4, window=8)
    grid = plan.to_dense()[0]
    for r in plan.launch_requests:
        for f, t in r.gaps:
            assert (grid[r.rows[0]:r.rows[1], f:t] == NOT_VISITED).all()
    assert any(r.gaps for r in plan.launch_requests)
    # read back from vg_meta, a launch request says what its segment said
    seg = [0] * len(SegField)
    seg[SegField.FIRST_ROW], seg[SegField.END_ROW], seg[SegField.CLASS] = 0, 40, RowClass.CUSTOM
    seg[SegField.KV_BEGIN], seg[SegField.KV_END], seg[SegField.Q_POS], seg[SegField.VIS_HI] = 0, 200, 160, -1
    seg[SegField.PIECE], seg[SegField.GAP_FROM_1], seg[SegField.GAP_TO_1] = -1, 4, 148
    r = LaunchRequest.from_segment(seg, 4)
    assert r.gaps == ((4, 148),) and r.pages == 50 - 36 and r.keys_read == 56 and r.visited() == 40 * 56


def test_the_fakes_map_list_keys_past_the_gaps_as_the_variant():
    """gap_shift (the fakes) against the variant's rule: list key i sits gap_len_j further for
    every gap j with gap_at_j <= i; no gap: gap_at NO_GAP_AT."""
    row = meta_rows(**{c.name.lower(): [0] for c in MetaColumn if not c.name.startswith("GAP_")})
    assert row[MetaColumn.GAP_AT_1:MetaColumn.GAP_LEN_3 + 1] == [NO_GAP_AT, 0] * MAX_KEY_GAPS
    row[MetaColumn.GAP_AT_1], row[MetaColumn.GAP_LEN_1] = 4, 100
    row[MetaColumn.GAP_AT_2], row[MetaColumn.GAP_LEN_2] = 10, 7
    j = torch.arange(14)
    assert (j + gap_shift(row, j)).tolist() == [0, 1, 2, 3, 104, 105, 106, 107, 108, 109, 117, 118, 119, 120]


@pytest.mark.parametrize("case, gaps, cls, pattern", [
    ("not page-aligned", [(6, 16)], RowClass.CUSTOM, "not page-aligned"),
    ("at the first key", [(0, 16)], RowClass.CUSTOM, "not page-aligned"),
    ("to the last key", [(8, 48)], RowClass.CUSTOM, "not page-aligned"),
    ("descending", [(24, 32), (8, 16)], RowClass.CUSTOM, "not page-aligned"),
    ("empty between", [(8, 8), (24, 32)], RowClass.CUSTOM, "not page-aligned"),
    ("on a dense run", [(8, 16)], RowClass.DENSE, "or is not custom"),
])
def test_a_bad_gap_is_named_by_the_launch_builder(case, gaps, cls, pattern):
    """The launch builder checks a segment's gaps before any page list reaches a kernel."""
    from test_pieces import _build

    seg = [0] * len(SegField)  # one request: 4 queries over 48 keys (page size 8)
    seg[SegField.END_ROW], seg[SegField.CLASS], seg[SegField.WINDOW] = 4, cls, -1
    seg[SegField.KV_END], seg[SegField.Q_POS], seg[SegField.VIS_HI], seg[SegField.PIECE] = 48, 44, -1, -1
    good = list(seg)
    good[SegField.CLASS], good[SegField.GAP_FROM_1], good[SegField.GAP_TO_1] = RowClass.CUSTOM, 8, 40
    _build([good], [4], [48], 8, 0)  # (a good gap is taken)
    for j, (f, t) in enumerate(gaps):
        seg[SegField.GAP_FROM_1 + 2 * j], seg[SegField.GAP_TO_1 + 2 * j] = f, t
    with pytest.raises(Exception, match=pattern):
        _build([seg], [4], [48], 8, 0)


def test_rows_the_pieces_leave_unsplit_skip_their_gaps_instead_of_reading_their_hull():
    """fa3 GQA packing runs a piece's causal and window runs custom over their pages; where those
    would read into the row's other pieces the rows stay unsplit - and run past their gaps, not
    over the hull (the four-interval mask, decode-like rows, page size 5: found by a search)."""
    from test_pieces import run_plan

    plan, _ = run_plan("four", "fa3", [3, 40, 6], [303, 60, 306], 5)  # (checks the output against the reference)
    assert plan.pack_gqa > 1 and plan.merge is not None, plan
    gapped = [r for r in plan.launch_requests if r.gaps]
    assert gapped and all(r.piece == -1 and r.mode.label == "custom" for r in gapped), plan


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_a_gapped_launch_requests_page_list_is_its_keys_pages_in_order(page_size):
    """The launch builder's gathered page list of each launch request: the caller's pages of the
    keys its vg_meta row places (kv_pos_base + list index + the gaps before it), page by page."""
    plan, batch = run_gaps("three", "fa2", [70, 1, 45], [150, 97, 45], page_size, seed=page_size)
    page_start = batch.kv_indptr.tolist()
    checked = 0
    for la in plan.launches:
        indptr, meta = la.kv_indptr.tolist(), la.meta.tolist()
        for k in range(la.num_requests):
            row = meta[k]
            n = indptr[k + 1] - indptr[k]
            if n == 0:
                continue
            j = torch.arange(n * page_size)
            pos = row[MetaColumn.KV_POS_BASE] + j + gap_shift(row, j)
            pages = torch.unique_consecutive(torch.div(pos, page_size, rounding_mode="floor"))[:n]
            want = batch.kv_indices[page_start[row[MetaColumn.REQUEST]] + pages]
            assert torch.equal(la.kv_indices[indptr[k]:indptr[k + 1]].cpu(), want.to(torch.int32)), (k, row)
            checked += row[MetaColumn.GAP_LEN_1] > 0
    assert checked > 0, "no gapped launch request"
