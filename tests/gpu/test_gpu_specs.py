"""GPU correctness: every shipped spec against its derived reference, and mm_prefix
against FlashInfer's own hand-written kernel. Run on the H200 with `pytest -m gpu`.

Modules are looked up in (or built into) VARIANTGEN_CACHE_DIR; precompile them with
`variantgen precompile` to keep device time for the tests themselves.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import ALL_SPECS, assert_graph_replays, check, mm_prefix_case, rel_error

from variantgen.testing.harness import mask_exact_launches, spans_to_ranges
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_spec_vs_reference(spec_name, workspace):
    check(spec_name, workspace)


@pytest.mark.parametrize("spec_name", ["mm_prefix", "softcap", "document"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_wide_matrix(spec_name, head_dim, dtype, page_size, workspace):
    check(spec_name, workspace, head_dim=head_dim, dtype=dtype, heads=(8, 8), page_size=page_size, seed=3)


def test_scales_and_lse(workspace):
    spec, w, b, args = mm_prefix_case(workspace, seed=5)
    w.plan(*b.plan_args(), skip_tiles=False)
    out, lse = w.run(b.q, (b.k_cache, b.v_cache), q_scale=0.5, k_scale=1.5, v_scale=0.25, return_lse=True, **args)
    ref, ref_lse = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                       b.last_page_len, args, q_scale=0.5, k_scale=1.5, v_scale=0.25,
                                       return_lse=True)
    assert rel_error(out, ref) < 1e-2
    assert torch.allclose(lse, ref_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("causal_window_left,range_window_left", [(-1, -1), (100, -1), (-1, 50), (64, 200)])
def test_mm_prefix_matches_flashinfer(causal_window_left, range_window_left, workspace):
    import flashinfer

    _, w, b, _ = mm_prefix_case(workspace, seed=11)
    spans = [[(0, 10)], [(100, 700), (750, 811)], [(0, 699)], [(500, 999)], [(0, 63), (100, 400)]]
    ranges = spans_to_ranges(b.qo_lens, b.kv_lens, spans).cuda()
    windows = dict(causal_window_left=causal_window_left, range_window_left=range_window_left)
    w.plan(*b.plan_args(), skip_tiles=False)
    ours = w.run(b.q, (b.k_cache, b.v_cache), ranges=ranges, **windows)
    fw = flashinfer.BatchPrefillWithCausalBidirectionalRangesWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16, head_dim_qk=128, head_dim_vo=128)
    fw.plan(*b.plan_args()[:6], 128, 16)
    theirs = fw.run(b.q, (b.k_cache, b.v_cache), ranges, **windows)
    diff = (ours.float() - theirs.float()).abs().max().item()
    assert diff <= 1e-3, f"max abs diff vs FlashInfer's mm-prefix wrapper: {diff}"


# ------------------------------------------------------------------ interval planner


@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_spec_planned_vs_reference(spec_name, workspace):
    check(spec_name, workspace, skip_tiles=True, seed=1)


def test_fa2_exact_units_match_the_masked_units(workspace):
    """fa2's exact launches run kernel units compiled without the spec's mask (only the kernel
    window); the same launches under the tail launch's run() code - the masked variant, with
    every key known visible - must give the same output, and both the reference's."""
    spec, w, b, args = mm_prefix_case(workspace, seed=6)
    w.plan(*b.plan_args(), skip_tiles=True, **args)
    kv = (b.k_cache, b.v_cache)
    out = w.run(b.q, kv, **args)
    assert mask_exact_launches(w.last_plan), w.last_plan
    masked = w.run(b.q, kv, **args)
    assert torch.equal(out, masked)
    ref = reference_attention(spec, b.q, kv, b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, args)
    assert rel_error(out, ref) < 1e-2


ADVERSARIAL = {
    # name: (qo_lens, kv_lens, spans per request)
    "span_at_first_and_last_token": ([64, 64], [64, 200], [[(0, 0), (63, 63)], [(199, 199), (136, 150)]]),
    "span_crossing_chunks": ([700], [700], [[(100, 650)]]),
    "boundary_inside_page": ([50], [90], [[(43, 77)]]),
    "empty_spans_and_qo_len_1": ([1, 1, 5], [1, 300, 5], [[], [(10, 299)], []]),
    "chunked_prefill_kv_much_longer": ([17, 130], [4000, 3000], [[(3990, 3999)], [(0, 2999)]]),
    "no_spans": ([200, 33], [260, 33], [[], []]),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
@pytest.mark.parametrize("windows", [(-1, -1), (5, -1), (-1, 7), (3, 20)])
def test_mm_prefix_planner_adversarial(case, windows, workspace):
    qo, kv, spans = ADVERSARIAL[case]
    args = {"ranges": spans_to_ranges(qo, kv, spans).cuda(), "causal_window_left": windows[0],
            "range_window_left": windows[1]}
    check("mm_prefix", workspace, skip_tiles=True, qo_lens=qo, kv_lens=kv, args=args)
    check("mm_prefix", workspace, skip_tiles=False, qo_lens=qo, kv_lens=kv, args=args)


@pytest.mark.parametrize("window", [3, 15, 16, 100])
def test_sliding_window_planner_small_windows(window, workspace):
    spec_args = {"window": window}
    check("sliding_window", workspace, skip_tiles=True, args=spec_args)


def test_fp8_kv_cache(workspace):
    """bf16 queries over an fp8 (e4m3) KV cache: the kernel and the reference read the same values."""
    spec, w, b, args = mm_prefix_case(workspace, seed=6, kv_dtype="fp8_e4m3")
    for skip_tiles in (False, True):
        w.plan(*b.plan_args(), skip_tiles=skip_tiles, **(args if skip_tiles else {}))
        out = w.run(b.q, (b.k_cache, b.v_cache), k_scale=0.5, v_scale=2.0, **args)
        ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                  b.last_page_len, args, k_scale=0.5, v_scale=2.0)
        assert rel_error(out, ref) < 1e-2


def test_planner_on_by_default_and_cuda_graph_replay(workspace):
    """plan() with the spans turns the planner on; a captured run() replays to the same output."""
    _, w, b, args = mm_prefix_case(workspace, seed=8)
    w.plan(*b.plan_args(), ranges=args["ranges"])
    assert "planner_off" not in w.plan_stats and len(w.plan_stats["launches"]) >= 1
    out = torch.empty_like(b.q)
    assert_graph_replays(lambda: w.run(b.q, (b.k_cache, b.v_cache), out=out, **args), out)
