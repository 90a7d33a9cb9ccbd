"""Interval analysis is sound: for every shipped spec and random inputs, each row's
visible keys (from the derived reference mask) lie inside the derived hull, and rows
marked exact see exactly that interval."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from variantgen import parse_spec
from variantgen.intervals import analyze, row_intervals, tensors_read
from variantgen.reference import RequestGrid, mask_for_request
from variantgen.spec import load_spec
from variantgen.testing import random_paged_batch, random_spec_args

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
    from variantgen.trees import random_tree_parents, tree_bits

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
    from variantgen.reference import RequestGrid, mask_for_request

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
