"""The run-time checks of what reaches a kernel (variantgen/checks.py) on the GPU, where the
page list's bounds come over from the device: folded into plan()'s copy of device indptrs,
or through page-locked memory with the planner's read-back (indptrs on the host), or on the
host. Also: CUDA-graph capture remembers the cache the graph reads, and check_plan's captured
comparison. The CPU tests (tests/test_run_checks_cpu.py) cover the messages on every path.
Run on the H200 with `pytest -m gpu tests/test_gpu_checks.py`.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from _gpu import SPECS, mm_prefix_case, rel_error

import variantgen
from variantgen.errors import LaunchError
from variantgen.graph import GraphCapacity
from variantgen.reference import reference_attention
from variantgen.testing import random_paged_batch, random_spec_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HQ, HKV, HD, PAGE = 32, 8, 128, 16
# Where an engine keeps plan()'s index tensors: all on the host, all on the GPU, or the page
# list on the GPU with host indptrs (vLLM's FlashInfer backend).
PLACEMENTS = ["host", "device", "device_page_list"]


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


def placed(b, placement: str) -> tuple[torch.Tensor, ...]:
    """(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) of ``b`` placed so;
    the page list with two garbage entries past the batch (a caller's longer buffer)."""
    kv = torch.cat([b.kv_indices, torch.tensor([-9, 1 << 30], dtype=torch.int32, device=b.kv_indices.device)])
    if placement == "host":
        return b.qo_indptr.cpu(), b.kv_indptr.cpu(), kv.cpu(), b.last_page_len.cpu()
    if placement == "device":
        return b.qo_indptr, b.kv_indptr, kv, b.last_page_len
    return b.qo_indptr.cpu(), b.kv_indptr.cpu(), kv, b.last_page_len.cpu()


def not_a_page(where: str, at: int, value: int, pages: int, cache: str = "the KV cache run() was given") -> str:
    return exact(f"{where}: paged_kv_indices[{at}]={value} is not a page of {cache} ({pages} pages: expected "
                 f"0 <= page < {pages})")


def negative(at: int, value: int) -> str:
    return exact(f"plan(): paged_kv_indices[{at}]={value} is not a page number (expected 0 <= page < the KV "
                 "cache's page count)")


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("skip_tiles", [True, False], ids=["planner", "direct"])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_prefill_page_numbers(workspace, placement, skip_tiles, backend):
    spec, w, b, args = mm_prefix_case(workspace, seed=3, backend=backend)
    qo, kvp, kv, last = placed(b, placement)
    pages = b.k_cache.shape[0]

    def plan(page_list):
        w.plan(qo, kvp, page_list, last, HQ, HKV, PAGE, skip_tiles=skip_tiles, **(args if skip_tiles else {}))

    plan(kv)
    if skip_tiles:
        assert w.plan_stats["row_planner"] == "kernel"
    out = w.run(b.q, (b.k_cache, b.v_cache), **args)
    ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                              b.last_page_len, args)
    assert rel_error(out, ref) < 1e-2
    at = int(b.kv_indptr[1]) + 3
    bad = kv.clone()
    bad[at] = pages
    plan(bad)
    with pytest.raises(LaunchError, match=not_a_page("run()", at, pages, pages)):
        w.run(b.q, (b.k_cache, b.v_cache), **args)
    bad[at] = -5
    with pytest.raises(LaunchError, match=negative(at, -5)):
        plan(bad)
    # the launches read plan()'s copy of the page list
    kv = kv.clone()
    plan(kv)
    kv.fill_(1 << 28)
    torch.cuda.synchronize()
    assert rel_error(w.run(b.q, (b.k_cache, b.v_cache), **args), ref) < 1e-2


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("tensor_cores, skip_tiles", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["cuda_cores", "cuda_cores-trimmed", "tensor_cores", "tensor_cores-planner"])
def test_decode_page_numbers(workspace, placement, tensor_cores, skip_tiles):
    spec = variantgen.load_spec(SPECS / "sliding_window.yaml")
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                use_tensor_cores=tensor_cores)
    kv_lens = [300, 17, 1000, 1]
    b = random_paged_batch([1] * 4, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE,
                           dtype=torch.bfloat16, device="cuda", seed=4)
    args = {"window": 100}
    _, kvp, kv, last = placed(b, placement)
    pages = b.k_cache.shape[0]

    def plan(page_list):
        w.plan(kvp, page_list, last, HQ, HKV, PAGE, skip_tiles=skip_tiles, **(args if skip_tiles else {}))

    plan(kv)
    out = w.run(b.q, (b.k_cache, b.v_cache), **args)
    ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), torch.arange(5, dtype=torch.int32, device="cuda"),
                              b.kv_indptr, b.kv_indices, b.last_page_len, args)
    assert rel_error(out, ref) < 1e-2
    at = int(b.kv_indptr[3]) - 1  # the third request's last page: inside its window, read when trimmed too
    bad = kv.clone()
    bad[at] = pages + 7
    plan(bad)
    with pytest.raises(LaunchError, match=not_a_page("run()", at, pages + 7, pages)):
        w.run(b.q, (b.k_cache, b.v_cache), **args)
    bad[at] = -1
    with pytest.raises(LaunchError, match=negative(at, -1)):
        plan(bad)


def test_host_page_lists_add_no_sync_to_plan(workspace):
    """Index tensors on the host: plan() (direct prefill, CUDA-core decode) returns while the GPU
    is still busy - the page check is a host min/max."""
    spec, w, b, args = mm_prefix_case(workspace, seed=5)
    host = placed(b, "host")
    dec = variantgen.make_wrapper(SPECS / "causal.yaml", workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16",
                                  kind="decode")
    d = random_paged_batch([1] * 8, [700] * 8, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE,
                           dtype=torch.bfloat16, device="cuda", seed=5)
    dec_plan = (d.kv_indptr.cpu(), d.kv_indices.cpu(), d.last_page_len.cpu(), HQ, HKV, PAGE)
    for plan in (lambda: w.plan(*host, HQ, HKV, PAGE, skip_tiles=False), lambda: dec.plan(*dec_plan)):
        plan()  # warm: allocations, staging buffers
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
        t0 = time.perf_counter()
        plan()
        took = time.perf_counter() - t0
        torch.cuda.synchronize()
        assert took < 0.2, f"plan() took {took:.3f} s behind a busy GPU: it waited for the device"
    w.run(b.q, (b.k_cache, b.v_cache), **args)
    dec.run(d.q, (d.k_cache, d.v_cache))


def test_graph_plan_checks_pages_against_the_captured_cache(workspace):
    spec = variantgen.load_spec(SPECS / "mm_prefix.yaml")
    cap = GraphCapacity(max_batch_size=4, max_total_q=1024, max_kv_pages=256)
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", graph=cap)
    b = random_paged_batch([300, 40], [700, 40], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE,
                           dtype=torch.bfloat16, device="cuda", seed=6)
    args = random_spec_args(spec, b, seed=6)
    ranges = torch.full((cap.max_total_q, 2), -1, dtype=torch.int32, device="cuda")
    ranges[:340] = args["ranges"]
    q = torch.zeros(cap.max_total_q, HQ, HD, dtype=torch.bfloat16, device="cuda")
    q[:340] = b.q
    out = torch.empty_like(q)
    k = torch.zeros(cap.max_kv_pages, PAGE, HKV, HD, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    k[:b.k_cache.shape[0]], v[:b.v_cache.shape[0]] = b.k_cache, b.v_cache
    bad = b.kv_indices.clone()
    bad[2] = cap.max_kv_pages
    w.plan(b.qo_indptr, b.kv_indptr, bad, b.last_page_len, HQ, HKV, PAGE, ranges=ranges)  # no capture yet
    w.plan(*b.plan_args(), ranges=ranges)
    w.run(q, (k, v), out=out, ranges=ranges)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, (k, v), out=out, ranges=ranges)
    with pytest.raises(LaunchError, match=not_a_page("plan()", 2, cap.max_kv_pages, cap.max_kv_pages,
                                                     "the KV cache the CUDA graph was captured with")):
        w.plan(b.qo_indptr, b.kv_indptr, bad, b.last_page_len, HQ, HKV, PAGE, ranges=ranges)
    w.plan(*b.plan_args(), ranges=ranges)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                              b.last_page_len, args)
    assert rel_error(out[:340], ref) < 1e-2


def test_check_plan_catches_a_tensor_changed_between_replays(workspace):
    """The measured failure (max abs error 2.5 on the H200 after rewriting `ranges` between graph
    replays) is reported by the next plan() in debug mode; eager runs are refused on the spot."""
    spec = variantgen.load_spec(SPECS / "mm_prefix.yaml")
    cap = GraphCapacity(max_batch_size=4, max_total_q=1024, max_kv_pages=256)
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", graph=cap,
                                check_plan=True)
    b = random_paged_batch([300, 40], [700, 40], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE,
                           dtype=torch.bfloat16, device="cuda", seed=7)
    args = random_spec_args(spec, b, seed=7)
    ranges = torch.full((cap.max_total_q, 2), -1, dtype=torch.int32, device="cuda")
    ranges[:340] = args["ranges"]
    q = torch.zeros(cap.max_total_q, HQ, HD, dtype=torch.bfloat16, device="cuda")
    q[:340] = b.q
    out = torch.empty_like(q)
    k = torch.zeros(cap.max_kv_pages, PAGE, HKV, HD, dtype=torch.bfloat16, device="cuda")
    k[:b.k_cache.shape[0]] = b.k_cache
    w.plan(*b.plan_args(), ranges=ranges)
    w.run(q, (k, k), out=out, ranges=ranges)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, (k, k), out=out, ranges=ranges)
    graph.replay()
    w.plan(*b.plan_args(), ranges=ranges)  # unchanged: nothing to report
    graph.replay()
    ranges[:300, 0] = 0  # every query of the first request now sees [0, its span end]
    graph.replay()
    with pytest.raises(LaunchError, match=r"^plan\(\): `ranges` changed after the previous plan\(\) read it, and a "
                                          r"replay of the captured run\(\) ran with the new values"):
        w.plan(*b.plan_args(), ranges=ranges)
    w.plan(*b.plan_args(), ranges=ranges)
    graph.replay()
    ranges[5, 1] += 1
    with pytest.raises(LaunchError, match=r"^run\(\): `ranges` changed since plan\(\) read it"):
        w.run(q, (k, k), out=out, ranges=ranges)
