"""GPU correctness of sparse key sets read through page lists (variantgen/planning/keysets.py): custom
launch requests whose page lists hold only the pages with a key their rows see, the key positions in
a table after the launch's metadata (the variants' key_pos). Against the derived reference and
against the same batch planned over each run's hull (lists off), on fa2 and fa3 paged prefill and
fa3's GQA-packed decode. Run on the GPU machine with `pytest -m gpu tests/gpu/test_gpu_keysets.py`.

The masks (bench/masks/): global tokens + a bidirectional window (Longformer / BigBird's global
tokens: ``is_global[kv_row] != 0``, 1 % of the keys) and fixed sparse attention (a block, and the
summary keys of every earlier block), and BigBird (random key blocks picked per query block: pages
found per (row block, key block)). Modules: the first run builds them (or precompile on a build
box: fa2 and fa3, hd 128, bf16, for global_window, fixed_sparse and bigbird).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _gpu import rel_error

import variantgen
from variantgen.testing.harness import random_paged_batch
from variantgen.wrappers.reference import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MASKS = Path(__file__).resolve().parents[2] / "bench" / "masks"
HQ, HKV, HD = 32, 8, 128


@pytest.fixture(scope="module")
def workspace():
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def spec_args(name: str, spec, kv_lens: list[int], seed: int) -> dict:
    args = {s.name: s.default for s in spec.scalars}
    g = torch.Generator().manual_seed(seed)
    if name == "global_window":
        args["is_global"] = (torch.rand(sum(kv_lens), generator=g) < 0.01).to(torch.int32).cuda()
    if name == "bigbird":  # random key blocks per query block: each of 32 with probability 0.1
        words = ((torch.rand(64, 32, generator=g) < 0.1).long() << torch.arange(32)).sum(1)
        args["random_blocks"] = (words - (words >= 2**31).long() * 2**32).to(torch.int32).cuda()
        args["block"] = 32
    return args


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("name", ["global_window", "fixed_sparse", "bigbird"])
def test_page_lists_match_the_reference_and_the_hull(name, page_size, backend, workspace):
    if backend == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")
    spec = variantgen.load_spec(MASKS / f"{name}.yaml")
    qo_lens, kv_lens = [700, 1, 300, 64], [1500, 900, 300, 2000]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD, page_size=page_size,
                               dtype=torch.bfloat16, device="cuda", seed=page_size)
    args = spec_args(name, spec, kv_lens, page_size)
    outs, visited = {}, {}
    for lists in (True, False):
        w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", backend=backend)
        w.planner.key_set_lists = lists
        plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
        assert any(r.gaps for r in plan.launch_requests) == lists, plan
        assert any(la.listed for la in plan.launches) == lists, plan  # (the listed variant's launch)
        visited[lists] = plan.work()["visited"]
        outs[lists] = w.run(batch.q, (batch.k_cache, batch.v_cache), **args).float()
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    err = rel_error(outs[True], ref)
    assert err < 1e-2, f"{name} {backend} ps{page_size}: rel. error {err:.2e}"
    assert (outs[True] - outs[False]).abs().max().item() < 2e-2, "page lists and hull differ"
    assert visited[True] < visited[False], visited


@pytest.mark.parametrize("page_size", [1, 16])
def test_fa3_decode_reads_the_global_pages_and_the_window(page_size, workspace):
    """fa3's decode (its prefill kernel, GQA-packed): each query's page list."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on sm90")
    spec = variantgen.load_spec(MASKS / "global_window.yaml")
    kv_lens = [3000, 17, 1200, 5000]
    w = variantgen.make_wrapper(spec, workspace, head_dim_qk=HD, q_dtype="bf16", kv_dtype="bf16", backend="fa3",
                                kind="decode")
    b = random_paged_batch([1] * len(kv_lens), kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HD,
                           page_size=page_size, dtype=torch.bfloat16, device="cuda", seed=7)
    args = spec_args("global_window", spec, kv_lens, 7)
    plan = w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, HQ, HKV, page_size, **args)
    assert any(r.gaps for r in plan.launch_requests), plan
    got = w.run(b.q, (b.k_cache, b.v_cache), **args)
    ref = reference_attention(spec, b.q, (b.k_cache, b.v_cache), b.qo_indptr, b.kv_indptr, b.kv_indices,
                              b.last_page_len, args)
    assert rel_error(got, ref) < 1e-2
