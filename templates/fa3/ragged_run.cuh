// Static source of variantgen's fa3 ragged-KV modules (copied as is into each module's sources).
//
// What a ragged module's binding does the same for every spec: `plan` writes the work list of
// FlashInfer's sm90 kernel for a batch (one schedule for all heads, plan/fa3_worklist.h - the
// paged modules' own) into the page-locked mirror and queues its copy into the int workspace;
// `ragged_run` fills RaggedParams from the tensors and that work list and launches the kernel
// the mask mode selects. The binding adds the spec's arguments and the mask-mode switch.
//
// Requests are kept apart by a gap (vg_abi::kRaggedKvGap, from variantgen/abi/table.py): the
// kernel loads whole KV tiles (TMA over the packed [total_kv, heads, dim] tensor) from a request's
// first key, so its last tile reads up to CTA_KV - 1 rows past the request's last key. Packed back
// to back, those rows are the next request's keys: their scores are masked (weight 0), but 0 x NaN
// is NaN, so a NaN / inf in one request's V reached the other requests' rows. `ragged_run` is
// therefore given K and V padded by RaggedWrapper.run (variantgen/wrappers/ragged.py): request b's
// keys start at row kv_indptr[b] + b * kRaggedKvGap and are followed by kRaggedKvGap zero rows.
// `plan` puts those padded starts into the work list (kv_len stays the request's); the variant's
// kv_idx is relative to the request's first key and vg_meta's kv_row_base is the unpadded
// kv_indptr[b], so the spec's [total_kv] tensors are read at the caller's rows.
#pragma once
#include "fill_params.cuh"

#include "fa3_worklist.h"
#include "vg_plan_abi.h"

namespace flashinfer {
template <uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, MaskMode MASK_MODE, bool LEFT_SLIDING_WINDOW,
          bool SAME_SCHEDULE_FOR_ALL_HEADS, typename AttentionVariant, typename Params>
cudaError_t BatchPrefillWithRaggedKVCacheDispatched(Params& params, bool enable_pdl,
                                                    cudaStream_t stream);
}  // namespace flashinfer

// The query tile FlashInfer's sm90 ragged kernel runs at these head dims (its getCTATileSize).
constexpr int64_t kVgRaggedCtaTileQ = (HEAD_DIM_QK == 64 && HEAD_DIM_VO == 64) ? 192 : 128;
// Its largest KV tile, causal or not (getCTATileSize: 192 at head dim 128 without causal, 64 at
// 256, 128 otherwise); each kernel unit checks its own against FlashInfer's (ragged_kernel.cu).
constexpr int64_t kVgRaggedCtaTileKv = (HEAD_DIM_QK == 128 && HEAD_DIM_VO == 128) ? 192
                                       : (HEAD_DIM_QK == 256 && HEAD_DIM_VO == 256) ? 64 : 128;
static_assert(vg_abi::kRaggedKvGap >= kVgRaggedCtaTileKv,
              "the gap between ragged requests must hold the kernel's KV tile past a request's last key");

static void VgCheckHostIndptr(const TensorView& t, const char* name) {
  vg_plan::check_host(t, name);
  VG_REQUIRE(t.ndim() == 1 && t.dtype() == dl_int32) << name << ": expected int32 [batch + 1]";
}

// The work list of a ragged batch (qo_indptr, kv_indptr: int32 [batch + 1] on the host) at the
// start of `page_locked`, copied into `int_workspace` on the current stream (no sync). Request
// b's keys are read from row kv_indptr[b] + b * kRaggedKvGap of the padded K / V that
// ragged_run is given (see the top of this file). Returns PrefillPlanSM90Info's values.
static tvm::ffi::Array<int64_t> VgRaggedPlan(TensorView int_workspace, TensorView page_locked,
                                             TensorView qo_indptr, TensorView kv_indptr, bool causal) {
  VgCheckHostIndptr(qo_indptr, "qo_indptr");
  VgCheckHostIndptr(kv_indptr, "kv_indptr");
  const int64_t n = qo_indptr.size(0) - 1;
  VG_REQUIRE(n >= 1 && kv_indptr.size(0) == n + 1) << "plan: qo_indptr and kv_indptr need batch + 1 entries";
  const int32_t* qo = static_cast<const int32_t*>(qo_indptr.data_ptr());
  const int32_t* kv = static_cast<const int32_t*>(kv_indptr.data_ptr());
  std::vector<int32_t> kv_len(n), kv_first(n);
  for (int64_t b = 0; b < n; ++b) {
    kv_len[b] = kv[b + 1] - kv[b];
    VG_REQUIRE(kv_len[b] >= 0 && qo[b + 1] >= qo[b]) << "plan: indptrs decrease at request " << b;
  }
  // the padded K / V's rows: the last request's gap must end within int32 (the work list's type)
  VG_REQUIRE(int64_t(kv[n]) + n * int64_t(vg_abi::kRaggedKvGap) <= INT32_MAX)
      << "plan: " << kv[n] << " keys and " << n << " requests exceed the padded K / V's int32 rows";
  for (int64_t b = 0; b < n; ++b) kv_first[b] = kv[b] + int32_t(b) * vg_abi::kRaggedKvGap;
  ffi::CUDADeviceGuard device_guard(int_workspace.device().device_id);
  int num_sm = 0;
  VG_REQUIRE(cudaDeviceGetAttribute(&num_sm, cudaDevAttrMultiProcessorCount, int_workspace.device().device_id) ==
             cudaSuccess) << "plan: cannot read the GPU's SM count";
  const int64_t works = vg_plan::fa3_tiles(qo, n, kVgRaggedCtaTileQ);
  const int64_t bytes = vg_plan::fa3_work_list_bytes(works, num_sm);
  const int64_t room = std::min<int64_t>(page_locked.numel() * get_element_size(page_locked),
                                         int_workspace.numel() * get_element_size(int_workspace));
  VG_REQUIRE(bytes <= room) << "plan: the work list needs " << bytes << " bytes of int workspace, it has " << room;
  char* host = static_cast<char*>(page_locked.data_ptr());
  std::vector<int64_t> info = vg_plan::fa3_work_list(qo, kv_first.data(), kv_len.data(), qo, n, causal,
                                                     kVgRaggedCtaTileQ, num_sm, works, host, 0);
  const int64_t end = info.back();
  info.pop_back();
  VG_REQUIRE(cudaMemcpyAsync(int_workspace.data_ptr(), host, end, cudaMemcpyHostToDevice,
                             get_stream(int_workspace.device())) == cudaSuccess)
      << "plan: work list copy failed";
  return tvm::ffi::Array<int64_t>(info.begin(), info.end());
}

// RaggedParams' FlashInfer fields (kernel_params.cuh) for one launch; k and v are the padded
// copies (nnz_kv, the TMA's extent, is theirs).
static void FillRaggedParams(RaggedParams& params, TensorView int_workspace_buffer,
                             const tvm::ffi::Array<int64_t>& plan_info_vec, TensorView q, TensorView k,
                             TensorView v, TensorView o, const tvm::ffi::Optional<TensorView>& maybe_lse,
                             int64_t mask_mode_code, int64_t layout) {
  // NHD: [tokens, heads, dim]; HND: [heads, tokens, dim].
  const bool nhd = static_cast<QKVLayout>(layout) == QKVLayout::kNHD;
  FillFa3Common(params, int_workspace_buffer, plan_info_vec, q, o, maybe_lse, int(k.size(nhd ? 1 : 0)),
                mask_mode_code, /*pack_gqa=*/1);
  params.k_ptr = static_cast<DTypeKV*>(k.data_ptr());
  params.v_ptr = static_cast<DTypeKV*>(v.data_ptr());
  params.k_stride_n = k.stride(nhd ? 0 : 1);
  params.k_stride_h = k.stride(nhd ? 1 : 0);
  params.v_stride_n = v.stride(nhd ? 0 : 1);
  params.v_stride_h = v.stride(nhd ? 1 : 0);
  params.nnz_kv = k.size(nhd ? 0 : 1);
  params.window_left = -1;  // ragged launches have no left window (the mask says what is visible)
}

template <MaskMode MASK_MODE, typename Variant, typename Params>
static void LaunchRagged(Params& params, bool enable_pdl, cudaStream_t stream) {
  cudaError_t status = flashinfer::BatchPrefillWithRaggedKVCacheDispatched<
      HEAD_DIM_QK, HEAD_DIM_VO, MASK_MODE, /*LEFT_SLIDING_WINDOW=*/false, /*SAME_SCHEDULE_FOR_ALL_HEADS=*/true,
      Variant>(params, enable_pdl, stream);
  TVM_FFI_ICHECK(status == cudaSuccess)
      << "variantgen fa3 ragged kernel launch failed: " << cudaGetErrorString(status);
}

// A launch of the shared plain kernel (plain_variant.cuh; its unit is compiled once per cache).
template <MaskMode MASK_MODE>
static void LaunchRaggedPlain(const RaggedParams& params, double v_scale, bool enable_pdl, cudaStream_t stream) {
  auto plain = vg::PlainParamsOf<vg::Fa3PlainRaggedParams<DTypeQ, DTypeKV, DTypeO>>(params, v_scale);
  LaunchRagged<MASK_MODE, vg::Fa3PlainVariant<false>>(plain, enable_pdl, stream);
}
