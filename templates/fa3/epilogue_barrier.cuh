// Static source of variantgen's fa3 modules (copied as is into each module's sources).
//
// The output store of FlashInfer's sm90 prefill kernel (hopper/epilogue.cuh, flashinfer 0.7.2)
// with its barrier fixed. There each consumer thread writes its output fragment to shared
// memory, *arrives* at the epilogue barrier, then *syncs* on the same barrier with the same
// thread count before the consumers copy the tile out to global memory. A barrier counts
// arrivals, not threads: once the other warps have arrived, the first of them to reach the
// sync completes the barrier while a late warp is still writing its rows, and the copy-out
// reads those rows stale (shared memory the output shares with the last V tile). Seen on the
// H200 as a few rows of one head off by up to 7 in one run of a few hundred on the same inputs
// (bench/fuzz_gpu.py; tests/gpu/test_gpu_regressions.py). Here the threads write, then all of
// them sync once, then copy out.
//
// VG_FA3_EPILOGUE_FOR(V) declares FlashInfer's CollectiveEpilogue for the kernel traits of the
// variant template V<flags...> (V<MASKED>, V<MASKED, LISTED>) as VgCollectiveEpilogue: FlashInfer's own (instantiated for a
// twin of the traits, the same members under another type) with store() replaced. Needs
// <flashinfer/attention/hopper/prefill_sm90.cuh> and the variant first; used by the kernel
// units only (nothing else instantiates the epilogue).
//
// Which FlashInfer versions need it is decided in variantgen/fi_versions.py (every version so
// far: 0.7.2.post1 and 0.7.4 have the same arrive-then-sync store) and rendered into fi_facts.h;
// where VG_FI_FA3_EPILOGUE_FIX is 0, VG_FA3_EPILOGUE_FOR declares nothing and FlashInfer's own
// epilogue runs.
#pragma once
#include "fi_facts.h"

#if VG_FI_FA3_EPILOGUE_FIX

namespace vg_fa3 {
// The same kernel traits under a distinct type: FlashInfer's primary epilogue template,
// instantiated for it, is the base the fixed one keeps everything else from.
template <typename Ktraits>
struct TwinTraits : Ktraits {};
}  // namespace vg_fa3

namespace flashinfer {

template <typename Ktraits>
struct VgCollectiveEpilogue : CollectiveEpilogue<vg_fa3::TwinTraits<Ktraits>> {
  using Base = CollectiveEpilogue<vg_fa3::TwinTraits<Ktraits>>;
  using typename Base::Params;
  using DTypeO = typename Base::DTypeO;
  static constexpr int CTA_Q = Base::CTA_Q;
  static constexpr int NUM_COPY_THREADS = Base::NUM_COPY_THREADS;
  static constexpr int NUM_MMA_THREADS = Base::NUM_MMA_THREADS;

  template <typename BlockCoord, typename SharedStorage, typename FrgTensorO, typename FrgTensorLSE,
            typename TiledMma>
  CUTLASS_DEVICE void store(Params const& params, FrgTensorO const& acc_o, FrgTensorLSE const& lse,
                            SharedStorage& shared_storage, TiledMma tiled_mma, int thread_idx,
                            BlockCoord const& block_coord) {
    const auto [qo_tile_idx, qo_head_idx, kv_head_idx, qo_indptr, kv_indptr, qo_len, kv_len, batch_idx] =
        block_coord;
    Tensor tile_o = make_tensor(make_smem_ptr(shared_storage.smem_o.data()), typename Base::SmemLayoutO{});
    auto to_smem = make_tiled_copy_C(typename Base::SmemCopyAtomO{}, tiled_mma);
    auto my_to_smem = to_smem.get_thread_slice(thread_idx);
    Tensor out = convert_type<DTypeO>(acc_o);

    // The tile's shared memory is the last V tile's: every consumer must be done reading it.
    cutlass::arch::NamedBarrier::sync(NUM_MMA_THREADS, static_cast<int>(NamedBarriers::kValueEmpty));
    cute::copy(to_smem, my_to_smem.retile_S(out), my_to_smem.partition_D(tile_o));
    // Every consumer's rows written before any consumer copies rows out: one sync, no arrive first.
    cutlass::arch::NamedBarrier::sync(NUM_MMA_THREADS, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);

    if (params.lse_ptr) {  // one thread per row (the fragment's first column) writes its row's LSE
      Tensor lse_tile = get_lse_local_tile_tensor(make_tensor(make_gmem_ptr(params.lse_ptr), params.layout_LSE),
                                                  Shape<Int<CTA_Q>>{}, qo_head_idx, qo_indptr, qo_len)(_, qo_tile_idx);
      Tensor coords = tiled_mma.get_thread_slice(thread_idx).partition_C(
          cute::make_identity_tensor(select<0, 1>(typename Base::TileShape_PDV{})));
      Tensor row_coords = coords(make_coord(_0{}, _, _0{}), _, _0{});
      static_assert(decltype(size(row_coords))::value == decltype(size(lse))::value, "one LSE per fragment row");
      if (get<1>(row_coords(_0{})) == 0) {
#pragma unroll
        for (int i = 0; i < size(lse); ++i) {
          const int row = get<0>(row_coords(i));
          if (row < qo_len - qo_tile_idx * CTA_Q) lse_tile(row) = lse(i);
        }
      }
    }
    typename Base::TiledCopyO to_global;
    write_O<NUM_COPY_THREADS>(params.O_ptr, to_global, params.layout_O, select<0, 1>(typename Base::TileShape_PDV{}),
                              tile_o, thread_idx, qo_tile_idx, qo_head_idx, qo_indptr, qo_len, /*unused*/ 0);
  }
};

}  // namespace flashinfer

// FlashInfer's AttentionKernelTraits<..., V<MASKED>> takes the fixed epilogue.
#define VG_FA3_EPILOGUE_FOR(VARIANT_TEMPLATE)                                                             \
  namespace flashinfer {                                                                                   \
  template <bool TMA_KV, int HD_QK, int HD_VO, int TILE_Q, int TILE_KV, int STAGES, typename DQ, typename DKV, \
            typename DO, typename ID, bool... FLAGS>                                                       \
  struct CollectiveEpilogue<                                                                               \
      AttentionKernelTraits<TMA_KV, HD_QK, HD_VO, TILE_Q, TILE_KV, STAGES, DQ, DKV, DO, ID, VARIANT_TEMPLATE<FLAGS...>>> \
      : VgCollectiveEpilogue<AttentionKernelTraits<TMA_KV, HD_QK, HD_VO, TILE_Q, TILE_KV, STAGES, DQ, DKV, DO, ID, \
                                                   VARIANT_TEMPLATE<FLAGS...>>> {};                        \
  }
#else
#define VG_FA3_EPILOGUE_FOR(VARIANT_TEMPLATE)
#endif  // VG_FI_FA3_EPILOGUE_FIX
