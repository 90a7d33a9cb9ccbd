// Static source of variantgen's fa3 modules (copied as is into each module's sources).
//
// What a module's binding.cu does the same for every spec for `paged_run`: PagedParams filled
// from the tensors and the work list the launch builder wrote (plan.cu, plan/fa3_worklist.h),
// and one launch of an instantiated kernel (the spec's, or the shared plain one). The binding
// adds the spec's arguments and the mask-mode switch.
#pragma once
#include "fill_params.cuh"

namespace flashinfer {
template <uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, MaskMode MASK_MODE, bool LEFT_SLIDING_WINDOW,
          bool SAME_SCHEDULE_FOR_ALL_HEADS, typename AttentionVariant, typename Params>
cudaError_t BatchPrefillWithPagedKVCacheDispatched(Params& params, bool enable_pdl,
                                                   cudaStream_t stream);
}  // namespace flashinfer

// PagedParams' FlashInfer fields (kernel_params.cuh) for one launch: the tensors, their layout, and
// the work list plan() wrote into the int workspace (plan_info).
template <typename Params>
static void FillPagedParams(Params& params, TensorView int_workspace_buffer,
                            const tvm::ffi::Array<int64_t>& plan_info_vec, TensorView q,
                            TensorView paged_k_cache, TensorView paged_v_cache,
                            TensorView paged_kv_indices, TensorView o,
                            const tvm::ffi::Optional<TensorView>& maybe_lse, int64_t mask_mode_code,
                            int64_t layout, int64_t window_left, int64_t pack_gqa) {
  const QKVLayout kv_layout = static_cast<QKVLayout>(layout);
  // NHD pages: [pages, page_size, heads, dim]; HND: [pages, heads, page_size, dim].
  const int token_axis = kv_layout == QKVLayout::kNHD ? 1 : 2;
  const int head_axis = kv_layout == QKVLayout::kNHD ? 2 : 1;
  FillFa3Common(params, int_workspace_buffer, plan_info_vec, q, o, maybe_lse,
                int(paged_k_cache.size(head_axis)), mask_mode_code, pack_gqa);
  params.k_ptr = static_cast<DTypeKV*>(paged_k_cache.data_ptr());
  params.v_ptr = static_cast<DTypeKV*>(paged_v_cache.data_ptr());
  params.k_stride_n = paged_k_cache.stride(token_axis);
  params.k_stride_h = paged_k_cache.stride(head_axis);
  params.v_stride_n = paged_v_cache.stride(token_axis);
  params.v_stride_h = paged_v_cache.stride(head_axis);
  params.k_page_stride = paged_k_cache.stride(0);
  params.v_page_stride = paged_v_cache.stride(0);
  params.head_dim = HEAD_DIM_QK;
  params.page_size = paged_k_cache.size(token_axis);
  params.window_left = int(window_left);
  params.kv_indices = static_cast<IdType*>(paged_kv_indices.data_ptr());
}

template <MaskMode MASK_MODE, bool WINDOW, typename Variant, typename Params>
static void Launch(Params& params, bool enable_pdl, cudaStream_t stream) {
  cudaError_t status = flashinfer::BatchPrefillWithPagedKVCacheDispatched<
      HEAD_DIM_QK, HEAD_DIM_VO, MASK_MODE, WINDOW, /*SAME_SCHEDULE_FOR_ALL_HEADS=*/true, Variant>(
      params, enable_pdl, stream);
  TVM_FFI_ICHECK(status == cudaSuccess)
      << "variantgen fa3 kernel launch failed: " << cudaGetErrorString(status);
}

// A launch of the shared plain kernel (plain_variant.cuh; its unit is compiled once per cache):
// the spec's filled params as the plain kernel's.
template <MaskMode MASK_MODE, bool WINDOW>
static void LaunchPlain(const PagedParams& params, double v_scale, bool enable_pdl, cudaStream_t stream) {
  auto plain = vg::PlainParamsOf<vg::Fa3PlainPagedParams<DTypeQ, DTypeKV, DTypeO>>(params, v_scale);
  Launch<MASK_MODE, WINDOW, vg::Fa3PlainVariant<false>>(plain, enable_pdl, stream);
}
