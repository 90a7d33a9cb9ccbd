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
    parts = out.new_empty(pieces, *out.shape)
    parts_lse = torch.empty(pieces, out.shape[0], out.shape[1], dtype=torch.float32, device=out.device)
    return parts, parts_lse
