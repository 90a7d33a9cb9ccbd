// Static source of variantgen's fa3 modules (copied as is into each module's sources).
//
// The plain attention variant: softmax(q k^T x sm_scale) v x v_scale, with no logits transform,
// no sink and no per-element mask. For a spec without a logits transform or a sink, the 'none',
// 'causal' and 'causal + left window' launches compute exactly this, so
// those kernel units do not depend on the spec at all: they are rendered against this header
// (templates/fa3/plain_kernel.cu.jinja, nothing of the spec in it), compiled once per cache
// and linked into every such spec's module (build.py, objects.py). The binding converts its
// spec's params with PlainParamsOf before such a launch.
//
// Only FlashInfer's headers and kernel_params.cuh come in here: a plain kernel unit must not
// include anything a spec renders (tests/cpu/test_render.py checks its include closure).
#pragma once
#include <flashinfer/attention/hopper/attention_updater.cuh>
#include <flashinfer/attention/hopper/variant_helper.cuh>
#include <flashinfer/math.cuh>

#include "kernel_params.cuh"

namespace vg {

// What the plain variant and fill_params.cuh read (a spec's AdditionalParams has the same
// fields by name, plus the spec's arguments and vg_meta).
struct Fa3PlainAdditionalParams {
  double sm_scale;           // softmax scale, q/k scales folded in
  double v_scale;            // value scale, applied to the output (1 for a spec without scales)
  uint32_t vg_num_qo_heads;  // set by FillFa3Common; not read by the plain variant
  uint32_t vg_num_kv_heads;
  uint32_t vg_pack_gqa;
  uint32_t vg_pack_magic;
};

template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_>
struct Fa3PlainPagedParams : Fa3PagedFields<DTypeQ_, DTypeKV_, DTypeO_, int32_t> {
  using Fields = Fa3PagedFields<DTypeQ_, DTypeKV_, DTypeO_, int32_t>;
  using AdditionalParams = Fa3PlainAdditionalParams;
  AdditionalParams additional_params;
};

template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_>
struct Fa3PlainRaggedParams : Fa3RaggedFields<DTypeQ_, DTypeKV_, DTypeO_, int32_t> {
  using Fields = Fa3RaggedFields<DTypeQ_, DTypeKV_, DTypeO_, int32_t>;
  using AdditionalParams = Fa3PlainAdditionalParams;
  AdditionalParams additional_params;
};

// A spec's filled params as the plain kernel's: FlashInfer's fields as they are (Params derives
// from the same Fields), the softmax scale and head counts by name, the value scale given.
template <typename Plain, typename Params>
inline Plain PlainParamsOf(const Params& params, double v_scale) {
  Plain plain;
  static_cast<typename Plain::Fields&>(plain) = params;
  const auto& args = params.additional_params;
  plain.additional_params = {double(args.sm_scale), v_scale, args.vg_num_qo_heads, args.vg_num_kv_heads,
                             args.vg_pack_gqa, args.vg_pack_magic};
  return plain;
}

// A template over MASKED only so that VG_FA3_EPILOGUE_FOR (epilogue_barrier.cuh) fits it as it
// fits a spec's variant; only Fa3PlainVariant<false> is ever instantiated.
template <bool MASKED>
struct Fa3PlainVariant {
  static_assert(!MASKED, "the plain variant has no mask");
  float sm_scale_log2, scale_pv;

  template <typename MainloopParams, typename BlockCoord>
  __device__ Fa3PlainVariant(const MainloopParams& params, const BlockCoord& /*block_coord*/) {
    sm_scale_log2 = float(params.additional_params.sm_scale) * flashinfer::math::log2e;
    scale_pv = float(params.additional_params.v_scale);
  }

  template <int NUM_ROWS_PER_THREAD>
  __device__ auto GetAttentionUpdater() {
    return flashinfer::OnlineSoftmax<NUM_ROWS_PER_THREAD, /*WITH_SCALE=*/true>(sm_scale_log2);
  }

  REGISTER_LOGITS_TRANSFORM(params, logits, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx,
                            { return logits; })
};

}  // namespace vg
