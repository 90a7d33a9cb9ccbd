// Static source of variantgen's modules (copied as is into each module's sources).
//
// Device helpers with the expression language's semantics, which the generated hooks call
// (evaluate.py implements the same in torch): floor division and modulo that give 0 for a
// zero divisor, clamped indices, the float functions.
// An include guard, not #pragma once: the planner's row kernel inlines this file.
#ifndef VG_HELPERS_CUH_
#define VG_HELPERS_CUH_
#include <cstdint>
#if !defined(__CUDACC__) && !defined(__host__)
#define __host__  // (a host compiler: the tests' drivers, which define __device__ away too)
#endif

namespace vg {
// An index clamped to [0, extent) (int64: an offset index must not overflow first).
__device__ __forceinline__ int32_t vg_clamp(int64_t i, int32_t extent) {
  return int32_t(i < 0 ? 0 : (i >= extent ? extent - 1 : i));
}
// Row `local` of a request whose `count` rows start at row `first`, clamped to those rows:
// an offset row index (kv_row - 1) never reaches a neighbouring request.
__device__ __forceinline__ int32_t vg_request_row(int32_t first, int64_t local, int32_t count) {
  return first + vg_clamp(local, count);
}
// The absolute position of list key i of a launch request whose page list skips gaps
// (planning/gaps.py): base + i, plus the length of every gap at or before i. A variant that runs
// no gapped launch request passes zero lengths, and this folds to base + i.
template <int N>
__device__ __forceinline__ int32_t vg_key_pos(int32_t base, int32_t i, const int32_t (&gap_at)[N],
                                              const int32_t (&gap_len)[N]) {
  int32_t pos = base + i;
#pragma unroll
  for (int j = 0; j < N; ++j) pos += i >= gap_at[j] ? gap_len[j] : 0;
  return pos;
}
// Division by a launch-uniform divisor d >= 1 as a multiply-high, an add and a shift, exact for
// every 32-bit n (m = floor(2^32 (2^s - d) / d) + 1, s = ceil(log2 d)): the listed variant divides
// every key's list index by the page size, where a hardware-free integer division costs ~20
// instructions per element. Set up once per CTA.
struct vg_fast_divisor {
  uint32_t d, m, s;
  __device__ __host__ void set(uint32_t divisor) {
    d = divisor > 0 ? divisor : 1;
    s = 0;
    while ((uint64_t(1) << s) < d) ++s;
    m = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << s) - d)) / d + 1);
  }
  __device__ __host__ __forceinline__ uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t high = __umulhi(n, m);
#else
    const uint32_t high = uint32_t((uint64_t(n) * m) >> 32);
#endif
    return uint32_t((uint64_t(high) + n) >> s);
  }
};
// Floor division and modulo by a launch-uniform int32 divisor (a spec scalar), exactly as
// vg_floordiv / vg_mod below (0 for a zero divisor; -a, wrapping, for -1): a multiply-high, a
// shift and selects, set once per CTA. Integer division has no instruction: vg_floordiv costs
// ~30 per element where a mask divides by a scalar (fixed_sparse's kv_pos % block).
struct vg_int_divisor {
  vg_fast_divisor magnitude;
  int32_t value;
  bool zero, negative;
  __device__ __host__ void set(int32_t divisor) {
    value = divisor;
    zero = divisor == 0;
    negative = divisor < 0;
    magnitude.set(zero ? 1u : negative ? 0u - uint32_t(divisor) : uint32_t(divisor));
  }
};
__device__ __host__ __forceinline__ int32_t vg_floordiv_by(int32_t a, const vg_int_divisor& d) {
  const int64_t x = d.negative ? -int64_t(a) : int64_t(a);  // a / d == -a / -d
  const uint32_t q = d.magnitude.div(uint32_t(x >= 0 ? x : -x - 1));
  const int32_t floor = x >= 0 ? int32_t(q) : int32_t(~q);  // x < 0: -((-x - 1) / |d|) - 1
  return d.zero ? 0 : floor;
}
__device__ __host__ __forceinline__ int32_t vg_mod_by(int32_t a, const vg_int_divisor& d) {
  const uint32_t r = uint32_t(a) - uint32_t(vg_floordiv_by(a, d)) * uint32_t(d.value);
  return d.zero ? 0 : int32_t(r);
}
// The absolute position of list key i of a launch request over a page list (planning/keysets.py):
// its page's first key (the table: one int32 per listed page) plus its slot in the page.
__device__ __forceinline__ int32_t vg_listed_key_pos(const int32_t* table, const vg_fast_divisor& page_size,
                                                     int32_t i) {
  const uint32_t page = page_size.div(uint32_t(i));
  return table[page] + int32_t(uint32_t(i) - page * page_size.d);
}
__device__ __forceinline__ int32_t vg_floordiv(int32_t a, int32_t b) {
  if (b == 0) return 0;  // defined as 0, like the reference, instead of a trap
  // -a, wrapping at INT32_MIN (whose quotient 2^31 leaves the int range): a / -1 is undefined there
  if (b == -1) return int32_t(0u - uint32_t(a));
  int32_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int32_t vg_mod(int32_t a, int32_t b) {
  if (b == 0 || b == -1) return 0;  // x % -1 is 0; INT32_MIN % -1 is undefined in C++
  int32_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
// The same on int64, for the planner's row kernel, which computes ints in int64 (its bounds
// are the mask rewritten, whose values may leave the int32 range where the mask's do not).
__device__ __forceinline__ int64_t vg_floordiv(int64_t a, int64_t b) {
  if (b == 0) return 0;
  if (b == -1) return int64_t(0ull - uint64_t(a));
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int64_t vg_mod(int64_t a, int64_t b) {
  if (b == 0 || b == -1) return 0;
  int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ int64_t vg_min(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t vg_max(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t vg_abs(int64_t a) { return a < 0 ? -a : a; }
__device__ __forceinline__ float vg_div(float a, float b) { return a / b; }
// Float arithmetic of masks, each operation rounded as IEEE float32 (round to nearest): the
// modules build with -use_fast_math, which would fuse a * b + c and approximate / and sqrt, and
// a mask's comparison must see the value the reference computes. (Denormals still flush to 0.)
// On the host (tests) the plain operators, which round the same way.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float vg_fadd_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float vg_fsub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float vg_fmul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float vg_fdiv_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float vg_sqrt_rn(float x) { return __fsqrt_rn(x); }
#else
__device__ __forceinline__ float vg_fadd_rn(float a, float b) { return a + b; }
__device__ __forceinline__ float vg_fsub_rn(float a, float b) { return a - b; }
__device__ __forceinline__ float vg_fmul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ float vg_fdiv_rn(float a, float b) { return a / b; }
__device__ __forceinline__ float vg_sqrt_rn(float x) { return sqrtf(x); }
#endif
__device__ __forceinline__ int32_t vg_min(int32_t a, int32_t b) { return a < b ? a : b; }
__device__ __forceinline__ int32_t vg_max(int32_t a, int32_t b) { return a > b ? a : b; }
__device__ __forceinline__ float vg_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ float vg_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ int32_t vg_abs(int32_t a) { return a < 0 ? -a : a; }
__device__ __forceinline__ float vg_abs(float a) { return fabsf(a); }
__device__ __forceinline__ float vg_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float vg_exp(float x) { return expf(x); }
__device__ __forceinline__ float vg_log(float x) { return logf(x); }
__device__ __forceinline__ float vg_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ float vg_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
// Bit i of x (two's complement, bit 0 the lowest); false for i outside 0..31, so no shift
// count is ever negative or too large (both undefined in C++).
__device__ __forceinline__ bool vg_bit(int32_t x, int32_t i) {
  return uint32_t(i) < 32u && ((uint32_t(x) >> uint32_t(i)) & 1u) != 0u;
}
// GQA packing (fa3, planner.Planner.pack_gqa): kernel row `row` of a launch request whose
// launch packs `pack` query heads per key/value head is query row row / pack, of query head
// kv_head x pack + row % pack; pack 1 (not packed): row and head as they are. The division is
// (row x magic) >> 16 with magic = ceil(2^16 / pack), exact while row x pack < 2^16: packed
// rows are one query tile (at most 192 rows x pack <= 192).
__device__ __forceinline__ int32_t vg_packed_row(uint32_t row, int32_t pack, uint32_t magic) {
  return pack > 1 ? int32_t((row * magic) >> 16) : int32_t(row);
}
__device__ __forceinline__ int32_t vg_packed_head(uint32_t row, int32_t head, int32_t kv_head, int32_t pack,
                                                  uint32_t magic) {
  return pack > 1 ? kv_head * pack + int32_t(row - ((row * magic) >> 16) * uint32_t(pack)) : head;
}
}  // namespace vg
using namespace vg;

#endif  // VG_HELPERS_CUH_
