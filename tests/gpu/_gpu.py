"""Shared pieces of the GPU tests: the ragged batch, the reference check, fixtures."""

from __future__ import annotations

from pathlib import Path

import torch

import variantgen
from variantgen.testing.harness import nan_positions_differ, random_paged_batch, random_spec_args
from variantgen.wrappers.reference import reference_attention

SPECS = Path(__file__).resolve().parents[2] / "specs"
ALL_SPECS = sorted(p.stem for p in SPECS.glob("*.yaml"))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Ragged batch with chunked prefill (kv_len > qo_len), a single-token request and one
# request whose queries start at position 0.
QO_LENS = [37, 300, 1, 129, 513]
KV_LENS = [37, 812, 700, 1000, 513]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of the finite values, after NaN / inf positions were found equal to the
    reference's (a NaN in is NaN out; with finite inputs: no NaN / inf at all)."""
    out = out.float()
    differ = nan_positions_differ(out, ref)
    assert not differ.any(), (f"kernel output has NaN/inf where the reference has none (or the reverse) in "
                              f"{int(differ.sum())} rows, e.g. {differ.nonzero().flatten()[:8].tolist()}")
    both = torch.isfinite(out) & torch.isfinite(ref)
    return ((out - ref)[both].norm() / ref[both].norm().clamp_min(1e-12)).item()


def check(spec_name, workspace, *, head_dim=128, dtype="bf16", heads=(32, 8), page_size=16, seed=0,
          skip_tiles=False, qo_lens=QO_LENS, kv_lens=KV_LENS, args=None, backend="fa2", spec=None):
    spec = spec or variantgen.load_spec(SPECS / f"{spec_name}.yaml")
    wrapper = variantgen.make_wrapper(spec, workspace, head_dim_qk=head_dim, q_dtype=dtype, kv_dtype=dtype,
                                      backend=backend)
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=heads[0], num_kv_heads=heads[1],
                               head_dim=head_dim, page_size=page_size, dtype=DTYPES[dtype], device="cuda", seed=seed)
    args = args if args is not None else random_spec_args(spec, batch, seed=seed)
    plan_kw = dict(skip_tiles=skip_tiles)
    if skip_tiles:
        plan_kw.update(args)  # the interval plan reads the spans and the windows
    wrapper.plan(*batch.plan_args(), **plan_kw)
    out = wrapper.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    err = rel_error(out, ref)
    assert err < 1e-2, (f"{spec_name} {backend} hd{head_dim} {dtype} heads{heads} page{page_size} "
                        f"skip_tiles={skip_tiles}: rel. error {err:.3e}")
    return err


def mm_prefix_case(workspace, seed, kv_dtype="bf16", backend="fa2"):
    """The mm_prefix wrapper (hd128, GQA 32/8, page 16) and a random ragged batch with its args."""
    spec = variantgen.load_spec(SPECS / "mm_prefix.yaml")
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=128, q_dtype="bf16", kv_dtype=kv_dtype, backend=backend)
    kv_torch = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[kv_dtype]
    b = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                           dtype=torch.bfloat16, kv_dtype=kv_torch, device="cuda", seed=seed)
    return spec, w, b, random_spec_args(spec, b, seed=seed)


def assert_graph_replays(run, out: torch.Tensor) -> None:
    """``run()`` writes ``out``; captured in a CUDA graph and replayed, it writes the same bytes."""
    run()
    expected = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
