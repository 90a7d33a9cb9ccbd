// Static source of variantgen's fa2 decode modules (copied as is: the module's binding.cu).
//
// Exports `plan` (FlashInfer's decode scheduler, sized with this module's kernel), `run`
// (FlashInfer's batch-decode host code, compiled against this module's config) and
// `read_indices` (plan()'s read-back of its index tensors) via TVM-FFI.
#include <flashinfer/attention/scheduler.cuh>

#include "batch_decode_config.inc"
#include "tvm/ffi/container/array.h"
#include "tvm_ffi_utils.h"
#include "read_indices.cuh"

using tvm::ffi::Array;
using tvm::ffi::Optional;

void BatchDecodeWithPagedKVCacheRun(TensorView float_workspace_buffer,
                                    TensorView int_workspace_buffer, Array<int64_t> plan_info_vec,
                                    TensorView q, TensorView paged_k_cache,
                                    TensorView paged_v_cache, TensorView paged_kv_indptr,
                                    TensorView paged_kv_indices, TensorView paged_kv_last_page_len,
                                    TensorView o, Optional<TensorView> maybe_lse,
                                    int64_t kv_layout_code, int64_t window_left,
                                    bool enable_pdl ADDITIONAL_FUNC_PARAMS);

// Split-KV schedule for one batch: reads only the host copy of the page indptr. The work
// estimate asks the occupancy of this module's kernel (VariantgenVariant, from variant.cuh)
// for the batch's GQA group size.
Array<int64_t> VariantgenDecodePlan(TensorView float_workspace_buffer,
                                    TensorView int_workspace_buffer,
                                    TensorView page_locked_int_workspace_buffer,
                                    TensorView kv_indptr, int64_t batch_size, int64_t num_qo_heads,
                                    int64_t num_kv_heads, int64_t page_size,
                                    bool enable_cuda_graph) {
  CHECK_INPUT_TYPE(kv_indptr, dl_int32);
  TVM_FFI_ICHECK(kv_indptr.device().device_type == kDLCPU)
      << "variantgen decode plan: kv_indptr must be a host tensor";
  TVM_FFI_ICHECK_EQ(kv_indptr.size(0), batch_size + 1);
  TVM_FFI_ICHECK(num_kv_heads > 0 && num_qo_heads % num_kv_heads == 0)
      << "num_qo_heads " << num_qo_heads << " is not a multiple of num_kv_heads " << num_kv_heads;
  const size_t float_bytes =
      float_workspace_buffer.size(0) * get_element_size(float_workspace_buffer);
  const size_t int_bytes = int_workspace_buffer.size(0) * get_element_size(int_workspace_buffer);
  flashinfer::DecodePlanInfo plan_info;
  ffi::CUDADeviceGuard device_guard(float_workspace_buffer.device().device_id);
  const cudaStream_t stream = get_stream(float_workspace_buffer.device());
  cudaError_t status = cudaSuccess;
  DISPATCH_GQA_GROUP_SIZE(num_qo_heads / num_kv_heads, GROUP_SIZE, {
    auto work_estimation_func = flashinfer::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<
        GROUP_SIZE, HEAD_DIM_QK, POS_ENCODING_MODE, VariantgenVariant, Params>;
    status = flashinfer::DecodePlan<HEAD_DIM_QK, POS_ENCODING_MODE, VariantgenVariant, Params>(
        float_workspace_buffer.data_ptr(), float_bytes, int_workspace_buffer.data_ptr(),
        page_locked_int_workspace_buffer.data_ptr(), int_bytes, plan_info,
        static_cast<IdType*>(kv_indptr.data_ptr()), batch_size, num_qo_heads, page_size,
        enable_cuda_graph, stream, work_estimation_func);
  });
  TVM_FFI_ICHECK(status == cudaSuccess)
      << "variantgen decode plan failed: " << cudaGetErrorString(status);
  return Array(plan_info.ToVector());
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, VariantgenDecodePlan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, BatchDecodeWithPagedKVCacheRun);
// (`run_exact` is exported by decode_exact_host.cu, which compiles it: the units build in parallel)
