"""A CPU stand-in for a generated FA2 module (``plan`` / ``paged_run``), for wrapper tests.

``FakeModule`` emulates what the compiled kernel does with the wrapper's launches, in
float32 torch on the CPU, closely enough that the interval planner can be checked
against the dense reference without a GPU:

* ``plan_direct`` (plan()'s planner-off path) calls the real launch builder's host part
  (tests/fakes/_builder.py: one nvcc-built module) and does its device part in torch ops, so the
  launches the fakes run are the ones the real modules would lay out.
* ``plan`` returns FlashInfer's PrefillPlanInfo layout (15 ints, split-KV off) and, like
  FlashInfer's scheduler, writes the packed ``o_indptr`` into the int workspace at
  ``o_indptr_offset`` (0 here). ``paged_run`` writes each launch request's output rows at
  ``o_indptr[b]`` read back from that workspace, so a wrapper that forgets to point
  o_indptr at unpacked rows writes the wrong rows (as the real kernel would). Launches the
  builder scheduled are read from its work list (fa2: one CTA per query tile; CUDA-graph
  mode's padding CTAs switched off by the valid mask).
* each launch request b reads q rows ``q_starts[b] ...`` (``vg_meta[b][8]`` of them) and
  keys j = 0 .. kv_len_b - 1 from its own page list; key j sits at absolute position
  ``vg_meta[b][2] + j``.
* mask mode 2 (custom) evaluates the variant's mask (the spec's, but on the keys vg_meta says
  every row sees: there only the kernel window) with true positions and rows; mode 1 (causal)
  is ``j <= d`` (d = kv_len_b - qo_len_b + i); on fa3 also ``j >= d - w`` with kernel window
  w >= 0, while fa2 evaluates the variant's mask only where FlashInfer's fa2 kernel is sure to:
  on the keys from the diagonal of each query tile's first query on (``j >= d0``, the tile of
  packed row i * group + head % group; its kernel starts at the KV tile holding d0, so at or
  before it) and below its last row's window edge (the window is the variant's to apply).
  That variant is the spec's in fa2's tail launch (its own code, FA2_TAIL_RUN_CODE); under
  code 1 it is the exact launches' (compiled without the spec's mask), which checks only the
  kernel window, whatever vg_meta says. Mode 0 (none) sees every key of the launch request.
  The planner may only send rows there whose visible set is exactly that; a strict emulation
  catches any row for which it is not.
  The query tile is the launch's work list's (or, FlashInfer scheduling it, what its scheduler
  picks for the mean launch request: fa2_cta_tile_q).
* the spec's logits transform is applied in every mode to the scaled score; its sink (if
  any) joins each row's denominator once; fully masked rows give 0 (lse -inf, or the sink);
  the output is multiplied by v_scale and cast to ``out.dtype``.

``FakeFa3Module`` takes the fa3 module's paged_run (its work list from the launch builder),
emulated through FakeModule; the ragged modules' fakes are in tests/fakes/_fake_ragged.py.
``FakeRowPlanner`` stands in for a spec's planner module: its ``plan_batch`` runs the row
rules in torch ops (rowrules.py, the reference the GPU row kernel is tested against) and the
real builder.

Every call is checked against the ABI (argument order and types from
render.kernel_args) and recorded; ``row_writes`` counts, per output row, how many launch
requests wrote it (reset it to None before a run to check a partition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from _builder import finish_on_cpu, plan_builder

from variantgen.abi.table import (
    FA2_TAIL_RUN_CODE,
    LISTED_RUN_CODE,
    MAX_KEY_GAPS,
    META_COLUMNS,
    SEG_FIELDS,
    MaskMode,
    MetaColumn,
    PrefillPlanInfo,
    SM90PlanInfo,
)
from variantgen.codegen import logits_fold
from variantgen.lang.evaluate import Evaluator
from variantgen.lang.reads import page_list_atoms
from variantgen.lang.values import VariantSpec
from variantgen.planning.planner import fa3_cta_tile_q
from variantgen.wrappers.merge import merge_inline_reference, merge_pieces_reference
from variantgen.wrappers.reference import softmax_attention

# run()'s codes: the mask modes and the listed launch (custom, the keys through page lists' tables)
MODE_NAMES = {**{int(m): m.label for m in MaskMode}, LISTED_RUN_CODE: "listed"}
# fa2's paged_run codes: those, and the tail launch's causal with the spec's mask
FA2_RUN_CODES = {**MODE_NAMES, FA2_TAIL_RUN_CODE: "causal"}


def fa2_cta_tile_q(packed_len: int, head_dim_vo: int, head_dim_qk: int) -> int:
    """FlashInfer's FA2DetermineCtaTileQ (what its scheduler and the launch builder pick for
    launch requests of packed_len rows), as it answers on this machine: below sm80, or with no
    GPU, it never picks 16."""
    if head_dim_vo >= 512:
        return 16 if packed_len <= 32 else 32
    if head_dim_qk >= 512:
        return 16
    if packed_len > 64 and head_dim_vo < 256:
        return 128
    ampere = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return 64 if packed_len > 16 or not ampere else 16


def gap_shift(meta_row: list[int], j: torch.Tensor) -> torch.Tensor:
    """How far past kv_pos_base + j list key j sits: the gaps its page list skipped, as the
    variant's key_pos adds them (gap_len of every gap whose gap_at is at or before j)."""
    shift = torch.zeros_like(j)
    if len(meta_row) <= MetaColumn.GAP_AT_1:  # (a row laid out by hand, without the gap columns)
        return shift
    for g in range(MAX_KEY_GAPS):
        at, length = meta_row[MetaColumn.GAP_AT_1 + 2 * g], meta_row[MetaColumn.GAP_LEN_1 + 2 * g]
        shift = shift + torch.where(j >= at, length, 0)
    return shift


def skipped_keys(meta_row: list[int]) -> int:
    """Keys the page list of a launch request skips (its gaps' lengths)."""
    if len(meta_row) <= MetaColumn.GAP_AT_1:
        return 0
    return sum(meta_row[MetaColumn.GAP_LEN_1 + 2 * g] for g in range(MAX_KEY_GAPS))


def page_table(meta_t: torch.Tensor, meta_row: list[int], pages: int) -> torch.Tensor | None:
    """The key positions of a launch request's listed pages (vg_meta's PAGE_TABLE_AT: int32 from
    the launch's first vg_meta row, laid out after its metadata arrays), None without a list."""
    if len(meta_row) <= MetaColumn.PAGE_TABLE_AT or meta_row[MetaColumn.PAGE_TABLE_AT] < 0:
        return None
    at = meta_t.storage_offset() + meta_row[MetaColumn.PAGE_TABLE_AT]
    assert at + pages <= meta_t.untyped_storage().nbytes() // 4, "a page table past the workspace"
    return torch.as_strided(meta_t, (pages,), (1,), at).long()


def launch_env(meta_row: list[int], qo_len: int, kv_len: int, hq: int, group: int, *,
               local_q_idx: bool = False, table: torch.Tensor | None = None
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The expression builtins of one launch request as the generated hooks compute them from
    its vg_meta row, over [heads, qo_len, kv_len], and the local indices i [1, qo, 1], j [1, 1, kv].
    ``local_q_idx``: q_idx as the launch request's row (the pre-fix codegen) instead of the request's.
    ``table``: its page list's key positions (page_table), which place list key j as key_pos does."""
    q_row_base, q_pos_base, kv_pos_base, request, kv_row_base, req_qo_len, req_kv_len = meta_row[:7]
    i64 = torch.int64
    i = torch.arange(qo_len, dtype=i64).view(1, -1, 1)
    j = torch.arange(kv_len, dtype=i64).view(1, 1, -1)
    q_pos, kv_pos = q_pos_base + i, kv_pos_base + j + gap_shift(meta_row, j)
    if table is not None:
        ps = meta_row[MetaColumn.LIST_PAGE_SIZE]
        kv_pos = table[j // ps] + j % ps
    qo_head = torch.arange(hq, dtype=i64).view(-1, 1, 1)
    env = {
        "q_pos": q_pos, "kv_pos": kv_pos, "q_idx": i if local_q_idx else q_pos - (req_kv_len - req_qo_len),
        "q_row": q_row_base + i, "kv_row": kv_row_base + kv_pos, "q_kv_row": kv_row_base + q_pos,
        "request": torch.tensor(request, dtype=i64), "qo_len": torch.tensor(req_qo_len, dtype=i64),
        "kv_len": torch.tensor(req_kv_len, dtype=i64), "qo_head": qo_head, "kv_head": qo_head // group,
    }
    return env, i, j


def scores_with_logits(spec: VariantSpec, env: dict, args: dict, scores: torch.Tensor) -> torch.Tensor:
    """The spec's logits transform applied to the scaled scores (unchanged without one), the way
    the generated variant computes it: launch-uniform factors folded into the score scale and the
    softmax scale (variantgen/codegen/logits_fold.py), so the wrapper tests hold the fold to the reference."""
    if spec.logits is None:
        return scores
    return logits_fold.evaluate(logits_fold.fold(spec), spec, env, args, scores).expand_as(scores)


def spec_mask(spec: VariantSpec, env: dict, args: dict, shape: tuple[int, ...]) -> torch.Tensor:
    return Evaluator(spec, env, args).ev(spec.mask).expand(shape)


def variant_window(shape: tuple[int, ...], window: int) -> torch.Tensor:
    """fa2's variant window check, kv_idx + qo_len + window_left >= kv_len + qo_idx, in launch-local
    indices (``window`` < 0: none, window_left = kv_len). ``shape``: [heads, qo_len, kv_len]."""
    _, qo_len, kv_len = shape
    i = torch.arange(qo_len).view(1, -1, 1)
    j = torch.arange(kv_len).view(1, 1, -1)
    return (j + qo_len + (window if window >= 0 else kv_len) >= kv_len + i).expand(shape)


def kernel_mask(spec: VariantSpec, env: dict, args: dict, shape: tuple[int, ...], meta_row: list[int]) -> torch.Tensor:
    """The generated mask as the variant evaluates it: keys in the launch request's known-visible
    range [VIS_LO, VIS_HI] are visible without evaluating it but for the kernel window (the
    planner's claim, trusted as the kernel trusts it: a wrong range shows as a wrong output), the
    others by the spec's mask. ``shape``: [heads, qo_len, kv_len] of the launch request."""
    lo, hi = meta_row[MetaColumn.VIS_LO], meta_row[MetaColumn.VIS_HI]
    known = (env["kv_pos"] >= lo) & (env["kv_pos"] <= hi)
    window = meta_row[MetaColumn.KERNEL_WINDOW]
    if window >= 0:
        return torch.where(known, variant_window(shape, window), spec_mask(spec, env, args, shape))
    return known | spec_mask(spec, env, args, shape)


def spec_sink(spec: VariantSpec, env: dict, args: dict, heads: int) -> torch.Tensor | None:
    """The spec's sink logit per query head, [heads, 1], as the variant computes it from the
    launch request's vg_meta row (None without a sink): every launch request of a row adds it."""
    if spec.sink is None:
        return None
    return Evaluator(spec, env, args).as_float(spec.sink).expand(heads, 1, 1).reshape(heads, 1)


def assert_lse_matches(lse: torch.Tensor, ref_lse: torch.Tensor, label: str) -> None:
    """Same -inf pattern (rows with no visible key), and |lse - ref| <= 1e-4 + 1e-5 |ref| elsewhere."""
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), f"{label}: lse -inf pattern differs"
    fin = torch.isfinite(ref_lse)
    bad = ((lse - ref_lse).abs() > 1e-4 + 1e-5 * ref_lse.abs()) & fin
    if bad.any():
        worst = (lse[fin] - ref_lse[fin]).abs().max().item()
        raise AssertionError(f"{label}: lse off on rows {bad.any(1).nonzero().flatten().tolist()[:20]} "
                             f"(max {worst:.2e})")


def assert_matches_reference(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor,
                             label: str, unit: str = "rows") -> None:
    """A bf16 kernel output vs the float32 reference: every row written, relative error below
    1e-3 against the reference rounded to bf16, no row off by more than bf16's step; then the LSE."""
    assert not torch.isnan(out.float()).any(), f"{label}: rows left unwritten"
    ref_bf16 = ref.to(torch.bfloat16).float()
    err = ((out.float() - ref_bf16).norm() / ref_bf16.norm().clamp_min(1e-12)).item()
    bad = (out.float() - ref).abs() > (2.0 ** -7) * ref.abs() + 1e-4
    bad_rows = bad.flatten(1).any(1).nonzero().flatten().tolist()
    assert err < 1e-3 and not bad_rows, f"{label}: rel. error {err:.2e}; {unit} off: {bad_rows[:20]}"
    assert_lse_matches(lse, ref_lse, label)


def assert_plan_matches_reference(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor,
                                  merge: Any, v_max: float, label: str) -> None:
    """assert_matches_reference where no row was merged from pieces (``merge``: the Plan's, or
    None). A merged row is a convex combination of partial outputs each rounded to bf16 by its
    launch, so its error is bounded by bf16's rounding of the partials, which may be larger than
    the merged row itself where they cancel: at most 2^-9 max|v| per partial, 2^-9 |o| for the
    final rounding - checked as |out - ref| <= 2^-8 max|v| + 2^-8 |ref|, and its LSE (merged in
    float32) as tightly as any row's."""
    if merge is None or not merge.rows.numel():
        assert_matches_reference(out, lse, ref, ref_lse, label)
        return
    rows = merge.rows.cpu()
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[rows] = False
    assert_matches_reference(out[keep], lse[keep], ref[keep], ref_lse[keep], label)
    got, want = out[rows].float(), ref[rows]
    assert not torch.isnan(got).any(), f"{label}: merged rows left unwritten"
    bad = (got - want).abs() > 2.0 ** -8 * (v_max + want.abs())
    bad_rows = rows[bad.flatten(1).any(1)].tolist()
    assert not bad_rows, f"{label}: merged rows off: {bad_rows[:20]}"
    assert_lse_matches(lse[rows], ref_lse[rows], f"{label} (merged rows)")


@dataclass
class PlanCall:
    qo_indptr: list[int]
    kv_indptr: list[int]
    total_rows: int
    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    page_size: int
    enable_cuda_graph: bool
    window_left: int
    fixed_split_size: int
    disable_split_kv: bool


@dataclass
class RunCall:
    mask_mode: str
    num_requests: int
    rows: int  # query rows this launch covers
    meta: list[list[int]]
    scalars: dict[str, Any] = field(default_factory=dict)
    code: int = -1  # the run() code paged_run got (fa2: FA2_TAIL_RUN_CODE for its tail launch)


class FakeModule:
    """Emulates a generated module's ``plan`` and ``paged_run`` on the CPU."""

    # fa2's causal launch evaluates the mask on each query tile's diagonal tiles; fa3's evaluates none
    mask_on_diagonal = True

    def __init__(self, spec: VariantSpec, *, codegen_q_idx: bool = False):
        self.spec = spec
        # True: q_idx as the generated hook computed it before the fix (q_local: the index
        # inside the *launch* request); False: the language's meaning (index inside the request).
        self.codegen_q_idx = codegen_q_idx
        self.plan_calls: list[PlanCall] = []
        self.run_calls: list[RunCall] = []
        self.direct_calls = 0
        self.merge_calls = 0
        self.inline_merges = 0  # (of merge_calls: merge_inline)
        self.row_writes: torch.Tensor | None = None
        self._planned: dict[int, PlanCall] = {}  # int workspace data_ptr -> plan of that launch

    # ------------------------------------------------------------------ the launch builder
    @property
    def build_launches(self):
        """The real builder's host part (every paged-prefill module exports it)."""
        return plan_builder().build_launches

    def plan_direct(self, indices, options, kv_indices, workspace, workspace_host, desc):
        """plan()'s planner-off launches: the real builder, then its device part on the CPU."""
        self.direct_calls += 1
        self.build_launches(indices, torch.empty(0, SEG_FIELDS, dtype=torch.int64), options, workspace_host, desc)
        finish_on_cpu(desc, workspace_host, workspace, kv_indices)

    def merge_pieces(self, out, lse, parts, parts_lse, rows, counts):
        """run()'s merge of split rows' partial outputs: the kernel's reference (wrappers/merge.py)."""
        self.merge_calls += 1
        merge_pieces_reference(out, lse, parts, parts_lse, rows, counts)

    def merge_inline(self, out, lse_in, lse_out, q, k_cache, v_cache, kv_indices, rows, first_entry, first_slot, keys,
                     sm_scale, v_scale, kv_head_div, hnd):
        """run()'s merge of an inline first piece into the rows written in place: the kernel's
        reference, after the checks the kernel's binding makes."""
        assert out.dim() == 3 and q.shape[1:] == out.shape[1:] and lse_in.shape == out.shape[:2]
        assert k_cache.dtype == v_cache.dtype == q.dtype == out.dtype, "one dtype"
        assert kv_indices.dtype == torch.int32 and rows.dtype == torch.int64
        assert first_entry.dtype == first_slot.dtype == keys.dtype == torch.int32
        assert rows.numel() == first_entry.numel() == first_slot.numel() == keys.numel()
        assert int(keys.min()) >= 1 and int((first_entry + (first_slot + keys - 1) // (
            k_cache.shape[2] if hnd else k_cache.shape[1])).max()) < kv_indices.numel(), "inline keys past the list"
        self.merge_calls += 1
        self.inline_merges += 1
        merge_inline_reference(out, lse_in, lse_out, q, k_cache, v_cache, kv_indices, rows, first_entry, first_slot,
                               keys, sm_scale, v_scale, kv_head_div, hnd)

    # ------------------------------------------------------------------ plan
    def plan(self, float_ws, int_ws, pinned, qo_indptr, kv_indptr, total_rows, batch_size, num_qo_heads,
             num_kv_heads, page_size, enable_cuda_graph, window_left, fixed_split_size, disable_split_kv):
        for name, t in (("float_ws", float_ws), ("int_ws", int_ws), ("pinned", pinned)):
            assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8, name
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
            assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu", name
            assert t.dim() == 1 and t.numel() == batch_size + 1, (name, t.shape, batch_size)
        for v in (total_rows, batch_size, num_qo_heads, num_kv_heads, page_size, window_left, fixed_split_size):
            assert isinstance(v, int) and not isinstance(v, bool), v
        assert isinstance(enable_cuda_graph, bool) and isinstance(disable_split_kv, bool)
        qo = qo_indptr.tolist()
        kvp = kv_indptr.tolist()
        # (CUDA-graph scheduling takes the capacity: at least the rows planned)
        assert qo[0] == 0 and (qo[-1] == total_rows or enable_cuda_graph and qo[-1] <= total_rows), (qo[-1], total_rows)
        assert all(a <= b for a, b in zip(qo, qo[1:])) and all(a <= b for a, b in zip(kvp, kvp[1:]))
        call = PlanCall(qo, kvp, total_rows, batch_size, num_qo_heads, num_kv_heads, page_size,
                        enable_cuda_graph, window_left, fixed_split_size, disable_split_kv)
        self.plan_calls.append(call)
        self._planned[int_ws.data_ptr()] = call
        # FlashInfer's scheduler writes o_indptr (packed, one entry per request: no split-KV).
        int_ws[:4 * (batch_size + 1)].view(torch.int32).copy_(qo_indptr)
        return [batch_size, total_rows, 0, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, int(enable_cuda_graph), 0]

    # ------------------------------------------------------------------ run
    def _unpack_extra(self, extra: tuple) -> tuple[dict[str, Any], torch.Tensor, float, float]:
        spec = self.spec
        n_t = len(spec.tensors)
        expected = n_t + 1 + len(spec.scalars) + 1 + int(spec.qkv_scales)
        assert len(extra) == expected, f"paged_run got {len(extra)} extra arguments, the ABI has {expected}"
        args: dict[str, Any] = {}
        for t, value in zip(spec.tensors, extra[:n_t]):
            want = {"int32": torch.int32, "float32": torch.float32}[t.dtype]
            assert isinstance(value, torch.Tensor) and value.dtype == want and value.is_contiguous(), t.name
            args[t.name] = value
        meta = extra[n_t]
        assert isinstance(meta, torch.Tensor) and meta.dtype == torch.int32 and meta.dim() == 2
        assert meta.shape[1] == META_COLUMNS and meta.is_contiguous()
        rest = list(extra[n_t + 1:])
        for s in spec.scalars:
            value = rest.pop(0)
            if s.dtype == "bool":
                assert isinstance(value, bool), (s.name, value)
            elif s.dtype == "int":
                assert isinstance(value, int) and not isinstance(value, bool), (s.name, value)
                assert -(2**31) <= value < 2**31
            else:
                assert isinstance(value, float), (s.name, value)
            args[s.name] = value
        sm_scale = rest.pop(0)
        assert isinstance(sm_scale, float)
        v_scale = 1.0
        if spec.qkv_scales:
            v_scale = rest.pop(0)
            assert isinstance(v_scale, float)
        assert not rest
        return args, meta, sm_scale, v_scale

    def paged_run(self, float_ws, int_ws, plan_info, q, k_cache, v_cache, q_starts, kv_indptr, kv_indices,
                  last_page_len, out, lse, mask_mode, layout, window_left, enable_pdl, *extra):
        args, meta_t, sm_scale, v_scale = self._unpack_extra(extra)
        assert mask_mode in (FA2_RUN_CODES if self.mask_on_diagonal else MODE_NAMES), mask_mode
        # (the listed variant is compiled only for a mask with an atom the planner may list)
        assert mask_mode != LISTED_RUN_CODE or page_list_atoms(self.spec.mask), "listed launch not compiled"
        assert layout == 0, "the fake kernel emulates the NHD layout only"
        assert window_left == -1 and isinstance(enable_pdl, bool)
        info = list(plan_info)
        assert len(info) == len(PrefillPlanInfo) and not info[PrefillPlanInfo.SPLIT_KV], info
        planned = self._planned.get(int_ws.data_ptr())
        own = planned is None
        if own:  # not FlashInfer's scheduler: the planner module's work list
            planned = self._own_schedule(int_ws, info, meta_t.tolist(), kv_indptr, q.shape[1], k_cache.shape[2],
                                         k_cache.shape[1])
        n = planned.batch_size
        assert meta_t.shape[0] == n, (n, tuple(meta_t.shape))
        assert kv_indptr.tolist() == planned.kv_indptr, "kv_indptr differs from the one plan() scheduled"
        meta = meta_t.tolist()
        qs = q_starts.tolist()
        kvp = kv_indptr.tolist()
        last = last_page_len.tolist()
        o_off = int(info[PrefillPlanInfo.O_INDPTR_OFFSET])
        o_indptr = int_ws[o_off:o_off + 4 * (n + 1)].view(torch.int32).tolist()
        assert len(qs) >= n and len(last) == n and len(kvp) == n + 1
        total_q, hq, dim = q.shape
        # FlashInfer's fa2 kernel writes o (and lse) at row * heads * head_dim: no strides.
        assert out.is_contiguous() and (lse is None or lse.is_contiguous())
        num_pages, page_size, hkv, _ = k_cache.shape
        assert v_cache.shape == k_cache.shape and k_cache.stride() == v_cache.stride()
        assert planned.page_size == page_size and planned.num_qo_heads == hq and planned.num_kv_heads == hkv
        group = hq // hkv
        cta = (int(info[PrefillPlanInfo.CTA_TILE_Q]) if own else
               fa2_cta_tile_q(planned.total_rows * group // max(n, 1), out.shape[-1], q.shape[-1]))
        if self.row_writes is None:
            self.row_writes = torch.zeros(total_q, dtype=torch.int64)
        rows_total = 0
        for b in range(n):
            (q_row_base, q_pos_base, kv_pos_base, request, kv_row_base, req_qo_len, req_kv_len, kwin,
             qo_len) = meta[b][:MetaColumn.VIS_LO]
            # The scheduler split the rows of each request into tiles from plan()'s qo_indptr:
            # the kernel's qo_len (from vg_meta) must be the same count.
            assert planned.qo_indptr[b + 1] - planned.qo_indptr[b] == qo_len, (b, meta[b])
            assert q_row_base == qs[b], f"vg_meta q_row_base {q_row_base} != q_indptr[{b}] {qs[b]}"
            npages = kvp[b + 1] - kvp[b]
            if npages:
                assert 1 <= last[b] <= page_size, (b, last[b])
                kv_len = (npages - 1) * page_size + last[b]
            else:
                kv_len = 0
            o_row = o_indptr[b]
            assert 0 <= qs[b] and qs[b] + qo_len <= total_q and 0 <= o_row and o_row + qo_len <= total_q
            assert 0 <= kv_pos_base and kv_pos_base + kv_len + skipped_keys(meta[b]) <= req_kv_len, (b, meta[b], kv_len)
            assert mask_mode == 2 or skipped_keys(meta[b]) == 0, "gaps in a launch request of an exact launch"
            # a page list exactly in the listed launch, whose variant alone reads the table
            table = page_table(meta_t, meta[b], npages)
            assert (table is not None) == (mask_mode == LISTED_RUN_CODE), (mask_mode, "page list", table)
            assert table is None or bool((table[1:] > table[:-1]).all() and table[-1] < req_kv_len), table
            rows_total += qo_len
            if qo_len == 0:
                continue
            self.row_writes[o_row:o_row + qo_len] += 1
            pages = kv_indices[kvp[b]:kvp[b + 1]].long()
            assert bool(((pages >= 0) & (pages < num_pages)).all()), "page index out of range"
            k = k_cache[pages].reshape(-1, hkv, dim)[:kv_len].float().repeat_interleave(group, dim=1)
            v = v_cache[pages].reshape(-1, hkv, v_cache.shape[-1])[:kv_len].float().repeat_interleave(group, 1)
            qb = q[qs[b]:qs[b] + qo_len].float()
            scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale

            env, i, j = launch_env(meta[b], qo_len, kv_len, hq, group, local_q_idx=self.codegen_q_idx, table=table)
            scores = scores_with_logits(self.spec, env, args, scores)
            if mask_mode in (2, LISTED_RUN_CODE):
                visible = kernel_mask(self.spec, env, args, (hq, qo_len, kv_len), meta[b])
            elif mask_mode in (1, FA2_TAIL_RUN_CODE):
                d = kv_len - qo_len + i
                if self.mask_on_diagonal:
                    # fa2: the kernel masks j > d itself and evaluates the variant's mask on the KV
                    # tiles from its query tile's first diagonal d0 on and on those holding keys
                    # below its last row's window edge (its own window check is the variant's).
                    # The variant: the spec's mask in the tail launch, else (an exact launch's
                    # unit, compiled without it) the kernel window only, whatever vg_meta says.
                    packed_row = i * group + torch.arange(hq).view(-1, 1, 1) % group
                    tile = packed_row // cta
                    d0 = kv_len - qo_len + (tile * cta + group - 1) // group  # FlashInfer's ceil_div
                    evaluated = j >= d0
                    if kwin >= 0:
                        edge = kv_len - qo_len + ((tile + 1) * cta + group - 1) // group - kwin
                        evaluated = evaluated | (j < edge)
                    if mask_mode == FA2_TAIL_RUN_CODE:
                        mask = kernel_mask(self.spec, env, args, (hq, qo_len, kv_len), meta[b])
                    else:
                        mask = variant_window((hq, qo_len, kv_len), kwin)
                    visible = (j <= d) & torch.where(evaluated, mask, torch.ones((), dtype=torch.bool))
                else:  # fa3: the kernel's own causal and window masks, no variant mask
                    visible = (j <= d) & ((j >= d - kwin) if kwin >= 0 else torch.ones((), dtype=torch.bool))
                    visible = visible.expand(hq, qo_len, kv_len)
            else:
                visible = torch.ones(hq, qo_len, kv_len, dtype=torch.bool)
            o, lse_b = softmax_attention(scores.masked_fill(~visible, -math.inf), v,
                                         spec_sink(self.spec, env, args, hq))
            out[o_row:o_row + qo_len] = (o * v_scale).to(out.dtype)
            if lse is not None:
                lse[o_row:o_row + qo_len] = lse_b
        self.run_calls.append(RunCall(FA2_RUN_CODES[mask_mode], n, rows_total, meta,
                                      {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)},
                                      code=mask_mode))


    @staticmethod
    def _own_schedule(int_ws, info, meta, kv_indptr, hq, hkv, page_size) -> PlanCall:
        """A launch the launch builder scheduled (its fa2 work list): one CTA per (launch request,
        query tile) in order, then (CUDA-graph mode) padding CTAs the valid mask switches off;
        the plan it stands for (o_indptr is read from int_ws as always)."""
        grid, cta = int(info[PrefillPlanInfo.PADDED_BATCH_SIZE]), int(info[PrefillPlanInfo.CTA_TILE_Q])
        ints = int_ws.view(torch.int32)
        request = ints[info[PrefillPlanInfo.REQUEST_INDICES_OFFSET] // 4:][:grid].tolist()
        q_tile = ints[info[PrefillPlanInfo.QO_TILE_INDICES_OFFSET] // 4:][:grid].tolist()
        valid = [True] * grid
        if info[PrefillPlanInfo.ENABLE_CUDA_GRAPH]:
            at = int(info[PrefillPlanInfo.BLOCK_VALID_MASK_OFFSET])
            valid = [bool(x) for x in int_ws[at:at + grid].tolist()]
            rows = int(ints[info[PrefillPlanInfo.TOTAL_NUM_ROWS_OFFSET] // 4])
            assert rows == sum(row[MetaColumn.LAUNCH_QO_LEN] for row in meta), "total_num_rows: this batch's rows"
        group = hq // hkv
        want = [(b, t) for b, row in enumerate(meta) for t in range(-(-row[MetaColumn.LAUNCH_QO_LEN] * group // cta))]
        got = [(b, t) for (b, t), ok in zip(zip(request, q_tile), valid) if ok]
        assert got == want and valid == sorted(valid, reverse=True), "work list: one CTA per (launch request, tile)"
        qo = [0]
        for row in meta:
            qo.append(qo[-1] + row[MetaColumn.LAUNCH_QO_LEN])
        return PlanCall(qo, kv_indptr.tolist(), qo[-1], len(meta), hq, hkv, page_size,
                        bool(info[PrefillPlanInfo.ENABLE_CUDA_GRAPH]), -1, -1, True)


class FakeFa3Module(FakeModule):
    """Emulates a generated fa3 module: ``paged_run`` takes the left window per launch (mode 1),
    applies the spec's mask only in mode 2, and reads each launch request's rows, pages and
    lengths from the sm90 work list the launch builder wrote (PrefillPlanSM90Info offsets).
    Emulated through FakeModule."""

    mask_on_diagonal = False  # its causal launch runs the plain variant: no mask on any tile

    def plan(self, *args):  # the fa3 module exports no FlashInfer scheduler: the builder schedules fa3
        raise AssertionError("an fa3 launch was left to FlashInfer's fa2 scheduler")

    @staticmethod
    def _work_items(int_ws, info, *offsets: SM90PlanInfo) -> list[torch.Tensor]:
        """Views of the sm90 work list's arrays at ``offsets`` (PlanInfo fields), one entry per
        work item."""
        ints = int_ws.view(torch.int32)
        assert len(info) == len(SM90PlanInfo) and info[SM90PlanInfo.SAME_SCHEDULE_FOR_ALL_HEADS] == 1, info
        # work_indptr of one SM (the planner's count on the CPU)
        works = int(ints[info[SM90PlanInfo.WORK_INDPTR_OFFSET] // 4 + 1])
        return [ints[info[k] // 4:info[k] // 4 + works] for k in offsets]

    @classmethod
    def _fa3_work_list(cls, int_ws, info, meta, page_size, cta, total_rows) -> dict:
        """A launch's sm90 work list: every (launch request, query tile) once; per launch request
        its first row, pages and lengths (launch requests without rows - CUDA-graph padding -
        have no work items)."""
        fields = cls._work_items(int_ws, info, SM90PlanInfo.QO_TILE_INDICES_OFFSET, SM90PlanInfo.QO_INDPTR_OFFSET,
                                 SM90PlanInfo.KV_INDPTR_OFFSET, SM90PlanInfo.QO_LEN_OFFSET,
                                 SM90PlanInfo.KV_LEN_OFFSET, SM90PlanInfo.BATCH_INDICES_OFFSET)
        tile, q_first, kv_first, q_len, k_len, batch = (f.tolist() for f in fields)
        works = len(tile)
        per: dict[int, list] = {}
        for w in range(works):
            per.setdefault(batch[w], []).append((tile[w], q_first[w], kv_first[w], q_len[w], k_len[w]))
        n = len(meta)
        real = [b for b in range(n) if meta[b][MetaColumn.LAUNCH_QO_LEN] > 0]
        assert sorted(per) == real, "work list: every launch request with rows has its tiles, the others none"
        starts, kvp, last, qo = [], [], [], [0]
        kv_end = 0
        for b in range(n):
            if b not in per:  # an empty launch request (no work items): no rows, no keys
                starts.append(meta[b][MetaColumn.Q_ROW_BASE])
                kvp.append(kv_end)
                last.append(0)
                qo.append(qo[-1])
                continue
            items = per[b]
            assert sorted(t for t, *_ in items) == list(range(-(-items[0][3] // cta))), (b, items)
            assert len({tuple(x[1:]) for x in items}) == 1, "a launch request's tiles disagree"
            _, first, kv0, qlen, klen = items[0]
            assert kv0 >= kv_end, "launch requests' pages overlap in the launch's page list"
            starts.append(first)
            kvp.append(kv0)
            last.append((klen - 1) % page_size + 1 if klen else 0)
            qo.append(qo[-1] + qlen)
            kv_end = kv0 + -(-klen // page_size)
        kv_indptr = torch.tensor(kvp + [kv_end], dtype=torch.int32)
        return dict(kv_indptr=kv_indptr, last=last, starts=starts + [total_rows], n=n, qo=qo)

    def paged_run(self, float_ws, int_ws, plan_info, q, k_cache, v_cache, kv_indices, out, lse, mask_mode, layout,
                  window_left, pack_gqa, enable_pdl, *extra):
        if pack_gqa > 1:
            return self._packed_run(float_ws, int_ws, plan_info, q, k_cache, v_cache, kv_indices, out, lse, mask_mode,
                                    layout, window_left, pack_gqa, enable_pdl, *extra)
        n_t = len(self.spec.tensors)
        meta_t = extra[n_t]
        p = self._fa3_work_list(int_ws, list(plan_info), meta_t.tolist(), k_cache.shape[1],
                                fa3_cta_tile_q(out.shape[2]), q.shape[0])
        assert window_left == -1 or mask_mode == 1, "a left window only exists in causal launches"
        # fa3 ignores vg_meta's window: the rows run with the launch's (set on the workspace's rows for
        # this run - the page tables after them stay where the rows point - and put back after it)
        saved = meta_t[:, MetaColumn.KERNEL_WINDOW].clone()
        meta_t[:, MetaColumn.KERNEL_WINDOW] = window_left if mask_mode == 1 else -1
        info = [p["n"], 0, 0, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        # the work list's first rows, where FakeModule reads o_indptr (a stand-in workspace)
        stand_in = torch.zeros(4 * (p["n"] + 1), dtype=torch.uint8)
        stand_in.view(torch.int32).copy_(torch.tensor(p["starts"], dtype=torch.int32))
        self._planned[stand_in.data_ptr()] = PlanCall(
            p["qo"], p["kv_indptr"].tolist(), p["qo"][-1], p["n"], q.shape[1], k_cache.shape[2], k_cache.shape[1],
            False, -1, -1, True)
        try:
            super().paged_run(float_ws, stand_in, info, q, k_cache, v_cache,
                              torch.tensor(p["starts"], dtype=torch.int32), p["kv_indptr"], kv_indices,
                              torch.tensor(p["last"], dtype=torch.int32), out, lse, mask_mode, layout, -1, enable_pdl,
                              *extra)
        finally:
            del self._planned[stand_in.data_ptr()]
            meta_t[:, MetaColumn.KERNEL_WINDOW] = saved

    def _packed_run(self, float_ws, int_ws, plan_info, q, k_cache, v_cache, kv_indices, out, lse, mask_mode, layout,
                    window_left, group, enable_pdl, *extra):
        """A GQA-packed launch: q / out / lse hold group query heads per key/value head as rows
        ([rows x group, kv_heads, ...]), every launch request's work items cover rows x group
        packed rows from its first row x group, and the launch is not causal (the kernel's causal
        mask would compare packed rows). Checked, then run unpacked on the same work list with
        its rows divided back, which is what the variant's row and head mapping computes."""
        kv_heads = k_cache.shape[2]
        assert q.shape[1] == kv_heads and out.shape[1] == kv_heads, "packed q / out have one head per kv head"
        assert mask_mode != 1 and window_left == -1, "a GQA-packed launch is never causal"
        assert q.shape[0] % group == 0, q.shape
        rows = q.shape[0] // group
        info = list(plan_info)
        firsts, lens, batch = self._work_items(int_ws, info, SM90PlanInfo.QO_INDPTR_OFFSET,
                                               SM90PlanInfo.QO_LEN_OFFSET, SM90PlanInfo.BATCH_INDICES_OFFSET)
        meta = extra[len(self.spec.tensors)]
        for first, qlen, b in zip(firsts.tolist(), lens.tolist(), batch.tolist()):
            assert first % group == 0 and qlen == meta[b, MetaColumn.LAUNCH_QO_LEN] * group, (first, qlen, group)
            assert first // group == meta[b, MetaColumn.Q_ROW_BASE], "packed rows start at the row x group"
            assert qlen <= fa3_cta_tile_q(out.shape[2]), "a packed launch request is one query tile"
        unpacked_ws = int_ws.clone()  # the same work list in query rows
        u_firsts, u_lens = self._work_items(unpacked_ws, info, SM90PlanInfo.QO_INDPTR_OFFSET,
                                            SM90PlanInfo.QO_LEN_OFFSET)
        u_firsts.copy_(firsts // group)
        u_lens.copy_(lens // group)
        q_u = q.view(rows, group, kv_heads, -1).transpose(1, 2).reshape(rows, group * kv_heads, q.shape[2])
        out_u = out.new_zeros(rows, group * kv_heads, out.shape[2])
        lse_u = lse.new_zeros(rows, group * kv_heads) if lse is not None else None
        self.paged_run(float_ws, unpacked_ws, plan_info, q_u, k_cache, v_cache, kv_indices, out_u, lse_u, mask_mode,
                       layout, window_left, 1, enable_pdl, *extra)
        # write back only the rows this launch wrote (others belong to the plan's other launches)
        written = torch.zeros(rows, dtype=torch.bool)
        for first, qlen in zip(firsts.tolist(), lens.tolist()):
            written[first // group:(first + qlen) // group] = True
        idx = written.nonzero().squeeze(1)
        out.view(rows, group, kv_heads, -1)[idx] = out_u.view(rows, kv_heads, group, -1)[idx].transpose(1, 2)
        if lse is not None:
            lse.view(rows, group, kv_heads)[idx] = lse_u.view(rows, kv_heads, group)[idx].transpose(1, 2)


class FakeRowPlanner:
    """A CPU stand-in for a spec's planner module (rowplan.py): ``plan_batch`` runs the row pass
    with the reference rules in torch ops (rowrules.py: what the generated row kernel computes,
    tests/gpu/test_gpu_planner.py compares them), then the real launch builder and its device part
    in torch ops - so that plan() takes its planned path on the CPU. ``room``: how many launch
    requests the read-back had room for, per call (the growth tests read it)."""

    def __init__(self, spec: VariantSpec, builder: Any = None):
        self.spec = spec
        self.builder = builder  # a module whose build_launches to call (default: tests/fakes/_builder.py's)
        self.calls = 0
        self.room: list[int] = []

    def plan_batch(self, indices, options, starts_page_locked, starts, rec, counts, seg, seg_host, scratch, kv_indices,
                   workspace, workspace_host, desc, *spec_values):
        from variantgen.abi.table import ROW_BLOCK, HeaderField, PlanOption, RecField, Status
        from variantgen.planning.intervals import analyze
        from variantgen.planning.rowplan import planner_inputs
        from variantgen.planning.rowrules import classify_rows, segments

        self.calls += 1
        form = analyze(self.spec)
        tensors, scalars = planner_inputs(self.spec, form)
        assert len(spec_values) == len(tensors) + len(scalars), "plan_batch: the spec arguments the intervals read"
        args = dict(zip(tensors + scalars, spec_values))
        assert indices.dtype == torch.int32 and indices.device.type == "cpu" and indices.dim() == 1
        assert options.dtype == torch.int64 and not options[PlanOption.DIRECT]
        page_size = int(options[PlanOption.PAGE_SIZE])
        batch = (indices.numel() - 2) // 3
        qo, page_indptr, last = indices.split([batch + 1, batch + 1, batch])
        qo, page_indptr, last = qo.tolist(), page_indptr.tolist(), last.tolist()
        kv_lens = [(p1 - p0 - 1) * page_size + lp if p1 > p0 else 0
                   for p0, p1, lp in zip(page_indptr, page_indptr[1:], last)]
        total_q = qo[-1]
        assert starts_page_locked.numel() >= 2 * (batch + 1) and starts.numel() >= 2 * (batch + 1)
        assert rec.numel() >= len(RecField) * total_q and counts.numel() >= -(-total_q // ROW_BLOCK)
        assert seg_host.numel() >= seg.numel() and workspace.numel() >= workspace_host.numel()
        rows = segments(classify_rows(self.spec, form, qo, kv_lens, page_size, args, rec.device), page_size)
        room = (seg.numel() - 1) // SEG_FIELDS
        self.room.append(room)
        if rows.shape[0] > room:  # what plan_batch answers when the read-back is too small
            desc.zero_()
            desc[HeaderField.STATUS] = Status.SEGMENTS
            desc[HeaderField.NEED] = desc[HeaderField.SEGMENTS] = rows.shape[0]
            return
        self.build_launches(indices, rows, options, workspace_host, desc)
        finish_on_cpu(desc, workspace_host, workspace, kv_indices)  # (also on CUDA tensors: torch copies)

    @property
    def build_launches(self):
        return (self.builder or plan_builder()).build_launches

    def plan_rows(self, rec, starts_host, starts_page_locked, starts, scratch, counts, seg, *rest):
        """The row pass alone (what CUDA-core decode's key trimming calls): rec from the
        reference rules; the launch requests compacted into seg as plan_rows does."""
        from variantgen.abi.table import RecField
        from variantgen.planning.intervals import analyze
        from variantgen.planning.rowplan import planner_inputs
        from variantgen.planning.rowrules import classify_rows, segments

        self.calls += 1
        *spec_values, page_size = rest
        form = analyze(self.spec)
        tensors, scalars = planner_inputs(self.spec, form)
        assert len(spec_values) == len(tensors) + len(scalars), "plan_rows: the spec arguments the intervals read"
        args = dict(zip(tensors + scalars, spec_values))
        assert starts_host.dtype == torch.int64 and starts_host.dim() == 2 and starts_host.shape[0] == 2
        qo, kv_start = starts_host[0].tolist(), starts_host[1].tolist()
        kv_lens = [b - a for a, b in zip(kv_start, kv_start[1:])]
        assert rec.shape == (len(RecField), qo[-1]) and rec.dtype == torch.int64
        rows = classify_rows(self.spec, form, qo, kv_lens, int(page_size), args, rec.device)
        rec.copy_(rows)
        found = segments(rows, int(page_size))
        room = (seg.numel() - 1) // SEG_FIELDS
        seg[0] = found.shape[0]
        n = min(room, found.shape[0])
        seg[1:1 + SEG_FIELDS * n] = found[:n].reshape(-1)
