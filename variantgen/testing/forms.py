"""Random equivalent forms of a spec's mask, for the tests and the fuzzer.

``random_form(spec, seed, rewrites)`` rewrites the mask ``rewrites`` times, each time one of its
boolean sub-expressions by one rule picked at random: commuted ``and`` / ``or``, a flipped or
negated comparison, a difference against 0, constant factors and ``// 1``, ``min`` / ``max`` /
``abs`` forms of an order, ``if`` expressions with equal branches, ``not not``. Every rule is exact
for the spec language's ints. The property test (tests/cpu/test_normalize.py) asserts each form
plans no worse than the mask as written; bench/make_forms.py writes fixed forms of the benchmarks'
masks as spec files (bench/masks/forms/) that the differential fuzzer runs as kernels.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import yaml

from ..lang.nodes import Binary, Const, Node, Type, Unary, to_source
from ..lang.spec import parse_spec
from ..lang.values import VariantSpec

ROW_CONDS = ("(q_pos % 2 == 0)", "(q_idx < 3)", "(q_pos >= kv_len - 1)")


def spec_data(spec: VariantSpec) -> dict[str, Any]:
    """The spec file's fields as written (its YAML)."""
    return yaml.safe_load(Path(spec.path).read_text())


def with_mask(spec: VariantSpec, mask_text: str, **fields: Any) -> VariantSpec:
    """``spec`` with its mask replaced by ``mask_text`` (and any other field given), parsed and
    type checked as a spec file's."""
    data = spec_data(spec)
    data["mask"] = mask_text
    data.update(fields)
    return parse_spec(yaml.safe_dump(data, sort_keys=False), str(spec.path))


def _int_cmp(n: Node) -> bool:
    return isinstance(n, Binary) and n.op in ("<", "<=", ">", ">=", "==", "!=") \
        and n.left.ty is Type.INT and n.right.ty is Type.INT


def _rewrite(n: Node, r: random.Random) -> str:
    """An equivalent text of bool node ``n`` by one rule picked at random."""
    s = to_source
    if isinstance(n, Binary) and n.op in ("and", "or") and r.random() < 0.5:
        return f"({s(n.right)} {n.op} {s(n.left)})"
    if _int_cmp(n):
        a, b, op = s(n.left), s(n.right), n.op
        flip = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}[op]
        neg = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}[op]
        options = [f"({b} {flip} {a})", f"(not ({a} {neg} {b}))", f"(({a} - {b}) {op} 0)",
                   f"(0 {flip} ({a} - {b}))", f"(({a} * 3) {op} ({b} * 3))", f"((({a}) // 1) {op} {b})",
                   f"(({a} if {r.choice(ROW_CONDS)} else {a}) {op} {b})"]
        if op == "<=":
            options += [f"(max({a}, {b}) <= {b})", f"(min({a}, {b}) == {a})", f"(abs({b} - {a}) == ({b} - {a}))",
                        f"(({a}) - ({a}) % 1 <= {b})"]
        if op == "<":
            options += [f"(({a}) + 1 <= {b})", f"(min({a}, {b}) != {b})"]
        if op == ">=":
            options += [f"(min({a}, {b}) == {b})", f"(max({a} - {b}, 0) == {a} - {b})"]
        if op == "==":
            options += [f"(({a} <= {b}) and ({a} >= {b}))", f"(abs({a} - {b}) <= 0)"]
        return r.choice(options)
    return r.choice([f"(not (not {s(n)}))", f"({s(n)} if {r.choice(ROW_CONDS)} else {s(n)})"])


def _bool_nodes(n: Node, out: list[Node]) -> list[Node]:
    if n.ty is Type.BOOL and not isinstance(n, Const):
        out.append(n)
    if isinstance(n, Binary) and n.op in ("and", "or"):
        _bool_nodes(n.left, out)
        _bool_nodes(n.right, out)
    elif isinstance(n, Unary) and n.op == "not":
        _bool_nodes(n.operand, out)
    return out


def random_form(spec: VariantSpec, seed: int, rewrites: int) -> str:
    """The text of a random equivalent form of ``spec``'s mask (``rewrites`` rules applied)."""
    r = random.Random(seed)
    tree = spec.mask
    for _ in range(rewrites):
        target = r.choice(_bool_nodes(tree, []) or [tree])
        text = _substitute(tree, target, _rewrite(target, r))
        tree = with_mask(spec, text).mask
    return to_source(tree)


def _substitute(tree: Node, target: Node, text: str) -> str:
    marker = "__vg_target__"
    return _source_with(tree, target, marker).replace(marker, text)


def _source_with(n: Node, target: Node, marker: str) -> str:
    if n is target:
        return marker
    if isinstance(n, Binary) and n.op in ("and", "or"):
        return f"({_source_with(n.left, target, marker)} {n.op} {_source_with(n.right, target, marker)})"
    if isinstance(n, Unary) and n.op == "not":
        return f"(not {_source_with(n.operand, target, marker)})"
    return to_source(n)
