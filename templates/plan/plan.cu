// The launch builder's entry points in a paged-prefill module (plan_module.h): plan() builds
// the planner-off launches with them, and the CPU tests call its host part. Static C++.
#include <flashinfer/attention/scheduler.cuh>

#include "tvm_ffi_utils.h"
#include "plan_module.h"
