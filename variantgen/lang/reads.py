"""How an expression reads the builtins of the query row, the key and the head.

The planner (planning/intervals.py, keysets.py) and the code generator both ask how a mask's
atoms read the key and the row: an atom that reads the key but not the row is a key set (global
tokens' flags), one that reads the row only by blocks (``q_pos // D``) picks its keys per block of
rows (BigBird's random blocks). Rows that see such keys read them through page lists, which a
kernel of their own runs (the listed variant): codegen compiles it exactly where an atom of one of
these two shapes exists (page_list_atoms), and the planner lists pages only there.
"""

from __future__ import annotations

from typing import NamedTuple

from .nodes import Binary, Cond, Name, Node, Type, Unary, names_used, substitute, walk

KEY_NAMES = frozenset({"kv_pos", "kv_row"})
HEAD_NAMES = frozenset({"qo_head", "kv_head"})
# (request, qo_len, kv_len: the same for every row of a request)
ROW_NAMES = frozenset({"q_pos", "q_idx", "q_row", "q_kv_row"})


class Blocks(NamedTuple):
    """How atoms read one side (the row's builtins or the key's): the builtin, and the divisor
    they read it by (None: by position)."""

    name: str
    divisor: Node | None


def reads(atoms: tuple[Node, ...], names: frozenset[str]) -> Blocks | None:
    """How ``atoms`` read ``names``: by blocks where every read is ``name // divisor`` with one
    name and one int divisor of scalars and constants; by position where any read is another;
    None where they read none of them."""
    uses: list[Blocks] = []

    def visit(node: Node) -> None:
        if (isinstance(node, Binary) and node.op == "//" and isinstance(node.left, Name) and node.left.id in names
                and not names_used(node.right) & (ROW_NAMES | KEY_NAMES | HEAD_NAMES) and node.right.ty is Type.INT):
            uses.append(Blocks(node.left.id, node.right))
        elif isinstance(node, Name) and node.id in names:
            uses.append(Blocks(node.id, None))
        else:
            for child in node.children():
                visit(child)

    for atom in atoms:
        visit(atom)
    if not uses:
        return None
    return uses[0] if all(u == uses[0] for u in uses) else Blocks(uses[0].name, None)


def key_only(node: Node) -> bool:
    """Reads the key and nothing of the row or the head (request-wide names are fine)."""
    used = names_used(node)
    return bool(used & KEY_NAMES) and not used & (ROW_NAMES | HEAD_NAMES)


def rows_by_blocks(atoms: tuple[Node, ...]) -> bool:
    """Whether ``atoms`` read the key, and the row only by blocks (or not at all), and no head."""
    used = set().union(*(names_used(a) for a in atoms)) if atoms else set()
    if not used & KEY_NAMES or used & HEAD_NAMES:
        return False
    rows = reads(atoms, ROW_NAMES)
    return rows is None or rows.divisor is not None


def atoms(node: Node):
    """The atoms of a boolean expression: its operands of ``and``, ``or`` and ``not``."""
    if isinstance(node, Binary) and node.op in ("and", "or"):
        yield from atoms(node.left)
        yield from atoms(node.right)
    elif isinstance(node, Unary) and node.op == "not":
        yield from atoms(node.operand)
    else:
        yield node


def _affine_in_key(node: Node) -> bool:
    """``k``, ``k // c``, or ``k`` plus or minus key-free terms (k a key builtin): a key bound."""
    if isinstance(node, Name):
        return node.id in KEY_NAMES
    if isinstance(node, Binary) and node.op == "//":
        return _affine_in_key(node.left) and not names_used(node.right) & KEY_NAMES
    if isinstance(node, Binary) and node.op in ("+", "-"):
        left, right = names_used(node.left) & KEY_NAMES, names_used(node.right) & KEY_NAMES
        return (_affine_in_key(node.left) and not right) or (node.op == "+" and _affine_in_key(node.right) and not left)
    return False


def bounds_the_key(node: Node) -> bool:
    """A comparison of an affine key expression with a key-free one (``kv_pos < num_sink``,
    ``kv_pos // f <= q_pos // f``): what the planner reads as an interval, not a key set."""
    if not (isinstance(node, Binary) and node.op in ("<", "<=", ">", ">=", "==")):
        return False
    left, right = names_used(node.left) & KEY_NAMES, names_used(node.right) & KEY_NAMES
    return (_affine_in_key(node.left) and not right) or (_affine_in_key(node.right) and not left)


MAX_BRANCH_TESTS = 64  # tests an expression's ``if`` branches may expand into (past it: the test as written)


def _branch_tests(test: Node, budget: list[int]) -> list[Node]:
    """``test`` with each ``if`` inside it resolved to either branch (as the planner lifts them:
    ``(a if c else b) == 0`` is ``c and a == 0 or not c and b == 0``), plus the ifs' conditions."""
    cond = next((n for n in walk(test) if isinstance(n, Cond)), None)
    if cond is None or budget[0] <= 0:
        return [test]
    budget[0] -= 1
    return (_branch_tests(substitute(test, {id(cond): cond.then}), budget)
            + _branch_tests(substitute(test, {id(cond): cond.orelse}), budget) + list(tests(cond.test)))


def tests(node: Node):
    """Every boolean test of an expression, wherever it sits: its atoms, those inside ``if``
    expressions' branches and conditions, and a test with an ``if`` inside it resolved to each
    branch (the planner rewrites all of these into terms)."""
    for n in walk(node):
        if n.ty is not Type.BOOL or isinstance(n, Cond):
            continue
        if (isinstance(n, Binary) and n.op in ("and", "or")) or (isinstance(n, Unary) and n.op == "not"):
            continue
        yield from _branch_tests(n, [MAX_BRANCH_TESTS])


def page_list_atoms(mask: Node) -> bool:
    """Whether some test of ``mask`` reads the key alone or the row only by blocks, and is not a
    key bound: rows the planner may read through page lists (planning/keysets.py), so codegen
    builds the listed variant, and the planner lists pages only for masks that have one. Tests
    inside ``if`` branches count: an equivalent form must plan alike."""
    return any((key_only(a) or rows_by_blocks((a,))) and not bounds_the_key(a) for a in tests(mask))
