// plan()'s one read-back of the index tensors it was given on a GPU: the indptrs and lengths
// back to back, and the (min, max) of the batch's page list kv_indices[:kv_indptr[-1]], in one
// kernel and one copy to the host - instead of a reduction, a concatenation and a copy in torch
// (three kernels and their host dispatch on every plan()). The bounds let plan() refuse a
// negative page at once (checks.py). Static C++ (templates/plan/). Including it exports
// `read_indices`: every module that plans does, once (plan_module.h, the fa2 decode binding),
// after tvm_ffi_utils.h.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tvm/ffi/container/array.h"
#include "vg_plan_abi.h"

namespace vg_plan {

constexpr int kReadThreads = 256;
constexpr int kReadMaxBlocks = 128;
constexpr int kReadParts = 3;
constexpr int64_t kReadBoundsBytes = 2 * sizeof(unsigned long long);

struct IndexParts {
  const int32_t* src[kReadParts];
  int64_t count[kReadParts];
};

// A page index as a key that atomicMax can fold from a zeroed word: 0 means "no entry seen".
// high = v + 2^31 + 1 (the largest v wins), low = 2^31 - v (the smallest v wins); both in [1, 2^32].
// The host reads the page list's bounds back with the inverses (ReadIndices below).
constexpr int64_t kHighKeyBias = (int64_t(1) << 31) + 1;
constexpr int64_t kLowKeyBias = int64_t(1) << 31;
__device__ __forceinline__ unsigned long long high_key(int32_t v) {
  return static_cast<unsigned long long>(int64_t(v) + kHighKeyBias);
}
__device__ __forceinline__ unsigned long long low_key(int32_t v) {
  return static_cast<unsigned long long>(kLowKeyBias - int64_t(v));
}

// out: the parts back to back (int32); bounds: (low key, high key), zeroed before the launch.
// Entries of kv_indices past kv_indptr[-1] (a caller's larger buffer) are not read.
__global__ void read_indices_kernel(IndexParts parts, const int32_t* __restrict__ kv_indices, int64_t kv_numel,
                                    const int32_t* __restrict__ kv_end, int32_t* __restrict__ out,
                                    unsigned long long* __restrict__ bounds) {
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t at = 0;
  for (int p = 0; p < kReadParts; ++p) {
    for (int64_t i = first; i < parts.count[p]; i += stride) out[at + i] = parts.src[p][i];
    at += parts.count[p];
  }
  const int64_t n = min(max(int64_t(*kv_end), int64_t(0)), kv_numel);
  unsigned long long low = 0, high = 0;
  for (int64_t i = first; i < n; i += stride) {
    const int32_t v = kv_indices[i];
    low = max(low, low_key(v));
    high = max(high, high_key(v));
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    low = max(low, __shfl_down_sync(0xffffffffu, low, offset));
    high = max(high, __shfl_down_sync(0xffffffffu, high, offset));
  }
  if ((threadIdx.x & 31) == 0 && high != 0) {
    atomicMax(&bounds[0], low);
    atomicMax(&bounds[1], high);
  }
}

inline void check_index_tensor(const TensorView& t, const char* name, const DLDevice& device) {
  TVM_FFI_ICHECK(t.dtype() == dl_int32 && t.ndim() == 1 && t.IsContiguous())
      << "read_indices: " << name << ": expected a contiguous 1-D int32 tensor";
  TVM_FFI_ICHECK(t.device().device_type == kDLCUDA && t.device().device_id == device.device_id)
      << "read_indices: " << name << ": expected it on the page list's GPU";
}

// Where the bounds' keys sit in scratch (and in host, which receives scratch's first bytes as they are).
inline int64_t bounds_offset(int64_t total) { return (4 * total + 7) / 8 * 8; }

// The int32 entries host and scratch hold for `total` entries of index tensors (the plan ABI's
// kReadIndicesExtra past them, which plan() allocates).
inline int64_t host_entries(int64_t total) { return total + vg_abi::kReadIndicesExtra; }
static_assert(4 * vg_abi::kReadIndicesExtra >= 4 + kReadBoundsBytes, "room for the bounds after 4 bytes of padding");

// host (int32, on the CPU) gets the parts back to back, then the page list's (min, max); with no
// entry (kv_indptr[-1] <= 0) both are 0 and plan() does not read them. scratch: device uint8 of
// at least host_entries(total) x 4 bytes. Returns once host holds them (one copy, one wait).
inline void read_indices(const TensorView& kv_indices, const TensorView& kv_indptr, const TensorView& part0,
                         const tvm::ffi::Optional<TensorView>& part1, const tvm::ffi::Optional<TensorView>& part2,
                         const TensorView& scratch, const TensorView& host) {
  const DLDevice device = kv_indices.device();
  check_index_tensor(kv_indices, "kv_indices", device);
  check_index_tensor(kv_indptr, "kv_indptr", device);
  TVM_FFI_ICHECK(kv_indptr.numel() >= 1) << "read_indices: kv_indptr is empty";
  IndexParts parts{};
  int64_t total = 0;
  int used = 0;
  auto add = [&](const TensorView& t) {
    check_index_tensor(t, "index tensor", device);
    parts.src[used] = static_cast<const int32_t*>(t.data_ptr());
    parts.count[used++] = t.numel();
    total += t.numel();
  };
  add(part0);
  if (part1.has_value()) add(part1.value());
  if (part2.has_value()) add(part2.value());
  const int64_t bytes = 4 * host_entries(total);
  TVM_FFI_ICHECK(scratch.dtype() == dl_uint8 && scratch.IsContiguous() && scratch.device().device_type == kDLCUDA &&
                 scratch.device().device_id == device.device_id && scratch.numel() >= bytes)
      << "read_indices: scratch: expected " << bytes << " bytes on the page list's GPU";
  TVM_FFI_ICHECK(host.dtype() == dl_int32 && host.IsContiguous() && host.device().device_type == kDLCPU &&
                 4 * host.numel() >= bytes)
      << "read_indices: host: expected int32 [" << bytes / 4 << "] on the CPU";
  ffi::CUDADeviceGuard device_guard(device.device_id);
  const cudaStream_t stream = get_stream(device);
  char* base = static_cast<char*>(scratch.data_ptr());
  TVM_FFI_ICHECK(reinterpret_cast<uintptr_t>(base) % 8 == 0) << "read_indices: scratch: expected 8-byte alignment";
  auto* bounds = reinterpret_cast<unsigned long long*>(base + bounds_offset(total));  // 8-byte aligned
  TVM_FFI_ICHECK(cudaMemsetAsync(bounds, 0, kReadBoundsBytes, stream) == cudaSuccess) << "read_indices: memset failed";
  const int64_t work = std::max<int64_t>(kv_indices.numel(), total);
  const int blocks = int(std::min<int64_t>(kReadMaxBlocks, std::max<int64_t>(1, (work + 8 * kReadThreads - 1) /
                                                                                   (8 * kReadThreads))));
  read_indices_kernel<<<blocks, kReadThreads, 0, stream>>>(
      parts, static_cast<const int32_t*>(kv_indices.data_ptr()), kv_indices.numel(),
      static_cast<const int32_t*>(kv_indptr.data_ptr()) + (kv_indptr.numel() - 1), reinterpret_cast<int32_t*>(base),
      bounds);
  const cudaError_t launched = cudaGetLastError();
  TVM_FFI_ICHECK(launched == cudaSuccess) << "variantgen read_indices launch failed: " << cudaGetErrorString(launched);
  char* out = static_cast<char*>(host.data_ptr());
  TVM_FFI_ICHECK(cudaMemcpyAsync(out, base, bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
                 cudaStreamSynchronize(stream) == cudaSuccess)
      << "read_indices: copy to the host failed";
  unsigned long long keys[2];
  std::memcpy(keys, out + bounds_offset(total), sizeof(keys));
  int32_t* values = reinterpret_cast<int32_t*>(out);
  const bool any = keys[1] != 0;
  values[total] = any ? int32_t(kLowKeyBias - int64_t(keys[0])) : 0;  // (low_key's inverse)
  values[total + 1] = any ? int32_t(int64_t(keys[1]) - kHighKeyBias) : 0;  // (high_key's inverse)
}

}  // namespace vg_plan

// The exported entry point (one per module: this header is included by one unit).
inline void VgReadIndices(TensorView kv_indices, TensorView kv_indptr, TensorView part0,
                          tvm::ffi::Optional<TensorView> part1, tvm::ffi::Optional<TensorView> part2,
                          TensorView scratch, TensorView host) {
  vg_plan::read_indices(kv_indices, kv_indptr, part0, part1, part2, scratch, host);
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(read_indices, VgReadIndices);
