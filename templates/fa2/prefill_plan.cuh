// Static source of variantgen's fa2 modules (copied as is into each module's sources).
//
// `plan` of the fa2 prefill modules (paged and ragged KV): FlashInfer's prefill scheduler for
// one batch, sized with this module's head dims and dtypes. Reads only the host copies of the
// indptrs; for ragged KV each request's kv length is its kv_indptr difference (page size 1).
// Included by the binding after the module's config (HEAD_DIM_*, DTypeO, DTypeKV, IdType).
#pragma once
#include <flashinfer/attention/scheduler.cuh>

#include "fi_facts.h"  // VG_FI_PLAN_FIXED_UNIFORM_Q_LEN: PrefillPlan's arguments in this FlashInfer version

#include "tvm/ffi/container/array.h"
#include "tvm_ffi_utils.h"

tvm::ffi::Array<int64_t> VariantgenPrefillPlan(
    TensorView float_workspace_buffer, TensorView int_workspace_buffer,
    TensorView page_locked_int_workspace_buffer, TensorView qo_indptr, TensorView kv_indptr,
    int64_t total_num_rows, int64_t batch_size, int64_t num_qo_heads, int64_t num_kv_heads,
    int64_t page_size, bool enable_cuda_graph, int64_t window_left, int64_t fixed_split_size,
    bool disable_split_kv) {
  const size_t float_bytes =
      float_workspace_buffer.size(0) * get_element_size(float_workspace_buffer);
  const size_t int_bytes = int_workspace_buffer.size(0) * get_element_size(int_workspace_buffer);
  flashinfer::PrefillPlanInfo plan_info;
  ffi::CUDADeviceGuard device_guard(float_workspace_buffer.device().device_id);
  const cudaStream_t stream = get_stream(float_workspace_buffer.device());
  cudaError_t status = flashinfer::PrefillPlan<IdType>(
      float_workspace_buffer.data_ptr(), float_bytes, int_workspace_buffer.data_ptr(),
      page_locked_int_workspace_buffer.data_ptr(), int_bytes, plan_info,
      static_cast<IdType*>(qo_indptr.data_ptr()), static_cast<IdType*>(kv_indptr.data_ptr()),
      total_num_rows, batch_size, num_qo_heads, num_kv_heads, HEAD_DIM_QK, HEAD_DIM_VO, page_size,
      enable_cuda_graph, /*sizeof_dtype_o=*/sizeof(DTypeO), window_left, fixed_split_size,
      disable_split_kv, /*num_colocated_ctas=*/0, /*uniform_q_len=*/0,
#if VG_FI_PLAN_FIXED_UNIFORM_Q_LEN
      /*fixed_uniform_q_len=*/false,  // (FlashInfer 0.7.4 on) false: the schedule 0.7.2 computes
#endif
      stream,
      /*kv_dtype_bytes=*/sizeof(DTypeKV));
  TVM_FFI_ICHECK(status == cudaSuccess)
      << "variantgen plan failed: " << cudaGetErrorString(status);
  return tvm::ffi::Array(plan_info.ToVector());
}
