"""Per-query key intervals derived from a mask's expression tree.

Practical masks are unions of key intervals per query row: causal [0, q_pos], window
[q_pos - w, q_pos], a span [start, end], a chunk [c*floor(q/c), q], prefix-LM
[0, max(q_pos, prefix - 1)]. ``analyze`` rewrites the mask into a disjunction of terms,
each an intersection of

  * row conditions (atoms that do not read the key at all),
  * bounds ``kv_pos >= lo`` / ``kv_pos <= hi`` with lo, hi row-only expressions
    (from any comparison linear in kv_pos with coefficient +-1, and from the chunk
    pattern ``kv_pos // c == r``),
  * anything else that reads the key (e.g. ``doc_ids[kv_row] == ...``): dropped from
    the bounds, which turns the term into a *hull* (a superset), marked inexact.

``row_intervals`` evaluates the bounds for every query row at once (torch, on the
device of the inputs): per row the hull [lo, hi] of the visible keys and whether the
visible set is exactly that one interval. The planner only skips per-element masking
where ``exact`` holds; elsewhere the mask is evaluated inside the hull, which is sound.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from ..abi.table import NO_INTERVAL
from ..core.errors import LaunchError
from ..lang.evaluate import Evaluator
from ..lang.nodes import Binary, Const, Index, Name, Node, Type, Unary, names_used, to_source
from ..lang.reads import HEAD_NAMES, KEY_NAMES, key_only, page_list_atoms, rows_by_blocks
from ..lang.values import VariantSpec
from .normalize import constant_difference, normalize

MAX_TERMS = 8
BIG = NO_INTERVAL  # no interval: lo = BIG, hi = -BIG


@dataclass(frozen=True)
class Term:
    conds: tuple[Node, ...] = ()  # row-only bool expressions, all must hold
    lows: tuple[Node, ...] = ()  # kv_pos >= each
    highs: tuple[Node, ...] = ()  # kv_pos <= each
    chunks: tuple[tuple[Node, Node], ...] = ()  # (c, r): kv_pos // c == r, c > 0
    # (t, v): t[kv_row] == v with t a [total_kv] tensor. Where t is non-decreasing along each
    # request (document ids, segment ids) the matching keys are one interval, found by binary
    # search; elsewhere the term keeps its hull.
    sorted_eqs: tuple[tuple[str, Node], ...] = ()
    exact: bool = True
    # Atoms of an inexact term that read the key but not the row (nor the head): a key set the
    # same for every row of a request (global tokens' flags, kv_pos % block >= block - c). Where
    # they are all the term drops (not ``opaque``), the term's keys are its bounds' keys in that
    # set, and a run of rows reads only the pages holding one (keysets.py); else its hull.
    keys: tuple[Node, ...] = ()
    opaque: bool = False  # it dropped an atom that reads the key and the row (or the head)
    # The atoms it dropped that read the key and the row (BigBird's random blocks' bit): keysets.py
    # evaluates them per block of rows and keys where they read the row only by blocks.
    pairs: tuple[Node, ...] = ()

    @property
    def key_set(self) -> bool:
        """An inexact term whose keys are a key set within its bounds (keys, nothing opaque)."""
        return not self.exact and bool(self.keys) and not self.opaque

    @functools.cached_property
    def row_blocked(self) -> bool:
        """An inexact term whose dropped atoms read the key and the row, the row only by blocks
        (``q_pos // D``): keysets.py finds its pages per (row block, key block). Kept (a walk of
        the atoms' trees): plan() asks for every term of a batch with custom rows."""
        return not self.exact and self.opaque and bool(self.pairs) and rows_by_blocks(self.pairs + self.keys)

    def describe(self) -> str:
        parts = [f"kv_pos >= {to_source(x)}" for x in self.lows] + [f"kv_pos <= {to_source(x)}" for x in self.highs]
        parts += [f"kv_pos // {to_source(c)} == {to_source(r)}" for c, r in self.chunks]
        parts += [f"{t}[kv_row] == {to_source(v)} (sorted)" for t, v in self.sorted_eqs]
        parts += [to_source(c) for c in self.conds]
        parts += [f"{to_source(k)} (key set)" for k in self.keys] if self.key_set else []
        return " and ".join(parts) + ("" if self.exact or self.key_set else "  (hull)")


@dataclass(frozen=True)
class IntervalForm:
    terms: tuple[Term, ...]
    planner_ready: bool
    reason: str = ""
    # Every name the bounds and conditions read (builtins included), computed once: plan()
    # asks on every call, and walking the trees each time cost ~0.8 ms per plan().
    names: frozenset[str] = frozenset()
    # Whether the mask has a test the planner may read through page lists, and so the modules
    # the listed variant (lang/reads.py's page_list_atoms): computed once for the same reason.
    page_lists: bool = False

    @property
    def exact(self) -> bool:
        return all(t.exact for t in self.terms)


def _row_only(node: Node) -> bool:
    return not (names_used(node) & (KEY_NAMES | HEAD_NAMES))


def _neg(node: Node) -> Node:
    if isinstance(node, Unary) and node.op == "-":
        return node.operand
    if isinstance(node, Const) and not isinstance(node.value, bool):
        return Const(pos=node.pos, ty=node.ty, value=-node.value)
    return Unary(pos=node.pos, ty=node.ty, op="-", operand=node)


def _sub(a: Node, b: Node) -> Node:
    return Binary(pos=a.pos, ty=Type.INT, op="-", left=a, right=b)


def _add_const(a: Node, k: int) -> Node:
    return Binary(pos=a.pos, ty=Type.INT, op="+", left=a, right=Const(value=k, ty=Type.INT))


def _linear(node: Node) -> tuple[int, Node | None] | None:
    """node == coef * kv_pos + rest with rest row-only; None if not of that form."""
    if isinstance(node, Name) and node.id == "kv_pos":
        return 1, None
    if _row_only(node):
        return 0, node
    if isinstance(node, Unary) and node.op in "+-":
        inner = _linear(node.operand)
        if inner is None:
            return None
        c, r = inner
        return (-c, _neg(r) if r is not None else None) if node.op == "-" else inner
    if isinstance(node, Binary) and node.op in ("+", "-"):
        a, b = _linear(node.left), _linear(node.right)
        if a is None or b is None:
            return None
        sign = 1 if node.op == "+" else -1
        rb = b[1] if sign == 1 or b[1] is None else _neg(b[1])
        rest = a[1] if rb is None else rb if a[1] is None else Binary(ty=Type.INT, op="+", left=a[1], right=rb)
        return a[0] + sign * b[0], rest
    return None


def _bounds_of_compare(node: Binary) -> Term | None:
    """A comparison linear in kv_pos -> bounds; None if it is not."""
    if node.left.ty is not Type.INT or node.right.ty is not Type.INT:
        return None
    diff = _linear(Binary(ty=Type.INT, op="-", left=node.left, right=node.right))
    if diff is None or abs(diff[0]) != 1:
        return None
    coef, rest = diff
    rest = rest if rest is not None else Const(value=0, ty=Type.INT)
    # coef*kv + rest  (op)  0
    op = node.op
    if coef == -1:  # -kv + rest op 0  <=>  kv  flip(op)  rest
        bound = rest
        op = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}[op]
    else:  # kv + rest op 0  <=>  kv op -rest
        bound = _neg(rest)
    if op == "<=":
        return Term(highs=(bound,))
    if op == "<":
        return Term(highs=(_add_const(bound, -1),))
    if op == ">=":
        return Term(lows=(bound,))
    if op == ">":
        return Term(lows=(_add_const(bound, 1),))
    if op == "==":
        return Term(lows=(bound,), highs=(bound,))
    return None


def _chunk_of_compare(node: Binary) -> Term | None:
    """kv_pos // c == r (either side), c and r row-only."""
    if node.op != "==":
        return None
    for a, b in ((node.left, node.right), (node.right, node.left)):
        # r an int: kv_pos // c == 1.5 holds for no key, not for the chunk of int(1.5)
        if (isinstance(a, Binary) and a.op == "//" and isinstance(a.left, Name) and a.left.id == "kv_pos"
                and _row_only(a.right) and _row_only(b) and b.ty is Type.INT):
            return Term(chunks=((a.right, b),))
    return None


def _sorted_eq_of_compare(node: Binary, key_tensors: frozenset[str]) -> Term | None:
    """t[kv_row] == v (either side), t one of the [total_kv] int tensors, v a row-only int. The
    binary search compares ints: a float tensor or value would be truncated to one."""
    if node.op != "==":
        return None
    for a, b in ((node.left, node.right), (node.right, node.left)):
        if (isinstance(a, Index) and a.tensor in key_tensors and isinstance(a.indices[0], Name)
                and a.indices[0].id == "kv_row" and _row_only(b) and a.ty is Type.INT and b.ty is Type.INT):
            return Term(sorted_eqs=((a.tensor, b),))
    return None


def _atom(node: Node, key_tensors: frozenset[str]) -> Term:
    if _row_only(node):
        return Term(conds=(node,))
    if isinstance(node, Binary) and node.op in ("<", "<=", ">", ">=", "==", "!="):
        found = (_bounds_of_compare(node) or _chunk_of_compare(node)
                 or _sorted_eq_of_compare(node, key_tensors))
        if found is not None:
            return found
    if key_only(node):  # a key set (keysets.py), not an interval
        return Term(exact=False, keys=(node,))
    return Term(exact=False, opaque=True, pairs=(node,))  # not an interval nor a key set: hull


def _and(a: Term, b: Term) -> Term:
    def both(x: tuple, y: tuple) -> tuple:
        return tuple(dict.fromkeys(x + y))  # a bound or condition both sides hold counts once
    return Term(both(a.conds, b.conds), both(a.lows, b.lows), both(a.highs, b.highs), both(a.chunks, b.chunks),
                both(a.sorted_eqs, b.sorted_eqs), a.exact and b.exact, both(a.keys, b.keys), a.opaque or b.opaque,
                both(a.pairs, b.pairs))


def _empty(term: Term) -> bool:
    """A term no key meets for any row: a false condition, or a low bound a constant above a high
    one (``kv_pos >= q_pos + 1 and kv_pos <= q_pos``, as the rewrites of nested min / max leave)."""
    if any(isinstance(c, Const) and c.value is False for c in term.conds):
        return True
    return any((d := constant_difference(lo, hi)) is not None and d > 0 for lo in term.lows for hi in term.highs)


class _TooComplex(Exception):
    pass


def _negate(node: Node) -> Node:
    """``not node`` with the ``not`` pushed inwards where that keeps its meaning; elsewhere
    ``not node`` itself (an atom for _dnf)."""
    if isinstance(node, Unary) and node.op == "not":
        return node.operand
    if isinstance(node, Binary) and node.op in ("and", "or"):
        return replace(node, op="or" if node.op == "and" else "and", left=_negate(node.left),
                       right=_negate(node.right))
    if isinstance(node, Binary) and node.op in ("==", "!="):
        return replace(node, op="!=" if node.op == "==" else "==")
    # An order flips only between ints: with a float NaN, x < y and x >= y are both false.
    if (isinstance(node, Binary) and node.op in ("<", "<=", ">", ">=")
            and node.left.ty is Type.INT and node.right.ty is Type.INT):
        return replace(node, op={"<": ">=", "<=": ">", ">": "<=", ">=": "<"}[node.op])
    return Unary(pos=node.pos, ty=Type.BOOL, op="not", operand=node)


def _dnf(node: Node, key_tensors: frozenset[str]) -> list[Term]:
    """``node`` as a disjunction of terms; ``key_tensors``: the one-dimensional [total_kv] tensors
    (a sorted-id comparison needs one row per key)."""
    if isinstance(node, Binary) and node.op == "or":
        terms = _dnf(node.left, key_tensors) + _dnf(node.right, key_tensors)
    elif isinstance(node, Binary) and node.op == "and":
        terms = [t for a in _dnf(node.left, key_tensors) for b in _dnf(node.right, key_tensors)
                 if not _empty(t := _and(a, b))]
    elif isinstance(node, Unary) and node.op == "not" and not _row_only(node):
        pushed = _negate(node.operand)
        if isinstance(pushed, Unary) and pushed.op == "not" and pushed.operand is node.operand:
            terms = [_atom(node, key_tensors)]  # the not stays outside (bit(), a float order ...): a hull
        else:
            return _dnf(pushed, key_tensors)
    elif isinstance(node, Const) and node.ty is Type.BOOL:
        terms = [Term()] if node.value else []
    else:
        terms = [_atom(node, key_tensors)]
    terms = list(dict.fromkeys(terms))  # (a or a) is a
    if len(terms) > MAX_TERMS:
        raise _TooComplex
    return terms


@functools.lru_cache(maxsize=256)
def analyze(spec: VariantSpec) -> IntervalForm:
    used = names_used(spec.mask)
    if used & HEAD_NAMES:
        return IntervalForm((), False, "the mask depends on the head index: intervals differ per head")
    try:
        key_tensors = frozenset(t.name for t in spec.tensors if t.shape == ("total_kv",))
        try:  # equivalent forms plan alike (normalize.py); one that expands too far is read as written
            terms = tuple(_dnf(normalize(spec.mask, spec), key_tensors))
        except _TooComplex:
            terms = tuple(_dnf(spec.mask, key_tensors))
    except _TooComplex:
        return IntervalForm((), False, f"the mask expands to more than {MAX_TERMS} interval terms")
    if not terms:
        return IntervalForm((), False, "the mask is never true")
    if all(not t.exact and not t.lows and not t.highs and not t.chunks and not t.sorted_eqs for t in terms):
        return IntervalForm(terms, False, "no key bound could be derived from the mask", _names_read(terms))
    return IntervalForm(terms, True, "", _names_read(terms), page_list_atoms(spec.mask))


def _names_read(terms: tuple[Term, ...]) -> frozenset[str]:
    used: set[str] = set()
    for t in terms:
        for node in (*t.conds, *t.lows, *t.highs, *(x for pair in t.chunks for x in pair),
                     *(v for _, v in t.sorted_eqs), *(t.keys if t.key_set or t.row_blocked else ()),
                     *(t.pairs if t.row_blocked else ())):
            used |= names_used(node)
        used |= {name for name, _ in t.sorted_eqs}
    return frozenset(used)


def args_read(form: IntervalForm, spec: VariantSpec) -> set[str]:
    """Spec arguments (tensors and scalars) the interval bounds read: plan() uses them."""
    return set(form.names & ({t.name for t in spec.tensors} | {s.name for s in spec.scalars}))


def usable_form(spec: VariantSpec, given: Collection[str], what: str = "intervals") -> IntervalForm:
    """The spec's key intervals for a plan that asked for them (skip_tiles=True): LaunchError
    when they are unknown or plan() lacks a tensor they read (``what`` names them)."""
    form = analyze(spec)
    if not form.planner_ready:
        raise LaunchError(f"plan(skip_tiles=True): spec `{spec.name}` has no usable key intervals "
                          f"({form.reason}); plan with skip_tiles=False")
    missing = sorted(tensors_read(form, spec) - set(given))
    if missing:
        raise LaunchError(f"plan(skip_tiles=True): the {what} of `{spec.name}` read {', '.join(missing)}; "
                          "pass them to plan() by name too")
    return form


def tensors_read(form: IntervalForm, spec: VariantSpec) -> set[str]:
    """Spec tensors the interval bounds read (plan() needs them to plan)."""
    return args_read(form, spec) & {t.name for t in spec.tensors}


# ----------------------------------------------------------------------------- evaluation


def _sorted_match(values: torch.Tensor, wanted: torch.Tensor, env: Mapping[str, torch.Tensor]):
    """Per row: the request-local key range [lo, hi] where values[kv_row] == wanted, and
    whether the row's request has non-decreasing values (only then is the range exact)."""
    kv_lens = env["vg_kv_lens"]  # [batch] keys per request
    n_req = kv_lens.shape[0]
    dev = values.device
    req_of_key = torch.repeat_interleave(torch.arange(n_req, device=dev), kv_lens, output_size=values.shape[0])
    v64 = values.to(torch.int64)
    step_ok = (v64[1:] >= v64[:-1]) | (req_of_key[1:] != req_of_key[:-1])
    sorted_req = torch.ones(n_req, dtype=torch.int32, device=dev)  # (CUDA scatter has no bool)
    if step_ok.numel():
        sorted_req = sorted_req.scatter_reduce(0, req_of_key[1:], step_ok.to(torch.int32), "amin")
    sorted_req = sorted_req.bool()
    # Requests occupy disjoint ranges of this key, so one binary search serves the batch.
    offset = 1 << 31
    keys = (req_of_key << 32) + (v64 + offset)
    request = env["request"]
    want = (request << 32) + (wanted.to(torch.int64).clamp(-offset, offset - 1) + offset)
    first = torch.searchsorted(keys, want.expand_as(request).contiguous(), right=False)
    last = torch.searchsorted(keys, want.expand_as(request).contiguous(), right=True) - 1
    base = env["q_kv_row"] - env["q_pos"]  # first [total_kv] row of the row's request
    return first - base, last - base, sorted_req[request]


@dataclass(frozen=True)
class RowIntervals:
    lo: torch.Tensor  # int64 [rows]: first key of the hull (clamped to [0, kv_len-1])
    hi: torch.Tensor  # int64 [rows]: last key of the hull
    exact: torch.Tensor  # bool [rows]: visible keys are exactly [lo, hi]
    empty: torch.Tensor  # bool [rows]: provably no visible key
    # int64 [rows]: every key of [lo, dense_hi] is visible (lo - 1: none known). dense_hi == hi on
    # exact rows; a hull row may still start with a dense run, e.g. tree_verify's context before
    # the draft block: only the keys after it need the mask.
    dense_hi: torch.Tensor | None = None


@functools.lru_cache(maxsize=256)
def _scalar_only_conds(form: IntervalForm, spec: VariantSpec) -> tuple[tuple[tuple[Node, ...], Term], ...]:
    """Per term of ``form``: its conditions that read only scalars and constants, and the term
    with the others alone (the same for every plan: decided_terms runs in plan()'s hot path)."""
    scalars = {s.name for s in spec.scalars}
    out = []
    for t in form.terms:
        uniform = tuple(c for c in t.conds if names_used(c) <= scalars)
        out.append((uniform, replace(t, conds=tuple(c for c in t.conds if c not in uniform)) if uniform else t))
    return tuple(out)


def decided_terms(form: IntervalForm, spec: VariantSpec, args: Mapping[str, Any]) -> tuple[Term, ...]:
    """``form``'s terms for one plan's scalar values. A condition that reads only scalars and
    constants holds for every row or for none, so it is decided here, once, on the host: a term
    whose condition fails is dropped, one whose condition holds loses it. The rows then evaluate
    only the terms that can hold: sliding_window's ``window < 0 or q_pos - kv_pos <= window``
    is one interval term for a window >= 0, not a union of two (a union costs the per-row sort
    and merge below). The result is the same as evaluating every term per row."""
    uniform_ev: Evaluator | None = None
    out = []
    for uniform, rest in _scalar_only_conds(form, spec):
        if uniform:
            if uniform_ev is None:  # (a host env: deciding a condition reads nothing back from a GPU)
                uniform_ev = Evaluator(spec, {"vg_uniform": torch.zeros((), dtype=torch.int64)}, args)
            if not all(bool(uniform_ev.ev(c)) for c in uniform):
                continue
        out.append(rest)
    return tuple(out)


class TermBounds(NamedTuple):
    """Per decided term of a form (decided_terms), for every row: its interval [lo, hi] (BIG, -BIG
    where the term shows the row no key), whether it shows the row any key, and whether the
    keys it shows are exactly [lo, hi] (an empty term counts as exact: it contributes nothing)."""

    lo: list[torch.Tensor]
    hi: list[torch.Tensor]
    ok: list[torch.Tensor]
    exact: list[torch.Tensor]


def term_bounds(form: IntervalForm, spec: VariantSpec, env: Mapping[str, torch.Tensor],
                args: Mapping[str, Any]) -> TermBounds:
    """``form``'s decided terms evaluated for rows described by ``env`` (see row_intervals): what
    row_intervals folds into one hull per row, and pieces.py into disjoint intervals."""
    ev = Evaluator(spec, env, args)
    kv_len = env["kv_len"]
    n = kv_len.shape[0]
    dev = kv_len.device
    los, his, oks, exacts = [], [], [], []
    for t in decided_terms(form, spec, args):
        lo = torch.zeros(n, dtype=torch.int64, device=dev)
        hi = kv_len - 1
        ok = torch.ones(n, dtype=torch.bool, device=dev)
        exact = torch.full((n,), t.exact, dtype=torch.bool, device=dev)
        for c in t.conds:
            ok = ok & ev.ev(c).to(torch.bool)
        for x in t.lows:
            lo = torch.maximum(lo, ev.ev(x).to(torch.int64))
        for x in t.highs:
            hi = torch.minimum(hi, ev.ev(x).to(torch.int64))
        for tensor_name, v_node in t.sorted_eqs:
            found_lo, found_hi, sorted_ok = _sorted_match(args[tensor_name], ev.ev(v_node), env)
            exact = exact & sorted_ok  # unsorted requests: no bound, keep the hull
            lo = torch.where(sorted_ok, torch.maximum(lo, found_lo), lo)
            hi = torch.where(sorted_ok, torch.minimum(hi, found_hi), hi)
        for c_node, r_node in t.chunks:
            c = ev.ev(c_node).to(torch.int64)
            r = ev.ev(r_node).to(torch.int64)
            valid = c > 0
            exact &= valid  # c <= 0: floordiv gives 0; not modelled, keep the hull
            lo = torch.where(valid, torch.maximum(lo, r * c), lo)
            hi = torch.where(valid, torch.minimum(hi, r * c + c - 1), hi)
        nonempty = ok & (lo <= hi)
        los.append(torch.where(nonempty, lo, torch.full_like(lo, BIG)))
        his.append(torch.where(nonempty, hi, torch.full_like(hi, -BIG)))
        oks.append(nonempty)
        exacts.append(exact | ~nonempty)  # an empty exact term contributes nothing
    return TermBounds(los, his, oks, exacts)


def row_intervals(form: IntervalForm, spec: VariantSpec, env: Mapping[str, torch.Tensor],
                  args: Mapping[str, Any]) -> RowIntervals:
    """Evaluate ``form`` for rows described by ``env`` (q_pos, q_idx, q_row, q_kv_row,
    request, qo_len, kv_len as int64 tensors of shape [rows])."""
    return fold_terms(term_bounds(form, spec, env, args), env["kv_len"])


def fold_terms(bounds: TermBounds, kv_len: torch.Tensor) -> RowIntervals:
    """Per row, the union of its terms' bounds (``bounds``: term_bounds' answer for rows whose
    kv lengths are ``kv_len``) as one hull, whether it is exact, and its dense run."""
    n = kv_len.shape[0]
    dev = kv_len.device
    los, his, oks, exacts = bounds
    if not los:  # no term can hold: no row sees a key (what the terms' union gives, sooner)
        none = torch.zeros(n, dtype=torch.bool, device=dev)
        lo = torch.zeros(n, dtype=torch.int64, device=dev)
        return RowIntervals(lo=lo, hi=kv_len - 1, exact=none, empty=~none, dense_hi=lo - 1)
    if len(los) == 1:  # one term: its interval is the answer (no union to check)
        any_ok, all_exact = oks[0], exacts[0]
        lo = torch.where(any_ok, los[0], torch.zeros_like(los[0]))
        hi = torch.where(any_ok, his[0], kv_len - 1)
        exact = any_ok & all_exact
        return RowIntervals(lo=lo, hi=hi, exact=exact, empty=~any_ok & all_exact,
                            dense_hi=torch.where(exact, hi, lo - 1))
    lo = torch.stack(los, 1)
    hi = torch.stack(his, 1)
    any_ok = torch.stack(oks, 1).any(1)
    all_exact = torch.stack(exacts, 1).all(1)
    # The union is one interval iff, with terms sorted by lo, each starts at most one past
    # the furthest end so far.
    order = lo.argsort(1)
    lo_s = lo.gather(1, order)
    hi_s = hi.gather(1, order)
    reach = hi_s.cummax(1).values
    gaps = (lo_s[:, 1:] > reach[:, :-1] + 1) & (lo_s[:, 1:] < BIG)
    contiguous = ~gaps.any(1)
    hull_lo = lo_s[:, 0]
    hull_hi = reach[:, -1]
    empty = ~any_ok & all_exact
    out_lo = torch.where(any_ok, hull_lo, torch.zeros_like(hull_lo))
    out_hi = torch.where(any_ok, hull_hi, kv_len - 1)
    # The dense run from the hull's start: exact terms, by their first key, as long as each
    # starts at most one past the run so far (a hull term neither extends nor breaks it). A row
    # whose dense run is its whole hull is exact whatever its other terms (a global token's row).
    dense_s = (torch.stack(exacts, 1) & torch.stack(oks, 1)).gather(1, order)
    dense = out_lo - 1
    for t in range(lo_s.shape[1]):
        joins = dense_s[:, t] & (lo_s[:, t] <= dense + 1)
        dense = torch.where(joins, torch.maximum(dense, hi_s[:, t]), dense)
    exact = any_ok & ((all_exact & contiguous) | (dense >= out_hi))
    dense = torch.where(exact, out_hi, torch.where(any_ok, dense, out_lo - 1))
    return RowIntervals(lo=out_lo, hi=out_hi, exact=exact, empty=empty, dense_hi=dense)
