// Static source of variantgen's fa2 modules (copied as is into each module's sources).
//
// What the config of every fa2 kind (batch_prefill_config.inc, batch_decode_config.inc)
// starts with: the FlashInfer headers its kernels and host code need, and the FlashInfer
// features a variant module turns off - the spec's variant does its own masking and logits
// transform, so there is no soft cap, sliding window or positional encoding to dispatch on.
#pragma once
#include <flashinfer/page.cuh>
#include <flashinfer/math.cuh>
#include <flashinfer/layout.cuh>
#include <flashinfer/utils.cuh>
#include <flashinfer/pos_enc.cuh>
#include <flashinfer/fastdiv.cuh>
#include <flashinfer/attention/mask.cuh>
#include <flashinfer/attention/variant_helper.cuh>
#include <type_traits>

using namespace flashinfer;

using IdType = int32_t;
constexpr bool USE_FP16_QK_REDUCTION = false;
#include "fi_facts.h"
#if VG_FI_KERNEL_TOKEN_HEAD_SF
constexpr bool USE_TOKEN_HEAD_SF = false;  // FlashInfer 0.7.4 on: no per-token, per-head KV scale factors
#endif
constexpr auto USE_LOGITS_SOFT_CAP = false;
constexpr auto POS_ENCODING_MODE = PosEncodingMode::kNone;
constexpr auto USE_SLIDING_WINDOW = false;

// K and V pages share their strides (read by FlashInfer's csrc/batch_prefill_paged.cuh).
#define PAGED_KV_STRIDE_MODE_RUNTIME 0
#define PAGED_KV_STRIDE_MODE_EQUAL 1
#define PAGED_KV_STRIDE_MODE_INDEPENDENT 2
#define PAGED_KV_STRIDE_MODE PAGED_KV_STRIDE_MODE_EQUAL
