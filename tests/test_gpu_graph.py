"""CUDA-graph mode on the GPU: capture run() once, re-plan other batches, replay.

Each replayed batch must match the reference, and the replay must write exactly what an
eager run() of the same plan writes; rows past the batch stay untouched.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import KV_LENS, QO_LENS, SPECS, rel_error

import variantgen
from variantgen.graph import GraphCapacity
from variantgen.reference import reference_attention
from variantgen.testing import random_paged_batch, random_spec_args

pytestmark = pytest.mark.gpu

HQ, HKV, HD, PAGE = 32, 8, 128, 16
CAP = GraphCapacity(max_batch_size=6, max_total_q=2048, max_kv_pages=512)
BATCHES = [  # (qo_lens, kv_lens): the captured batch first
    (QO_LENS, KV_LENS),
    ([512, 7, 300], [2000, 7, 900]),
    ([1], [1]),
    ([400, 400, 400, 400, 300, 148], [400, 1200, 400, 1300, 300, 3000]),
    ([1024], [1024]),
]


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(128 << 20, dtype=torch.uint8, device="cuda")


class Engine:
    """Static buffers a serving engine would capture with."""

    def __init__(self, spec):
        self.spec = spec
        self.q = torch.empty(CAP.max_total_q, HQ, HD, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty_like(self.q)
        self.k = torch.zeros(CAP.max_kv_pages, PAGE, HKV, HD, dtype=torch.bfloat16, device="cuda")
        self.v = torch.zeros_like(self.k)
        dims = {"total_q": CAP.max_total_q, "total_kv": CAP.max_kv_pages * PAGE, "batch": CAP.max_batch_size}
        self.static = {t.name: torch.zeros([dims[d] if isinstance(d, str) else d for d in t.shape],
                                           dtype=torch.int32 if t.dtype == "int32" else torch.float32, device="cuda")
                       for t in spec.tensors}

    def load(self, seed: int, qo_lens, kv_lens):
        b = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE,
                               dtype=torch.bfloat16, device="cuda", seed=seed)
        args = random_spec_args(self.spec, b, seed=seed)
        self.q[:b.q.shape[0]] = b.q
        self.k[:b.k_cache.shape[0]] = b.k_cache
        self.v[:b.v_cache.shape[0]] = b.v_cache
        for name, value in args.items():
            if isinstance(value, torch.Tensor):
                self.static[name].fill_(-1)
                self.static[name][tuple(slice(0, n) for n in value.shape)] = value
        return b, args


@pytest.mark.parametrize("spec_name, skip_tiles, planner_module", [
    ("mm_prefix", True, True), ("mm_prefix", False, True), ("document", True, True),
    ("mm_prefix", True, False),  # no planner module: planner-off plans (the same builder, one launch slot used)
])
def test_replay_after_replanning(spec_name, skip_tiles, planner_module, workspace):
    spec = variantgen.load_spec(SPECS / f"{spec_name}.yaml")
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", graph=CAP,
                                backend="fa2")
    if not planner_module:
        w.set_row_planner(None, "test: without the planner module")
    engine = Engine(spec)
    graph = None
    for seed, (qo_lens, kv_lens) in enumerate(BATCHES):
        b, args = engine.load(seed, qo_lens, kv_lens)
        w.plan(*b.plan_args(), skip_tiles=skip_tiles, **(engine.static if skip_tiles else {}))
        assert w.last_plan.planner == ("module" if planner_module and skip_tiles else "off")
        run = lambda: w.run(engine.q, (engine.k, engine.v), out=engine.out, **engine.static)  # noqa: E731
        if graph is None:
            run()  # warm up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
        tq = b.q.shape[0]
        engine.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = engine.out.clone()
        assert torch.isnan(replayed[tq:].float()).all(), f"batch {seed}: rows past total_q written"
        ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                  b.last_page_len, args)
        err = rel_error(replayed[:tq], ref)
        assert err < 1e-2, f"{spec_name} batch {seed} ({qo_lens}): replay rel. error {err:.2e}"
        engine.out.fill_(float("nan"))
        run()
        assert torch.equal(engine.out[:tq], replayed[:tq]), f"batch {seed}: eager run differs from the replay"


def replay_decode(w, spec, cap: GraphCapacity, batches: list[list[int]]) -> None:
    """Capture a decode run() after the first plan, then re-plan every batch (one query per
    request, sliding window 1000) and replay: each vs the reference, rows past it untouched."""
    q = torch.empty(cap.max_batch_size, HQ, HD, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    k = torch.zeros(cap.max_kv_pages, PAGE, HKV, HD, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    graph = None
    for seed, kv_lens in enumerate(batches):
        n = len(kv_lens)
        b = random_paged_batch([1] * n, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE,
                               dtype=torch.bfloat16, device="cuda", seed=seed)
        q[:n] = b.q
        k[:b.k_cache.shape[0]], v[:b.v_cache.shape[0]] = b.k_cache, b.v_cache
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, PAGE, window=1000)
        if graph is None:
            w.run(q, (k, v), out=out, window=1000)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q, (k, v), out=out, window=1000)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), torch.arange(n + 1, dtype=torch.int32,
                                  device="cuda"), b.kv_indptr, b.kv_indices, b.last_page_len, {"window": 1000})
        err = rel_error(out[:n], ref)
        assert err < 1e-2, f"decode batch {seed} ({n} requests): replay rel. error {err:.2e}"
        assert torch.isnan(out[n:].float()).all()


def test_tensor_core_decode_replay_after_replanning(workspace):
    """Decode through the prefill kernel (use_tensor_cores=True) in graph mode: one capture,
    batches of 1..64 requests replayed from static q / out buffers."""
    spec = variantgen.load_spec(SPECS / "sliding_window.yaml")
    cap = GraphCapacity(max_batch_size=64, max_total_q=64, max_kv_pages=4096)
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                use_tensor_cores=True, graph=cap)
    replay_decode(w, spec, cap, [[300, 5000, 17], [1] * 64, [9000, 16, 4000, 1200] * 3, [16384]])


def test_cuda_core_decode_replay_after_replanning(workspace):
    """The CUDA-core decode kernel in graph mode: 16 requests per plan (FlashInfer's CUDA-graph
    decode schedule is for one batch size), other lengths and key-trimmed page lists, one capture."""
    spec = variantgen.load_spec(SPECS / "sliding_window.yaml")
    cap = GraphCapacity(max_batch_size=16, max_total_q=16, max_kv_pages=8192)
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                graph=cap)
    assert not w.use_tensor_cores
    replay_decode(w, spec, cap, [[300, 5000, 17, 1] * 4, [16384, 1, 2, 3] * 4, [8000] * 16])
