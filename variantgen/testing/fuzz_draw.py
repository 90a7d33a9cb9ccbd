"""Drawing random fuzz cases: lengths at tile edges, scalars within their declared ranges,
spec tensors (key spans, document runs, trees, ...), graph sessions and isolation cases."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..lang.nodes import names_used
from ..lang.reads import key_only, tests
from ..lang.values import ScalarArg, VariantSpec
from .fuzz_cases import (
    Batch,
    DocRuns,
    FuzzCase,
    GraphSetup,
    ModuleKey,
    PerHead,
    PerRequest,
    Ranges,
    Scalar,
    Seeded,
    Target,
    TensorArg,
    Trees,
    shipped_spec,
)
from .fuzz_tensors import EXTRA_PAGES
from .harness import within_range

# ----------------------------------------------------------------------------- drawing cases


@dataclass(frozen=True)
class Limits:
    """How large drawn batches get (the defaults: the GPU fuzzer's; the CPU smoke test draws
    small ones)."""

    max_requests: int = 4
    max_qo_len: int = 700
    max_cached: int = 1000  # kv_len - qo_len of a prefill request
    max_decode_requests: int = 16
    max_decode_kv_len: int = 3000
    max_decode_q_len: int = 16  # multi-token decode (tensor cores): queries per request
    groups: tuple[int, ...] = (1, 2, 4, 8, 16)  # GQA group sizes
    kv_heads: tuple[int, ...] = (1, 2, 4)
    page_sizes: tuple[int, ...] = (1, 5, 16, 64)
    boundaries: tuple[int, ...] = (15, 16, 17, 63, 64, 65, 127, 128, 129)  # tile edges worth hitting


def _log_uniform(r: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi], small values as likely as large ones per factor of two."""
    if hi <= lo:
        return lo
    return min(hi, int(math.exp(r.uniform(math.log(lo), math.log(hi + 1)))))


def _length(r: random.Random, lo: int, hi: int, limits: Limits) -> int:
    edges = [b for b in limits.boundaries if lo <= b <= hi]
    if edges and r.random() < 0.15:
        return r.choice(edges)
    return _log_uniform(r, lo, hi)


def _window(r: random.Random) -> int:
    """A left window: none (-1), 0, 1, small or large."""
    pick = r.randrange(5)
    return (-1, 0, 1, r.randint(2, 16), r.randint(64, 1500))[pick]


# Scalars by name (the shipped specs' vocabulary); others by dtype in _draw_scalar.
SCALAR_DRAWS: dict[str, Callable[[random.Random], Scalar]] = {
    "window": _window,
    "causal_window_left": _window,
    "range_window_left": _window,  # <= 0: unbounded there
    "chunk_size": lambda r: r.choice([1, 2, r.randint(3, 32), r.randint(64, 300), 8192]),
    "num_sink": lambda r: r.choice([0, 1, r.randint(2, 8), r.randint(64, 512)]),
    "soft_cap": lambda r: r.choice([1.0, 5.0, 30.0, 50.0, round(r.uniform(0.5, 60.0), 3)]),
}


def _draw_scalar(r: random.Random, scalar: ScalarArg) -> Scalar:
    """A random value of one of the spec's scalars, within the range the spec declares for it."""
    if scalar.name in SCALAR_DRAWS:
        value = SCALAR_DRAWS[scalar.name](r)
    elif scalar.dtype == "bool":
        return r.random() < 0.5
    elif scalar.dtype == "int":
        value = _window(r)
    else:
        value = round(r.uniform(-2.0, 2.0), 4)
    return within_range(scalar, value)


def _draw_lengths(r: random.Random, target: Target, limits: Limits, n: int | None = None) -> tuple[list, list]:
    if target.kind == "decode":
        n = n or _log_uniform(r, 1, limits.max_decode_requests)
        # tensor cores: multi-token decode (speculative verification) in a third of the batches
        per = 1
        if target.tensor_cores and r.random() < 0.35:
            per = r.choice([q for q in (2, 3, 4, 8, 16) if q <= limits.max_decode_q_len] or [1])
        kv = [max(_length(r, 1, limits.max_decode_kv_len, limits), per) for _ in range(n)]
        return [per] * n, kv
    n = n or min(limits.max_requests, r.choice([1, 1, 2, 2, 3, 4]))
    qo, kv = [], []
    for _ in range(n):
        if r.random() < 0.04:
            q = k = 0  # a request with no queries and no keys
        else:
            q = 0 if r.random() < 0.04 else (1 if r.random() < 0.15 else _length(r, 1, limits.max_qo_len, limits))
            cached = 0 if r.random() < 0.35 else _length(r, 1, limits.max_cached, limits)
            k = max(q + cached, 1)
        qo.append(q)
        kv.append(k)
    if sum(qo) == 0:
        qo[0] = 1
        kv[0] = max(kv[0], 1)
    return qo, kv


def _draw_ranges(r: random.Random, qo_lens: list[int], kv_lens: list[int]) -> Ranges:
    spans, rows = [], []
    for q, k in zip(qo_lens, kv_lens):
        req: list[tuple[int, int]] = []
        start_of_chunk = k - q
        for _ in range(r.choice([0, 1, 1, 2, 3])):
            kind = r.randrange(4)
            if kind == 0 and 0 < start_of_chunk < k:  # crosses the chunk start
                s, e = r.randint(0, start_of_chunk - 1), r.randint(start_of_chunk, k - 1)
            elif kind == 1 and k:  # at the first or last key
                s = e = r.choice([0, k - 1])
            else:
                s = r.randint(0, max(k - 1, 0))
                e = min(k - 1, s + _log_uniform(r, 1, max(k // 2, 1)) - 1)
            if k and not any(s <= e2 and e >= s2 for s2, e2 in req):
                req.append((s, e))
        over: list[tuple[int, int, int, int]] = []
        if q and r.random() < 0.3:
            for _ in range(r.randint(1, 3)):
                a = r.randint(0, q - 1)
                b = min(q - 1, a + _log_uniform(r, 1, q) - 1)
                kind = r.randrange(5)
                if kind == 0:  # future-only: after the last of these queries
                    s = min(k + 2, start_of_chunk + b + 1 + r.randint(0, 5))
                    span = (s, s + r.randint(0, 20))
                elif kind == 1:  # empty
                    s = r.randint(1, max(k, 1))
                    span = (s, s - r.randint(1, 3))
                elif kind == 2:
                    span = (-1, -1)
                elif kind == 3:
                    span = (0, max(k - 1, 0))
                else:
                    span = tuple(sorted((r.randint(-3, k + 3), r.randint(-3, k + 3))))
                over.append((a, b, *span))
        spans.append(tuple(sorted(req)))
        rows.append(tuple(over))
    return Ranges(tuple(spans), tuple(rows))


def _draw_doc_runs(r: random.Random, qo_lens: list[int], kv_lens: list[int]) -> DocRuns:
    runs = []
    for q, k in zip(qo_lens, kv_lens):
        cuts = {0}
        for _ in range(r.choice([0, 1, 2, 3, 5])):
            cuts.add(r.randint(0, max(k - 1, 0)))
        if 0 < k - q < k and r.random() < 0.3:
            cuts.add(k - q)  # a document starting at the chunk start
        if k > 2 and r.random() < 0.3:  # documents of length 1
            p = r.randint(1, k - 2)
            cuts.update((p, p + 1))
        starts = sorted(c for c in cuts if c < max(k, 1))
        unsorted = r.random() < 0.2
        ids = [r.randint(0, 3) for _ in starts] if unsorted else list(range(len(starts)))
        runs.append(tuple(zip(starts, ids)))
    return DocRuns(tuple(runs))


def _draw_flags(r: random.Random, kv_lens: list[int]) -> DocRuns:
    """0 / 1 flags per key (global tokens' ``is_global``) as runs: per request none, a few single
    keys (the first and the last among the candidates), or a short run of them."""
    runs = []
    for k in kv_lens:
        flagged: set[int] = set()
        if k > 0:
            for _ in range(r.choice([0, 1, 2, 4, 8])):
                flagged.add(r.choice([0, k - 1, r.randint(0, k - 1)]))
            if r.random() < 0.2:  # a run of flagged keys
                p = r.randint(0, k - 1)
                flagged.update(range(p, min(k, p + r.randint(2, 20))))
        cuts = [(0, 0)]
        for key in sorted(flagged):
            cuts += [(key, 1), (key + 1, 0)]
        runs.append(tuple(c for c in cuts if c[0] < max(k, 1)))
    return DocRuns(tuple(runs))


def _flag_tensors(spec: VariantSpec) -> set[str]:
    """The [total_kv] tensors the mask reads in a test of the key alone (``is_global[kv_row] != 0``):
    drawn as sparse flags, not as documents."""
    return {n for a in tests(spec.mask) if key_only(a) for n in names_used(a)} & {t.name for t in spec.tensors}


def _draw_trees(r: random.Random, qo_lens: list[int], words: int) -> Trees:
    from ..wrappers.trees import random_tree_parents

    g = torch.Generator().manual_seed(r.getrandbits(31))
    shapes = ("chain", "star", "random", "forest")
    return Trees(tuple(tuple(random_tree_parents(min(q, 32 * words), g, r.choice(shapes))) for q in qo_lens))


def _draw_tensor(r: random.Random, t: Any, qo_lens: list[int], kv_lens: list[int], flags: set[str]) -> TensorArg:
    shape = tuple(t.shape)
    if t.name == "tree_bits" and t.dtype == "int32" and len(shape) == 2 and shape[0] == "total_q":
        return _draw_trees(r, qo_lens, shape[1])
    if t.name == "sinks" and t.dtype == "float32" and shape == ("num_qo_heads",):
        # learned sink logits: a few units either way (gpt-oss), and ones that take all or no weight
        return PerHead(tuple(r.choice([round(r.uniform(-6.0, 6.0), 3), 40.0, -40.0, 0.0])
                             for _ in range(r.randint(1, 8))))
    if t.dtype == "int32" and shape == ("total_q", 2):
        return _draw_ranges(r, qo_lens, kv_lens)
    if t.dtype == "int32" and shape == ("total_kv",):
        return _draw_flags(r, kv_lens) if t.name in flags else _draw_doc_runs(r, qo_lens, kv_lens)
    if t.dtype == "int32" and shape == ("batch",):
        vals = []
        for q, k in zip(qo_lens, kv_lens):
            vals.append(r.choice([0, 1, k - q, k - q + 1, r.randint(0, k + 3), k, k + 3]))
        return PerRequest(tuple(vals))
    if t.dtype == "float32" and shape == ("num_qo_heads",):
        if r.random() < 0.6:
            return PerHead()
        return PerHead(tuple(round(r.uniform(-0.5, 1.0), 4) for _ in range(r.randint(1, 8))))
    return Seeded(r.getrandbits(31))


def draw_batch(r: random.Random, spec: VariantSpec, target: Target, limits: Limits,
               n: int | None = None) -> Batch:
    """Random lengths and spec tensors for ``target`` (``n`` requests, or a random count)."""
    qo, kv = _draw_lengths(r, target, limits, n)
    flags = _flag_tensors(spec)
    tensors = tuple((t.name, _draw_tensor(r, t, qo, kv, flags)) for t in spec.tensors)
    return Batch(tuple(qo), tuple(kv), tensors, r.getrandbits(31))


def graph_capacity(target: Target, limits: Limits, page_size: int, batch_size: int) -> tuple[int, int, int]:
    """(max_batch_size, max_total_q, max_kv_pages) of a graph-mode wrapper for ``limits``
    (CUDA-core decode: exactly ``batch_size`` requests per plan)."""
    if target.kind == "decode":
        n = batch_size if not target.tensor_cores else limits.max_decode_requests
        pages = n * -(-limits.max_decode_kv_len // page_size) + EXTRA_PAGES
        return n, n * (limits.max_decode_q_len if target.tensor_cores else 1), pages
    n = limits.max_requests
    longest = limits.max_qo_len + limits.max_cached
    return n, n * limits.max_qo_len, n * -(-longest // page_size) + EXTRA_PAGES


def draw_case(r: random.Random, target: Target, module: ModuleKey, *, limits: Limits = Limits(),
              plans: tuple[str, ...] | None = None, session: FuzzCase | None = None,
              poison: tuple[str, ...] = ()) -> FuzzCase:
    """A random case of ``target`` on ``module``. ``plans``: the plan paths available (default:
    the target's). ``session`` (graph targets): a case of an existing graph session - the new case
    replays another batch in it (same heads, page size, plan path, scalars, scales, capacity).
    ``poison``: POISONS keys, one drawn for each case of two requests or more (isolation cases;
    draws nothing more when empty, so a seed gives the same cases as without it)."""
    spec = shipped_spec(module.spec)
    if session is not None:
        if session.graph is None or session.target != target.name or session.module != module:
            raise ValueError(f"draw_case(session=...): {session.label()} is no graph session of {target.name} "
                             f"on {module.label()}")
        n = session.graph.max_batch_size if target.kind == "decode" and not target.tensor_cores else None
        return replace(session, batch=draw_batch(r, spec, target, limits, n))
    plans = plans or target.plans
    group = r.choice(limits.groups)
    hkv = r.choice(limits.kv_heads)
    page_size = 1 if target.kind == "ragged" else r.choice(limits.page_sizes)
    plan = r.choice([p for p in target.plans if p in plans] or ["off"])
    scalars = tuple((s.name, _draw_scalar(r, s)) for s in spec.scalars)
    scales: tuple[float | None, float | None, float | None] = (None, None, None)
    if spec.qkv_scales and (r.random() < 0.15 or module.kv_dtype.startswith("fp8") and r.random() < 0.6):
        scales = (r.choice([None, 0.5, 1.5]), r.choice([None, 0.25, 2.0]), r.choice([None, 0.5, 3.0]))
    batch = draw_batch(r, spec, target, limits)
    graph = None
    if target.graph:
        cap = graph_capacity(target, limits, page_size, len(batch.qo_lens))
        longest = limits.max_decode_q_len if target.kind == "decode" and target.tensor_cores else None
        graph = GraphSetup(batch, *cap, max_qo_len=longest)
    case = FuzzCase(target.name, module, batch, group * hkv, hkv, page_size, plan, scalars,
                    disable_split_kv=not target.graph and r.random() < 0.2, return_lse=r.random() < 0.5,
                    scales=scales, graph=graph)
    if poison and len(batch.qo_lens) > 1:
        case = replace(case, poison=r.choice(poison))
    return case
