// Static source of variantgen's fa2 paged-prefill modules (copied as is: the module's binding.cu).
//
// Exports `plan` (FlashInfer's prefill scheduler, prefill_plan.cuh) and `paged_run`
// (FlashInfer's paged prefill host code, compiled against this module's config) through TVM-FFI.
#include <flashinfer/attention/scheduler.cuh>

#include "batch_prefill_config.inc"
#include "prefill_plan.cuh"

using tvm::ffi::Array;
using tvm::ffi::Optional;

void BatchPrefillWithPagedKVCacheRun(TensorView float_workspace_buffer,
                                     TensorView int_workspace_buffer, Array<int64_t> plan_info_vec,
                                     TensorView q, TensorView paged_k_cache,
                                     TensorView paged_v_cache, TensorView qo_indptr,
                                     TensorView paged_kv_indptr, TensorView paged_kv_indices,
                                     TensorView paged_kv_last_page_len, TensorView o,
                                     Optional<TensorView> maybe_lse, int64_t mask_mode_code,
                                     int64_t layout, int64_t window_left,
                                     bool enable_pdl ADDITIONAL_FUNC_PARAMS);

TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, VariantgenPrefillPlan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(paged_run, BatchPrefillWithPagedKVCacheRun);
