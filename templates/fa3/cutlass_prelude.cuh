// Static source of variantgen's fa3 modules (copied as is into each module's sources).
//
// FlashInfer's sm90 attention headers include flashinfer/cutlass_utils.cuh, which pulls in
// CUTLASS's host-side test utilities (cutlass/util/reference/device/tensor_fill.h and
// friends) for its GEMM kernels. Those include curand_kernel.h, which a build box with only
// nvcc and the CUDA runtime headers does not have - and the attention kernels use none of
// it. Included first, this header stands in for cutlass_utils.cuh: it takes its include
// guard and includes only the CUTLASS / CuTe headers the attention kernels need (each of
// them includes its GEMM collectives itself).
#pragma once
#ifndef FLASHINFER_CUTLASS_UTILS_CUH_
#define FLASHINFER_CUTLASS_UTILS_CUH_

#include <cuda_fp8.h>

#include <sstream>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"

#endif  // FLASHINFER_CUTLASS_UTILS_CUH_
