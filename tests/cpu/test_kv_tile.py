"""kv_tile: which fa2 modules pin FlashInfer's KV tile, and how far the sm90 figures are from a
tile boundary (FlashInfer's own dispatch is compared in test_kv_tile_nvcc.py)."""

from __future__ import annotations

import itertools

import pytest

import variantgen
from variantgen.build.builder import rendered_sources
from variantgen.codegen import kv_tile
from variantgen.codegen.render import DTYPES, FA2_CTA_TILES_Q, ModuleConfig
from variantgen.routing.capabilities import FA2
from variantgen.routing.capabilities import HEAD_DIMS as HEAD_DIMS_OF

HEAD_DIMS = sorted({*HEAD_DIMS_OF["fa2", "prefill"], *HEAD_DIMS_OF["fa2", "ragged"]})
CONFIGS = list(itertools.product(FA2_CTA_TILES_Q, HEAD_DIMS, sorted({DTYPES[q][1] for q in FA2.q_dtypes}),
                                 sorted({DTYPES[kv][1] for kv in FA2.kv_dtypes})))


def tiles(arch: str = "9.0a") -> dict:
    return {c: kv_tile.fa2_num_mma_kv(c[0], *c[1], c[2], c[3], arch) for c in CONFIGS}


def test_sm90_modules_pin_a_tile_and_others_do_not():
    assert all(t in kv_tile.MMA_KV_STEPS for t in tiles("9.0a").values())
    assert tiles("9.0") == tiles("9.0a")
    for arch in ("8.0", "8.9", "10.0a", "12.0"):  # devices of these archs differ, or are not known here
        assert set(tiles(arch).values()) == {None}, arch
    assert kv_tile.fa2_num_mma_kv(128, 128, 128, 2, 2, "9.0a") == 4  # FlashInfer's 128-row tile on an H100/H200
    assert kv_tile.fa2_num_mma_kv(32, 512, 512, 2, 2, "9.0a") is None  # head dims above 256: not pinned


def test_sm90_tiles_hold_for_any_shared_memory_from_224_to_255_kb(monkeypatch):
    """Every sm90 GPU has 228 KB per SM: the pinned tiles would be the same anywhere from 224 KB
    to 255 KB, so they do not hang on the exact figure."""
    shipped = tiles()
    for kb in range(224, 256):
        smem = kv_tile.SharedMemory(per_sm=kb * 1024, per_block_optin=kb * 1024 - 1024)
        monkeypatch.setitem(kv_tile.SHARED_MEMORY_BY_MAJOR, 9, smem)
        assert tiles() == shipped, kb


@pytest.mark.parametrize("arch", ["9.0a", "8.0"])
def test_units_follow_the_pinning(arch):
    """A pinned module has one kernel unit per CTA tile with every run() code; an unpinned one a
    unit per code and tile, without the pinned header."""
    config = ModuleConfig(variantgen.resolve_spec("mm_prefix"), 128, 128, "bf16", "bf16", "bf16", arch)
    module = rendered_sources(config)
    kernels = [u for u in module.compile_units if u.startswith("paged_kernel_")]
    if arch == "9.0a":
        assert kernels == [f"paged_kernel_cta{c}.cu" for c in FA2_CTA_TILES_Q]
        assert "pinned_kv_tile.cuh" in module.files
        for unit, steps in zip(kernels, (2, 8, 4)):
            assert f'#define VG_FA2_NUM_MMA_KV {steps}\n#include "pinned_kv_tile.cuh"' in module.files[unit]
            assert module.files[unit].index("pinned_kv_tile.cuh") < module.files[unit].index("prefill.cuh>")
    else:
        assert len(kernels) == 4 * len(FA2_CTA_TILES_Q) and "pinned_kv_tile.cuh" not in module.files
        assert all("VG_FA2_NUM_MMA_KV" not in module.files[u] for u in kernels)
