"""The run-time checks of what reaches a kernel (variantgen/wrappers/checks.py) on the GPU, where the
page list's bounds come over from the device: folded into plan()'s copy of device indptrs,
or through page-locked memory with the planner's read-back (indptrs on the host), or on the
host - or, with a device page list, host indptrs and nothing read back, still on their way
in run(), which then clamps the kernels' copy of the list on the GPU (no wait in plan() or
run()) and the next call reports. Also: CUDA-graph capture remembers the cache the graph
reads and records the clamp, and check_plan's captured comparison. The CPU tests
(tests/cpu/test_run_checks_cpu.py) cover the messages on every path.
Run on the H200 with `pytest -m gpu tests/gpu/test_gpu_checks.py`.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
import torch
from _gpu import SPECS, mm_prefix_case, rel_error

import variantgen
from variantgen.abi.table import READ_INDICES_EXTRA
from variantgen.core.errors import LaunchError
from variantgen.planning.graph import GraphCapacity
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HQ, HKV, HD, PAGE = 32, 8, 128, 16
# Where an engine keeps plan()'s index tensors: all on the host, all on the GPU, or the page
# list on the GPU with host indptrs (vLLM's FlashInfer backend).
PLACEMENTS = ["host", "device", "device_page_list"]


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


def graph_case(workspace, seed: int, **make_kwargs):
    """mm_prefix in CUDA-graph mode (capacity: 4 requests, 1024 query rows, 256 pages) and one
    batch of two requests (300 + 40 queries) in static buffers of the capacity: q, out, ranges,
    and a KV cache (k, v) of the capacity's pages whose first pages are the batch's."""
    spec = variantgen.load_spec(SPECS / "mm_prefix.yaml")
    cap = GraphCapacity(max_batch_size=4, max_total_q=1024, max_kv_pages=256)
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", graph=cap,
                                **make_kwargs)
    b = random_paged_batch([300, 40], [700, 40], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE,
                           dtype=torch.bfloat16, device="cuda", seed=seed)
    args = random_spec_args(spec, b, seed=seed)
    ranges = torch.full((cap.max_total_q, 2), -1, dtype=torch.int32, device="cuda")
    ranges[:340] = args["ranges"]
    q = torch.zeros(cap.max_total_q, HQ, HD, dtype=torch.bfloat16, device="cuda")
    q[:340] = b.q
    k = torch.zeros(cap.max_kv_pages, PAGE, HKV, HD, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    k[:b.k_cache.shape[0]], v[:b.v_cache.shape[0]] = b.k_cache, b.v_cache
    return SimpleNamespace(spec=spec, cap=cap, w=w, b=b, args=args, ranges=ranges, q=q, out=torch.empty_like(q),
                           k=k, v=v)


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


def clamped_report(where: str, run: int, plan: int, value: int, pages: int) -> str:
    """The guard's report of the last run() (#run), which read plan() #plan's list clamped."""
    return exact(
        f"{where}: the last run() (#{run} of this wrapper) read a page list with entries outside its KV cache: plan() "
        f"#{plan}'s paged_kv_indices held page {value} (the cache had {pages} pages: expected 0 <= page < {pages}). "
        "That run() ran with the list clamped to the cache on the GPU: it read nothing outside the cache, but its "
        "output is wrong. plan() had left the list's bounds to arrive from the GPU (a page list there with host "
        "indptrs, and nothing else read back); pass the page list on the host to have run() refuse such entries "
        "before the launch")


def in_flight(placement: str, reads_back: bool) -> bool:
    """Whether plan()'s page bounds may still be on their way from the GPU when it returns: a
    device page list with host indptrs, where plan() reads nothing else back."""
    return placement == "device_page_list" and not reads_back


def refused(plan, run, at: int, value: int, pages: int, bounds_in_flight: bool) -> None:
    """A negative entry is refused by plan() - or, where its bounds may still be on their way
    when plan() returns (a race with the GPU), by run() once they have landed (synchronized
    here), before the launch."""
    if not bounds_in_flight:
        with pytest.raises(LaunchError, match=negative(at, value)):
            plan()
        return
    try:
        plan()
    except LaunchError as e:
        assert re.match(negative(at, value), str(e)), str(e)
        return
    torch.cuda.synchronize()
    with pytest.raises(LaunchError, match=not_a_page("run()", at, value, pages)):
        run()


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
    flight = in_flight(placement, reads_back=skip_tiles)  # the planner reads its launch requests back
    if flight:
        torch.cuda.synchronize()  # landed: run() refuses before the launch (test_guard_* for the clamp)
    with pytest.raises(LaunchError, match=not_a_page("run()", at, pages, pages)):
        w.run(b.q, (b.k_cache, b.v_cache), **args)
    bad[at] = -5
    refused(lambda: plan(bad), lambda: w.run(b.q, (b.k_cache, b.v_cache), **args), at, -5, pages, flight)
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
                                backend="fa2", use_tensor_cores=tensor_cores)
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
    # the window's key trimming reads no spec tensor (no read-back); the planner does
    flight = in_flight(placement, reads_back=tensor_cores and skip_tiles)
    if flight:
        torch.cuda.synchronize()  # landed: run() refuses before the launch (test_guard_* for the clamp)
    with pytest.raises(LaunchError, match=not_a_page("run()", at, pages + 7, pages)):
        w.run(b.q, (b.k_cache, b.v_cache), **args)
    bad[at] = -1
    refused(lambda: plan(bad), lambda: w.run(b.q, (b.k_cache, b.v_cache), **args), at, -1, pages, flight)


def test_host_page_lists_add_no_sync_to_plan(workspace):
    """Index tensors on the host: plan() (direct prefill, CUDA-core decode) returns while the GPU
    is still busy - the page check is a host min/max."""
    spec, w, b, args = mm_prefix_case(workspace, seed=5)
    host = placed(b, "host")
    dec = variantgen.make_wrapper(SPECS / "causal.yaml", workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16",
                                  kind="decode", backend="fa2")
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


BUSY_GPU_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second of GPU time queued before plan()


def guarded_wrapper(workspace, kind: str):
    """(wrapper, batch, plan(page list), run(cache), reference(page list)) with the page list on
    the GPU and the indptrs on the host, planned so that plan() reads nothing back."""
    if kind.startswith("decode"):
        spec = variantgen.load_spec(SPECS / "sliding_window.yaml")
        w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                    backend="fa2", use_tensor_cores=kind == "decode-tensor_cores")
        b = random_paged_batch([1] * 4, [300, 17, 1000, 1], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD,
                               page_size=PAGE, dtype=torch.bfloat16, device="cuda", seed=8)
        args = {"window": 100}
        trim = kind == "decode-cuda_cores-trimmed"  # the window's hulls are computed on the host
        kvp, last = b.kv_indptr.cpu(), b.last_page_len.cpu()

        def plan(kv):
            w.plan(kvp, kv, last, HQ, HKV, PAGE, skip_tiles=trim, **(args if trim else {}))

        qo = torch.arange(5, dtype=torch.int32, device="cuda")
    else:
        spec, w, b, args = mm_prefix_case(workspace, seed=8, backend=kind.partition("-")[0])
        qo_h, kvp, last = b.qo_indptr.cpu(), b.kv_indptr.cpu(), b.last_page_len.cpu()

        def plan(kv):
            w.plan(qo_h, kvp, kv, last, HQ, HKV, PAGE, skip_tiles=False)

        qo = b.qo_indptr

    def run(cache=None):
        return w.run(b.q, cache or (b.k_cache, b.v_cache), **args)

    def reference(kv):
        return reference_attention(spec, b.q, (b.k_cache, b.v_cache), qo, b.kv_indptr, kv, b.last_page_len, args)

    return w, b, plan, run, reference


@pytest.mark.parametrize("kind", ["fa2-direct", "fa3-direct", "decode-cuda_cores", "decode-cuda_cores-trimmed",
                                  "decode-tensor_cores"])
def test_guard_plans_without_waiting_and_the_next_call_reports(workspace, kind):
    """vLLM's decode layout (page list on the GPU, indptrs on the host) behind a busy GPU: plan()
    and run() return without waiting for it; run() clamped the kernels' copy of the list on the
    GPU (the output is attention over the clamped list), and the next call raises."""
    w, b, plan, run, reference = guarded_wrapper(workspace, kind)
    pages = b.k_cache.shape[0]
    good = b.kv_indices
    plan(good)  # plan #1 (and the warm-up: allocations, staging buffers)
    assert rel_error(run(), reference(good)) < 1e-2  # run #1
    torch.cuda.synchronize()
    at = int(b.kv_indptr[2]) - 1  # the second request's last page (inside its window)
    bad = good.clone()
    bad[at] = pages + 3
    torch.cuda._sleep(BUSY_GPU_CYCLES)
    t0 = time.perf_counter()
    plan(bad)  # plan #2
    took_plan = time.perf_counter() - t0
    out = run()  # run #2: clamped
    took = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert took_plan < 0.2 and took < 0.2, f"plan() {took_plan:.3f} s, plan()+run() {took:.3f} s behind a busy GPU"
    assert rel_error(out, reference(bad.clamp(0, pages - 1))) < 1e-2
    with pytest.raises(LaunchError, match=clamped_report("plan()", 2, 2, pages + 3, pages)):
        plan(good)
    plan(good)
    assert rel_error(run(), reference(good)) < 1e-2


def test_graph_guard_is_captured(workspace):
    """A captured run() records the clamp against the captured cache: a replay after a plan()
    whose bounds were still on their way reads nothing outside it, and the next plan() raises."""
    c = graph_case(workspace, seed=9)
    spec, cap, w, b, args, ranges, q, out, k, v = c.spec, c.cap, c.w, c.b, c.args, c.ranges, c.q, c.out, c.k, c.v
    host = (b.qo_indptr.cpu(), b.kv_indptr.cpu())
    last = b.last_page_len.cpu()  # (read here: a .cpu() inside plan's call would wait for the busy GPU itself)

    def plan(kv):  # direct: plan() reads nothing back
        w.plan(*host, kv, last, HQ, HKV, PAGE, skip_tiles=False)

    def reference(kv):
        return reference_attention(spec, b.q, (k, v), b.qo_indptr, b.kv_indptr, kv, b.last_page_len, args)

    plan(b.kv_indices)
    w.run(q, (k, v), out=out, ranges=ranges)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, (k, v), out=out, ranges=ranges)
    torch.cuda.synchronize()
    bad = b.kv_indices.clone()
    bad[5] = cap.max_kv_pages + 1000
    torch.cuda._sleep(BUSY_GPU_CYCLES)
    t0 = time.perf_counter()
    plan(bad)  # plan #2: its bounds are behind the busy GPU
    took = time.perf_counter() - t0
    graph.replay()
    torch.cuda.synchronize()
    assert took < 0.2, f"plan() took {took:.3f} s behind a busy GPU: it waited for the device"
    assert rel_error(out[:340], reference(bad.clamp(0, cap.max_kv_pages - 1))) < 1e-2
    pages = cap.max_kv_pages
    with pytest.raises(LaunchError, match=r"^" + re.escape(
            f"plan(): plan() #2's paged_kv_indices held page {pages + 1000}, which is not a page of the KV cache the "
            f"CUDA graph was captured with ({pages} pages: expected 0 <= page < {pages}). Any replay of the captured "
            "run() after that plan() ran with the list clamped to the cache on the GPU")):
        plan(b.kv_indices)
    plan(b.kv_indices)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out[:340], reference(b.kv_indices)) < 1e-2


def test_graph_plan_checks_pages_against_the_captured_cache(workspace):
    c = graph_case(workspace, seed=6)
    spec, cap, w, b, args, ranges, q, out, k, v = c.spec, c.cap, c.w, c.b, c.args, c.ranges, c.q, c.out, c.k, c.v
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
    c = graph_case(workspace, seed=7, check_plan=True)
    w, b, ranges, q, out, k = c.w, c.b, c.ranges, c.q, c.out, c.k  # (k for both caches: only the checks matter)
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


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_read_indices_matches_torch(workspace, kind):
    """plan()'s read-back of device index tensors (the module's read_indices: one kernel, one
    copy) against torch on random lists: the parts back to back, and the (min, max) of exactly
    the first kv_indptr[-1] entries of the page list - garbage past them (a longer buffer),
    negative entries, page lists of one entry to a million, non-contiguous indptrs."""
    w = variantgen.make_wrapper(SPECS / "causal.yaml", workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16",
                                kind=kind, backend="fa2")
    gen = torch.Generator(device="cpu").manual_seed(7)
    for trial in range(60):
        batch = int(torch.randint(1, 300, (1,), generator=gen))
        entries = int(torch.randint(1, [16, 5000, 1 << 20][trial % 3], (1,), generator=gen))
        cuts = torch.sort(torch.randint(0, entries + 1, (batch - 1,), generator=gen)).values
        kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([entries])]).to(torch.int32)
        low, high = (-5, 50) if trial % 4 == 0 else (0, 1 << 30)
        kv = torch.randint(low, high, (entries + int(torch.randint(0, 9, (1,), generator=gen)),), generator=gen,
                           dtype=torch.int32)
        kv[entries:] = -(1 << 31) if trial % 2 else (1 << 31) - 1  # past the batch: never read
        last = torch.randint(1, PAGE + 1, (batch,), generator=gen, dtype=torch.int32)
        qo = torch.arange(batch + 1, dtype=torch.int32)
        parts = [kv_indptr, last] if kind == "decode" else [qo, kv_indptr, last]
        dev = [t.cuda() for t in parts]
        if trial % 5 == 0:  # a strided view of a longer tensor
            dev[-1] = torch.stack([dev[-1], dev[-1]], 1).reshape(-1)[::2]
            assert not dev[-1].is_contiguous()
        lists, flat, folded = w._read_indptrs(kv.cuda(), dev[0] if kind == "decode" else dev[1], *dev)
        assert lists == [t.tolist() for t in parts], trial
        assert flat.tolist() == torch.cat(parts).tolist() and flat.device.type == "cpu", trial
        assert folded == [int(kv[:entries].min()), int(kv[:entries].max())], trial


def test_read_indices_refuses_tensors_it_cannot_read(workspace):
    """The module's own checks, behind plan()'s (which never passes such tensors)."""
    w = variantgen.make_wrapper(SPECS / "causal.yaml", workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16",
                                backend="fa2")
    ind = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    kv = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    scratch = torch.empty(64, dtype=torch.uint8, device="cuda")
    host = torch.empty(2 + READ_INDICES_EXTRA, dtype=torch.int32)
    w.module.read_indices(kv, ind, ind, None, None, scratch, host)
    assert host[:2].tolist() == [0, 2] and host[2:4].tolist() == [1, 2]
    for bad, what in ((dict(host=host[:4]), "host: expected int32"), (dict(scratch=scratch[:8]), "scratch: expected"),
                      (dict(part0=ind.long()), "index tensor: expected a contiguous 1-D int32"),
                      (dict(part0=ind.cpu()), "index tensor: expected it on the page list's GPU")):
        args = dict(kv=kv, ind=ind, part0=ind, scratch=scratch, host=host) | bad
        with pytest.raises(Exception, match=what):
            w.module.read_indices(args["kv"], args["ind"], args["part0"], None, None, args["scratch"], args["host"])
