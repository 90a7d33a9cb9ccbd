"""Equivalent forms of a mask, rewritten into the shapes the interval planner bounds.

intervals.analyze derives key bounds from comparisons linear in ``kv_pos`` with coefficient
+-1 (``q_pos - w <= kv_pos``), the chunk pattern ``kv_pos // c == r`` and sorted-id equalities.
Authors write the same masks in other forms: ``abs(q_pos - kv_pos) <= w``, frame-causal
``kv_pos // f <= q_pos // f``, ``min`` / ``max`` of key terms, ``if`` expressions, ``not``
around comparisons, ``kv_pos - kv_pos % f``, ``2 * kv_pos <= ...``. ``normalize`` rewrites the
mask tree (a copy: the kernel still evaluates the mask as written) into an equivalent tree
whose key-reading comparisons are linear wherever a rewrite exists, so every form plans alike.

Every rewrite is exact for the spec language's integers (evaluate.py: int64, Python-style
floor ``//`` and ``%``, 0 for a zero divisor, negative values allowed):

* ``not`` is pushed inwards (De Morgan; an int order flips, a float one does not: NaN);
* ``x != y`` on ints -> ``x < y or x > y``;
* a comparison is read as ``sum(coef * term) op 0``; row-only terms stay as they are, and the
  one key-reading term is isolated:
  - ``c * t op r`` (c > 0)       -> ``t <= r // c``, ``t >= (r - 1) // c + 1`` ... (floor rules);
  - ``l // f op r`` (f > 0)      -> ``l <= r * f + f - 1``, ``l >= r * f`` ...;
  - ``min`` / ``max`` / ``abs``  -> a conjunction or disjunction of the comparisons of their
    arguments (``abs(e) = max(e, -e)``), an ``if`` expression -> ``(t and ..) or (not t and ..)``;
  - ``l % f`` (f > 0)            -> ``l - f * (l // f)``, kept only where the terms then cancel
    (``kv_pos - kv_pos % f`` is ``f * (kv_pos // f)``);
* a factor or divisor ``f`` not known positive (a constant, or a scalar declared ``positive`` or
  with ``min`` >= 1) guards the rewrite: ``(f > 0 and rewritten) or (f <= 0 and original)``. A
  scalar-only guard is decided once per plan (intervals.decided_terms).

A comparison no rule fits is left as written (the planner keeps a hull for it, as before).
planner_notes.py says, for ``variantgen validate``, where the planner still cannot bound a
mask and what would let it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from ..lang.nodes import Binary, Call, Cond, Const, Index, Name, Node, Type, Unary, names_used
from ..lang.reads import HEAD_NAMES, KEY_NAMES
from ..lang.values import VariantSpec

ORDERS = ("<", "<=", ">", ">=")
FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}  # a op b  <=>  b FLIP[op] a
NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}  # not (a op b), ints
MAX_DEPTH = 32  # nested rewrites of one comparison: each removes a structure; this only stops a pathological tree


def _row_only(node: Node) -> bool:
    return not (names_used(node) & (KEY_NAMES | HEAD_NAMES))


# ----------------------------------------------------------------------------- building nodes


def _c(value: int | bool, pos: int = 0) -> Const:
    return Const(pos=pos, ty=Type.BOOL if isinstance(value, bool) else Type.INT, value=value)


def _arith(op: str, a: Node, b: Node) -> Node:
    return Binary(pos=a.pos, ty=Type.INT, op=op, left=a, right=b)


def _cmp(op: str, a: Node, b: Node, pos: int) -> Node:
    return Binary(pos=pos, ty=Type.BOOL, op=op, left=a, right=b)


def _truth(node: Node) -> bool | None:
    return node.value if isinstance(node, Const) and node.ty is Type.BOOL else None


# The rewrites of nested min / max / if produce branches such as ``q_pos == q_pos``; folding them
# keeps the planner's disjunction small (intervals.MAX_TERMS), so such a form still plans.
def _and(a: Node, b: Node) -> Node:
    ta, tb = _truth(a), _truth(b)
    if ta is False or tb is False:
        return _c(False, a.pos)
    if ta is True or tb is True:
        return b if ta is True else a
    return Binary(pos=a.pos, ty=Type.BOOL, op="and", left=a, right=b)


def _or(a: Node, b: Node) -> Node:
    ta, tb = _truth(a), _truth(b)
    if ta is True or tb is True:
        return _c(True, a.pos)
    if ta is False or tb is False:
        return b if ta is False else a
    return Binary(pos=a.pos, ty=Type.BOOL, op="or", left=a, right=b)


def _not(a: Node) -> Node:
    t = _truth(a)
    return _c(not t, a.pos) if t is not None else Unary(pos=a.pos, ty=Type.BOOL, op="not", operand=a)


def _fold(node: Node) -> Node:
    """An int comparison whose two sides are the same sum (``q_pos == q_pos``, ``x + 1 <= 1 + x``)
    as its constant truth; anything else unchanged. Exact: equal int expressions are equal values,
    wrapping included."""
    if (isinstance(node, Binary) and node.op in FLIP and node.left.ty is Type.INT
            and node.right.ty is Type.INT and not _difference(node.left, node.right)):
        return _c(node.op in ("==", "<=", ">="), node.pos)
    return node


# ----------------------------------------------------------------------------- linear sums

Terms = list[tuple[int, Node]]  # sum of coef * node


def _flatten(node: Node, coef: int, out: Terms) -> None:
    """``coef * node`` as a sum of (coef, term), through + - unary minus and constant factors."""
    if isinstance(node, Binary) and node.op in ("+", "-") and node.ty is Type.INT:
        _flatten(node.left, coef, out)
        _flatten(node.right, coef if node.op == "+" else -coef, out)
    elif isinstance(node, Unary) and node.op in ("+", "-") and node.ty is Type.INT:
        _flatten(node.operand, coef if node.op == "+" else -coef, out)
    elif isinstance(node, Binary) and node.op == "*" and node.ty is Type.INT and _const(node.left) is not None:
        _flatten(node.right, coef * _const(node.left), out)
    elif isinstance(node, Binary) and node.op == "*" and node.ty is Type.INT and _const(node.right) is not None:
        _flatten(node.left, coef * _const(node.right), out)
    elif isinstance(node, Binary) and node.op == "//" and node.ty is Type.INT and _const(node.right) == 1:
        _flatten(node.left, coef, out)  # x // 1 is x
    elif isinstance(node, Binary) and node.op == "%" and node.ty is Type.INT and _const(node.right) in (1, -1):
        pass  # x % 1 is 0
    elif isinstance(node, Const) and node.value == 0:
        pass
    elif isinstance(node, Cond) and node.ty is Type.INT and node.then == node.orelse:
        _flatten(node.then, coef, out)  # (x if t else x) is x
    else:
        out.append((coef, node))


def _const(node: Node) -> int | None:
    if isinstance(node, Const) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    return None


def _merge(terms: Terms) -> Terms:
    """Equal terms (trees compare without positions) summed; zero coefficients dropped."""
    out: Terms = []
    for coef, node in terms:
        for i, (c, n) in enumerate(out):
            if n == node:
                out[i] = (c + coef, n)
                break
        else:
            out.append((coef, node))
    return [(c, n) for c, n in out if c != 0]


def _common_factor_out(terms: Terms) -> Terms:
    """``sum op 0`` with every coefficient (and the constant) divided by their common factor g > 1:
    ``3 * a <= 3 * b`` is ``a <= b`` (g > 0 keeps the order)."""
    constant = sum(c * _const(t) for c, t in terms if _const(t) is not None)
    factors = [abs(c) for c, t in terms if _const(t) is None] + ([abs(constant)] if constant else [])
    g = functools.reduce(math.gcd, factors, 0)
    if g <= 1:
        return terms
    out: Terms = [(c // g, t) for c, t in terms if _const(t) is None]
    return out + ([(constant // g, _c(1, 0))] if constant else [])


def _sum(terms: Terms, pos: int) -> Node:
    node: Node | None = None
    for coef, t in terms:
        mag = abs(coef)
        part = t if mag == 1 else _arith("*", _c(mag, pos), t)
        if node is None:
            node = part if coef > 0 else Unary(pos=pos, ty=Type.INT, op="-", operand=part)
        else:
            node = _arith("+" if coef > 0 else "-", node, part)
    return node if node is not None else _c(0, pos)


# ----------------------------------------------------------------------------- the rewriter


@dataclass
class Rewriter:
    positive: frozenset[str]  # int scalars known > 0
    assume_positive: bool = False  # planner_notes: what the mask would plan as with every divisor > 0
    guards: list[Node] | None = None  # divisors the rewrites assumed positive (planner_notes)
    depth: int = 0

    def known_positive(self, f: Node) -> bool:
        v = _const(f)
        if v is not None:
            return v > 0
        return isinstance(f, Name) and f.id in self.positive

    def guarded(self, f: Node, rewritten: Node, original: Node) -> Node:
        if self.known_positive(f):
            return rewritten
        if self.guards is not None:
            self.guards.append(f)
        if self.assume_positive:
            return rewritten
        pos = original.pos
        return _or(_and(_cmp(">", f, _c(0, pos), pos), rewritten), _and(_cmp("<=", f, _c(0, pos), pos), original))

    # -- boolean structure
    def boolean(self, node: Node, negate: bool = False) -> Node:
        if _row_only(node):
            node = _fold(node)
            return _not(node) if negate else node
        if isinstance(node, Unary) and node.op == "not":
            return self.boolean(node.operand, not negate)
        if isinstance(node, Binary) and node.op == "and" and not negate:
            eq = _equality(node.left, node.right)
            if eq is not None:  # x <= y and x >= y: x == y (a sorted-id match stays one)
                return self.boolean(eq)
        if isinstance(node, Binary) and node.op in ("and", "or"):
            op = node.op if not negate else ("or" if node.op == "and" else "and")
            left, right = self.boolean(node.left, negate), self.boolean(node.right, negate)
            if op == "and":  # (the orders may only show once rewritten: min(a, b) == b is b <= a)
                eq = _equality(left, right)
                if eq is not None:
                    return self.boolean(eq)
            return _and(left, right) if op == "and" else _or(left, right)
        if isinstance(node, Cond) and node.ty is Type.BOOL:
            if node.then == node.orelse:  # (p if t else p) is p
                return self.boolean(node.then, negate)
            return _or(_and(self.boolean(node.test), self.boolean(node.then, negate)),
                       _and(self.boolean(node.test, True), self.boolean(node.orelse, negate)))
        if isinstance(node, Binary) and node.op in FLIP and node.left.ty is Type.INT and node.right.ty is Type.INT:
            cmp = replace(node, op=NEGATE[node.op] if negate else node.op, left=_plain(node.left),
                          right=_plain(node.right))
            found = self.compare(cmp)
            return cmp if found is None else found
        return _not(node) if negate else node  # a float order, bit(), a bool tensor ...: as written

    # -- one int comparison
    def compare(self, node: Binary) -> Node | None:
        """An equivalent of the int comparison ``node`` the planner bounds; None: none found
        (or ``node`` is already one)."""
        if self.depth >= MAX_DEPTH or _row_only(node):
            return None
        self.depth += 1
        try:
            return self._compare(node)
        finally:
            self.depth -= 1

    def _compare(self, node: Binary) -> Node | None:
        op, pos = node.op, node.pos
        if op == "!=":
            lt, gt = replace(node, op="<"), replace(node, op=">")
            parts = [self.compare(lt), self.compare(gt)]
            if any(p is None and not _is_linear_as_written(c) for p, c in zip(parts, (lt, gt))):
                return None  # nothing bounds either half (t[kv_row] != 0): one hull atom, as written
            return _or(parts[0] or lt, parts[1] or gt)
        if op == "==" and _is_chunk(node):
            return None  # kv_pos // c == r: intervals' chunk pattern
        merged = _difference(node.left, node.right)
        terms = _common_factor_out(merged)
        scaled = terms != merged  # (then the comparison is rewritten even where isolate finds nothing more)
        key = [(c, t) for c, t in terms if not _row_only(t)]
        rest = [(c, t) for c, t in terms if _row_only(t)]
        if not key:  # the key cancelled out: a row condition
            return _fold(_cmp(op, _sum(rest, pos), _c(0, pos), pos))
        if len(key) > 1:
            return self.picks(node, terms) or self.expand_modulo(node, terms) or self.lift(node, terms)
        picked = self.picks(node, terms)  # min(t, r) == r: one order, not the if expression isolate makes
        if picked is not None:
            return picked
        coef, t = key[0]
        if coef < 0:  # c * t + rest op 0  <=>  |c| * t FLIP(op) rest
            coef, op, bound = -coef, FLIP[op], _sum(rest, pos)
        else:
            bound = _sum([(-c, n) for c, n in rest], pos)
        if isinstance(t, Name) and t.id == "kv_pos":
            if coef == 1:
                return None if _is_linear_as_written(node) and not scaled else _cmp(op, t, bound, pos)
            return self.isolate_product(_c(coef, pos), t, op, bound, node)
        if coef != 1:
            return self.isolate_product(_c(coef, pos), t, op, bound, node)
        if isinstance(t, Index) and op == "==":  # t[kv_row] == v: the sorted-id pattern, as intervals.py reads it
            return None if node.left == t and _row_only(node.right) else _cmp(op, t, bound, pos)
        found = self.isolate(t, op, bound, node)
        return _cmp(op, t, bound, pos) if found is None and scaled else found

    def isolate(self, t: Node, op: str, bound: Node, original: Node) -> Node | None:
        """``t op bound``, t the one key-reading term, bound row-only."""
        pos = original.pos
        if isinstance(t, Binary) and t.op == "*" and t.ty is Type.INT:
            for f, x in ((t.left, t.right), (t.right, t.left)):
                if _row_only(f) and not _row_only(x):
                    return self.isolate_product(f, x, op, bound, original)
            return None
        if isinstance(t, Binary) and t.op == "//" and t.ty is Type.INT and _row_only(t.right):
            return self.isolate_floor(t.left, t.right, op, bound, original)
        if (isinstance(t, Call) and t.ty is Type.INT and t.func == "abs"
                and (op, _const(bound)) in (("<=", 0), ("<", 1))):  # abs(e) <= 0: e == 0 (a sorted-id match stays one)
            return self.sub(_cmp("==", t.args[0], _c(0, pos), pos))
        if isinstance(t, Call) and t.ty is Type.INT and t.func in ("min", "max", "abs"):
            args = (t.args[0], Unary(pos=pos, ty=Type.INT, op="-", operand=t.args[0])) if t.func == "abs" else t.args
            is_min = t.func == "min"
            if op in ORDERS:  # min(a, b) <= r  <=>  a <= r or b <= r; max(a, b) <= r  <=>  a <= r and b <= r
                parts = [self.sub(_cmp(op, a, bound, pos)) for a in args]
                join = _or if (is_min == (op in ("<", "<="))) else _and
                return functools.reduce(join, parts)
            # ==: the argument min / max picks, as an if expression
            return self.isolate(_pick(t.func, args, pos), op, bound, original)
        if isinstance(t, Cond) and t.ty is Type.INT:
            if t.then == t.orelse:
                return self.sub(_cmp(op, t.then, bound, pos))
            return _or(_and(self.boolean(t.test), self.sub(_cmp(op, t.then, bound, pos))),
                       _and(self.boolean(t.test, True), self.sub(_cmp(op, t.orelse, bound, pos))))
        return None

    def sub(self, cmp: Node) -> Node:
        return self.compare(cmp) or _fold(cmp)

    def isolate_product(self, f: Node, x: Node, op: str, r: Node, original: Node) -> Node:
        """``f * x op r`` for f > 0 as a comparison of x (floor rules)."""
        pos = original.pos
        one = _c(1, pos)
        if op == "<=":  # f x <= r  <=>  x <= r // f
            new = _cmp("<=", x, _arith("//", r, f), pos)
        elif op == "<":  # f x <= r - 1
            new = _cmp("<=", x, _arith("//", _arith("-", r, one), f), pos)
        elif op == ">":  # not (f x <= r)
            new = _cmp(">", x, _arith("//", r, f), pos)
        elif op == ">=":  # not (f x <= r - 1)
            new = _cmp(">", x, _arith("//", _arith("-", r, one), f), pos)
        else:  # ==: r a multiple of f
            new = _and(_cmp("==", _arith("%", r, f), _c(0, pos), pos), _cmp("==", x, _arith("//", r, f), pos))
        return self.guarded(f, self.boolean(new), original)

    def isolate_floor(self, x: Node, f: Node, op: str, r: Node, original: Node) -> Node:
        """``x // f op r`` for f > 0 as a comparison of x: x // f <= r <=> x <= r f + f - 1."""
        pos = original.pos
        lo = _arith("*", r, f)  # the first x with x // f == r
        hi = _arith("-", _arith("+", lo, f), _c(1, pos))  # the last
        new = {"<=": lambda: _cmp("<=", x, hi, pos), "<": lambda: _cmp("<", x, lo, pos),
               ">=": lambda: _cmp(">=", x, lo, pos), ">": lambda: _cmp(">", x, hi, pos),
               "==": lambda: _and(_cmp(">=", x, lo, pos), _cmp("<=", x, hi, pos))}[op]()
        return self.guarded(f, self.boolean(new), original)

    def picks(self, node: Binary, terms: Terms) -> Node | None:
        """``min(a, b) == a`` <=> ``a <= b``, ``max(a, b) == a`` <=> ``a >= b``, ``abs(e) == e`` <=>
        ``e >= 0`` (abs(e) = max(e, -e)): a min / max equal to one of its arguments."""
        if node.op != "==":
            return None
        pos = node.pos
        for c, t in terms:
            if not (abs(c) == 1 and isinstance(t, Call) and t.ty is Type.INT and t.func in ("min", "max", "abs")):
                continue
            args = (t.args[0], Unary(pos=pos, ty=Type.INT, op="-", operand=t.args[0])) if t.func == "abs" else t.args
            others: Terms = [(k, n) for k, n in terms if n != t]
            for i, a in enumerate(args):
                diff: Terms = list(others)
                _flatten(a, c, diff)
                if _merge(diff):
                    continue  # t is not compared with this argument
                op = "<=" if t.func == "min" else ">="
                parts = [self.sub(_cmp(op, a, b, pos)) for j, b in enumerate(args) if j != i]
                return functools.reduce(_and, parts)
        return None

    def expand_modulo(self, node: Binary, terms: Terms) -> Node | None:
        """``l % f`` -> ``l - f * (l // f)`` (f > 0) where the key terms then cancel to one."""
        mods = [t for _, t in terms if isinstance(t, Binary) and t.op == "%" and t.ty is Type.INT
                and _row_only(t.right) and not _row_only(t.left)]
        if not mods:
            return None
        m = mods[0]
        expanded: Terms = []
        for c, t in terms:
            if t == m:
                _flatten(t.left, c, expanded)
                expanded.append((-c, _arith("*", m.right, _arith("//", m.left, m.right))))
            else:
                expanded.append((c, t))
        expanded = _merge(expanded)
        if sum(1 for _, t in expanded if not _row_only(t)) >= sum(1 for _, t in terms if not _row_only(t)):
            return None  # nothing cancelled: the expansion only adds terms
        pos = node.pos
        new = _cmp(node.op, _sum(expanded, pos), _c(0, pos), pos)
        return self.guarded(m.right, self.sub(new), node)

    def lift(self, node: Binary, terms: Terms) -> Node | None:
        """Several key terms: the first key-reading min / max / abs / if among them becomes an
        if expression whose branches are compared separately."""
        for t in (n for _, term in terms for n in _arith_nodes(term)):
            if _row_only(t):
                continue
            if isinstance(t, Call) and t.ty is Type.INT and t.func in ("min", "max", "abs"):
                args = (t.args[0], Unary(pos=t.pos, ty=Type.INT, op="-", operand=t.args[0])) \
                    if t.func == "abs" else t.args
                cond = _pick(t.func, args, t.pos)
            elif isinstance(t, Cond) and t.ty is Type.INT:
                cond = t
            else:
                continue
            if cond.then == cond.orelse:  # (x if t else x) is x
                return self.sub(_replace(node, t, cond.then))
            then = _replace(node, t, cond.then)
            orelse = _replace(node, t, cond.orelse)
            return _or(_and(self.boolean(cond.test), self.sub(then)),
                       _and(self.boolean(cond.test, True), self.sub(orelse)))
        return None


def _equality(a: Node, b: Node) -> Node | None:
    """``x == y`` where ``a and b`` says x <= y and x >= y (ints), else None."""
    def difference(x: Node, y: Node) -> tuple[Node, Node]:  # x <= y, with x - y <= 0 read as x <= y
        if isinstance(y, Const) and y.value == 0 and isinstance(x, Binary) and x.op == "-":
            return x.left, x.right
        if isinstance(x, Const) and x.value == 0 and isinstance(y, Binary) and y.op == "-":
            return y.right, y.left  # (0 <= a - b: b <= a)
        return x, y

    def upper(n: Node) -> tuple[Node, Node] | None:  # (x, y) with n meaning x <= y
        if isinstance(n, Binary) and n.left.ty is Type.INT and n.right.ty is Type.INT:
            if n.op == "<=":
                return difference(n.left, n.right)
            if n.op == ">=":
                return difference(n.right, n.left)
        return None
    ua, ub = upper(a), upper(b)
    if ua is None or ub is None or ua != (ub[1], ub[0]):
        return None
    return _cmp("==", ua[0], ua[1], a.pos)


def _plain(node: Node) -> Node:
    """An int expression with every ``(x if t else x)`` in its arithmetic read as x: the test
    reads nothing the comparison needs (a row-only test would make a key test read the row)."""
    if isinstance(node, Cond) and node.ty is Type.INT and node.then == node.orelse:
        return _plain(node.then)
    if isinstance(node, Binary) and node.ty is Type.INT and node.op in ("+", "-", "*", "//", "%"):
        return replace(node, left=_plain(node.left), right=_plain(node.right))
    if isinstance(node, Unary) and node.ty is Type.INT:
        return replace(node, operand=_plain(node.operand))
    return node


def _pick(func: str, args: tuple[Node, ...], pos: int) -> Node:
    """min / max of ints (abs: max(e, -e)) as nested if expressions."""
    if len(args) == 1:
        return args[0]
    rest = _pick(func, args[1:], pos)
    test = _cmp("<=" if func == "min" else ">=", args[0], rest, pos)
    return Cond(pos=pos, ty=Type.INT, test=test, then=args[0], orelse=rest)


def _arith_nodes(node: Node):
    """``node`` and the int nodes under it through arithmetic (not into calls or indices)."""
    yield node
    if isinstance(node, Binary) and node.op in ("+", "-", "*", "//", "%"):
        yield from _arith_nodes(node.left)
        yield from _arith_nodes(node.right)
    elif isinstance(node, Unary) and node.op in "+-":
        yield from _arith_nodes(node.operand)


def _replace(node: Node, old: Node, new: Node) -> Node:
    if node == old:
        return new
    if isinstance(node, Binary):
        return replace(node, left=_replace(node.left, old, new), right=_replace(node.right, old, new))
    if isinstance(node, Unary):
        return replace(node, operand=_replace(node.operand, old, new))
    return node  # (only the arithmetic _arith_nodes walks holds the terms)


def _is_chunk(node: Binary) -> bool:
    for a, b in ((node.left, node.right), (node.right, node.left)):
        if (isinstance(a, Binary) and a.op == "//" and isinstance(a.left, Name) and a.left.id == "kv_pos"
                and _row_only(a.right) and _row_only(b) and b.ty is Type.INT):
            return True
    return False


def _is_linear_as_written(node: Binary) -> bool:
    """The comparison intervals.py bounds as written: kv_pos reached through + - only."""
    def linear(n: Node) -> bool:
        if _row_only(n):
            return True
        if isinstance(n, Name):
            return n.id == "kv_pos"
        if isinstance(n, Unary) and n.op in "+-":
            return linear(n.operand)
        return isinstance(n, Binary) and n.op in ("+", "-") and linear(n.left) and linear(n.right)
    return linear(node.left) and linear(node.right)


def _difference(a: Node, b: Node) -> Terms:
    """``a - b`` as a sum of terms, equal terms summed (empty: the same sum)."""
    terms: Terms = []
    _flatten(a, 1, terms)
    _flatten(b, -1, terms)
    return _merge(terms)


def constant_difference(a: Node, b: Node) -> int | None:
    """``a - b`` where it is a constant (``(q_pos + 1) - q_pos`` is 1), else None."""
    total = 0
    for coef, node in _difference(a, b):
        value = _const(node)
        if value is None:
            return None
        total += coef * value
    return total


def positive_scalars(spec: VariantSpec) -> frozenset[str]:
    return frozenset(s.name for s in spec.scalars
                     if s.dtype == "int" and (s.positive or (s.minimum is not None and s.minimum >= 1)))


def normalize(node: Node, spec: VariantSpec) -> Node:
    """``node`` (a mask of ``spec``) rewritten into the forms the interval planner bounds."""
    return Rewriter(positive_scalars(spec)).boolean(node)
