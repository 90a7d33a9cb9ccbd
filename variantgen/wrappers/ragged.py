"""Ragged-KV prefill (kind "ragged"): a spec's module behind ``plan(...)`` / ``run(q, k, v, ...)``.

The KV of request b is rows ``kv_indptr[b] .. kv_indptr[b+1]`` of ``k`` / ``v`` (FlashInfer's
``BatchPrefillWithRaggedKVCacheWrapper`` layout); its queries are rows ``qo_indptr[b] ..
qo_indptr[b+1]`` of ``q`` and are the *last* qo_len tokens of the request
(``q_pos = kv_len - qo_len + q_idx``), exactly as in the paged prefill wrapper. This is
the kernel vLLM's MLA FlashInfer backend uses for prefill (head_dim_qk 192, head_dim_vo
128 for DeepSeek), with ``return_lse=True`` to merge chunked-context prefill.

Two backends: fa2 (FlashInfer's FA2 ragged kernel and scheduler, every NVIDIA GPU from sm80)
and fa3 (its sm90 ragged kernel, Hopper; our work list, the paged fa3 modules' one). One
launch covers the whole batch (one vg_meta row per request). The launch uses the kernel's
causal mode where the spec's mask is exactly ``kv_pos <= q_pos`` (the kernel then skips the
KV tiles above the diagonal), no mask where it is ``true``, and the spec's mask on every tile
otherwise (fa2's kCustom; on fa3 the masked variant in a non-causal launch). fa2 may split a
request's keys over work items (packed back to back, merged by the kernel); fa3 never does.

fa3 runs over a padded copy of K and V. FlashInfer's sm90 ragged kernel loads whole KV tiles
(TMA over the packed [total_kv, heads, dim] tensor) from a request's first key, so the last tile
of request b reads up to CTA_KV - 1 rows (191 at head dim 128) past its last key: over K / V
packed back to back, request b+1's first keys. Their scores are masked (weight 0), but 0 x NaN is
NaN, so a NaN or inf in one request's V reached the other requests' rows (found on an H100,
tests/gpu/test_gpu_isolation.py). run() therefore copies K and V into tensors where every
request's keys, the last one's included, are followed by ``RAGGED_KV_GAP`` (256) zero rows
(variantgen/abi/table.py, which the module's header and plan read as kRaggedKvGap: request b
starts at row ``kv_indptr[b] + b * RAGGED_KV_GAP``). The cost: one copy of K and V per run()
(one index_copy_ each, rows made at plan()), O(total_kv + batch x 256) extra memory while the
kernel runs. A batch of one request is not copied: its tiles past the last key lie past the
tensor's end, which the TMA load fills with zeros. The spec's [total_kv] tensors are still
indexed by the caller's rows (vg_meta's kv_row_base is the unpadded kv_indptr; the kernel's key
index is relative to the request). fa2 and the paged kinds load only a request's own keys (or
its own pages) and need no copy.

LSE convention: ``run(..., return_lse=True)`` returns FlashInfer's log-sum-exp **in base
2** (``log2(sum_j exp(s_j))`` of the scaled, transformed logits), the same convention as
the paged prefill wrapper, ``reference.reference_attention(return_lse=True)`` and
FlashInfer's ``merge_state``. Multiply by ``math.log(2)`` for a natural-log LSE (e.g. for a
merge routine that uses ``exp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..abi.table import META_COLUMNS, RAGGED_KV_GAP, meta_rows
from ..codegen.render import MASK_MODES
from ..core.errors import LaunchError
from ..core.flags import check_flags
from ..lang.nodes import Const
from ..planning.plan import Batch, ScheduledPlan
from .base import LAYOUT_CODES, TORCH_DTYPES, WrapperBase, host_lists
from .checks import check_index_tensors, check_indptr_starts, check_plan_sizes, refuse_grad


def launch_mask_mode(spec: Any, compiled: tuple[str, ...]) -> str:
    """The FlashInfer mask mode a ragged launch uses for ``spec`` (see the module doc)."""
    from ..lang.nodes import to_source
    from ..planning.intervals import analyze

    want = "custom"
    if isinstance(spec.mask, Const) and spec.mask.value is True:
        want = "none"
    else:
        form = analyze(spec)
        if len(form.terms) == 1:
            t = form.terms[0]
            if (t.exact and not (t.conds or t.lows or t.chunks or t.sorted_eqs) and len(t.highs) == 1
                    and to_source(t.highs[0]) == "q_pos"):
                want = "causal"
    if want in compiled:
        return want
    if "custom" in compiled:
        return "custom"
    raise LaunchError(f"the module was compiled with mask modes {list(compiled)}; spec `{spec.name}` needs "
                      f"'{want}' or 'custom'")


@dataclass
class RaggedLaunch:
    mask_mode: str
    qo_indptr: torch.Tensor  # on the device
    kv_indptr: torch.Tensor
    meta: torch.Tensor  # [batch, META_COLUMNS] int32
    plan_info: Any
    int_workspace: torch.Tensor
    float_workspace: torch.Tensor
    num_requests: int
    # fa3 (see the module doc): the padded K / V's rows, the row of each key (int64 [total_kv], in
    # the caller's order) and of each gap row (int64 [batch x RAGGED_KV_GAP]), on the device
    padded_rows: int = 0
    key_rows: torch.Tensor | None = None
    gap_rows: torch.Tensor | None = None

    def padded(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """fa3: ``t`` (K or V, keys along ``dim``) copied into a fresh tensor with RAGGED_KV_GAP
        zero rows after each request's keys: only the gap rows are zeroed, the keys copied with one
        index_copy_ (no host sync)."""
        assert self.key_rows is not None and self.gap_rows is not None
        shape = list(t.shape)
        shape[dim] = self.padded_rows
        out = t.new_empty(shape)
        out.index_fill_(dim, self.gap_rows, 0)
        return out.index_copy_(dim, self.key_rows, t)


class RaggedWrapper(WrapperBase):
    """Ragged-KV prefill for one spec, dtype and (head_dim_qk, head_dim_vo) combination.

    Build it with ``variantgen.make_wrapper(spec, workspace, head_dim_qk=192, head_dim_vo=128,
    q_dtype=..., kv_dtype=..., kind="ragged")``. ``kv_layout`` "NHD": k [total_kv, Hkv,
    head_dim_qk], v [total_kv, Hkv, head_dim_vo]; "HND": k [Hkv, total_kv, head_dim_qk], v
    [Hkv, total_kv, head_dim_vo]. q, k and v may be strided views (e.g. v split off a wider
    kv tensor) as long as their last dimension is contiguous and rows are 16-byte aligned.
    The kernel reads every input in run(), so plan() fixes nothing a later change of a tensor
    could contradict (``check_plan`` has nothing to check here).
    """

    # False: always launch kCustom (evaluate the spec's mask on every tile), e.g. to compare.
    auto_mask_mode = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._launch: RaggedLaunch | None = None
        self.last_plan: ScheduledPlan | None = None  # what the last plan() decided (None: no plan, or it failed)

    def _page_lists(self) -> list[torch.Tensor]:
        return []  # (no page list: the KV is rows of k / v)

    def _dim_capacity(self) -> dict[str, int]:
        return {}  # (no graph mode)

    # ------------------------------------------------------------------ plan
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             *, disable_split_kv: bool = False, **spec_args: Any) -> ScheduledPlan:
        """Plan a batch from its indptrs (read on the host; int32, starting at 0); returns its
        Plan (also kept as ``last_plan``: one launch over the batch, FlashInfer's schedule).

        Spec arguments may be passed here too (as to the paged wrapper); they are checked
        but not used: the ragged kernel reads them in run(), where they are required.
        ``disable_split_kv`` (fa2): keep each request's keys in one work item (fa3 never splits them).
        """
        self._batch, self._launch, self.last_plan = None, None, None
        self._batch, qo_h, kv_h = read_ragged_batch(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, disable_split_kv)
        batch, qo_lens, kv_lens = self._batch.batch_size, self._batch.qo_lens, self._batch.kv_lens
        if spec_args:
            self._check_args(spec_args, where="plan()", require_tensors_from="plan")
        if self._batch.total_q == 0:  # nothing to compute; run() returns empty outputs
            self.plan_stats["launches"] = []
            return self._keep_plan("", disable_split_kv)
        mode = launch_mask_mode(self.spec, self.config.mask_modes) if self.auto_mask_mode else "custom"
        if mode not in self.config.mask_modes:
            raise LaunchError(f"the module was compiled with mask modes {list(self.config.mask_modes)}; "
                              f"a ragged launch needs '{mode}'")
        meta = meta_rows(q_row_base=qo_h[:-1], q_pos_base=[k - q for k, q in zip(kv_lens, qo_lens)],
                         kv_pos_base=[0] * batch, request=list(range(batch)), kv_row_base=kv_h[:-1], req_qo_len=qo_lens,
                         req_kv_len=kv_lens, kernel_window=[-1] * batch, launch_qo_len=qo_lens,
                         vis_lo=[0] * batch, vis_hi=[-1] * batch)  # (no keys known visible: the mask everywhere)
        # begin() first: it waits for the previous plan's copies out of the page-locked mirror
        # the scheduler is about to rewrite (a run() queued behind busy kernels still needs them)
        self._staging.begin()
        int_ws, pinned = self._workspace(0)
        if self.config.backend == "fa3":  # our fa3 work list (templates/fa3/ragged_run.cuh), copied by plan
            plan_info = self.module.plan(int_ws, pinned, torch.tensor(qo_h, dtype=torch.int32),
                                         torch.tensor(kv_h, dtype=torch.int32), mode == "causal")
        else:  # FlashInfer's FA2 scheduler (prefill_plan.cuh), copied by plan
            plan_info = self.module.plan(
                self._float_workspace, int_ws, pinned, torch.tensor(qo_h, dtype=torch.int32),
                torch.tensor(kv_h, dtype=torch.int32), int(qo_h[-1]), batch, num_qo_heads, num_kv_heads,
                1, False, -1, -1, bool(disable_split_kv))
        self._staging.queued()
        # qo_indptr, kv_indptr and vg_meta in one staged copy (no sync)
        staged = self._staging.to_device(qo_h + kv_h + meta, torch.int32)
        self._staging.record()
        kv_indptr_dev = staged[batch + 1:2 * batch + 2]
        self._launch = RaggedLaunch(
            mask_mode=mode,
            qo_indptr=staged[:batch + 1],
            kv_indptr=kv_indptr_dev,
            meta=staged[2 * batch + 2:].view(batch, META_COLUMNS),
            plan_info=plan_info,
            int_workspace=int_ws,
            float_workspace=self._float_workspace,
            num_requests=batch,
        )
        if self.config.backend == "fa3" and batch > 1:  # the plan shifted request b's keys by b x RAGGED_KV_GAP
            la = self._launch
            la.padded_rows = kv_h[-1] + batch * RAGGED_KV_GAP
            la.key_rows, la.gap_rows = padded_kv_rows(kv_indptr_dev, kv_h[-1])
        self.plan_stats["launches"] = [(mode, batch)]
        return self._keep_plan(mode, disable_split_kv)

    def _keep_plan(self, mode: str, disable_split_kv: bool) -> ScheduledPlan:
        """last_plan: the one launch in ``mode`` ("": none, an empty batch), as FlashInfer's scheduler laid it out."""
        fa3 = self.config.backend == "fa3"
        by = "the fa3 ragged work list" if fa3 else "FlashInfer's FA2 scheduler"
        if not fa3:
            by += (", each request's keys in one work item" if disable_split_kv
                   else ", a request's keys may be split over work items")
        why = (f"one {mode} launch over the whole batch" if mode else "no launch (the batch has no queries)")
        self.last_plan = ScheduledPlan(self._batch, kind="ragged", backend=self.config.backend, scheduled_by=by,
                                       planner="off", reason=f"the ragged kind has no interval planner: {why}",
                                       runs=list(self.plan_stats["launches"]))
        return self.last_plan

    # ------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
            return_lse: bool = False, enable_pdl: bool | None = None, **spec_args: Any):
        """Attention of q over the ragged k / v; returns ``out`` [total_q, Hq, head_dim_vo], or
        ``(out, lse)`` with ``return_lse=True`` (lse [total_q, Hq] float32, base 2 - see the
        module doc). Scales: q_scale * k_scale fold into the softmax scale, v_scale scales
        the output (specs with ``scales.qkv_scales``)."""
        if self._batch is None or (self._batch.total_q and self._launch is None):
            raise LaunchError("run() called before plan(): call plan(qo_indptr, kv_indptr, num_qo_heads, "
                              "num_kv_heads) first")
        b = self._batch
        args = check_ragged_run(self, q, k, v, (q_scale, k_scale, v_scale), out, return_lse, enable_pdl, spec_args)
        out, lse = self._outputs(out, return_lse)
        if b.total_q == 0:
            return (out, lse) if return_lse else out
        la = self._launch
        assert la is not None
        tensors, scalars = self._kernel_args(args, q_scale, k_scale, v_scale)
        if enable_pdl is None:  # programmatic dependent launch: sm90+, as FlashInfer defaults
            enable_pdl = self._pdl_default()
        code, layout = MASK_MODES[la.mask_mode][0], LAYOUT_CODES[self.kv_layout]
        if self.config.backend == "fa3":  # the work list carries the requests' rows, in the padded K / V
            dim = 0 if self.kv_layout == "NHD" else 1
            kk, vv = (la.padded(k, dim), la.padded(v, dim)) if la.key_rows is not None else (k, v)
            self.module.ragged_run(la.float_workspace, la.int_workspace, la.plan_info, q, kk, vv, out, lse, code,
                                   layout, bool(enable_pdl), *tensors, la.meta, *scalars)
        else:
            self.module.ragged_run(la.float_workspace, la.int_workspace, la.plan_info, q, k, v, la.qo_indptr,
                                   la.kv_indptr, out, lse, code, layout, -1, bool(enable_pdl), *tensors, la.meta,
                                   *scalars)
        return (out, lse) if return_lse else out


def padded_kv_rows(kv_indptr: torch.Tensor, total_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fa3's padded K / V (see the module doc) from ``kv_indptr`` (int32 [batch + 1], on the
    device; ``total_kv`` its last entry, known on the host): the padded row of each key (key r of
    request b at r + b x RAGGED_KV_GAP) and the RAGGED_KV_GAP gap rows after each request's keys,
    int64 on kv_indptr's device, made there without a host sync."""
    batch = kv_indptr.numel() - 1
    i64 = dict(dtype=torch.int64, device=kv_indptr.device)
    shift = torch.arange(batch, **i64) * RAGGED_KV_GAP
    lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    key_rows = torch.arange(total_kv, **i64) + torch.repeat_interleave(shift, lens, output_size=total_kv)
    gap_rows = ((kv_indptr[1:].to(torch.int64) + shift).unsqueeze(1) + torch.arange(RAGGED_KV_GAP, **i64)).flatten()
    return key_rows, gap_rows


def read_ragged_batch(qo_indptr: Any, kv_indptr: Any, num_qo_heads: Any, num_kv_heads: Any, disable_split_kv: Any,
                      ) -> tuple[Batch, list[int], list[int]]:
    """plan()'s checks of a ragged batch, shared by every ragged route: the Batch and host copies
    of qo_indptr and kv_indptr; LaunchError naming the argument otherwise."""
    check_plan_sizes("plan()", num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads)
    check_flags("plan()", disable_split_kv=disable_split_kv)
    check_index_tensors("plan()", qo_indptr=qo_indptr, kv_indptr=kv_indptr)
    batch = qo_indptr.numel() - 1
    if batch < 1 or kv_indptr.numel() != batch + 1:
        raise LaunchError(f"plan(): inconsistent batch: `qo_indptr` has {qo_indptr.numel()} entries and "
                          f"`kv_indptr` {kv_indptr.numel()} (expected batch + 1 each, batch >= 1)")
    qo_h, kv_h = host_lists(qo_indptr, kv_indptr)
    check_indptr_starts("plan()", qo_indptr=qo_h[0], kv_indptr=kv_h[0])
    qo_lens, kv_lens = [], []
    for b in range(batch):
        ql, kl = qo_h[b + 1] - qo_h[b], kv_h[b + 1] - kv_h[b]
        if ql < 0 or kl < 0:
            name = "qo_indptr" if ql < 0 else "kv_indptr"
            raise LaunchError(f"plan(): `{name}` decreases at request {b}: indptrs must be non-decreasing")
        if ql > kl:
            raise LaunchError(f"plan(): request {b} has {ql} queries but only {kl} keys; the queries must be "
                              "the last qo_len tokens of the request's KV (qo_len <= kv_len)")
        qo_lens.append(ql)
        kv_lens.append(kl)
    return (Batch(batch, qo_h[-1], kv_h[-1], num_qo_heads, num_kv_heads, 1, tuple(qo_lens), tuple(kv_lens)),
            qo_h, kv_h)


def check_ragged_run(w: WrapperBase, q: Any, k: Any, v: Any, scales: tuple[Any, Any, Any], out: Any,
                     return_lse: Any, enable_pdl: Any, spec_args: dict[str, Any]) -> dict[str, Any]:
    """run()'s checks of a ragged batch (return_lse, enable_pdl, q, k, v in the wrapper's layout,
    scales, the spec's arguments, out), shared by every ragged route: the checked spec arguments."""
    check_flags("run()", return_lse=return_lse, enable_pdl=enable_pdl)
    b, cfg = w._batch, w.config
    w._check_rows("q", q, TORCH_DTYPES[cfg.q_dtype], (b.total_q, b.num_qo_heads, cfg.head_dim_qk),
               "[total_q, num_qo_heads, head_dim_qk]")
    kvdt = TORCH_DTYPES[cfg.kv_dtype]
    for name, t, hd, hd_name in (("k", k, cfg.head_dim_qk, "head_dim_qk"),
                                 ("v", v, cfg.head_dim_vo, "head_dim_vo")):
        if w.kv_layout == "NHD":
            shape, text = (b.total_kv, b.num_kv_heads, hd), f"[total_kv, num_kv_heads, {hd_name}]"
        else:
            shape, text = (b.num_kv_heads, b.total_kv, hd), f"[num_kv_heads, total_kv, {hd_name}] (HND)"
        w._check_rows(name, t, kvdt, shape, text)
    w._check_scales(*scales)
    args = w._check_args(spec_args, where="run()")  # `out` is checked by _outputs
    if not w._trains:
        refuse_grad("run()", w.config.backend, {"q": q, "k": k, "v": v, **args})
    return args


# ----------------------------------------------------------------------------- testing helpers


@dataclass
class RaggedBatch:
    """A random ragged batch (what tests and benchmarks feed RaggedWrapper). It has the
    fields batches.random_spec_args reads, so spec arguments come from there."""

    q: torch.Tensor  # [total_q, Hq, head_dim_qk]
    k: torch.Tensor  # NHD [total_kv, Hkv, head_dim_qk] (HND: [Hkv, total_kv, head_dim_qk])
    v: torch.Tensor  # NHD [total_kv, Hkv, head_dim_vo]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    qo_lens: list[int]
    kv_lens: list[int]
    num_qo_heads: int
    num_kv_heads: int
    kv_layout: str = "NHD"

    def plan_args(self) -> tuple:
        return (self.qo_indptr, self.kv_indptr, self.num_qo_heads, self.num_kv_heads)


def random_ragged_batch(qo_lens: list[int], kv_lens: list[int], *, num_qo_heads: int, num_kv_heads: int,
                        head_dim_qk: int, head_dim_vo: int | None = None, dtype: torch.dtype = torch.bfloat16,
                        kv_dtype: torch.dtype | None = None, kv_layout: str = "NHD",
                        device: str | torch.device = "cpu", seed: int = 0) -> RaggedBatch:
    g = torch.Generator().manual_seed(seed)
    head_dim_vo = head_dim_vo or head_dim_qk
    kv_dtype = kv_dtype or dtype
    qo_indptr, kv_indptr = [0], [0]
    for ql, kl in zip(qo_lens, kv_lens):
        qo_indptr.append(qo_indptr[-1] + ql)
        kv_indptr.append(kv_indptr[-1] + kl)
    q = torch.randn(qo_indptr[-1], num_qo_heads, head_dim_qk, generator=g).to(dtype)
    k = torch.randn(kv_indptr[-1], num_kv_heads, head_dim_qk, generator=g).to(kv_dtype)
    v = torch.randn(kv_indptr[-1], num_kv_heads, head_dim_vo, generator=g).to(kv_dtype)
    if kv_layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    i32 = dict(dtype=torch.int32)
    return RaggedBatch(q.to(device), k.to(device), v.to(device), torch.tensor(qo_indptr, **i32).to(device),
                       torch.tensor(kv_indptr, **i32).to(device), list(qo_lens), list(kv_lens), num_qo_heads,
                       num_kv_heads, kv_layout)


def reference_ragged(spec: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
                     kv_indptr: torch.Tensor, args: Any = None, *, kv_layout: str = "NHD", **kwargs: Any):
    """reference.reference_attention over ragged k / v (viewed as pages of one token);
    ``kwargs``: sm_scale, q_scale, k_scale, v_scale, return_lse (LSE in base 2)."""
    from .reference import reference_attention

    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    total_kv = k.shape[0]
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
    return reference_attention(
        spec, q, (k.unsqueeze(1), v.unsqueeze(1)), qo_indptr, kv_indptr,
        torch.arange(total_kv, dtype=torch.int32, device=kv_indptr.device), (kv_lens > 0).to(torch.int32),
        args, **kwargs)
