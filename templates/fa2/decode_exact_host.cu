// Static source of variantgen's fa2 decode modules (copied as is).
//
// FlashInfer's batch-decode host code (its csrc/batch_decode.cu) a second time, compiled against
// the module's config with the variant without the spec's mask (VariantgenExactVariant,
// variant.cuh) and its run() named BatchDecodeWithPagedKVCacheRunExact: exported here as the
// module's `run_exact` (binding.cu exports the rest), which plan() picks where every key a
// request's kernel visits is provably visible (decode.py).
// Its plan and workspace-size functions are renamed as well, only so that they do not clash with
// the first copy's; nothing calls them.
#define VG_DECODE_VARIANT VariantgenExactVariant
#define BatchDecodeWithPagedKVCachePlan VariantgenExactDecodePlanUnused
#define BatchDecodeWithPagedKVCacheWorkspaceSize VariantgenExactDecodeWorkspaceSizeUnused
#define BatchDecodeWithPagedKVCacheRun BatchDecodeWithPagedKVCacheRunExact
#include "batch_decode.cu"

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_exact, BatchDecodeWithPagedKVCacheRunExact);
