"""Shrinking a failing fuzz case (fewer and shorter requests, fewer heads, simpler spec tensors
and options) while it fails the same way, and printing it as a pytest regression test."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from .fuzz_cases import (
    CASE_CLASSES,
    TARGET_BY_NAME,
    Batch,
    DocRuns,
    FuzzCase,
    PerHead,
    PerRequest,
    Ranges,
    TensorArg,
    Trees,
    case_literal,
    without,
)
from .fuzz_compare import Verdict, is_fatal
from .fuzz_run import CaseRunner

# ----------------------------------------------------------------------------- shrinking


def _batch_shrinks(case: FuzzCase, b: Batch, fixed_count: bool) -> Iterator[Batch]:
    """Smaller versions of batch ``b``: fewer requests, then shorter ones."""
    decode = TARGET_BY_NAME[case.target].kind == "decode"
    n = len(b.qo_lens)
    if not fixed_count:
        for i in reversed(range(n)):
            if n > 1 and sum(b.qo_lens) > b.qo_lens[i]:
                yield b.drop(i)
    for i in range(n):
        q, k = b.qo_lens[i], b.kv_lens[i]
        options: list[tuple[int, int]] = []
        if decode:  # the same query count per request: shorter contexts, or one query less everywhere
            options += [(q, q), (q, max(q, k // 2)), (q, k - 1)]
        else:
            cached = k - q
            options += [(q, q), (q, q + cached // 2), (q, k - 1)]  # fewer cached keys before the chunk
            options += [(1, cached + 1), (q // 2, cached + q // 2), (q - 1, k - 1)]  # keep the first queries
            options += [(1, k), (q // 2, k), (q - 1, k)]  # keep the last queries (and every key)
        seen = set()
        for nq, nk in options:
            smaller = nq <= q and nk <= k and (nq, nk) != (q, k)
            if smaller and 0 <= nq <= nk and (nk >= 1 or not decode) and (nq, nk) not in seen:
                seen.add((nq, nk))
                qo = b.qo_lens[:i] + (nq,) + b.qo_lens[i + 1:]
                kv = b.kv_lens[:i] + (nk,) + b.kv_lens[i + 1:]
                if sum(qo) > 0:
                    yield Batch(qo, kv, b.tensors, b.seed)
    for j, (name, arg) in enumerate(b.tensors):  # simpler spec tensors
        for simpler in _tensor_shrinks(arg):
            yield Batch(b.qo_lens, b.kv_lens, b.tensors[:j] + ((name, simpler),) + b.tensors[j + 1:], b.seed)


def _tensor_shrinks(arg: TensorArg) -> Iterator[TensorArg]:
    if isinstance(arg, Ranges):
        for i, spans in enumerate(arg.spans):
            for j in range(len(spans)):
                yield Ranges(arg.spans[:i] + (without(spans, j),) + arg.spans[i + 1:], arg.rows)
        for i, rows in enumerate(arg.rows):
            for j in range(len(rows)):
                yield Ranges(arg.spans, arg.rows[:i] + (without(rows, j),) + arg.rows[i + 1:])
    elif isinstance(arg, DocRuns):
        for i, runs in enumerate(arg.runs):
            for j in range(1, len(runs)):
                yield DocRuns(arg.runs[:i] + (without(runs, j),) + arg.runs[i + 1:])
    elif isinstance(arg, PerRequest):
        for i, value in enumerate(arg.values):
            if value:
                yield PerRequest(arg.values[:i] + (0,) + arg.values[i + 1:])
    elif isinstance(arg, PerHead) and arg.values:
        yield PerHead()
    elif isinstance(arg, Trees):
        for i, parents in enumerate(arg.parents):
            chain = tuple(range(-1, len(parents) - 1))
            if parents != chain:  # the simplest tree of its size
                yield Trees(arg.parents[:i] + (chain,) + arg.parents[i + 1:])


def shrink_candidates(case: FuzzCase) -> Iterator[FuzzCase]:
    """Smaller cases to try, biggest cuts first: fewer and shorter requests, fewer heads,
    simpler spec tensors and options; in graph mode the capture batch shrinks too."""
    target = TARGET_BY_NAME[case.target]
    fixed = target.graph and target.kind == "decode" and not target.tensor_cores  # exactly max_batch_size
    g = case.graph
    if fixed and g is not None and len(case.batch.qo_lens) > 1:
        for i in reversed(range(len(case.batch.qo_lens))):  # one request fewer in both batches and the capacity
            cap = g.max_batch_size - 1
            yield replace(case, batch=case.batch.drop(i), graph=replace(g, capture=g.capture.drop(i),
                                                                       max_batch_size=cap, max_total_q=cap))
    for b in _batch_shrinks(case, case.batch, fixed):
        yield replace(case, batch=b)
    group = case.num_qo_heads // case.num_kv_heads
    if case.num_kv_heads > 1:
        yield replace(case, num_qo_heads=group, num_kv_heads=1)
    if group > 1:
        yield replace(case, num_qo_heads=case.num_kv_heads)
    if case.return_lse:
        yield replace(case, return_lse=False)
    if case.scales != (None, None, None):
        yield replace(case, scales=(None, None, None))
    if case.disable_split_kv:
        yield replace(case, disable_split_kv=False)
    if g is not None:
        for b in _batch_shrinks(case, g.capture, fixed):
            yield replace(case, graph=replace(g, capture=b))


def case_size(case: FuzzCase) -> tuple[int, int, int]:
    """(requests, query rows, keys): what shrinking reduces."""
    b = case.batch
    return len(b.qo_lens), sum(b.qo_lens), sum(b.kv_lens)


@dataclass
class Minimized:
    case: FuzzCase
    verdict: Verdict
    steps: int  # candidates run
    accepted: int  # of them still failing the same way (each became the new case)
    reproduced: bool  # the original failed again in the minimizing runner
    seconds: float


def minimize(case: FuzzCase, signature: str, runner: CaseRunner, *, budget_s: float = 30.0,
             max_steps: int = 400, clock: Callable[[], float] | None = None) -> Minimized:
    """Greedily shrink ``case`` while it still fails with ``signature`` (Verdict.signature):
    take the first smaller candidate that does, start over from it; stop when none does, or at
    the budget."""
    import time

    clock = clock or time.perf_counter
    t0 = clock()
    first = runner.run(case).verdict
    if first.signature != signature:
        return Minimized(case, first, 1, 0, False, clock() - t0)
    best, verdict, steps, accepted = case, first, 1, 0
    improved = True
    while improved and steps < max_steps and clock() - t0 < budget_s:
        improved = False
        for cand in shrink_candidates(best):
            if steps >= max_steps or clock() - t0 >= budget_s:
                break
            steps += 1
            v = runner.run(cand).verdict
            if v.signature == signature:
                best, verdict, accepted, improved = cand, v, accepted + 1, True
                if is_fatal(v):
                    return Minimized(best, verdict, steps, accepted, True, clock() - t0)
                break
    return Minimized(best, verdict, steps, accepted, True, clock() - t0)


# ----------------------------------------------------------------------------- regression tests


def regression_test(case: FuzzCase, verdict: Verdict, *, origin: str) -> str:
    """A pytest test (for tests/gpu/test_gpu_regressions.py, which has the ``workspace`` fixture)
    that fails while ``case`` still does. ``origin``: where it was found (seed, commit)."""
    import hashlib
    import textwrap

    head = "    case = "
    literal = case_literal(case, column=len(head))
    names = sorted(n for n in CASE_CLASSES if re.search(rf"\b{n}\(", literal))
    digest = hashlib.sha1(repr(case).encode()).hexdigest()[:6]
    slug = re.sub(r"[^0-9a-z]+", "_", f"{case.target}_{case.module.spec}").strip("_")
    quotes = '"' * 3
    doc = textwrap.wrap(f"{origin}: {verdict.kind}: {verdict.message}".replace(quotes, "'''"), 108) or [""]
    if len(doc) == 1:
        doc_text = f"    {quotes}{doc[0]}{quotes}"
    else:
        doc_text = "\n".join([f"    {quotes}{doc[0]}", *(f"    {line}" for line in doc[1:]), f"    {quotes}"])
    return "\n".join([
        f"def test_fuzz_{slug}_{digest}(workspace):",
        doc_text,
        f"    from variantgen.testing.fuzz_cases import {', '.join(names)}",
        "    from variantgen.testing.fuzz_run import assert_case_passes",
        "",
        head + literal,
        "    assert_case_passes(case, workspace)",
        "",
    ])
