"""Typed expressions of spec files: the builtins table, index kinds and the type checker.

Every name must be a built-in, a declared scalar or a declared tensor; the checked tree is
what code generation, the torch reference and the interval analysis walk. Nothing from the
source text reaches generated C++ except through that tree. (parsing.py parses the text into
nodes.py's tree; ``parse_typed`` does both steps.)

Indices are checked by kind: a symbolic dimension (``total_kv`` ...) takes only its row
builtin (``kv_row`` ...), optionally offset by terms that are the same for every row of the
request (``kv_row - 1``); see docs/spec-reference.md and ``row_index``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Any

from ..core.errors import SpecError, SpecErrors
from .nodes import (
    BOOL_OPS,
    CMP_OPS,
    INT32_MAX,
    INT32_MIN,
    Binary,
    Call,
    Cond,
    Const,
    Index,
    Name,
    Node,
    Type,
    Unary,
    constant_int,
    names_used,
    to_source,
)
from .parsing import SourceText, parse, shorten

# ----------------------------------------------------------------------------- typing


@dataclass(frozen=True)
class TensorSig:
    """What the type checker needs to know about a declared tensor."""

    name: str
    shape: tuple[str | int, ...]  # symbolic dimension names (DIMS) and fixed sizes
    elem: Type  # INT or FLOAT

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Builtin:
    name: str
    ty: Type
    doc: str


BUILTINS: dict[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("q_pos", Type.INT, "absolute position of the query within its request (kv_len - qo_len + q_idx)"),
        Builtin("kv_pos", Type.INT, "absolute position of the key within its request"),
        Builtin("q_idx", Type.INT, "index of the query among the request's new tokens (0 .. qo_len-1)"),
        Builtin("q_row", Type.INT, "global query row in the batch: indexes [total_q, ...] tensors"),
        Builtin("kv_row", Type.INT,
                "global key row in the batch (requests back to back): indexes [total_kv, ...] tensors"),
        Builtin("q_kv_row", Type.INT, "global key row of the query's own token: indexes [total_kv, ...] tensors"),
        Builtin("request", Type.INT, "index of the request in the batch: indexes [batch, ...] tensors"),
        Builtin("qo_head", Type.INT, "query head index: indexes [num_qo_heads] tensors"),
        Builtin("kv_head", Type.INT, "key/value head index: indexes [num_kv_heads] tensors"),
        Builtin("qo_len", Type.INT, "number of new query tokens of the request"),
        Builtin("kv_len", Type.INT, "number of key tokens of the request (cached + new)"),
    )
}
LOGITS = Builtin("logits", Type.FLOAT, "the scaled score sm_scale * (q . k), in logits transforms only")
# What a learned attention sink may read: it joins the softmax of every query row of one head
# as one more logit (with no value), so it cannot depend on the query's or the key's token.
SINK_BUILTINS = frozenset({"qo_head", "kv_head", "request", "qo_len", "kv_len"})

# name -> (min args, max args)
FUNCTIONS: dict[str, tuple[int, int]] = {
    "min": (2, 8),
    "max": (2, 8),
    "abs": (1, 1),
    "float": (1, 1),
    "tanh": (1, 1),
    "exp": (1, 1),
    "log": (1, 1),
    "sqrt": (1, 1),
    "sigmoid": (1, 1),
    "bit": (2, 2),
}
FLOAT_FUNCS = ("tanh", "exp", "log", "sqrt", "sigmoid")
# bit(x, i): whether bit i of the int x (32-bit two's complement, bit 0 the lowest) is set;
# false for i outside 0..31 (never a shift by a negative or too large count).
BIT_WIDTH = 32


# ----------------------------------------------------------------------------- index kinds


@dataclass(frozen=True)
class Dim:
    """A symbolic tensor dimension: what its rows are and which builtins index them (their *kind*)."""

    name: str
    per: str  # "per query token": what one row of the tensor belongs to
    rows: str  # how its rows are laid out
    builtins: tuple[str, ...]


DIMS: dict[str, Dim] = {
    d.name: d
    for d in (
        Dim("total_q", "per query token", "one row per query token, in the order of q", ("q_row",)),
        Dim("total_kv", "per key token", "one row per key token, requests back to back", ("kv_row", "q_kv_row")),
        Dim("batch", "per request", "one row per request", ("request",)),
        Dim("num_qo_heads", "per query head", "one row per query head", ("qo_head",)),
        Dim("num_kv_heads", "per key/value head", "one row per key/value head", ("kv_head",)),
    )
}
# The dimensions whose extent is the batch's: only a tensor's first dimension may be one.
BATCH_SIZED = ("total_q", "total_kv", "batch")
# Row builtin -> the dimension it indexes.
INDEX_KINDS: dict[str, str] = {b: d.name for d in DIMS.values() for b in d.builtins}
# Row builtins of a request's rows: (the row's position within the request, the request's row
# count). An offset row is clamped to the request's rows: first + clamp(position + offset, count).
REQUEST_ROWS: dict[str, tuple[str, str]] = {
    "q_row": ("q_idx", "qo_len"), "kv_row": ("kv_pos", "kv_len"), "q_kv_row": ("q_pos", "kv_len")}
# Request-local positions and the row builtin that places each in the batch.
POSITION_ROWS: dict[str, str] = {"q_idx": "q_row", "kv_pos": "kv_row", "q_pos": "q_kv_row"}
# Builtins that differ from one query, key or head to the next: an offset may not read them.
PER_TOKEN = frozenset(POSITION_ROWS) | (frozenset(INDEX_KINDS) - {"request"})


@dataclass(frozen=True)
class RowIndex:
    """An index of a symbolic dimension: a row builtin plus signed offset terms, e.g.
    ``kv_row - 1`` is RowIndex("kv_row", ((-1, Const(1)),))."""

    builtin: str
    offsets: tuple[tuple[int, Node], ...] = ()

    @property
    def kind(self) -> str:
        return INDEX_KINDS[self.builtin]


def row_index(node: Node) -> RowIndex | None:
    """``node`` as a row builtin offset by added or subtracted terms; None if it is not of that
    form. Purely structural: the type checker decides whether the offsets are allowed, codegen
    and the reference read checked trees through this same function."""
    if isinstance(node, Name):
        return RowIndex(node.id) if node.id in INDEX_KINDS else None
    if isinstance(node, Unary) and node.op == "+":
        return row_index(node.operand)
    if isinstance(node, Binary) and node.op in ("+", "-"):
        left = row_index(node.left)
        if left is not None:
            return replace(left, offsets=left.offsets + ((1 if node.op == "+" else -1, node.right),))
        right = row_index(node.right) if node.op == "+" else None
        if right is not None:
            return replace(right, offsets=((1, node.left),) + right.offsets)
    return None


def _direct_names(node: Node) -> set[str]:
    """Names ``node`` computes with, not counting those only inside a tensor's index."""
    out: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Name):
            out.add(n.id)
        elif not isinstance(n, Index):
            stack.extend(n.children())
    return out


def _shown_expr(node: Node) -> str:
    text = to_source(node)
    return text[1:-1] if isinstance(node, (Binary, Unary, Cond)) and text.startswith("(") else text


@dataclass(frozen=True)
class TypeEnv:
    scalars: dict[str, Type]
    tensors: dict[str, TensorSig]
    allow_logits: bool = False
    # Names whose declaration was refused: their uses raise FollowOnError (already reported).
    failed: frozenset[str] = frozenset()
    # Checking a `sink`: only the builtins of SINK_BUILTINS (one value per query head and request).
    sink: bool = False

    def known_names(self) -> list[str]:
        names = [b for b in BUILTINS if not self.sink or b in SINK_BUILTINS] + list(self.scalars) + list(self.tensors)
        if self.allow_logits:
            names.append(LOGITS.name)
        return names


class FollowOnError(SpecError):
    """A use of a name whose declaration was refused: the declaration's error says it all,
    so spec loading drops this one instead of reporting the same mistake twice."""


def _listed(names: list[str], limit: int = 30) -> str:
    """Names for a message ("a, b, c"), the first ``limit`` of them and a count of the rest."""
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more or "(none)"


def _suggest(name: str, candidates: list[str]) -> str | None:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


class _Poison:
    """The type of a subexpression with an error: whatever contains it takes this type too and
    is not checked further, so one error does not cascade into follow-ups ('and' of an unknown
    name is not also "'and' needs bool operands"); independent subexpressions still are."""

    def __repr__(self) -> str:
        return "POISON"


POISON: Any = _Poison()


class ExprErrors(SpecErrors):
    """Several independent errors of one expression (each a located SpecError)."""


class _Checker:
    def __init__(self, src: SourceText, env: TypeEnv):
        self.src = src
        self.env = env
        self.errors: list[SpecError] = []  # follow-ons included (the loader drops those)

    @staticmethod
    def poisoned(*nodes: Node) -> bool:
        return any(n.ty is POISON for n in nodes)

    def err(self, node: Node, message: str, hint: str | None = None) -> SpecError:
        return self.src.error(node.pos, message, hint)

    def follow_on(self, node: Node, name: str) -> FollowOnError:
        line, col = self.src.line_text(node.pos)
        return FollowOnError(f"`{name}` is used but its declaration has errors", self.src.locate(node.pos),
                             field=self.src.field, source_line=line, caret_col=col)

    def check(self, node: Node) -> Node:
        """``node`` typed; an error is recorded and poisons the node (see _Poison)."""
        method = getattr(self, "_" + type(node).__name__.lower())
        try:
            typed = method(node)
            if typed.ty is Type.INT and not isinstance(typed, Const):
                value = constant_int(typed)
                if value is not None and not INT32_MIN <= value <= INT32_MAX:
                    raise self.err(typed, f"`{shorten(to_source(typed), 60)}` is {value}, outside the 32-bit int "
                                   "range (the kernel would wrap it)")
        except SpecError as e:
            self.errors.append(e)
            return replace(node, ty=POISON)
        return typed

    def _const(self, node: Const) -> Node:
        v = node.value
        ty = Type.BOOL if isinstance(v, bool) else Type.INT if isinstance(v, int) else Type.FLOAT
        if ty is Type.INT and not (INT32_MIN <= v <= INT32_MAX):
            raise self.err(node, f"integer {v} does not fit in 32 bits")
        return replace(node, ty=ty)

    def _name(self, node: Name) -> Node:
        if node.id in BUILTINS:
            if self.env.sink and node.id not in SINK_BUILTINS:
                raise self.err(node, f"`{node.id}` is not available in a sink: the sink is one logit per query head "
                               "(and request), shared by all its query rows and keys",
                               f"a sink may read {', '.join(sorted(SINK_BUILTINS))}, scalars and tensors indexed by "
                               "them, e.g. sinks[qo_head]")
            return replace(node, ty=BUILTINS[node.id].ty)
        if node.id in self.env.scalars:
            return replace(node, ty=self.env.scalars[node.id])
        if node.id == LOGITS.name:
            if self.env.allow_logits:
                return replace(node, ty=Type.FLOAT)
            where = "a sink (a logit of its own)" if self.env.sink else "a mask"
            raise self.err(node, f"`logits` is only available in the `logits` transform, not in {where}")
        if node.id in self.env.tensors:
            sig = self.env.tensors[node.id]
            idx = ", ".join(["i"] * sig.ndim)
            raise self.err(node, f"tensor `{node.id}` must be indexed, e.g. {node.id}[{idx}]")
        if node.id in FUNCTIONS:
            raise self.err(node, f"`{node.id}` is a function: call it, e.g. {node.id}(...)")
        if node.id in self.env.failed:
            raise self.follow_on(node, node.id)
        raise self.err(
            node,
            f"unknown name `{shorten(node.id)}`; known names: {_listed(self.env.known_names())}",
            _suggest(node.id, self.env.known_names()),
        )

    def _index(self, node: Index) -> Node:
        # The indices first: their errors are independent of the tensor's.
        indices = tuple(self.check(i) for i in node.indices)
        sig = self.env.tensors.get(node.tensor)
        if sig is None:
            if node.tensor in self.env.failed:
                raise self.follow_on(node, node.tensor)
            what = "a scalar" if node.tensor in self.env.scalars or node.tensor in BUILTINS else "not a declared tensor"
            raise self.err(
                node,
                f"`{shorten(node.tensor)}` is {what} and cannot be indexed; declared tensors: "
                f"{_listed(list(self.env.tensors))}",
                _suggest(node.tensor, list(self.env.tensors)),
            )
        if len(node.indices) != sig.ndim:
            raise self.err(
                node,
                f"tensor `{node.tensor}` has {sig.ndim} dimension(s) but is indexed with {len(node.indices)}",
            )
        if self.poisoned(*indices):
            return replace(node, indices=indices, ty=POISON)
        for i in indices:
            if i.ty is not Type.INT:
                raise self.err(i, f"index of `{node.tensor}` must be an int, got {i.ty}")
        for k, (dim, i) in enumerate(zip(sig.shape, indices)):
            if isinstance(dim, str):  # fixed sizes take any int (clamped to the size)
                self._check_row_index(sig, k, DIMS[dim], i)
        return replace(node, indices=indices, ty=sig.elem)

    def _check_row_index(self, sig: TensorSig, k: int, dim: Dim, index: Node) -> None:
        """A symbolic dimension takes only an index of its kind: its row builtin, optionally
        offset by terms that are the same for every row of the request."""
        t = sig.name
        of = f"`{t}`" if sig.ndim == 1 else f"dimension {k} of `{t}`"
        use = " or ".join(dim.builtins)
        fix = f"`{t}` is {dim.per}: index it with {use}"
        shown = _shown_expr(index)
        ref = row_index(index)
        if ref is None:
            kinded = sorted(_direct_names(index) & set(INDEX_KINDS))
            if kinded:
                raise self.err(index, f"`{shown}` is not a row of {of} ({dim.name}): it computes with the row "
                               f"index `{kinded[0]}`, and only adding or subtracting an offset keeps an index a row",
                               f"{fix}, or {dim.builtins[0]} + k / {dim.builtins[0]} - k with k the same for every "
                               "row of the request")
            positions = sorted(_direct_names(index) & set(POSITION_ROWS))
            if positions:
                pos, row = positions[0], POSITION_ROWS[positions[0]]
                hint = (f"`{t}` is {dim.per}: index it with {row} (the row of {pos} in the batch)"
                        if row in dim.builtins else fix)
                raise self.err(index, f"`{pos}` is a position within its request, but {of} has {dim.name} rows "
                               f"({dim.rows}): it would read the first request's rows for every request", hint)
            raise self.err(index, f"{of} has {dim.name} rows ({dim.rows}); `{shown}` is not a row index", fix)
        for _, term in ref.offsets:
            others = sorted(_direct_names(term) & set(INDEX_KINDS))
            if others:
                raise self.err(index, f"`{shown}` combines the row indices `{ref.builtin}` and `{others[0]}`, which "
                               "makes no row of any tensor", fix)
        if ref.kind != dim.name:
            other = DIMS[ref.kind]
            raise self.err(index, f"{of} has {dim.name} rows ({dim.rows}), but `{ref.builtin}` indexes "
                           f"{other.name} rows ({other.rows})", fix)
        if ref.offsets and dim.name == "batch":
            raise self.err(index, f"`{shown}` would read another request's row of `{t}`: a query sees only its "
                           "own request's values", f"index `{t}` with request itself")
        for _, term in ref.offsets:
            moving = sorted(names_used(term) & PER_TOKEN)
            if moving:
                raise self.err(term, f"the offset `{_shown_expr(term)}` of `{ref.builtin}` reads `{moving[0]}`, "
                               "which changes from row to row; an offset must be the same for every row of the "
                               "request", "offset by ints, scalars, qo_len, kv_len or tensors indexed by request")

    def _unary(self, node: Unary) -> Node:
        operand = self.check(node.operand)
        if self.poisoned(operand):
            return replace(node, operand=operand, ty=POISON)
        if node.op == "not":
            if operand.ty is not Type.BOOL:
                raise self.err(node, f"'not' needs a bool, got {operand.ty}", "compare first, e.g. `not (x > 0)`")
            return replace(node, operand=operand, ty=Type.BOOL)
        if operand.ty is Type.BOOL:
            raise self.err(node, f"unary '{node.op}' needs a number, got bool")
        return replace(node, operand=operand, ty=operand.ty)

    def _binary(self, node: Binary) -> Node:
        left, right = self.check(node.left), self.check(node.right)
        if self.poisoned(left, right):
            return replace(node, left=left, right=right, ty=POISON)
        op = node.op
        if op in BOOL_OPS:
            for side in (left, right):
                if side.ty is not Type.BOOL:
                    raise self.err(side, f"'{op}' needs bool operands, got {side.ty}",
                                   "compare the number first, e.g. `x != 0`")
            return replace(node, left=left, right=right, ty=Type.BOOL)
        if op in CMP_OPS:
            if op in ("==", "!=") and left.ty is Type.BOOL and right.ty is Type.BOOL:
                return replace(node, left=left, right=right, ty=Type.BOOL)
            for side in (left, right):
                if side.ty is Type.BOOL:
                    raise self.err(side, f"'{op}' compares numbers, got a bool operand")
            return replace(node, left=left, right=right, ty=Type.BOOL)
        for side in (left, right):
            if side.ty is Type.BOOL:
                raise self.err(side, f"'{op}' needs numbers, got bool",
                               "bools are not numbers here; use `1 if test else 0`")
        if op in ("//", "%"):
            for side in (left, right):
                if side.ty is not Type.INT:
                    raise self.err(side, f"'{op}' needs int operands, got {side.ty}")
            if isinstance(right, Const) and right.value == 0:
                raise self.err(right, f"'{op}' by zero")
            if constant_int(right) == 0:
                raise self.err(right, f"'{op}' by zero: `{shorten(_shown_expr(right), 60)}` is 0")
            return replace(node, left=left, right=right, ty=Type.INT)
        if op == "/":
            if isinstance(right, Const) and right.value == 0:
                raise self.err(right, "division by zero")
            if constant_int(right) == 0:
                raise self.err(right, f"division by zero: `{shorten(_shown_expr(right), 60)}` is 0")
            return replace(node, left=left, right=right, ty=Type.FLOAT)
        ty = Type.FLOAT if Type.FLOAT in (left.ty, right.ty) else Type.INT
        return replace(node, left=left, right=right, ty=ty)

    def _call(self, node: Call) -> Node:
        args = tuple(self.check(a) for a in node.args)  # (their errors are independent of the call's)
        if node.func not in FUNCTIONS:
            if node.func in self.env.tensors:
                raise self.err(node, f"tensor `{node.func}` is indexed with [...], not called",
                               f"write {node.func}[...]")
            if node.func in self.env.failed:
                raise self.follow_on(node, node.func)
            raise self.err(node, f"unknown function `{shorten(node.func)}`; functions: {_listed(list(FUNCTIONS))}",
                           _suggest(node.func, list(FUNCTIONS)))
        lo, hi = FUNCTIONS[node.func]
        if not lo <= len(node.args) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise self.err(node, f"`{node.func}` takes {want} argument(s), got {len(node.args)}")
        if self.poisoned(*args):
            return replace(node, args=args, ty=POISON)
        for a in args:
            if a.ty is Type.BOOL:
                raise self.err(a, f"`{node.func}` needs numbers, got bool")
        if node.func == "bit":
            for a, what in zip(args, ("x (the int whose bit is tested)", "i (the bit index, 0 the lowest)")):
                if a.ty is not Type.INT:
                    raise self.err(a, f"`bit(x, i)` tests a bit of an int: {what} is a {a.ty}",
                                   "keep bit masks in int32 tensors or int scalars")
            return replace(node, args=args, ty=Type.BOOL)
        if node.func in ("min", "max"):
            ty = Type.FLOAT if any(a.ty is Type.FLOAT for a in args) else Type.INT
        elif node.func == "abs":
            ty = args[0].ty
        else:
            ty = Type.FLOAT
        return replace(node, args=args, ty=ty)

    def _cond(self, node: Cond) -> Node:
        test, then, orelse = self.check(node.test), self.check(node.then), self.check(node.orelse)
        if self.poisoned(test, then, orelse):
            return replace(node, test=test, then=then, orelse=orelse, ty=POISON)
        if test.ty is not Type.BOOL:
            raise self.err(test, f"the test of 'a if test else b' must be a bool, got {test.ty}")
        if (then.ty is Type.BOOL) != (orelse.ty is Type.BOOL):
            raise self.err(node, "both branches of 'a if test else b' must have the same kind, "
                           f"got {then.ty} and {orelse.ty}")
        ty = then.ty if then.ty == orelse.ty else Type.FLOAT
        return replace(node, test=test, then=then, orelse=orelse, ty=ty)


def typecheck(node: Node, env: TypeEnv, src: SourceText | None = None, expect: Type | None = None) -> Node:
    """Return a copy of ``node`` with every ``ty`` filled in; raise SpecError on misuse."""
    src = src or SourceText("")
    checker = _Checker(src, env)
    typed = checker.check(node)
    if checker.errors:
        # Every independent error, in the order of the text; uses of refused declarations only
        # where nothing else is wrong (the loader drops those: their declaration is reported).
        errors = sorted((e for e in checker.errors if not isinstance(e, FollowOnError)),
                        key=lambda e: (e.location.line, e.location.col))
        if not errors:
            raise checker.errors[0]
        if len(errors) == 1:
            raise errors[0]
        raise ExprErrors(errors)
    if expect is not None:
        ok = typed.ty is expect or (expect is Type.FLOAT and typed.ty is Type.INT)
        if not ok:
            hint = None
            if expect is Type.BOOL:
                hint = "a mask must be true where the key is visible, e.g. `kv_pos <= q_pos`"
            elif env.sink:
                hint = "a sink is a logit (a float), e.g. sinks[qo_head]"
            raise src.error(0, f"expression must be a {expect}, got {typed.ty}", hint)
    return typed


def parse_typed(src: SourceText, env: TypeEnv, expect: Type | None = None) -> Node:
    return typecheck(parse(src), env, src, expect)
