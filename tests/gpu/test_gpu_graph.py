"""CUDA-graph mode on the GPU: capture run() once, re-plan other batches, replay.

Each replayed batch must match the reference, and the replay must write exactly what an
eager run() of the same plan writes; rows past the batch stay untouched. fa2 and fa3 (whose
launch slots include a causal launch per pinned window width).
"""

from __future__ import annotations

import random

import pytest
import torch
from _gpu import KV_LENS, QO_LENS, SPECS, rel_error

import variantgen
from variantgen.planning.graph import GraphCapacity
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.reference import reference_attention

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


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("spec_name, skip_tiles, planner_module", [
    ("mm_prefix", True, True), ("mm_prefix", False, True), ("document", True, True),
    ("mm_prefix", True, False),  # no planner module: planner-off plans (the same builder, one launch slot used)
])
def test_replay_after_replanning(spec_name, skip_tiles, planner_module, backend, workspace):
    spec = variantgen.load_spec(SPECS / f"{spec_name}.yaml")
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", graph=CAP,
                                backend=backend)
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


def test_make_wrapper_picks_fa3_for_graph_mode_on_sm90(workspace):
    """graph= takes the backend make_wrapper takes without it (resolver.resolve): fa3 on sm90."""
    spec = variantgen.load_spec(SPECS / "causal.yaml")
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", graph=CAP)
    major, _ = torch.cuda.get_device_capability()
    assert w.config.backend == ("fa3" if major == 9 else "fa2")
    probed = variantgen.probe(spec, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", cuda_graph=True)
    assert probed and probed.details["backend"] == w.config.backend


def random_batch(rng: random.Random, cap: GraphCapacity) -> tuple[list[int], list[int]]:
    """A batch that fits the capacity: 1-6 requests, chunked prefill, single-token requests."""
    n = rng.randint(1, cap.max_batch_size)
    qo = [rng.choice([1, rng.randint(1, 64), rng.randint(64, 600)]) for _ in range(n)]
    while sum(qo) > cap.max_total_q:
        qo[rng.randrange(n)] //= 2
    qo = [max(q, 1) for q in qo]
    kv = [q + rng.choice([0, rng.randint(1, 700)]) for q in qo]
    while sum(-(-k // PAGE) for k in kv) > cap.max_kv_pages:
        i = rng.randrange(n)
        kv[i] = max(qo[i], kv[i] // 2)
    return qo, kv


@pytest.mark.parametrize("spec_name, scalars, widths", [
    ("mm_prefix", {"causal_window_left": 64, "range_window_left": 5}, (64,)),  # spans + a window slot
    ("document", {}, None),  # [total_kv] ids, the planner's sorted-id terms
    ("prefix_lm", {}, None),  # [batch] prefix lengths
    ("streaming_sink", {"num_sink": 4, "window": 300}, None),  # rows of two intervals: past their gaps
])
def test_fa3_replays_50_replanned_batches_under_one_capture(spec_name, scalars, widths, workspace):
    """fa3 CUDA-graph mode: one capture, then 50 batches of other sizes, their spec tensors
    rewritten in the static buffers and planned again before each replay - every replay against
    the reference. The launch slots (custom, causal, none, a causal slot per window width) and
    their plan_info stay those of the capture."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")
    spec = variantgen.load_spec(SPECS / f"{spec_name}.yaml")
    cap = GraphCapacity(max_batch_size=6, max_total_q=2048, max_kv_pages=512, window_widths=widths)
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", graph=cap,
                                backend="fa3")
    assert w.row_planner is not None, w.planner.row_planner_reason
    engine = Engine(spec)
    rng = random.Random(17)
    graph, pinned = None, None
    for seed in range(51):
        qo_lens, kv_lens = (QO_LENS, KV_LENS) if seed == 0 else random_batch(rng, cap)
        b, args = engine.load(seed, qo_lens, kv_lens)
        plan = w.plan(*b.plan_args(), **engine.static, **scalars)
        assert plan.planner == "module"
        slots = [(la.mask_mode, la.window_left, la.plan_info) for la in plan.launches]
        run = lambda: w.run(engine.q, (engine.k, engine.v), out=engine.out, **engine.static, **scalars)  # noqa: E731
        if graph is None:
            run()  # warm up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            pinned = slots
            want = [("custom", -1), ("causal", -1), ("none", -1)] + [("causal", x) for x in widths or ()]
            assert [s[:2] for s in slots] == want
        assert slots == pinned, f"batch {seed}: the launch slots changed"
        tq = b.q.shape[0]
        engine.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isnan(engine.out[tq:].float()).all(), f"batch {seed}: rows past total_q written"
        ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                  b.last_page_len, {**args, **scalars})
        err = rel_error(engine.out[:tq], ref)
        assert err < 1e-2, f"{spec_name} batch {seed} ({qo_lens}, {kv_lens}): replay rel. error {err:.2e}"


def replay_decode(w, spec, cap: GraphCapacity, batches: list[list[int]], scalars: dict | None = None) -> None:
    """Capture a decode run() after the first plan, then re-plan every batch (one query per
    request, sliding window 1000) and replay: each vs the reference, rows past it untouched."""
    q = torch.empty(cap.max_batch_size, HQ, HD, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    k = torch.zeros(cap.max_kv_pages, PAGE, HKV, HD, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    scalars = scalars or {"window": 1000}
    graph = None
    for seed, kv_lens in enumerate(batches):
        n = len(kv_lens)
        b = random_paged_batch([1] * n, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=PAGE,
                               dtype=torch.bfloat16, device="cuda", seed=seed)
        q[:n] = b.q
        k[:b.k_cache.shape[0]], v[:b.v_cache.shape[0]] = b.k_cache, b.v_cache
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, PAGE, **scalars)
        if graph is None:
            w.run(q, (k, v), out=out, **scalars)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q, (k, v), out=out, **scalars)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), torch.arange(n + 1, dtype=torch.int32,
                                  device="cuda"), b.kv_indptr, b.kv_indices, b.last_page_len, scalars)
        err = rel_error(out[:n], ref)
        assert err < 1e-2, f"decode batch {seed} ({n} requests): replay rel. error {err:.2e}"
        assert torch.isnan(out[n:].float()).all()


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("spec_name", ["sliding_window", "streaming_sink"])
def test_tensor_core_decode_replay_after_replanning(workspace, backend, spec_name):
    """Decode through the prefill kernel (fa2 use_tensor_cores=True; fa3's decode) in graph mode:
    one capture, batches of 1..64 requests replayed from static q / out buffers (streaming_sink:
    each query's sinks and window as one launch request past the gap)."""
    if backend == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")
    spec = variantgen.load_spec(SPECS / f"{spec_name}.yaml")
    cap = GraphCapacity(max_batch_size=64, max_total_q=64, max_kv_pages=4096)
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                backend=backend, use_tensor_cores=True, graph=cap)
    assert w.use_tensor_cores and w.config.backend == backend
    scalars = {"window": 1000} | ({"num_sink": 4} if spec_name == "streaming_sink" else {})
    replay_decode(w, spec, cap, [[300, 5000, 17], [1] * 64, [9000, 16, 4000, 1200] * 3, [16384]], scalars)


def test_cuda_core_decode_replay_after_replanning(workspace):
    """The CUDA-core decode kernel in graph mode: 16 requests per plan (FlashInfer's CUDA-graph
    decode schedule is for one batch size), other lengths and key-trimmed page lists, one capture."""
    spec = variantgen.load_spec(SPECS / "sliding_window.yaml")
    cap = GraphCapacity(max_batch_size=16, max_total_q=16, max_kv_pages=8192)
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                backend="fa2", graph=cap)
    assert not w.use_tensor_cores
    replay_decode(w, spec, cap, [[300, 5000, 17, 1] * 4, [16384, 1, 2, 3] * 4, [8000] * 16])
