"""kv_tile.fa2_num_mma_kv against FlashInfer's own fa2 dispatch, on the CPU (nvcc, no GPU).

A host program includes FlashInfer's prefill.cuh with the device attributes of an sm90 GPU in
place of the CUDA runtime's, and its DISPATCH_NUM_MMA_KV replaced by one that records the KV
tile instead of launching: it runs FlashInfer's paged and ragged dispatch code as the kernel
units would on that GPU, for every head dim, dtype pair and CTA tile variantgen builds. A
second program checks the pinned units' guard (templates/fa2/pinned_kv_tile.cuh): a device
whose tile differs from the unit's is refused with an error naming both.
"""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

import variantgen
from variantgen.build import builder as build
from variantgen.codegen import kv_tile
from variantgen.codegen.render import DTYPES, FA2_CTA_TILES_Q, ModuleConfig
from variantgen.core.env import TEMPLATES_DIR
from variantgen.routing.capabilities import FA2
from variantgen.routing.capabilities import HEAD_DIMS as HEAD_DIMS_OF

pytestmark = pytest.mark.nvcc

SM90 = kv_tile.SHARED_MEMORY_BY_MAJOR[9]
# every head dim pair and dtype an fa2 prefill module (paged or ragged) is built for
HEAD_DIMS = sorted({*HEAD_DIMS_OF["fa2", "prefill"], *HEAD_DIMS_OF["fa2", "ragged"]})
DTYPE_PAIRS = list(itertools.product(FA2.q_dtypes, FA2.kv_dtypes))

# The CUDA runtime calls FlashInfer's dispatch makes before it picks the tile, answered as an
# sm90 GPU would (and anything else refused, so that a new query shows up here).
DEVICE = f"""\
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
static cudaError_t vg_probe_get_device(int* device) {{ *device = 0; return cudaSuccess; }}
static cudaError_t vg_probe_attribute(int* value, cudaDeviceAttr attr, int) {{
  if (attr == cudaDevAttrMaxSharedMemoryPerMultiprocessor) {{ *value = {SM90.per_sm}; return cudaSuccess; }}
  if (attr == cudaDevAttrMaxSharedMemoryPerBlockOptin) {{ *value = {SM90.per_block_optin}; return cudaSuccess; }}
  std::printf("unexpected attribute %d\\n", int(attr));
  std::exit(3);
}}
#define cudaGetDevice vg_probe_get_device
#define cudaDeviceGetAttribute vg_probe_attribute
"""

PARAMS = """\
#include "kernel_params.cuh"
// One request, one head: what the dispatch reads before it picks the tile.
template <typename Q, typename KV>
struct ProbePaged : vg::PagedPrefillFields<Q, KV, Q, int32_t> {
  ProbePaged() : vg::PagedPrefillFields<Q, KV, Q, int32_t>{} {
    this->padded_batch_size = 1;
    this->num_qo_heads = 1;
    this->paged_kv.num_heads = 1;
  }
};
template <typename Q, typename KV>
struct ProbeRagged : vg::RaggedPrefillFields<Q, KV, Q, int32_t> {
  ProbeRagged() : vg::RaggedPrefillFields<Q, KV, Q, int32_t>{} {
    this->padded_batch_size = 1;
    this->num_qo_heads = 1;
    this->num_kv_heads = 1;
  }
};
using Variant = flashinfer::DefaultAttention<false, false, false, false>;
"""


def compile_and_run(toolchain, tmp_path: Path, name: str, source: str, arch: str = "9.0a") -> str:
    (tmp_path / f"{name}.cu").write_text(source)
    fi = build.flashinfer_info()
    includes = [f"-I{TEMPLATES_DIR / 'fa2'}"] + [f"-I{p}" for p in fi.include_dirs]
    for p in (*fi.system_include_dirs, toolchain.cuda_home / "include"):
        includes += ["-isystem", str(p)]
    config = ModuleConfig(variantgen.resolve_spec("causal"), 64, 64, "bf16", "bf16", "bf16", arch)
    flags = build.semantic_flags(config)["cuda"]  # the kernel units' flags
    exe = tmp_path / name
    done = subprocess.run([str(toolchain.nvcc), *flags, *includes, str(tmp_path / f"{name}.cu"), "-o", str(exe)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return ran.stdout


def test_pinned_kv_tiles_are_flashinfers_choice_on_sm90(toolchain, tmp_path):
    cases, calls = [], []
    for (hd_qk, hd_vo), (q, kv), cta in itertools.product(HEAD_DIMS, DTYPE_PAIRS, FA2_CTA_TILES_Q):
        expected = kv_tile.fa2_num_mma_kv(cta, hd_qk, hd_vo, DTYPES[q][1], DTYPES[kv][1], "9.0a")
        assert expected in kv_tile.MMA_KV_STEPS, (hd_qk, hd_vo, q, kv, cta)
        q_type, kv_type = DTYPES[q][0], DTYPES[kv][0]
        for kind in ("Paged", "Ragged"):
            cases.append((kind, hd_qk, hd_vo, q, kv, cta, expected))
            args = ("/*SAME_KV_STRIDES=*/true, " if kind == "Paged" else "") + (
                f"{cta}, {hd_qk}, {hd_vo}, PosEncodingMode::kNone, false, MaskMode::kNone, Variant, "
                f"Probe{kind}<{q_type}, {kv_type}>")
            calls.append(f"  probe<Probe{kind}<{q_type}, {kv_type}>>([](auto& p) {{\n"
                         f"    flashinfer::BatchPrefillWith{kind}KVCacheDispatched<{args}>(p, nullptr, nullptr, "
                         "false, nullptr);\n  });")
    source = DEVICE + """\
#include <flashinfer/utils.cuh>
static int vg_probe_seen = -1;
#undef DISPATCH_NUM_MMA_KV
#define DISPATCH_NUM_MMA_KV(max_mma_kv, NUM_MMA_KV, ...) \\
  vg_probe_seen = (max_mma_kv) >= 8 ? 8 : (max_mma_kv) >= 4 ? 4 : (max_mma_kv) >= 2 ? 2 : (max_mma_kv) >= 1 ? 1 : 0;
#include <flashinfer/attention/prefill.cuh>
using namespace flashinfer;
""" + PARAMS + """\
template <typename Params, typename Call>
void probe(Call call) {
  Params p;
  vg_probe_seen = -1;
  call(p);
  std::printf("%d\\n", vg_probe_seen);
}
int main() {
""" + "\n".join(calls) + "\n}\n"
    seen = [int(line) for line in compile_and_run(toolchain, tmp_path, "probe", source).split()]
    mismatches = [(*case[:-1], f"variantgen {case[-1]}, FlashInfer {got}") for case, got in zip(cases, seen)
                  if got != case[-1]]
    assert len(seen) == len(cases) and not mismatches, mismatches


def test_a_device_with_another_kv_tile_is_refused(toolchain, tmp_path):
    """A unit pinned to a tile the device would not pick: the launch throws FlashInfer's error
    with both tiles in it, before any kernel runs (hd 64, bf16, CTA 64: sm90 picks 8)."""
    assert kv_tile.fa2_num_mma_kv(64, 64, 64, 2, 2, "9.0a") == 8
    source = DEVICE + """\
#define VG_FA2_NUM_MMA_KV 4
#include "pinned_kv_tile.cuh"
#include <flashinfer/attention/prefill.cuh>
using namespace flashinfer;
""" + PARAMS + """\
// (the kernel is compiled here: what FlashInfer's default variant reads)
struct GuardParams : ProbePaged<nv_bfloat16, nv_bfloat16> {
  float sm_scale = 1.f;
  __host__ __device__ uint32_t get_qo_len(uint32_t batch_idx) const {
    return q_indptr[batch_idx + 1] - q_indptr[batch_idx];
  }
};
int main() {
  GuardParams p;
  try {
    BatchPrefillWithPagedKVCacheDispatched<true, 64, 64, 64, PosEncodingMode::kNone, false, MaskMode::kNone,
                                           Variant, GuardParams>(p, nullptr, nullptr, false, nullptr);
  } catch (const std::exception& e) {
    std::printf("refused: %s\\n", e.what());
    return 0;
  }
  std::printf("not refused\\n");
  return 0;
}
"""
    out = compile_and_run(toolchain, tmp_path, "guard", source)
    assert out.startswith("refused: ") and "built for NUM_MMA_KV=4" in out and "gives NUM_MMA_KV=8" in out, out
