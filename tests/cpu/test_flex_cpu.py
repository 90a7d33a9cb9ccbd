"""The flex route on the CPU: every shipped spec end to end through torch's FlexAttention.

Unlike the other CPU suites (fake kernels that emulate generated modules), these tests run
the real thing a laptop or CI machine runs: ``make_wrapper(..., backend="flex")`` plans a
batch, gathers its pages and calls ``flex_attention`` (dynamo with the eager backend), and
the outputs are compared with the dense float32 reference derived from the same spec. The
block masks (which the eager math ignores and the compiled GPU kernel obeys) are checked
against the mask itself: a full block must be all visible, a block left out all hidden.
"""

from __future__ import annotations

import functools
import json
import math
import re

import pytest
import torch
from _fake_kernel import assert_lse_matches
from click.testing import CliRunner
from conftest import ALL_SPECS, SPECS_DIR
from conftest import CPU_KV_LENS as KV_LENS
from conftest import CPU_QO_LENS as QO_LENS
from conftest import CPU_SMALL_SCALARS as SMALL_SCALARS

import variantgen
from variantgen.core.errors import LaunchError
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.tools.cli import main as cli_main
from variantgen.wrappers import flex_blocks as flex
from variantgen.wrappers.flex_wrapper import FlexDecodeWrapper, FlexPrefillWrapper, FlexRaggedWrapper, make_flex_wrapper
from variantgen.wrappers.ragged import random_ragged_batch, reference_ragged
from variantgen.wrappers.reference import reference_attention

HQ, HKV, HEAD_DIM = 4, 2, 32
WS = torch.empty(0, dtype=torch.uint8)  # Flex needs no workspace; the API takes one
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@functools.cache
def shipped(name: str) -> variantgen.VariantSpec:
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


def spec_args(spec, batch, seed=0):
    args = random_spec_args(spec, batch, seed=seed)
    args.update(SMALL_SCALARS.get(spec.name, {}))
    return args


def assert_close(out, ref, dtype, label):
    """Flex's eager math multiplies probabilities rounded to the query dtype by V: a relative
    error of a few units of that dtype, and no NaN (every row written)."""
    assert not torch.isnan(out.float()).any(), f"{label}: NaN in the output"
    eps = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}[dtype]
    err = (out.float() - ref).norm() / ref.norm().clamp_min(1e-12)
    worst = (out.float() - ref).abs().max()
    assert err < 4 * eps and worst < 64 * eps, f"{label}: relative error {err:.2e}, max abs {worst:.2e}"


def paged_reference(spec, batch, args, **kw):
    return reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                               batch.kv_indices, batch.last_page_len, args, return_lse=True, **kw)


# ----------------------------------------------------------------------------- paged prefill


@pytest.mark.parametrize("spec_name", ALL_SPECS)
@pytest.mark.parametrize("page_size,planner", [(16, True), (16, False), (1, True)],
                         ids=["page16-planner", "page16-noplanner", "page1-planner"])
def test_paged_prefill_matches_reference(spec_name, page_size, planner):
    """Chunked prefill (qo_len < kv_len), single-token and empty requests, GQA, shuffled pages."""
    spec = shipped(spec_name)
    batch = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=page_size, dtype=torch.float16, seed=3)
    args = spec_args(spec, batch)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex")
    assert isinstance(w, FlexPrefillWrapper) and w.uri is None and not w.compiled
    if planner:
        w.plan(*batch.plan_args(), skip_tiles=True, **args)
        # only the keys some query sees are gathered (the empty request's none)
        assert w.plan_stats["keys_gathered"] <= sum(KV_LENS) - KV_LENS[3]
    else:
        w.plan(*batch.plan_args(), skip_tiles=False)
        assert w.plan_stats["keys_gathered"] == sum(KV_LENS)
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = paged_reference(spec, batch, args)
    assert out.dtype == torch.float16 and out.shape == (sum(QO_LENS), HQ, HEAD_DIM)
    assert_close(out, ref, torch.float16, spec_name)
    assert_lse_matches(lse, ref_lse, spec_name)


@pytest.mark.parametrize("spec_name", ["mm_prefix", "softcap", "document"])
def test_paged_prefill_hnd_gqa8_bf16_scales(spec_name):
    """HND pages, 8 query heads per KV head, bf16, q/k/v scales, a float32 output."""
    spec = shipped(spec_name)
    batch = random_paged_batch([12, 30, 1], [40, 30, 77], num_qo_heads=8, num_kv_heads=1, head_dim=16,
                               page_size=5, dtype=torch.bfloat16, seed=1)
    args = spec_args(spec, batch)
    hnd = (batch.k_cache.transpose(1, 2).contiguous(), batch.v_cache.transpose(1, 2).contiguous())
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=16, q_dtype="bf16", kv_dtype="bf16", o_dtype="fp32",
                                kv_layout="HND", backend="flex")
    w.plan(*batch.plan_args(), **{k: v for k, v in args.items() if k in w._interval_facts.args})
    out, lse = w.run(batch.q, hnd, q_scale=0.7, k_scale=1.3, v_scale=0.5, return_lse=True, **args)
    ref, ref_lse = paged_reference(spec, batch, args, q_scale=0.7, k_scale=1.3, v_scale=0.5)
    assert out.dtype == torch.float32
    assert_close(out, ref, torch.bfloat16, spec_name)
    assert_lse_matches(lse, ref_lse, spec_name)


def test_fp8_kv_cache_is_widened_to_the_query_dtype():
    spec = shipped("sliding_window")
    batch = random_paged_batch([9, 4], [9, 50], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=16,
                               dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, seed=2)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="bf16", kv_dtype="fp8_e4m3", backend="flex")
    w.plan(*batch.plan_args(), window=7)
    out = w.run(batch.q, (batch.k_cache, batch.v_cache), k_scale=0.5, v_scale=2.0, window=7)
    ref, _ = paged_reference(spec, batch, {"window": 7}, k_scale=0.5, v_scale=2.0)
    assert_close(out, ref, torch.bfloat16, "fp8 kv")


def test_rows_that_see_no_key_give_zero_and_minus_inf(spec_from):
    spec = spec_from("""
        name: strictly_before
        mask: kv_pos < q_pos
    """)
    batch = random_paged_batch([6, 3], [6, 3], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4,
                               dtype=torch.float16)
    for planner in (True, False):
        w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex")
        w.plan(*batch.plan_args(), skip_tiles=planner)
        out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True)
        for row in (0, 6):  # each request's first query (q_pos 0)
            assert torch.equal(out[row], torch.zeros_like(out[row])) and torch.isneginf(lse[row]).all()
        ref, ref_lse = paged_reference(spec, batch, {})
        assert_close(out, ref, torch.float16, "strictly_before")
        assert_lse_matches(lse, ref_lse, "strictly_before")


def test_logits_transform_lse_is_float32_exact():
    """A logits transform is applied to float32 scores and returned as float32: Flex traces the
    score_mod with scores of the query dtype, and a cast back to it rounded the transformed
    logits to 16 bits (LSE off by ~1e-2 on ALiBi / soft-cap)."""
    for name in ("alibi", "softcap"):
        spec = shipped(name)
        batch = random_paged_batch([40, 64], [90, 200], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                                   page_size=16, dtype=torch.float16, seed=5)
        args = spec_args(spec, batch)
        w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex")
        w.plan(*batch.plan_args(), skip_tiles=False)
        _, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
        _, ref_lse = paged_reference(spec, batch, args)
        fin = torch.isfinite(ref_lse)
        assert (lse[fin] - ref_lse[fin]).abs().max() < 1e-4, name


def test_head_dependent_mask_finds_blocks_per_head(spec_from):
    """A mask reading the head has no key intervals: the planner is off (with the reason) and
    the block mask comes from evaluating the mask, one block list per head."""
    spec = spec_from("""
        name: head_window
        mask: kv_pos <= q_pos and q_pos - kv_pos <= 3 * qo_head + 2
    """)
    batch = random_paged_batch([150, 40], [300, 40], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=16, dtype=torch.float16)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex")
    w.plan(*batch.plan_args())
    assert "head index" in w.plan_stats["planner_off"]
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True)
    ref, ref_lse = paged_reference(spec, batch, {})
    assert_close(out, ref, torch.float16, "head_window")
    assert_lse_matches(lse, ref_lse, "head_window")
    blocks = w._run_blocks[1]
    assert blocks.kv_num.shape[1] == HQ  # per head
    assert_blocks_sound(w, {}, blocks)


# ----------------------------------------------------------------------------- block masks


def dense_visibility(w, args):
    """The wrapper's mask_mod over its whole Flex grid: bool [B, H, q_len, kv_len], and which
    Flex query rows belong to a request [B, q_len]."""
    plan = w._plan
    layout = plan.layout
    mods = flex.make_mods(w.spec, layout, flex.capture_args(w.spec, args, w.device))
    b = torch.arange(layout.batch).view(-1, 1, 1, 1)
    h = torch.arange(layout.num_qo_heads).view(1, -1, 1, 1)
    q = torch.arange(layout.q_len).view(1, 1, -1, 1)
    kv = torch.arange(layout.kv_len).view(1, 1, 1, -1)
    vis = mods.mask_mod(b, h, q, kv).expand(layout.batch, layout.num_qo_heads, layout.q_len, layout.kv_len)
    real = flex._real_rows(layout, b[:, 0, :, 0], q[:, 0, :, 0])
    return vis, real.expand(layout.batch, layout.q_len)


def assert_blocks_sound(w, args, blocks):
    """A full block is visible everywhere (on rows of a request), a block not listed nowhere."""
    vis, real = dense_visibility(w, args)
    partial, full = blocks.dense()
    bsz, heads, nq, nkv = vis.shape[0], vis.shape[1], partial.shape[2], partial.shape[3]
    pad_q = nq * flex.BLOCK - vis.shape[2]
    vis = torch.nn.functional.pad(vis, (0, 0, 0, pad_q))
    real = torch.nn.functional.pad(real, (0, pad_q))
    tiles = vis.view(bsz, heads, nq, flex.BLOCK, nkv, flex.BLOCK).permute(0, 1, 2, 4, 3, 5)
    rows = real.view(bsz, 1, nq, 1, flex.BLOCK, 1)
    any_visible = (tiles & rows).flatten(4).any(-1)
    all_visible = (tiles | ~rows).flatten(4).all(-1)
    partial, full = partial.expand_as(any_visible), full.expand_as(any_visible)
    assert not (partial & full).any(), "a block is both partial and full"
    assert (all_visible | ~full).all(), "a full block hides a key from a row"
    assert not (any_visible & ~(partial | full)).any(), "a block with a visible key is not visited"
    return (partial & ~any_visible).sum().item()  # visited blocks with nothing visible (not wrong: slower)


@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_blocks_from_intervals_are_sound_and_tight(spec_name):
    """Requests of several hundred tokens (several 128-blocks), chunked prefill: the interval
    block lists are sound against the mask; where every row's interval is exact, no visited
    block is all hidden; the lists found by evaluating the mask are sound and tight."""
    spec = shipped(spec_name)
    batch = random_paged_batch([300, 130, 1, 260], [300, 500, 70, 600], num_qo_heads=2, num_kv_heads=1,
                               head_dim=16, page_size=16, dtype=torch.float16, seed=11)
    args = spec_args(spec, batch, seed=4)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=16, q_dtype="fp16", kv_dtype="fp16", backend="flex")
    w.plan(*batch.plan_args(), skip_tiles=True, **args)
    blocks = w._plan.blocks
    idle = assert_blocks_sound(w, args, blocks)
    counts = blocks.counts()
    assert counts["partial"] + counts["full"] < counts["total"]  # the diagonal structure skips blocks
    if spec_name in ("causal", "alibi", "prefix_lm"):
        assert counts["full"] > 0  # interior blocks skip the mask
    if spec_name in ("causal", "alibi", "softcap", "sliding_window", "chunked_local", "prefix_lm"):
        assert idle == 0
    w.plan(*batch.plan_args(), skip_tiles=False)
    w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    assert assert_blocks_sound(w, args, w._run_blocks[1]) == 0


def test_compiled_cpu_kernel_obeys_the_block_lists():
    """The eager math evaluates the mask everywhere; the compiled kernel (inductor's CPU kernel
    here, Triton on CUDA) trusts the block lists: it skips blocks not listed and the mask in
    full ones. With the interval lists it matches the reference, and a list made wrong on
    purpose changes the output, so the lists are what the compiled result rests on."""
    spec = shipped("prefix_lm")
    batch = random_paged_batch([300, 130, 1, 260], [300, 500, 70, 600], num_qo_heads=2, num_kv_heads=1,
                               head_dim=16, page_size=16, dtype=torch.float32, seed=11)
    args = spec_args(spec, batch, seed=4)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    w = make_flex_wrapper(spec, WS, head_dim_qk=16, q_dtype="fp32", kv_dtype="fp32", compile=True)
    w.plan(*batch.plan_args(), **args)
    out = w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    assert (out - ref).abs().max() < 1e-5
    partial, full = w._plan.blocks.dense()
    assert full.any() and partial.any()
    for name, bad_partial, bad_full in (("a full block dropped", partial, full & (full.cumsum(-1) > 1)),
                                        ("a partial block marked full", partial & (partial.cumsum(-1) > 1),
                                         full | (partial & (partial.cumsum(-1) == 1)))):
        w._plan.blocks = flex.Blocks.from_dense(bad_partial, bad_full)
        wrong = w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
        assert (wrong - ref).abs().max() > 1e-2, name


# ----------------------------------------------------------------------------- ragged and decode


@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_ragged_matches_reference(spec_name):
    spec = shipped(spec_name)
    rb = random_ragged_batch(QO_LENS, KV_LENS, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=HEAD_DIM,
                             dtype=torch.float16, seed=7)
    args = spec_args(spec, rb)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex",
                                kind="ragged")
    assert isinstance(w, FlexRaggedWrapper)
    w.plan(*rb.plan_args())
    out, lse = w.run(rb.q, rb.k, rb.v, return_lse=True, **args)
    ref, ref_lse = reference_ragged(spec, rb.q, rb.k, rb.v, rb.qo_indptr, rb.kv_indptr, args, return_lse=True)
    assert_close(out, ref, torch.float16, spec_name)
    assert_lse_matches(lse, ref_lse, spec_name)


def test_ragged_hnd_192_128_and_replanning_on_new_arguments():
    """MLA-shaped head dims, HND rows; the interval plan follows run()'s tensors (a tensor
    changed in place is a new plan, the same values reuse it)."""
    spec = shipped("document")
    rb = random_ragged_batch([20, 7], [50, 7], num_qo_heads=HQ, num_kv_heads=HQ, head_dim_qk=48, head_dim_vo=32,
                             dtype=torch.float16, kv_layout="HND", seed=2)
    args = spec_args(spec, rb)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=48, head_dim_vo=32, q_dtype="fp16", kv_dtype="fp16",
                                backend="flex", kind="ragged", kv_layout="HND")
    w.plan(*rb.plan_args())
    plans = []
    for step in range(3):
        out, lse = w.run(rb.q, rb.k, rb.v, return_lse=True, v_scale=1.5, **args)
        ref, ref_lse = reference_ragged(spec, rb.q, rb.k, rb.v, rb.qo_indptr, rb.kv_indptr, args, kv_layout="HND",
                                        v_scale=1.5, return_lse=True)
        assert_close(out, ref, torch.float16, f"step {step}")
        assert_lse_matches(lse, ref_lse, f"step {step}")
        plans.append(w._interval_plan_of[1])
        if step == 0:
            args["doc_ids"][30:] += 1  # in place: new values
    assert plans[0] is not plans[1] and plans[1] is plans[2]


@pytest.mark.parametrize("spec_name", ALL_SPECS)
@pytest.mark.parametrize("trim", [True, False], ids=["trimmed", "untrimmed"])
def test_decode_matches_reference(spec_name, trim):
    spec = shipped(spec_name)
    kv_lens = [1, 3, 16, 17, 90, 130, 41]
    batch = random_paged_batch([1] * len(kv_lens), kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=HEAD_DIM,
                               page_size=16, dtype=torch.bfloat16, seed=4)
    args = spec_args(spec, batch)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="bf16", kv_dtype="bf16", backend="flex",
                                kind="decode")
    assert isinstance(w, FlexDecodeWrapper)
    if trim:
        w.plan(*batch.plan_args()[1:], skip_tiles=True, **args)
    else:
        w.plan(*batch.plan_args()[1:], skip_tiles=False)
        assert w.plan_stats["keys_gathered"] == sum(kv_lens)
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache),
                                       torch.arange(len(kv_lens) + 1, dtype=torch.int32), batch.kv_indptr,
                                       batch.kv_indices, batch.last_page_len, args, return_lse=True)
    assert_close(out, ref, torch.bfloat16, spec_name)
    assert_lse_matches(lse, ref_lse, spec_name)


def test_decode_trimming_gathers_only_the_window():
    spec = shipped("sliding_window")
    batch = random_paged_batch([1, 1], [700, 20], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=16, dtype=torch.float16)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex",
                                kind="decode")
    w.plan(*batch.plan_args()[1:], window=9)
    assert w.plan_stats["keys_gathered"] == 20
    out = w.run(batch.q, (batch.k_cache, batch.v_cache), window=9)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), torch.arange(3, dtype=torch.int32),
                              batch.kv_indptr, batch.kv_indices, batch.last_page_len, {"window": 9})
    assert_close(out, ref, torch.float16, "window")


@pytest.mark.parametrize("spec_name", ["causal", "mm_prefix", "sliding_window", "attention_sink_learned"])
def test_multi_token_decode_matches_reference(spec_name):
    """q_len_per_request=3: the last 3 tokens of every request are its queries (rows 3b .. 3b+2);
    a later one-query plan is plain decode again."""
    spec = shipped(spec_name)
    kv_lens = [3, 16, 17, 90, 41]
    batch = random_paged_batch([3] * len(kv_lens), kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=HEAD_DIM,
                               page_size=16, dtype=torch.bfloat16, seed=5)
    args = spec_args(spec, batch)
    w = variantgen.make_wrapper(spec, torch.empty(1, dtype=torch.uint8), head_dim_qk=HEAD_DIM, q_dtype="bf16",
                                kv_dtype="bf16", backend="flex", kind="decode")
    assert isinstance(w, FlexDecodeWrapper)
    kv = (batch.k_cache, batch.v_cache)
    w.plan(*batch.plan_args()[1:], q_len_per_request=3, **args)
    out, lse = w.run(batch.q, kv, return_lse=True, **args)
    assert out.shape == (15, 8, HEAD_DIM) and batch.qo_indptr.tolist() == list(range(0, 18, 3))
    ref, ref_lse = paged_reference(spec, batch, args)
    assert_close(out, ref, torch.bfloat16, spec_name)
    assert_lse_matches(lse, ref_lse, spec_name)
    with pytest.raises(LaunchError, match=exact("plan(): request 0 has kv_len 3 < q_len_per_request=4 (its queries "
                                                "are its last q_len_per_request tokens)")):
        w.plan(*batch.plan_args()[1:], q_len_per_request=4)
    with pytest.raises(LaunchError, match=exact("plan(): q_len_per_request=0: expected a whole number >= 1")):
        w.plan(*batch.plan_args()[1:], q_len_per_request=0)
    last = batch.q[2::3].contiguous()  # each request's last token alone
    one_args = random_spec_args(spec, random_paged_batch([1] * len(kv_lens), kv_lens, num_qo_heads=8,
                                                         num_kv_heads=2, head_dim=HEAD_DIM, page_size=16))
    one_args.update(SMALL_SCALARS.get(spec_name, {}))
    w.plan(*batch.plan_args()[1:], **one_args)
    one = w.run(last, kv, **one_args)
    ref_one = reference_attention(spec, last, kv, torch.arange(len(kv_lens) + 1, dtype=torch.int32), batch.kv_indptr,
                                  batch.kv_indices, batch.last_page_len, one_args)
    assert one.shape == (5, 8, HEAD_DIM)
    assert_close(one, ref_one, torch.bfloat16, f"{spec_name} after multi-token")


# ----------------------------------------------------------------------------- the shared checks


def prefill(spec_name="mm_prefix", **kw):
    spec = shipped(spec_name)
    batch = random_paged_batch([5, 3], [9, 3], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4,
                               dtype=torch.float16)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex", **kw)
    return w, batch, spec_args(spec, batch)


def test_argument_checks_are_the_wrappers():
    w, batch, args = prefill()
    kv = (batch.k_cache, batch.v_cache)
    with pytest.raises(LaunchError, match=exact("run() called before plan(): call plan(...) first")):
        w.run(batch.q, kv, **args)
    with pytest.raises(LaunchError, match="num_qo_heads=4 is not a multiple of num_kv_heads=3"):
        w.plan(*batch.plan_args()[:4], HQ, 3, 4)
    with pytest.raises(LaunchError, match=r"request 0 has 5 queries but only 4 keys"):
        w.plan(batch.qo_indptr, torch.tensor([0, 1, 2], dtype=torch.int32), batch.kv_indices,
               torch.tensor([4, 3], dtype=torch.int32), HQ, HKV, 4)
    with pytest.raises(LaunchError, match="unexpected argument"):
        w.plan(*batch.plan_args(), skip_tiles=False, rangs=args["ranges"])
    w.plan(*batch.plan_args(), skip_tiles=False, **args)  # one plan() contract: taken, planner on or off
    w.plan(*batch.plan_args(), **args)
    with pytest.raises(LaunchError, match="missing tensor argument `ranges`"):
        w.run(batch.q, kv)
    with pytest.raises(LaunchError, match="is not the tensor plan\\(\\) was given"):
        w.run(batch.q, kv, ranges=args["ranges"].clone())
    with pytest.raises(LaunchError, match="expected dtype torch.float16"):
        w.run(batch.q.to(torch.bfloat16), kv, **args)
    with pytest.raises(LaunchError, match="`causal_window_left`: expected an int"):
        w.run(batch.q, kv, **dict(args, causal_window_left=1.5))
    with pytest.raises(LaunchError, match="`q_scale`: expected a finite float"):
        w.run(batch.q, kv, q_scale=math.inf, **args)
    with pytest.raises(LaunchError, match=r"`out`: expected shape \[8, 4, 32\]"):
        w.run(batch.q, kv, out=torch.empty(7, HQ, HEAD_DIM, dtype=torch.float16), **args)
    small = (batch.k_cache[:2], batch.v_cache[:2])
    bad = int((batch.kv_indices >= 2).nonzero()[0, 0])
    with pytest.raises(LaunchError, match=exact(f"run(): paged_kv_indices[{bad}]={int(batch.kv_indices[bad])} is not "
                                                "a page of the KV cache run() was given (2 pages: expected 0 <= page < "
                                                "2)")):
        w.run(batch.q, small, **args)
    negative = batch.kv_indices.clone()
    negative[1] = -1  # torch would read the last page for it
    with pytest.raises(LaunchError, match=exact("plan(): paged_kv_indices[1]=-1 is not a page number (expected 0 <= "
                                                "page < the KV cache's page count)")):
        w.plan(batch.qo_indptr, batch.kv_indptr, negative, batch.last_page_len, HQ, HKV, 4, **args)
    with pytest.raises(LaunchError, match=exact("run() called before plan(): call plan(...) first")):
        w.run(batch.q, kv, **args)  # the failed plan() left none


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_every_planned_page_is_checked_gathered_or_not(kind):
    """As on the FlashInfer routes, every entry of paged_kv_indices[:paged_kv_indptr[-1]] must be a
    page of run()'s cache, also the ones key trimming does not gather (a regression: only the
    gathered pages were checked, and negative entries only in run())."""
    spec = shipped("sliding_window")
    batch = random_paged_batch([1], [40], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4,
                               dtype=torch.float16)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex",
                                kind=kind)
    plan_args = batch.plan_args()[1:] if kind == "decode" else batch.plan_args()
    kv = (batch.k_cache, batch.v_cache)

    def plan(page0: int) -> None:  # page 0 of the request: outside the window, not gathered
        indices = batch.kv_indices.clone()
        indices[0] = page0
        at = 1 if kind == "decode" else 2  # (paged_kv_indices)
        w.plan(*plan_args[:at], indices, *plan_args[at + 1:], skip_tiles=True, window=3)
        assert w.plan_stats["keys_gathered"] == 4

    with pytest.raises(LaunchError, match=exact("plan(): paged_kv_indices[0]=-7 is not a page number (expected 0 <= "
                                                "page < the KV cache's page count)")):
        plan(-7)
    pages = batch.k_cache.shape[0]
    plan(pages)
    with pytest.raises(LaunchError, match=exact(f"run(): paged_kv_indices[0]={pages} is not a page of the KV cache "
                                                f"run() was given ({pages} pages: expected 0 <= page < {pages})")):
        w.run(batch.q, kv, window=3)
    plan(0)
    w.run(batch.q, kv, window=3)
    if kind == "prefill":  # a batch without queries reads no page, but its list is checked as well
        empty = random_paged_batch([0], [8], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4,
                                   dtype=torch.float16)
        indices = empty.kv_indices.clone()
        indices[1] = -1
        with pytest.raises(LaunchError, match=exact("plan(): paged_kv_indices[1]=-1 is not a page number (expected 0 "
                                                    "<= page < the KV cache's page count)")):
            w.plan(empty.qo_indptr, empty.kv_indptr, indices, empty.last_page_len, HQ, HKV, 4)


def test_decode_and_ragged_checks_are_the_wrappers():
    spec = shipped("causal")
    batch = random_paged_batch([1, 1], [5, 9], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4,
                               dtype=torch.float16)
    d = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex",
                                kind="decode")
    with pytest.raises(LaunchError, match="request 1 has no pages"):
        d.plan(torch.tensor([0, 2, 2], dtype=torch.int32), batch.kv_indices, batch.last_page_len, HQ, HKV, 4)
    d.plan(*batch.plan_args()[1:])
    with pytest.raises(LaunchError, match="`out` must be contiguous"):
        d.run(batch.q, (batch.k_cache, batch.v_cache),
              out=torch.empty(2, HEAD_DIM, HQ, dtype=torch.float16).transpose(1, 2))
    r = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp16", kv_dtype="fp16", backend="flex",
                                kind="ragged")
    with pytest.raises(LaunchError, match=r"`kv_indptr`\[0\]=1: expected 0"):
        r.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32), HQ, HKV)
    rb = random_ragged_batch([2], [3], num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=HEAD_DIM, dtype=torch.float16)
    r.plan(*rb.plan_args())
    misaligned = torch.empty(rb.k.numel() + 1, dtype=torch.float16)[1:].view_as(rb.k)  # 2 bytes off
    with pytest.raises(LaunchError, match="rows must start at 16-byte boundaries"):
        r.run(rb.q, misaligned, rb.v)


def test_batch_without_queries_returns_empty_outputs():
    w, batch, args = prefill("causal")
    b = random_paged_batch([0, 0], [4, 0], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4,
                           dtype=torch.float16)
    w.plan(*b.plan_args())
    out, lse = w.run(b.q, (b.k_cache, b.v_cache), return_lse=True)
    assert out.shape == (0, HQ, HEAD_DIM) and lse.shape == (0, HQ)


def test_factory_settings():
    spec = shipped("causal")
    # make_wrapper asks the capability table (capabilities.FLEX) before the route's factory
    with pytest.raises(ValueError, match=exact("graph=: CUDA-graph mode needs backend 'fa3' or 'fa2' (got 'flex'): "
                                               "its plan() and run() read the batch on the host")):
        variantgen.make_wrapper(spec, WS, head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16", backend="flex",
                                graph=object())
    with pytest.raises(ValueError, match=exact("q_dtype=fp8_e4m3: the flex route takes bf16, fp16, fp32")):
        variantgen.make_wrapper(spec, WS, head_dim_qk=64, q_dtype="fp8_e4m3", kv_dtype="bf16", backend="flex")
    with pytest.raises(ValueError, match=exact("q_dtype='fp8_e4m3': the flex route takes ['bf16', 'fp16', 'fp32']")):
        make_flex_wrapper(spec, WS, head_dim_qk=64, q_dtype="fp8_e4m3", kv_dtype="bf16")  # its own check, too
    with pytest.raises(ValueError, match=exact("check_plan=True: the plan check is the FlashInfer routes' debug "
                                               "mode; the flex route has none")):
        variantgen.make_wrapper(spec, WS, head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16", backend="flex",
                                check_plan=True)
    with pytest.raises(ValueError, match="kind='paged': expected one of"):
        variantgen.make_wrapper(spec, WS, head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16", backend="flex",
                                kind="paged")
    with pytest.raises(LaunchError, match="kv_layout='NDH'"):
        variantgen.make_wrapper(spec, WS, head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16", backend="flex",
                                kv_layout="NDH")
    w = make_flex_wrapper(spec, WS, head_dim_qk=64, q_dtype=torch.float32, kv_dtype="float32", kind="decode",
                          use_tensor_cores=True)
    assert w.config.describe()["q_dtype"] == "fp32" and w.config.kind == "decode"


def test_fp32_wrapper_matches_reference_tightly():
    spec = shipped("chunked_local")
    batch = random_paged_batch([10, 33], [25, 33], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=8, dtype=torch.float32)
    args = spec_args(spec, batch)
    w = variantgen.make_wrapper(spec, WS, head_dim_qk=HEAD_DIM, q_dtype="fp32", kv_dtype="fp32", backend="flex")
    w.plan(*batch.plan_args(), **args)
    out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    ref, ref_lse = paged_reference(spec, batch, args)
    assert_close(out, ref, torch.float32, "fp32")
    assert_lse_matches(lse, ref_lse, "fp32")


# ----------------------------------------------------------------------------- probe and CLI


def test_probe_flex_runs_a_batch_here():
    for kind in ("prefill", "ragged", "decode"):
        r = variantgen.probe(SPECS_DIR / "mm_prefix.yaml", head_dim_qk=32, q_dtype="bf16", kv_dtype="bf16",
                             backend="flex", kind=kind)
        assert r.ok, r.reason
        assert r.uri is None and r.source == "torch" and r.details["backend"] == "flex"
        assert r.details["device"] == "cpu" and r.details["compiled"] is False
        assert "through Flex" in r.details["checked"]


def test_probe_flex_reasons():
    r = variantgen.probe(SPECS_DIR / "causal.yaml", head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16",
                         backend="flex", cuda_graph=True)
    assert not r.ok and r.reason == ("cuda_graph=True: CUDA-graph mode needs backend 'fa3' or 'fa2' (got 'flex'): "
                                     "its plan() and run() read the batch on the host")
    r = variantgen.probe(SPECS_DIR / "causal.yaml", head_dim_qk=64, q_dtype="fp8", kv_dtype="bf16", backend="flex")
    assert not r.ok and r.reason == "q_dtype=fp8_e4m3: the flex route takes bf16, fp16, fp32"
    r = variantgen.probe(SPECS_DIR / "causal.yaml", head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16", backend="flex",
                         device="meta")
    assert not r.ok and "runs on CUDA and CPU devices" in r.reason


def test_probe_flex_says_why_torch_cannot(monkeypatch):
    monkeypatch.setattr(flex, "flex_problem", lambda: "torch 2.4.0 has no torch.nn.attention.flex_attention")
    variantgen.probe.cache_clear()
    try:
        r = variantgen.probe(SPECS_DIR / "causal.yaml", head_dim_qk=64, q_dtype="bf16", kv_dtype="bf16",
                             backend="flex")
    finally:
        variantgen.probe.cache_clear()
    assert not r.ok and r.reason == "torch 2.4.0 has no torch.nn.attention.flex_attention"


def test_cli_probe_and_precompile_flex():
    runner = CliRunner()
    res = runner.invoke(cli_main, ["probe", str(SPECS_DIR / "softcap.yaml"), "--head-dim", "32", "--dtype", "fp16",
                                   "--backend", "flex", "--kind", "prefill,decode", "--json"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.output)
    assert [(p["backend"], p["kind"], p["ok"]) for p in payload] == [("flex", "prefill", True),
                                                                     ("flex", "decode", True)]
    res = runner.invoke(cli_main, ["precompile", str(SPECS_DIR / "softcap.yaml"), "--head-dim", "128", "--dtype",
                                   "bf16", "--backend", "flex", "--arch", "9.0a"])
    assert res.exit_code == 0, res.output
    assert "flex: nothing to precompile" in res.output and "nothing to build" in res.output


def test_a_tensor_refilled_outside_torch_is_read_again():
    """What run() finds from the spec's tensors (the ragged interval plan; the block lists with the
    planner off) is kept only while they hold the same values: a server's staging buffer refilled
    through numpy keeps its address and torch's version counter, and the old plan gave wrong output."""
    import numpy as np

    spec = variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")
    rb = random_ragged_batch([8], [64], num_qo_heads=2, num_kv_heads=1, head_dim_qk=16, dtype=torch.float32, seed=0)
    ragged = make_flex_wrapper(spec, torch.empty(0, dtype=torch.uint8), head_dim_qk=16, q_dtype="fp32",
                               kv_dtype="fp32", kind="ragged")
    ragged.plan(*rb.plan_args())
    b = random_paged_batch([64], [64], num_qo_heads=2, num_kv_heads=1, head_dim=16, page_size=16,
                           dtype=torch.float32, seed=0)
    paged = make_flex_wrapper(spec, torch.empty(0, dtype=torch.uint8), head_dim_qk=16, q_dtype="fp32",
                              kv_dtype="fp32", compile=True)  # (the compiled kernel obeys the block lists)
    paged.plan(*b.plan_args(), skip_tiles=False)
    host_r, host_p = np.empty((8, 2), dtype=np.int32), np.empty((64, 2), dtype=np.int32)
    for span_r, span_p in (((-1, -1), (-1, -1)), ((0, 63), (40, 63))):
        host_r[:], host_p[:] = span_r, span_p
        ranges = torch.from_numpy(host_r)
        args = {"ranges": ranges, "causal_window_left": 2}
        out = ragged.run(rb.q, rb.k, rb.v, **args)
        want = reference_ragged(spec, rb.q, rb.k, rb.v, rb.qo_indptr, rb.kv_indptr, args)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        ranges = torch.from_numpy(host_p)
        out = paged.run(b.q, (b.k_cache, b.v_cache), ranges=ranges)
        want = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                   b.last_page_len, {"ranges": ranges})
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_qk_and_vo_head_dims_may_differ_with_caches_of_their_own(kind):
    """192/128 on paged kinds: K and V caches of their own widths have different strides, which
    the module kernels refuse (one set of strides) but the flex route gathers separately; its
    probe said no from that check."""
    assert variantgen.probe("causal", head_dim_qk=192, head_dim_vo=128, q_dtype="fp32", kv_dtype="fp32",
                            backend="flex", kind=kind).ok
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    w = make_flex_wrapper(spec, torch.empty(0, dtype=torch.uint8), head_dim_qk=192, head_dim_vo=128,
                          q_dtype="fp32", kv_dtype="fp32", kind=kind)
    qo = [1, 1] if kind == "decode" else [5, 3]
    b = random_paged_batch(qo, [40, 7], num_qo_heads=2, num_kv_heads=1, head_dim=192, page_size=16,
                           dtype=torch.float32)
    v = torch.randn(*b.k_cache.shape[:-1], 128)  # its own buffer: strides unlike K's
    if kind == "decode":
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 2, 1, 16)
    else:
        w.plan(*b.plan_args())
    out = w.run(b.q, (b.k_cache, v))
    want = reference_attention(spec, b.q, (b.k_cache, v), b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
