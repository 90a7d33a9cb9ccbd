// The row pass's launch classes: a query row's class and class parameters from its key interval
// and its neighbours'. Static C++ for the host and the device: the row kernel
// (templates/planner/planner.cu.jinja) classifies each row with it, and plan_module.h's
// `classify_rows` runs it on the host, where the CPU tests compare it with its reference,
// variantgen/planning/rowrules.py's classify_intervals.
#pragma once
#include <cstdint>

#include "vg_plan_abi.h"

#ifdef __CUDACC__
#define VG_ROW_HD __host__ __device__
#else
#define VG_ROW_HD
#endif

namespace vg_rows {
using namespace vg_abi;

struct RowInterval {
  int64_t lo, hi;  // hull of the visible keys, request-local positions
  bool exact;      // the visible keys are exactly [lo, hi]
  int64_t dense_hi;  // every key of [lo, dense_hi] is visible (lo - 1: none known)
  int32_t request, q_pos, q_idx, qo_len;
};

struct RowKey {
  int32_t request, cls;
  int64_t param_a, param_b;
  VG_ROW_HD bool operator!=(const RowKey& o) const {
    return request != o.request || cls != o.cls || param_a != o.param_a || param_b != o.param_b;
  }
};

// A row's launch class; it looks at its neighbours because a class only pays off when
// several rows share its parameters.
VG_ROW_HD inline RowKey classify(const RowInterval* prev, const RowInterval& cur, const RowInterval* next,
                                 int32_t page_size) {
  const bool same_prev = prev != nullptr && prev->request == cur.request;
  const bool same_next = next != nullptr && next->request == cur.request;
  const bool causal_end = cur.exact && cur.hi == cur.q_pos;
  const bool aligned = cur.lo % page_size == 0;
  // A band's rows (keys up to q_pos + b) run causal too: a run's keys end at its last row's hi,
  // which puts the kernel's diagonal on each row's hi; the shift must be shared with a neighbour.
  const int64_t shift = cur.hi - cur.q_pos;
  const bool fixed_shift = (same_prev && prev->hi - prev->q_pos == shift) ||
                           (same_next && next->hi - next->q_pos == shift);
  const bool diagonal = cur.exact && (shift == 0 || (shift > 0 && fixed_shift));
  const int64_t width = cur.hi - cur.lo;
  const bool fixed_lo = (same_prev && prev->lo == cur.lo) || (same_next && next->lo == cur.lo);
  const bool fixed_width = (same_prev && prev->hi - prev->lo == width) ||
                           (same_next && next->hi - next->lo == width);
  const bool fixed_span = (same_prev && prev->lo == cur.lo && prev->hi == cur.hi) ||
                          (same_next && next->lo == cur.lo && next->hi == cur.hi);
  int32_t cls = kCustom;
  if (diagonal && fixed_width) cls = kWindow;
  if (diagonal && aligned && (fixed_lo || cur.lo == 0)) cls = kCausal;
  if (cur.exact && !causal_end && aligned && fixed_span) cls = kDense;
  // A hull that ends at q_pos with a dense prefix reaching the request's first query: only the
  // request's own keys need the mask (tree_verify's draft block after its context).
  const int64_t mask_from = cur.dense_hi + 1;
  if (!cur.exact && cur.hi == cur.q_pos && aligned && (fixed_lo || cur.lo == 0) && mask_from > cur.lo &&
      mask_from >= cur.q_pos - cur.q_idx && cur.qo_len <= kTailMaxQoLen)
    cls = kTail;
  RowKey key;
  key.request = cur.request;
  key.cls = cls;
  key.param_a = cls == kWindow ? width : cls == kCustom ? int64_t(cur.q_idx / kCustomRows) : cur.lo;
  key.param_b = cls == kDense ? cur.hi : cls == kTail ? mask_from : (cls == kCausal || cls == kWindow) ? shift : 0;
  return key;
}

}  // namespace vg_rows
