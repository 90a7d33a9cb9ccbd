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
#include <initializer_list>

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

// The merge weights' rules, shared by both kernels (wrappers/merge.py's reference has the same):
// the max of the pieces' LSEs keeps a NaN (fmaxf would drop it); the weights are taken against
// that max, or against 0 where it is not finite (every piece empty, or a NaN that the weights
// then carry into the row); the merged LSE is -inf where no piece has a visible key.
__device__ __forceinline__ float lse_max(float a, float b) { return isnan(a) || isnan(b) ? NAN : fmaxf(a, b); }
__device__ __forceinline__ float weight_shift(float top) { return isfinite(top) ? top : 0.f; }
__device__ __forceinline__ float merged_lse(float shift, float total) {
  return total > 0.f ? shift + log2f(total) : -INFINITY;
}

// f(T{}) for the 16- and 32-bit float dtype `dt` (`what` names the tensor in the error).
template <typename F>
inline void with_float_type(DLDataType dt, const char* what, F&& f) {
  if (dt == dl_float16) {
    f(__half{});
  } else if (dt == dl_bfloat16) {
    f(__nv_bfloat16{});
  } else if (dt == dl_float32) {
    f(float{});
  } else {
    VG_REQUIRE(false) << what << ": expected float16, bfloat16 or float32";
  }
}

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
    top = lse_max(top, w[p]);
  }
  top = weight_shift(top);
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
    a.lse[row * a.lse_stride_row + head * a.lse_stride_head] = merged_lse(top, total);
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
  with_float_type(out.dtype(), "merge_pieces: out", [&](auto zero) {
    launch_merge<decltype(zero)>(a, vectorized, stream);
  });
}

// ---------------------------------------------------------------------------------------
// The inline mode (merge_inline): rows whose first key interval is a few keys (StreamingLLM's
// sinks: pieces.py's INLINE_KEYS) and whose other interval ran in place. A launch over a few keys
// costs a whole key tile per query tile and a partial output that the merge reads back; here the
// merge computes that piece itself - q . k of its keys, their softmax and values - and merges it
// into the row the in-place launch wrote (o, and its LSE in lse_in).
//
// The kernel is a pass over q and o (read q, read o, write o: 1.5x merge_pieces' reads of two
// partial rows and write of one), so it is written for memory-level parallelism: a group of G
// lanes owns one (row, head), each lane 16 bytes of it (G = 16 at head dim 128 in 16-bit types:
// two rows per warp), and every load that does not depend on another is issued before any is
// used - q, o and the row's LSE first, then a chunk of keys' page lookups, then the chunk's K and
// V rows together. A (row, head) costs the latency of three dependent loads, whatever its keys.
// The scores: q . k reduced across the group's lanes (a chunk's dot products together), softmax
// online over the chunks. Specs with a logits transform, a learned sink or fp8 scales never take
// this mode (the plan's rule): the scores are q . k x sm_scale.
struct InlineArgs {
  char* out;               // [rows, heads, dim]: the in-place launch's o, overwritten by the merge
  const float* lse_in;     // [rows, heads]: its LSE (base 2)
  float* lse_out;          // [rows, heads] or null
  const char* q;           // [rows, heads, dim] (q as the launches read it: packed with GQA packing)
  const char* k;           // the paged cache, by the strides below
  const char* v;
  const int32_t* kv_indices;
  const int64_t* rows;         // [m] rows of out
  const int32_t* first_entry;  // [m] entry of kv_indices holding the piece's first key
  const int32_t* first_slot;   // [m] its slot in that page
  const int32_t* keys;         // [m] keys of the piece (1 .. kMaxInlineKeys)
  int64_t m, out_rows, heads, dim, page_size, num_pages, num_entries, kv_head_div;
  int64_t out_stride_row, out_stride_head, lse_in_stride_row, lse_in_stride_head, lse_out_stride_row,
      lse_out_stride_head, q_stride_row, q_stride_head;
  int64_t k_stride_page, k_stride_slot, k_stride_head, v_stride_page, v_stride_slot, v_stride_head;  // elements
  float sm_scale_log2, v_scale;  // (the launches' scale of the scores, and of the values: fp8's v_scale)
};

constexpr int kMaxInlineKeys = 64;  // (the plan's INLINE_KEYS is smaller: a guard, not a limit it meets)

// A lane's share of one row of `dim` elements: E consecutive elements as one aligned vector
// (E > 0), or (E = 0: any dim and alignment) elements lane, lane + 32, ... up to 8 of them.
template <typename T, int E>
using LaneFrag = MergeVec<T, (E > 0 ? E : 8)>;

template <typename T, int E, int LANES>
__device__ __forceinline__ LaneFrag<T, E> load_frag(const T* row, int lane, int64_t dim) {
  LaneFrag<T, E> f;
  if constexpr (E > 0) {
    f = *reinterpret_cast<const LaneFrag<T, E>*>(row + lane * E);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int64_t at = int64_t(e) * LANES + lane;
      f.v[e] = at < dim ? row[at] : merge_from_float<T>(0.f);
    }
  }
  return f;
}

template <typename T, int E, int LANES>
__device__ __forceinline__ void store_frag(T* row, int lane, int64_t dim, const float* x) {
  LaneFrag<T, E> f;
#pragma unroll
  for (int e = 0; e < (E > 0 ? E : 8); ++e) f.v[e] = merge_from_float<T>(x[e]);
  if constexpr (E > 0) {
    *reinterpret_cast<LaneFrag<T, E>*>(row + lane * E) = f;
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int64_t at = int64_t(e) * LANES + lane;
      if (at < dim) row[at] = f.v[e];
    }
  }
}

// E elements per lane and G lanes per (row, head): dim = E x G, or E = 0 and G = 32 (dims up to
// 256, element by element).
template <typename T, int E, int G>
__global__ void merge_inline_kernel(InlineArgs a) {
  static_assert(G == 4 || G == 8 || G == 16 || G == 32, "a (row, head) is a power-of-two part of a warp");
  constexpr int kSlots = E > 0 ? E : 8;
  constexpr int kChunk = E > 4 || E == 0 ? 4 : 8;  // keys whose K and V rows are in flight together
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = int(threadIdx.x % G);
  const int64_t item = thread / G;
  // Every lane runs to the end: the shuffles are warp-wide. A lane past the (row, head) items, or
  // of a row out of range (the planner's rows are in range: a guard, not a path), computes on
  // item 0's indices and stores nothing.
  const bool in_items = item < a.m * a.heads;
  // (m x heads < 2^31, checked at the binding: 32-bit division, several times cheaper than 64-bit)
  const int32_t it = in_items ? int32_t(item) : 0, heads32 = int32_t(a.heads);
  const int32_t i = it / heads32, head = it % heads32;
  int64_t row = a.rows[i];
  const bool valid = in_items && row >= 0 && row < a.out_rows;
  if (!valid) row = 0;
  const int32_t n_keys = valid ? min(a.keys[i], kMaxInlineKeys) : 0;
  const int32_t ps = int32_t(a.page_size), first_slot = a.first_slot[i], first_entry = a.first_entry[i];
  const int32_t last_entry = int32_t(a.num_entries - 1), last_page = int32_t(a.num_pages - 1);
  const int64_t kv_head = head / a.kv_head_div;
  // The loads of the row itself, independent of the keys: in flight while the keys are looked up.
  T* out = reinterpret_cast<T*>(a.out) + row * a.out_stride_row + head * a.out_stride_head;
  const LaneFrag<T, E> qf = load_frag<T, E, G>(
      reinterpret_cast<const T*>(a.q) + row * a.q_stride_row + head * a.q_stride_head, lane, a.dim);
  const LaneFrag<T, E> base = load_frag<T, E, G>(out, lane, a.dim);
  const float lse_b = a.lse_in[row * a.lse_in_stride_row + head * a.lse_in_stride_head];
  // The chunks' count is the warp's most keys (a loop the whole warp runs); a group's keys past its
  // own count score -inf.
  int32_t warp_keys = n_keys;
#pragma unroll
  for (int o = 16; o >= G; o >>= 1) warp_keys = max(warp_keys, __shfl_xor_sync(0xffffffffu, warp_keys, o));
  float mx = -INFINITY, d = 0.f, acc[kSlots];
#pragma unroll
  for (int e = 0; e < kSlots; ++e) acc[e] = 0.f;
  for (int32_t j0 = 0; j0 < warp_keys; j0 += kChunk) {
    LaneFrag<T, E> kf[kChunk], vf[kChunk];
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      // (a key past the group's last: its first key again, loaded and unused)
      const int32_t pos = first_slot + (j0 + c < n_keys ? j0 + c : 0);
      const int32_t entry = min(first_entry + pos / ps, last_entry);
      const int64_t page = max(0, min(a.kv_indices[entry], last_page));  // (run() checks them; clamped in flight)
      const int64_t slot = pos % ps;
      kf[c] = load_frag<T, E, G>(reinterpret_cast<const T*>(a.k) + page * a.k_stride_page + slot * a.k_stride_slot +
                                     kv_head * a.k_stride_head, lane, a.dim);
      vf[c] = load_frag<T, E, G>(reinterpret_cast<const T*>(a.v) + page * a.v_stride_page + slot * a.v_stride_slot +
                                     kv_head * a.v_stride_head, lane, a.dim);
    }
    float s[kChunk];
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      s[c] = 0.f;
#pragma unroll
      for (int e = 0; e < kSlots; ++e) s[c] += merge_to_float(qf.v[e]) * merge_to_float(kf[c].v[e]);
    }
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1)
#pragma unroll
      for (int c = 0; c < kChunk; ++c) s[c] += __shfl_xor_sync(0xffffffffu, s[c], o);
    float m_new = mx;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      s[c] = j0 + c < n_keys ? s[c] * a.sm_scale_log2 : -INFINITY;
      m_new = fmaxf(m_new, s[c]);
    }
    // (no score yet, e.g. a chunk past the group's keys: weights against 0, so a masked key's is 0
    // and a NaN score's NaN, as the reference has them)
    const float m_ref = m_new == -INFINITY ? 0.f : m_new;
    const float rescale = exp2f(mx - m_ref);  // (0 while mx is -inf)
    d *= rescale;
#pragma unroll
    for (int e = 0; e < kSlots; ++e) acc[e] *= rescale;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      const float pc = exp2f(s[c] - m_ref);  // (0 for the keys past the group's last)
      d += pc;
#pragma unroll
      for (int e = 0; e < kSlots; ++e) acc[e] += pc * merge_to_float(vf[c].v[e]);
    }
    mx = m_new;
  }
  // The inline piece: o_i = acc / d, lse_i = mx + log2(d); the base: the in-place row.
  const float lse_i = d > 0.f ? mx + log2f(d) : -INFINITY;
  const float shift = weight_shift(lse_max(lse_b, lse_i));
  const float w_b = exp2f(lse_b - shift), w_i = exp2f(lse_i - shift);
  const float total = w_b + w_i;
  const float denom = total > 0.f ? total : 1.f;
  float merged[kSlots];
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    // (no visible key in the base: its row may never have been written, and is not used)
    const float from_base = w_b != 0.f ? w_b * merge_to_float(base.v[e]) : 0.f;
    const float own = w_i != 0.f ? w_i * (acc[e] / d) * a.v_scale : 0.f;
    merged[e] = (from_base + own) / denom;
  }
  if (valid) store_frag<T, E, G>(out, lane, a.dim, merged);
  __syncwarp();  // (every lane read lse_in before a group's first lane writes lse_out: they may be one tensor)
  if (valid && lane == 0 && a.lse_out != nullptr)
    a.lse_out[row * a.lse_out_stride_row + head * a.lse_out_stride_head] = merged_lse(shift, total);
}

template <typename T, int E, int G>
inline void launch_inline_groups(const InlineArgs& a, cudaStream_t stream) {
  const int64_t threads = a.m * a.heads * G;
  merge_inline_kernel<T, E, G><<<(threads + kMergeThreads - 1) / kMergeThreads, kMergeThreads, 0, stream>>>(a);
}

// `lane_elems`: the elements of a lane's aligned vector (0: element by element).
template <typename T>
inline void launch_inline(const InlineArgs& a, int64_t lane_elems, cudaStream_t stream) {
  if (a.m * a.heads == 0) return;
  constexpr int kVec = 16 / sizeof(T);  // a 16-byte vector
  if constexpr (sizeof(T) == 2) {
    if (lane_elems == kVec && a.dim == 8 * kVec) {
      launch_inline_groups<T, kVec, 8>(a, stream);
    } else if (lane_elems == kVec && a.dim == 16 * kVec) {
      launch_inline_groups<T, kVec, 16>(a, stream);
    } else if (lane_elems == kVec && a.dim == 32 * kVec) {
      launch_inline_groups<T, kVec, 32>(a, stream);
    } else {
      launch_inline_groups<T, 0, 32>(a, stream);
    }
  } else {
    if (lane_elems == kVec && a.dim == 16 * kVec) {
      launch_inline_groups<T, kVec, 16>(a, stream);
    } else if (lane_elems == kVec && a.dim == 32 * kVec) {
      launch_inline_groups<T, kVec, 32>(a, stream);
    } else if (lane_elems == 2 * kVec && a.dim == 64 * kVec) {
      launch_inline_groups<T, 2 * kVec, 32>(a, stream);  // (head dim 256: two vectors a lane)
    } else {
      launch_inline_groups<T, 0, 32>(a, stream);
    }
  }
  check_launched("merge_inline");
}

// out [rows, heads, dim] (dim contiguous) holding the in-place launch's rows and lse_in float32
// [rows, heads] their LSE; q [rows, heads, dim_qk == dim] as the launches read it; k_cache /
// v_cache the paged cache (NHD [pages, page, kv heads, dim] or, with hnd, [pages, kv heads, page,
// dim]; out's dtype); kv_indices int32 the caller's page list; rows int64 and first_entry /
// first_slot / keys int32 [m] on out's GPU. Runs on the current stream; no sync.
inline void merge_inline(const TensorView& out, const TensorView& lse_in, const tvm::ffi::Optional<TensorView>& lse_out,
                         const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                         const TensorView& kv_indices, const TensorView& rows, const TensorView& first_entry,
                         const TensorView& first_slot, const TensorView& keys, double sm_scale, double v_scale,
                         int64_t kv_head_div, bool hnd) {
  VG_REQUIRE(out.device().device_type == kDLCUDA && out.ndim() == 3 && out.stride(2) == 1)
      << "merge_inline: out: expected a CUDA [rows, heads, dim], dim contiguous";
  VG_REQUIRE(q.ndim() == 3 && q.size(0) >= out.size(0) && q.size(1) == out.size(1) && q.size(2) == out.size(2) &&
             q.stride(2) == 1 && q.dtype() == out.dtype() && same_device(q, out))
      << "merge_inline: q: expected [>= rows, heads, dim] in out's dtype on its GPU";
  VG_REQUIRE(lse_in.dtype() == dl_float32 && lse_in.ndim() == 2 && lse_in.size(0) >= out.size(0) &&
             lse_in.size(1) == out.size(1) && same_device(lse_in, out))
      << "merge_inline: lse_in: expected float32 [rows, heads] on out's GPU";
  VG_REQUIRE(k_cache.ndim() == 4 && v_cache.ndim() == 4 && k_cache.dtype() == out.dtype() &&
             v_cache.dtype() == out.dtype() && k_cache.size(3) == out.size(2) && v_cache.size(3) == out.size(2) &&
             k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && same_device(k_cache, out) && same_device(v_cache, out))
      << "merge_inline: k_cache / v_cache: expected [pages, ..., dim] in out's dtype, dim contiguous, on out's GPU";
  VG_REQUIRE(kv_indices.dtype() == dl_int32 && kv_indices.ndim() == 1 && kv_indices.IsContiguous() &&
             kv_indices.numel() >= 1 && same_device(kv_indices, out))
      << "merge_inline: kv_indices: expected int32 [entries] on out's GPU";
  VG_REQUIRE(rows.dtype() == dl_int64 && rows.ndim() == 1 && rows.IsContiguous() && same_device(rows, out))
      << "merge_inline: rows: expected int64 [m] on out's GPU";
  for (const TensorView* t : {&first_entry, &first_slot, &keys})
    VG_REQUIRE(t->dtype() == dl_int32 && t->ndim() == 1 && t->IsContiguous() && t->numel() == rows.numel() &&
               same_device(*t, out))
        << "merge_inline: first_entry / first_slot / keys: expected int32 [m] on out's GPU";
  const int64_t kv_heads = hnd ? k_cache.size(1) : k_cache.size(2);
  VG_REQUIRE(kv_head_div >= 1 && (out.size(1) - 1) / kv_head_div < kv_heads)
      << "merge_inline: kv_head_div " << kv_head_div << " maps heads past the cache's " << kv_heads;
  InlineArgs a{};
  a.out = static_cast<char*>(out.data_ptr());
  a.lse_in = static_cast<const float*>(lse_in.data_ptr());
  a.q = static_cast<const char*>(q.data_ptr());
  a.k = static_cast<const char*>(k_cache.data_ptr());
  a.v = static_cast<const char*>(v_cache.data_ptr());
  a.kv_indices = static_cast<const int32_t*>(kv_indices.data_ptr());
  a.rows = static_cast<const int64_t*>(rows.data_ptr());
  a.first_entry = static_cast<const int32_t*>(first_entry.data_ptr());
  a.first_slot = static_cast<const int32_t*>(first_slot.data_ptr());
  a.keys = static_cast<const int32_t*>(keys.data_ptr());
  a.m = rows.numel();
  a.out_rows = out.size(0);
  a.heads = out.size(1);
  a.dim = out.size(2);
  a.page_size = hnd ? k_cache.size(2) : k_cache.size(1);
  a.num_pages = k_cache.size(0);
  a.num_entries = kv_indices.numel();
  a.kv_head_div = kv_head_div;
  a.out_stride_row = out.stride(0);
  a.out_stride_head = out.stride(1);
  a.lse_in_stride_row = lse_in.stride(0);
  a.lse_in_stride_head = lse_in.stride(1);
  a.q_stride_row = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.k_stride_page = k_cache.stride(0);
  a.k_stride_slot = hnd ? k_cache.stride(2) : k_cache.stride(1);
  a.k_stride_head = hnd ? k_cache.stride(1) : k_cache.stride(2);
  a.v_stride_page = v_cache.stride(0);
  a.v_stride_slot = hnd ? v_cache.stride(2) : v_cache.stride(1);
  a.v_stride_head = hnd ? v_cache.stride(1) : v_cache.stride(2);
  a.sm_scale_log2 = float(sm_scale * 1.4426950408889634);
  a.v_scale = float(v_scale);
  if (lse_out.has_value()) {
    const TensorView& l = lse_out.value();
    VG_REQUIRE(l.dtype() == dl_float32 && l.ndim() == 2 && l.size(0) >= out.size(0) && l.size(1) == out.size(1) &&
               same_device(l, out))
        << "merge_inline: lse_out: expected float32 [rows, heads] on out's GPU";
    a.lse_out = static_cast<float*>(l.data_ptr());
    a.lse_out_stride_row = l.stride(0);
    a.lse_out_stride_head = l.stride(1);
  }
  VG_REQUIRE(a.dim <= 256) << "merge_inline: head dim " << a.dim << " (at most 256)";
  VG_REQUIRE(a.m * a.heads < (int64_t(1) << 31) && a.num_pages < (int64_t(1) << 31) &&
             a.num_entries < (int64_t(1) << 31) && a.page_size < (int64_t(1) << 30))
      << "merge_inline: rows x heads, pages, page-list entries and the page size must fit 32-bit indices";
  if (a.m == 0 || a.out_rows == 0) return;  // (lanes past the items read row 0)
  // A lane's 16 bytes of a row (32 at fp32's head dim 256) as one vector where every row, head and
  // key starts on that size (head dims 64, 128 and 256 with tensors as the wrappers make them);
  // element by element otherwise.
  const int64_t elem = get_element_size(out);
  const int64_t lane_elems = elem * a.dim == 1024 && elem == 4 ? 8 : 16 / elem;
  const auto fits = [&](const void* p, std::initializer_list<int64_t> strides) {
    if (reinterpret_cast<uintptr_t>(p) % (lane_elems * elem) != 0) return false;
    for (const int64_t st : strides)
      if (st % lane_elems != 0) return false;
    return true;
  };
  const bool aligned = (a.dim == 64 || a.dim == 128 || a.dim == 256) &&
                       fits(a.out, {a.out_stride_row, a.out_stride_head}) && fits(a.q, {a.q_stride_row, a.q_stride_head}) &&
                       fits(a.k, {a.k_stride_page, a.k_stride_slot, a.k_stride_head}) &&
                       fits(a.v, {a.v_stride_page, a.v_stride_slot, a.v_stride_head});
  ffi::CUDADeviceGuard device_guard(out.device().device_id);
  const cudaStream_t stream = get_stream(out.device());
  with_float_type(out.dtype(), "merge_inline: out", [&](auto zero) {
    launch_inline<decltype(zero)>(a, aligned ? lane_elems : 0, stream);
  });
}

}  // namespace vg_plan
