"""A CPU stand-in for a generated FA2 *decode* module (``plan`` / ``run``), for DecodeWrapper tests.

``FakeDecodeModule`` checks every call against the module's ABI (templates/fa2/
templates/fa2/decode_binding.cu and FlashInfer's BatchDecodeWithPagedKVCacheRun, extra arguments
in render.kernel_args order) and emulates the kernel in float32 torch:

* ``plan`` takes the *host* page indptr and returns DecodePlanInfo's 10 ints (no split-KV);
* ``run``: request b is row b of q, out, lse and vg_meta; its keys are its page list
  (``kv_len_b`` keys, key j at absolute position ``vg_meta[b][2] + j``); the query sits at
  ``q_pos = vg_meta[b][1]``. The spec's mask is evaluated on every key (decode has no mask
  modes) but those vg_meta says it sees (key trimming's dense run), the logits transform on
  the scaled score, the sink (if any) in the denominator; fully masked requests give 0 and
  lse -inf (or the sink); the output is multiplied by v_scale. NHD and HND caches are both
  accepted.
* ``run_exact``: the same on the kernels without the spec's mask: only the variant's kernel
  window (vg_meta's KERNEL_WINDOW) decides which keys are visible.

Calls are recorded in ``plan_calls`` / ``run_calls``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from _fake_kernel import (
    META_COLUMNS,
    FakeModule,
    kernel_mask,
    launch_env,
    scores_with_logits,
    spec_sink,
    variant_window,
)

from variantgen.abi.table import MAX_KEY_GAPS, NO_GAP_AT, MetaColumn
from variantgen.lang.values import VariantSpec
from variantgen.wrappers.reference import softmax_attention


@dataclass
class DecodePlanCall:
    kv_indptr: list[int]
    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    page_size: int
    enable_cuda_graph: bool


@dataclass
class DecodeRunCall:
    kv_indptr: list[int]
    kv_indices: list[int]
    last_page_len: list[int]
    meta: list[list[int]]
    layout: int
    enable_pdl: bool
    sm_scale: float
    v_scale: float
    scalars: dict[str, Any] = field(default_factory=dict)
    lse: bool = False
    exact: bool = False  # run_exact: the variant without the spec's mask


class FakeDecodeModule:
    """Emulates a generated decode module's ``plan`` and ``run`` on the CPU."""

    def __init__(self, spec: VariantSpec):
        self.spec = spec
        self._abi = FakeModule(spec)  # for its extra-argument (ABI) unpacking
        self.plan_calls: list[DecodePlanCall] = []
        self.run_calls: list[DecodeRunCall] = []
        self._planned: dict[int, DecodePlanCall] = {}

    def plan(self, float_ws, int_ws, pinned, kv_indptr, batch_size, num_qo_heads, num_kv_heads, page_size,
             enable_cuda_graph):
        for name, t in (("float_ws", float_ws), ("int_ws", int_ws), ("pinned", pinned)):
            assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8, name
        assert isinstance(kv_indptr, torch.Tensor) and kv_indptr.dtype == torch.int32, kv_indptr
        assert kv_indptr.device.type == "cpu", "plan() reads the page indptr on the host"
        assert kv_indptr.dim() == 1 and kv_indptr.numel() == batch_size + 1
        for v in (batch_size, num_qo_heads, num_kv_heads, page_size):
            assert isinstance(v, int) and not isinstance(v, bool) and v > 0, v
        assert isinstance(enable_cuda_graph, bool)
        assert num_qo_heads % num_kv_heads == 0
        kvp = kv_indptr.tolist()
        assert all(a < b for a, b in zip(kvp, kvp[1:])), f"every request needs a page: {kvp}"
        call = DecodePlanCall(kvp, batch_size, num_qo_heads, num_kv_heads, page_size, enable_cuda_graph)
        self.plan_calls.append(call)
        self._planned[int_ws.data_ptr()] = call
        return [batch_size, 0, 0, 0, 0, 0, 0, 0, int(enable_cuda_graph), 0]

    def run(self, *a):
        self._run(False, *a)

    def run_exact(self, *a):
        """``run`` on the kernels without the spec's mask: the variant's kernel window only."""
        self._run(True, *a)

    def _run(self, exact, float_ws, int_ws, plan_info, q, k_cache, v_cache, kv_indptr, kv_indices, last_page_len,
             out, lse, layout, window_left, enable_pdl, *extra):
        args, meta_t, sm_scale, v_scale = self._abi._unpack_extra(extra)
        assert layout in (0, 1) and window_left == -1 and isinstance(enable_pdl, bool)
        info = list(plan_info)
        assert len(info) == 10 and not info[9], info
        planned = self._planned[int_ws.data_ptr()]
        kvp = kv_indptr.tolist()
        assert kvp == planned.kv_indptr, "kv_indptr differs from the one plan() scheduled"
        n = planned.batch_size
        assert q.dim() == 3 and q.shape[0] == n and q.stride(-1) == 1, tuple(q.shape)
        assert out.shape[:2] == q.shape[:2] and out.is_contiguous()
        assert meta_t.shape == (n, META_COLUMNS)
        if lse is not None:
            assert lse.dtype == torch.float32 and tuple(lse.shape) == (n, q.shape[1])
        assert k_cache.stride() == v_cache.stride()
        if layout == 1:  # HND -> NHD
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        num_pages, page_size, hkv, dim = k_cache.shape
        hq = q.shape[1]
        assert planned.page_size == page_size and planned.num_qo_heads == hq and planned.num_kv_heads == hkv
        group = hq // hkv
        meta = meta_t.tolist()
        last = last_page_len.tolist()
        for b in range(n):
            (q_row_base, q_pos_base, kv_pos_base, request, kv_row_base, req_qo_len, req_kv_len, kwin,
             qo_len, vis_lo, vis_hi) = meta[b][:MetaColumn.GAP_AT_1]
            gaps = meta[b][MetaColumn.GAP_AT_1:MetaColumn.GAP_LEN_3 + 1]
            assert gaps == [NO_GAP_AT, 0] * MAX_KEY_GAPS, "decode: no gaps"
            assert meta[b][MetaColumn.PAGE_TABLE_AT] == -1, "decode: no page lists"
            assert (q_row_base, request, req_qo_len, qo_len) == (b, b, 1, 1), meta[b]
            assert kwin == -1 or (exact and kwin >= 0), "decode: a kernel window only for run_exact"
            assert vis_hi < vis_lo or kv_pos_base <= vis_lo <= vis_hi <= q_pos_base, "decode: known keys it reads"
            assert q_pos_base == req_kv_len - 1, "the decode query is its request's last token"
            npages = kvp[b + 1] - kvp[b]
            assert npages >= 1 and 1 <= last[b] <= page_size, (b, npages, last[b])
            kv_len = (npages - 1) * page_size + last[b]
            assert 0 <= kv_pos_base and kv_pos_base + kv_len <= req_kv_len, (b, meta[b], kv_len)
            pages = kv_indices[kvp[b]:kvp[b + 1]].long()
            assert bool(((pages >= 0) & (pages < num_pages)).all()), "page index out of range"
            k = k_cache[pages].reshape(-1, hkv, dim)[:kv_len].float().repeat_interleave(group, dim=1)
            v = v_cache[pages].reshape(-1, hkv, v_cache.shape[-1])[:kv_len].float().repeat_interleave(group, 1)
            scores = torch.einsum("hd,khd->hk", q[b].float(), k).unsqueeze(1) * sm_scale  # [h, 1, kv]
            env, _, _ = launch_env(meta[b], 1, kv_len, hq, group)
            scores = scores_with_logits(self.spec, env, args, scores)
            if exact:
                visible = variant_window((hq, 1, kv_len), kwin)
            else:
                visible = kernel_mask(self.spec, env, args, (hq, 1, kv_len), meta[b])  # (no mask on known keys)
            o, lse_b = softmax_attention(scores.masked_fill(~visible, -math.inf), v,
                                         spec_sink(self.spec, env, args, hq))
            out[b] = (o[0] * v_scale).to(out.dtype)
            if lse is not None:
                lse[b] = lse_b[0]
        self.run_calls.append(DecodeRunCall(
            kvp, kv_indices.tolist(), last, meta, layout, enable_pdl, sm_scale, v_scale,
            {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}, lse is not None, exact))
