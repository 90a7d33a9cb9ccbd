"""GPU correctness of the sm90 (fa3) variant modules: transforms, the -inf mask route
(direct and planned), windows, fully masked rows, LSE and scales, against the derived
reference and FlashInfer's own mm-prefix kernel. Skipped unless the GPU is sm90."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _gpu import ALL_SPECS, SPECS, check, mm_prefix_case, rel_error

import variantgen
from variantgen.testing.harness import random_paged_batch, spans_to_ranges
from variantgen.wrappers.reference import reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm90 (Hopper) GPU"),
]
# Every shipped spec (one fa3 module each, ~1-2 min of compile on 16 cores).
FA3_SPECS = ALL_SPECS


@pytest.mark.parametrize("skip_tiles", [False, True])
@pytest.mark.parametrize("spec_name", FA3_SPECS)
def test_fa3_spec_vs_reference(spec_name, skip_tiles, workspace):
    check(spec_name, workspace, backend="fa3", skip_tiles=skip_tiles, seed=2)


@pytest.mark.parametrize("head_dim,dtype", [(64, "bf16"), (256, "bf16"), (128, "fp16")])
def test_fa3_head_dims_and_dtypes(head_dim, dtype, workspace):
    check("mm_prefix", workspace, backend="fa3", head_dim=head_dim, dtype=dtype, heads=(8, 8), seed=3,
          skip_tiles=True)


def test_fa3_fully_masked_rows_are_zero(workspace):
    """`kv_pos < q_pos`: the first query of each request sees no key. FA3 has no mask hook,
    so the masked transform returns -inf for every logit of that row: zeros, not NaN."""
    spec = variantgen.load_spec(Path(__file__).resolve().parents[1] / "data" / "strictly_causal.yaml")
    qo, kv = [5, 64, 1], [5, 64, 1]
    for skip_tiles in (False, True):
        check("strictly_causal", workspace, spec=spec, backend="fa3", skip_tiles=skip_tiles, qo_lens=qo,
              kv_lens=kv, args={})
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="fa3")
    b = random_paged_batch(qo, kv, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, device="cuda")
    w.plan(*b.plan_args(), skip_tiles=False)
    out, lse = w.run(b.q, (b.k_cache, b.v_cache), return_lse=True)
    first_rows = torch.tensor([0, 5, 69], device="cuda")
    assert torch.equal(out[first_rows].float(), torch.zeros_like(out[first_rows].float()))
    assert torch.isfinite(out).all()


def test_fa3_scales_and_lse(workspace):
    spec, w, b, args = mm_prefix_case(workspace, seed=5, backend="fa3")
    for skip_tiles in (False, True):
        w.plan(*b.plan_args(), skip_tiles=skip_tiles, **(args if skip_tiles else {}))
        out, lse = w.run(b.q, (b.k_cache, b.v_cache), q_scale=0.5, k_scale=1.5, v_scale=0.25, return_lse=True,
                         **args)
        ref, ref_lse = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr,
                                           b.kv_indices, b.last_page_len, args, q_scale=0.5, k_scale=1.5,
                                           v_scale=0.25, return_lse=True)
        assert rel_error(out, ref) < 1e-2
        assert torch.allclose(lse, ref_lse, atol=2e-2, rtol=1e-3), (lse - ref_lse).abs().max()


@pytest.mark.parametrize("windows", [(-1, -1), (64, 200)])
def test_fa3_mm_prefix_matches_flashinfer(windows, workspace):
    import flashinfer

    _, w, b, _ = mm_prefix_case(workspace, seed=11, backend="fa3")
    spans = [[(0, 10)], [(100, 700), (750, 811)], [(0, 699)], [(500, 999)], [(0, 63), (100, 400)]]
    ranges = spans_to_ranges(b.qo_lens, b.kv_lens, spans).cuda()
    kw = dict(causal_window_left=windows[0], range_window_left=windows[1])
    fw = flashinfer.BatchPrefillWithCausalBidirectionalRangesWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16, head_dim_qk=128, head_dim_vo=128)
    fw.plan(*b.plan_args()[:6], 128, 16)
    theirs = fw.run(b.q, (b.k_cache, b.v_cache), ranges, **kw).float()
    for skip_tiles in (False, True):
        w.plan(*b.plan_args(), skip_tiles=skip_tiles, **(dict(ranges=ranges, **kw) if skip_tiles else {}))
        ours = w.run(b.q, (b.k_cache, b.v_cache), ranges=ranges, **kw).float()
        rel = ((ours - theirs).norm() / theirs.norm()).item()
        assert rel < 1e-2, f"skip_tiles={skip_tiles}: rel. error vs FlashInfer's mm-prefix wrapper {rel:.2e}"


ADVERSARIAL = {
    "span_at_first_and_last_token": ([64, 64], [64, 200], [[(0, 0), (63, 63)], [(199, 199), (136, 150)]]),
    "boundary_inside_page": ([50], [90], [[(43, 77)]]),
    "empty_spans_and_qo_len_1": ([1, 1, 5], [1, 300, 5], [[], [(10, 299)], []]),
    "chunked_prefill_kv_much_longer": ([17, 130], [4000, 3000], [[(3990, 3999)], [(0, 2999)]]),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_fa3_mm_prefix_planner_adversarial(case, workspace):
    qo, kv, spans = ADVERSARIAL[case]
    args = {"ranges": spans_to_ranges(qo, kv, spans).cuda(), "causal_window_left": 5, "range_window_left": 7}
    check("mm_prefix", workspace, backend="fa3", skip_tiles=True, qo_lens=qo, kv_lens=kv, args=args)


@pytest.mark.parametrize("window", [3, 16, 100])
def test_fa3_sliding_window_launches(window, workspace):
    """Window rows go to causal launches with the kernel's own left window (one per width)."""
    check("sliding_window", workspace, backend="fa3", skip_tiles=True, args={"window": window})


def test_fa3_factory_choice_on_sm90(workspace):
    spec = variantgen.load_spec(SPECS / "mm_prefix.yaml")
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16")
    assert w.config.backend == variantgen.choose_backend(
        spec, kind="prefill", head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16",
        arch="9.0a")


@pytest.mark.parametrize("skip_tiles", [False, True])
def test_fa3_work_list_covers_every_tile_once(skip_tiles, workspace):
    """The fa3 plan (one schedule for all heads): every query tile of every launch request is
    one work item, on one SM's list, pointed at the request's own first row; lists balanced."""
    spec, w, b, args = mm_prefix_case(workspace, seed=7, backend="fa3")
    w.plan(*b.plan_args(), skip_tiles=skip_tiles, **(args if skip_tiles else {}))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for la in w._launches:
        info = list(la.plan_info)
        assert info[8] == 1, "expected the all-heads schedule"
        ints = la.int_workspace.cpu().view(torch.int32)
        work_indptr = ints[info[6] // 4:info[6] // 4 + sms + 1].tolist()
        works = work_indptr[-1]
        assert work_indptr[0] == 0 and all(x <= y for x, y in zip(work_indptr, work_indptr[1:]))
        tiles, first_rows, batch = (ints[info[k] // 4:info[k] // 4 + works].tolist() for k in (0, 1, 7))
        meta = la.meta.tolist()
        want = {(r, t) for r, row in enumerate(meta) for t in range(-(-row[8] // 128))}
        assert sorted(zip(batch, tiles)) == sorted(want)
        assert all(first_rows[i] == meta[batch[i]][0] for i in range(works))
        per_sm = [y - x for x, y in zip(work_indptr, work_indptr[1:])]
        assert max(per_sm) - min(per_sm) <= max(4, works // sms), per_sm
