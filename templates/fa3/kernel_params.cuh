// Static source of variantgen's fa3 modules (copied as is into each module's sources).
//
// The fields FlashInfer's sm90 (FA3) paged and ragged prefill kernels read from their Params,
// without the variant's arguments: a module's config derives PagedParams and RaggedParams from
// these and adds its AdditionalParams (the spec's tensors and scalars, vg_meta, the head
// counts), where the FA3 mainloop hands them to the variant. fill_params.cuh, run.cuh and
// ragged_run.cuh fill every field by name.
#pragma once
#include <cstdint>

namespace vg {

// What the paged and the ragged kernel read alike: the tensors, the work list plan() wrote (one
// entry per query tile, pointed at its request's rows), strides and head counts.
template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_, typename IdType_>
struct Fa3Fields {
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
  IdType* qo_indptr;  // first query row of the work item's launch request (patched by plan)
  IdType* kv_indptr;  // paged: first entry of its page list in kv_indices; ragged: its first key row
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

  int num_qo_heads;
  int num_kv_heads;
  int group_size;
  int window_left;

  bool causal;
};

// Paged KV: keys through a page list.
template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_, typename IdType_>
struct Fa3PagedFields : Fa3Fields<DTypeQ_, DTypeKV_, DTypeO_, IdType_> {
  IdType_* kv_indices;
  int64_t k_page_stride;
  int64_t v_page_stride;
  int head_dim;
  int page_size;
};

// Ragged KV: request b's keys are rows kv_indptr[b] .. of k / v (no page list).
template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_, typename IdType_>
struct Fa3RaggedFields : Fa3Fields<DTypeQ_, DTypeKV_, DTypeO_, IdType_> {
  int64_t nnz_kv;
};

}  // namespace vg
