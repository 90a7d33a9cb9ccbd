"""Wrong outputs found on the GPU, kept as regression tests. Run: pytest -m gpu tests/gpu/test_gpu_regressions.py

Each case is compared with the dense float32 reference, on two planned paths (the planner
module's plan_batch, and the reference row rules' segments laid out by the same launch
builder), and where FlashInfer has the same mask with FlashInfer's own kernel on the same
batch.

fa2 with a kernel window (issue 14): the planner's causal launch requests of a small window
carry it in vg_meta, and FlashInfer's fa2 kernel sizes a request's split-KV partial rows
from that window (min(kv_len, window_left + CTA_TILE_Q)) while its scheduler, planned with
window -1, sized them from kv_len: the merge read the wrong rows (221 of 711 rows wrong) or
rows with no keys (NaN everywhere). Such launches are now never split.

fa3 output store (bench/fuzz_gpu.py, 2026-12-04): FlashInfer's sm90 epilogue arrives at its
epilogue barrier and then syncs on it with the same threads, so the copy of the output tile to
global memory could start while a late warp was still writing its rows to shared memory: a
few rows of one head came out stale, once in a few hundred runs of the same inputs (the case
below: 1 of 40 runs in one wrapper, 9 of 4948 interleaved with other cases). The fa3 kernel
units now take variantgen's store (templates/fa3/epilogue_barrier.cuh); the test runs the case
many times and wants every run equal to the first, and the first equal to the reference.
"""

from __future__ import annotations

import pytest
import torch
from _fake_kernel import FakeRowPlanner
from _gpu import SPECS, rel_error

import variantgen
from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WINDOW_SOFTCAP_ALIBI = """
name: window_softcap_alibi
tensors:
  slopes: {dtype: float32, shape: [num_qo_heads]}
scalars:
  window: {dtype: int, default: 0}
  soft_cap: {dtype: float, default: 5.0}
mask: kv_pos <= q_pos and q_pos - kv_pos <= window
logits: soft_cap * tanh((logits + slopes[qo_head] * float(kv_pos - q_pos)) / soft_cap)
"""


def run_both_paths(spec, batch, args, head_dim, dtype, workspace, backend="fa2"):
    """(outputs of the planner-module path, of the reference rules' path, plan_stats of the first)."""
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=head_dim, q_dtype=dtype, kv_dtype=dtype,
                                backend=backend)
    outs = []
    stats = None
    for native in (True, False):
        if not native:
            w.set_row_planner(FakeRowPlanner(spec, builder=w.row_planner))
        w.plan(*batch.plan_args(), **args)
        outs.append(w.run(batch.q, (batch.k_cache, batch.v_cache), **args))
        if native:
            stats = dict(w.plan_stats)
    return outs, stats


def reference(spec, batch, args):
    return reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                               batch.kv_indices, batch.last_page_len, args)


def flashinfer_causal_window(batch, window_left, workspace, head_dim, backend):
    import flashinfer

    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.last_page_len, batch.num_qo_heads,
           batch.num_kv_heads, head_dim, batch.page_size, causal=True, window_left=window_left,
           q_data_type=batch.q.dtype, kv_data_type=batch.k_cache.dtype)
    return w.run(batch.q, (batch.k_cache, batch.v_cache))


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("ranges", ["none", "random"])
def test_mm_prefix_small_causal_window_page_1_chunked(workspace, backend, ranges):
    spec = variantgen.load_spec(SPECS / "mm_prefix.yaml")
    qo_lens, kv_lens = [662, 49], [746, 67]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=16, num_kv_heads=1, head_dim=128, page_size=1,
                               dtype=torch.bfloat16, device="cuda", seed=14)
    total_q = sum(qo_lens)
    r = torch.full((total_q, 2), -1, dtype=torch.int32, device="cuda")
    if ranges == "random":  # spans far in the past of each query (inside its window they would add nothing)
        g = torch.Generator().manual_seed(141)
        starts = torch.randint(0, 40, (total_q,), generator=g, dtype=torch.int32)
        keep = torch.rand(total_q, generator=g) < 0.3
        r[keep.cuda(), 0] = starts[keep].cuda()
        r[keep.cuda(), 1] = (starts[keep] + 3).cuda()
    args = {"ranges": r, "causal_window_left": 5, "range_window_left": -1}
    (native, python), stats = run_both_paths(spec, batch, args, 128, "bf16", workspace, backend)
    ref = reference(spec, batch, args)
    for name, out in (("planner module", native), ("reference rules", python)):
        bad = ((out.float() - ref).abs().amax(dim=(1, 2)) > 0.05).sum().item()
        assert bad == 0 and rel_error(out, ref) < 1e-2, f"{backend} {name}: {bad} of {total_q} rows wrong"
    if ranges == "none":
        if backend == "fa2":
            assert stats["launches"] == [("causal", 2)]
        fi = flashinfer_causal_window(batch, 5, workspace, 128, backend)
        assert rel_error(fi, ref) < 1e-2, "FlashInfer's own causal window_left=5 kernel"


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_window_0_softcap_alibi_hd256_fp16(workspace, backend):
    spec = variantgen.parse_spec(WINDOW_SOFTCAP_ALIBI)
    batch = random_paged_batch([245], [441], num_qo_heads=32, num_kv_heads=4, head_dim=256, page_size=16,
                               dtype=torch.float16, device="cuda", seed=15)
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / 32) for h in range(32)], dtype=torch.float32, device="cuda")
    args = {"slopes": slopes, "window": 0, "soft_cap": 5.0}
    (native, python), stats = run_both_paths(spec, batch, args, 256, "fp16", workspace, backend)
    ref = reference(spec, batch, args)
    for name, out in (("planner module", native), ("reference rules", python)):
        assert torch.isfinite(out).all(), f"{backend} {name}: NaN/inf in the output"
        assert rel_error(out, ref) < 1e-2, f"{backend} {name}"
    if backend == "fa2":
        assert stats["launches"] == [("causal", 1)]


def test_fa3_output_rows_are_never_read_back_stale(workspace):
    """The fuzzer's case (qo [73, 1, 292, 139], 64/4 heads, page size 5, planner off: one
    custom launch, 7 query tiles on 132 x 64 CTAs), run 400 times on the same inputs."""
    from variantgen.testing.fuzz_cases import TARGET_BY_NAME, Batch, FuzzCase, ModuleKey, Ranges
    from variantgen.testing.fuzz_run import CacheModules, assert_case_passes
    from variantgen.testing.fuzz_tensors import make_tensors

    case = FuzzCase(
        target="fa3/prefill", module=ModuleKey("mm_prefix"),
        batch=Batch(qo_lens=(73, 1, 292, 139), kv_lens=(74, 1, 292, 142), tensors=(
            ("ranges", Ranges(spans=(((0, 29),), (), ((139, 207),), ((0, 99),)),
                              rows=((), (), ((152, 167, 87, 109), (256, 291, 0, 291), (142, 145, 54, 51)), ()))),),
            seed=913080162),
        num_qo_heads=64, num_kv_heads=4, page_size=5, plan="off",
        scalars=(("causal_window_left", -1), ("range_window_left", -1)), disable_split_kv=False,
        return_lse=False, scales=(None, 2.0, 3.0), graph=None)
    assert_case_passes(case, workspace)
    modules = CacheModules(workspace, build=True)
    w = modules.wrapper(TARGET_BY_NAME[case.target], case.module)
    t = make_tensors(case, case.batch, workspace.device)
    w.plan(t.qo_indptr, t.kv_indptr, t.kv_indices, t.last_page_len, 64, 4, 5, skip_tiles=False)
    first = w.run(t.q, (t.k, t.v), q_scale=None, k_scale=2.0, v_scale=3.0, **t.args).clone()
    differ = []
    for i in range(400):
        out = w.run(t.q, (t.k, t.v), q_scale=None, k_scale=2.0, v_scale=3.0, **t.args)
        rows = (out != first).flatten(1).any(dim=1)
        if bool(rows.any()):
            differ.append((i, rows.nonzero().flatten().tolist()[:16]))
    assert not differ, f"{len(differ)} of 400 runs differ from the first (run, rows): {differ[:5]}"
