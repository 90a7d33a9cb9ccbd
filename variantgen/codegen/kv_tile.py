"""The KV tile FlashInfer's fa2 prefill kernels run with on a known device family, so that a
module built for it compiles that tile only.

FlashInfer's fa2 prefill dispatch (``BatchPrefill...Dispatched`` in its
``attention/prefill.cuh``) picks ``NUM_MMA_KV`` - the key tile, in 16-key steps per KV warp -
at run time from the device's shared memory, and so instantiates its kernel for each of the
four tiles it could pick (8, 4, 2, 1). A variantgen module is built for one arch; where every
device of that arch has the same shared memory (every sm90 GPU: 228 KB per SM, 227 KB per block
opt-in), only one tile is ever picked, and the other three kernels are compile time for nothing:
about a quarter of an fa2 kernel unit's build. ``fa2_num_mma_kv`` says which tile that is, or
None where it cannot be known at build time (then the module keeps FlashInfer's dispatch).

The rule is FlashInfer 0.7.2's occupancy budget for head dims up to 256 (two CTAs per SM when
they fit, the query tile and the KV tiles in shared memory, a register cap of 8 / NUM_MMA_Q).
``tests/cpu/test_kv_tile_nvcc.py`` runs FlashInfer's own dispatch code on the host with these
devices' attributes and checks every supported configuration against it; the kernel units
check it again on the device at run time (``templates/fa2/pinned_kv_tile.cuh``): a device that
asks for another tile gets an error naming both, never a kernel built for another tile.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SharedMemory:
    """A device family's shared memory (cudaDevAttrMaxSharedMemoryPerMultiprocessor and
    cudaDevAttrMaxSharedMemoryPerBlockOptin), in bytes."""

    per_sm: int
    per_block_optin: int


# Arch major -> the shared memory every device of that arch has. sm90 only: a module built for
# 8.0 also runs on 8.6 / 8.9 GPUs (100 KB per SM against the A100's 164 KB).
SHARED_MEMORY_BY_MAJOR = {9: SharedMemory(per_sm=233472, per_block_optin=232448)}

MMA_KV_STEPS = (8, 4, 2, 1)  # the tiles FlashInfer's DISPATCH_NUM_MMA_KV instantiates


def shared_memory(arch: str) -> SharedMemory | None:
    """The shared memory of every device an ``arch`` module ('9.0a', '8.0', ...) runs on, or
    None where those devices differ or it is not known here."""
    major = arch.split(".", 1)[0]
    return SHARED_MEMORY_BY_MAJOR.get(int(major)) if major.isdigit() else None


def _warps(cta_tile_q: int) -> tuple[int, int, int]:
    """(NUM_MMA_Q, NUM_WARPS_Q, NUM_WARPS_KV) of a query tile (head dims below 512)."""
    num_mma_q = 2 if cta_tile_q > 64 else 1
    num_warps_q = 4 if cta_tile_q > 16 else 1
    return num_mma_q, num_warps_q, 4 // num_warps_q


def fa2_num_mma_kv(cta_tile_q: int, head_dim_qk: int, head_dim_vo: int, q_bytes: int, kv_bytes: int,
                   arch: str) -> int | None:
    """NUM_MMA_KV FlashInfer's fa2 prefill dispatch (paged and ragged KV) picks for this query
    tile, head dims and element sizes on a device of ``arch``; None where that is not known at
    build time (an arch whose devices differ, head dims above 256, a tile it would refuse)."""
    smem = shared_memory(arch)
    if smem is None or head_dim_qk > 256 or head_dim_vo > 256 or cta_tile_q not in (16, 64, 128):
        return None
    num_mma_q, num_warps_q, num_warps_kv = _warps(cta_tile_q)
    # Shared memory per NUM_MMA_KV step: the K and V tiles, plus the 16-bit staging buffer of a
    # one-byte KV cache (FlashInfer repacks fp8 tiles for query tiles above 16, head_dim_vo != 64).
    repack = kv_bytes == 1 and head_dim_vo != 64 and cta_tile_q > 16
    per_step = (head_dim_qk + head_dim_vo) * 16 * num_warps_kv * kv_bytes
    if repack:
        per_step += max(head_dim_qk, head_dim_vo) * 16 * num_warps_kv * q_bytes
    fixed = cta_tile_q * head_dim_qk * q_bytes  # the query tile
    min_steps = num_warps_q // 2 if kv_bytes == 1 and num_warps_q > 2 else 1  # fp8's alignment
    ctas_per_sm = 2 if smem.per_sm >= 2 * (fixed + min_steps * per_step) else 1
    per_block = min(smem.per_sm // ctas_per_sm, smem.per_block_optin)
    most = min((per_block - fixed) // per_step, 8 // num_mma_q)
    return next((steps for steps in MMA_KV_STEPS if most >= steps), None)
