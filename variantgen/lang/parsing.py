"""Parsing the expression language of spec files: the located source text
(``SourceText``, whose errors name ``file:line:col``), the tokenizer and the
recursive-descent parser (``parse``) that gives an untyped tree of nodes.py's types.

Expressions are parsed by this module alone (never ``eval``).

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

import fractions
import math
import re
import struct
from dataclasses import dataclass

from ..core.errors import Location, SpecError
from .nodes import CMP_OPS, FLOAT32_MAX, INT32_MAX, Binary, Call, Cond, Const, Index, Name, Node, Unary, to_float32

MAX_EXPR_CHARS = 4096
MAX_DEPTH = 64
MAX_TREE_DEPTH = 128  # long chains (a + b + c ...) nest without parentheses; every tree walk recurses


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
                raise self.src.error(tok.pos, f"integer {shorten(tok.text)} does not fit in 32 bits")
            return Const(pos=tok.pos, value=value)
        if tok.kind == "float":
            self.advance()
            value = float(tok.text)
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise self.src.error(tok.pos, f"number {shorten(tok.text)} does not fit in a 32-bit float")
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


def shorten(text: str, limit: int = 40) -> str:
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
