// Static source of variantgen's fa3 modules (copied as is into each module's sources).
//
// The fields FlashInfer's sm90 (FA3) paged and ragged prefill kernels read from their Params,
// without the variant's arguments: a module's config derives PagedParams and RaggedParams from
// these and adds its AdditionalParams (the spec's tensors and scalars, vg_meta, the head
// counts), where the FA3 mainloop hands them to the variant. Our bindings (run.cuh) fill every
// field by name.
#pragma once
#include <cstdint>

namespace vg {

template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_, typename IdType_>
struct Fa3PagedFields {
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  using IdType = IdType_;

  DTypeQ* q_ptr;
  DTypeKV* k_ptr;
  DTypeKV* v_ptr;
  DTypeO* o_ptr;
  float* lse_ptr;

  // Work list written by plan(): one entry per (query tile, head) work item.
  IdType* qo_tile_indices;
  IdType* qo_indptr;  // first query row of the work item's launch request (patched by plan)
  IdType* kv_indptr;  // first entry of its page list in kv_indices
  IdType* kv_indices;
  IdType* qo_lens;
  IdType* kv_lens;
  IdType* head_indices;
  IdType* work_indptr;
  IdType* batch_indices;  // launch request of the work item (row of vg_meta)

  int64_t q_stride_n;
  int64_t k_stride_n;
  int64_t v_stride_n;
  int64_t o_stride_n;
  int64_t q_stride_h;
  int64_t k_stride_h;
  int64_t v_stride_h;
  int64_t o_stride_h;
  int64_t nnz_qo;
  int64_t k_page_stride;
  int64_t v_page_stride;

  int head_dim;
  int num_qo_heads;
  int num_kv_heads;
  int group_size;
  int page_size;
  int window_left;

  bool causal;
};

// Ragged KV: request b's keys are rows kv_indptr[b] .. of k / v (no page list); the work list
// is the same as the paged kernel's, its kv_indptr entries row offsets instead of page offsets.
template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_, typename IdType_>
struct Fa3RaggedFields {
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  using IdType = IdType_;

  DTypeQ* q_ptr;
  DTypeKV* k_ptr;
  DTypeKV* v_ptr;
  DTypeO* o_ptr;
  float* lse_ptr;

  IdType* qo_tile_indices;
  IdType* qo_indptr;  // first query row of the work item's request
  IdType* kv_indptr;  // its first key row
  IdType* qo_lens;
  IdType* kv_lens;
  IdType* head_indices;
  IdType* work_indptr;
  IdType* batch_indices;  // request of the work item (row of vg_meta)

  int64_t q_stride_n;
  int64_t k_stride_n;
  int64_t v_stride_n;
  int64_t o_stride_n;
  int64_t q_stride_h;
  int64_t k_stride_h;
  int64_t v_stride_h;
  int64_t o_stride_h;
  int64_t nnz_qo;
  int64_t nnz_kv;

  int num_qo_heads;
  int num_kv_heads;
  int group_size;
  int window_left;

  bool causal;
};

}  // namespace vg
