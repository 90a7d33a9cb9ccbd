// What-if experiment (bench/experiments/fa3_decode_tiles): FlashInfer's sm90 kernel with one
// consumer warpgroup (a 64-row query tile). FlashInfer's warp scheduler barrier orders the GEMMs
// of two or three consumer warpgroups, and asserts there are two or three; with one there is
// nothing to order, so its barrier calls do nothing here and mma_init only frees the query buffer.
#pragma once

namespace flashinfer {
template <bool TMA_KV, int HD_QK, int HD_VO, int TILE_KV, int STAGES, typename DQ, typename DKV, typename DO,
          typename ID, typename V>
struct WarpScheduler<AttentionKernelTraits<TMA_KV, HD_QK, HD_VO, 64, TILE_KV, STAGES, DQ, DKV, DO, ID, V>, true> {
  using Ktraits = AttentionKernelTraits<TMA_KV, HD_QK, HD_VO, 64, TILE_KV, STAGES, DQ, DKV, DO, ID, V>;
  static CUTLASS_DEVICE void barrier_sync() {}
  static CUTLASS_DEVICE void barrier_arrive() {}
  static CUTLASS_DEVICE void mma_init() {
    cutlass::arch::NamedBarrier::arrive(Ktraits::NUM_MMA_THREADS + Ktraits::NUM_PRODUCER_THREADS,
                                        /*id=*/static_cast<int>(NamedBarriers::kQueryEmpty));
  }
};
}  // namespace flashinfer
