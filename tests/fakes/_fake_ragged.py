"""CPU stand-ins for the ragged-KV modules (kind "ragged"), for RaggedWrapper's tests.

``FakeRaggedModule`` emulates an fa2 ragged module: ``plan`` is FakeModule's (FlashInfer's
plan-info layout, the packed o_indptr in the int workspace) and ``ragged_run`` reads request b's
keys exactly: rows ``kv_indptr[b] .. kv_indptr[b+1]`` of k / v (FlashInfer's FA2 kernel loads a
request's own keys only, a partial tile predicated).

``FakeFa3RaggedModule`` emulates an fa3 ragged module, the over-read of FlashInfer's sm90 kernel
included: ``plan`` writes the sm90 work list with request b's first key at row ``kv_indptr[b] +
b * RAGGED_KV_GAP`` of the padded K / V (as templates/fa3/ragged_run.cuh's plan), and
``ragged_run`` reads each request's keys from the k / v it is given at the work list's offsets,
in whole tiles of ``CTA_KV`` rows from its first key - past its last key, clamped to the
tensor's end, as TMA loads them. The rows past the last key get a masked score (weight 0) and
still go through P @ V, so a NaN or inf there makes the request's rows NaN (0 x NaN), as on the
GPU: given K / V packed back to back (no gap), the next request's bad values leak in.

Both check the wrapper's arguments against the ABI (tests/fakes/_fake_kernel.py's FakeModule)
and record each call in ``ragged_calls``.
"""

from __future__ import annotations

import math

import torch
from _fake_kernel import (
    MODE_NAMES,
    FakeModule,
    launch_env,
    scores_with_logits,
    spec_mask,
    spec_sink,
)

from variantgen.abi import table as plan_abi
from variantgen.abi.table import META_COLUMNS, MetaColumn, PrefillPlanInfo, SM90PlanInfo
from variantgen.wrappers.reference import softmax_attention


class FakeRaggedModule(FakeModule):
    """``plan`` from FakeModule (FlashInfer's plan-info layout, packed o_indptr in the int
    workspace) plus an emulated ``ragged_run``."""

    def __init__(self, spec):
        super().__init__(spec)
        self.ragged_calls: list[dict] = []

    def paged_run(self, *a, **k):  # a ragged module exports no paged_run
        raise AssertionError("RaggedWrapper called paged_run")

    def ragged_run(self, float_ws, int_ws, plan_info, q, k, v, qo_indptr, kv_indptr, out, lse, mask_mode, layout,
                   window_left, enable_pdl, *extra):
        args, meta_t, sm_scale, v_scale = self._unpack_extra(extra)
        assert mask_mode in MODE_NAMES and layout in (0, 1) and window_left == -1
        assert isinstance(enable_pdl, bool)
        info = list(plan_info)
        n = int(info[PrefillPlanInfo.PADDED_BATCH_SIZE])
        planned = self._planned[int_ws.data_ptr()]
        assert planned.page_size == 1 and planned.batch_size == n and meta_t.shape == (n, META_COLUMNS)
        assert qo_indptr.dtype == kv_indptr.dtype == torch.int32 and qo_indptr.device == q.device
        qs, kvp = qo_indptr.tolist(), kv_indptr.tolist()
        assert qs == planned.qo_indptr and kvp == planned.kv_indptr, "indptrs differ from the planned ones"
        o_off = int(info[PrefillPlanInfo.O_INDPTR_OFFSET])
        o_indptr = int_ws[o_off:o_off + 4 * (n + 1)].view(torch.int32).tolist()
        if layout == 1:  # HND -> NHD
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        total_q, hq, _ = q.shape
        hkv = k.shape[1]
        assert planned.num_qo_heads == hq and planned.num_kv_heads == hkv and k.shape[0] == v.shape[0]
        assert k.shape[0] == kvp[-1], f"fa2 reads the packed k / v: {kvp[-1]} rows, got {k.shape[0]}"
        self.ragged_calls.append(dict(mode=MODE_NAMES[mask_mode], meta=meta_t.tolist(), qo_indptr=qs, kv_indptr=kvp,
                                      layout=layout, lse=lse is not None, sm_scale=sm_scale, v_scale=v_scale,
                                      args={k_: v_ for k_, v_ in args.items() if not isinstance(v_, torch.Tensor)}))
        self._attend(q, k, v, qs, kvp, o_indptr, meta_t.tolist(), mask_mode, args, sm_scale, v_scale, out, lse)

    def _attend(self, q, k, v, qs, kvp, o_rows, meta, mask_mode, args, sm_scale, v_scale, out, lse, *,
                kv_first=None, tile=None):
        """Each request b's queries (rows qs[b] ..) over its keys of the NHD k / v, written at rows
        o_rows[b] of ``out`` (and ``lse``). Its keys are rows ``kv_first[b] ..`` (default: kvp[b],
        the caller's rows, which vg_meta's kv_row_base must name in any case). ``tile``: the kernel
        loads keys in whole tiles of that many rows (clamped to the tensor's end): the rows past the
        request's last key take part in P @ V with weight 0, so a NaN / inf there is NaN in the
        request's rows (None: exactly its keys)."""
        total_q, hq, _ = q.shape
        hkv = k.shape[1]
        assert out.is_contiguous() and out.shape == (total_q, hq, v.shape[-1])
        group = hq // hkv
        for b in range(len(meta)):
            q_row_base, q_pos_base, kv_pos_base, request, kv_row_base, req_qo, req_kv, kwin, qo_len = meta[b][:9]
            assert meta[b][MetaColumn.VIS_HI] < meta[b][MetaColumn.VIS_LO], "ragged: no keys known visible"
            kv_len = kvp[b + 1] - kvp[b]
            assert q_row_base == qs[b] and qo_len == qs[b + 1] - qs[b] and kv_row_base == kvp[b], meta[b]
            assert kv_pos_base == 0 and req_kv == kv_len and req_qo == qo_len and kwin == -1, meta[b]
            if qo_len == 0:
                continue
            first = kvp[b] if kv_first is None else kv_first[b]
            assert 0 <= first and first + kv_len <= k.shape[0], f"request {b}'s keys lie outside k / v"
            kb = k[first:first + kv_len].float().repeat_interleave(group, dim=1)
            vb = v[first:first + kv_len].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[qs[b]:qs[b + 1]].float(), kb) * sm_scale
            env, i, j = launch_env(meta[b], qo_len, kv_len, hq, group)
            scores = scores_with_logits(self.spec, env, args, scores)
            if mask_mode == 2:
                visible = spec_mask(self.spec, env, args, (hq, qo_len, kv_len))
            else:
                # none and causal run a variant without the spec's mask (fa2's <Spec>Exact; fa3
                # never evaluates it): right only where the mask is exactly the mode
                visible = ((j <= kv_len - qo_len + i) if mask_mode == 1 else torch.ones_like(j, dtype=torch.bool))
                visible = visible.expand(hq, qo_len, kv_len)
                assert torch.equal(visible, spec_mask(self.spec, env, args, (hq, qo_len, kv_len))), (
                    f"ragged launched {MODE_NAMES[mask_mode]!r} for spec {self.spec.name!r}, whose mask is not "
                    "exactly that mode on this request")
            o, lse_b = softmax_attention(scores.masked_fill(~visible, -math.inf), vb,
                                         spec_sink(self.spec, env, args, hq))
            if tile is not None:  # the last tile's rows past the last key: masked, weight 0, still in P @ V
                end = min(first + -(-kv_len // tile) * tile, v.shape[0])
                past = v[first + kv_len:end].float().repeat_interleave(group, dim=1)
                o = o + torch.einsum("hqk,khd->qhd", o.new_zeros(hq, qo_len, past.shape[0]), past)
            o_row = o_rows[b]
            out[o_row:o_row + qo_len] = (o * v_scale).to(out.dtype)
            if lse is not None:
                lse[o_row:o_row + qo_len] = lse_b


class FakeFa3RaggedModule(FakeRaggedModule):
    """An fa3 ragged module: ``plan(int_ws, page_locked, qo_indptr, kv_indptr, causal)`` writes an
    sm90 work list (one SM list here, every query tile once) through the page-locked mirror into
    the int workspace, as the module's plan does, with request b's keys from row kv_indptr[b] +
    b * RAGGED_KV_GAP of the padded K / V; ``ragged_run`` (no indptr tensors: the work list carries
    each request's rows) reads the requests back from it and attends as FakeRaggedModule, over the
    k / v it is given at the work list's key offsets, in whole KV tiles of CTA_KV rows."""

    CTA = 128  # query tile
    CTA_KV = 128  # KV tile (FlashInfer's is 64 to 192 by head dims; any >= 1 shows the over-read)

    def plan(self, int_ws, pinned, qo_indptr, kv_indptr, causal):
        for name, t in (("int_ws", int_ws), ("pinned", pinned)):
            assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8, name
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
            assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu", name
        assert isinstance(causal, bool) and qo_indptr.numel() == kv_indptr.numel() >= 2
        qs, kvp = qo_indptr.tolist(), kv_indptr.tolist()
        n = len(qs) - 1
        gap = plan_abi.RAGGED_KV_GAP  # (read at the call: a test may change it)
        # SM90PlanInfo's arrays in its order: tile, first row, first key (padded), rows, keys, head, request
        items = [(t, qs[b], kvp[b] + b * gap, qs[b + 1] - qs[b], kvp[b + 1] - kvp[b], 0, b)
                 for b in range(n) for t in range(-(-(qs[b + 1] - qs[b]) // self.CTA))]
        stride = -(-4 * max(len(items), 1) // 16) * 16
        offsets = [i * stride for i in range(7)]
        work_indptr = 7 * stride
        ints = pinned[:work_indptr + 8].view(torch.int32)
        for off, column in zip(offsets, zip(*items)):
            ints[off // 4:off // 4 + len(items)] = torch.tensor(column, dtype=torch.int32)
        ints[work_indptr // 4:work_indptr // 4 + 2] = torch.tensor([0, len(items)], dtype=torch.int32)
        int_ws[:work_indptr + 8].copy_(pinned[:work_indptr + 8])  # the module's copy into the workspace
        self.plan_calls.append(dict(qo_indptr=qs, kv_indptr=kvp, causal=causal))
        self._planned[int_ws.data_ptr()] = (qs, kvp)
        return [*offsets[:6], work_indptr, offsets[6], 1]

    def ragged_run(self, float_ws, int_ws, plan_info, q, k, v, out, lse, mask_mode, layout, enable_pdl, *extra):
        args, meta_t, sm_scale, v_scale = self._unpack_extra(extra)
        assert mask_mode in MODE_NAMES and layout in (0, 1) and isinstance(enable_pdl, bool)
        info = list(plan_info)
        assert len(info) == len(SM90PlanInfo) and info[SM90PlanInfo.SAME_SCHEDULE_FOR_ALL_HEADS] == 1, info
        qs, kvp = self._planned[int_ws.data_ptr()]
        ints = int_ws.view(torch.int32)
        works = int(ints[info[SM90PlanInfo.WORK_INDPTR_OFFSET] // 4 + 1])
        fields = (SM90PlanInfo.QO_INDPTR_OFFSET, SM90PlanInfo.KV_INDPTR_OFFSET, SM90PlanInfo.QO_LEN_OFFSET,
                  SM90PlanInfo.KV_LEN_OFFSET, SM90PlanInfo.BATCH_INDICES_OFFSET)
        q_first, kv_first, q_len, k_len, batch = (ints[info[f] // 4:info[f] // 4 + works].tolist() for f in fields)
        first_key = {}
        for w in range(works):  # each work item carries its request's rows and keys
            b = batch[w]
            assert (q_first[w], q_len[w], k_len[w]) == (qs[b], qs[b + 1] - qs[b], kvp[b + 1] - kvp[b]), (
                f"work item {w} disagrees with the plan")
            assert first_key.setdefault(b, kv_first[w]) == kv_first[w], f"request {b}'s work items disagree"
        assert {b for b in range(len(qs) - 1) if qs[b + 1] > qs[b]} == set(batch), "a request with rows has no work"
        if layout == 1:  # HND -> NHD
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        assert k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1]
        self.ragged_calls.append(dict(mode=MODE_NAMES[mask_mode], meta=meta_t.tolist(), qo_indptr=qs, kv_indptr=kvp,
                                      layout=layout, lse=lse is not None, sm_scale=sm_scale, v_scale=v_scale,
                                      kv_rows=k.shape[0], kv_first=[first_key.get(b) for b in range(len(qs) - 1)],
                                      args={k_: v_ for k_, v_ in args.items() if not isinstance(v_, torch.Tensor)}))
        self._attend(q, k, v, qs, kvp, qs, meta_t.tolist(), mask_mode, args, sm_scale, v_scale, out, lse,
                     kv_first=[first_key.get(b, 0) for b in range(len(qs) - 1)], tile=self.CTA_KV)
