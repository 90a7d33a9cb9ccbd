"""GPU correctness of rows that see several key intervals (variantgen/planning/pieces.py): their launch
requests per interval, merged by LSE, against the derived reference and against the same batch
planned with the pieces off (one custom launch over each row's hull), on fa2 and fa3 paged
prefill. Run on the GPU machine with `pytest -m gpu tests/gpu/test_gpu_pieces.py`.

The masks: StreamingLLM's sinks + window (the shipped streaming_sink), a bidirectional prefix +
window, packed documents + global sinks (a sorted-id term and an interval), and sinks + a middle
block + window (three intervals); chunked prefill, a decode-like row, GQA 32/8, page sizes 1, 5
and 16. Modules: the first run builds them (or precompile on a build box: fa2 and fa3, hd 128,
bf16, for streaming_sink and the three specs below).
"""

from __future__ import annotations

import pytest
import torch
from _gpu import SPECS, rel_error

import variantgen
from variantgen.abi.table import MAX_PIECES
from variantgen.lang.spec import parse_spec
from variantgen.planning.pieces import INLINE_KEYS
from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HQ, HKV, HD = 32, 8, 128
QO_LENS = [700, 1, 300, 64]
KV_LENS = [1500, 900, 300, 2000]


def _spec(name: str, mask: str, scalars: dict[str, int], tensors: str = "") -> variantgen.VariantSpec:
    lines = "".join(f"  {k}:\n    dtype: int\n    default: {v}\n    min: 0\n" for k, v in scalars.items())
    return parse_spec(f"name: {name}\ndescription: test mask\n{tensors}scalars:\n{lines}mask: {mask}\n")


def specs() -> dict[str, variantgen.VariantSpec]:
    return {
        "streaming_sink": variantgen.load_spec(SPECS / "streaming_sink.yaml"),
        "prefix_window": _spec("vg_test_prefix_window",
                               "kv_pos < prefix or (kv_pos <= q_pos and q_pos - kv_pos <= window)",
                               {"prefix": 100, "window": 127}),
        "document_sinks": _spec("vg_test_document_sinks",
                                "kv_pos <= q_pos and (doc_ids[kv_row] == doc_ids[q_kv_row] or kv_pos < num_global)",
                                {"num_global": 4}, "tensors:\n  doc_ids:\n    dtype: int32\n    shape: [total_kv]\n"),
        "three": _spec("vg_test_three", "kv_pos <= q_pos and (kv_pos < sink or (kv_pos >= at and kv_pos < at + 64) "
                                        "or q_pos - kv_pos <= window)", {"sink": 4, "at": 400, "window": 100}),
    }


def spec_args(name: str, spec, kv_lens: list[int], seed: int) -> dict:
    args = {s.name: s.default for s in spec.scalars}
    if name == "streaming_sink":
        args.update(num_sink=4, window=255)
    if name == "document_sinks":  # sorted ids, documents of 1-600 keys
        g = torch.Generator().manual_seed(seed)
        ids = []
        for k in kv_lens:
            row, doc = [], 0
            while len(row) < k:
                row += [doc] * int(torch.randint(1, 600, (1,), generator=g))
                doc += 1
            ids += row[:k]
        args["doc_ids"] = torch.tensor(ids, dtype=torch.int32, device="cuda")
    return args


@pytest.fixture(scope="module")
def wrappers(workspace):
    made = {}

    def get(name, backend):
        if (name, backend) not in made:
            made[name, backend] = variantgen.make_wrapper(specs()[name], workspace, head_dim_qk=HD, q_dtype="bf16",
                                                          kv_dtype="bf16", backend=backend)
        return made[name, backend]

    return get


def split_as(w, how: str) -> None:
    """Set the planner's mechanism for rows of several intervals: "pieces" (the default: every
    piece launched, merged by LSE), "inline" (a short first piece computed by the merge) or "gaps"."""
    w.planner.split_rows = "gaps" if how == "gaps" else "pieces"
    w.planner.inline_keys = INLINE_KEYS if how == "inline" else 0


@pytest.mark.parametrize("how", ["pieces", "inline", "gaps"])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", ["streaming_sink", "prefix_window", "document_sinks", "three"])
def test_rows_of_several_intervals_match_the_reference_and_the_hull(wrappers, name, page_size, backend, how):
    """Pieces merged by LSE (every piece launched, or the merge computing a short first piece),
    and custom launch requests whose page lists skip the gaps (planning/gaps.py: the variant's
    key_pos maps list keys to positions), against the reference and the hull."""
    spec = specs()[name]
    w = wrappers(name, backend)
    batch = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=page_size,
                               dtype=torch.bfloat16, device="cuda", seed=page_size)
    args = spec_args(name, spec, KV_LENS, page_size)
    kv = (batch.k_cache, batch.v_cache)
    ref, ref_lse = reference_attention(spec, batch.q, kv, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                                       batch.last_page_len, args, return_lse=True)
    label = f"{name} {backend} page {page_size} {how}"
    try:
        split_as(w, how)
        plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        if how == "gaps":
            assert plan.merge is None and any(r.gaps for r in plan.launch_requests), f"{label}: no gaps\n{plan}"
        else:
            assert plan.merge is not None and plan.merge.rows.numel() > 0, f"{label}: no row ran as pieces\n{plan}"
        out, lse = w.run(batch.q, kv, return_lse=True, **args)
        assert rel_error(out, ref) < 1e-2, f"{label}: rel. error {rel_error(out, ref):.3e}\n{plan}"
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin), f"{label}: lse -inf pattern"
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-2, label
        w.planner.max_pieces = 0  # the same batch over each row's hull
        hull = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        assert hull.merge is None
        out_hull = w.run(batch.q, kv, **args)
        assert rel_error(out, out_hull.float()) < 1e-2, label
        assert plan.work()["visited"] < hull.work()["visited"], f"{label}: no fewer keys read than the hull's"
    finally:
        w.planner.max_pieces = MAX_PIECES
        split_as(w, "pieces")


@pytest.mark.parametrize("split_rows", ["pieces", "inline", "gaps"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["streaming_sink", "prefix_window", "document_sinks", "three"])
def test_pieces_with_fa3_gqa_packing_match_the_reference(wrappers, name, page_size, split_rows):
    """Decode-like rows (1-6 queries per request) on fa3: GQA-packed launches, packed partial rows
    merged in the packed layout, then unpacked."""
    spec, w = specs()[name], wrappers(name, "fa3")
    qo_lens, kv_lens = [1, 1, 6, 3], KV_LENS
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=page_size,
                               dtype=torch.bfloat16, device="cuda", seed=page_size)
    args = spec_args(name, spec, kv_lens, page_size)
    try:
        split_as(w, split_rows)
        plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        out, lse = w.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **args)
    finally:
        split_as(w, "pieces")
    assert plan.pack_gqa > 1 and (plan.merge is not None) == (split_rows != "gaps"), plan
    ref, ref_lse = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr,
                                       batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, return_lse=True)
    assert rel_error(out, ref) < 1e-2, f"{name} page {page_size}: rel. error {rel_error(out, ref):.3e}\n{plan}"
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [128, 64, 36])
def test_the_merge_kernel_matches_its_reference(wrappers, dtype, dim):
    """The module's merge_pieces (templates/plan/merge_pieces.cuh) against merge_pieces_reference:
    rows with 1..MAX_PIECES pieces, pieces with no visible key (lse -inf, their partial rows never
    written: NaN here), a row whose every piece is empty, a NaN LSE, an `out` with a row stride
    (a view) and a head dim that is no multiple of 8 (the element-by-element path)."""
    from variantgen.wrappers.merge import merge_pieces_reference

    module = wrappers("streaming_sink", "fa3").module
    g = torch.Generator(device="cuda").manual_seed(dim)
    pieces, rows, heads = MAX_PIECES, 300, 4
    parts = torch.randn(pieces, rows, heads, dim, generator=g, device="cuda").to(dtype)
    parts_lse = torch.randn(pieces, rows, heads, generator=g, device="cuda") * 8
    split = torch.arange(3, rows, 2, device="cuda")
    counts = torch.randint(1, pieces + 1, (split.numel(),), generator=g, device="cuda")
    empty = torch.rand(pieces, rows, heads, generator=g, device="cuda") < 0.2
    parts_lse[empty] = -torch.inf
    parts[empty] = torch.nan  # (an empty piece's partial row: never written)
    parts_lse[:, 5] = -torch.inf  # row 5: every piece empty
    parts_lse[0, 7, 1] = torch.nan  # row 7, head 1: NaN logits
    base = torch.randn(rows, heads, dim + 8, generator=g, device="cuda").to(dtype)
    for lse_wanted in (True, False):
        out, want = base[..., :dim].clone(), base[..., :dim].clone()
        out_view = base.clone()[..., :dim]  # a row stride of dim + 8
        lse = torch.zeros(rows, heads, device="cuda") if lse_wanted else None
        want_lse = torch.zeros(rows, heads, device="cuda") if lse_wanted else None
        merge_pieces_reference(want, want_lse, parts, parts_lse, split, counts)
        for o in (out, out_view):
            lse_o = lse.clone() if lse is not None else None
            module.merge_pieces(o, lse_o, parts, parts_lse, split, counts)
            torch.testing.assert_close(o.float(), want.float(), equal_nan=True, atol=1e-2, rtol=1e-2)
            if lse_o is not None:
                torch.testing.assert_close(lse_o, want_lse, equal_nan=True)
        untouched = torch.ones(rows, dtype=torch.bool, device="cuda")
        untouched[split] = False
        assert torch.equal(out[untouched], base[..., :dim][untouched]), "rows not split are not written"


@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [128, 64, 256, 36])
def test_the_inline_merge_matches_its_reference(wrappers, dtype, dim, hnd):
    """The module's merge_inline (merge_pieces.cuh): a row's short first piece computed from q, k and
    v and merged into its in-place output, against merge_inline_reference - keys across page ends,
    1..16 keys, GQA heads (kv_head_div 4), a base row that saw no key (lse -inf), a NaN base LSE,
    lse_out the same tensor as lse_in, and without lse_out."""
    from variantgen.wrappers.merge import merge_inline_reference

    module = wrappers("streaming_sink", "fa3").module
    g = torch.Generator(device="cuda").manual_seed(dim)
    rows, heads, kv_heads, ps, pages = 200, 8, 2, 5, 40
    q = torch.randn(rows, heads, dim, generator=g, device="cuda").to(dtype)
    shape = (pages, kv_heads, ps, dim) if hnd else (pages, ps, kv_heads, dim)
    k = torch.randn(*shape, generator=g, device="cuda").to(dtype)
    v = torch.randn(*shape, generator=g, device="cuda").to(dtype)
    kv_indices = torch.randperm(pages, generator=g, device="cuda").to(torch.int32)
    split = torch.arange(1, rows, 3, device="cuda")
    m = split.numel()
    keys = torch.randint(1, 17, (m,), generator=g, device="cuda").to(torch.int32)
    slot = torch.randint(0, ps, (m,), generator=g, device="cuda").to(torch.int32)
    entry = torch.randint(0, pages - 5, (m,), generator=g, device="cuda").to(torch.int32)
    base = torch.randn(rows, heads, dim, generator=g, device="cuda").to(dtype)
    base_lse = torch.randn(rows, heads, generator=g, device="cuda") * 4
    base_lse[4, 3] = -torch.inf  # row 4: its in-place piece saw no key
    base_lse[7, 0] = torch.nan
    for with_lse in (True, False):
        out, want = base.clone(), base.clone()
        lse = base_lse.clone() if with_lse else None  # (lse_out = lse_in: updated in place)
        want_lse = base_lse.clone() if with_lse else None
        merge_inline_reference(want, base_lse, want_lse, q, k, v, kv_indices, split, entry, slot, keys, 0.125, 0.5, 4,
                               hnd)
        lse_in = lse if lse is not None else base_lse
        module.merge_inline(out, lse_in, lse, q, k, v, kv_indices, split, entry, slot, keys, 0.125, 0.5, 4, hnd)
        tol = 2e-2 if dtype != torch.float32 else 1e-4
        torch.testing.assert_close(out.float(), want.float(), equal_nan=True, atol=tol, rtol=tol)
        if lse is not None:
            torch.testing.assert_close(lse, want_lse, equal_nan=True, atol=1e-4, rtol=1e-4)
        untouched = torch.ones(rows, dtype=torch.bool, device="cuda")
        untouched[split] = False
        assert torch.equal(out[untouched], base[untouched]), "rows not merged are not written"
