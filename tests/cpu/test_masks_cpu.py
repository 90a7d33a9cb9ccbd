"""Issue 18's masks on the CPU: learned attention sinks (attention_sink_learned), tree
verification for speculative decoding (tree_verify) and Gemma 4's sliding layers with images
(gemma4_sliding).

Each spec's meaning is checked against a definition written independently of its expression
(an ancestor walk, the attention formula with the sink, transformers' own Gemma 4 mask
functions), then every wrapper kind is run through the fake kernels (tests/fakes/_fake_kernel.py,
_fake_decode.py) - fa2 and fa3 paged prefill with the planner on and off, chunked prefill,
ragged, CUDA-core and tensor-core decode, CUDA-graph replays - against the dense reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SPECS_DIR
from test_decode_cpu import check as decode_check
from test_decode_cpu import decode_batch
from test_graph_cpu import Engine, capture_or_replay, check_replayed
from test_graph_cpu import make as graph_make
from test_ragged_cpu import batch_of as ragged_batch
from test_ragged_cpu import check as ragged_check
from test_wrapper_cpu import HEAD_DIM, HKV, HQ, batch_of
from test_wrapper_cpu import check as prefill_check
from test_wrapper_cpu import make as make_wrapper_for

import variantgen
from variantgen import probe as probe_mod
from variantgen.abi.table import FA2_TAIL_RUN_CODE, MaskMode, MetaColumn
from variantgen.codegen.render import ModuleConfig
from variantgen.routing.capabilities import TABLE, Request, Site
from variantgen.testing.harness import mask_exact_launches, random_paged_batch, random_spec_args
from variantgen.wrappers.reference import (
    RequestGrid,
    mask_for_request,
    reference_attention,
    sink_for_request,
    softmax_attention,
)
from variantgen.wrappers.trees import random_tree_parents, tree_bits


def shipped(name: str) -> variantgen.VariantSpec:
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


def dense_attention(batch, masks: list[torch.Tensor], sinks: list[torch.Tensor | None] | None = None):
    """Attention with an explicit dense mask per request ([qo_len, kv_len] bool, the same for
    every head) and an optional sink per head: the float32 output and base-2 LSE."""
    k_all = batch.k_cache[batch.kv_indices.long()].reshape(-1, HKV, HEAD_DIM).float()
    v_all = batch.v_cache[batch.kv_indices.long()].reshape(-1, HKV, HEAD_DIM).float()
    outs, lses = [], []
    q_at = page_at = 0
    for b, (ql, kl) in enumerate(zip(batch.qo_lens, batch.kv_lens)):
        pages = -(-kl // batch.page_size)
        k = k_all[page_at * batch.page_size:][:kl].repeat_interleave(HQ // HKV, dim=1)
        v = v_all[page_at * batch.page_size:][:kl].repeat_interleave(HQ // HKV, dim=1)
        scores = torch.einsum("qhd,khd->hqk", batch.q[q_at:q_at + ql].float(), k) / math.sqrt(HEAD_DIM)
        o, lse = softmax_attention(scores.masked_fill(~masks[b], -math.inf), v, sinks[b] if sinks else None)
        outs.append(o)
        lses.append(lse)
        q_at += ql
        page_at += pages
    return torch.cat(outs), torch.cat(lses)


def unshuffled_batch(qo_lens, kv_lens, page_size, seed=0):
    """A paged batch whose pages lie in order (dense_attention reads them back to back)."""
    return random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                              page_size=page_size, seed=seed, shuffle_pages=False)


# ----------------------------------------------------------------------------- learned sinks


def test_learned_sink_is_the_attention_formula():
    """The reference with a sink is o = sum_j e^(l_j - m) v_j / (e^(s_h - m) + sum_j e^(l_j - m)),
    checked as FlashInfer's sink wrapper defines it: the sink as one more column of the softmax,
    dropped before the product with v (as transformers' gpt-oss eager attention does)."""
    spec = shipped("attention_sink_learned")
    batch = unshuffled_batch([5, 1, 9], [5, 30, 200], 16, seed=3)
    sinks = torch.tensor([0.0, 2.5, -4.0, 30.0])
    for window in (-1, 128, 7):
        args = {"sinks": sinks, "window": window}
        out, lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args,
                                       return_lse=True)
        want_out, want_lse = [], []
        q_at = 0
        for b, (ql, kl) in enumerate(zip(batch.qo_lens, batch.kv_lens)):
            first = int(batch.kv_indptr[b]) * 16
            k = batch.k_cache.reshape(-1, HKV, HEAD_DIM)[first:first + kl].float().repeat_interleave(2, 1)
            v = batch.v_cache.reshape(-1, HKV, HEAD_DIM)[first:first + kl].float().repeat_interleave(2, 1)
            logits = torch.einsum("qhd,khd->hqk", batch.q[q_at:q_at + ql].float(), k) / math.sqrt(HEAD_DIM)
            q_pos = torch.arange(kl - ql, kl).view(-1, 1)
            kv_pos = torch.arange(kl).view(1, -1)
            keep = (kv_pos <= q_pos) & ((q_pos - kv_pos < window) if window > 0 else True)
            logits = logits.masked_fill(~keep, -math.inf)
            combined = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, ql, 1)], dim=-1)
            probs = torch.softmax(combined, dim=-1)[..., :-1]
            want_out.append(torch.einsum("hqk,khd->qhd", probs, v))
            want_lse.append((torch.logsumexp(combined, dim=-1) / math.log(2.0)).t())
            q_at += ql
        torch.testing.assert_close(out, torch.cat(want_out), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, torch.cat(want_lse), atol=1e-5, rtol=1e-5)


def test_learned_sink_lse_merges_with_more_keys():
    """The LSE includes the sink: merging the output over keys [0, c) with the output over
    [c, kv) (plain attention, no sink) gives the sink attention over [0, kv). This is what a
    chunked-context or cascade merge does with run(..., return_lse=True)."""
    spec = shipped("attention_sink_learned")
    batch = unshuffled_batch([4], [40], 8, seed=1)
    sinks = torch.tensor([1.0, -0.5, 3.0, 0.25])
    full, full_lse = dense_attention(batch, [torch.ones(4, 40, dtype=torch.bool)], [sinks.view(-1, 1)])
    first = torch.zeros(4, 40, dtype=torch.bool)
    first[:, :24] = True
    a, a_lse = dense_attention(batch, [first], [sinks.view(-1, 1)])  # the sink goes with one part only
    b, b_lse = dense_attention(batch, [~first])
    m = torch.maximum(a_lse, b_lse)
    wa, wb = torch.exp2(a_lse - m), torch.exp2(b_lse - m)
    merged = (a * wa.unsqueeze(-1) + b * wb.unsqueeze(-1)) / (wa + wb).unsqueeze(-1)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m + torch.log2(wa + wb), full_lse, atol=1e-5, rtol=1e-5)
    grid = RequestGrid(0, 4, 40, 0, 0, HQ, HKV, torch.device("cpu"))
    assert torch.equal(sink_for_request(spec, grid, {"sinks": sinks}), sinks.view(-1, 1))


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("window", [-1, 11, 1])
@pytest.mark.parametrize("skip_tiles", [False, True], ids=["planner_off", "planner_on"])
def test_learned_sink_prefill_through_the_kernels(backend, window, skip_tiles):
    """Every row adds its head's sink once, whatever launch (dense, window, custom) it lands in;
    rows whose keys are all outside the window give 0 and lse = the sink."""
    spec = shipped("attention_sink_learned")
    batch = batch_of([37, 1, 20, 0, 64, 5], [37, 90, 61, 9, 200, 5], 16, seed=window + 5)
    args = {"sinks": torch.tensor([0.5, -2.0, 6.0, -40.0]), "window": window}
    w, fake = prefill_check(spec, batch, args, skip_tiles=skip_tiles, backend=backend,
                            label=f"sink {backend} w{window}")
    if skip_tiles and window == 11:
        assert {c.mask_mode for c in fake.run_calls} >= {"causal"}  # the window runs as a causal launch


def test_learned_sink_ragged_and_decode():
    spec = shipped("attention_sink_learned")
    sinks = torch.tensor([1.5, -1.0, 0.0, 8.0, -3.0, 2.0, 0.5, -0.25])
    ragged_check(spec, ragged_batch([7, 1, 30], [7, 40, 30], seed=2), {"sinks": sinks[:HQ], "window": 5},
                 label="ragged sinks")
    batch = decode_batch([1, 3, 16, 17, 90, 130], 16, seed=4)
    for window in (-1, 4):
        args = {"sinks": sinks, "window": window}
        for tensor_cores in (False, True):
            decode_check(spec, batch, args, tensor_cores=tensor_cores, label=f"decode sinks w{window}")


def test_learned_sink_on_the_flex_route():
    """The flex route applies the sink from Flex's LSE (o *= sigmoid(lse - s), lse = logaddexp(lse, s)):
    the reference's output and LSE, with v_scale applied after it, for sinks large, small and -inf
    (no sink) and windows down to one key; torch's compiled CPU kernel (no LSE) is refused by name."""
    from variantgen.core.errors import LaunchError
    from variantgen.wrappers.flex_wrapper import make_flex_wrapper

    spec = shipped("attention_sink_learned")
    batch = random_paged_batch([9, 1, 30, 0, 5], [9, 40, 77, 3, 5], num_qo_heads=HQ, num_kv_heads=HKV,
                               head_dim=32, page_size=4, dtype=torch.float32, seed=2)
    ws = torch.empty(0, dtype=torch.uint8)
    w = variantgen.make_wrapper(spec, ws, head_dim_qk=32, q_dtype="fp32", kv_dtype="fp32", backend="flex")
    for sinks in (torch.tensor([0.5, -3.0, 25.0, -math.inf]), torch.full((HQ,), -math.inf)):
        for window in (-1, 11, 1):
            args = {"sinks": sinks, "window": window}
            w.plan(*batch.plan_args(), **args)
            out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), v_scale=0.5, return_lse=True, **args)
            ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                               batch.kv_indptr, batch.kv_indices, batch.last_page_len, args,
                                               v_scale=0.5, return_lse=True)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
            assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
            fin = torch.isfinite(ref_lse)
            torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    compiled = make_flex_wrapper(spec, ws, head_dim_qk=32, q_dtype="fp32", kv_dtype="fp32", compile=True)
    compiled.plan(*batch.plan_args(), sinks=sinks, window=-1)
    with pytest.raises(LaunchError, match="spec `attention_sink_learned` has a sink, which the flex route applies "
                                          "from the LSE: torch's compiled CPU FlexAttention returns no LSE"):
        compiled.run(batch.q, (batch.k_cache, batch.v_cache), sinks=sinks, window=-1)


# ----------------------------------------------------------------------------- tree verification


def tree_case(sizes, shapes, contexts, page_size=16, seed=0):
    """A verification batch: request i holds contexts[i] cached keys and a draft tree of
    sizes[i] nodes (shapes[i]); (batch, args, parents)."""
    g = torch.Generator().manual_seed(seed)
    parents = [random_tree_parents(n, g, s) for n, s in zip(sizes, shapes)]
    batch = unshuffled_batch(list(sizes), [c + n for c, n in zip(contexts, sizes)], page_size, seed=seed)
    return batch, {"tree_bits": tree_bits(parents)}, parents


def ancestor_masks(batch, parents) -> list[torch.Tensor]:
    """Each node sees the context, itself and its ancestors (walked up its parent links)."""
    masks = []
    for n, k, par in zip(batch.qo_lens, batch.kv_lens, parents):
        m = torch.zeros(n, k, dtype=torch.bool)
        m[:, :k - n] = True
        for i in range(n):
            node = i
            while node >= 0:
                m[i, k - n + node] = True
                node = par[node]
        masks.append(m)
    return masks


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("seed", range(3))
def test_random_trees_through_the_kernels(backend, seed):
    """Chains, stars, random parents and forests of 1 to 64 nodes after short and long contexts:
    the planned kernels agree with the reference, and the reference with the ancestor walk."""
    spec = shipped("tree_verify")
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 64, 2] + [int(torch.randint(1, 65, (1,), generator=g)) for _ in range(3)]
    shapes = ["chain", "random", "star", "forest", "random", "chain"]
    contexts = [0, 300, 17] + [int(torch.randint(0, 200, (1,), generator=g)) for _ in range(3)]
    for page_size in (1, 16):
        batch, args, parents = tree_case(sizes, shapes, contexts, page_size, seed)
        for skip_tiles in (False, True):
            prefill_check(spec, batch, args, skip_tiles=skip_tiles, backend=backend,
                          label=f"tree {backend} ps{page_size} {skip_tiles=}")
        want, _ = dense_attention(batch, ancestor_masks(batch, parents))
        ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                                  batch.kv_indices, batch.last_page_len, args)
        torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)


def test_a_chain_is_causal_attention():
    """A tree with one path verifies like a causal prefill of the drafts: same output as `causal`."""
    batch, args, _ = tree_case([16, 5, 64], ["chain"] * 3, [8192 - 16, 3, 40], seed=7)
    prefill_check(shipped("tree_verify"), batch, args, skip_tiles=True, label="chain")
    causal = reference_attention(shipped("causal"), batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                 batch.kv_indptr, batch.kv_indices, batch.last_page_len, {})
    tree = reference_attention(shipped("tree_verify"), batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                               batch.kv_indptr, batch.kv_indices, batch.last_page_len, args)
    torch.testing.assert_close(tree, causal, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_tree_verify_plans_the_context_dense(backend):
    """The planner reads no tensor for a tree (plan() needs none) and sees each node's context as
    dense: fa2 runs each request's tree as one causal launch request over [0, node] whose mask is
    evaluated only on its diagonal tile (the draft block); fa3, whose causal launch has no mask,
    as custom launch requests over the same keys."""
    spec = shipped("tree_verify")
    batch, args, _ = tree_case([16, 16, 3], ["random", "star", "chain"], [1000, 2000, 40], seed=2)
    w, fake = prefill_check(spec, batch, {**args}, skip_tiles=True, backend=backend, label="tree plan")
    segments = w.plan_stats["segments"]
    if backend == "fa2":
        assert (segments["tail"], segments["custom"], segments["custom_rows"]) == (3, 0, 0)
        assert [(la.mask_mode, la.tail, la.num_requests) for la in w._launches] == [("causal", True, 3)]
        assert not w._launches[0].exact  # (its diagonal tile evaluates the mask)
        assert {r.cls.label for r in w.last_plan.launch_requests} == {"tail"}
        assert w.last_plan.work()["masked"] == 16 * 17 // 2 * 2 + 3 * 4 // 2  # the draft blocks' diagonals only
    else:  # custom, the mask skipped on the context (visible to every node)
        assert (segments["tail"], segments["custom"], segments["custom_rows"]) == (0, 3, 35)
        assert [r.visible for r in w.last_plan.launch_requests] == [(0, 999), (0, 1999), (0, 39)]
        assert w.last_plan.work()["masked"] == 16 * 16 * 2 + 3 * 3  # the draft blocks only
    for call in fake.run_calls:
        for meta in call.meta:
            assert meta[2] == 0  # each launch request reads from the first key: the context is visible


def test_fa2_tail_launch_runs_the_masked_variant():
    """fa2's tail launch runs causal with the spec's mask on its diagonal tiles, under a run()
    code of its own: the exact causal code's kernel units have no spec mask (only the kernel
    window), so there each draft node would see every earlier draft of its block - a wrong output."""
    spec = shipped("tree_verify")
    batch, args, _ = tree_case([16, 16, 3], ["random", "star", "chain"], [10, 6, 4], seed=2)  # short contexts
    w, fake = prefill_check(spec, batch, dict(args), skip_tiles=True, label="tree plan")
    (tail,) = w._launches
    assert tail.tail and not tail.exact and [c.code for c in fake.run_calls] == [FA2_TAIL_RUN_CODE]
    tail.tail = False  # as if run() passed it the exact causal code
    bad = w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    assert fake.run_calls[-1].code == int(MaskMode.CAUSAL)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    assert (bad.float() - ref.float()).abs().max().item() > 0.2


def run_with_meta_changed(monkeypatch, w, spec, batch, args, change):
    """Plan again with ``change(meta)`` applied to every launch's vg_meta as plan() lays it out,
    run, and return (that output, the reference): what a wrong vg_meta column does to the output."""
    from variantgen.planning import planner as planner_mod
    real = planner_mod.Planner._launches

    def changed(self, *a):
        launches, layouts = real(self, *a)
        for la in launches:
            change(la.meta)
        return launches, layouts

    monkeypatch.setattr(planner_mod.Planner, "_launches", changed)
    w.plan(*batch.plan_args(), skip_tiles=True, **args)
    bad = w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    return bad, ref


def known_visible_cases():
    """(spec, batch, args) with custom launch requests that have known-visible keys: trees on fa3
    (the context) and Gemma 4's image rows (their window, clamped to the image block)."""
    batch, args, _ = tree_case([8, 5], ["star", "random"], [30, 50], seed=4)
    yield "fa3", shipped("tree_verify"), batch, args
    batch = unshuffled_batch([120, 90], [200, 90], 16, seed=1)
    ranges = torch.cat([variantgen.spans_to_ranges([200], [200], [[(30, 149)]])[80:200],
                        variantgen.spans_to_ranges([90], [90], [[(0, 40), (60, 89)]])])
    yield "fa2", shipped("gemma4_sliding"), batch, {"ranges": ranges, "window": 48}


@pytest.mark.parametrize("case", range(2), ids=["tree_fa3", "gemma4_fa2"])
def test_a_wrong_known_visible_range_shows_as_a_wrong_output(case, monkeypatch):
    """The fakes honour a custom launch request's known-visible keys as the kernels do (no mask
    there): widening the planner's range by a few keys on each side must break the output, so
    every wrapper test checks the ranges the planner derives."""
    backend, spec, batch, args = list(known_visible_cases())[case]
    w, _ = make_wrapper_for(spec, backend=backend)
    w.plan(*batch.plan_args(), skip_tiles=True, **args)
    assert any(r.visible[1] >= r.visible[0] for r in w.last_plan.launch_requests)
    good = w.run(batch.q, (batch.k_cache, batch.v_cache), **args).clone()

    def widened(meta):
        known = meta[:, MetaColumn.VIS_HI] >= meta[:, MetaColumn.VIS_LO]
        meta[:, MetaColumn.VIS_LO] -= 3 * known.int()
        meta[:, MetaColumn.VIS_HI] += 3 * known.int()

    bad, ref = run_with_meta_changed(monkeypatch, w, spec, batch, args, widened)
    torch.testing.assert_close(good.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert (bad.float() - ref.float()).abs().max() > 0.05


@pytest.mark.parametrize("spec_name,args", [("sliding_window", {"window": 37}), ("mm_prefix", None)])
def test_an_exact_fa2_run_skips_the_mask_but_not_its_window(spec_name, args, monkeypatch):
    """fa2's causal and dense launch requests whose mode and kernel window are their whole mask
    carry every key as known visible (plan_abi.VIS_EVERY_KEY), so the variant evaluates only the
    kernel window there, which FlashInfer's fa2 kernel leaves to it. The output stays the
    reference's; and a launch request that loses its window in vg_meta shows as a wrong output
    (the fake applies the window only through the variant, as the kernel does)."""
    from variantgen.abi.table import VIS_EVERY_KEY
    spec = shipped(spec_name)
    batch = unshuffled_batch([150, 1, 300], [400, 90, 300], 16, seed=3)
    args = args if args is not None else random_spec_args(spec, batch, seed=3)
    w, fake = prefill_check(spec, batch, args, skip_tiles=True, backend="fa2", label=f"{spec_name} exact")
    exact = [meta for call in fake.run_calls if call.mask_mode != "custom" for meta in call.meta]
    assert exact and all(m[MetaColumn.VIS_LO:MetaColumn.VIS_HI + 1] == [0, VIS_EVERY_KEY] for m in exact)
    assert all(r.visible == (0, -1) for r in w.last_plan.launch_requests if r.mode.name != "CUSTOM")
    assert all(bool((la.meta[:, MetaColumn.VIS_HI] == VIS_EVERY_KEY).all()) == la.exact for la in w.last_plan.launches)
    # the benchmarks' A/B (testing.mask_exact_launches): the exact causal launches on the units with
    # the spec's mask compiled in, every key still known visible, give the same output
    kv = (batch.k_cache, batch.v_cache)
    good = w.run(batch.q, kv, **args)
    calls = len(fake.run_calls)
    exact_causal = sum(la.exact and la.mode == MaskMode.CAUSAL for la in w._launches)
    assert exact_causal and mask_exact_launches(w.last_plan) == exact_causal
    assert torch.equal(w.run(batch.q, kv, **args), good)
    assert FA2_TAIL_RUN_CODE in [c.code for c in fake.run_calls[calls:]]
    if spec_name != "sliding_window":
        return
    assert any(m[MetaColumn.KERNEL_WINDOW] == 37 for m in exact)

    def windowless(meta):
        meta[:, MetaColumn.KERNEL_WINDOW] = -1

    bad, ref = run_with_meta_changed(monkeypatch, w, spec, batch, args, windowless)
    assert (bad.float() - ref.float()).abs().max() > 0.05


def test_tree_rows_that_span_query_tiles_run_custom():
    """fa2 evaluates the mask from a query tile's diagonal on: a tree whose packed rows (nodes x
    GQA group) exceed one tile must not run in the tail launch (the first tile would skip the
    mask on the later nodes' draft keys). 64 nodes x group 8 = 512 rows: custom; 16 x 8 = 128: tail.
    (The fake kernel masks only from each tile's diagonal, as the kernel: a wrong launch would
    show as a wrong output here.)"""
    spec = shipped("tree_verify")
    g = torch.Generator().manual_seed(3)
    parents = [random_tree_parents(64, g, "random"), random_tree_parents(16, g, "random")]
    args = {"tree_bits": tree_bits(parents)}
    batch = random_paged_batch([64, 16], [64 + 300, 16 + 50], num_qo_heads=16, num_kv_heads=2, head_dim=HEAD_DIM,
                               page_size=16, seed=3)
    w, fake = make_wrapper_for(spec)
    w.plan(*batch.plan_args(), skip_tiles=True, **args)
    assert [(la.mask_mode, la.tail, la.num_requests) for la in w._launches] == [("custom", False, 1),
                                                                              ("causal", True, 1)]
    assert w.plan_stats["segments"]["custom_rows"] == 64
    out = w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert [c.mask_mode for c in fake.run_calls] == ["custom", "causal"]


def test_tree_verify_graph_replays():
    """CUDA-graph mode: capture once, then verify batches of different trees and sizes."""
    w, fake = graph_make("tree_verify")
    engine = Engine(w)
    cases = [([16, 8], ["random", "star"], [40, 100]), ([1, 2, 3, 64], ["chain", "chain", "forest", "random"],
                                                       [30, 0, 5, 200]), ([33], ["random"], [20])]
    calls = None
    for i, (sizes, shapes, contexts) in enumerate(cases):
        batch, args, _ = tree_case(sizes, shapes, contexts, 16, seed=i)
        static = engine.load(batch, args)
        w.plan(*batch.plan_args(), **static)
        calls = capture_or_replay(w, fake, engine, static, calls)
        check_replayed(w.spec, engine, batch, args, f"tree graph batch {i}")


def test_single_node_tree_decodes_like_causal():
    """A one-node tree (qo_len 1: the root after the context) is decode: DecodeWrapper on both paths."""
    spec = shipped("tree_verify")
    batch = decode_batch([1, 5, 16, 17, 130], 16, seed=1)
    args = {"tree_bits": tree_bits([[-1]] * 5)}
    for tensor_cores in (False, True):
        decode_check(spec, batch, args, tensor_cores=tensor_cores, label="tree decode")


# ----------------------------------------------------------------------------- Gemma 4 sliding layers


def gemma4_mask_transformers(token_types: torch.Tensor, window: int, q_start: int, kv_len: int) -> torch.Tensor:
    """Gemma 4's sliding-layer mask for queries q_start .. kv_len - 1 over keys 0 .. kv_len - 1,
    from transformers' own functions (create_masks_for_vision_model composes them so)."""
    mu = pytest.importorskip("transformers.masking_utils")
    gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    ids = gemma4.get_block_sequence_ids_for_mask(token_types.view(1, -1), torch.device("cpu"))
    fn = mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids)),
                      mu.sliding_window_overlay(window))
    q = torch.arange(q_start, kv_len).view(-1, 1)
    kv = torch.arange(kv_len).view(1, -1)
    return fn(torch.tensor(0), torch.tensor(0), q, kv).expand(kv_len - q_start, kv_len)


def gemma4_mask_loops(token_types: list[int], window: int, q_start: int, kv_len: int) -> torch.Tensor:
    """The same definition written out: in the window, and causal or in the query's image block."""
    block, current, prev = [], -1, False
    for t in token_types:
        vision = t in (1, 2)
        current += vision and not prev
        block.append(current if vision else -1)
        prev = vision
    m = torch.zeros(kv_len - q_start, kv_len, dtype=torch.bool)
    for q in range(q_start, kv_len):
        for k in range(kv_len):
            same = block[q] >= 0 and block[q] == block[k]
            m[q - q_start, k] = k > q - window and (k <= q or same)
    return m


def image_layout(length: int, images: list[tuple[int, int]]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """mm_token_type_ids (1 = image) of a request with image tokens at [start, end] spans."""
    types = torch.zeros(length, dtype=torch.int64)
    for s, e in images:
        types[s:e + 1] = 1
    return types, images


GEMMA_LAYOUTS = [
    (64, [(3, 20), (21, 21), (40, 63)], 8),  # adjacent images merge into one block (no text between)
    (100, [(10, 59)], 16),  # a block longer than the window: its early keys leave later rows' window
    (30, [], 4),
    (50, [(0, 0), (2, 49)], 100),  # window larger than the request
]


@pytest.mark.parametrize("length, images, window", GEMMA_LAYOUTS)
def test_gemma4_spec_is_transformers_sliding_mask(length, images, window):
    """Every chunking of the request (chunks starting inside image blocks among them) gives the
    rows transformers' mask gives, and the hand-written definition agrees with both."""
    spec = shipped("gemma4_sliding")
    types, spans = image_layout(length, images)
    blocks = []  # transformers merges adjacent image spans into one block: the spec's spans follow
    for s, e in sorted(spans):
        if blocks and s == blocks[-1][1] + 1:
            blocks[-1] = (blocks[-1][0], e)
        else:
            blocks.append((s, e))
    for q_start in sorted({0, length - 1, length // 3, *(s + 1 for s, _ in blocks if s + 1 < length)}):
        for kv_len in sorted({length, q_start + 1, min(length, q_start + 7)}):
            if kv_len <= q_start:
                continue
            ranges = variantgen.spans_to_ranges([kv_len - q_start], [kv_len],
                                                [[(s, min(e, kv_len - 1)) for s, e in blocks if s < kv_len]])
            # a block's end beyond the keys written so far is given as is (its later tokens are not in the KV)
            ranges = torch.where(ranges >= 0, _block_end(ranges, blocks), ranges)
            grid = RequestGrid(0, kv_len - q_start, kv_len, 0, 0, 1, 1, torch.device("cpu"))
            got = mask_for_request(spec, grid, {"ranges": ranges, "window": window})[0]
            want = gemma4_mask_loops(types.tolist()[:kv_len], window, q_start, kv_len)
            assert torch.equal(got, want), (q_start, kv_len)
            hf = gemma4_mask_transformers(types[:kv_len], window, q_start, kv_len)
            assert torch.equal(hf, want), (q_start, kv_len)


def _block_end(ranges: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """ranges with each span's end set to its whole block's end (the engine knows the image's size)."""
    out = ranges.clone()
    for s, e in blocks:
        out[:, 1] = torch.where(ranges[:, 0] == s, torch.full_like(ranges[:, 1], e), out[:, 1])
    return out


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gemma4_chunked_prefill_through_the_kernels(backend, page_size):
    """Chunked prefill where chunks start inside an image block: each chunk's queries see the
    block's keys that are in the KV (its later ones included) and earlier keys within the window,
    through the planned kernels; the output is attention under transformers' mask."""
    spec = shipped("gemma4_sliding")
    layouts = [(200, [(30, 149)]), (90, [(0, 40), (60, 89)]), (70, []), (300, [(10, 250)])]
    chunks = [(120, 200), (50, 90), (0, 70), (100, 160)]  # (first query position, keys in the KV)
    window = 48
    qo_lens = [kv - q0 for q0, kv in chunks]
    kv_lens = [kv for _, kv in chunks]
    batch = unshuffled_batch(qo_lens, kv_lens, page_size, seed=page_size)
    # each query's block as the whole request's spans give it: the last chunk's block runs past its keys
    ranges = torch.cat([variantgen.spans_to_ranges([length], [length], [images])[q0:kv]
                        for (q0, kv), (length, images) in zip(chunks, layouts)])
    args = {"ranges": ranges, "window": window}
    for skip_tiles in (False, True):
        prefill_check(spec, batch, args, skip_tiles=skip_tiles, backend=backend,
                      label=f"gemma4 {backend} ps{page_size} {skip_tiles=}")
    masks = [gemma4_mask_loops(image_layout(length, images)[0].tolist()[:kv], window, q0, kv)
             for (q0, kv), (length, images) in zip(chunks, layouts)]
    want, _ = dense_attention(batch, masks)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)


def test_gemma4_head_dims():
    """Head dim 256 (the sliding layers) compiles for fa2 and fa3, prefill and decode; 512 (the
    global layers' head dim) is refused with the supported list, as the probe says."""
    spec = shipped("gemma4_sliding")
    for backend, kind in (("fa2", "prefill"), ("fa3", "prefill"), ("fa2", "decode"), ("fa2", "ragged")):
        request = Request.of(spec, kind=kind, head_dim_qk=256, q_dtype="bf16", kv_dtype="bf16", backend=backend)
        assert TABLE[backend].problems(request, Site(arch="9.0a")) == []
        ModuleConfig(spec, 256, 256, "bf16", "bf16", "bf16", "9.0a", backend, kind=kind)  # renders
    probe_mod.cache_clear()
    for backend in ("fa2", "fa3"):
        result = variantgen.probe(spec, head_dim_qk=512, q_dtype="bf16", kv_dtype="bf16", backend=backend,
                                  arch="9.0a", runtime=False)
        assert not result and f"head_dim_qk=512, head_dim_vo=512: {backend} prefill modules support head dims " \
                               "64, 128, 256" in result.reason, result.reason


def test_shipped_masks_get_meaningful_random_arguments():
    """random_spec_args draws real trees for tree_verify and spans for gemma4_sliding."""
    spec = shipped("tree_verify")
    batch = batch_of([5, 64, 1], [40, 64, 9], 16)
    bits = random_spec_args(spec, batch, seed=1)["tree_bits"]
    assert bits.shape == (70, 2) and bool((bits[:, 0] & 1)[[0, 5, 69]].all())  # every root sees itself
    for i in range(70):  # each node's own bit is set
        node = i if i < 5 else i - 5 if i < 69 else 0
        assert (int(bits[i, node // 32]) >> (node % 32)) & 1, i
    ranges = random_spec_args(shipped("gemma4_sliding"), batch, seed=1)["ranges"]
    assert ranges.shape == (70, 2) and bool(((ranges[:, 0] <= ranges[:, 1])).all())


def test_bench_masks_modules_are_valid_precompile_commands(capsys):
    """bench/bench_masks.py --list-modules prints commands that expand (dry run) to real modules."""
    import sys

    from click.testing import CliRunner

    from variantgen.tools.cli import main as cli_main

    sys.path.insert(0, str(SPECS_DIR.parent / "bench"))
    import bench_masks

    assert bench_masks.main(["--list-modules"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 9  # MODULES: 2 + 1 sinks, 2 no-sink windows, 2 trees, 2 gemma4
    for line in lines:
        res = CliRunner().invoke(cli_main, line.split()[3:] + ["--dry-run"])
        assert res.exit_code == 0, (line, res.output)
        assert any(u.startswith("vg_") for u in res.output.splitlines()), res.output


@pytest.mark.parametrize("value", ["0", "-5", "12x", ""])
def test_bench_masks_rejects_bad_sink_windows_before_needing_a_gpu(value, capsys):
    """--sink-windows is checked on any machine, with the argument named in the error."""
    import sys

    sys.path.insert(0, str(SPECS_DIR.parent / "bench"))
    import bench_masks

    with pytest.raises(SystemExit) as exc:
        bench_masks.main(["--cases", "sinks", "--sink-windows", value])
    assert exc.value.code == 2
    assert "--sink-windows" in capsys.readouterr().err
