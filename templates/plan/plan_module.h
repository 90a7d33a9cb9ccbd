// The launch builder's entry points, exported by every planning module: the planner module
// (whose plan_batch runs the row pass first) and each fa2/fa3 paged-prefill module (plan.cu),
// so that the planner-off path builds its launches with the same code. Static C++
// (templates/plan/); variantgen/planning/planner.py calls them.
//   build_launches: the host part alone (segments -> launches, metadata, schedules) - the CPU
//                   tests call it, and the CPU fakes build their plans with it;
//   plan_direct:    planner off: one custom launch request per request, built, copied to the
//                   device and its page lists gathered there, in one call;
//   schedule:       the fa2 work list of one launch (tests);
//   read_indices:   plan()'s read-back of its index tensors from the GPU (read_indices.cuh);
//   merge_pieces:   run()'s merge of the partial outputs of rows split into pieces (merge_pieces.cuh).
//   merge_inline:   run()'s merge of a short first piece, computed there, into the rows written in place.
//   classify_rows:  the row kernel's classes (row_classes.h) on the host, for the CPU tests.
#pragma once

#include <utility>
#include <vector>

#include "gather.cuh"
#include "launches.h"
#include "merge_pieces.cuh"
#include "read_indices.cuh"
#include "row_classes.h"
#include "tvm/ffi/container/array.h"

namespace vg_plan {

// The checked host arguments of a plan: the batch (indices: int32 [3 batch + 2]), the options,
// the workspace's host mirror and the descriptor.
struct HostArgs {
  Batch batch;
  Options options;
  char* host;
  int64_t capacity;
  int64_t* desc;
  int64_t desc_count;
};

inline HostArgs host_args(const TensorView& indices, const TensorView& options, const TensorView& workspace_host,
                          const TensorView& desc) {
  check_host(indices, "indices");
  check_host(options, "options");
  check_host(workspace_host, "workspace_host");
  check_host(desc, "desc");
  VG_REQUIRE(indices.dtype() == dl_int32 && indices.ndim() == 1) << "indices: expected int32 [3 batch + 2] on the host";
  VG_REQUIRE(options.dtype() == dl_int64 && desc.dtype() == dl_int64 && workspace_host.dtype() == dl_uint8)
      << "options and desc: int64; workspace_host: uint8";
  HostArgs a;
  a.options = read_options(static_cast<const int64_t*>(options.data_ptr()), options.numel());
  a.batch = read_batch(static_cast<const int32_t*>(indices.data_ptr()), indices.numel(), a.options.page_size);
  a.host = static_cast<char*>(workspace_host.data_ptr());
  a.capacity = workspace_host.numel();
  a.desc = static_cast<int64_t*>(desc.data_ptr());
  a.desc_count = desc.numel();
  return a;
}

// A written plan to the device: the host mirror's first COPY_BYTES into `workspace`, then the
// launches' page lists gathered from kv_indices (device int32) into it.
inline void finish_plan(const HostArgs& a, const TensorView& kv_indices, const TensorView& workspace,
                        cudaStream_t stream) {
  const int64_t* d = a.desc;
  if (d[kHeadStatus] != kStatusOk) return;
  char* device = static_cast<char*>(workspace.data_ptr());
  VG_REQUIRE(cudaMemcpyAsync(device, a.host, d[kHeadCopyBytes], cudaMemcpyHostToDevice, stream) == cudaSuccess)
      << "plan: workspace copy failed";
  launch_gather(static_cast<const int32_t*>(kv_indices.data_ptr()),
                reinterpret_cast<const int32_t*>(device + d[kHeadTableOffset]), d[kHeadRanges], d[kHeadPagesExtent],
                reinterpret_cast<int32_t*>(device + d[kHeadPagesOffset]), stream);
}

inline void check_device_args(const HostArgs& a, const TensorView& kv_indices, const TensorView& workspace) {
  CHECK_INPUT_TYPE(kv_indices, dl_int32);
  CHECK_INPUT_TYPE(workspace, dl_uint8);
  VG_REQUIRE(workspace.numel() >= a.capacity) << "workspace smaller than its page-locked mirror";
  VG_REQUIRE(kv_indices.numel() >= a.batch.page_start[a.batch.batch]) << "kv_indices: fewer entries than indptr";
}

}  // namespace vg_plan

// segments: int64 [n, kSegFields] on the host, in row order (ignored with kOptionDirect), then
// kOptionListRows rows of page lists (SegField.PAGE_LIST_AT / PAGE_LIST_LEN index them).
void VgBuildLaunches(TensorView indices, TensorView segments, TensorView options, TensorView workspace_host,
                     TensorView desc) {
  vg_plan::HostArgs a = vg_plan::host_args(indices, options, workspace_host, desc);
  std::vector<int64_t> direct;
  const int64_t* seg = nullptr;
  int64_t nseg = 0;
  if (a.options.direct) {
    direct = vg_plan::direct_segments(a.batch);
    seg = direct.data();
    nseg = int64_t(direct.size()) / vg_abi::kSegFields;
  } else {
    vg_plan::check_host(segments, "segments");
    VG_REQUIRE(segments.dtype() == dl_int64 && segments.ndim() == 2 && segments.size(1) == vg_abi::kSegFields)
        << "segments: expected int64 [n, " << vg_abi::kSegFields << "]";
    seg = static_cast<const int64_t*>(segments.data_ptr());
    VG_REQUIRE(a.options.list_rows <= segments.size(0))
        << "segments: " << segments.size(0) << " rows, fewer than the options' " << a.options.list_rows << " list rows";
    nseg = segments.size(0) - a.options.list_rows;  // (then the page lists' rows)
  }
  auto reqs = vg_plan::read_segments(seg, nseg, a.batch, a.options.page_size, a.options.max_pieces,
                                     seg + nseg * vg_abi::kSegFields, a.options.list_rows * vg_abi::kSegFields);
  vg_plan::write_plan(std::move(reqs), a.batch, a.options, a.host, a.capacity, a.desc, a.desc_count);
}

void VgPlanDirect(TensorView indices, TensorView options, TensorView kv_indices, TensorView workspace,
                  TensorView workspace_host, TensorView desc) {
  vg_plan::HostArgs a = vg_plan::host_args(indices, options, workspace_host, desc);
  vg_plan::check_device_args(a, kv_indices, workspace);
  VG_REQUIRE(a.options.direct) << "plan_direct: the options do not say direct";
  const std::vector<int64_t> seg = vg_plan::direct_segments(a.batch);
  auto reqs = vg_plan::read_segments(seg.data(), int64_t(seg.size()) / vg_abi::kSegFields, a.batch,
                                     a.options.page_size);
  vg_plan::write_plan(std::move(reqs), a.batch, a.options, a.host, a.capacity, a.desc, a.desc_count);
  ffi::CUDADeviceGuard device_guard(workspace.device().device_id);
  vg_plan::finish_plan(a, kv_indices, workspace, get_stream(workspace.device()));
}

// The fa2 work list of one launch (int32 host qo_indptr and o_indptr) at byte `base` of
// `page_locked`: its 15 plan_info values, then the end offset.
tvm::ffi::Array<int64_t> VgSchedule(TensorView page_locked, int64_t base, TensorView qo_indptr, TensorView o_indptr,
                                    int64_t num_qo_heads, int64_t num_kv_heads, int64_t head_dim_qk,
                                    int64_t head_dim_vo, int64_t kv_dtype_bytes, int64_t graph_rows) {
  vg_plan::check_host(qo_indptr, "qo_indptr");
  vg_plan::check_host(o_indptr, "o_indptr");
  vg_plan::check_host(page_locked, "page_locked");
  VG_REQUIRE(qo_indptr.dtype() == dl_int32 && o_indptr.dtype() == dl_int32) << "indptrs: expected int32";
  const int64_t n = qo_indptr.size(0) - 1;
  VG_REQUIRE(n >= 1 && o_indptr.size(0) == n + 1) << "qo_indptr/o_indptr: expected batch + 1 entries";
  VG_REQUIRE(num_kv_heads > 0 && num_qo_heads > 0 && num_qo_heads % num_kv_heads == 0) << "heads: whole GQA groups";
  vg_plan::Options c{};
  c.num_qo_heads = num_qo_heads;
  c.num_kv_heads = num_kv_heads;
  c.head_dim_qk = head_dim_qk;
  c.head_dim_vo = head_dim_vo;
  c.kv_dtype_bytes = kv_dtype_bytes;
  const int32_t* qo = static_cast<const int32_t*>(qo_indptr.data_ptr());
  const vg_plan::Fa2Shape s = vg_plan::fa2_shape(qo, n, c, graph_rows);
  const int64_t capacity = page_locked.numel() * get_element_size(page_locked);
  VG_REQUIRE(base + s.bytes <= capacity) << "int workspace too small (" << base + s.bytes << " bytes needed)";
  std::vector<int64_t> info = vg_plan::fa2_write(s, static_cast<char*>(page_locked.data_ptr()), base, qo,
                                                 static_cast<const int32_t*>(o_indptr.data_ptr()), n, c, graph_rows);
  info.push_back(base + s.bytes);
  return tvm::ffi::Array<int64_t>(info.begin(), info.end());
}

void VgMergePieces(TensorView out, tvm::ffi::Optional<TensorView> lse, TensorView parts, TensorView parts_lse,
                   TensorView rows, TensorView counts) {
  vg_plan::merge_pieces(out, lse, parts, parts_lse, rows, counts);
}

void VgMergeInline(TensorView out, TensorView lse_in, tvm::ffi::Optional<TensorView> lse_out, TensorView q,
                   TensorView k_cache, TensorView v_cache, TensorView kv_indices, TensorView rows,
                   TensorView first_entry, TensorView first_slot, TensorView keys, double sm_scale,
                   double v_scale, int64_t kv_head_div, bool hnd) {
  vg_plan::merge_inline(out, lse_in, lse_out, q, k_cache, v_cache, kv_indices, rows, first_entry, first_slot, keys,
                        sm_scale, v_scale, kv_head_div, hnd);
}

// Rows as the row kernel sees them (int64 [n, 8]: lo, hi, exact, dense_hi, request, q_pos, q_idx,
// qo_len) classified as it does, each with its neighbours: out int64 [n, 4] (starts, class,
// param_a, param_b).
void VgClassifyRows(TensorView rows, TensorView out, int64_t page_size) {
  vg_plan::check_host(rows, "rows");
  vg_plan::check_host(out, "out");
  VG_REQUIRE(rows.dtype() == dl_int64 && rows.ndim() == 2 && rows.size(1) == 8) << "rows: expected int64 [n, 8]";
  VG_REQUIRE(out.dtype() == dl_int64 && out.ndim() == 2 && out.size(0) == rows.size(0) && out.size(1) == 4)
      << "out: expected int64 [n, 4]";
  VG_REQUIRE(page_size >= 1) << "page_size: expected >= 1";
  const int64_t n = rows.size(0);
  const int64_t* in = static_cast<const int64_t*>(rows.data_ptr());
  std::vector<vg_rows::RowInterval> row_iv(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* x = in + 8 * r;
    row_iv[r] = vg_rows::RowInterval{x[0], x[1], x[2] != 0, x[3], int32_t(x[4]), int32_t(x[5]), int32_t(x[6]),
                                 int32_t(x[7])};
  }
  const auto key_of = [&](int64_t r) {
    return vg_rows::classify(r >= 1 ? &row_iv[r - 1] : nullptr, row_iv[r], r + 1 < n ? &row_iv[r + 1] : nullptr,
                             int32_t(page_size));
  };
  int64_t* o = static_cast<int64_t*>(out.data_ptr());
  for (int64_t r = 0; r < n; ++r) {
    const vg_rows::RowKey key = key_of(r);
    o[4 * r] = r == 0 || key_of(r - 1) != key;
    o[4 * r + 1] = key.cls;
    o[4 * r + 2] = key.param_a;
    o[4 * r + 3] = key.param_b;
  }
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(build_launches, VgBuildLaunches);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(classify_rows, VgClassifyRows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_direct, VgPlanDirect);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(schedule, VgSchedule);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_pieces, VgMergePieces);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_inline, VgMergeInline);
