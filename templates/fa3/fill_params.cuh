// Static source of variantgen's fa3 modules (copied as is into each module's sources).
//
// The part of a launch's parameters every fa3 binding fills the same way (kernel_params.cuh's
// Fa3Fields): q, o and the LSE, the work list plan() wrote into the int workspace, the head
// counts. run.cuh (paged) and ragged_run.cuh (ragged) add their keys.
#pragma once
#include <flashinfer/attention/mask.cuh>
#include <flashinfer/attention/scheduler.cuh>

#include <algorithm>
#include <vector>

#include "batch_prefill_sm90_config.inc"
#include "tvm/ffi/container/array.h"
#include "tvm_ffi_utils.h"

template <typename Params>
static void FillFa3Common(Params& params, TensorView int_workspace_buffer,
                          const tvm::ffi::Array<int64_t>& plan_info_vec, TensorView q, TensorView o,
                          const tvm::ffi::Optional<TensorView>& maybe_lse, int num_kv_heads,
                          int64_t mask_mode_code, int64_t pack_gqa) {
  using Id = typename Params::IdType;
  flashinfer::PrefillPlanSM90Info plan_info;
  plan_info.FromVector(std::vector<int64_t>(plan_info_vec.begin(), plan_info_vec.end()));
  void* int_ws = int_workspace_buffer.data_ptr();
  params.q_ptr = static_cast<typename Params::DTypeQ*>(q.data_ptr());
  params.o_ptr = static_cast<typename Params::DTypeO*>(o.data_ptr());
  params.lse_ptr = maybe_lse ? static_cast<float*>(maybe_lse.value().data_ptr()) : nullptr;
  params.q_stride_n = q.stride(0);
  params.q_stride_h = q.stride(1);
  params.o_stride_n = o.stride(0);
  params.o_stride_h = o.stride(1);
  params.nnz_qo = q.size(0);
  params.num_qo_heads = q.size(1);
  params.num_kv_heads = num_kv_heads;
  params.group_size = params.num_qo_heads / params.num_kv_heads;
  params.causal = mask_mode_code == 1;
  params.qo_tile_indices = GetPtrFromBaseOffset<Id>(int_ws, plan_info.qo_tile_indices_offset);
  params.qo_indptr = GetPtrFromBaseOffset<Id>(int_ws, plan_info.qo_indptr_offset);
  params.kv_indptr = GetPtrFromBaseOffset<Id>(int_ws, plan_info.kv_indptr_offset);
  params.qo_lens = GetPtrFromBaseOffset<Id>(int_ws, plan_info.qo_len_offset);
  params.kv_lens = GetPtrFromBaseOffset<Id>(int_ws, plan_info.kv_len_offset);
  params.head_indices = GetPtrFromBaseOffset<Id>(int_ws, plan_info.head_indices_offset);
  params.work_indptr = GetPtrFromBaseOffset<Id>(int_ws, plan_info.work_indptr_offset);
  params.batch_indices = GetPtrFromBaseOffset<Id>(int_ws, plan_info.batch_indices_offset);
  // GQA packing: q / o hold each key/value head's group of query heads as consecutive rows
  // ([rows x group, num_kv_heads, dim]), so the kernel sees one query head per key/value head;
  // the variant maps a packed row back to its query row and head (variant.cuh).
  const uint32_t pack = pack_gqa > 1 ? uint32_t(pack_gqa) : 1u;
  TVM_FFI_ICHECK(pack == 1 || (params.num_qo_heads == num_kv_heads && mask_mode_code != 1))
      << "GQA-packed q must have one head per key/value head (" << params.num_qo_heads << " for "
      << num_kv_heads << ") and the launch must not be causal";
  params.additional_params.vg_num_qo_heads = uint32_t(params.num_qo_heads) * pack;
  params.additional_params.vg_num_kv_heads = uint32_t(params.num_kv_heads);
  params.additional_params.vg_pack_gqa = pack;
  // packed row / pack as (row * magic) >> 16: exact for row x pack < 2^16 (rows < one tile)
  params.additional_params.vg_pack_magic = (65536u + pack - 1u) / pack;
}
