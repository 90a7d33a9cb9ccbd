"""The expression tree of spec files: the node types (``Const``, ``Name``, ``Index``,
``Unary``, ``Binary``, ``Call``, ``Cond``) and their ``Type``, walking a tree
(``walk``, ``names_used``, ``constant_int``), its canonical text (``to_source``, used in
comments and cache keys) and the 32-bit limits the kernel's values have.

parsing.py builds these trees from text; expr.py type-checks them.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: beyond it a kernel sees inf


class Type(enum.Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"

    def __str__(self) -> str:
        return self.value


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


def substitute(node: Node, by_id: Mapping[int, Node]) -> Node:
    """``node`` with each subtree whose ``id()`` is a key of ``by_id`` replaced by its value
    (subtrees by identity: equal subtrees elsewhere in the tree stay)."""
    if id(node) in by_id:
        return by_id[id(node)]
    if isinstance(node, Unary):
        return replace(node, operand=substitute(node.operand, by_id))
    if isinstance(node, Binary):
        return replace(node, left=substitute(node.left, by_id), right=substitute(node.right, by_id))
    if isinstance(node, Index):
        return replace(node, indices=tuple(substitute(i, by_id) for i in node.indices))
    if isinstance(node, Call):
        return replace(node, args=tuple(substitute(a, by_id) for a in node.args))
    if isinstance(node, Cond):
        return replace(node, test=substitute(node.test, by_id), then=substitute(node.then, by_id),
                       orelse=substitute(node.orelse, by_id))
    return node


def names_used(node: Node) -> set[str]:
    out: set[str] = set()
    for n in walk(node):
        if isinstance(n, Name):
            out.add(n.id)
        elif isinstance(n, Index):
            out.add(n.tensor)
    return out


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
