"""GPU correctness of issue 18's masks: learned attention sinks (gpt-oss), tree verification
for speculative decoding, Gemma 4's sliding layers with images. Run on the H200 with
`pytest -m gpu tests/gpu/test_gpu_masks.py`.

* attention_sink_learned: fa2 / fa3 paged prefill (planner on and off), ragged, CUDA-core and
  tensor-core decode (split-KV included) against the reference, output and LSE; and against
  FlashInfer's BatchAttentionWithAttentionSinkWrapper (its fa2 and fa3 variants) on the same
  inputs, with the window (gpt-oss sliding layers) and without;
* tree_verify: random trees (chains, stars, random parents, forests; 1-64 nodes) after long
  contexts on fa2 / fa3, multi-token decode (qo_len 2..64 per request on the prefill module),
  CUDA-graph capture and replays with other trees; a chain matches the causal spec;
* gemma4_sliding: head dim 256 on fa2 and fa3, chunked prefill with chunks starting inside
  image blocks, against attention under transformers' own Gemma 4 mask functions.

Modules: `bash scripts/precompile_gpu_tests.sh` builds them beforehand (its masks group: hd 256). FlashInfer's sink
wrapper JIT-compiles its own two modules on first use (FlashInfer's cache).
"""

from __future__ import annotations

import math

import pytest
import torch
from _gpu import SPECS, rel_error

import variantgen
from variantgen.planning.graph import GraphCapacity
from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.ragged import random_ragged_batch, reference_ragged
from variantgen.wrappers.reference import reference_attention, softmax_attention
from variantgen.wrappers.trees import random_tree_parents, tree_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HQ, HKV, PAGE = 32, 8, 16  # GQA 4 (gpt-oss: 64 query heads over 8; Gemma 4 E4B: 8 over 2)
QO_LENS = [37, 300, 1, 129, 513, 16]
KV_LENS = [37, 812, 700, 1000, 513, 4000]


@pytest.fixture(scope="module")
def wrappers(workspace):
    """wrappers(spec, backend=, kind=, head_dim=, tensor_cores=, graph=): one make_wrapper per key."""
    made = {}

    def get(spec_name, backend="fa2", kind="prefill", head_dim=128, tensor_cores=False, graph=None):
        key = (spec_name, backend, kind, head_dim, tensor_cores, graph)
        if key not in made:
            made[key] = variantgen.make_wrapper(SPECS / f"{spec_name}.yaml", workspace, head_dim_qk=head_dim,
                                                q_dtype="bf16", kv_dtype="bf16", backend=backend, kind=kind,
                                                use_tensor_cores=tensor_cores, graph=graph)
        return made[key]

    return get


def paged(qo_lens, kv_lens, head_dim=128, seed=0, shuffle=True):
    return random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=head_dim, page_size=PAGE,
                              dtype=torch.bfloat16, device="cuda", seed=seed, shuffle_pages=shuffle)


def check_lse(lse, ref_lse, label):
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), f"{label}: lse -inf pattern differs"
    fin = torch.isfinite(ref_lse)
    diff = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    assert torch.allclose(lse[fin], ref_lse[fin], atol=2e-2, rtol=1e-3), f"{label}: lse max abs diff {diff:.3e}"


def run_prefill(w, b, args, *, skip_tiles):
    w.plan(*b.plan_args(), skip_tiles=skip_tiles, **(args if skip_tiles else {}))
    return w.run(b.q, (b.k_cache, b.v_cache), return_lse=True, **args)


def check_prefill(w, b, args, *, skip_tiles, label):
    out, lse = run_prefill(w, b, args, skip_tiles=skip_tiles)
    ref, ref_lse = reference_attention(w.spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                       b.last_page_len, args, return_lse=True)
    err = rel_error(out, ref)
    assert err < 1e-2, f"{label}: rel. error {err:.3e}"
    check_lse(lse, ref_lse, label)
    return out, lse


def sinks_of(seed: int, heads: int = HQ) -> torch.Tensor:
    """Sink logits of the size gpt-oss learns (a few units), large and negative ones included."""
    g = torch.Generator().manual_seed(seed)
    sinks = torch.randn(heads, generator=g) * 3.0
    sinks[0], sinks[-1] = 40.0, -40.0  # a sink that takes almost all weight, one that takes none
    return sinks.cuda()


# ----------------------------------------------------------------------------- learned sinks


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("window", [-1, 128])
@pytest.mark.parametrize("skip_tiles", [False, True], ids=["planner_off", "planner_on"])
def test_learned_sinks_prefill_vs_reference(backend, window, skip_tiles, wrappers):
    w = wrappers("attention_sink_learned", backend)
    b = paged(QO_LENS, KV_LENS, seed=window + 3)
    check_prefill(w, b, {"sinks": sinks_of(1), "window": window}, skip_tiles=skip_tiles,
                  label=f"sinks {backend} window {window} {skip_tiles=}")


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("window", [-1, 128])
def test_learned_sinks_match_flashinfer_sink_wrapper(backend, window, wrappers):
    """The same inputs through FlashInfer's BatchAttentionWithAttentionSinkWrapper (its own fa2 /
    fa3 sink variant; window_left = window - 1: gpt-oss's 128-key window) and through ours, at
    gpt-oss's head dim 64 (the modules bench/bench_masks.py measures)."""
    import flashinfer

    d = 64
    b = paged(QO_LENS, KV_LENS, head_dim=d, seed=11)
    sinks = sinks_of(2)
    ours, our_lse = run_prefill(wrappers("attention_sink_learned", backend, head_dim=d), b,
                                {"sinks": sinks, "window": window}, skip_tiles=True)
    window_left = window - 1 if window > 0 else -1
    fw = flashinfer.BatchAttentionWithAttentionSinkWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", backend=backend,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, head_dim_qk=d, head_dim_vo=d,
        window_left=window_left)
    fw.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, d, PAGE, causal=True,
            window_left=window_left, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    theirs, their_lse = fw.run(b.q, (b.k_cache, b.v_cache), sinks, 1.0 / math.sqrt(d), return_lse=True)
    diff = (ours.float() - theirs.float()).abs().max().item()
    assert diff <= 2e-2 and rel_error(ours, theirs.float()) < 5e-3, f"{backend} w{window}: max abs diff {diff}"
    check_lse(our_lse, their_lse, f"{backend} w{window} vs FlashInfer's lse")


def test_learned_sinks_ragged_and_decode(wrappers):
    """Ragged prefill, and decode on both paths: long requests split their KV (split-KV merges
    chunks; the sink must join exactly one of them), short ones do not."""
    sinks = sinks_of(3)
    for window in (-1, 128):
        args = {"sinks": sinks, "window": window}
        w = wrappers("attention_sink_learned", kind="ragged")
        rb = random_ragged_batch(QO_LENS, KV_LENS, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=128,
                                 dtype=torch.bfloat16, device="cuda", seed=4)
        w.plan(*rb.plan_args())
        out, lse = w.run(rb.q, rb.k, rb.v, return_lse=True, **args)
        ref, ref_lse = reference_ragged(w.spec, rb.q, rb.k, rb.v, rb.qo_indptr, rb.kv_indptr, args, return_lse=True)
        assert rel_error(out, ref) < 1e-2, f"ragged w{window}"
        check_lse(lse, ref_lse, f"ragged w{window}")
        kv_lens = [1, 7, 16, 17, 300, 1000, 6000, 4097]
        db = paged([1] * len(kv_lens), kv_lens, seed=5)
        qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32, device="cuda")
        ref, ref_lse = reference_attention(w.spec, db.q, (db.k_cache, db.v_cache), qo_indptr, db.kv_indptr,
                                           db.kv_indices, db.last_page_len, args, return_lse=True)
        for tensor_cores in (False, True):
            d = wrappers("attention_sink_learned", kind="decode", tensor_cores=tensor_cores)
            d.plan(db.kv_indptr, db.kv_indices, db.last_page_len, HQ, HKV, PAGE, **args)
            out, lse = d.run(db.q, (db.k_cache, db.v_cache), return_lse=True, **args)
            label = f"decode w{window} {'tensor' if tensor_cores else 'cuda'} cores"
            assert rel_error(out, ref) < 1e-2, label
            check_lse(lse, ref_lse, label)


# ----------------------------------------------------------------------------- tree verification


def tree_batch(sizes, shapes, contexts, seed):
    g = torch.Generator().manual_seed(seed)
    parents = [random_tree_parents(n, g, s) for n, s in zip(sizes, shapes)]
    b = paged(list(sizes), [c + n for c, n in zip(contexts, sizes)], seed=seed)
    return b, {"tree_bits": tree_bits(parents, device="cuda")}, parents


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("seed", range(3))
def test_random_trees_vs_reference(backend, seed, wrappers):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 64, 2, 16] + [int(torch.randint(1, 65, (1,), generator=g)) for _ in range(4)]
    shapes = ["chain", "random", "star", "random", "forest", "random", "star", "chain"]
    contexts = [0, 8192, 17, 8192 - 16] + [int(torch.randint(0, 3000, (1,), generator=g)) for _ in range(4)]
    b, args, _ = tree_batch(sizes, shapes, contexts, seed)
    w = wrappers("tree_verify", backend)
    for skip_tiles in (False, True):
        check_prefill(w, b, args, skip_tiles=skip_tiles, label=f"trees {backend} seed {seed} {skip_tiles=}")


def test_a_chain_matches_causal(wrappers):
    b, args, _ = tree_batch([16] * 8, ["chain"] * 8, [8192 - 16] * 8, seed=9)
    tree, _ = run_prefill(wrappers("tree_verify"), b, args, skip_tiles=True)
    causal, _ = run_prefill(wrappers("causal"), b, {}, skip_tiles=True)
    diff = (tree.float() - causal.float()).abs().max().item()
    assert diff <= 1e-2, f"chain vs causal: max abs diff {diff}"


def test_multi_token_decode_of_trees(wrappers):
    """64 requests of 8192 keys verifying 2..64 draft nodes each (the tensor-core decode shape:
    the prefill module with a few queries per request)."""
    g = torch.Generator().manual_seed(5)
    sizes = [int(torch.randint(2, 65, (1,), generator=g)) for _ in range(64)]
    shapes = [("random", "star", "chain", "forest")[i % 4] for i in range(64)]
    b, args, _ = tree_batch(sizes, shapes, [8192 - n for n in sizes], seed=5)
    check_prefill(wrappers("tree_verify"), b, args, skip_tiles=True, label="multi-token decode")


def test_tree_verify_cuda_graph_replays(wrappers):
    """Capture run() once in graph mode, then plan other trees and sizes and replay."""
    cap = GraphCapacity(max_batch_size=8, max_total_q=512, max_kv_pages=2048)
    w = wrappers("tree_verify", graph=cap)
    q = torch.empty(cap.max_total_q, HQ, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    k = torch.zeros(cap.max_kv_pages, PAGE, HKV, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    bits = torch.zeros(cap.max_total_q, 2, dtype=torch.int32, device="cuda")
    graph = None
    cases = [([16] * 8, ["random"] * 8, [1000] * 8), ([64, 1, 33], ["random", "chain", "forest"], [3000, 5, 900]),
             ([8, 8], ["star", "chain"], [4000, 20])]
    for seed, (sizes, shapes, contexts) in enumerate(cases):
        b, args, _ = tree_batch(sizes, shapes, contexts, seed)
        tq, pages = b.q.shape[0], b.k_cache.shape[0]
        q[:tq], k[:pages], v[:pages] = b.q, b.k_cache, b.v_cache
        bits.zero_()
        bits[:tq] = args["tree_bits"]
        w.plan(*b.plan_args(), tree_bits=bits)
        if graph is None:
            w.run(q, (k, v), out=out, tree_bits=bits)  # warm up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q, (k, v), out=out, tree_bits=bits)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_attention(w.spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                  b.last_page_len, args)
        assert rel_error(out[:tq], ref) < 1e-2, f"replay {seed}"


# ----------------------------------------------------------------------------- Gemma 4 sliding layers


def gemma4_masks(chunks, layouts, window):
    """transformers' Gemma 4 sliding mask (create_masks_for_vision_model's composition) for each
    request's chunk: [qo_len, kv_len] bool, the same for every head."""
    mu = pytest.importorskip("transformers.masking_utils")
    gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    masks = []
    for (q0, kv), (length, images) in zip(chunks, layouts):
        types = torch.zeros(length, dtype=torch.int64)
        for s, e in images:
            types[s:e + 1] = 1
        ids = gemma4.get_block_sequence_ids_for_mask(types[:kv].view(1, -1), torch.device("cpu"))
        fn = mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids)),
                          mu.sliding_window_overlay(window))
        masks.append(fn(torch.tensor(0), torch.tensor(0), torch.arange(q0, kv).view(-1, 1),
                        torch.arange(kv).view(1, -1)).expand(kv - q0, kv).cuda())
    return masks


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_gemma4_sliding_hd256_chunked_prefill(backend, wrappers):
    """Head dim 256 (Gemma 4's sliding layers); chunks that start inside an image block see the
    block's keys in the KV (later ones too) and earlier keys only within the window."""
    window = 512
    layouts = [(8192, [(1024, 2047), (3072, 4095), (5120, 6143)]), (3000, [(100, 2099)]), (700, [])]
    chunks = [(1500, 4000), (600, 3000), (0, 700)]  # (first query position, keys in the KV)
    b = paged([kv - q0 for q0, kv in chunks], [kv for _, kv in chunks], head_dim=256, seed=7, shuffle=False)
    # each query's block as the whole request's spans give it (a block may run past the chunk's keys)
    ranges = torch.cat([variantgen.spans_to_ranges([length], [length], [images])[q0:kv]
                        for (q0, kv), (length, images) in zip(chunks, layouts)]).cuda()
    args = {"ranges": ranges, "window": window}
    w = wrappers("gemma4_sliding", backend, head_dim=256)
    for skip_tiles in (False, True):
        out, _ = check_prefill(w, b, args, skip_tiles=skip_tiles, label=f"gemma4 {backend} {skip_tiles=}")
    # attention under transformers' mask, pages in order (shuffle=False) read back to back
    k_all = b.k_cache.reshape(-1, HKV, 256).float()
    v_all = b.v_cache.reshape(-1, HKV, 256).float()
    first_q = first_page = 0
    for mask, (q0, kv) in zip(gemma4_masks(chunks, layouts, window), chunks):
        k = k_all[first_page * PAGE:][:kv].repeat_interleave(HQ // HKV, 1)
        v = v_all[first_page * PAGE:][:kv].repeat_interleave(HQ // HKV, 1)
        scores = torch.einsum("qhd,khd->hqk", b.q[first_q:first_q + kv - q0].float(), k) / 16.0
        want, _ = softmax_attention(scores.masked_fill(~mask, -math.inf), v)
        assert rel_error(out[first_q:first_q + kv - q0], want) < 1e-2, f"gemma4 {backend} chunk {q0}..{kv}"
        first_q += kv - q0
        first_page += -(-kv // PAGE)


def test_gemma4_global_head_dim_512_is_refused_with_a_reason():
    spec = variantgen.load_spec(SPECS / "gemma4_sliding.yaml")
    for backend in ("fa2", "fa3"):
        result = variantgen.probe(spec, head_dim_qk=512, q_dtype="bf16", kv_dtype="bf16", backend=backend)
        assert not result and "support head dims 64, 128, 256" in result.reason, result.reason
