"""GPU correctness of batch decode (kind "decode"): every shipped spec against the derived
reference (the prefill reference with one query per request, qo_indptr = arange(batch+1)),
both paths (CUDA-core decode module, tensor-core = prefill module), return_lse, q/k/v
scales, an fp8 KV cache, both KV layouts, split-KV, and FlashInfer's own decode kernel.
Run on the H200 with `pytest -m gpu tests/gpu/test_gpu_decode.py`.

The modules this file needs (15 decode + 3 prefill modules) are built on first use; build
them in parallel beforehand with scripts/precompile_gpu_tests.sh (VARIANTGEN_CACHE_DIR).
"""

from __future__ import annotations

import pytest
import torch
from _gpu import ALL_SPECS, SPECS, assert_graph_replays, rel_error

import variantgen
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}

# Ragged decode batch: kv_len 1, shorter than a page, exactly a page, a page + 1, long ones.
KV_LENS = [1, 7, 16, 17, 300, 1000, 2500, 129]
# Scalars that make the masks bite at these lengths (the defaults mostly exceed them).
SMALL_SCALARS = {
    "streaming_sink": {"num_sink": 4, "window": 100},
    "chunked_local": {"chunk_size": 256},
    "mm_prefix": {"causal_window_left": 50, "range_window_left": 40},
    "sliding_window": {"window": 127},
    "softcap": {"soft_cap": 5.0, "window": 300},
}
# Extra (spec, head dim, q dtype, kv dtype) modules beyond every spec at hd128 bf16.
MATRIX = [("softcap", 64, "bf16", "bf16"), ("mm_prefix", 256, "bf16", "bf16"), ("document", 64, "fp16", "fp16"),
          ("sliding_window", 256, "fp16", "fp16"), ("causal", 128, "fp16", "fp16"),
          ("softcap", 128, "bf16", "fp8_e4m3")]
TENSOR_CORE_SPECS = ["causal", "mm_prefix", "softcap"]


@pytest.fixture(scope="module")
def wrapper(workspace):
    """wrapper(spec, head_dim, q_dtype, kv_dtype, tensor_cores, kv_layout): one make_wrapper per key,
    building its module on first use (precompile them all at once with
    scripts/precompile_gpu_tests.sh to spend less device time)."""
    made = {}

    def get(spec_name, head_dim=128, q_dtype="bf16", kv_dtype=None, tensor_cores=False, kv_layout="NHD"):
        key = (spec_name, head_dim, q_dtype, kv_dtype or q_dtype, tensor_cores, kv_layout)
        if key not in made:
            made[key] = variantgen.make_wrapper(SPECS / f"{spec_name}.yaml", workspace, head_dim_qk=head_dim,
                                                q_dtype=q_dtype, kv_dtype=kv_dtype or q_dtype, kind="decode",
                                                backend="fa2", use_tensor_cores=tensor_cores, kv_layout=kv_layout)
        return made[key]

    return get


def decode_batch(kv_lens, *, head_dim=128, q_dtype="bf16", kv_dtype=None, heads=(32, 8), page_size=16, seed=0):
    return random_paged_batch([1] * len(kv_lens), kv_lens, num_qo_heads=heads[0], num_kv_heads=heads[1],
                              head_dim=head_dim, page_size=page_size, dtype=TORCH[q_dtype],
                              kv_dtype=TORCH[kv_dtype or q_dtype], device="cuda", seed=seed)


def check(wrapper, spec_name, *, head_dim=128, q_dtype="bf16", kv_dtype=None, tensor_cores=False, heads=(32, 8),
          page_size=16, seed=0, kv_lens=KV_LENS, args=None, small=False, trim=True, kv_layout="NHD", scales=None,
          tol=1e-2):
    """Plan + run one decode batch and compare with the reference; returns (wrapper, out, lse)."""
    w = wrapper(spec_name, head_dim, q_dtype, kv_dtype, tensor_cores, kv_layout)
    b = decode_batch(kv_lens, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype, heads=heads,
                     page_size=page_size, seed=seed)
    if args is None:
        args = random_spec_args(w.spec, b, seed=seed)
        if small:
            args.update(SMALL_SCALARS.get(spec_name, {}))
    plan_kw = dict(args) if trim else {"skip_tiles": False}
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, heads[0], heads[1], page_size, **plan_kw)
    kv = (b.k_cache, b.v_cache)
    if kv_layout == "HND":
        kv = (b.k_cache.transpose(1, 2).contiguous(), b.v_cache.transpose(1, 2).contiguous())
    scales = scales or {}
    out, lse = w.run(b.q, kv, return_lse=True, **scales, **args)
    qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32, device="cuda")
    ref, ref_lse = reference_attention(w.spec, b.q, (b.k_cache, b.v_cache), qo_indptr, b.kv_indptr, b.kv_indices,
                                       b.last_page_len, args, return_lse=True, **scales)
    label = (f"{spec_name} hd{head_dim} {q_dtype}/{kv_dtype or q_dtype} heads{heads} page{page_size} "
             f"{'tensor' if tensor_cores else 'cuda'} cores trim={trim} {kv_layout}")
    err = rel_error(out, ref)
    assert err < tol, f"{label}: rel. error {err:.3e}"
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), f"{label}: lse -inf pattern differs"
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=2e-2, rtol=1e-3), f"{label}: lse differs"
    return w, out, lse


@pytest.mark.parametrize("trim", [True, False], ids=["trim", "full"])
@pytest.mark.parametrize("small", [False, True], ids=["defaults", "small"])
@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_spec_decode_vs_reference(spec_name, small, trim, wrapper):
    if small and spec_name not in SMALL_SCALARS:
        pytest.skip("no scalars to shrink")
    check(wrapper, spec_name, small=small, trim=trim, seed=len(spec_name))


@pytest.mark.parametrize("spec_name, head_dim, q_dtype, kv_dtype", MATRIX)
def test_head_dims_and_dtypes(spec_name, head_dim, q_dtype, kv_dtype, wrapper):
    scales = {"k_scale": 0.5, "v_scale": 2.0} if kv_dtype.startswith("fp8") else None
    for page_size in (1, 16):
        check(wrapper, spec_name, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=page_size,
              small=True, scales=scales, seed=page_size)


@pytest.mark.parametrize("spec_name", TENSOR_CORE_SPECS)
def test_tensor_core_path(spec_name, wrapper):
    for trim in (True, False):
        w, out_tc, _ = check(wrapper, spec_name, tensor_cores=True, small=True, trim=trim, seed=3)
        assert w.use_tensor_cores
    _, out_cc, _ = check(wrapper, spec_name, small=True, seed=3)
    assert (out_tc.float() - out_cc.float()).abs().max().item() < 5e-2


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_scales_and_lse(tensor_cores, wrapper):
    check(wrapper, "mm_prefix", tensor_cores=tensor_cores, small=True, seed=5,
          scales={"q_scale": 0.5, "k_scale": 1.5, "v_scale": 0.25})


@pytest.mark.parametrize("heads", [(32, 32), (32, 4), (16, 8), (24, 4)])
def test_gqa_group_sizes(heads, wrapper):
    """Each group size is its own kernel instantiation (group 1 uses 4 keys per thread)."""
    check(wrapper, "sliding_window", heads=heads, small=True, seed=heads[1])


def test_hnd_layout(wrapper):
    check(wrapper, "sliding_window", kv_layout="HND", small=True, seed=9)
    check(wrapper, "document", kv_layout="HND", seed=9)


@pytest.mark.parametrize("trim", [True, False], ids=["trim", "full"])
def test_split_kv_with_fully_masked_chunks(trim, wrapper):
    """Two long requests: the scheduler splits their KV; with a small window and no trimming
    most chunks see no key at all, and the merge must ignore them."""
    args = {"window": 100}
    w, _, _ = check(wrapper, "sliding_window", kv_lens=[6000, 4097], args=args, trim=trim, seed=4)
    if not trim:
        assert w.plan_stats["pages"]["visited"] == w.plan_stats["pages"]["given"]
    else:
        assert w.plan_stats["pages"]["visited"] <= 2 * (100 // 16 + 2)


def test_cuda_graph_replay(wrapper):
    w = wrapper("document")
    b = decode_batch(KV_LENS, seed=8)
    args = random_spec_args(w.spec, b, seed=8)
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 16, **args)
    out = torch.empty_like(b.q)
    assert_graph_replays(lambda: w.run(b.q, (b.k_cache, b.v_cache), out=out, **args), out)


def test_matches_flashinfer_decode(wrapper, workspace):
    """softcap spec (cap 30, window 1023) vs FlashInfer's decode with logits_soft_cap and window_left."""
    import flashinfer

    w = wrapper("softcap")
    b = decode_batch([1, 17, 1024, 1025, 3000, 8000], seed=12)
    args = {"soft_cap": 30.0, "window": 1023}
    w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 16, **args)
    ours = w.run(b.q, (b.k_cache, b.v_cache), **args)
    fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                                       "NHD")
    fw.plan(b.kv_indptr, b.kv_indices, b.last_page_len, 32, 8, 128, 16, window_left=1023, logits_soft_cap=30.0,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    theirs = fw.run(b.q, (b.k_cache, b.v_cache))
    diff = (ours.float() - theirs.float()).abs().max().item()
    assert diff <= 3e-2 and rel_error(ours, theirs.float()) < 5e-3, f"max abs diff vs FlashInfer's decode: {diff}"
