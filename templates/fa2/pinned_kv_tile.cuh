// Static source of variantgen's fa2 modules (copied as is into each module's sources).
//
// Included first by an fa2 prefill kernel unit of a module built for an arch whose devices all
// have the same shared memory (sm90), after the unit defines VG_FA2_NUM_MMA_KV.
//
// FlashInfer's fa2 prefill dispatch picks its KV tile (NUM_MMA_KV: 8, 4, 2 or 1) from the
// device's shared memory at run time, so it instantiates its kernel four times; on such an arch
// it always picks the same one (variantgen/codegen/kv_tile.py says which). Its DISPATCH_NUM_MMA_KV is
// replaced here, before its prefill.cuh is parsed, by one that instantiates that tile only - a
// quarter of the kernels, about a quarter less build time per unit. Should a device still ask
// for another tile, the launch is refused with an error naming both tiles: no kernel ever runs
// with a tile it was not built for.
#pragma once
#include <flashinfer/utils.cuh>  // FlashInfer's DISPATCH_NUM_MMA_KV, replaced below

#include <sstream>
#include <string>

namespace vg {

// The tile FlashInfer's dispatch takes for the largest tile the device has room for.
inline constexpr uint32_t Fa2MmaKvStep(uint32_t most) {
  return most >= 8 ? 8 : most >= 4 ? 4 : most >= 2 ? 2 : most >= 1 ? 1 : 0;
}

inline std::string Fa2MmaKvMismatch(uint32_t most) {
  std::ostringstream err;
  err << "variantgen: this fa2 kernel unit was built for NUM_MMA_KV=" << VG_FA2_NUM_MMA_KV
      << " (the KV tile of every device of its arch), but this device's shared memory gives "
      << "NUM_MMA_KV=" << Fa2MmaKvStep(most) << "; rebuild the module for this device's arch";
  return err.str();
}

}  // namespace vg

#undef DISPATCH_NUM_MMA_KV
#define DISPATCH_NUM_MMA_KV(max_mma_kv, NUM_MMA_KV, ...)                  \
  if (vg::Fa2MmaKvStep(max_mma_kv) == VG_FA2_NUM_MMA_KV) {              \
    constexpr size_t NUM_MMA_KV = VG_FA2_NUM_MMA_KV;                     \
    __VA_ARGS__                                                          \
  } else {                                                               \
    FLASHINFER_ERROR(vg::Fa2MmaKvMismatch(max_mma_kv));                  \
  }
