// The page gather of a plan, on the device: each launch's page list from ranges of the
// caller's page list (the launch builder's table). Static C++ (templates/plan/).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace vg_plan {

constexpr int kGatherThreads = 256;

inline void check_launched(const char* what) {
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "variantgen " << what << " launch failed: " << cudaGetErrorString(err);
}

// table: int32 [3, ranges] = (first output entry, shift into kv_indices, count) per range, first
// entries ascending. out[k] = kv_indices[k + shift[i]] for the range i holding k; entries in
// no range (CUDA-graph mode leaves room between launch slots) are not written.
__global__ void gather_pages_kernel(const int32_t* __restrict__ kv_indices, const int32_t* __restrict__ table,
                                    int64_t ranges, int64_t extent, int32_t* __restrict__ out) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= extent) return;
  const int32_t* first = table;
  const int32_t* shift = table + ranges;
  const int32_t* count = table + 2 * ranges;
  if (k < first[0]) return;
  int64_t lo = 0, hi = ranges - 1;  // the last range with first <= k
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first[mid] <= k) lo = mid; else hi = mid - 1;
  }
  if (k < first[lo] + count[lo]) out[k] = kv_indices[k + shift[lo]];
}

inline void launch_gather(const int32_t* kv_indices, const int32_t* table, int64_t ranges, int64_t extent,
                          int32_t* out, cudaStream_t stream) {
  if (ranges == 0 || extent == 0) return;
  const int64_t blocks = (extent + kGatherThreads - 1) / kGatherThreads;
  gather_pages_kernel<<<blocks, kGatherThreads, 0, stream>>>(kv_indices, table, ranges, extent, out);
  check_launched("gather_pages");
}

}  // namespace vg_plan
