"""Bidirectional token spans -> the per-query ``ranges`` tensor of span masks.

A multimodal request marks its image (audio, ...) tokens as spans of key positions that see
each other bidirectionally; the mm_prefix spec (and FlashInfer's
``BatchPrefillWithCausalBidirectionalRangesWrapper``) take them as one inclusive span per
query row, ``ranges[total_q, 2]``, ``(-1, -1)`` for a query outside every span. A serving
engine knows the spans per request; :func:`spans_to_ranges` turns them into that tensor::

    ranges = variantgen.spans_to_ranges(qo_lens, kv_lens, [[(10, 265)], []], device="cuda")
    wrapper.plan(..., ranges=ranges)
    wrapper.run(q, kv_cache, ranges=ranges)

Positions are absolute within the request (cached keys first): request ``i``'s queries sit at
positions ``kv_lens[i] - qo_lens[i]`` ... ``kv_lens[i] - 1`` (chunked prefill), so a span that
began in an earlier chunk is given with its original start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..lang.nodes import INT32_MAX
from .checks import to_device


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _lengths(name: str, value: Any) -> Any:
    """A 1-D integer tensor of lengths (e.g. an engine's sequence lengths) as a list."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"spans_to_ranges: {name}: expected a 1-D integer tensor (or a list), got a "
                             f"{value.dim()}-D {value.dtype} tensor")
        return value.tolist()
    return value


def spans_to_ranges(qo_lens: Sequence[int], kv_lens: Sequence[int], spans: Sequence[Sequence[tuple[int, int]]],
                    *, device: str | torch.device | None = None) -> torch.Tensor:
    """int32 ``[sum(qo_lens), 2]``: each query's inclusive span ``(start, end)`` if its position
    lies in one of its request's ``spans``, else ``(-1, -1)``.

    ``spans[i]`` lists request ``i``'s spans as ``(start, end)`` key positions with
    ``0 <= start <= end < kv_lens[i]``; spans of one request must not overlap (a query holds one
    span). Raises ValueError naming the offending argument and entry."""
    qo_lens, kv_lens = _lengths("qo_lens", qo_lens), _lengths("kv_lens", kv_lens)
    for name, value in (("qo_lens", qo_lens), ("kv_lens", kv_lens), ("spans", spans)):
        if not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
            raise ValueError(f"spans_to_ranges: {name}={value!r}: expected a sequence with one entry per request")
    if len(qo_lens) != len(kv_lens) or len(spans) != len(kv_lens):
        raise ValueError(f"spans_to_ranges: qo_lens, kv_lens and spans must have one entry per request "
                         f"(got {len(qo_lens)}, {len(kv_lens)} and {len(spans)})")
    rows = []
    for i, (ql, kl, req_spans) in enumerate(zip(qo_lens, kv_lens, spans)):
        if not _whole(ql) or not _whole(kl) or not 0 <= ql <= kl:
            raise ValueError(f"spans_to_ranges: request {i}: qo_lens[{i}]={ql!r}, kv_lens[{i}]={kl!r}: expected "
                             "whole numbers with 0 <= qo_len <= kv_len")
        if kl > INT32_MAX:
            raise ValueError(f"spans_to_ranges: request {i}: kv_lens[{i}]={kl}: expected at most 2**31 - 1 (ranges "
                             "holds int32 key positions)")
        if not hasattr(req_spans, "__iter__"):
            raise ValueError(f"spans_to_ranges: spans[{i}]={req_spans!r}: expected the request's (start, end) spans")
        checked = []
        for j, span in enumerate(req_spans):
            where = f"spans[{i}][{j}]={span!r}"
            if not isinstance(span, Sequence) or len(span) != 2 or not all(_whole(x) for x in span):
                raise ValueError(f"spans_to_ranges: {where}: expected a pair of whole numbers (start, end)")
            s, e = span
            if not 0 <= s <= e < kl:
                raise ValueError(f"spans_to_ranges: {where}: expected 0 <= start <= end < kv_lens[{i}]={kl} "
                                 "(inclusive key positions of the request)")
            checked.append((s, e, j))
        checked.sort()
        for (_, e0, j0), (s1, _, j1) in zip(checked, checked[1:]):
            if s1 <= e0:
                raise ValueError(f"spans_to_ranges: spans[{i}][{j0}]={req_spans[j0]!r} and spans[{i}][{j1}]="
                                 f"{req_spans[j1]!r} overlap (a query row holds one span)")
        r = torch.full((ql, 2), -1, dtype=torch.int32)
        pos = torch.arange(kl - ql, kl)
        for s, e, _ in checked:
            inside = (pos >= s) & (pos <= e)
            r[inside, 0] = s
            r[inside, 1] = e
        rows.append(r)
    out = torch.cat(rows) if rows else torch.empty(0, 2, dtype=torch.int32)
    return to_device("spans_to_ranges", out, device)
