// Host-side work list of FlashInfer's sm90 (fa3) prefill kernel, for the launch builder
// (launches.h). Static C++: copied into the planner module and every fa3/fa2 paged-prefill
// module as it is. Needs <flashinfer/attention/scheduler.cuh> and tvm_ffi_utils.h first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

// A check of the plan's inputs: a ValueError with the message alone (no condition text).
#ifndef VG_REQUIRE
#define VG_REQUIRE(cond) \
  if (!(cond)) TVM_FFI_THROW(ValueError)
#endif

namespace vg_plan {

// Host memory the host code reads or writes (a device pointer there would crash it).
inline void check_host(const TensorView& t, const char* name) {
  const DLDeviceType type = t.device().device_type;
  VG_REQUIRE(type == kDLCPU || type == kDLCUDAHost) << name << ": expected a host tensor";
  VG_REQUIRE(t.IsContiguous()) << name << ": expected a contiguous tensor";
}

inline int64_t align16(int64_t x) { return (x + 15) & ~int64_t(15); }

// Relative cost of one query tile that reads kv keys (a fixed part for loading Q and writing O).
inline int64_t fa3_tile_cost(int64_t kv) { return kv + 128; }

// Bytes of a work list with room for `works` work items on num_sm lists, from an aligned base.
inline int64_t fa3_work_list_bytes(int64_t works, int64_t num_sm) {
  return 7 * align16(int64_t(sizeof(int32_t)) * std::max<int64_t>(works, 1)) + int64_t(sizeof(int32_t)) * (num_sm + 1);
}

// Query tiles of one launch: ceil(qo_len / cta_tile_q) per launch request.
inline int64_t fa3_tiles(const int32_t* qo, int64_t n, int64_t cta_tile_q) {
  int64_t works = 0;
  for (int64_t b = 0; b < n; ++b) works += (int64_t(qo[b + 1] - qo[b]) + cta_tile_q - 1) / cta_tile_q;
  return works;
}

// The work list of one launch for FlashInfer's sm90 kernel with one schedule for all heads
// (its BatchPrefillTileScheduler: a grid of SMs x query heads, CTA (s, h) runs the query
// tiles of list s for head h). Query tiles go longest first to the least loaded list (greedy
// LPT), O(tiles log SMs) on the host - FlashInfer's per-head schedule is heads times that.
// qo: packed [n + 1] (it gives each launch request's length); starts[b]: launch request b's
// first row in the caller's q / o, which may differ (the interval planner leaves rows in
// place) and is what the work items carry; kvp: [n + 1] pages (ragged: [n] first key rows, the
// padded K / V's - fa3/ragged_run.cuh); kv_len: [n] keys.
// works_capacity: the work items the arrays have room for (>= this launch's; CUDA-graph mode
// sizes them for the capacity so that the offsets never change). Writes at byte `base` of
// `host`, which has room for fa3_work_list_bytes(works_capacity, num_sm) from there. Returns
// PrefillPlanSM90Info's values (offsets from the buffer's start) and the end offset.
inline std::vector<int64_t> fa3_work_list(const int32_t* qo, const int32_t* kvp, const int32_t* kv_len,
                                          const int32_t* starts, int64_t n, bool causal, int64_t cta_tile_q,
                                          int64_t num_sm, int64_t works_capacity, char* host, int64_t base) {
  struct Tile {
    int64_t cost;
    int32_t request, tile;
  };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t qo_len = qo[b + 1] - qo[b];
    VG_REQUIRE(qo_len >= 0 && kv_len[b] >= 0) << "plan: negative length in launch request " << b;
    const int64_t count = (qo_len + cta_tile_q - 1) / cta_tile_q;
    for (int64_t t = 0; t < count; ++t) {
      // causal: the tile sees keys up to its last row's position (rows are the last qo_len keys)
      const int64_t kv = causal ? std::min<int64_t>(kv_len[b], kv_len[b] - qo_len + (t + 1) * cta_tile_q)
                                : kv_len[b];
      tiles.push_back({fa3_tile_cost(std::max<int64_t>(kv, 0)), int32_t(b), int32_t(t)});
    }
  }
  const int64_t works = int64_t(tiles.size());
  VG_REQUIRE(works <= works_capacity) << "plan: " << works << " query tiles, room for " << works_capacity;
  flashinfer::PrefillPlanSM90Info info;
  int64_t at = base;
  for (int64_t* field : {&info.qo_tile_indices_offset, &info.qo_indptr_offset, &info.kv_indptr_offset,
                         &info.qo_len_offset, &info.kv_len_offset, &info.head_indices_offset,
                         &info.batch_indices_offset}) {
    *field = at;
    at = align16(at + int64_t(sizeof(int32_t)) * std::max<int64_t>(works_capacity, 1));
  }
  info.work_indptr_offset = at;
  at += int64_t(sizeof(int32_t)) * (num_sm + 1);
  info.same_schedule_for_all_heads = true;

  // Longest first, ties in request order: one sort of (kMaxCost - cost) << 24 | index.
  constexpr int64_t kMaxCost = int64_t(1) << 36;
  VG_REQUIRE(works < int64_t(1) << 24) << "plan: too many query tiles in one launch";
  std::vector<int64_t> order(tiles.size());
  for (size_t i = 0; i < tiles.size(); ++i) order[i] = ((kMaxCost - tiles[i].cost) << 24) | int64_t(i);
  std::sort(order.begin(), order.end());
  // Least loaded list first, ties to the lower index: a binary min-heap of (load << 11 | list);
  // the chosen list's key grows by the tile's cost and sinks (one sift per tile).
  VG_REQUIRE(num_sm > 0 && num_sm < 2048) << "plan: " << num_sm << " SMs";
  std::vector<int64_t> heap(num_sm);
  for (int64_t s = 0; s < num_sm; ++s) heap[s] = s;  // all loads 0: ascending, already a heap
  std::vector<int> list_of(tiles.size());
  std::vector<int32_t> work_indptr(num_sm + 1, 0);
  for (size_t i = 0; i < tiles.size(); ++i) {
    const int s = int(heap[0] & 2047);
    list_of[i] = s;
    ++work_indptr[s + 1];
    const int64_t key = heap[0] + (tiles[order[i] & 0xFFFFFF].cost << 11);
    size_t k = 0;
    for (size_t c = 1; c < heap.size(); c = 2 * k + 1) {
      if (c + 1 < heap.size() && heap[c + 1] < heap[c]) ++c;
      if (heap[c] >= key) break;
      heap[k] = heap[c];
      k = c;
    }
    heap[k] = key;
  }
  for (int64_t s = 0; s < num_sm; ++s) work_indptr[s + 1] += work_indptr[s];
  auto field = [host](int64_t offset) { return reinterpret_cast<int32_t*>(host + offset); };
  int32_t* q_tile = field(info.qo_tile_indices_offset);
  int32_t* q_first = field(info.qo_indptr_offset);
  int32_t* kv_first = field(info.kv_indptr_offset);
  int32_t* q_len = field(info.qo_len_offset);
  int32_t* k_len = field(info.kv_len_offset);
  int32_t* head = field(info.head_indices_offset);
  int32_t* batch = field(info.batch_indices_offset);
  std::vector<int32_t> fill(work_indptr.begin(), work_indptr.end() - 1);
  for (size_t i = 0; i < tiles.size(); ++i) {  // each list keeps the longest-first order
    const int32_t w = fill[list_of[i]]++;
    const Tile& tile = tiles[order[i] & 0xFFFFFF];
    const int32_t b = tile.request;
    q_tile[w] = tile.tile;
    q_first[w] = starts[b];
    kv_first[w] = kvp[b];
    q_len[w] = qo[b + 1] - qo[b];
    k_len[w] = kv_len[b];
    head[w] = 0;  // (unused: the head is the CTA's blockIdx.y)
    batch[w] = b;
  }
  std::copy(work_indptr.begin(), work_indptr.end(), field(info.work_indptr_offset));
  std::vector<int64_t> out = info.ToVector();
  out.push_back(at);
  return out;
}

}  // namespace vg_plan
