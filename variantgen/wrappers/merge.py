"""Merging a row's partial outputs (one per key interval it sees, pieces.py) by their LSE.

Each piece launch writes, for its rows, the attention output over its keys alone (o_p, already
divided by its own softmax denominator) and its base-2 log-sum-exp (lse_p, as FlashInfer's
kernels write it: log2 of the sum of 2^(logit * log2 e)). Over the union of disjoint key sets

    lse = m + log2(sum_p 2^(lse_p - m)),   o = sum_p 2^(lse_p - lse) o_p,   m = max_p lse_p

which is the softmax over all the row's keys. A piece with no visible key (lse -inf) adds
nothing; a row whose every piece is empty gets o = 0 and lse = -inf, as the kernels give a fully
masked row.

run() merges with the module's ``merge_pieces`` kernel (templates/plan/merge_pieces.cuh: one read
of the partial rows, one write of the merged ones). ``merge_pieces_reference`` is the same math in
torch ops - the CPU fakes' merge and the reference the GPU tests hold the kernel to; it makes
float32 copies of the partial rows and is several times the kernel's memory traffic.
"""

from __future__ import annotations

import torch


def merge_pieces_reference(out: torch.Tensor, lse: torch.Tensor | None, parts: torch.Tensor, parts_lse: torch.Tensor,
                           rows: torch.Tensor, counts: torch.Tensor) -> None:
    """Writes ``out[rows]`` (and ``lse[rows]``) from the partial outputs: ``parts`` [P, total_q,
    heads, dim] and ``parts_lse`` [P, total_q, heads] (float32, base 2), row ``rows[i]`` having
    pieces 0 .. counts[i] - 1 (the rest of its partial rows are not read). ``rows`` and
    ``counts``: int64 [M] on out's device."""
    if rows.numel() == 0:
        return
    pieces = parts.shape[0]
    part_lse = parts_lse.index_select(1, rows)  # [P, M, heads]
    have = torch.arange(pieces, device=rows.device).view(-1, 1) < counts.view(1, -1)  # [P, M]
    part_lse = part_lse.masked_fill(~have.unsqueeze(-1), -torch.inf)
    top = part_lse.amax(0)  # [M, heads]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # (all -inf: weights 0 below)
    weight = torch.exp2(part_lse - top)  # [P, M, heads]; unwritten pieces: 0
    total = weight.sum(0)
    part_out = parts.index_select(1, rows).float()
    # (a partial row of a missing piece is never written: 0 x NaN must not reach the sum)
    part_out = torch.where((weight > 0).unsqueeze(-1), part_out, torch.zeros((), device=parts.device))
    merged = (weight.unsqueeze(-1) * part_out).sum(0) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    out.index_copy_(0, rows, merged.to(out.dtype))
    if lse is not None:
        lse.index_copy_(0, rows, torch.where(total > 0, top + torch.log2(total), -torch.inf))


def piece_buffers(out: torch.Tensor, pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial outputs of ``pieces`` key intervals for run()'s ``out`` [rows, heads, dim]:
    [pieces, rows, heads, dim] in out's dtype (each piece launch writes o rows in place of the
    row's index, as it would into out) and their LSE, float32 [pieces, rows, heads]. Rows cost
    memory whether or not they are split (pieces x out's size): simple row addressing for every
    kernel; compacting them to the split rows would need o offsets apart from q's, which fa3's
    work list does not have."""
    if pieces == 0:  # (inline pieces only: nothing to allocate)
        return out.new_empty(0, *out.shape), torch.empty(0, out.shape[0], out.shape[1], dtype=torch.float32,
                                                         device=out.device)
    parts = out.new_empty(pieces, *out.shape)
    parts_lse = torch.empty(pieces, out.shape[0], out.shape[1], dtype=torch.float32, device=out.device)
    return parts, parts_lse


def merge_inline_reference(out: torch.Tensor, lse_in: torch.Tensor, lse_out: torch.Tensor | None, q: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indices: torch.Tensor,
                           rows: torch.Tensor, first_entry: torch.Tensor, first_slot: torch.Tensor,
                           keys: torch.Tensor, sm_scale: float, v_scale: float, kv_head_div: int,
                           hnd: bool) -> None:
    """The merge kernel's inline mode (merge_pieces.cuh's merge_inline) in torch ops: for each row
    ``rows[i]`` of ``out`` [rows, heads, dim], whose in-place launch wrote o and its base-2 LSE
    (``lse_in``), the attention over its short first interval computed here - ``keys[i]`` keys from
    slot ``first_slot[i]`` of page entry ``first_entry[i]`` of ``kv_indices`` on (q's row and
    head; key/value head = head // kv_head_div; the paged cache NHD [pages, page, heads, dim] or
    ``hnd`` [pages, heads, page, dim]), softmax scale ``sm_scale``, values scaled by ``v_scale`` as
    the launches scale theirs - merged into the row by LSE.
    Writes out[rows] and, given, lse_out[rows]."""
    if rows.numel() == 0:
        return
    page_size = k_cache.shape[2] if hnd else k_cache.shape[1]
    most = int(keys.max())
    j = torch.arange(most, device=rows.device)
    slot = first_slot.view(-1, 1) + j  # [M, most]
    page = kv_indices[(first_entry.view(-1, 1) + torch.div(slot, page_size, rounding_mode="floor")).clamp(
        max=kv_indices.numel() - 1)].long().clamp(0, k_cache.shape[0] - 1)
    slot = slot % page_size
    heads = out.shape[1]
    kvh = torch.arange(heads, device=rows.device) // kv_head_div  # [heads]
    if hnd:
        k = k_cache[page.view(-1, most, 1), kvh.view(1, 1, -1), slot.view(-1, most, 1)]  # [M, most, heads, dim]
        v = v_cache[page.view(-1, most, 1), kvh.view(1, 1, -1), slot.view(-1, most, 1)]
    else:
        k = k_cache[page.view(-1, most, 1), slot.view(-1, most, 1), kvh.view(1, 1, -1)]
        v = v_cache[page.view(-1, most, 1), slot.view(-1, most, 1), kvh.view(1, 1, -1)]
    qr = q.index_select(0, rows).float()  # [M, heads, dim]
    s = torch.einsum("mhd,mjhd->mhj", qr, k.float()) * (sm_scale * 1.4426950408889634)  # log2 domain
    s = s.masked_fill((j.view(1, 1, -1) >= keys.view(-1, 1, 1)), -torch.inf)
    m = s.amax(-1)  # [M, heads]
    p = torch.exp2(s - m.unsqueeze(-1))
    d = p.sum(-1)
    o_in = torch.einsum("mhj,mjhd->mhd", p, v.float()) / d.unsqueeze(-1) * v_scale
    lse_base = lse_in.index_select(0, rows)
    # the two pieces (base first, as the kernel) merged by merge_pieces_reference's rules
    every = torch.arange(rows.numel(), device=rows.device)
    merged = out.new_empty(rows.numel(), *out.shape[1:])
    merged_lse = torch.empty_like(lse_base) if lse_out is not None else None
    merge_pieces_reference(merged, merged_lse, torch.stack([out.index_select(0, rows).float(), o_in]),
                           torch.stack([lse_base, m + torch.log2(d)]), every, torch.full_like(every, 2))
    out.index_copy_(0, rows, merged)
    if lse_out is not None:
        lse_out.index_copy_(0, rows, merged_lse)
