// Static source of variantgen's fa2 modules (copied as is into each module's sources).
//
// The kernel parameters FlashInfer's FA2 host code fills in and its kernels read, one struct
// per kind, without the variant's own arguments: a module's config derives its Params from
// these and adds the spec's tensors and scalars (and vg_meta), which ADDITIONAL_PARAMS_SETTER
// sets. Field names are FlashInfer's (csrc/batch_prefill*.cu[h], csrc/batch_decode.cu);
// nothing depends on their order.
#pragma once
#include <flashinfer/fastdiv.cuh>
#include <flashinfer/page.cuh>

namespace vg {

// The schedule FlashInfer's prefill planner writes (PrefillPlanInfo's offsets, read back).
template <typename IdType>
struct PrefillSchedule {
  IdType* request_indices;
  IdType* qo_tile_indices;
  IdType* kv_tile_indices;
  IdType* merge_indptr;
  IdType* o_indptr;
  IdType* kv_chunk_size_ptr;
  bool* block_valid_mask;
  uint32_t max_total_num_rows;
  uint32_t* total_num_rows;
  uint32_t padded_batch_size;
  bool partition_kv;
};

// FP8 scale-factor strides FlashInfer's host code sets (unused by 16-bit and plain fp8 caches).
struct ScaleStrides {
  uint32_t k_sf_stride_page;
  uint32_t k_sf_stride_n;
  uint32_t k_sf_stride_h;
  uint32_t v_sf_stride_page;
  uint32_t v_sf_stride_n;
  uint32_t v_sf_stride_h;
};

// Paged-KV prefill (csrc/batch_prefill_paged.cuh).
template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_, typename IdType_>
struct PagedPrefillFields : PrefillSchedule<IdType_>, ScaleStrides {
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  using IdType = IdType_;

  DTypeQ* q;
  flashinfer::paged_kv_t<DTypeKV, IdType> paged_kv;
  IdType* q_indptr;
  DTypeO* o;
  float* lse;
  flashinfer::uint_fastdiv group_size;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;

  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};

// Ragged-KV prefill (csrc/batch_prefill.cu).
template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_, typename IdType_>
struct RaggedPrefillFields : PrefillSchedule<IdType_>, ScaleStrides {
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  using IdType = IdType_;

  DTypeQ* q;
  DTypeKV* k;
  DTypeKV* v;
  IdType* q_indptr;
  IdType* kv_indptr;
  DTypeO* o;
  float* lse;
  flashinfer::uint_fastdiv group_size;
  uint32_t num_qo_heads;
  uint32_t num_kv_heads;
  uint32_t q_stride_n;
  uint32_t q_stride_h;
  uint32_t k_stride_n;
  uint32_t k_stride_h;
  uint32_t v_stride_n;
  uint32_t v_stride_h;
  int32_t window_left;

  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t batch_idx) const {
    return uint32_t(kv_indptr[batch_idx + 1] - kv_indptr[batch_idx]);
  }
};

// Paged-KV batch decode on CUDA cores (csrc/batch_decode.cu): request b is row b of q, o,
// lse and vg_meta, with one query.
template <typename DTypeQ_, typename DTypeKV_, typename DTypeO_, typename IdType_>
struct DecodeFields {
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  using IdType = IdType_;

  DTypeQ* q;
  flashinfer::paged_kv_t<DTypeKV, IdType> paged_kv;
  DTypeO* o;
  float* lse;
  uint32_t padded_batch_size;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;
  bool enable_pdl;

  IdType* request_indices;
  IdType* kv_tile_indices;
  IdType* o_indptr;
  IdType* kv_chunk_size_ptr;
  bool* block_valid_mask;
  bool partition_kv;

  __host__ __device__ __forceinline__ uint32_t get_qo_len(uint32_t batch_idx) const { return 1; }

  // Keys of the request's page list (plan() may have trimmed it to the visible hull;
  // vg_meta's KV_POS_BASE says where it starts).
  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};

}  // namespace vg
