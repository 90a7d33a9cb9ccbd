"""Every independent error of a spec is reported together (the docs promise it): unknown names
in every subexpression, type errors that do not depend on another error, each bad declaration
and the expressions after it - one error never cascading into follow-ups (a poison type)."""

from __future__ import annotations

import pytest

from variantgen.core.errors import SpecError
from variantgen.lang import expr, nodes, parsing
from variantgen.lang.spec import parse_spec


def errors_of(text: str) -> list[SpecError]:
    err = pytest.raises(SpecError, parse_spec, text, "spec.yaml").value
    return list(getattr(err, "errors", [err]))


def where(errors: list[SpecError]) -> list[tuple[str, int, int, str]]:
    return [(e.field, e.location.line, e.location.col, e.message.split(";")[0]) for e in errors]


def test_unknown_names_on_both_sides_of_an_or_are_both_reported():
    """`kv_poss <= q_pos or kv_pos <= q_poss` reported `kv_poss` alone."""
    got = where(errors_of("name: x\nmask: kv_poss <= q_pos or kv_pos <= q_poss\n"))
    assert got == [("mask", 2, 7, "unknown name `kv_poss`"), ("mask", 2, 37, "unknown name `q_poss`")]


def test_an_error_does_not_cascade():
    """`foo + 1` with foo unknown is one error, not also "'<=' ..." or "'and' needs bool operands"."""
    got = where(errors_of("name: x\nmask: (foo + 1 <= q_pos) and not bar(kv_pos)\n"))
    line = "mask: (foo + 1 <= q_pos) and not bar(kv_pos)"
    assert got == [("mask", 2, line.index("foo") + 1, "unknown name `foo`"),
                   ("mask", 2, line.index("bar") + 1, "unknown function `bar`")]


def test_independent_type_errors_are_all_reported():
    text = "name: x\nmask: (q_pos and kv_pos) or (1.5 // 2 == 0) or tanh(true) > 0.0\n"
    got = where(errors_of(text))
    assert [g[3] for g in got] == ["'and' needs bool operands, got int", "'//' needs int operands, got float",
                                   "`tanh` needs numbers, got bool"]


def test_errors_inside_indices_and_arguments_are_reported_with_the_outer_error():
    many = ", ".join(str(i) for i in range(18))  # (more arguments than min takes)
    text = f"name: x\nmask: nope[q_roww] <= kv_pos or min(kv_pos, zzz, {many}) > 0\n"
    messages = [g[3] for g in where(errors_of(text))]
    assert messages[:2] == ["`nope` is not a declared tensor and cannot be indexed", "unknown name `q_roww`"]
    assert "unknown name `zzz`" in messages


def test_a_refused_declaration_hides_neither_later_errors_nor_the_mask():
    text = ("name: x\ntensors:\n  r: {dtype: int64, shape: [total_q]}\nscalars:\n  w: {dtype: int, default: 1.5}\n"
            "  u: {dtype: int, default: 2}\nmask: r[q_row] <= kv_pos and kv_pos <= w and vv > 0\n"
            "logits: logits * w + undefined_thing\n")
    got = where(errors_of(text))
    assert [(g[0], g[1]) for g in got] == [("tensors.r.dtype", 3), ("scalars.w.default", 5), ("mask", 7),
                                           ("logits", 8)]
    assert got[2][3] == "unknown name `vv`" and got[3][3] == "unknown name `undefined_thing`"


def test_only_follow_on_uses_give_no_extra_error():
    got = where(errors_of("name: x\nscalars:\n  w: {dtype: int, default: 1.5}\nmask: kv_pos <= w and w > 0\n"))
    assert got == [("scalars.w.default", 3, 28, "default must be an int, got a float 1.5")]


def test_typecheck_outside_the_loader_raises_all_errors_in_order():
    env = expr.TypeEnv(scalars={}, tensors={})
    src = parsing.SourceText("b1 + a1 > c1", "f.yaml", ((1, 1),), "mask")
    err = pytest.raises(expr.ExprErrors, expr.parse_typed, src, env, nodes.Type.BOOL).value
    assert [e.location.col for e in err.errors] == [1, 6, 11]
    assert isinstance(err, SpecError)


def test_a_valid_expression_still_types():
    env = expr.TypeEnv(scalars={"w": nodes.Type.INT}, tensors={})
    node = expr.parse_typed(parsing.SourceText("kv_pos <= q_pos and q_pos - kv_pos < w"), env, nodes.Type.BOOL)
    assert node.ty is nodes.Type.BOOL and expr.POISON not in {n.ty for n in nodes.walk(node)}
