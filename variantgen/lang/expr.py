"""The expression language of spec files: tokenizer, parser and type checker.

Expressions are parsed by this module alone (never ``eval``); every name must be a
built-in, a declared scalar or a declared tensor; the checked tree is what code
generation, the torch reference and the interval analysis walk. Nothing from the
source text reaches generated C++ except through that tree.

Indices are checked by kind: a symbolic dimension (``total_kv`` ...) takes only its row
builtin (``kv_row`` ...), optionally offset by terms that are the same for every row of the
request (``kv_row - 1``); see docs/spec-reference.md and ``row_index``.

Grammar, lowest precedence first::

    cond    := or ['if' or 'else' cond]
    or      := and ('or' and)*
    and     := not ('and' not)*
    not     := 'not' not | compare
    compare := arith (('<'|'<='|'>'|'>='|'=='|'!=') arith)*     # a < b < c chains
    arith   := term (('+'|'-') term)*
    term    := unary (('*'|'/'|'//'|'%') unary)*
    unary   := ('-'|'+') unary | postfix
    postfix := NAME '(' args ')' | NAME '[' args ']' | atom
    atom    := INT | FLOAT | 'true' | 'false' | NAME | '(' cond ')'
"""

from __future__ import annotations

import difflib
import enum
import fractions
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.errors import Location, SpecError, SpecErrors

MAX_EXPR_CHARS = 4096
MAX_DEPTH = 64
MAX_TREE_DEPTH = 128  # long chains (a + b + c ...) nest without parentheses; every tree walk recurses
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: beyond it a kernel sees inf


class Type(enum.Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"

    def __str__(self) -> str:
        return self.value


# ----------------------------------------------------------------------------- source


@dataclass(frozen=True)
class SourceText:
    """An expression's text and where it sits in its file.

    ``line_starts`` holds, for each line of ``text``, the (line, col) in the file where
    that line of the expression begins, so multi-line YAML scalars map back exactly.
    """

    text: str
    file: str = "<string>"
    line_starts: tuple[tuple[int, int], ...] = ((1, 1),)
    field: str = "expression"
    positions: tuple[tuple[int, int], ...] = ()
    """Optional (line, col) in the file of every offset 0..len(text) of ``text``: set when
    YAML folded the scalar (plain, quoted or '>' style), so its lines are not the file's."""

    def locate(self, offset: int) -> Location:
        offset = max(0, min(offset, len(self.text)))
        if len(self.positions) == len(self.text) + 1:
            line, col = self.positions[offset]
            return Location(self.file, line, col)
        line_idx = self.text.count("\n", 0, offset)
        line_begin = self.text.rfind("\n", 0, offset) + 1
        if line_idx < len(self.line_starts):
            file_line, file_col = self.line_starts[line_idx]
        else:  # more lines than mapped (folded scalar): best effort
            file_line, file_col = self.line_starts[-1][0] + line_idx, 1
        return Location(self.file, file_line, file_col + (offset - line_begin))

    def line_text(self, offset: int) -> tuple[str, int]:
        """The source line containing ``offset`` and the 1-based column within it."""
        begin = self.text.rfind("\n", 0, offset) + 1
        end = self.text.find("\n", offset)
        end = len(self.text) if end < 0 else end
        return self.text[begin:end], offset - begin + 1

    def error(self, offset: int, message: str, hint: str | None = None) -> SpecError:
        # The caret goes under the expression's own line, so its column is the one
        # within that line; the location keeps the column in the file.
        line, col = self.line_text(offset)
        return SpecError(message, self.locate(offset), field=self.field, source_line=line,
                         hint=hint, caret_col=col)


# ----------------------------------------------------------------------------- tokens

_TOKEN_RE = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+)
  | (?P<float>(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)
  | (?P<int>\d+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>//|<=|>=|==|!=|[-+*/%<>()\[\],])
    """,
    re.VERBOSE | re.ASCII,  # \d: 0-9 only, not every Unicode digit
)
KEYWORDS = {"and", "or", "not", "if", "else", "true", "false", "True", "False"}


@dataclass(frozen=True)
class Token:
    kind: str  # 'int' 'float' 'name' 'op' 'kw' 'end'
    text: str
    pos: int


def tokenize(src: SourceText) -> list[Token]:
    text = src.text
    if len(text) > MAX_EXPR_CHARS:
        raise src.error(0, f"expression is {len(text)} characters long; the limit is {MAX_EXPR_CHARS}")
    tokens: list[Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            ch = text[pos]
            shown = repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}"
            hint = None
            if ch in "&|!":
                hint = "use 'and', 'or' and 'not' for boolean logic" + (
                    "; bit(x, i) tests bit i of an int" if ch in "&|" else "")
            elif ch == "=":
                hint = "use '==' to compare"
            raise src.error(pos, f"unexpected character {shown}", hint)
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            tok_text = m.group()
            if kind == "name" and tok_text in KEYWORDS:
                kind = "kw"
            tokens.append(Token(kind, tok_text, pos))
        pos = m.end()
    tokens.append(Token("end", "", len(text)))
    return tokens


# ----------------------------------------------------------------------------- AST


@dataclass(frozen=True)
class Node:
    pos: int = field(default=0, compare=False)
    ty: Type | None = field(default=None, compare=False)

    def children(self) -> tuple[Node, ...]:
        return ()


@dataclass(frozen=True)
class Const(Node):
    value: bool | int | float = 0


@dataclass(frozen=True)
class Name(Node):
    id: str = ""


@dataclass(frozen=True)
class Index(Node):
    tensor: str = ""
    indices: tuple[Node, ...] = ()

    def children(self) -> tuple[Node, ...]:
        return self.indices


@dataclass(frozen=True)
class Unary(Node):
    op: str = "-"  # '-', '+', 'not'
    operand: Node = field(default_factory=Const)

    def children(self) -> tuple[Node, ...]:
        return (self.operand,)


@dataclass(frozen=True)
class Binary(Node):
    op: str = "+"  # + - * / // % < <= > >= == != and or
    left: Node = field(default_factory=Const)
    right: Node = field(default_factory=Const)

    def children(self) -> tuple[Node, ...]:
        return (self.left, self.right)


@dataclass(frozen=True)
class Call(Node):
    func: str = ""
    args: tuple[Node, ...] = ()

    def children(self) -> tuple[Node, ...]:
        return self.args


@dataclass(frozen=True)
class Cond(Node):
    test: Node = field(default_factory=Const)
    then: Node = field(default_factory=Const)
    orelse: Node = field(default_factory=Const)

    def children(self) -> tuple[Node, ...]:
        return (self.test, self.then, self.orelse)


ARITH_OPS = ("+", "-", "*", "/", "//", "%")
CMP_OPS = ("<", "<=", ">", ">=", "==", "!=")
BOOL_OPS = ("and", "or")


def walk(node: Node) -> Iterator[Node]:
    yield node
    for child in node.children():
        yield from walk(child)


def names_used(node: Node) -> set[str]:
    out: set[str] = set()
    for n in walk(node):
        if isinstance(n, Name):
            out.add(n.id)
        elif isinstance(n, Index):
            out.add(n.tensor)
    return out


# ----------------------------------------------------------------------------- parser


class _Parser:
    def __init__(self, src: SourceText):
        self.src = src
        self.tokens = tokenize(src)
        self.i = 0
        self.depth = 0

    # helpers
    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def advance(self) -> Token:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def at(self, text: str) -> bool:
        return self.tok.kind in ("op", "kw") and self.tok.text == text

    def expect(self, text: str, what: str) -> Token:
        if not self.at(text):
            found = "end of expression" if self.tok.kind == "end" else repr(self.tok.text)
            raise self.src.error(self.tok.pos, f"expected {what}, found {found}")
        return self.advance()

    def enter(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.src.error(pos, f"expression is nested too deeply (more than {MAX_DEPTH} levels)")

    def leave(self) -> None:
        self.depth -= 1

    # grammar
    def parse(self) -> Node:
        if self.tok.kind == "end":
            raise self.src.error(0, "expression is empty")
        node = self.cond()
        if self.tok.kind != "end":
            raise self.src.error(
                self.tok.pos,
                f"unexpected {self.tok.text!r} after a complete expression",
                "join conditions with 'and' / 'or'; a conditional reads 'a if test else b'",
            )
        too_deep = _deeper_than(node, MAX_TREE_DEPTH)
        if too_deep is not None:
            raise self.src.error(
                too_deep.pos,
                f"expression is nested too deeply (more than {MAX_TREE_DEPTH} levels of operations)",
                "group long chains with parentheses, e.g. (a or b) or (c or d)",
            )
        return node

    def cond(self) -> Node:
        self.enter(self.tok.pos)
        node = self.or_()
        if self.at("if"):
            pos = self.advance().pos
            test = self.or_()
            self.expect("else", "'else' of the conditional 'a if test else b'")
            orelse = self.cond()
            node = Cond(pos=pos, test=test, then=node, orelse=orelse)
        self.leave()
        return node

    def or_(self) -> Node:
        node = self.and_()
        while self.at("or"):
            pos = self.advance().pos
            node = Binary(pos=pos, op="or", left=node, right=self.and_())
        return node

    def and_(self) -> Node:
        node = self.not_()
        while self.at("and"):
            pos = self.advance().pos
            node = Binary(pos=pos, op="and", left=node, right=self.not_())
        return node

    def not_(self) -> Node:
        if self.at("not"):
            pos = self.advance().pos
            self.enter(pos)
            node = Unary(pos=pos, op="not", operand=self.not_())
            self.leave()
            return node
        return self.compare()

    def compare(self) -> Node:
        first = self.arith()
        parts: list[Node] = []
        left = first
        while self.tok.kind == "op" and self.tok.text in CMP_OPS:
            tok = self.advance()
            right = self.arith()
            parts.append(Binary(pos=tok.pos, op=tok.text, left=left, right=right))
            left = right
        if not parts:
            return first
        node = parts[0]
        for part in parts[1:]:  # a < b < c  ==  a < b and b < c
            node = Binary(pos=part.pos, op="and", left=node, right=part)
        return node

    def arith(self) -> Node:
        node = self.term()
        while self.tok.kind == "op" and self.tok.text in ("+", "-"):
            tok = self.advance()
            node = Binary(pos=tok.pos, op=tok.text, left=node, right=self.term())
        return node

    def term(self) -> Node:
        node = self.unary()
        while self.tok.kind == "op" and self.tok.text in ("*", "/", "//", "%"):
            tok = self.advance()
            node = Binary(pos=tok.pos, op=tok.text, left=node, right=self.unary())
        return node

    def unary(self) -> Node:
        if self.tok.kind == "op" and self.tok.text in ("-", "+"):
            tok = self.advance()
            self.enter(tok.pos)
            operand = self.unary()
            self.leave()
            if tok.text == "-" and isinstance(operand, Const) and not isinstance(operand.value, bool):
                return Const(pos=tok.pos, value=-operand.value)
            return Unary(pos=tok.pos, op=tok.text, operand=operand)
        return self.postfix()

    def args(self, close: str, what: str) -> tuple[Node, ...]:
        out: list[Node] = []
        if self.at(close):
            self.advance()
            return ()
        while True:
            out.append(self.cond())
            if self.at(","):
                self.advance()
                continue
            self.expect(close, what)
            return tuple(out)

    def postfix(self) -> Node:
        tok = self.tok
        if tok.kind == "name":
            self.advance()
            if self.at("("):
                self.advance()
                return Call(pos=tok.pos, func=tok.text, args=self.args(")", "')' closing the call"))
            if self.at("["):
                self.advance()
                return Index(pos=tok.pos, tensor=tok.text, indices=self.args("]", "']' closing the index"))
            return Name(pos=tok.pos, id=tok.text)
        return self.atom()

    def atom(self) -> Node:
        tok = self.tok
        if tok.kind == "int":
            self.advance()
            # Length first: int() of thousands of digits is slow, and past 4300 digits it raises.
            value = int(tok.text) if len(tok.text) <= 20 else None
            if value is None or value > INT32_MAX + 1:  # +1: '-2147483648' is parsed as -(2147483648)
                raise self.src.error(tok.pos, f"integer {_shorten(tok.text)} does not fit in 32 bits")
            return Const(pos=tok.pos, value=value)
        if tok.kind == "float":
            self.advance()
            value = float(tok.text)
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise self.src.error(tok.pos, f"number {_shorten(tok.text)} does not fit in a 32-bit float")
            single = float32_of_decimal(tok.text)
            # The literal rounded once, as a C++ compiler rounds `<text>f`: through the double, a
            # decimal just past a float32 tie lands on the tie and rounds to even (the wrong side).
            return Const(pos=tok.pos, value=value if to_float32(value) == single else single)
        if tok.kind == "kw" and tok.text in ("true", "false", "True", "False"):
            self.advance()
            return Const(pos=tok.pos, value=tok.text in ("true", "True"))
        if self.at("("):
            self.advance()
            node = self.cond()
            self.expect(")", "')'")
            return node
        found = "end of expression" if tok.kind == "end" else repr(tok.text)
        raise self.src.error(tok.pos, f"expected a value (number, name or '('), found {found}")


def constant_int(node: Node) -> int | None:
    """The value of an int expression of constants only (+ - * // % min max abs), as the
    reference computes it (unbounded, floor division, 0 for a zero divisor); None otherwise."""
    if isinstance(node, Const):
        return node.value if isinstance(node.value, int) and not isinstance(node.value, bool) else None
    if isinstance(node, Unary) and node.op in "+-":
        v = constant_int(node.operand)
        return None if v is None else -v if node.op == "-" else v
    if isinstance(node, Binary) and node.op in ("+", "-", "*", "//", "%"):
        a = constant_int(node.left)
        b = None if a is None else constant_int(node.right)
        if a is None or b is None:
            return None
        if node.op in ("//", "%"):
            return 0 if b == 0 else a // b if node.op == "//" else a % b
        return a + b if node.op == "+" else a - b if node.op == "-" else a * b
    if isinstance(node, Call) and node.func in ("min", "max", "abs"):
        values = [constant_int(a) for a in node.args]
        if any(v is None for v in values):
            return None
        return abs(values[0]) if node.func == "abs" else min(values) if node.func == "min" else max(values)
    return None


def to_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def float32_of_decimal(text: str) -> float:
    """The float32 nearest to the decimal ``text`` (ties to even), rounded once from the exact
    value; ``text`` a finite literal within the float32 range."""
    if float(text) == 0.0:  # below half the smallest double, so below any float32 tie: 0
        # (and no exact value: Fraction("1e-999999999") would build a billion-digit power of ten)
        return 0.0
    exact = fractions.Fraction(text)
    guess = to_float32(float(exact))  # off by at most one float32 step (rounded twice)
    bits = struct.unpack("<i", struct.pack("<f", guess))[0]
    near = [guess] + [struct.unpack("<f", struct.pack("<i", b))[0] for b in (bits - 1, bits + 1)
                      if 0 <= b < 0x7F800000 or -0x80000000 <= b < -0x00800000]
    near = [x for x in near if math.isfinite(x)]
    return min(near, key=lambda x: (abs(fractions.Fraction(x) - exact),
                                    struct.unpack("<i", struct.pack("<f", x))[0] & 1))


def _shorten(text: str, limit: int = 40) -> str:
    """A literal as quoted in a message: long ones keep their ends and say how long they are."""
    if len(text) <= limit:
        return text
    return f"{text[:16]}...{text[-8:]} ({len(text)} characters)"


def _deeper_than(root: Node, limit: int) -> Node | None:
    """The first node (in source order) deeper than ``limit`` levels, without recursing."""
    stack: list[tuple[Node, int]] = [(root, 1)]
    deepest: Node | None = None
    while stack:
        node, depth = stack.pop()
        if depth > limit and (deepest is None or node.pos < deepest.pos):
            deepest = node
            continue
        stack.extend((child, depth + 1) for child in node.children())
    return deepest


def parse(src: SourceText | str) -> Node:
    """Parse an expression into an untyped tree. Raises SpecError with a location."""
    if isinstance(src, str):
        src = SourceText(src)
    return _Parser(src).parse()


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
                    raise self.err(typed, f"`{_shorten(to_source(typed), 60)}` is {value}, outside the 32-bit int "
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
            f"unknown name `{_shorten(node.id)}`; known names: {_listed(self.env.known_names())}",
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
                f"`{_shorten(node.tensor)}` is {what} and cannot be indexed; declared tensors: "
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
                raise self.err(right, f"'{op}' by zero: `{_shorten(_shown_expr(right), 60)}` is 0")
            return replace(node, left=left, right=right, ty=Type.INT)
        if op == "/":
            if isinstance(right, Const) and right.value == 0:
                raise self.err(right, "division by zero")
            if constant_int(right) == 0:
                raise self.err(right, f"division by zero: `{_shorten(_shown_expr(right), 60)}` is 0")
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
            raise self.err(node, f"unknown function `{_shorten(node.func)}`; functions: {_listed(list(FUNCTIONS))}",
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


def to_source(node: Node) -> str:
    """Canonical text of a tree (fully parenthesised): used in comments and cache keys."""
    if isinstance(node, Const):
        if isinstance(node.value, bool):
            return "true" if node.value else "false"
        return repr(node.value)
    if isinstance(node, Name):
        return node.id
    if isinstance(node, Index):
        return f"{node.tensor}[{', '.join(to_source(i) for i in node.indices)}]"
    if isinstance(node, Unary):
        return f"(not {to_source(node.operand)})" if node.op == "not" else f"({node.op}{to_source(node.operand)})"
    if isinstance(node, Binary):
        return f"({to_source(node.left)} {node.op} {to_source(node.right)})"
    if isinstance(node, Call):
        return f"{node.func}({', '.join(to_source(a) for a in node.args)})"
    if isinstance(node, Cond):
        return f"({to_source(node.then)} if {to_source(node.test)} else {to_source(node.orelse)})"
    raise TypeError(f"not an expression node: {node!r}")
