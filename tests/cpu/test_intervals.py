"""Interval analysis is sound: for every shipped spec and random inputs, each row's
visible keys (from the derived reference mask) lie inside the derived hull, and rows
marked exact see exactly that interval."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from variantgen import parse_spec
from variantgen.lang.spec import load_spec
from variantgen.planning.intervals import analyze, decided_terms, row_intervals, tensors_read
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.reference import RequestGrid, mask_for_request

SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.yaml"))


def row_env(qo_lens, kv_lens):
    _rows, env = [], {k: [] for k in ("q_pos", "q_idx", "q_row", "q_kv_row", "request", "qo_len", "kv_len")}
    q_row = kv_base = 0
    for b, (ql, kl) in enumerate(zip(qo_lens, kv_lens)):
        for i in range(ql):
            pos = kl - ql + i
            for k, v in (("q_pos", pos), ("q_idx", i), ("q_row", q_row), ("q_kv_row", kv_base + pos),
                         ("request", b), ("qo_len", ql), ("kv_len", kl)):
                env[k].append(v)
            q_row += 1
        kv_base += kl
    out = {k: torch.tensor(v, dtype=torch.int64) for k, v in env.items()}
    out["vg_kv_lens"] = torch.tensor(kv_lens, dtype=torch.int64)
    return out


def check_sound(spec, qo_lens, kv_lens, args):
    form = analyze(spec)
    iv = row_intervals(form, spec, row_env(qo_lens, kv_lens), args)
    row = q_base = kv_base = 0
    exact_rows = 0
    for b, (ql, kl) in enumerate(zip(qo_lens, kv_lens)):
        grid = RequestGrid(b, ql, kl, q_base, kv_base, 1, 1, torch.device("cpu"))
        mask = mask_for_request(spec, grid, args)[0]
        for i in range(ql):
            visible = mask[i].nonzero().squeeze(1)
            lo, hi = int(iv.lo[row]), int(iv.hi[row])
            if visible.numel():
                assert lo <= int(visible.min()) and int(visible.max()) <= hi, (spec.name, b, i, lo, hi)
            if bool(iv.exact[row]):
                exact_rows += 1
                assert visible.tolist() == list(range(lo, hi + 1)), (spec.name, b, i, lo, hi)
                assert int(iv.dense_hi[row]) == hi
            dense_hi = int(iv.dense_hi[row])
            assert lo - 1 <= dense_hi <= hi and bool(mask[i, lo:dense_hi + 1].all()), (spec.name, b, i, dense_hi)
            if bool(iv.empty[row]):
                assert visible.numel() == 0
            row += 1
        q_base += ql
        kv_base += kl
    return exact_rows, row


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_intervals_sound(path, seed):
    spec = load_spec(path)
    form = analyze(spec)
    if not form.planner_ready:
        pytest.skip(form.reason)
    qo_lens, kv_lens = [5, 40, 1, 33], [5, 90, 61, 33]
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
                               dtype=torch.float32, seed=seed)
    args = random_spec_args(spec, batch, seed=seed)
    for s in spec.scalars:  # small windows/chunks so every branch shows up in short requests
        if s.dtype == "int":
            args[s.name] = [-1, 7, 3][seed] if "window" in s.name else [4, 8, 3][seed]
    exact, total = check_sound(spec, qo_lens, kv_lens, args)
    if len(form.terms) == 1 and form.exact:
        assert exact == total


def test_exactness_of_known_forms():
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "mm_prefix.yaml")
    form = analyze(spec)
    assert form.planner_ready and form.exact
    assert tensors_read(form, spec) == {"ranges"}
    doc = load_spec(Path(__file__).resolve().parents[2] / "specs" / "document.yaml")
    # Equality of a [total_kv] tensor with a row value is exact where the tensor is sorted.
    assert analyze(doc).exact and tensors_read(analyze(doc), doc) == {"doc_ids"}


def test_document_ids_sorted_and_unsorted():
    doc = load_spec(Path(__file__).resolve().parents[2] / "specs" / "document.yaml")
    qo, kv = [6, 10], [9, 10]
    sorted_ids = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2, 2] + [5, 5, 5, 7, 7, 7, 7, 7, 9, 9], dtype=torch.int32)
    exact, total = check_sound(doc, qo, kv, {"doc_ids": sorted_ids})
    assert exact == total
    shuffled = torch.tensor([0, 1, 0, 1, 1, 1, 2, 2, 2] + [5, 5, 5, 7, 7, 7, 7, 7, 9, 9], dtype=torch.int32)
    iv = row_intervals(analyze(doc), doc, row_env(qo, kv), {"doc_ids": shuffled})
    assert not iv.exact[:6].any() and iv.exact[6:].all()  # only the unsorted request loses exactness
    check_sound(doc, qo, kv, {"doc_ids": shuffled})


def test_head_dependent_mask_is_not_planned():
    spec = parse_spec("name: h\nmask: kv_pos <= q_pos and qo_head % 2 == 0\n")
    assert not analyze(spec).planner_ready


def test_negation_and_chunk_forms():
    spec = parse_spec("name: n\nscalars:\n  c: {dtype: int, default: 4}\n"
                      "mask: not (kv_pos > q_pos) and kv_pos // c == q_pos // c\n")
    exact, total = check_sound(spec, [9, 3], [9, 12], {"c": 4})
    assert exact == total


def test_a_not_over_a_float_order_keeps_nan_rows_visible():
    """not (x >= 0.0 and ...) is not x < 0.0 or ...: where x is NaN both orders are false, so
    the not leaves every key visible. The not stays outside a float order (a hull)."""
    spec = parse_spec("name: n\nmask: not (sqrt(float(q_pos) - 40.0) >= 0.0 and kv_pos > q_pos)\n")
    assert [t.describe() for t in analyze(spec).terms] == [
        "(not (sqrt((float(q_pos) - 40.0)) >= 0.0))", "kv_pos <= q_pos"]
    check_sound(spec, [4, 6], [40, 44], {})  # q_pos 36..39 (NaN: every key) and 38..43


def test_a_not_that_cannot_be_pushed_in_is_a_hull():
    """not bit(kv_pos, 0) has no inner form: it was negated back and forth forever."""
    spec = parse_spec("name: n\nmask: kv_pos <= q_pos and not bit(kv_pos, 0)\n")
    form = analyze(spec)
    assert form.planner_ready and not form.exact
    check_sound(spec, [5, 3], [9, 4], {})
    flt = parse_spec("name: n\nmask: not (float(kv_pos) < 2.5)\n")
    assert not analyze(flt).planner_ready  # reads the key through a float: nothing to bound
    check_sound(parse_spec("name: n\nmask: not (float(q_pos) < 2.5) or kv_pos == 0\n"), [5], [9], {})


def test_sorted_ids_and_chunks_compare_ints_only():
    """The binary search and the chunk bound compare ints: a float tensor or value would be
    truncated (0.25, 0.5 and 0.75 all one document; kv_pos // 16 == 1.5 the chunk of 1)."""
    fdoc = parse_spec("name: d\ntensors:\n  doc: {dtype: float32, shape: [total_kv]}\n"
                      "mask: kv_pos <= q_pos and doc[kv_row] == doc[q_kv_row]\n")
    assert not analyze(fdoc).exact
    check_sound(fdoc, [8], [12], {"doc": torch.arange(12, dtype=torch.float32) / 4.0})
    half = parse_spec("name: d\ntensors:\n  doc: {dtype: int32, shape: [total_kv]}\n"
                      "mask: doc[kv_row] == float(q_pos) / 2.0\n")
    assert not analyze(half).exact
    check_sound(half, [6], [6], {"doc": torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32)})
    chunk = parse_spec("name: c\nscalars:\n  x: {dtype: float, default: 1.5}\nmask: kv_pos // 16 == x\n")
    assert not analyze(chunk).planner_ready
    exact_chunk = parse_spec("name: c\nscalars:\n  x: {dtype: int, default: 1}\nmask: kv_pos // 16 == x\n")
    assert analyze(exact_chunk).exact
    check_sound(exact_chunk, [8], [40], {"x": 1})


def test_sorted_ids_need_a_key_row_tensor():
    """`t[kv_row] == v` is a sorted-id term only for a [total_kv] tensor: on a fixed-size one
    (any int index, clamped) it reads the key in a way the planner does not model."""
    fixed = parse_spec("name: x\ntensors:\n  t: {dtype: int32, shape: [8]}\n"
                       "mask: kv_pos <= q_pos and t[kv_row] == 1\n")
    form = analyze(fixed)
    assert [t.sorted_eqs for t in form.terms] == [()] and not form.exact
    t = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0], dtype=torch.int32)
    check_sound(fixed, [5, 3], [9, 4], {"t": t})


def test_offset_rows_in_bounds_are_sound():
    """Row-only bounds with offset rows evaluate with the request-local clamp (the planner and
    the reference share it)."""
    spec = parse_spec("name: x\ntensors:\n  r: {dtype: int32, shape: [total_q, 2]}\n"
                      "  d: {dtype: int32, shape: [total_kv]}\n"
                      "mask: r[q_row - 1, 0] <= kv_pos and kv_pos <= max(r[q_row + 1, 1], d[q_kv_row - 2])\n")
    form = analyze(spec)
    assert form.planner_ready and form.exact
    qo_lens, kv_lens = [5, 1, 7], [9, 4, 7]
    g = torch.Generator().manual_seed(3)
    args = {"r": torch.randint(-2, 10, (sum(qo_lens), 2), generator=g, dtype=torch.int32),
            "d": torch.randint(-2, 10, (sum(kv_lens),), generator=g, dtype=torch.int32)}
    check_sound(spec, qo_lens, kv_lens, args)
    iv = row_intervals(form, spec, row_env(qo_lens, kv_lens), args)
    assert bool((iv.exact | iv.empty).all())  # one interval per row, each exact (or provably empty)


# ----------------------------------------------------------------------------- tree verification


def _tree_case(sizes, shapes, context, seed=0):
    """A batch of tree-verify requests: per request a draft tree of sizes[i] nodes after
    `context` cached keys; (qo_lens, kv_lens, args, parents)."""
    from variantgen.wrappers.trees import random_tree_parents, tree_bits

    g = torch.Generator().manual_seed(seed)
    parents = [random_tree_parents(n, g, s) for n, s in zip(sizes, shapes)]
    return list(sizes), [c + n for c, n in zip(context, sizes)], {"tree_bits": tree_bits(parents)}, parents


def test_tree_verify_context_is_dense_and_the_drafts_a_small_hull():
    """The planner sees each draft node's row as the context [0, ctx) exactly (dense) plus a
    hull over the drafts up to the node itself: at most qo_len keys need the per-key mask."""
    spec = load_spec(Path(SPECS[0]).parent / "tree_verify.yaml")
    form = analyze(spec)
    assert form.planner_ready and [t.exact for t in form.terms] == [True, False]
    assert tensors_read(form, spec) == set()  # plan() needs no tensor to plan it
    sizes, shapes = [1, 7, 16, 64, 33, 2], ["chain", "random", "star", "random", "forest", "chain"]
    qo, kv, args, _ = _tree_case(sizes, shapes, [0, 100, 37, 8192, 5, 64])
    iv = row_intervals(form, spec, row_env(qo, kv), args)
    row = 0
    for n, k in zip(qo, kv):
        ctx = k - n
        for i in range(n):
            assert (int(iv.lo[row]), int(iv.dense_hi[row]), int(iv.hi[row])) == (0, ctx - 1, ctx + i)
            assert not bool(iv.exact[row])  # the drafts' bits are the mask's business
            row += 1
    check_sound(spec, qo, kv, args)


@pytest.mark.parametrize("seed", range(4))
def test_tree_verify_mask_is_context_plus_ancestors(seed):
    """Random trees of 1-64 nodes (chains, stars, random parents, forests): a node sees every
    cached key, itself and its ancestors, nothing else; a chain is causal attention."""
    from variantgen.wrappers.reference import RequestGrid, mask_for_request

    spec = load_spec(Path(SPECS[0]).parent / "tree_verify.yaml")
    g = torch.Generator().manual_seed(100 + seed)
    sizes = [int(torch.randint(1, 65, (1,), generator=g)) for _ in range(4)] + [64, 1]
    shapes = ["chain", "star", "random", "forest", "random", "star"]
    qo, kv, args, parents = _tree_case(sizes, shapes, [int(torch.randint(0, 50, (1,), generator=g)) for _ in sizes],
                                       seed)
    q_base = kv_base = 0
    for b, (n, k, par) in enumerate(zip(qo, kv, parents)):
        mask = mask_for_request(spec, RequestGrid(b, n, k, q_base, kv_base, 1, 1, torch.device("cpu")), args)[0]
        ctx = k - n
        for i in range(n):
            seen, node = {i}, i
            while par[node] >= 0:
                node = par[node]
                seen.add(node)
            want = list(range(ctx)) + sorted(ctx + j for j in seen)
            assert mask[i].nonzero().flatten().tolist() == want, (b, i)
        if shapes[b] == "chain":
            causal = torch.arange(k).view(1, -1) <= torch.arange(ctx, k).view(-1, 1)
            assert torch.equal(mask, causal)
        q_base += n
        kv_base += k


_RANDOM_HEADER = """name: r
tensors:
  t: {dtype: int32, shape: [total_q, 2]}
  d: {dtype: int32, shape: [total_kv]}
  g: {dtype: float32, shape: [total_kv]}
scalars:
  w: {dtype: int, default: 3}
  c: {dtype: int, default: 4}
  x: {dtype: float, default: 1.5}
  flag: {dtype: bool, default: true}
"""


def _random_mask(r, depth: int) -> str:
    """A random mask of the forms the analysis rewrites (bounds, chunks, sorted ids, not) mixed
    with ones it must leave alone (float orders that can be NaN, bit(), float tensors)."""
    def row(d):
        if d <= 0 or r.random() < 0.4:
            return r.choice(["q_pos", "q_idx", "qo_len", "kv_len", "w", "c", "t[q_row, 0]", "d[q_kv_row]",
                             "d[q_kv_row - 2]", str(r.randint(-6, 6))])
        a, b = row(d - 1), row(d - 1)
        return r.choice([f"({a} + {b})", f"({a} - {b})", f"({a} // {b})", f"({a} % {b})", f"max({a}, {b})",
                         f"-{a}"])

    def atom():
        op = r.choice(["<", "<=", ">", ">=", "==", "!="])
        key = r.choice([f"(kv_pos + {row(1)})", f"({row(1)} - kv_pos)", f"-(kv_pos - {row(1)})", "kv_pos"])
        return r.choice([
            f"({key} {op} {row(1)})", f"(kv_pos // {row(0)} == {row(1)})", f"(d[kv_row] == {row(1)})",
            f"({row(1)} {op} {row(1)})", "flag", "bit(kv_pos, 0)", "(kv_pos // 4 == x)",
            f"(sqrt(float({row(0)}) - 6.0) {op} 0.0)", f"(float(kv_pos) {op} x)", "(g[kv_row] == x)",
            "(g[kv_row] == float(q_pos) / 2.0)"])

    def mask(d):
        if d <= 0 or r.random() < 0.3:
            return atom()
        return r.choice([f"({mask(d - 1)} and {mask(d - 1)})", f"({mask(d - 1)} or {mask(d - 1)})",
                         f"(not {mask(d - 1)})"])

    return mask(depth)


@pytest.mark.parametrize("seed", range(4))
def test_random_masks_are_sound(seed):
    """Every interval the analysis derives holds for random masks: a hull covers the visible
    keys, an exact one is exactly them, a dense prefix is all visible (check_sound)."""
    checked = 0
    for spec, qo, kv, args in _random_cases(seed, sorted_ids=0.7):
        check_sound(spec, qo, kv, args)
        checked += 1
    assert checked >= 20


def _random_cases(seed: int, sorted_ids: float, tries: int = 60):
    """(spec, qo_lens, kv_lens, args) of random masks the analysis plans, with random batches and
    arguments; ``sorted_ids``: the share of cases whose `d` ids are sorted."""
    import random

    from variantgen.core.errors import SpecError

    r = random.Random(seed)
    for _ in range(tries):
        try:
            spec = parse_spec(_RANDOM_HEADER + f'mask: "{_random_mask(r, r.randint(1, 3))}"\n')
        except SpecError:
            continue
        if not analyze(spec).planner_ready:
            continue
        qo, kv = [r.randint(1, 6), r.randint(1, 6)], [r.randint(6, 14), r.randint(6, 14)]
        g = torch.Generator().manual_seed(r.randrange(1 << 30))
        total_q, total_kv = sum(qo), sum(kv)
        ids = torch.randint(-2, 4, (total_kv,), generator=g, dtype=torch.int32)
        args = {"t": torch.randint(-3, 16, (total_q, 2), generator=g, dtype=torch.int32),
                "d": ids.sort().values if r.random() < sorted_ids else ids,
                "g": torch.randint(0, 6, (total_kv,), generator=g).float() / 2.0,
                "w": r.randint(-2, 6), "c": r.randint(-3, 5), "x": r.choice([1.5, 2.0, 0.0]),
                "flag": r.random() < 0.5}
        yield spec, qo, kv, args


def test_a_scalar_only_condition_is_decided_once_per_plan():
    """sliding_window's `window < 0 or q_pos - kv_pos <= window`: for a window >= 0 the rows
    evaluate one interval term, not a union of two (plan()'s host work); for -1 the decided
    condition is gone from the term that holds."""
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "sliding_window.yaml")
    form = analyze(spec)
    assert len(form.terms) == 2
    (bounded,) = decided_terms(form, spec, {"window": 7})
    assert not bounded.conds and bounded.lows
    unbounded = decided_terms(form, spec, {"window": -1})
    assert len(unbounded) == 2 and not any(t.conds for t in unbounded)


@pytest.mark.parametrize("seed", range(3))
def test_deciding_scalar_conditions_changes_no_interval(seed, monkeypatch):
    """row_intervals with the scalar-only conditions decided up front gives exactly what
    evaluating every term on every row gives, for random masks (their `flag`, `w`, `c` and
    constant conditions) and every shipped spec."""
    from variantgen.planning import intervals

    def both(spec, qo, kv, args):
        form = analyze(spec)
        env = row_env(qo, kv)
        decided = row_intervals(form, spec, env, args)
        with monkeypatch.context() as m:
            m.setattr(intervals, "decided_terms", lambda form, spec, args: form.terms)
            every = row_intervals(form, spec, env, args)
        for field in ("lo", "hi", "exact", "empty", "dense_hi"):
            assert torch.equal(getattr(decided, field), getattr(every, field)), (spec.name, field, args)

    compared = 0
    for spec, qo, kv, args in _random_cases(seed, sorted_ids=1.0):
        both(spec, qo, kv, args)
        compared += 1
    assert compared >= 20
    qo_lens, kv_lens = [5, 40, 1, 33], [5, 90, 61, 33]
    for path in SPECS:
        spec = load_spec(path)
        if not analyze(spec).planner_ready:
            continue
        batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
                                   dtype=torch.float32, seed=seed)
        args = random_spec_args(spec, batch, seed=seed)
        for s in spec.scalars:
            if s.dtype == "int":
                args[s.name] = [-1, 7, 0][seed]
        both(spec, qo_lens, kv_lens, args)
