"""The flex route's dense path: a spec's mods evaluated request by request, in plain torch ops.

Where Flex's kernel does not run - the flex route on the CPU without ``compile=True`` (the
default there) - the wrapper computes here instead of through Flex's eager math, for two reasons:

* isolation: Flex's eager math multiplies the whole [q_len, kv_len] weight matrix into V, so a
  NaN or inf in any value reaches every row of the packed batch (0 x NaN = NaN), where a row may
  only ever see its own request's keys. Here each request's rows meet its own keys only, and a
  non-finite value reaches only the rows that see its key (reference.softmax_attention);
* gradients: torch's FlexAttention has no backward pass on the CPU. Everything here is torch
  autograd, so run() is differentiable in q, k, v and the float spec tensors the logits
  transform reads.

The mask and the logits transform are the same ``FlexMods`` the kernel gets (flex.make_mods),
evaluated on grids of Flex indices instead of Flex's vmapped scalars, so the CPU tests of the
flex route still check the mods, the layout tables and their builtins that the GPU runs.
"""

from __future__ import annotations

import math

import torch

from .flex_blocks import FlexLayout, FlexMods
from .reference import softmax_attention


def request_spans(layout: FlexLayout) -> list[tuple[int, int, int, int, int]]:
    """Per request: (Flex batch row, first Flex query row, queries, first Flex key, keys)."""
    if layout.packed:
        q_start, qo_len = layout.q_start.tolist(), layout.qo_len.tolist()
        key_start, key_count = layout.key_start.tolist(), layout.key_count.tolist()
        return [(0, qs, n, ks, m) for qs, n, ks, m in zip(q_start, qo_len, key_start, key_count)]
    return [(r, 0, 1, 0, m) for r, m in enumerate(layout.key_count.tolist())]


def dense_attend(layout: FlexLayout, mods: FlexMods, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What flex.flex_call returns for [B, H, L, D] tensors laid out by ``layout``: (o [B, Hq, Lq,
    Dv] in q's dtype, natural-log LSE [B, Hq, Lq] float32; 0 and -inf on rows of no request or
    that see no key), computed in float32 one request at a time."""
    batch, heads, q_len, _ = q.shape
    group = heads // k.shape[1]
    dev, i64 = q.device, torch.int64
    o = torch.zeros(batch, heads, q_len, v.shape[-1], dtype=torch.float32, device=dev)
    lse = torch.full((batch, heads, q_len), -math.inf, dtype=torch.float32, device=dev)
    h = torch.arange(heads, dtype=i64, device=dev).view(-1, 1, 1)
    for b, qs, n, ks, m in request_spans(layout):
        if n == 0:
            continue
        qr = q[b, :, qs:qs + n].float()
        kr = k[b, :, ks:ks + m].float().repeat_interleave(group, dim=0)
        vr = v[b, :, ks:ks + m].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hqd,hkd->hqk", qr, kr) * scale
        bt = torch.tensor(b, dtype=i64, device=dev)
        qi = torch.arange(qs, qs + n, dtype=i64, device=dev).view(1, -1, 1)
        kv = torch.arange(ks, ks + m, dtype=i64, device=dev).view(1, 1, -1)
        if mods.score_mod is not None:
            scores = torch.broadcast_to(mods.score_mod(scores, bt, h, qi, kv), scores.shape)
        visible = torch.broadcast_to(mods.mask_mod(bt, h, qi, kv), scores.shape)
        out_r, lse_r = softmax_attention(scores.masked_fill(~visible, -math.inf), vr.transpose(0, 1))
        o[b, :, qs:qs + n] = out_r.transpose(0, 1)
        lse[b, :, qs:qs + n] = lse_r.t() * math.log(2.0)  # (softmax_attention's LSE is base 2)
    return o.to(q.dtype), lse
