"""The tensors of a fuzz case on the device (q, k, v, page pools with poisoned free slots, the
spec tensors built from their structure) and the derived float32 reference of its batch."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from .fuzz_cases import (
    POISONS,
    TARGET_BY_NAME,
    Batch,
    DocRuns,
    FuzzCase,
    PerHead,
    PerRequest,
    Ranges,
    TensorArg,
    Trees,
    shipped_spec,
)
from .harness import poison_keys

# ----------------------------------------------------------------------------- tensors of a case

EXTRA_PAGES = 3  # at most this many unused pages in a paged pool (filled with POISON_K / POISON_V)
# Finite poison in every KV slot no request owns (unused pages, the tail of a last page): a kernel
# that reads one unmasked gets logits of ~16 sigma and a value of 64, far off the reference.
POISON_K, POISON_V = 16.0, 64.0
SENTINEL = 12288.0  # what outputs hold before a run (exact in bf16 and fp16): rows left so were not written

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}


@dataclass
class CaseTensors:
    """One batch of a case on the device, as its wrapper takes it. Paged: k / v are page pools
    [pages, page_size, kv_heads, head_dim]; ragged: [total_kv, kv_heads, head_dim]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor | None
    last_page_len: torch.Tensor | None
    args: dict[str, Any]  # spec tensors and scalars, by name


def _int_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device)


def _ranges_tensor(arg: Ranges, qo_lens: tuple[int, ...], kv_lens: tuple[int, ...]) -> torch.Tensor:
    from .harness import spans_to_ranges

    out = spans_to_ranges(list(qo_lens), list(kv_lens), [list(s) for s in arg.spans])
    base = 0
    for q, rows in zip(qo_lens, arg.rows):
        for a, b, s, e in rows:
            a, b = max(a, 0), min(b, q - 1)
            if a <= b:
                out[base + a:base + b + 1, 0] = s
                out[base + a:base + b + 1, 1] = e
        base += q
    return out


def _doc_ids_tensor(arg: DocRuns, kv_lens: tuple[int, ...]) -> torch.Tensor:
    ids = []
    for k, runs in zip(kv_lens, arg.runs):
        row = torch.full((k,), runs[0][1] if runs else 0, dtype=torch.int32)
        for start, doc in sorted(runs):
            row[max(start, 0):] = doc
        ids.append(row)
    return torch.cat(ids) if ids else torch.empty(0, dtype=torch.int32)


def spec_tensor(t: Any, arg: TensorArg, batch: Batch, num_qo_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The host tensor of spec tensor ``t`` described by ``arg`` for ``batch``."""
    from .harness import alibi_slopes

    if isinstance(arg, Ranges):
        return _ranges_tensor(arg, batch.qo_lens, batch.kv_lens)
    if isinstance(arg, DocRuns):
        return _doc_ids_tensor(arg, batch.kv_lens)
    if isinstance(arg, PerRequest):
        return torch.tensor(arg.values, dtype=torch.int32)
    if isinstance(arg, PerHead):
        if not arg.values:
            return alibi_slopes(num_qo_heads)
        return torch.tensor([arg.values[h % len(arg.values)] for h in range(num_qo_heads)], dtype=torch.float32)
    if isinstance(arg, Trees):
        from ..wrappers.trees import tree_bits

        words = t.shape[1]
        out = torch.zeros(sum(batch.qo_lens), words, dtype=torch.int32)
        base = 0
        for q, parents in zip(batch.qo_lens, arg.parents):
            nodes = list(parents[:min(q, 32 * words)])
            if nodes:
                out[base:base + len(nodes)] = tree_bits([nodes], words=words)
            base += q
        return out
    dims = {"total_q": sum(batch.qo_lens), "total_kv": sum(batch.kv_lens), "batch": len(batch.qo_lens),
            "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads}
    shape = tuple(dims[d] if isinstance(d, str) else d for d in t.shape)
    g = torch.Generator().manual_seed(arg.seed)
    if t.dtype == "int32":
        return torch.randint(-2, max(batch.kv_lens, default=0) + 1, shape, generator=g, dtype=torch.int32)
    return torch.randn(shape, generator=g)


def make_tensors(case: FuzzCase, batch: Batch, device: torch.device) -> CaseTensors:
    """q, k, v, the index tensors and the spec arguments of ``batch`` (a case's own batch, or
    its graph capture batch), deterministic in the batch's seed."""
    spec = shipped_spec(case.module.spec)
    m, target = case.module, TARGET_BY_NAME[case.target]
    hq, hkv = case.num_qo_heads, case.num_kv_heads
    qo, kv = list(batch.qo_lens), list(batch.kv_lens)
    qdt, kvdt = TORCH_DTYPES[m.q_dtype], TORCH_DTYPES[m.kv_dtype]
    g = torch.Generator(device=device).manual_seed(batch.seed)
    host = random.Random(batch.seed)
    total_q = sum(qo)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    q = randn(total_q, hq, m.head_dim_qk).to(qdt)
    qo_indptr = [0]
    for n in qo:
        qo_indptr.append(qo_indptr[-1] + n)
    if [name for name, _ in batch.tensors] != [t.name for t in spec.tensors]:
        raise ValueError(f"FuzzCase: batch.tensors names {[n for n, _ in batch.tensors]}, spec `{spec.name}` has "
                         f"tensors {[t.name for t in spec.tensors]}")
    args: dict[str, Any] = {name: spec_tensor(t, arg, batch, hq, hkv).to(device).contiguous()
                            for t, (name, arg) in zip(spec.tensors, batch.tensors)}
    args.update(case.scalars)
    if target.kind == "ragged":
        kv_indptr = [0]
        for n in kv:
            kv_indptr.append(kv_indptr[-1] + n)
        k = randn(kv_indptr[-1], hkv, m.head_dim_qk).to(kvdt)
        v = randn(kv_indptr[-1], hkv, m.head_dim_vo).to(kvdt)
        if case.poison:
            poison_keys(k, v, kv, poisoned_request(batch), POISONS[case.poison])
        return CaseTensors(q, k, v, _int_tensor(qo_indptr, device), _int_tensor(kv_indptr, device), None, None,
                           args)
    ps = case.page_size
    pages = [-(-n // ps) for n in kv]
    used = sum(pages)
    pool = used + host.randint(0, EXTRA_PAGES)
    order = list(range(pool))
    host.shuffle(order)
    kv_indptr = [0]
    for p in pages:
        kv_indptr.append(kv_indptr[-1] + p)
    # Slots no request owns (pages past `used` in the shuffled order, last pages' tails) get poison.
    filled: list[int] = []  # keys held by each used page, in page-list order
    for n, p in zip(kv, pages):
        filled += [ps] * (p - 1) + [n - (p - 1) * ps] if p else []
    owned = torch.zeros(pool, ps, dtype=torch.bool)
    owned[torch.tensor(order[:used], dtype=torch.long)] = (
        torch.arange(ps).view(1, -1) < torch.tensor(filled, dtype=torch.long).view(-1, 1))
    owned = owned.to(device)[:, :, None, None]
    k = torch.where(owned, randn(pool, ps, hkv, m.head_dim_qk), POISON_K).to(kvdt)
    v = torch.where(owned, randn(pool, ps, hkv, m.head_dim_vo), POISON_V).to(kvdt)
    last = [(n - 1) % ps + 1 if n else 0 for n in kv]
    if case.poison:
        poison_keys(k, v, kv, poisoned_request(batch), POISONS[case.poison], kv_indptr=kv_indptr,
                    kv_indices=torch.tensor(order[:used]), page_size=ps)
    return CaseTensors(q, k, v, _int_tensor(qo_indptr, device), _int_tensor(kv_indptr, device),
                       _int_tensor(order[:used], device), _int_tensor(last, device), args)


def poisoned_request(batch: Batch) -> int:
    """The request an isolation case poisons: the middle one of those with keys (0 if none has
    any). Not the first: a kernel that reads past a request's last key (FlashInfer's sm90 ragged
    kernel loads whole KV tiles) reaches the *next* request's first keys, so the poisoned request
    needs one before it, and one after it for a kernel that reads before a request's start."""
    with_keys = [i for i, n in enumerate(batch.kv_lens) if n]
    return with_keys[len(with_keys) // 2] if with_keys else 0


def compared_rows(case: FuzzCase) -> torch.Tensor | None:
    """Bool [total_q]: the rows compared with the reference (all but the poisoned request's in an
    isolation case), or None for all."""
    if not case.poison:
        return None
    from .harness import rows_of_requests

    return ~rows_of_requests(list(case.batch.qo_lens), [poisoned_request(case.batch)])


def reference(case: FuzzCase, t: CaseTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The derived float32 reference of a case's batch: (out, lse base 2)."""
    from ..wrappers.ragged import reference_ragged
    from ..wrappers.reference import reference_attention

    spec = shipped_spec(case.module.spec)
    q_scale, k_scale, v_scale = case.scales
    kw = dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    if t.kv_indices is None:
        return reference_ragged(spec, t.q, t.k, t.v, t.qo_indptr, t.kv_indptr, t.args, **kw)
    return reference_attention(spec, t.q, (t.k, t.v), t.qo_indptr, t.kv_indptr, t.kv_indices, t.last_page_len,
                               t.args, **kw)
