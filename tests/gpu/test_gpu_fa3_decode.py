"""GPU correctness of decode on sm90's fa3 kernel (its decode is its paged prefill module with
qo_len 1 per request) and of multi-token decode (q_len_per_request 2..16: speculative
verification) on fa3 and fa2's tensor-core path: against the derived reference, against
FlashInfer's decode for causal, in CUDA-graph mode across re-planned batches, and the
choice on sm90 (fa2 first for decode; fa3 when asked for).
Run on the H200 with `pytest -m gpu tests/gpu/test_gpu_fa3_decode.py`.
"""

from __future__ import annotations

import random

import pytest
import torch
from _gpu import SPECS, rel_error

import variantgen
from variantgen import GraphCapacity
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KV_LENS = [1, 7, 16, 17, 300, 1000, 2500, 129]
DECODE_SPECS = ["causal", "sliding_window", "document", "mm_prefix", "attention_sink_learned"]
SMALL = {"sliding_window": {"window": 127}, "attention_sink_learned": {"window": 128},
         "mm_prefix": {"causal_window_left": 50, "range_window_left": 40}}


@pytest.fixture(scope="module", autouse=True)
def sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")


@pytest.fixture(scope="module")
def wrapper(workspace):
    made = {}

    def get(spec_name, backend="fa3", graph=None):
        key = (spec_name, backend, graph)
        if key not in made:
            made[key] = variantgen.make_wrapper(SPECS / f"{spec_name}.yaml", workspace, head_dim_qk=128,
                                                q_dtype="bf16", kv_dtype="bf16", kind="decode", backend=backend,
                                                use_tensor_cores=backend == "fa2", graph=graph)
        return made[key]

    return get


def batch_of(kv_lens, per=1, heads=(32, 8), page_size=16, seed=0):
    return random_paged_batch([per] * len(kv_lens), kv_lens, num_qo_heads=heads[0], num_kv_heads=heads[1],
                              head_dim=128, page_size=page_size, dtype=torch.bfloat16, device="cuda", seed=seed)


def check(w, kv_lens, *, per=1, heads=(32, 8), page_size=16, seed=0, trim=True, small=False, label=""):
    b = batch_of(kv_lens, per, heads, page_size, seed)
    args = random_spec_args(w.spec, b, seed=seed)
    if small:
        args.update(SMALL.get(w.spec.name, {}))
    plan_kw = dict(args) if trim else {"skip_tiles": False}
    multi = {"q_len_per_request": per} if per > 1 else {}
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, heads[0], heads[1], page_size, **multi, **plan_kw)
    out, lse = w.run(b.q, (b.k_cache, b.v_cache), return_lse=True, **args)
    ref, ref_lse = reference_attention(w.spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                       b.last_page_len, args, return_lse=True)
    where = f"{w.spec.name} {w.config.backend} T={per} heads{heads} page{page_size} trim={trim} {label}"
    err = rel_error(out, ref)
    assert err < 1e-2, f"{where}: rel. error {err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), f"{where}: lse -inf pattern differs"
    assert torch.allclose(lse[fin], ref_lse[fin], atol=2e-2, rtol=1e-3), f"{where}: lse differs"
    return b, args, out


@pytest.mark.parametrize("trim", [True, False], ids=["planned", "direct"])
@pytest.mark.parametrize("spec_name", DECODE_SPECS)
def test_fa3_decode_vs_reference(spec_name, trim, wrapper):
    w = wrapper(spec_name)
    assert w.use_tensor_cores and w.config.backend == "fa3" and w.config.kind == "prefill"
    for heads, page_size in (((32, 8), 16), ((16, 16), 1), ((32, 2), 16)):  # GQA groups 4, 1, 16
        check(w, KV_LENS, heads=heads, page_size=page_size, seed=len(spec_name) + page_size, trim=trim, small=True)


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("per", [2, 4, 16])
@pytest.mark.parametrize("spec_name", ["causal", "sliding_window", "document"])
def test_multi_token_decode_vs_reference(spec_name, per, backend, wrapper):
    w = wrapper(spec_name, backend)
    for trim in (True, False):
        check(w, [max(n, per) for n in KV_LENS], per=per, seed=per, trim=trim, small=True)


@pytest.mark.parametrize("spec_name", ["alibi", "softcap", "mm_prefix", "sliding_window"])
def test_fa3_gqa_packed_decode_equals_unpacked(spec_name, wrapper):
    """GQA packing (a key/value head's query heads as rows of one tile) against the reference and
    against the same plan with packing off: alibi and softcap read the query head in the logits,
    mm_prefix and sliding_window the query row in the mask; one and three queries per request."""
    w = wrapper(spec_name)
    for per, heads in ((1, (32, 8)), (3, (32, 8)), (1, (32, 2)), (2, (24, 4))):
        kv_lens = [max(n, per) for n in KV_LENS]
        _, _, packed = check(w, kv_lens, per=per, heads=heads, seed=per, small=True, label="packed")
        assert w.last_plan.pack_gqa == heads[0] // heads[1], w.last_plan
        w.planner.pack_gqa_enabled = False
        try:
            _, _, plain = check(w, kv_lens, per=per, heads=heads, seed=per, small=True, label="unpacked")
            assert w.last_plan.pack_gqa == 1
        finally:
            w.planner.pack_gqa_enabled = True
        diff = (packed.float() - plain.float()).abs().max().item()
        assert diff <= 1e-2, f"{spec_name} T={per} heads{heads}: packed vs unpacked max abs diff {diff}"


def test_fa3_decode_matches_flashinfer_decode(wrapper):
    """causal on fa3 vs FlashInfer's own decode (CUDA cores) on the same batch."""
    import flashinfer

    w = wrapper("causal")
    b, _, ours = check(w, [1, 17, 1024, 1025, 3000, 8000], seed=12)
    fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                                       "NHD")
    fw.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16)
    theirs = fw.run(b.q, (b.k_cache, b.v_cache))
    diff = (ours.float() - theirs.float()).abs().max().item()
    assert diff <= 3e-2 and rel_error(ours, theirs.float()) < 5e-3, f"max abs diff vs FlashInfer's decode: {diff}"


def test_decode_on_sm90_takes_fa2_unless_fa3_is_asked_for(workspace):
    """backend=None: fa2 first for decode (capabilities.KIND_ORDER: fa3's decode measured slower);
    backend="fa3": its prefill module, probed as make_wrapper loads it."""
    w = variantgen.make_wrapper("causal", workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="decode")
    assert w.config.backend == "fa2" and not w.use_tensor_cores
    for cuda_graph in (False, True):
        probed = variantgen.probe("causal", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="decode",
                                  backend="fa3", cuda_graph=cuda_graph)
        assert probed.ok and probed.details["backend"] == "fa3" and "_fa3_prefill_" in probed.uri, probed.reason


@pytest.mark.parametrize("max_qo_len", [None, 8], ids=["unpacked", "gqa_packed"])
def test_fa3_graph_replays_decode_and_multi_token_decode(max_qo_len, wrapper):
    """One capture, then 50 re-planned decode batches (1..32 requests, 1..8 queries each, other
    lengths), spec tensors rewritten in the static buffers: every replay vs the reference; with
    max_qo_len=8 the capture is GQA-packed (8 rows x group 4 fit a tile), its unpack writing only
    each replay's rows."""
    cap = GraphCapacity(max_batch_size=32, max_total_q=256, max_kv_pages=2048, max_qo_len=max_qo_len)
    w = wrapper("document", graph=cap)
    hq, hkv, ps = 32, 8, 16
    q = torch.zeros(cap.max_total_q, hq, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    k = torch.zeros(cap.max_kv_pages, ps, hkv, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    doc = torch.zeros(cap.max_kv_pages * ps, dtype=torch.int32, device="cuda")
    rng = random.Random(5)
    graph = None
    for seed in range(51):
        n = rng.randint(1, 32)
        per = rng.choice([1, 1, 2, 4, 8])
        kv_lens = [rng.randint(per, 900) for _ in range(n)]
        b = batch_of(kv_lens, per, (hq, hkv), ps, seed)
        args = random_spec_args(w.spec, b, seed=seed)
        q[:b.q.shape[0]] = b.q
        k[:b.k_cache.shape[0]], v[:b.v_cache.shape[0]] = b.k_cache, b.v_cache
        doc.fill_(-1)
        doc[:args["doc_ids"].numel()] = args["doc_ids"]
        multi = {"q_len_per_request": per} if per > 1 else {}
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, hq, hkv, ps, doc_ids=doc, **multi)
        assert w.last_plan.pack_gqa == (1 if max_qo_len is None else hq // hkv)
        if graph is None:
            w.run(q, (k, v), out=out, doc_ids=doc)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q, (k, v), out=out, doc_ids=doc)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows = b.q.shape[0]
        ref = reference_attention(w.spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                                  b.last_page_len, args)
        err = rel_error(out[:rows], ref)
        assert err < 1e-2, f"batch {seed} ({n} requests x {per}): replay rel. error {err:.2e}"
        assert torch.isnan(out[rows:].float()).all(), f"batch {seed}: rows past the batch written"
