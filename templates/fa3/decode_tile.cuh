// Static source of variantgen's fa3 modules (copied as is into each module's sources).
//
// The decode tile: FlashInfer's sm90 paged kernel with one consumer warpgroup of
// vg_abi::kFa3DecodeTileQ (64) query rows and kFa3DecodeTileKv-key tiles. Its own dispatch
// only knows tiles of 128 rows and more (two or three consumer warpgroups). A GQA-packed decode
// launch fills a tile with group x queries rows of one request and key/value head - 4 of 128 at
// group 4 - and the kernel computes every row of the tile; half the rows is half the work.
// 64-key tiles keep the single warpgroup's accumulators inside the 144 registers the kernel
// gives a consumer thread of an 8-warp CTA (96-key tiles spill and serialize the WGMMAs).
//
// Included by the decode-tile kernel units after FlashInfer's prefill_sm90.cuh and the module's
// config (HEAD_DIM_QK, the dtypes).
#pragma once
#include <flashinfer/attention/hopper/kernel_traits.cuh>
#include <flashinfer/attention/hopper/named_barrier.cuh>

namespace vg {

// FlashInfer's traits under a type of our own, so the warp scheduler below is ours to define.
template <typename Variant>
struct Fa3DecodeTileTraits
    : flashinfer::AttentionKernelTraits</*USE_TMA_LOAD_KV=*/false, HEAD_DIM_QK, HEAD_DIM_VO,
                                        vg_abi::kFa3DecodeTileQ, vg_abi::kFa3DecodeTileKv,
                                        /*NUM_STAGES=*/2, DTypeQ, DTypeKV, DTypeO, IdType, Variant> {
  static_assert(HEAD_DIM_QK == HEAD_DIM_VO && HEAD_DIM_VO <= 128,
                "the decode tile's registers fit head dims up to 128 (plan_abi.fa3_has_decode_tile)");
};

}  // namespace vg

namespace flashinfer {

// The kernel's warp scheduler lets two or three consumer warpgroups take turns at the tensor
// cores (named barriers between them); one consumer warpgroup has no one to wait for, so only
// the "query buffer is free" arrival of mma_init remains.
template <typename Variant, bool UseSchedulerBarrier>
struct WarpScheduler<vg::Fa3DecodeTileTraits<Variant>, UseSchedulerBarrier> {
  using Traits = vg::Fa3DecodeTileTraits<Variant>;
  static_assert(Traits::NUM_MMA_THREADS == cutlass::NumThreadsPerWarpGroup);
  static CUTLASS_DEVICE void barrier_sync() {}
  static CUTLASS_DEVICE void barrier_arrive() {}
  static CUTLASS_DEVICE void mma_init() {
    cutlass::arch::NamedBarrier::arrive(Traits::NUM_MMA_THREADS + Traits::NUM_PRODUCER_THREADS,
                                        static_cast<int>(NamedBarriers::kQueryEmpty));
  }
};

}  // namespace flashinfer
