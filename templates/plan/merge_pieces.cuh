// Merging the partial outputs of rows that see several key intervals (planning/pieces.py): one
// pass that reads each split row's partial rows once and writes the merged row and its LSE.
// Static C++ (templates/plan/), exported as `merge_pieces` by every planning module
// (plan_module.h); wrappers/merge.py holds the same math in torch ops, the reference the GPU
// tests compare this kernel with.
//
// Why a kernel: in torch ops the merge of 57k split rows x 32 heads x 128 (streaming_sink at
// 8 x 8192 tokens) is a chain of gathers, casts and elementwise passes over float32 copies of the
// partial rows - about 18 GB of memory traffic, more than the attention itself. Here each thread
// owns VEC consecutive elements of one (row, head): it reads the row's piece LSEs (the same few
// floats for the whole head: cached), then its VEC elements of each present piece, and writes VEC
// outputs: one read of the partial rows and one write of the merged ones.
//
// The math, per row and head, over its pieces p < count (base-2 LSEs, as FlashInfer writes them):
//   top = max_p lse_p (0 where not finite), w_p = 2^(lse_p - top), total = sum_p w_p,
//   o = sum_{p: w_p != 0} w_p o_p / (total > 0 ? total : 1), lse = total > 0 ? top + log2(total) : -inf.
// A piece with no visible key (lse -inf, w 0) is not read: its partial row may never have been
// written. A NaN LSE (NaN logits in the row's request) gives a NaN weight, which is read and
// makes the row NaN, as the reference does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace vg_plan {

constexpr int kMergeThreads = 256;

struct MergeArgs {
  const char* parts;     // [pieces, parts_rows, heads, dim], contiguous
  const float* parts_lse;  // [pieces, parts_rows, heads], contiguous
  const int64_t* rows;   // [m]: the split rows
  const int64_t* counts;  // [m]: their piece counts
  char* out;             // [rows, heads, dim]; dim contiguous
  float* lse;            // [rows, heads] or null
  int64_t m, pieces, parts_rows, out_rows, heads, dim;
  int64_t out_stride_row, out_stride_head;  // in elements
  int64_t lse_stride_row, lse_stride_head;
};

template <typename T>
__device__ __forceinline__ float merge_to_float(T x) { return static_cast<float>(x); }
template <>
__device__ __forceinline__ float merge_to_float(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float merge_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T merge_from_float(float x) { return static_cast<T>(x); }
template <>
__device__ __forceinline__ __half merge_from_float(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 merge_from_float(float x) { return __float2bfloat16_rn(x); }

// VEC elements of T moved as one aligned load / store.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) MergeVec {
  T v[VEC];
};

// Index: the type the thread's (row, head, chunk) is decoded in - uint32_t wherever the threads'
// count fits (a 64-bit division costs several times a 32-bit one, three per thread); the offsets
// into the tensors stay 64-bit. The pieces' loop is unrolled to kMaxPieces with the row's count as
// a predicate: the weights stay in registers and a thread's loads of its pieces are in flight
// together.
template <typename T, int VEC, typename Index>
__global__ void merge_pieces_kernel(MergeArgs a) {
  const Index chunks = Index(a.dim / VEC), heads = Index(a.heads);
  const Index t = Index(blockIdx.x) * Index(blockDim.x) + Index(threadIdx.x);
  if (int64_t(t) >= a.m * a.heads * int64_t(chunks)) return;
  const Index chunk = t % chunks, rest = t / chunks;
  const int64_t head = int64_t(rest % heads), i = int64_t(rest / heads);
  const int64_t row = a.rows[i];
  if (row < 0 || row >= a.out_rows) return;  // (the planner's rows are in range: a guard, not a path)
  const int64_t n = a.counts[i] < a.pieces ? a.counts[i] : a.pieces;
  float w[vg_abi::kMaxPieces];
  float top = -INFINITY;
#pragma unroll
  for (int p = 0; p < vg_abi::kMaxPieces; ++p) {
    w[p] = p < n ? a.parts_lse[(p * a.parts_rows + row) * a.heads + head] : -INFINITY;
    top = fmaxf(top, w[p]);
    if (isnan(w[p])) top = w[p];  // (fmaxf drops a NaN: the reference's max keeps it)
  }
  if (!isfinite(top)) top = 0.f;
  float total = 0.f;
#pragma unroll
  for (int p = 0; p < vg_abi::kMaxPieces; ++p) {
    w[p] = p < n ? exp2f(w[p] - top) : 0.f;
    total += w[p];
  }
  MergeVec<T, VEC> x[vg_abi::kMaxPieces];
#pragma unroll
  for (int p = 0; p < vg_abi::kMaxPieces; ++p) {
    if (p < n && w[p] != 0.f) {  // (no visible key, or past the row's pieces: its partial row is not read)
      x[p] = *reinterpret_cast<const MergeVec<T, VEC>*>(
          a.parts + (((p * a.parts_rows + row) * a.heads + head) * a.dim + int64_t(chunk) * VEC) * sizeof(T));
    }
  }
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
#pragma unroll
  for (int p = 0; p < vg_abi::kMaxPieces; ++p) {
    if (p >= n || w[p] == 0.f) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += w[p] * merge_to_float(x[p].v[j]);
  }
  const float denom = total > 0.f ? total : 1.f;
  MergeVec<T, VEC> y;
#pragma unroll
  for (int j = 0; j < VEC; ++j) y.v[j] = merge_from_float<T>(acc[j] / denom);
  *reinterpret_cast<MergeVec<T, VEC>*>(
      a.out + (row * a.out_stride_row + head * a.out_stride_head + int64_t(chunk) * VEC) * sizeof(T)) = y;
  if (chunk == 0 && a.lse != nullptr) {
    a.lse[row * a.lse_stride_row + head * a.lse_stride_head] = total > 0.f ? top + log2f(total) : -INFINITY;
  }
}

template <typename T, int VEC>
inline void launch_merge_vec(const MergeArgs& a, int64_t threads, cudaStream_t stream) {
  const int64_t blocks = (threads + kMergeThreads - 1) / kMergeThreads;
  if (threads <= int64_t(UINT32_MAX) - kMergeThreads) {
    merge_pieces_kernel<T, VEC, uint32_t><<<blocks, kMergeThreads, 0, stream>>>(a);
  } else {
    merge_pieces_kernel<T, VEC, uint64_t><<<blocks, kMergeThreads, 0, stream>>>(a);
  }
}

template <typename T>
inline void launch_merge(const MergeArgs& a, bool vectorized, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int vec = vectorized ? kVec : 1;
  const int64_t threads = a.m * a.heads * (a.dim / vec);
  if (threads == 0) return;
  if (vectorized) {
    launch_merge_vec<T, kVec>(a, threads, stream);
  } else {
    launch_merge_vec<T, 1>(a, threads, stream);
  }
  check_launched("merge_pieces");
}

inline bool same_device(const TensorView& a, const TensorView& b) {
  return a.device().device_type == b.device().device_type && a.device().device_id == b.device().device_id;
}

// out [rows, heads, dim] (and lse [rows, heads], float32) from parts [pieces, >= rows, heads, dim]
// (out's dtype) and parts_lse float32 [pieces, parts rows, heads], both contiguous; rows and
// counts: int64 [m] on out's GPU, every row < out's rows (the planner's merge_rows), every count
// in 1..pieces. Runs on the current stream; no sync.
inline void merge_pieces(const TensorView& out, const tvm::ffi::Optional<TensorView>& lse, const TensorView& parts,
                         const TensorView& parts_lse, const TensorView& rows, const TensorView& counts) {
  VG_REQUIRE(out.device().device_type == kDLCUDA) << "merge_pieces: out: expected a CUDA tensor";
  VG_REQUIRE(out.ndim() == 3 && out.stride(2) == 1) << "merge_pieces: out: expected [rows, heads, dim], dim contiguous";
  VG_REQUIRE(parts.ndim() == 4 && parts.IsContiguous() && parts.dtype() == out.dtype() && same_device(parts, out) &&
             parts.size(1) >= out.size(0) && parts.size(2) == out.size(1) && parts.size(3) == out.size(2))
      << "merge_pieces: parts: expected contiguous [pieces, >= rows, heads, dim] in out's dtype on its GPU";
  const int64_t pieces = parts.size(0);
  VG_REQUIRE(pieces >= 1 && pieces <= vg_abi::kMaxPieces) << "merge_pieces: " << pieces << " pieces (1.."
                                                          << vg_abi::kMaxPieces << ")";
  VG_REQUIRE(parts_lse.dtype() == dl_float32 && parts_lse.IsContiguous() && parts_lse.ndim() == 3 &&
             parts_lse.size(0) == pieces && parts_lse.size(1) == parts.size(1) && parts_lse.size(2) == out.size(1) &&
             same_device(parts_lse, out))
      << "merge_pieces: parts_lse: expected contiguous float32 [pieces, parts rows, heads] on out's GPU";
  VG_REQUIRE(rows.dtype() == dl_int64 && counts.dtype() == dl_int64 && rows.ndim() == 1 && counts.ndim() == 1 &&
             rows.IsContiguous() && counts.IsContiguous() && rows.numel() == counts.numel() &&
             same_device(rows, out) && same_device(counts, out))
      << "merge_pieces: rows and counts: expected int64 [m] each on out's GPU";
  MergeArgs a{};
  a.parts = static_cast<const char*>(parts.data_ptr());
  a.parts_lse = static_cast<const float*>(parts_lse.data_ptr());
  a.rows = static_cast<const int64_t*>(rows.data_ptr());
  a.counts = static_cast<const int64_t*>(counts.data_ptr());
  a.out = static_cast<char*>(out.data_ptr());
  a.m = rows.numel();
  a.pieces = pieces;
  a.parts_rows = parts.size(1);
  a.out_rows = out.size(0);
  a.heads = out.size(1);
  a.dim = out.size(2);
  a.out_stride_row = out.stride(0);
  a.out_stride_head = out.stride(1);
  if (lse.has_value()) {
    const TensorView& l = lse.value();
    VG_REQUIRE(l.dtype() == dl_float32 && l.ndim() == 2 && l.size(0) == out.size(0) && l.size(1) == out.size(1) &&
               same_device(l, out))
        << "merge_pieces: lse: expected float32 [rows, heads] on out's GPU";
    a.lse = static_cast<float*>(l.data_ptr());
    a.lse_stride_row = l.stride(0);
    a.lse_stride_head = l.stride(1);
  }
  if (a.m == 0) return;
  const int64_t elem = get_element_size(out);
  const int64_t vec = 16 / elem;
  // 16-byte loads and stores where every (row, head) starts on 16 bytes: the common case (dims a
  // multiple of 8 halves); element by element otherwise.
  const bool vectorized = a.dim % vec == 0 && a.out_stride_row % vec == 0 && a.out_stride_head % vec == 0 &&
                          reinterpret_cast<uintptr_t>(a.out) % 16 == 0 && reinterpret_cast<uintptr_t>(a.parts) % 16 == 0;
  ffi::CUDADeviceGuard device_guard(out.device().device_id);
  const cudaStream_t stream = get_stream(out.device());
  const DLDataType dt = out.dtype();
  if (dt == dl_float16) {
    launch_merge<__half>(a, vectorized, stream);
  } else if (dt == dl_bfloat16) {
    launch_merge<__nv_bfloat16>(a, vectorized, stream);
  } else if (dt == dl_float32) {
    launch_merge<float>(a, vectorized, stream);
  } else {
    VG_REQUIRE(false) << "merge_pieces: out: expected float16, bfloat16 or float32";
  }
}

}  // namespace vg_plan
