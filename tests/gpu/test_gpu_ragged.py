"""GPU correctness of ragged-KV prefill (kind "ragged"): every shipped spec against its
derived reference, MLA-shaped head dims 192/128 (DeepSeek, vLLM's MLA prefill), LSE
(base 2) and the chunked-context merge it exists for, split-KV, strided views, HND.
Run on the H200 with `pytest -m gpu tests/gpu/test_gpu_ragged.py`.

Each module (spec x head dims x dtype) is built once per session (module-scoped cache of
wrappers; modules land in VARIANTGEN_CACHE_DIR, so a second session only loads them).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _gpu import ALL_SPECS, SPECS, rel_error

import variantgen
from variantgen.core.errors import JitDisabledError
from variantgen.testing.harness import random_spec_args
from variantgen.wrappers.ragged import RaggedWrapper, random_ragged_batch, reference_ragged

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEADS = (32, 8)  # GQA 4

# Full prefill, chunked prefill (kv_len >> qo_len), single-token requests, one long context.
QO_LENS = [37, 300, 1, 129, 513, 16, 1]
KV_LENS = [37, 812, 700, 1000, 513, 4000, 1]
# A context-free spec for the chunked-context merge (vLLM runs context chunks non-causal).
FULL_SPEC = Path(__file__).resolve().parents[1] / "data" / "full.yaml"


@pytest.fixture(scope="module")
def wrappers(workspace):
    """wrappers(spec_name, qk, vo, dtype, kv_layout, backend) -> RaggedWrapper, each module built once."""
    made: dict[tuple, RaggedWrapper] = {}

    def get(spec_name: str, qk: int = 128, vo: int | None = None, dtype: str = "bf16", kv_layout: str = "NHD",
            backend: str = "fa2"):
        key = (spec_name, qk, vo or qk, dtype, kv_layout, backend)
        if key not in made:
            spec = variantgen.load_spec(FULL_SPEC if spec_name == "full" else SPECS / f"{spec_name}.yaml")
            w = variantgen.make_wrapper(spec, workspace, head_dim_qk=qk, head_dim_vo=vo or qk, q_dtype=dtype,
                                        kv_dtype=dtype, kind="ragged", kv_layout=kv_layout, backend=backend)
            assert isinstance(w, RaggedWrapper)
            made[key] = w
        return made[key]

    return get


def check_lse(lse: torch.Tensor, ref_lse: torch.Tensor, label: str) -> None:
    fin = torch.isfinite(ref_lse)
    assert fin.any()
    diff = (lse[fin] - ref_lse[fin]).abs().max().item()
    assert torch.allclose(lse[fin], ref_lse[fin], atol=2e-2, rtol=1e-3), f"{label}: lse max abs diff {diff:.3e}"


def check(wrappers, spec_name, *, qk=128, vo=None, dtype="bf16", qo_lens=QO_LENS, kv_lens=KV_LENS, seed=0,
          kv_layout="NHD", scales=None, disable_split_kv=False, backend="fa2"):
    w = wrappers(spec_name, qk, vo, dtype, kv_layout, backend)
    batch = random_ragged_batch(qo_lens, kv_lens, num_qo_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim_qk=qk,
                                head_dim_vo=vo, dtype=DTYPES[dtype], kv_layout=kv_layout, device="cuda", seed=seed)
    args = random_spec_args(w.spec, batch, seed=seed)
    scales = scales or {}
    w.plan(*batch.plan_args(), disable_split_kv=disable_split_kv)
    out, lse = w.run(batch.q, batch.k, batch.v, return_lse=True, **scales, **args)
    ref, ref_lse = reference_ragged(w.spec, batch.q, batch.k, batch.v, batch.qo_indptr, batch.kv_indptr, args,
                                    kv_layout=kv_layout, return_lse=True, **scales)
    label = f"{spec_name} {backend} hd{qk}x{vo or qk} {dtype} {kv_layout}"
    err = rel_error(out, ref)
    assert err < 1e-2, f"{label}: rel. error {err:.3e}"
    check_lse(lse, ref_lse, label)
    return w, batch, args, out, lse


@pytest.mark.parametrize("spec_name", ALL_SPECS)
def test_spec_vs_reference(spec_name, wrappers):
    w, *_ = check(wrappers, spec_name)
    assert w.plan_stats["launches"][0][0] == ("causal" if spec_name in ("causal", "alibi") else "custom")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("spec_name", ["mm_prefix", "causal", "softcap"])
def test_mla_head_dims_192_128(spec_name, dtype, wrappers):
    check(wrappers, spec_name, qk=192, vo=128, dtype=dtype, seed=1)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_other_head_dims(head_dim, wrappers):
    check(wrappers, "softcap", qk=head_dim, seed=2)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_causal_mode_matches_custom_mode(wrappers, backend):
    """The causal spec launches the causal mode (skips tiles above the diagonal); the masked launch
    (fa2's kCustom, fa3's masked variant) must agree."""
    if backend == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")
    w, batch, args, out, lse = check(wrappers, "causal", qk=192, vo=128, seed=3, backend=backend)
    assert w.plan_stats["launches"][0][0] == "causal"
    w.auto_mask_mode = False
    try:
        w.plan(*batch.plan_args())
        assert w.plan_stats["launches"][0][0] == "custom"
        out2, lse2 = w.run(batch.q, batch.k, batch.v, return_lse=True)
    finally:
        w.auto_mask_mode = True
    assert (out.float() - out2.float()).abs().max().item() <= 1e-2
    assert torch.allclose(lse, lse2, atol=1e-3)


def test_scales_and_out(wrappers):
    w, batch, args, out, _ = check(wrappers, "mm_prefix", qk=192, vo=128, seed=4,
                                   scales=dict(q_scale=0.5, k_scale=1.5, v_scale=0.25))
    given = torch.empty_like(out)
    got = w.run(batch.q, batch.k, batch.v, out=given, q_scale=0.5, k_scale=1.5, v_scale=0.25, **args)
    assert got is given and torch.equal(given, out)


def test_split_kv(wrappers):
    """Few queries over long contexts: FlashInfer's planner splits KV and merges; same result
    (and LSE) with split-KV disabled."""
    qo, kv = [1, 3, 1, 2], [16000, 9000, 30000, 4000]
    w, batch, args, out, lse = check(wrappers, "causal", qk=192, vo=128, qo_lens=qo, kv_lens=kv, seed=5)
    assert bool(list(w._launch.plan_info)[14]), "expected the plan to split KV"
    check(wrappers, "causal", qk=192, vo=128, qo_lens=qo, kv_lens=kv, seed=5, disable_split_kv=True)
    assert not bool(list(w._launch.plan_info)[14])


def test_hnd_layout(wrappers):
    check(wrappers, "mm_prefix", kv_layout="HND", seed=6)


def test_strided_v_as_vllm_passes_it(wrappers):
    """vLLM's MLA prefill splits v off [k_nope | v]: a strided view with a contiguous last dim."""
    w = wrappers("causal", 192, 128)
    batch = random_ragged_batch([20, 7], [20, 300], num_qo_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim_qk=192,
                                head_dim_vo=128, device="cuda", seed=7)
    kv_nope = torch.randn(320, HEADS[1], 128 + 128, device="cuda").to(torch.bfloat16)
    v = kv_nope[..., 128:]
    w.plan(*batch.plan_args())
    out, lse = w.run(batch.q, batch.k, v, return_lse=True)
    ref, ref_lse = reference_ragged(w.spec, batch.q, batch.k, v, batch.qo_indptr, batch.kv_indptr, return_lse=True)
    assert rel_error(out, ref) < 1e-2
    check_lse(lse, ref_lse, "strided v")


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_lse_merges_chunked_context(wrappers, backend):
    """vLLM's chunked-context MLA prefill: new tokens causal over themselves, then each context
    chunk non-causal; merging the partial outputs with the (base-2) LSE gives causal attention
    over context + new tokens."""
    qk, vo, hq, hkv = 192, 128, HEADS[0], HEADS[1]
    new_lens, ctx_lens = [40, 1, 300], [500, 77, 2100]
    g = torch.Generator().manual_seed(8)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()

    q = rand(sum(new_lens), hq, qk)
    ks = [rand(c + n, hkv, qk) for c, n in zip(ctx_lens, new_lens)]
    vs = [rand(c + n, hkv, vo) for c, n in zip(ctx_lens, new_lens)]
    qo_indptr = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def indptr(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    # 1) causal over the new tokens only
    if backend == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")
    causal = wrappers("causal", qk, vo, backend=backend)
    k_new = torch.cat([k[c:] for k, c in zip(ks, ctx_lens)])
    v_new = torch.cat([v[c:] for v, c in zip(vs, ctx_lens)])
    causal.plan(qo_indptr, indptr(new_lens), hq, hkv)
    o1, lse1 = causal.run(q, k_new, v_new, return_lse=True)
    # 2) the context in two chunks, every key visible
    full = wrappers("full", qk, vo, backend=backend)
    parts = [(o1.float(), lse1)]
    for lo, hi in ((0, 0.5), (0.5, 1.0)):
        bounds = [(int(c * lo), int(c * hi)) for c in ctx_lens]
        k_ctx = torch.cat([k[a:b] for k, (a, b) in zip(ks, bounds)])
        v_ctx = torch.cat([v[a:b] for v, (a, b) in zip(vs, bounds)])
        full.plan(qo_indptr, indptr([b - a for a, b in bounds]), hq, hkv)
        o, lse = full.run(q, k_ctx, v_ctx, return_lse=True)
        parts.append((o.float(), lse))
    # merge in base 2
    lses = torch.stack([p[1] for p in parts])
    m = lses.amax(0)
    weights = torch.exp2(lses - m)
    merged = sum(w.unsqueeze(-1) * p[0] for w, p in zip(weights, parts)) / weights.sum(0).unsqueeze(-1)
    merged_lse = m + torch.log2(weights.sum(0))
    ref, ref_lse = reference_ragged(causal.spec, q, torch.cat(ks), torch.cat(vs), qo_indptr,
                                    indptr([c + n for c, n in zip(ctx_lens, new_lens)]), return_lse=True)
    assert rel_error(merged, ref) < 1e-2
    check_lse(merged_lse, ref_lse, "merged")


def test_lse_is_base_2(wrappers):
    """One row by hand: lse == log2(sum_j exp(sm_scale * q.k_j)) (not the natural log)."""
    w = wrappers("full", 192, 128)
    batch = random_ragged_batch([1], [300], num_qo_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim_qk=192,
                                head_dim_vo=128, device="cuda", seed=9)
    w.plan(*batch.plan_args())
    _, lse = w.run(batch.q, batch.k, batch.v, return_lse=True)
    scores = torch.einsum("hd,khd->hk", batch.q[0].float(), batch.k.float().repeat_interleave(4, dim=1))
    natural = torch.logsumexp(scores / math.sqrt(192), dim=-1)
    assert torch.allclose(lse[0], natural / math.log(2.0), atol=2e-2, rtol=1e-3)


# ----------------------------------------------------------------------------- fa3 (sm90)

FA3_SPECS = ["causal", "mm_prefix", "document", "softcap", "attention_sink_learned"]


@pytest.fixture
def sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")


@pytest.mark.parametrize("spec_name", FA3_SPECS)
def test_fa3_spec_vs_reference(spec_name, wrappers, sm90):
    w, *_ = check(wrappers, spec_name, backend="fa3", seed=11)
    assert w.config.backend == "fa3"
    assert w.plan_stats["launches"][0][0] == ("causal" if spec_name == "causal" else "custom")


@pytest.mark.parametrize("spec_name", ["mm_prefix", "causal"])
def test_fa3_mla_head_dims_192_128(spec_name, wrappers, sm90):
    check(wrappers, spec_name, qk=192, vo=128, backend="fa3", seed=12)


def test_fa3_hnd_strided_v_and_scales(wrappers, sm90):
    check(wrappers, "mm_prefix", kv_layout="HND", backend="fa3", seed=14)
    check(wrappers, "mm_prefix", backend="fa3", seed=15, scales=dict(q_scale=0.5, k_scale=1.5, v_scale=0.25))
    w = wrappers("causal", 192, 128, backend="fa3")
    batch = random_ragged_batch([20, 7, 300], [20, 300, 1500], num_qo_heads=HEADS[0], num_kv_heads=HEADS[1],
                                head_dim_qk=192, head_dim_vo=128, device="cuda", seed=16)
    kv_nope = torch.randn(batch.k.shape[0], HEADS[1], 256, device="cuda").to(torch.bfloat16)
    v = kv_nope[..., 128:]  # vLLM's MLA prefill: v split off [k_nope | v]
    w.plan(*batch.plan_args())
    out, lse = w.run(batch.q, batch.k, v, return_lse=True)
    ref, ref_lse = reference_ragged(w.spec, batch.q, batch.k, v, batch.qo_indptr, batch.kv_indptr, return_lse=True)
    assert rel_error(out, ref) < 1e-2
    check_lse(lse, ref_lse, "fa3 strided v")


def test_make_wrapper_picks_fa3_for_ragged_on_sm90(workspace, sm90):
    fa3 = variantgen.probe("causal", head_dim_qk=192, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", kind="ragged",
                           backend="fa3")
    if not fa3 and "is not precompiled" in fa3.reason:  # JIT off: the choice falls back (a skip where the run says so)
        raise JitDisabledError(fa3.reason)
    w = variantgen.make_wrapper(SPECS / "causal.yaml", workspace, head_dim_qk=192, head_dim_vo=128, q_dtype="bf16",
                                kv_dtype="bf16", kind="ragged")
    assert w.config.backend == "fa3"
    probed = variantgen.probe("causal", head_dim_qk=192, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16",
                              kind="ragged")
    assert probed.ok and probed.details["backend"] == "fa3", probed.reason


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_plan_behind_a_busy_gpu_keeps_the_previous_plan(wrappers, backend):
    """Regression: plan() rewrote the page-locked work list before the previous plan's copy of it
    had run (queued behind busy kernels), so the earlier run() launched with the later batch's work
    list. Two plans of different batches with host indptrs behind a second of GPU work; both runs
    against the reference."""
    if backend == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")
    w = wrappers("causal", backend=backend)
    a = random_ragged_batch([300, 5, 64], [900, 5, 700], num_qo_heads=HEADS[0], num_kv_heads=HEADS[1],
                            head_dim_qk=128, device="cuda", seed=17)
    b = random_ragged_batch([1, 700], [4000, 700], num_qo_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim_qk=128,
                            device="cuda", seed=18)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued before both plans
    w.plan(a.qo_indptr.cpu(), a.kv_indptr.cpu(), HEADS[0], HEADS[1])
    out_a = w.run(a.q, a.k, a.v)
    w.plan(b.qo_indptr.cpu(), b.kv_indptr.cpu(), HEADS[0], HEADS[1])
    out_b = w.run(b.q, b.k, b.v)
    torch.cuda.synchronize()
    for name, batch, out in (("first", a, out_a), ("second", b, out_b)):
        ref = reference_ragged(w.spec, batch.q, batch.k, batch.v, batch.qo_indptr, batch.kv_indptr)
        assert rel_error(out, ref) < 1e-2, f"{backend}: the {name} plan's run() is wrong"
