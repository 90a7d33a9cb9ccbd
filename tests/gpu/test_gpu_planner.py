"""The interval planner's generated row kernel (variantgen/planning/rowplan.py) on the GPU: it must
give exactly what the reference rules (rowrules.classify_rows, rowrules.segments) give, row
for row and segment for segment, for every shipped spec with intervals; plan() must use it,
and its launches must be the ones the launch builder lays out from the reference's segments.
Run: pytest -m gpu tests/gpu/test_gpu_planner.py"""

from __future__ import annotations

import pytest
import torch
from _fake_kernel import FakeRowPlanner
from _gpu import ALL_SPECS, KV_LENS, QO_LENS, SPECS

import variantgen
from variantgen.abi.table import RecField
from variantgen.build.builder import default_cache
from variantgen.core.errors import JitDisabledError
from variantgen.planning.intervals import analyze
from variantgen.planning.rowplan import load_planner, plan_rows, read_segments
from variantgen.planning.rowrules import classify_rows, segments
from variantgen.testing.harness import random_paged_batch, random_spec_args, spans_to_ranges

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DATA = SPECS.parent / "tests" / "data"
PLANNED = [s for s in ALL_SPECS if analyze(variantgen.load_spec(SPECS / f"{s}.yaml")).planner_ready]
# (qo_lens, kv_lens, page size): the GPU tests' batch, chunked prefill with single-token and
# empty requests, and one long request over page-1 KV.
BATCHES = [
    (QO_LENS, KV_LENS, 16),
    ([1, 0, 64, 1, 200, 3], [1, 50, 4096, 9, 200, 3000], 16),
    ([2048], [2048], 1),
]


def load_spec(name: str) -> variantgen.VariantSpec:
    for path in (SPECS / f"{name}.yaml", DATA / f"{name}.yaml", SPECS.parent / "bench" / "masks" / f"{name}.yaml"):
        if path.exists():
            return variantgen.load_spec(path)
    raise FileNotFoundError(name)


def compare(spec, args, qo_lens, kv_lens, page_size, label):
    module, why = load_planner(spec, "9.0a", default_cache())
    if module is None and analyze(spec).planner_ready:  # not precompiled (JIT off): a skip where the run says so
        raise JitDisabledError(why)
    assert module is not None, why
    qo_indptr = [0]
    for n in qo_lens:
        qo_indptr.append(qo_indptr[-1] + n)
    form = analyze(spec)
    dev = torch.device("cuda")
    rows = plan_rows(module, spec, form, args, qo_indptr, kv_lens, page_size, dev)
    got = rows.rec
    want = classify_rows(spec, form, qo_indptr, kv_lens, page_size, args, dev)
    assert got.shape == want.shape == (len(RecField), qo_indptr[-1])
    for i, field in enumerate(RecField):
        diff = (got[i] != want[i]).nonzero().flatten()
        assert diff.numel() == 0, (f"{label}: {field} differs in {diff.numel()} rows, first {diff[:5].tolist()}: "
                                   f"kernel {got[i][diff[:5]].tolist()} torch {want[i][diff[:5]].tolist()}")
    if qo_indptr[-1]:
        # the kernel's compacted launch requests, with room for all and with room for one
        # (then read back again at full size)
        want_segments = segments(want, page_size).tolist()
        assert read_segments(module, rows).tolist() == want_segments, f"{label}: compacted launch requests differ"
        small = plan_rows(module, spec, form, args, qo_indptr, kv_lens, page_size, dev, segment_capacity=1)
        assert read_segments(module, small).tolist() == want_segments, f"{label}: re-read launch requests differ"


def batch_args(spec, qo_lens, kv_lens, page_size, seed):
    b = random_paged_batch(qo_lens, kv_lens, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size,
                           dtype=torch.bfloat16, device="cuda", seed=seed)
    return random_spec_args(spec, b, seed=seed)


# (global_window, fixed_sparse: a key set beside exact terms; a global token's row, whose exact
# terms cover its hull, is exact - the rule the kernel and the torch rules must share; the
# bidirectional masks: bands, the causal and window classes with their diagonal past q_pos)
@pytest.mark.parametrize("spec_name", PLANNED + ["strictly_causal", "global_window", "fixed_sparse",
                                                 "bidirectional_window", "sinks_bidirectional"])
def test_row_kernel_matches_the_torch_rules(spec_name):
    spec = load_spec(spec_name)
    for i, (qo, kv, ps) in enumerate(BATCHES):
        for seed in range(2):
            compare(spec, batch_args(spec, qo, kv, ps, seed), qo, kv, ps, f"{spec_name} batch {i} seed {seed}")


def test_row_kernel_adversarial_mm_prefix_and_documents():
    """Spans at the first/last key, crossing pages, both windows; unsorted document ids."""
    mm = load_spec("mm_prefix")
    qo, kv = [700, 1, 300], [700, 900, 1300]
    spans = [[(0, 0), (15, 17), (650, 699)], [(0, 899)], [(1000, 1299)]]
    ranges = spans_to_ranges(qo, kv, spans).cuda()
    for cw, rw in ((-1, -1), (100, 5), (3, 0), (0, 1)):
        args = {"ranges": ranges, "causal_window_left": cw, "range_window_left": rw}
        compare(mm, args, qo, kv, 16, f"mm_prefix windows {cw}/{rw}")
    doc = load_spec("document")
    qo, kv = [300, 50], [1000, 50]
    ids = torch.cat([torch.randint(0, 4, (1000,)), torch.sort(torch.randint(0, 3, (50,))).values]).int().cuda()
    compare(doc, {"doc_ids": ids}, qo, kv, 16, "document, request 0 unsorted")


def launches_of(w) -> list:
    return [(la.mask_mode, la.window_left, la.num_requests, la.meta.tolist(), la.kv_indptr.tolist(),
             la.kv_indices[:la.kv_indptr[-1]].tolist()) for la in w._launches]


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_plan_uses_the_row_kernel_and_the_builder_lays_out_its_segments(backend, workspace):
    """plan()'s launches (the row kernel, then the builder, in one call) == the launches the same
    module's builder lays out from the reference rules' segments (the CPU tests' stand-in)."""
    spec = load_spec("mm_prefix")
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend=backend)
    module = w.row_planner
    assert module is not None, w.planner.row_planner_reason
    b = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                           dtype=torch.bfloat16, device="cuda", seed=3)
    args = random_spec_args(spec, b, seed=3)
    plan = w.plan(*b.plan_args(), **args)
    assert plan.planner == "module" and w.plan_stats["row_planner"] == "kernel"
    launches, requests = launches_of(w), plan.launch_requests
    w.set_row_planner(FakeRowPlanner(spec, builder=module))
    reference = w.plan(*b.plan_args(), **args)
    assert launches == launches_of(w) and requests == reference.launch_requests


@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (4, 1)])
def test_schedule_matches_flashinfers_scheduler(heads, workspace):
    """The planner module's work list (split-KV off) == FlashInfer's PrefillPlan's, field by field."""
    spec = load_spec("causal")
    planner, why = load_planner(spec, "9.0a", default_cache())
    assert planner is not None, why
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="fa2")
    int_ws = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    fi_pinned = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
    ours_pinned = torch.zeros(8 << 20, dtype=torch.uint8)
    for lens in ([700, 0, 1, 300], [3] * 40, [1, 2, 5, 9], [8192] * 8, [0, 5000, 0]):
        qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        kv_pages = torch.tensor([0, *torch.tensor([-(-(x + 7) // 16) for x in lens]).cumsum(0).tolist()],
                                dtype=torch.int32)
        n = len(lens)
        fi = list(w.module.plan(workspace[:32 << 20], int_ws, fi_pinned, qo, kv_pages, int(qo[-1]), n, heads[0],
                                heads[1], 16, False, -1, -1, True))
        torch.cuda.synchronize()
        fi_ints = int_ws.cpu().view(torch.int32)
        ours = list(planner.schedule(ours_pinned, 0, qo, qo, heads[0], heads[1], 128, 128, 2, 0))
        ours.pop()
        ours_ints = ours_pinned.view(torch.int32)
        label = f"heads {heads} lens {lens[:6]}"
        same = (ours[0], ours[1], ours[3], ours[13], ours[14]) == (fi[0], fi[1], fi[3], fi[13], fi[14])
        assert same, (label, ours, fi)
        tiles = fi[0]
        for field, count in ((4, tiles), (5, tiles), (6, tiles), (8, n + 1)):
            a = ours_ints[ours[field] // 4:ours[field] // 4 + count]
            b = fi_ints[fi[field] // 4:fi[field] // 4 + count]
            assert torch.equal(a, b), f"{label}: plan_info field {field} arrays differ"


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_plan_batch_retries_give_the_same_plan(backend, workspace):
    """plan_batch's less common paths - a second read-back copy (more launch requests than the
    first copy takes), a retry with room for them all, a schedule workspace grown mid-plan -
    give the same launches and the same output as a plan with room to spare."""
    spec = load_spec("mm_prefix")
    b = random_paged_batch([700, 64, 1, 300], [900, 64, 40, 1300], num_qo_heads=32, num_kv_heads=8, head_dim=128,
                           page_size=16, dtype=torch.bfloat16, device="cuda", seed=4)
    spans = [[(10, 90), (300, 420), (600, 650)], [(0, 20)], [], [(100, 400), (1000, 1290)]]
    args = {"ranges": spans_to_ranges([700, 64, 1, 300], [900, 64, 40, 1300], spans).cuda()}

    def planned(setup):
        w = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16",
                                    backend=backend)
        assert w.row_planner is not None, w.planner.row_planner_reason
        setup(w.planner)
        w.plan(*b.plan_args(), **args)
        return w, launches_of(w), w.run(b.q, (b.k_cache, b.v_cache), **args)

    _, want_launches, want = planned(lambda p: None)
    assert sum(la[2] for la in want_launches) > 4, want_launches
    setups = {"second copy": lambda p: setattr(p, "segment_read", 1),
              "room for one": lambda p: setattr(p, "segment_capacity", 1),
              "tiny workspace": lambda p: setattr(p, "workspace_bytes", 256)}
    for label, setup in setups.items():
        w, launches, out = planned(setup)
        assert w.plan_stats["row_planner"] == "kernel", label
        assert launches == want_launches, label
        assert torch.equal(out, want), label
    assert w.planner._workspace_pair()[0].numel() > 256
