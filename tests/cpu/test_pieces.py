"""Rows that see several key intervals (variantgen/planning/pieces.py, merge.py): the intervals found per
row against the mask itself, the LSE merge against one softmax over the union, and whole plans
through the wrapper on the CPU fakes (fa2 and fa3, the real launch builder) against the derived
reference - StreamingLLM's sinks + window, a prefix + window, documents + global sinks, and
masks of three, four and (past MAX_PIECES) five intervals; chunked prefill, GQA, page sizes 1, 5
and 16."""

from __future__ import annotations

import functools
import math
import random
from pathlib import Path

import pytest
import torch
from _fake_kernel import FakeFa3Module, FakeModule, FakeRowPlanner, assert_plan_matches_reference
from conftest import SPECS_DIR

import variantgen
from variantgen import GraphCapacity
from variantgen.abi.table import MAX_PIECES, RowClass, SegField
from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import render
from variantgen.lang.evaluate import Evaluator
from variantgen.lang.spec import parse_spec
from variantgen.planning.assembly import TableRules, segment_table
from variantgen.planning.intervals import analyze
from variantgen.planning.pieces import INLINE_KEYS, may_split, row_pieces
from variantgen.planning.rowrules import row_env
from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.merge import merge_inline_reference
from variantgen.wrappers.merge import merge_pieces_reference as merge_pieces
from variantgen.wrappers.paged import VariantWrapper
from variantgen.wrappers.reference import reference_attention

HQ, HKV, HEAD_DIM = 8, 2, 64


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def _spec(name: str, mask: str, scalars: dict[str, int], tensors: str = "") -> variantgen.VariantSpec:
    lines = "".join(f"  {k}:\n    dtype: int\n    default: {v}\n    min: 0\n" for k, v in scalars.items())
    return parse_spec(f"name: {name}\ndescription: test mask\n{tensors}scalars:\n{lines}mask: {mask}\n")


@functools.cache
def specs() -> dict[str, variantgen.VariantSpec]:
    doc_tensor = "tensors:\n  doc_ids:\n    dtype: int32\n    shape: [total_kv]\n"
    return {
        "streaming_sink": variantgen.load_spec(SPECS_DIR / "streaming_sink.yaml"),
        # a bidirectional prefix (a system prompt) every row sees, then a sliding window
        "prefix_window": _spec("prefix_window", "kv_pos < prefix or (kv_pos <= q_pos and q_pos - kv_pos <= window)",
                               {"prefix": 7, "window": 5}),
        # packed documents, causal within each, and the first keys of the sequence seen by all
        "document_sinks": _spec("document_sinks",
                                "kv_pos <= q_pos and (doc_ids[kv_row] == doc_ids[q_kv_row] or kv_pos < num_global)",
                                {"num_global": 3}, doc_tensor),
        # sinks, a block of keys in the middle (a retrieved passage) and a window: three intervals
        "three": _spec("three", "kv_pos <= q_pos and (kv_pos < sink or (kv_pos >= at and kv_pos < at + 4) "
                                "or q_pos - kv_pos <= window)", {"sink": 2, "at": 20, "window": 6}),
        # and a second block: four
        "four": _spec("four", "kv_pos <= q_pos and (kv_pos < sink or (kv_pos >= at and kv_pos < at + 4) "
                              "or (kv_pos >= at2 and kv_pos <= at2 + 2) or q_pos - kv_pos <= window)",
                      {"sink": 2, "at": 20, "at2": 40, "window": 6}),
        # five: more than MAX_PIECES, such rows run over their hull as before
        "five": _spec("five", "kv_pos <= q_pos and (kv_pos < sink or (kv_pos >= at and kv_pos < at + 4) "
                              "or (kv_pos >= at2 and kv_pos <= at2 + 2) or kv_pos == at3 "
                              "or q_pos - kv_pos <= window)", {"sink": 2, "at": 20, "at2": 40, "at3": 50, "window": 6}),
        # bands: keys on both sides of the row (Longformer's local window, one with a global
        # prefix, one lopsided), which run causal / window with the diagonal past q_pos
        "band": _spec("band", "abs(q_pos - kv_pos) <= window", {"window": 6}),
        "sinks_band": _spec("sinks_band", "kv_pos < sink or abs(q_pos - kv_pos) <= window", {"sink": 3, "window": 9}),
        "asym_band": _spec("asym_band", "q_pos - before <= kv_pos and kv_pos <= q_pos + after",
                           {"before": 20, "after": 3}),
    }


def doc_ids(kv_lens: list[int], seed: int) -> torch.Tensor:
    """Sorted document ids per request (documents of 1-30 keys)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in kv_lens:
        ids, doc = [], 0
        while len(ids) < k:
            ids += [doc] * int(torch.randint(1, 31, (1,), generator=g))
            doc += 1
        out += ids[:k]
    return torch.tensor(out, dtype=torch.int32)


def spec_args(name: str, kv_lens: list[int], seed: int = 0) -> dict:
    args = {s.name: s.default for s in specs()[name].scalars}
    if name == "document_sinks":
        args["doc_ids"] = doc_ids(kv_lens, seed)
    if name == "streaming_sink":  # (its default window, 1023, is longer than these requests)
        args.update(num_sink=4, window=20)
    return args


# ----------------------------------------------------------------------------- intervals


def visible_keys(spec, env: dict, args: dict, row: int, kv_len: int) -> torch.Tensor:
    """The mask evaluated on every key of one row (the ground truth)."""
    one = {k: v[row:row + 1].expand(kv_len) for k, v in env.items() if k != "vg_kv_lens"}
    kv_pos = torch.arange(kv_len)
    one.update(kv_pos=kv_pos, kv_row=one["q_kv_row"] - one["q_pos"] + kv_pos)
    ev = Evaluator(spec, one, args)
    return ev.ev(spec.mask).to(torch.bool).expand(kv_len).clone()


@pytest.mark.parametrize("name", ["streaming_sink", "prefix_window", "document_sinks", "three", "four", "five"])
def test_row_pieces_are_the_masks_visible_keys_as_disjoint_intervals(name):
    spec, form = specs()[name], analyze(specs()[name])
    qo, kv = [0, 37, 37 + 80], [90, 80]
    args = spec_args(name, kv, seed=3)
    env = row_env(qo, kv, torch.device("cpu"))
    pieces = row_pieces(form, spec, env, args, MAX_PIECES)
    split = 0
    for row in range(qo[-1]):
        kv_len = int(env["kv_len"][row])
        want = visible_keys(spec, env, args, row, kv_len)
        n = int(pieces.count[row])
        if n == 0:
            continue
        split += 1
        got = torch.zeros(kv_len, dtype=torch.bool)
        for p in range(n):
            lo, hi = int(pieces.lo[row, p]), int(pieces.hi[row, p])
            assert lo <= hi and (p == 0 or lo > int(pieces.hi[row, p - 1]) + 1), (row, p, lo, hi)
            got[lo:hi + 1] = True
        assert torch.equal(got, want), f"row {row}: pieces {pieces.lo[row, :n].tolist()}-{pieces.hi[row, :n].tolist()}"
        assert 2 <= n <= MAX_PIECES
    if name == "five":  # rows past the third block see five intervals: not split
        assert all(int(c) in (0, 2, 3, 4) for c in pieces.count)
    assert split > 0, "no row was split"


def test_only_specs_whose_rows_may_see_several_exact_intervals_are_split():
    cases = {"causal": False, "sliding_window": False, "document": False, "prefix_lm": False,
             "attention_sink_learned": False, "streaming_sink": True}
    for name, want in cases.items():
        spec = variantgen.load_spec(SPECS_DIR / f"{name}.yaml")
        args = {s.name: s.default for s in spec.scalars}
        assert may_split(analyze(spec), spec, args) is want, name


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_piece_tables_cover_every_row_once_then_each_piece_and_never_read_a_rows_other_pieces(page_size):
    """The table's layout (the launch builder's contract), and no launch request of a piece that
    evaluates the mask reaches into keys of another piece of one of its rows."""
    spec, form = specs()["three"], analyze(specs()["three"])
    qo, kv = [0, 64, 64 + 50], [64, 200]
    args = spec_args("three", kv)
    table = segment_table(spec, form, qo, kv, page_size, args, torch.device("cpu"), TableRules(split="pieces")).table
    env = row_env(qo, kv, torch.device("cpu"))
    pieces = row_pieces(form, spec, env, args)
    rows = table[table[:, SegField.PIECE] <= 0]
    assert rows[:, SegField.FIRST_ROW].tolist() == [0] + rows[:-1, SegField.END_ROW].tolist()
    assert int(rows[-1, SegField.END_ROW]) == qo[-1]
    order = [(int(p), int(f)) for p, f in table[len(rows):, [SegField.PIECE, SegField.FIRST_ROW]].tolist()]
    assert order == sorted(order) and all(p >= 1 for p, _ in order)
    for seg in table.tolist():
        p = seg[SegField.PIECE]
        if p < 0 or seg[SegField.CLASS] not in (RowClass.CUSTOM, RowClass.WINDOW):
            continue
        for row in range(seg[SegField.FIRST_ROW], seg[SegField.END_ROW]):
            begin = seg[SegField.KV_BEGIN]
            if seg[SegField.CLASS] == RowClass.WINDOW:  # (fa2's window launch: from each row's window start)
                begin = max(begin, seg[SegField.Q_POS] + row - seg[SegField.FIRST_ROW] - seg[SegField.WINDOW])
            if p >= 1:
                assert begin > int(pieces.hi[row, p - 1]), (seg, row)
            if p + 1 < int(pieces.count[row]):
                assert seg[SegField.KV_END] - 1 < int(pieces.lo[row, p + 1]), (seg, row)
    assert (table[:, SegField.PIECE] >= 2).any()  # some row ran as three pieces


# ----------------------------------------------------------------------------- the merge


def test_merging_partial_outputs_is_the_softmax_over_the_union():
    g = torch.Generator().manual_seed(5)
    rows, heads, dim, keys = 6, 3, 8, 40
    scores = torch.randn(rows, heads, keys, generator=g) * 3
    v = torch.randn(keys, dim, generator=g)
    cuts = [0, 7, 19, 40]  # three disjoint key sets
    parts = torch.full((3, rows, heads, dim), math.nan)
    parts_lse = torch.full((3, rows, heads), math.nan)
    for p in range(3):
        s = scores[..., cuts[p]:cuts[p + 1]]
        parts[p] = torch.softmax(s, -1) @ v[cuts[p]:cuts[p + 1]]
        parts_lse[p] = torch.logsumexp(s, -1) / math.log(2)
    counts = torch.tensor([3, 3, 2, 3, 1, 2])  # rows with fewer pieces: the rest never written (NaN)
    for r in range(rows):
        parts[int(counts[r]):, r] = math.nan
        parts_lse[int(counts[r]):, r] = math.nan
    out = torch.zeros(rows + 2, heads, dim)
    lse = torch.zeros(rows + 2, heads)
    at = torch.arange(1, rows + 1)
    merge_pieces(out, lse, torch.cat([parts.new_zeros(3, 1, heads, dim), parts, parts.new_zeros(3, 1, heads, dim)], 1),
                 torch.cat([parts_lse.new_zeros(3, 1, heads), parts_lse, parts_lse.new_zeros(3, 1, heads)], 1),
                 at, counts)
    for r in range(rows):
        s = scores[r][..., :cuts[int(counts[r])]]
        want = torch.softmax(s, -1) @ v[:cuts[int(counts[r])]]
        torch.testing.assert_close(out[r + 1], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[r + 1], torch.logsumexp(s, -1) / math.log(2), rtol=1e-5, atol=1e-5)
    assert (out[0] == 0).all() and (out[-1] == 0).all()  # rows not merged: untouched


def test_a_row_whose_every_piece_is_empty_merges_to_zero_and_minus_infinity():
    parts = torch.full((2, 1, 1, 4), math.nan)
    parts_lse = torch.full((2, 1, 1), -math.inf)
    out, lse = torch.ones(1, 1, 4), torch.zeros(1, 1)
    merge_pieces(out, lse, parts, parts_lse, torch.tensor([0]), torch.tensor([2]))
    assert (out == 0).all() and lse.item() == -math.inf


# ----------------------------------------------------------------------------- whole plans on the fakes


def make(spec, backend: str, max_pieces: int = MAX_PIECES, inline_keys: int | None = None,
         graph: GraphCapacity | None = None):
    config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", backend)
    manifest = {"scalar_args": [a.name for a in render.kernel_args(spec)[1]], "module_sha256": "x",
                "module_file": "x.so"}
    fake = (FakeFa3Module if backend == "fa3" else FakeModule)(spec)
    build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                        built=False, seconds=0.0)
    w = VariantWrapper(spec, config, fake, build, torch.empty(1 << 20, dtype=torch.uint8), graph=graph)
    w.set_row_planner(FakeRowPlanner(spec))
    w.planner.max_pieces = max_pieces
    if inline_keys is not None:
        w.planner.inline_keys = inline_keys
    return w, fake


def run_plan(name: str, backend: str, qo_lens, kv_lens, page_size: int, seed: int = 0, max_pieces: int = MAX_PIECES,
             inline_keys: int | None = None, **scalars):
    spec = specs()[name]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=page_size, seed=seed)
    args = spec_args(name, kv_lens, seed) | scalars
    w, fake = make(spec, backend, max_pieces, inline_keys)
    plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
    out = torch.full((batch.q.shape[0], HQ, HEAD_DIM), math.nan, dtype=torch.bfloat16)
    fake.row_writes = None
    got, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), out=out, return_lse=True, **args)
    assert got is out
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, return_lse=True)
    label = f"{name} {backend} ps{page_size}"
    assert_plan_matches_reference(out, lse, ref, ref_lse, plan.merge, float(batch.v_cache.abs().max()), label)
    want = torch.ones(batch.q.shape[0], dtype=torch.int64)  # kernel writes per row: one per launched piece
    if plan.merge is not None and plan.merge.inline is None:
        want[plan.merge.rows] = plan.merge.counts
    assert torch.equal(fake.row_writes, want), label
    assert fake.merge_calls == (plan.merge is not None), f"{label}: run() merges with the module's merge_pieces"
    assert fake.inline_merges == (plan.merge is not None and plan.merge.inline is not None), label
    return plan, fake


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", ["streaming_sink", "prefix_window", "document_sinks", "three", "four", "five"])
def test_rows_of_several_intervals_run_as_pieces_and_match_the_reference(name, page_size, backend):
    # chunked prefill (keys before the queries), a decode-like row, a prefill from key 0; every
    # piece launched (the planner's default: the merge computes none)
    qo_lens, kv_lens = [70, 1, 45], [150, 97, 45]
    plan, _ = run_plan(name, backend, qo_lens, kv_lens, page_size, seed=page_size, inline_keys=0)
    assert plan.merge is not None and plan.merge.rows.numel() > 0
    pieces = [la.piece for la in plan.launches]
    assert pieces == sorted(pieces) and max(pieces) >= 1  # in-place launches first, then each piece's
    if name in ("three", "four", "five"):
        assert plan.merge.pieces >= 3
    # a piece's launch requests are exact classes or custom over keys of that piece alone: every
    # launch request of a piece reads only pages of the piece's keys, far fewer than the hull
    text = repr(plan)
    assert "rows see several key intervals" in text and "piece 1" in text


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_streaming_sink_pieces_read_the_sinks_and_the_window_not_the_gap(backend):
    """The point of it: past its first window a streaming_sink row reads its sinks' page and its
    window's pages, not the keys between (planned with the pieces off, the custom hull reads them)."""
    qo_lens, kv_lens, window = [300], [300], 16
    on, _ = run_plan("streaming_sink", backend, qo_lens, kv_lens, 16, num_sink=4, window=window)
    off, _ = run_plan("streaming_sink", backend, qo_lens, kv_lens, 16, max_pieces=0, num_sink=4, window=window)
    assert off.merge is None
    work_on, work_off = on.work(), off.work()
    live = sum(min(q + 1, 4 + window + 1) for q in range(300))  # keys visible, summed over rows
    assert work_on["masked"] == 0 or backend == "fa3"
    assert work_on["visited"] < 1.6 * live < work_off["visited"]
    assert [r for r in on.launch_requests if r.piece >= 0 and r.mode.label == "custom"] == [] or backend == "fa3"


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", ["streaming_sink", "prefix_window", "document_sinks", "three"])
def test_pieces_run_with_fa3_gqa_packing(name, page_size):
    """Decode and multi-token decode on fa3 pack a GQA group's query heads into rows of one tile:
    a StreamingLLM decode row (sinks + window over a long context) runs its pieces there too,
    packed partial rows merged in out's packed layout, not custom over the whole context."""
    qo_lens, kv_lens = [1, 1, 6, 3], [300, 97, 260, 180]
    plan, _ = run_plan(name, "fa3", qo_lens, kv_lens, page_size, seed=page_size)
    assert plan.pack_gqa == HQ // HKV, plan
    assert plan.merge is not None and plan.merge.rows.numel() > 0, plan
    # the kernel merges packed rows: each split row's group of query heads
    assert plan.merge.out_rows.numel() == plan.merge.rows.numel() * plan.pack_gqa
    assert all(r.mode.label != "causal" for r in plan.launch_requests), "packed launches are never causal"


@pytest.mark.parametrize("qo_lens", [[1, 1, 6, 3], [70, 1, 45, 3]], ids=["packed", "unpacked"])
def test_pieces_merge_without_an_lse_as_with_one(qo_lens):
    """run() without return_lse merges the same rows (the kernel's lse output is optional)."""
    spec, kv_lens = specs()["streaming_sink"], [300, 97, 260, 180]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=5,
                               seed=2)
    args = spec_args("streaming_sink", kv_lens, 2)
    w, fake = make(spec, "fa3")
    plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
    assert plan.merge is not None and (plan.pack_gqa > 1) == (max(qo_lens) < 10)
    kv = (batch.k_cache, batch.v_cache)
    with_lse, _ = w.run(batch.q, kv, return_lse=True, **args)
    without = w.run(batch.q, kv, **args)
    assert torch.equal(with_lse, without) and fake.merge_calls == 2


def test_a_streaming_sink_decode_row_reads_its_sinks_and_window_on_fa3():
    """The serving case: one decode query per request over 2000 keys, 4 sinks + a 63-key window."""
    qo_lens, kv_lens = [1, 1], [2000, 1500]
    on, _ = run_plan("streaming_sink", "fa3", qo_lens, kv_lens, 16, num_sink=4, window=63)
    off, _ = run_plan("streaming_sink", "fa3", qo_lens, kv_lens, 16, max_pieces=0, num_sink=4, window=63)
    assert on.pack_gqa > 1 and off.merge is None
    assert on.work()["visited"] * 10 < off.work()["visited"], (on, off)


BANDS = ["band", "sinks_band", "asym_band"]


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", BANDS)
def test_a_band_runs_in_causal_and_window_launches_past_the_diagonal(name, page_size, backend):
    """Rows that see keys on both sides of their position (hi = q_pos + b) run in the kernel's
    causal or window launches: each launch request's keys end at its last row's hi, so the
    kernel's diagonal (kv_len - qo_len) is each row's hi, and no mask is evaluated inside the band.
    Against the reference on chunked prefill, a decode row and a prefill from key 0."""
    qo_lens, kv_lens = [70, 1, 45], [150, 97, 45]
    plan, _ = run_plan(name, backend, qo_lens, kv_lens, page_size, seed=page_size)
    shifted = [r for r in plan.launch_requests if r.mode.label == "causal" and r.diagonal > r.q_pos]
    assert shifted, plan
    custom_rows = sum(r.rows[1] - r.rows[0] for r in plan.launch_requests if r.mode.label == "custom")
    assert custom_rows < sum(qo_lens) // 3, plan  # (custom: rows whose keys stop at the request's end)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", BANDS)
def test_a_band_with_fa3_gqa_packing(name, page_size):
    """Packed launches are never causal (launches.h's pack_classes): a band's run becomes dense or
    custom there, with the keys all its rows see - up to the first row's hi, past its q_pos."""
    plan, _ = run_plan(name, "fa3", [1, 1, 6, 3], [300, 97, 260, 180], page_size, seed=page_size)
    assert plan.pack_gqa == HQ // HKV, plan
    assert all(r.mode.label != "causal" for r in plan.launch_requests)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_a_band_in_graph_mode(backend):
    spec = specs()["asym_band"]
    capacity = GraphCapacity(max_batch_size=2, max_total_q=256, max_kv_pages=128)
    batch = random_paged_batch([64, 100], [300, 260], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=5)
    args = {"before": 20, "after": 3}
    w, _ = make(spec, backend, graph=capacity)
    plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
    assert any(r.mode.label == "causal" and r.diagonal == r.q_pos + 3 for r in plan.launch_requests), plan
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, return_lse=True)
    assert_plan_matches_reference(out, lse, ref, ref_lse, None, 0.0, f"graph mode, band, {backend}")


BAND_FORMS = ["abs(q_pos - kv_pos) <= a", "q_pos - a <= kv_pos and kv_pos <= q_pos + b",
              "kv_pos < s or (q_pos - a <= kv_pos and kv_pos <= q_pos + b)", "q_pos < s or abs(kv_pos - q_pos) <= a",
              "kv_pos <= q_pos + b and kv_pos >= s",
              "(kv_pos <= q_pos + b and q_pos - a <= kv_pos) or kv_pos // 7 == q_pos // 7"]


@pytest.mark.parametrize("case", range(24))
def test_random_bands_match_the_reference(case):
    """Random bands (widths, shifts, sinks, a chunk pattern beside them) on random batches
    (chunked prefill, decode rows, page sizes, CUDA-graph mode) through fa2 and fa3."""
    rng = random.Random(case)
    text = BAND_FORMS[case % len(BAND_FORMS)]
    spec = _spec(f"band_{case}", text, {"a": rng.randrange(0, 40), "b": rng.randrange(0, 40), "s": rng.randrange(0, 9)})
    kv_lens = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 4))]
    qo_lens = [rng.choice([k, rng.randrange(1, k + 1), 1]) for k in kv_lens]
    page_size = rng.choice([1, 3, 16])
    graph = GraphCapacity(max_batch_size=4, max_total_q=1024, max_kv_pages=1024) if case % 4 == 3 else None
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=page_size, seed=case)
    args = {s.name: s.default for s in spec.scalars}
    for backend in ("fa2", "fa3"):
        w, _ = make(spec, backend, graph=graph)
        plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
        ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                           batch.kv_indptr, batch.kv_indices, batch.last_page_len, args,
                                           return_lse=True)
        assert_plan_matches_reference(out, lse, ref, ref_lse, plan.merge, float(batch.v_cache.abs().max()),
                                      f"{text} {args} {backend} ps{page_size} {qo_lens}/{kv_lens}")


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_graph_mode_runs_rows_of_several_intervals_past_their_gaps(backend):
    """CUDA-graph mode keeps its fixed launch slots and static workspace, which hold no partial
    outputs: there the rows of two intervals run as gapped custom launch requests, in place (no
    merge), reading the sinks' page and the window - not their hull - and still exact."""
    spec = specs()["streaming_sink"]
    capacity = GraphCapacity(max_batch_size=2, max_total_q=256, max_kv_pages=128)
    batch = random_paged_batch([64, 100], [300, 260], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=5)
    args = {"num_sink": 4, "window": 10}
    visited = {}
    for how in ("gaps", "hull"):
        w, _ = make(spec, backend, max_pieces=0 if how == "hull" else MAX_PIECES, graph=capacity)
        plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        assert plan.merge is None and all(la.piece == -1 for la in plan.launches)
        gapped = [r for r in plan.launch_requests if r.gaps]
        assert bool(gapped) == (how == "gaps"), (how, plan)
        visited[how] = plan.work()["visited"]
        out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
        ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                           batch.kv_indptr, batch.kv_indices, batch.last_page_len, args,
                                           return_lse=True)
        assert_plan_matches_reference(out, lse, ref, ref_lse, None, 0.0, f"graph mode, {how}")
    assert visited["gaps"] * 2 < visited["hull"], visited


# ----------------------------------------------------------------------------- the launch builder


def _build(table: list[list[int]], qo_lens, kv_lens, page_size: int, max_pieces: int, graph: bool = False):
    from _builder import plan_builder

    from variantgen.abi.table import DESC_FIELDS, OPTION_FIELDS, PlanOption

    q_start = [sum(qo_lens[:i]) for i in range(len(qo_lens) + 1)]
    pages = [-(-k // page_size) for k in kv_lens]
    page_start = [sum(pages[:i]) for i in range(len(pages) + 1)]
    last = [(k - 1) % page_size + 1 if k else 0 for k in kv_lens]
    indices = torch.tensor(q_start + page_start + last, dtype=torch.int32)
    o = torch.zeros(OPTION_FIELDS, dtype=torch.int64)
    for k, v in {PlanOption.PAGE_SIZE: page_size, PlanOption.NUM_SM: 8, PlanOption.FA3_CTA_TILE_Q: 128,
                 PlanOption.NUM_QO_HEADS: HQ, PlanOption.NUM_KV_HEADS: HKV, PlanOption.HEAD_DIM_QK: 128,
                 PlanOption.HEAD_DIM_VO: 128, PlanOption.KV_DTYPE_BYTES: 2, PlanOption.MAX_WINDOW_LAUNCHES: 4,
                 PlanOption.WINDOW_COUNT: -1, PlanOption.MAX_PIECES: max_pieces}.items():
        o[k] = v
    if graph:
        o[PlanOption.GRAPH_REQUESTS], o[PlanOption.GRAPH_PAGES], o[PlanOption.GRAPH_ROWS] = 8, 64, 64
    host = torch.zeros(1 << 20, dtype=torch.uint8)
    desc = torch.zeros(DESC_FIELDS, dtype=torch.int64)
    table = [list(s) + [0] * (len(SegField) - len(s)) for s in table]  # (no gaps unless given)
    plan_builder().build_launches(indices, torch.tensor(table, dtype=torch.int64).view(-1, len(SegField)), o, host,
                                  desc)
    return desc


D, C, W = int(RowClass.DENSE), int(RowClass.CAUSAL), int(RowClass.WINDOW)
# one request of 40 rows over 40 keys: rows 0-11 causal in place, rows 12-39 sinks [0, 4) + window 7
GOOD = [[0, 12, 0, C, -1, 0, 12, 0, 0, -1, -1], [12, 40, 0, D, -1, 0, 4, 12, 0, -1, 0],
        [12, 40, 0, W, 7, 4, 40, 12, 0, -1, 1]]


def test_the_builder_lays_pieces_out_after_the_rows_written_in_place():
    from variantgen.abi.table import HEADER_FIELDS, LAUNCH_FIELDS, HeaderField, LaunchField, Status

    for fa3 in (False, True):
        desc = _build(GOOD, [40], [40], 4, MAX_PIECES).tolist()
        assert desc[HeaderField.STATUS] == Status.OK and desc[HeaderField.SEGMENTS] == 3
        launches = [desc[HEADER_FIELDS + i * LAUNCH_FIELDS:HEADER_FIELDS + (i + 1) * LAUNCH_FIELDS]
                    for i in range(desc[HeaderField.LAUNCHES])]
        assert [(la[LaunchField.PIECE], la[LaunchField.ROWS]) for la in launches] == [(-1, 12), (0, 28), (1, 28)], fa3


@pytest.mark.parametrize("case, table, max_pieces, pattern", [
    ("pieces_off", GOOD, 0, "has piece 0 .pieces on: 0"),
    ("piece_past_max", [GOOD[0], GOOD[1], [12, 40, 0, W, 7, 4, 40, 12, 0, -1, 1]], 1, "has piece 1 .pieces on: 1"),
    ("piece_inside_partition", [GOOD[0], GOOD[2], GOOD[1]], MAX_PIECES, "is not after the rows' partition"),
    ("piece_1_without_0", [[0, 40, 0, C, -1, 0, 40, 0, 0, -1, -1], GOOD[2]], MAX_PIECES,
     "covers row 12, which has 0 pieces before it"),
    ("piece_twice", GOOD + [GOOD[2]], MAX_PIECES, r"row 3 \(piece 1, rows 12-40\) is not after"),
])
def test_a_bad_piece_table_is_named(case, table, max_pieces, pattern):
    with pytest.raises(Exception, match=pattern):
        _build(table, [40], [40], 4, max_pieces)


def test_pieces_are_refused_in_cuda_graph_mode():
    with pytest.raises(Exception, match="max_pieces=4 .*0 in CUDA-graph mode"):
        _build(GOOD, [40], [40], 4, MAX_PIECES, graph=True)


# ----------------------------------------------------------------------------- a short first interval in the merge


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", ["streaming_sink", "prefix_window", "document_sinks"])
def test_a_short_first_interval_is_computed_by_the_merge(name, page_size, backend):
    """Rows of two intervals whose first is a few keys (sinks, a short prefix, global tokens): the
    second runs in place, and run()'s merge computes the first from q, k and v and merges it in."""
    plan, fake = run_plan(name, backend, [70, 1, 45], [150, 97, 45], page_size, seed=page_size,
                          inline_keys=INLINE_KEYS)
    assert plan.merge is not None and plan.merge.inline is not None and plan.merge.pieces == 0, plan
    assert all(la.piece == -1 for la in plan.launches) and fake.inline_merges == 1
    entry, slot, keys = plan.merge.inline
    assert int(keys.max()) <= INLINE_KEYS and int(slot.max()) < page_size
    text = repr(plan)
    assert "computed by the merge" in text, text


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["streaming_sink", "document_sinks"])
def test_a_short_first_interval_in_the_merge_with_fa3_gqa_packing(name, page_size):
    plan, _ = run_plan(name, "fa3", [1, 1, 6, 3], [300, 97, 260, 180], page_size, seed=page_size,
                       inline_keys=INLINE_KEYS)
    assert plan.pack_gqa == HQ // HKV and plan.merge.inline is not None, plan
    assert plan.merge.out_rows.numel() == plan.merge.inline[0].numel() == plan.merge.rows.numel() * plan.pack_gqa


def test_the_inline_merge_scales_the_values_as_the_launches():
    spec, kv_lens = specs()["streaming_sink"], [150, 97]
    batch = random_paged_batch([70, 1], kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=5,
                               seed=3)
    args = spec_args("streaming_sink", kv_lens, 3)
    w, _ = make(spec, "fa3", inline_keys=INLINE_KEYS)
    w.plan(*batch.plan_args(), skip_tiles=True, **args)
    assert w.last_plan.merge.inline is not None
    kv = (batch.k_cache, batch.v_cache)
    plain = w.run(batch.q, kv, **args).float()
    halved = w.run(batch.q, kv, v_scale=0.5, **args).float()
    torch.testing.assert_close(halved, plain * 0.5, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("hnd", [False, True])
def test_the_inline_merge_reference_is_the_merge_of_the_short_pieces_softmax(hnd):
    """merge_inline_reference (the kernel's reference) against its definition: the softmax over
    the piece's keys, merged with the row's in-place output by merge_pieces_reference."""
    g = torch.Generator().manual_seed(0)
    rows_n, heads, kv_heads, dim, ps, pages = 6, 4, 2, 32, 4, 5
    q = torch.randn(rows_n, heads, dim, generator=g)
    k_nhd = torch.randn(pages, ps, kv_heads, dim, generator=g)
    v_nhd = torch.randn(pages, ps, kv_heads, dim, generator=g)
    kv_indices = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    base = torch.randn(rows_n, heads, dim, generator=g)
    base_lse = torch.randn(rows_n, heads, generator=g)
    base_lse[1, 2] = -math.inf  # a row whose in-place piece saw no key
    rows = torch.tensor([0, 1, 3, 5])
    entry = torch.tensor([0, 1, 0, 2], dtype=torch.int32)  # keys from entry e, slot s on
    slot = torch.tensor([0, 2, 3, 1], dtype=torch.int32)
    keys = torch.tensor([4, 3, 2, 6], dtype=torch.int32)
    scale = 0.3
    out, lse = base.clone(), base_lse.clone()
    k, v = (k_nhd.transpose(1, 2).contiguous(), v_nhd.transpose(1, 2).contiguous()) if hnd else (k_nhd, v_nhd)
    merge_inline_reference(out, base_lse, lse, q, k, v, kv_indices, rows, entry, slot, keys, scale, 1.0, 2, hnd)
    want, want_lse = base.clone(), base_lse.clone()
    parts = torch.zeros(2, rows_n, heads, dim)
    parts_lse = torch.full((2, rows_n, heads), -math.inf)
    parts[0], parts_lse[0] = base, base_lse
    for i, r in enumerate(rows.tolist()):
        pos = [int(slot[i]) + j for j in range(int(keys[i]))]
        page = [int(kv_indices[int(entry[i]) + p // ps]) for p in pos]
        kk = torch.stack([k_nhd[pg, p % ps] for pg, p in zip(page, pos)])  # [keys, kv_heads, dim]
        vv = torch.stack([v_nhd[pg, p % ps] for pg, p in zip(page, pos)])
        kk, vv = kk.repeat_interleave(2, 1), vv.repeat_interleave(2, 1)
        s_ = torch.einsum("hd,jhd->hj", q[r], kk) * scale
        parts[1, r] = torch.einsum("hj,jhd->hd", torch.softmax(s_, -1), vv)
        parts_lse[1, r] = torch.logsumexp(s_, -1) / math.log(2)
    merge_pieces(want, want_lse, parts, parts_lse, rows, torch.full((4,), 2))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_the_merge_computes_the_sinks_unless_told_not_to_or_for_a_spec_it_cannot():
    """inline_keys is INLINE_KEYS by default (measured faster than launching the sinks), 0 turns it
    off; a spec with a logits transform or q / k / v / o of different dtypes launches every piece."""
    plan, _ = run_plan("streaming_sink", "fa3", [70, 1, 45], [150, 97, 45], 16)
    assert plan.merge is not None and plan.merge.inline is not None
    plan, _ = run_plan("streaming_sink", "fa3", [70, 1, 45], [150, 97, 45], 16, inline_keys=0)
    assert plan.merge is not None and plan.merge.inline is None and plan.merge.pieces == 2
    capped = parse_spec("name: capped_sinks\ndescription: sinks + window with a soft cap\nscalars:\n"
                        "  window:\n    dtype: int\n    default: 20\n    min: 0\n"
                        "mask: kv_pos < 4 or (kv_pos <= q_pos and q_pos - kv_pos <= window)\n"
                        "logits: 30.0 * tanh(logits / 30.0)\n")
    w, _ = make(capped, "fa3", inline_keys=INLINE_KEYS)
    assert not w.planner.inline_allowed
    batch = random_paged_batch([70], [150], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=16)
    plan = w.plan(*batch.plan_args(), skip_tiles=True, window=20)
    assert plan.merge is not None and plan.merge.inline is None
