"""VariantWrapper and the interval planner on the CPU, against fake fa2 / fa3 modules.

tests/fakes/_fake_kernel.py emulates what the generated kernel does with each launch (mask
mode, vg_meta, page lists, in-place o rows); its modes 0/1 are strictly geometric, so a
planner that sends a row to kNone/kCausal whose visible keys are not exactly what those
modes show gives a wrong result here. The launches are the real launch builder's (an
nvcc-built module, tests/fakes/_builder.py), the row pass the reference rules' (FakeRowPlanner).
Every case is compared with the dense reference (variantgen.wrappers.reference), with the planner
off (one custom launch) and on.
"""

from __future__ import annotations

import functools
import math
import random
import re
from pathlib import Path

import pytest
import torch
from _fake_kernel import (
    FakeFa3Module,
    FakeModule,
    FakeRowPlanner,
    assert_matches_reference,
    assert_plan_matches_reference,
)
from conftest import ALL_SPECS, SPECS_DIR
from conftest import CPU_KV_LENS as KV_LENS
from conftest import CPU_QO_LENS as QO_LENS
from conftest import CPU_SMALL_SCALARS as SMALL_SCALARS

import variantgen
import variantgen.build.builder as build_mod
from variantgen.abi.table import FA2_TAIL_RUN_CODE, META_COLUMNS, MetaColumn, PrefillPlanInfo, Schedule
from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import expressions as codegen
from variantgen.codegen import render
from variantgen.core.errors import LaunchError
from variantgen.planning.intervals import analyze
from variantgen.testing.harness import random_paged_batch, random_spec_args, spans_to_ranges, within_range
from variantgen.wrappers.flex_wrapper import FlexPrefillWrapper
from variantgen.wrappers.paged import VariantWrapper
from variantgen.wrappers.reference import reference_attention

HQ, HKV, HEAD_DIM = 4, 2, 64
PLAN_STATS: dict[str, object] = {}


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


@functools.cache
def shipped(name: str) -> variantgen.VariantSpec:
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


def make(spec: variantgen.VariantSpec, *, codegen_q_idx: bool = False, backend: str = "fa2",
         planner_module: bool = True, num_sms: int | None = None) -> tuple[VariantWrapper, FakeModule]:
    """A wrapper on a fake module, with the fake planner module (``planner_module``: as make_wrapper
    sets one on CUDA) or without (planner-off plans); ``num_sms``: the GPU's SMs it plans for
    (default: the CPU's 1)."""
    config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a", backend)
    manifest = {"scalar_args": [a.name for a in render.kernel_args(spec)[1]],
                "module_sha256": "x", "module_file": "x.so"}
    fake_class = FakeFa3Module if backend == "fa3" else FakeModule
    fake = fake_class(spec, codegen_q_idx=codegen_q_idx)
    build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                        built=False, seconds=0.0)
    w = VariantWrapper(spec, config, fake, build, torch.empty(1 << 20, dtype=torch.uint8))
    if planner_module and analyze(spec).planner_ready:
        w.set_row_planner(FakeRowPlanner(spec))
    if num_sms is not None:
        w.planner.num_sms = num_sms
    return w, fake


def batch_of(qo_lens, kv_lens, page_size, seed=0):
    return random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                              page_size=page_size, seed=seed)


def check(spec, batch, args, *, skip_tiles, scales=None, label="", codegen_q_idx=False, backend="fa2",
          row_planner=None, num_sms=None, setup=None):
    """Plan + run through the fake kernel and compare with the reference; returns (wrapper, fake).
    ``row_planner``: the wrapper's planner module (default: the fake one, FakeRowPlanner);
    ``setup``: called with the wrapper before plan()."""
    w, fake = make(spec, codegen_q_idx=codegen_q_idx, backend=backend, num_sms=num_sms)
    if row_planner is not None:
        w.set_row_planner(row_planner)
    if setup is not None:
        setup(w)
    plan_kw = dict(skip_tiles=skip_tiles)
    if skip_tiles:
        plan_kw.update(args)
    w.plan(*batch.plan_args(), **plan_kw)
    total_q = batch.q.shape[0]
    out = torch.full((total_q, HQ, HEAD_DIM), math.nan, dtype=torch.bfloat16)
    fake.row_writes = None
    scales = scales or {}
    got, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), out=out, return_lse=True, **scales, **args)
    assert got is out
    modes = [c.mask_mode for c in fake.run_calls]
    assert len(modes) == len(w._launches), modes
    if backend == "fa2":  # fa3 may split a mode over launches (one per window width, or by size)
        # (fa2's tail launch is a second causal one; a piece's launches write a partial output of their own)
        keys = [(m, la.tail, la.piece) for m, la in zip(modes, w._launches)]
        assert len(keys) == len(set(keys)), keys
        # the tail launch runs under its own code (the masked variant), the exact ones without the spec's mask
        assert [c.code for c in fake.run_calls] == [FA2_TAIL_RUN_CODE if la.tail else int(la.mode)
                                                    for la in w._launches]
    if not skip_tiles:
        # planner off: one custom launch request per request with queries
        assert set(modes) == {"custom"} and sum(c.num_requests for c in fake.run_calls) == sum(map(bool, batch.qo_lens))
        assert backend == "fa3" or len(modes) == 1
    if total_q:
        assert fake.row_writes is not None
        # once each; a row that sees several key intervals once per interval (merged after)
        want = torch.ones_like(fake.row_writes)
        merge = w.last_plan.merge if w.last_plan is not None else None
        if merge is not None and merge.inline is None:  # (an inline first piece is the merge's, not a launch's)
            want[merge.rows.cpu()] = merge.counts.cpu()
        twice = (fake.row_writes != want).nonzero().flatten().tolist()
        assert not twice, f"{label}: rows written {fake.row_writes[twice].tolist()} times: {twice[:20]}"
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args,
                                       return_lse=True, **scales)
    v_max = float(batch.v_cache.abs().max()) * (scales.get("v_scale") or 1.0)
    assert_plan_matches_reference(out, lse, ref, ref_lse, w.last_plan.merge if w.last_plan else None, v_max, label)
    return w, fake


def mode_rows(fake: FakeModule) -> dict[str, int]:
    return {c.mask_mode: c.rows for c in fake.run_calls}


def assert_run_is_reference(w: VariantWrapper, batch, args: dict, label: str = "", **run_kw) -> None:
    """run() on what was planned last gives the reference's output and LSE (an accepted call is
    checked for its value, not only for raising nothing)."""
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **run_kw, **args)
    ref, ref_lse = reference_attention(w.spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args,
                                       return_lse=True)
    assert_matches_reference(out, lse, ref, ref_lse, label)


def mode_rows_per_launch(fake: FakeModule) -> list[int]:
    return [c.rows for c in fake.run_calls]


# ----------------------------------------------------------------------------- every shipped spec


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("skip_tiles", [False, True], ids=["planner_off", "planner_on"])
@pytest.mark.parametrize("spec_name, scalars", [(n, "defaults") for n in ALL_SPECS]
                         + [(n, "small") for n in sorted(SMALL_SCALARS)])
def test_shipped_spec_matches_reference(spec_name, scalars, skip_tiles, page_size):
    spec = shipped(spec_name)
    seed = page_size * 7 + len(spec_name)
    batch = batch_of(QO_LENS, KV_LENS, page_size, seed=seed)
    args = random_spec_args(spec, batch, seed=seed)
    if scalars == "small":
        args.update(SMALL_SCALARS[spec_name])
    w, fake = check(spec, batch, args, skip_tiles=skip_tiles, label=f"{spec_name} ps{page_size} {scalars}")
    if skip_tiles:
        PLAN_STATS[f"{spec_name}/ps{page_size}/{scalars}"] = dict(w.plan_stats["segments"])
        # the plan covers every row once, split over at most three launches; rows that see several
        # key intervals once more per interval past their first, in launches of their own
        assert sum(rows for la, rows in zip(w._launches, mode_rows_per_launch(fake)) if la.piece <= 0) == sum(QO_LENS)
        if w.last_plan.merge is None:
            assert sum(mode_rows(fake).values()) == sum(QO_LENS)


@pytest.mark.parametrize("spec_name", ["causal", "alibi", "softcap"])
def test_qkv_scales_fold_into_sm_scale_and_output(spec_name):
    spec = shipped(spec_name)
    batch = batch_of([9, 3], [9, 40], 4, seed=3)
    args = random_spec_args(spec, batch)
    scales = dict(q_scale=0.5, k_scale=1.75, v_scale=0.25)
    for skip in (False, True):
        w, fake = check(spec, batch, args, skip_tiles=skip, scales=scales, label=spec_name)
        run = fake.run_calls[0]
        assert run.scalars == {s.name: args.get(s.name, s.default) for s in spec.scalars}


def test_offset_row_indices_stay_in_their_request():
    """`keep[kv_row - lag]` reads the key `lag` rows back, clamped to the rows of its request
    (the first key of a request reads itself, never the previous request's last key); the
    module takes no extra argument for it."""
    spec = variantgen.parse_spec(
        "name: keep_prev\n"
        "tensors:\n  keep: {dtype: int32, shape: [total_kv]}\n"
        "scalars:\n  invert: {dtype: bool, default: false}\n  lag: {dtype: int, default: 1}\n"
        "mask: kv_pos <= q_pos and ((keep[kv_row - lag] != 0) != invert or kv_pos == q_pos)\n")
    config = render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16", "9.0a")
    assert [a.name for a in render.render_module(config).scalar_args] == ["invert", "lag", "sm_scale", "v_scale"]
    batch = batch_of([5, 12], [20, 12], 4, seed=5)
    keep = torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    for invert, lag in ((False, 1), (True, 1), (False, -3), (False, 2**31 - 1)):
        for skip in (False, True):
            check(spec, batch, {"keep": keep, "invert": invert, "lag": lag}, skip_tiles=skip,
                  label=f"keep invert={invert} lag={lag}")


# ----------------------------------------------------------------------------- mm_prefix adversarial

# (qo_lens, kv_lens, spans per request)
MM_LAYOUTS = {
    # spans at the first and last token, a single-token query inside a span that crosses many
    # pages, a one-token span next to another span
    "edges": ([40, 1, 25], [40, 300, 90], [[(0, 9), (30, 39)], [(250, 299)], [(66, 66), (67, 80), (85, 89)]]),
    # kv_len >> qo_len; one span covering the whole request
    "long_kv": ([3, 16, 1], [500, 260, 77], [[(490, 499)], [(0, 259)], [(0, 0)]]),
    # no spans at all
    "empty": ([20, 7], [20, 50], [[], []]),
    # span boundaries inside pages; spans that begin before the first query
    "in_page": ([60, 9], [75, 40], [[(5, 21), (35, 36), (37, 70)], [(2, 34), (36, 39)]]),
}


@pytest.mark.parametrize("range_window", [-1, 0, 5])
@pytest.mark.parametrize("causal_window", [-1, 0, 3, 16])
@pytest.mark.parametrize("layout", sorted(MM_LAYOUTS))
def test_mm_prefix_spans(layout, causal_window, range_window):
    spec = shipped("mm_prefix")
    qo_lens, kv_lens, spans = MM_LAYOUTS[layout]
    page_size = (1, 4, 16)[(causal_window + range_window + len(layout)) % 3]
    batch = batch_of(qo_lens, kv_lens, page_size, seed=len(layout) + causal_window)
    args = {"ranges": spans_to_ranges(qo_lens, kv_lens, spans), "causal_window_left": causal_window,
            "range_window_left": range_window}
    for skip in (False, True):
        w, _ = check(spec, batch, args, skip_tiles=skip, label=f"{layout} cw{causal_window} rw{range_window}")
    PLAN_STATS[f"mm_prefix/{layout}/cw{causal_window}/rw{range_window}/ps{page_size}"] = w.plan_stats["segments"]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_mm_prefix_hostile_ranges(seed, page_size):
    """Ranges need not hold their query: empty (start > end), negative, past kv_len, in the future."""
    spec = shipped("mm_prefix")
    qo_lens, kv_lens = [33, 1, 17, 8], [33, 70, 50, 8]
    batch = batch_of(qo_lens, kv_lens, page_size, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    total_q = sum(qo_lens)
    ranges = torch.randint(-3, 80, (total_q, 2), generator=g, dtype=torch.int32)
    none = torch.rand(total_q, generator=g) < 0.3
    ranges[none] = -1
    ranges[::7, 1] = ranges[::7, 0] - 2  # empty spans
    for cw, rw in ((-1, -1), (2, 0), (0, 7), (16, 3)):
        args = {"ranges": ranges.contiguous(), "causal_window_left": cw, "range_window_left": rw}
        for skip in (False, True):
            check(spec, batch, args, skip_tiles=skip, label=f"hostile seed{seed} cw{cw} rw{rw}")


def test_mm_prefix_planner_sends_few_rows_to_custom(record_property):
    spec = shipped("mm_prefix")
    qo_lens = kv_lens = [512, 512, 512]
    spans = [[(37, 100), (301, 333)], [(0, 63), (480, 511)], [(129, 130), (200, 419)]]
    batch = batch_of(qo_lens, kv_lens, 16, seed=11)
    args = {"ranges": spans_to_ranges(qo_lens, kv_lens, spans)}
    w, fake = check(spec, batch, args, skip_tiles=True, label="3x512")
    rows = mode_rows(fake)
    custom = rows.get("custom", 0)
    record_property("plan_stats", w.plan_stats)
    record_property("mode_rows", rows)
    PLAN_STATS["mm_prefix/3x512"] = {"segments": w.plan_stats["segments"], "mode_rows": rows}
    assert sum(rows.values()) == 3 * 512
    assert custom <= 0.1 * 3 * 512, f"{custom} of {3 * 512} rows evaluate the mask everywhere: {w.plan_stats}"
    # with windows, still exact (what fraction needs the mask is recorded, not asserted)
    for cw, rw in ((16, -1), (-1, 64), (16, 64)):
        args.update(causal_window_left=cw, range_window_left=rw)
        w, fake = check(spec, batch, args, skip_tiles=True, label=f"3x512 cw{cw} rw{rw}")
        PLAN_STATS[f"mm_prefix/3x512/cw{cw}/rw{rw}"] = {"segments": w.plan_stats["segments"],
                                                       "mode_rows": mode_rows(fake)}
        record_property(f"mode_rows_cw{cw}_rw{rw}", mode_rows(fake))


def test_fa2_launches_with_a_kernel_window_never_split_kv():
    """The H200 case of issue 14 (mm_prefix, window 5, page size 1, chunked prefill): the planner
    makes causal launch requests with a kernel window of 5; FlashInfer's scheduler must not split
    their KV (its fa2 kernel sizes split-KV partial rows from the window it runs with, the
    scheduler from the one it is planned with), whatever the launch's size."""
    spec = shipped("mm_prefix")
    qo_lens, kv_lens = [662, 49], [746, 67]
    batch = batch_of(qo_lens, kv_lens, 1, seed=14)
    ranges = torch.full((sum(qo_lens), 2), -1, dtype=torch.int32)
    args = {"ranges": ranges, "causal_window_left": 5, "range_window_left": -1}
    # an H200's SMs: FlashInfer's split-KV bar (2 x 132 / 2 KV heads = 132 tiles) is above both launches'
    w, fake = check(spec, batch, args, skip_tiles=True, label="issue 14 case 1", num_sms=132)
    assert w.plan_stats["launches"] == [("causal", 2)]
    assert any(row[MetaColumn.KERNEL_WINDOW] == 5 for la in w._launches for row in la.meta.tolist())
    assert not fake.plan_calls and all(la.schedule == Schedule.FA2 for la in w._launches)
    # a launch without a kernel window still lets FlashInfer split where it pays
    w, fake = check(spec, batch, dict(args, causal_window_left=-1), skip_tiles=True, label="no window", num_sms=132)
    assert fake.plan_calls and not any(call.disable_split_kv for call in fake.plan_calls)
    assert [la.schedule for la in w._launches] == [Schedule.FLASHINFER]


# ----------------------------------------------------------------------------- other masks' edges


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("window", [-1, 0, 1, 3, 15, 16, 17, 1000])
def test_sliding_window_sizes(window, page_size):
    spec = shipped("sliding_window")
    batch = batch_of([30, 1, 70], [30, 100, 90], page_size, seed=window + 2)
    for skip in (False, True):
        check(spec, batch, {"window": window}, skip_tiles=skip, label=f"window {window} ps{page_size}")


@functools.cache
def chunks_any_size() -> variantgen.VariantSpec:
    """chunked_local without its `positive: true`: the language's `//` by 0 or a negative."""
    text = (SPECS_DIR / "chunked_local.yaml").read_text()
    assert "    positive: true\n" in text
    return variantgen.parse_spec(text.replace("    positive: true\n", ""))


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 7, 13, 0, -4])
def test_chunked_local_chunk_sizes(chunk_size, page_size):
    spec = shipped("chunked_local") if chunk_size > 0 else chunks_any_size()
    batch = batch_of([30, 1, 50], [30, 100, 90], page_size, seed=abs(chunk_size))
    for skip in (False, True):
        check(spec, batch, {"chunk_size": chunk_size}, skip_tiles=skip, label=f"chunk {chunk_size} ps{page_size}")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefix_lm_prefix_lengths(page_size):
    spec = shipped("prefix_lm")
    qo_lens, kv_lens = [20, 1, 30, 12, 9, 40], [20, 50, 45, 12, 30, 40]
    prefix = torch.tensor([30, 60, 45, 11, 1, 0], dtype=torch.int32)  # > kv_len, == kv_len, kv_len-1, ...
    batch = batch_of(qo_lens, kv_lens, page_size, seed=page_size)
    for skip in (False, True):
        check(spec, batch, {"prefix_len": prefix}, skip_tiles=skip, label=f"prefix ps{page_size}")


def test_streaming_sink_sinks_past_the_window():
    spec = shipped("streaming_sink")
    batch = batch_of([40, 1, 64], [40, 120, 64], 4, seed=9)
    for num_sink, window in ((0, 3), (5, 0), (100, 2), (6, 200), (1, 1)):
        for skip in (False, True):
            check(spec, batch, {"num_sink": num_sink, "window": window}, skip_tiles=skip,
                  label=f"sink {num_sink} window {window}")


def test_one_tensor_kv_cache():
    """paged_kv_cache as one [pages, 2, page_size, kv_heads, head_dim] tensor."""
    spec = shipped("mm_prefix")
    batch = batch_of([12, 3], [12, 40], 4, seed=12)
    args = random_spec_args(spec, batch)
    cache = torch.stack([batch.k_cache, batch.v_cache], 1)
    ref = reference_attention(spec, batch.q, cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                              batch.last_page_len, args)
    for skip in (False, True):
        w, _ = make(spec)
        w.plan(*batch.plan_args(), skip_tiles=skip, **(args if skip else {}))
        out = w.run(batch.q, cache, **args)
        assert out.dtype == torch.bfloat16 and out.shape == (15, HQ, HEAD_DIM)
        torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-4)


def test_planned_launches_are_not_packed_and_o_indptr_points_at_their_rows():
    """Launch requests keep their rows in place: o_indptr in the int workspace = q_starts."""
    spec = shipped("mm_prefix")
    qo_lens = kv_lens = [64, 48]
    batch = batch_of(qo_lens, kv_lens, 16, seed=2)
    args = {"ranges": spans_to_ranges(qo_lens, kv_lens, [[(10, 20)], [(3, 40)]]), "causal_window_left": 5}
    w, fake = check(spec, batch, args, skip_tiles=True)
    assert len(w._launches) >= 2
    for la in w._launches:
        n = la.num_requests
        at = la.plan_info[PrefillPlanInfo.O_INDPTR_OFFSET]
        o_indptr = la.int_workspace[at:at + 4 * (n + 1)].view(torch.int32)
        assert torch.equal(o_indptr, la.q_starts), la.mask_mode
        assert la.meta.shape == (n, META_COLUMNS)
        assert torch.equal(la.meta[:, 0], la.q_starts[:n])
    for call in fake.plan_calls:
        assert call.disable_split_kv and not call.enable_cuda_graph and call.window_left == -1


def test_planner_default_follows_what_plan_was_given():
    spec = shipped("mm_prefix")
    batch = batch_of([10, 5], [10, 30], 4)
    args = random_spec_args(spec, batch)
    w, fake = make(spec)
    w.plan(*batch.plan_args())
    assert "ranges" in w.plan_stats["planner_off"]
    assert [m for m, _ in w.plan_stats["launches"]] == ["custom"]
    assert_run_is_reference(w, batch, args, "planner off by default")
    assert [c.mask_mode for c in fake.run_calls] == ["custom"]
    fake.run_calls.clear()
    w.plan(*batch.plan_args(), ranges=args["ranges"])
    assert "planner_off" not in w.plan_stats and "segments" in w.plan_stats
    assert_run_is_reference(w, batch, args, "planner on by default")
    assert [c.mask_mode for c in fake.run_calls] == [m for m, _ in w.plan_stats["launches"]]


# Rows 8..15 of a request are plain causal (kCausal); the others read every third key, by q_idx
# (kCustom), so the planner splits each request into custom / causal / custom launch requests.
Q_IDX_SPEC = ("name: q_idx_rows\n"
              "mask: kv_pos <= q_pos and ((q_idx >= 8 and q_idx < 16) or ((q_idx < 8 or q_idx >= 16) "
              "and kv_pos % 3 == q_idx % 3))\n")
# What the generated hook computes for q_idx: it used to be q_local, the index inside the
# *launch* request, which is wrong once the planner splits a request (fixed in codegen/render).
CODEGEN_Q_IDX_IS_LAUNCH_LOCAL = codegen.BUILTIN_LOCALS["q_idx"] == "q_local"


def test_q_idx_with_the_planner_splitting_requests():
    spec = variantgen.parse_spec(Q_IDX_SPEC)
    batch = batch_of([40, 30], [40, 60], 4, seed=1)
    w, fake = check(spec, batch, {}, skip_tiles=True, label="q_idx (language semantics)")
    assert set(mode_rows(fake)) == {"custom", "causal"}
    # in the direct path every launch request starts at its request's first query
    check(spec, batch, {}, skip_tiles=False, codegen_q_idx=True, label="q_idx launch-local, direct")
    # a launch-local q_idx is wrong under the planner: the fake tells
    with pytest.raises(AssertionError, match="rows off"):
        check(spec, batch, {}, skip_tiles=True, codegen_q_idx=True, label="q_idx launch-local, planner")


def test_generated_q_idx_is_the_request_index():
    """Regression: the hook must not read q_idx from q_local (the launch request's index)."""
    assert not CODEGEN_Q_IDX_IS_LAUNCH_LOCAL
    spec = variantgen.parse_spec(Q_IDX_SPEC)
    variant = render.render_module(render.ModuleConfig(spec, HEAD_DIM, HEAD_DIM, "bf16", "bf16", "bf16",
                                                       "9.0a")).files["variant.cuh"]
    body = variant[variant.index("REGISTER_LOGITS_MASK"):]
    ret = next(line for line in body.splitlines() if line.strip().startswith("return "))
    assert "q_local" not in ret, ret


def test_head_dependent_mask_runs_direct_and_refuses_the_planner():
    spec = variantgen.parse_spec("name: per_head\nmask: kv_pos <= q_pos and (qo_head % 2 == 0 or "
                                 "kv_pos >= q_pos - kv_head - 1)\n")
    batch = batch_of([20, 1, 9], [20, 30, 40], 4, seed=6)
    check(spec, batch, {}, skip_tiles=False)
    w, _ = make(spec)
    w.plan(*batch.plan_args())  # default: planner off, and why
    assert w.plan_stats["planner_off"] == "the mask depends on the head index: intervals differ per head"
    with pytest.raises(LaunchError, match=exact(
            "plan(skip_tiles=True): spec `per_head` has no usable key intervals (the mask depends on the head "
            "index: intervals differ per head); plan with skip_tiles=False")):
        w.plan(*batch.plan_args(), skip_tiles=True)


def test_planner_with_no_queries():
    """A batch whose requests have no new tokens: plan() and run() succeed, nothing launches."""
    spec = shipped("causal")
    batch = batch_of([0, 0], [5, 9], 4)
    for skip in (False, True, None):
        w, fake = make(spec)
        w.plan(*batch.plan_args(), skip_tiles=skip)
        out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True)
        assert out.shape == (0, HQ, HEAD_DIM) and lse.shape == (0, HQ)
        assert not fake.run_calls  # nothing to launch


@pytest.mark.parametrize("seed", range(40))
def test_random_batches(seed):
    """Random spec, lengths (some past CUSTOM_ROWS), page size (also 2, 3, 8) and scalars."""
    rng = random.Random(seed)
    name = ALL_SPECS[seed % len(ALL_SPECS)]
    spec = shipped(name)
    n = rng.randint(1, 4)
    kv_lens = [rng.randint(1, 300) for _ in range(n)]
    qo_lens = [rng.choice([k, rng.randint(1, k), 1]) for k in kv_lens]
    page_size = rng.choice([1, 2, 3, 4, 8, 16])
    batch = batch_of(qo_lens, kv_lens, page_size, seed=seed)
    args = random_spec_args(spec, batch, seed=seed)
    for s in spec.scalars:
        args[s.name] = within_range(s, rng.randint(-3, 40) if s.dtype == "int" else rng.uniform(0.5, 30.0))
    for skip in (False, True):
        check(spec, batch, args, skip_tiles=skip, label=f"{name} {qo_lens} {kv_lens} ps{page_size} skip={skip}")


# ----------------------------------------------------------------------------- errors (exact text)


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


@pytest.fixture
def mm():
    spec = shipped("mm_prefix")
    batch = batch_of([7, 5], [7, 30], 4, seed=4)
    args = random_spec_args(spec, batch)
    w, fake = make(spec)
    return w, fake, batch, args


def test_run_before_plan(mm):
    w, _, batch, args = mm
    with pytest.raises(LaunchError, match=exact("run() called before plan(): call plan(qo_indptr, "
                                                "paged_kv_indptr, ...) first")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)


def test_run_after_a_failed_plan_does_not_use_the_old_launches(mm):
    """A plan() that raises must not leave the previous batch's launches behind."""
    w, fake, batch, args = mm
    w.plan(*batch.plan_args())
    other = batch_of([3, 2, 4], [3, 9, 4], 4, seed=8)
    with pytest.raises(LaunchError, match="read ranges"):
        w.plan(*other.plan_args(), skip_tiles=True)
    other_args = random_spec_args(shipped("mm_prefix"), other)
    with pytest.raises(LaunchError, match=r"^run\(\) called before plan\(\)"):
        w.run(other.q, (other.k_cache, other.v_cache), **other_args)
    # a plan() refused while checking its inputs (after a good one) leaves nothing runnable either
    w.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match="paged_kv_last_page_len"):
        w.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.last_page_len + 9, HQ, HKV, 4)
    with pytest.raises(LaunchError, match=r"^run\(\) called before plan\(\)"):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)


def test_run_missing_tensor(mm):
    w, _, batch, args = mm
    w.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match=exact(
            "run(): missing tensor argument `ranges` (int32, shape ['total_q', 2]: inclusive absolute key span "
            "[start, end] each query token sees; (-1, -1) for none)")):
        w.run(batch.q, (batch.k_cache, batch.v_cache))


def test_run_unknown_argument(mm):
    w, _, batch, args = mm
    w.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match=exact(
            "run(): unexpected argument(s) bogus, window; spec `mm_prefix` takes: ranges, causal_window_left, "
            "range_window_left (plus q_scale, k_scale, v_scale, out, return_lse in run())")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), bogus=1, window=3, **args)
    causal, _ = make(shipped("causal"))
    causal.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match=exact(
            "run(): unexpected argument(s) ranges; spec `causal` takes: no extra arguments "
            "(plus q_scale, k_scale, v_scale, out, return_lse in run())")):
        causal.run(batch.q, (batch.k_cache, batch.v_cache), ranges=args["ranges"])


@pytest.mark.parametrize("case", ["dtype", "shape", "not_a_tensor", "non_contiguous", "device"])
def test_run_bad_spec_tensor(mm, case):
    w, _, batch, args = mm
    w.plan(*batch.plan_args())
    total_q = batch.q.shape[0]  # 12
    bad, message = {
        "dtype": (args["ranges"].long(), "run(): `ranges`: expected dtype torch.int32, got torch.int64"),
        "shape": (torch.zeros(total_q, 3, dtype=torch.int32),
                  "run(): `ranges`: expected shape [total_q=12, 2], got [12, 3]"),
        "not_a_tensor": ([[0, 1]] * total_q, "run(): `ranges`: expected a torch.int32 tensor of shape "
                                             "[total_q=12, 2], got list"),
        "non_contiguous": (torch.zeros(2, total_q, dtype=torch.int32).t(),
                           "run(): `ranges` must be contiguous (call .contiguous(); it is not copied implicitly "
                           "so that CUDA-graph pointers stay stable)"),
        "device": (torch.zeros(total_q, 2, dtype=torch.int32, device="meta"),
                   "run(): `ranges` is on meta, expected cpu (the device of the workspace)"),
    }[case]
    assert total_q == 12
    with pytest.raises(LaunchError, match=exact(message)):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **{**args, "ranges": bad})


@pytest.mark.parametrize("value, shown", [(True, "True (bool)"), ("3", "'3' (str)"),
                                          (2**31, "2147483648 (int)"), (-(2**31) - 1, "-2147483649 (int)"),
                                          (1.0, "1.0 (float)")])
def test_run_bad_int_scalar(mm, value, shown):
    w, _, batch, args = mm
    w.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match=exact(f"run(): `causal_window_left`: expected an int in 32-bit range, "
                                                f"got {shown}")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **{**args, "causal_window_left": value})


@pytest.mark.parametrize("value, shown", [(True, "True (bool)"), ("2.0", "'2.0' (str)"), (math.inf, "inf (float)"),
                                          (math.nan, "nan (float)"), (1e300, "1e+300 (float)"),
                                          (-3.5e38, "-3.5e+38 (float)"),
                                          pytest.param(10**400, "1" + "0" * 35 + "...00000000 (401 characters) (int)",
                                                       id="10**400"),
                                          pytest.param(10**5000, "<an integer of 16610 bits> (int)", id="10**5000")])
def test_run_bad_float_scalar(value, shown):
    """A float scalar must fit a 32-bit float: 1e300 would be inf in the kernel."""
    w, _ = make(shipped("softcap"))
    batch = batch_of([4], [4], 4)
    w.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match=exact(f"run(): `soft_cap`: expected a float in 32-bit float range "
                                                f"(|x| <= 3.402823e+38), got {shown}")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), soft_cap=value)
    assert_run_is_reference(w, batch, {"soft_cap": 3}, "an int is a fine float")
    assert_run_is_reference(w, batch, {"soft_cap": 3.4e38}, "the largest float32 range")


@pytest.mark.parametrize(("spec_name", "name", "value", "message"), [
    ("softcap", "soft_cap", -1.0, "-1.0 is out of range: the spec allows > 0"),
    ("softcap", "soft_cap", 0, "0 is out of range: the spec allows > 0"),
    ("softcap", "soft_cap", 1e-50, "1e-50 (as a 32-bit float it is 0.0) is out of range: the spec allows > 0"),
    ("softcap", "window", -2, "-2 is out of range: the spec allows >= -1"),
    ("chunked_local", "chunk_size", 0, "0 is out of range: the spec allows > 0"),
    ("streaming_sink", "window", -1, "-1 is out of range: the spec allows >= 0"),
    ("mm_prefix", "range_window_left", -5, "-5 is out of range: the spec allows >= -1"),
])
@pytest.mark.parametrize("where", ["plan()", "run()"])
def test_scalars_outside_their_declared_range(spec_name, name, value, message, where):
    spec = shipped(spec_name)
    w, fake = make(spec)
    batch = batch_of([4], [4], 4)
    args = random_spec_args(spec, batch)
    if where == "plan()":
        with pytest.raises(LaunchError, match=exact(f"plan(): `{name}`: {message}")):
            w.plan(*batch.plan_args(), **args, **{name: value})
        return
    ok = within_range(next(s for s in spec.scalars if s.name == name), value)  # the nearest valid value
    w.plan(*batch.plan_args(), **args, **{name: ok})
    with pytest.raises(LaunchError, match=exact(f"run(): `{name}`: {message}")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args, **{name: value})
    assert not fake.run_calls
    assert_run_is_reference(w, batch, {**args, name: ok}, f"{name}={ok}")


@pytest.mark.parametrize("case", ["dtype", "shape", "device", "out_shape"])
def test_run_bad_q(mm, case):
    w, _, batch, args = mm
    w.plan(*batch.plan_args())
    q, kw = batch.q, {}
    if case == "dtype":
        q = q.half()
        message = "run(): `q`: expected dtype torch.bfloat16 (the wrapper was built for it), got torch.float16"
    elif case == "shape":
        q = q[:, :2]
        message = "run(): `q`: expected shape [12, 4, 64], got [12, 2, 64]"
    elif case == "device":
        q = torch.empty(q.shape, dtype=q.dtype, device="meta")
        message = "run(): `q` is on meta, expected cpu"
    else:
        kw["out"] = torch.empty(11, HQ, HEAD_DIM, dtype=torch.bfloat16)
        message = "run(): `out`: expected shape [12, 4, 64], got [11, 4, 64]"
    with pytest.raises(LaunchError, match=exact(message)):
        w.run(q, (batch.k_cache, batch.v_cache), **kw, **args)


def test_run_kv_with_different_strides(mm):
    w, _, batch, args = mm
    w.plan(*batch.plan_args())
    k = batch.k_cache
    v = torch.zeros(*k.shape[:3], 2 * HEAD_DIM, dtype=k.dtype)[..., :HEAD_DIM]
    v.copy_(batch.v_cache)
    with pytest.raises(LaunchError, match=exact(
            f"run(): k_cache and v_cache must have identical strides (got {k.stride()} and {v.stride()}); "
            "this module is compiled for equal K/V strides")):
        w.run(batch.q, (k, v), **args)
    with pytest.raises(LaunchError, match=exact("run(): `v_cache`: expected dtype torch.bfloat16, got torch.float32")):
        w.run(batch.q, (k, batch.v_cache.float()), **args)
    with pytest.raises(LaunchError, match=exact(
            "run(): `k_cache`: expected [pages, page_size, kv_heads, head_dim] with page_size=4, kv_heads=2, "
            "head_dim=64; got [10, 2, 2, 64]")):
        w.run(batch.q, (k[:, :2], batch.v_cache[:, :2]), **args)
    # the right page size and head dim, one kv head of the two planned: the kernel would read past each token's heads
    one_head = (k[:, :, :1].contiguous(), batch.v_cache[:, :, :1].contiguous())
    with pytest.raises(LaunchError, match=exact(
            "run(): `k_cache`: expected [pages, page_size, kv_heads, head_dim] with page_size=4, kv_heads=2, "
            "head_dim=64; got [10, 4, 1, 64]")):
        w.run(batch.q, one_head, **args)


def test_q_scale_refused_without_qkv_scales():
    spec = variantgen.parse_spec("name: noscale\nscales: {qkv_scales: false}\nmask: kv_pos <= q_pos\n")
    w, fake = make(spec)
    batch = batch_of([6], [10], 4)
    w.plan(*batch.plan_args())
    for kw in ({"q_scale": 2.0}, {"k_scale": 1.0}, {"v_scale": 0.5}):
        with pytest.raises(LaunchError, match=exact(
                "run(): spec `noscale` sets `scales.qkv_scales: false`; q_scale/k_scale/v_scale are not accepted")):
            w.run(batch.q, (batch.k_cache, batch.v_cache), **kw)
    check(spec, batch, {}, skip_tiles=False)  # and no v_scale in the ABI (the fake checks the count)


def test_bad_qkv_scale_value():
    w, _ = make(shipped("causal"))
    batch = batch_of([6], [10], 4)
    w.plan(*batch.plan_args())
    with pytest.raises(LaunchError, match=exact(
            "run(): `v_scale`: expected a finite float, got tensor([1.]) (per-head scale tensors are not supported)")):
        w.run(batch.q, (batch.k_cache, batch.v_cache), v_scale=torch.ones(1))


def test_plan_errors(mm):
    w, _, batch, args = mm
    qo, kvp, idx, last = batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.last_page_len
    heads = (HQ, HKV, 4)
    with pytest.raises(LaunchError, match=exact(
            "plan(): `qo_indptr`: expected a 1-D torch.int32 tensor [batch + 1], got torch.int64 tensor of shape [3]")):
        w.plan(qo.long(), kvp, idx, last, *heads)
    with pytest.raises(LaunchError, match=exact(
            "plan(): `paged_kv_last_page_len`: expected a 1-D torch.int32 tensor [batch], got list")):
        w.plan(qo, kvp, idx, last.tolist(), *heads)
    with pytest.raises(LaunchError, match=exact(
            "plan(): inconsistent batch: qo_indptr has 3 entries, paged_kv_indptr 4, paged_kv_last_page_len 2 "
            "(expected batch+1, batch+1, batch)")):
        w.plan(qo, torch.cat([kvp, kvp[-1:]]), idx, last, *heads)
    with pytest.raises(LaunchError, match=exact(
            "plan(): request 1 has 5 queries but only 2 keys; the queries must be the last qo_len tokens of the "
            "request's KV")):
        w.plan(qo, torch.tensor([0, 2, 3], dtype=torch.int32), idx, torch.tensor([3, 2], dtype=torch.int32), *heads)
    for bad_last in (0, 5):
        with pytest.raises(LaunchError, match=exact(f"plan(): paged_kv_last_page_len[1]={bad_last}: expected 1..4")):
            w.plan(qo, kvp, idx, torch.tensor([3, bad_last], dtype=torch.int32), *heads)
    with pytest.raises(LaunchError, match=exact("plan(): num_qo_heads=3 is not a multiple of num_kv_heads=2")):
        w.plan(qo, kvp, idx, last, 3, HKV, 4)
    with pytest.raises(LaunchError, match=exact("plan(): page_size=0: expected a positive int below 2**31")):
        w.plan(qo, kvp, idx, last, HQ, HKV, 0)
    with pytest.raises(LaunchError, match=exact(
            "plan(): paged_kv_indices has 9 entries, paged_kv_indptr needs 10")):
        w.plan(qo, kvp, idx[:-1], last, *heads)
    # planner off, plan() still checks the spec arguments it is given as run() would
    with pytest.raises(LaunchError, match=exact("plan(): `ranges`: expected shape [total_q=12, 2], got [11, 2]")):
        w.plan(*batch.plan_args(), skip_tiles=False, ranges=args["ranges"][:11].contiguous())


def test_plan_planner_needs_the_tensors_its_intervals_read(mm):
    w, _, batch, args = mm
    with pytest.raises(LaunchError, match=exact(
            "plan(skip_tiles=True): the intervals of `mm_prefix` read ranges; pass them to plan() by name too")):
        w.plan(*batch.plan_args(), skip_tiles=True, causal_window_left=3)
    w2, _ = make(shipped("prefix_lm"))
    with pytest.raises(LaunchError, match=exact(
            "plan(skip_tiles=True): the intervals of `prefix_lm` read prefix_len; pass them to plan() by name too")):
        w2.plan(*batch.plan_args(), skip_tiles=True)
    # plan() checks what it is given like run() does
    with pytest.raises(LaunchError, match=exact("plan(): `ranges`: expected shape [total_q=12, 2], got [11, 2]")):
        w.plan(*batch.plan_args(), skip_tiles=True, ranges=args["ranges"][:11].contiguous())


def test_run_must_use_what_plan_planned_with(mm):
    w, _, batch, args = mm
    w.plan(*batch.plan_args(), skip_tiles=True, ranges=args["ranges"], causal_window_left=3)
    kv = (batch.k_cache, batch.v_cache)
    with pytest.raises(LaunchError, match=exact(
            "run(): `ranges` is not the tensor plan() was given; the interval plan was computed from that one - "
            "plan again with the new tensor")):
        w.run(batch.q, kv, ranges=args["ranges"].clone(), causal_window_left=3)
    with pytest.raises(LaunchError, match=exact(
            "run(): `causal_window_left`=4 but plan() planned with 3 (the key intervals depend on it); pass "
            "causal_window_left= to plan() as well, or plan again")):
        w.run(batch.q, kv, ranges=args["ranges"], causal_window_left=4)
    with pytest.raises(LaunchError, match=exact(
            "run(): `causal_window_left`=-1 but plan() planned with 3 (the key intervals depend on it); pass "
            "causal_window_left= to plan() as well, or plan again")):
        w.run(batch.q, kv, ranges=args["ranges"])
    with pytest.raises(LaunchError, match=exact(
            "run(): `range_window_left`=2 but plan() planned with -1 (the key intervals depend on it); pass "
            "range_window_left= to plan() as well, or plan again")):
        w.run(batch.q, kv, ranges=args["ranges"], causal_window_left=3, range_window_left=2)
    assert_run_is_reference(w, batch, {"ranges": args["ranges"], "causal_window_left": 3}, "as planned")
    # planned with the default window, run with another
    w.plan(*batch.plan_args(), skip_tiles=True, ranges=args["ranges"])
    with pytest.raises(LaunchError, match=exact(
            "run(): `causal_window_left`=3 but plan() planned with -1 (the key intervals depend on it); pass "
            "causal_window_left= to plan() as well, or plan again")):
        w.run(batch.q, kv, ranges=args["ranges"], causal_window_left=3)


def test_make_wrapper_refuses_a_module_over_a_cpu_workspace(monkeypatch):
    """A compiled module's kernels run on a GPU: make_wrapper with a CPU workspace and arch= built
    the module (minutes with JIT on) and returned a wrapper whose plan() failed with a raw CUDA
    error. Now backend="fa2"/"fa3" are refused before any build, and backend=None takes the flex
    route, as it does without arch=."""
    def no_build(*a, **k):
        pytest.fail("make_wrapper built a module for a CPU workspace")

    monkeypatch.setattr(build_mod, "build_module", no_build)
    monkeypatch.setattr(build_mod, "load_module", no_build)
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    for backend in ("fa2", "fa3"):
        with pytest.raises(ValueError, match=exact(
                "workspace: expected a CUDA tensor for a compiled module, got a tensor on cpu (to build modules for "
                "another machine: `variantgen precompile --arch`)")):
            variantgen.make_wrapper(shipped("causal"), ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16",
                                    arch="9.0a", backend=backend)
    w = variantgen.make_wrapper(shipped("causal"), ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", arch="9.0a")
    assert isinstance(w, FlexPrefillWrapper)
    with pytest.raises(ValueError, match="got list"):
        variantgen.make_wrapper(shipped("causal"), [0] * 16, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16",
                                arch="9.0a", backend="fa2")


@pytest.mark.usefixtures("host_modules")
def test_make_wrapper_refuses_fp8_queries_before_building(monkeypatch):
    def no_build(*a, **k):
        pytest.fail("make_wrapper built a module for an invalid configuration")

    monkeypatch.setattr(build_mod, "build_module", no_build)
    monkeypatch.setattr(build_mod, "load_module", no_build)
    with pytest.raises(ValueError, match=exact(
            "q_dtype=fp8_e4m3: fp8 query is not supported by fa2 (its tensor-core path needs 16-bit queries); "
            "use bf16 or fp16 queries with an fp8 KV cache")):
        variantgen.make_wrapper(shipped("causal"), torch.empty(16, dtype=torch.uint8), head_dim_qk=64,
                                q_dtype="fp8_e4m3", kv_dtype="bf16", o_dtype="bf16", arch="9.0a", backend="fa2")
    with pytest.raises(ValueError) as e:  # backend=None: every backend's reason, one line each
        variantgen.make_wrapper(shipped("causal"), torch.empty(16, dtype=torch.uint8), head_dim_qk=64,
                                q_dtype="fp8_e4m3", kv_dtype="bf16", o_dtype="bf16", arch="9.0a")
    lines = str(e.value).splitlines()
    assert lines[0] == "no backend can run it here:" and [line.split(":")[0] for line in lines[1:]] == [
        "  fa3", "  fa2", "  flex"]
    assert lines[2] == ("  fa2: q_dtype=fp8_e4m3: fp8 query is not supported by fa2 (its tensor-core path needs "
                        "16-bit queries); use bf16 or fp16 queries with an fp8 KV cache")
    with pytest.raises(ValueError, match="fa2"):
        variantgen.make_wrapper(shipped("causal"), torch.empty(16, dtype=torch.uint8), head_dim_qk=64,
                                q_dtype="fp8_e4m3", kv_dtype="fp8_e4m3", arch="9.0a")


def test_wrapper_constructor_checks():
    spec = shipped("causal")
    w, fake = make(spec)
    with pytest.raises(LaunchError, match=exact("kv_layout='NDH': expected 'NHD' or 'HND'")):
        VariantWrapper(spec, w.config, fake, w.build, torch.empty(16, dtype=torch.uint8), "NDH")
    with pytest.raises(LaunchError, match=exact(
            "workspace: expected a torch.uint8 tensor (e.g. 128 MiB on the GPU)")):
        VariantWrapper(spec, w.config, fake, w.build, torch.empty(16, dtype=torch.float32))
    with pytest.raises(LaunchError, match=exact("workspace: expected a contiguous tensor (got strides [2])")):
        VariantWrapper(spec, w.config, fake, w.build, torch.empty(32, dtype=torch.uint8)[::2])


def test_document_with_page_aligned_documents_runs_causal_launches():
    """Sorted document ids give exact intervals; page-aligned documents need no per-element mask."""
    spec = shipped("document")
    batch = batch_of([40, 24], [48, 32], 4, seed=3)
    ids = torch.cat([torch.arange(48) // 8, torch.arange(32) // 16]).to(torch.int32)
    w, _ = check(spec, batch, {"doc_ids": ids}, skip_tiles=True, label="aligned documents")
    segments = w.plan_stats["segments"]
    assert segments["custom"] == 0 and segments["causal"] > 0, segments
    # Unaligned documents still plan exactly, with the mask evaluated inside tight hulls.
    ids = torch.cat([torch.arange(48) // 7, torch.arange(32) // 5]).to(torch.int32)
    check(spec, batch, {"doc_ids": ids}, skip_tiles=True, label="unaligned documents")


def test_moving_bounds_do_not_make_one_launch_request_per_row():
    """`kv_pos < q_pos` (hi moves every row) and unaligned fixed starts plan as custom chunks."""
    spec = variantgen.parse_spec("name: strict\nmask: kv_pos < q_pos\n")
    batch = batch_of([300], [300], 4, seed=2)
    w, _ = check(spec, batch, {}, skip_tiles=True, label="strict causal")
    segments = w.plan_stats["segments"]
    assert sum(v for k, v in segments.items() if k != "custom_rows") <= 300 // 128 + 3, segments


# ----------------------------------------------------------------------------- fa3 launches


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("skip_tiles", [False, True], ids=["planner_off", "planner_on"])
@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_fa3_launches_match_reference(spec_name, skip_tiles, page_size):
    """The fa3 route: no kCustom (the mask runs as a -inf transform in non-causal launches),
    the left window per launch, rows read and written in place through q_starts."""
    spec = shipped(spec_name)
    seed = page_size * 5 + len(spec_name)
    batch = batch_of(QO_LENS, KV_LENS, page_size, seed=seed)
    args = random_spec_args(spec, batch, seed=seed)
    check(spec, batch, args, skip_tiles=skip_tiles, backend="fa3", label=f"fa3 {spec_name} ps{page_size}")


def test_fa3_window_rows_get_one_causal_launch_per_width():
    spec = shipped("sliding_window")
    batch = batch_of([300, 700], [300, 900], 16, seed=4)
    w, fake = check(spec, batch, {"window": 100}, skip_tiles=True, backend="fa3", label="fa3 window")
    windows = sorted(la.window_left for la in w._launches if la.mask_mode == "causal")
    assert 100 in windows, [(la.mask_mode, la.window_left) for la in w._launches]


def test_fa3_too_many_window_widths_go_custom():
    """Each distinct width needs its own launch; past the cap the rest run masked."""
    spec = variantgen.parse_spec("name: win\ntensors:\n  w: {dtype: int32, shape: [batch]}\n"
                                 "mask: kv_pos <= q_pos and q_pos - kv_pos <= w[request]\n")
    batch = batch_of([200, 200, 200], [400, 400, 400], 16, seed=5)
    args = {"w": torch.tensor([40, 90, 40], dtype=torch.int32)}
    w, fake = check(spec, batch, args, skip_tiles=True, backend="fa3", label="fa3 widths",
                    setup=lambda w: setattr(w.planner, "max_window_launches", 1))
    causal_windows = {la.window_left for la in w._launches if la.mask_mode == "causal"}
    assert causal_windows <= {-1, 40} and 90 not in causal_windows
    assert any(la.mask_mode == "custom" for la in w._launches)


def test_fa3_large_launches_stay_one_launch():
    """The fa3 module schedules one work list for all heads (no per-head tile budget), so a
    batch of many long requests is one launch per mask mode."""
    spec = shipped("causal")
    batch = batch_of([130, 1, 260, 129, 5] * 3, [130, 40, 300, 129, 5] * 3, 16, seed=6)
    w, _ = check(spec, batch, {}, skip_tiles=False, backend="fa3", label="fa3 one launch")
    assert [(la.mask_mode, la.num_requests) for la in w._launches] == [("custom", 15)]


def test_host_lists_and_staging_on_the_cpu():
    from variantgen.core.staging import HostStaging
    from variantgen.wrappers.base import host_indices, host_lists

    a, b = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([5, 1], dtype=torch.int32)
    assert host_lists(a, b) == [[0, 3, 7], [5, 1]]
    lists, flat = host_indices(a, b)
    assert lists == [[0, 3, 7], [5, 1]] and flat.dtype == torch.int32 and flat.tolist() == [0, 3, 7, 5, 1]
    staging = HostStaging(torch.device("cpu"))
    staging.begin()
    got = staging.to_device([1, -2, 3], torch.int64)
    assert got.dtype == torch.int64 and got.tolist() == [1, -2, 3]
    assert staging.to_device(torch.tensor([[4, 5]]), torch.int32).tolist() == [4, 5]


def test_row_kernel_segment_read_back_grows_when_too_small():
    """The row pass's compacted launch requests: a read-back with too little room is answered
    with the count (nothing built), plan() calls plan_batch again with room for all, and the
    next plan() starts with room for twice as many (one call)."""
    spec = shipped("mm_prefix")
    qo_lens = kv_lens = [64, 48]
    batch = batch_of(qo_lens, kv_lens, 16, seed=2)
    args = {"ranges": spans_to_ranges(qo_lens, kv_lens, [[(10, 20), (30, 40)], [(3, 40)]])}
    w, fake = make(spec)
    roomy = make(spec)[0]
    roomy.plan(*batch.plan_args(), **args)
    rows = FakeRowPlanner(spec)
    w.set_row_planner(rows)
    w.planner.segment_capacity = 1
    w.plan(*batch.plan_args(), **args)
    n = sum(count for _, count in w.plan_stats["launches"])
    assert w.plan_stats["row_planner"] == "kernel" and rows.calls == 2 and rows.room[0] == 1 and rows.room[1] >= n
    assert n > 1 and w.planner.segment_capacity >= 2 * n
    assert w.plan_stats["launches"] == roomy.plan_stats["launches"]
    out = w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    w.plan(*batch.plan_args(), **args)
    assert rows.calls == 3  # one per plan now


@pytest.mark.parametrize("spec_name", ALL_SPECS)
@pytest.mark.parametrize("skip_tiles", [False, None, True])
def test_plan_takes_every_spec_argument_whatever_the_planner_decides(spec_name, skip_tiles):
    """One plan() contract: engine code passes the same spec arguments to plan() and run() for
    any spec, planner on, off or by default; the output is the reference's either way."""
    spec = shipped(spec_name)
    if skip_tiles and not analyze(spec).planner_ready:
        pytest.skip("the planner cannot be forced on for this mask")
    batch = batch_of([5, 1, 7], [9, 6, 20], 4, seed=3)
    args = random_spec_args(spec, batch)
    args.update({s.name: within_range(s, s.default if s.default is not None else 3) for s in spec.scalars})
    w, _ = make(spec)
    plan = w.plan(*batch.plan_args(), skip_tiles=skip_tiles, **args)
    assert plan is w.last_plan
    if skip_tiles is False:
        assert plan.planner == "off"
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, return_lse=True)
    assert_matches_reference(out, lse, ref, ref_lse, f"{spec_name} skip_tiles={skip_tiles}")
