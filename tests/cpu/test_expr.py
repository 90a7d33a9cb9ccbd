"""The expression language: tokenizer, parser, precedence, type errors, to_source."""

from __future__ import annotations

import re
import time

import pytest

import variantgen
from variantgen.core.errors import Location, SpecError
from variantgen.lang import expr, nodes, parsing
from variantgen.lang.expr import TensorSig, TypeEnv
from variantgen.lang.nodes import Binary, Call, Cond, Const, Index, Name, Type, Unary, to_source
from variantgen.lang.parsing import SourceText, parse

ENV = TypeEnv(
    scalars={"w": Type.INT, "f": Type.FLOAT, "flag": Type.BOOL},
    tensors={"t": TensorSig("t", ("total_q", 2), Type.INT), "s": TensorSig("s", (4,), Type.FLOAT)},
)
LOGITS_ENV = TypeEnv(ENV.scalars, ENV.tensors, allow_logits=True)

# Expressions sit at line 5, column 7 of m.yaml (as in `mask: <expr>` on line 5).
FILE, LINE, COL = "m.yaml", 5, 7


def src(text: str) -> SourceText:
    return SourceText(text, FILE, ((LINE, COL),), "mask")


def typed(text: str, env: TypeEnv = ENV, expect: Type | None = None) -> nodes.Node:
    return expr.parse_typed(src(text), env, expect)


def error(text: str, env: TypeEnv = ENV, expect: Type | None = None) -> SpecError:
    with pytest.raises(SpecError) as info:
        typed(text, env, expect)
    return info.value


def where(err: SpecError) -> str:
    return str(err.location)


def at(offset: int) -> str:
    """The file location of ``offset`` within a one-line expression."""
    return f"{FILE}:{LINE}:{COL + offset}"


# ----------------------------------------------------------------------------- parsing


def test_parse_simple_names_and_numbers():
    assert parse("kv_pos <= q_pos") == Binary(op="<=", left=Name(id="kv_pos"), right=Name(id="q_pos"))
    assert parse("42") == Const(value=42)
    assert parse("1.5") == Const(value=1.5)
    assert parse(".5e1") == Const(value=5.0)
    assert parse("2e3") == Const(value=2000.0)
    assert parse("true") == Const(value=True) and parse("True") == Const(value=True)
    assert parse("false") == Const(value=False) and parse("False") == Const(value=False)
    assert parse("t[q_row, 1]") == Index(tensor="t", indices=(Name(id="q_row"), Const(value=1)))
    assert parse("max(1, 2, 3)") == Call(func="max", args=(Const(value=1), Const(value=2), Const(value=3)))
    assert parse("min()") == Call(func="min", args=())  # arity is the type checker's business


def test_node_positions_are_offsets():
    node = parse("kv_pos <= q_pos")
    assert node.pos == 7 and node.left.pos == 0 and node.right.pos == 10


def test_or_binds_weaker_than_and():
    assert to_source(parse("a or b and c")) == "(a or (b and c))"
    assert to_source(parse("a and b or c")) == "((a and b) or c)"
    assert to_source(parse("a or b or c")) == "((a or b) or c)"


def test_not_binds_tighter_than_and_weaker_than_comparison():
    assert to_source(parse("not a and b")) == "((not a) and b)"
    assert to_source(parse("not a == b")) == "(not (a == b))"
    assert to_source(parse("not not a")) == "(not (not a))"
    assert to_source(parse("a or not b")) == "(a or (not b))"


def test_chained_comparison_expands_to_and():
    node = parse("a < b <= c")
    assert node == Binary(
        op="and",
        left=Binary(op="<", left=Name(id="a"), right=Name(id="b")),
        right=Binary(op="<=", left=Name(id="b"), right=Name(id="c")),
    )
    assert to_source(parse("a < b < c < d")) == "(((a < b) and (b < c)) and (c < d))"


def test_arithmetic_precedence():
    assert to_source(parse("a + b * c")) == "(a + (b * c))"
    assert to_source(parse("a - b - c")) == "((a - b) - c)"
    assert to_source(parse("a * b // c % d")) == "(((a * b) // c) % d)"
    assert to_source(parse("a / b + c")) == "((a / b) + c)"
    assert to_source(parse("(a + b) * c")) == "((a + b) * c)"
    assert to_source(parse("a + b < c * d")) == "((a + b) < (c * d))"


def test_unary_minus():
    assert parse("-3") == Const(value=-3)  # folded into the literal
    assert parse("-2.5") == Const(value=-2.5)
    assert parse("- - 3") == Const(value=3)
    assert parse("-a") == Unary(op="-", operand=Name(id="a"))
    assert parse("+a") == Unary(op="+", operand=Name(id="a"))
    assert to_source(parse("-a * b")) == "((-a) * b)"
    assert to_source(parse("a - -b")) == "(a - (-b))"
    assert to_source(parse("a--1")) == "(a - -1)"


def test_floordiv_and_mod_tokens():
    assert parse("a // b") == Binary(op="//", left=Name(id="a"), right=Name(id="b"))
    assert parse("a % b") == Binary(op="%", left=Name(id="a"), right=Name(id="b"))
    with pytest.raises(SpecError, match="found '/'"):  # '/ /' is not '//'
        parse("a/ /b")


def test_conditional():
    node = parse("x if c else y")
    assert node == Cond(test=Name(id="c"), then=Name(id="x"), orelse=Name(id="y"))
    # right associative; the test is an `or` expression
    assert to_source(parse("a if b else c if d else e")) == "(a if b else (c if d else e))"
    assert to_source(parse("a if b or c else d")) == "(a if (b or c) else d)"
    assert to_source(parse("1 + (x if c else y)")) == "(1 + (x if c else y))"


def test_whitespace_and_newlines_are_ignored():
    assert parse("kv_pos\n<=\tq_pos\r\n") == parse("kv_pos <= q_pos")


def test_int_min_literal_is_allowed():
    node = typed("-2147483648 < kv_pos")
    assert node.left == Const(value=-(2**31))


@pytest.mark.parametrize(
    "text",
    [
        "kv_pos <= q_pos",
        "kv_pos <= q_pos and (w < 0 or q_pos - kv_pos <= w)",
        "kv_pos // w == q_pos // w",
        "t[q_row, 0] <= kv_pos and kv_pos <= t[q_row, 1]",
        "not (flag and kv_pos % 3 == 1) or -q_pos > -5",
        "(1.5 if flag else 2) * f / 3.0 >= float(kv_len)",
        "min(q_pos, kv_pos, 3) == max(abs(-w), 0)",
        "tanh(f) + exp(f) - log(f) * sqrt(f) + sigmoid(-f) > 0.0",
        "a < b <= c != d",
        "1e-07 < f",
        "-2147483648 < q_pos",
        "x if c else y if d else -z",
    ],
)
def test_to_source_round_trips(text):
    node = parse(text)
    canon = to_source(node)
    assert parse(canon) == node
    assert to_source(parse(canon)) == canon


def test_to_source_of_typed_tree_equals_untyped():
    text = "kv_pos <= q_pos and (w < 0 or q_pos - kv_pos <= w)"
    assert to_source(typed(text)) == to_source(parse(text))


def test_to_source_rejects_non_nodes():
    with pytest.raises(TypeError):
        to_source("kv_pos")  # type: ignore[arg-type]


def test_names_used():
    node = parse("t[q_row, w] + s[kv_head] > f and flag")
    assert nodes.names_used(node) == {"t", "q_row", "w", "s", "kv_head", "f", "flag"}


# ----------------------------------------------------------------------------- typing


def test_types_of_well_typed_expressions():
    assert typed("kv_pos <= q_pos").ty is Type.BOOL
    assert typed("kv_pos + 1").ty is Type.INT
    assert typed("kv_pos + 1.0").ty is Type.FLOAT
    assert typed("kv_pos / 2").ty is Type.FLOAT  # '/' is float division
    assert typed("kv_pos // 2").ty is Type.INT
    assert typed("t[q_row, 0]").ty is Type.INT
    assert typed("s[0]").ty is Type.FLOAT
    assert typed("min(1, 2)").ty is Type.INT
    assert typed("min(1, 2.0)").ty is Type.FLOAT
    assert typed("abs(w)").ty is Type.INT
    assert typed("abs(f)").ty is Type.FLOAT
    assert typed("tanh(1)").ty is Type.FLOAT
    assert typed("1 if flag else 2").ty is Type.INT
    assert typed("1 if flag else 2.0").ty is Type.FLOAT
    assert typed("flag == (kv_pos > 0)").ty is Type.BOOL
    assert typed("logits * 2", LOGITS_ENV).ty is Type.FLOAT


def test_expected_float_accepts_int():
    assert typed("kv_pos", expect=Type.FLOAT).ty is Type.INT


def test_typecheck_fills_every_node():
    node = typed("kv_pos <= q_pos and (w < 0 or q_pos - kv_pos <= w)")
    assert all(n.ty is not None for n in nodes.walk(node))


def test_unknown_name_with_suggestion():
    err = error("kv_poss <= q_pos")
    assert where(err) == at(0)
    assert err.message.startswith("unknown name `kv_poss`; known names: f, flag, kv_head, kv_len, kv_pos,")
    assert err.hint == "did you mean `kv_pos`?"
    text = str(err)
    assert text.startswith(f"{at(0)}: mask: unknown name `kv_poss`")
    assert "\n    kv_poss <= q_pos\n    ^" in text
    assert text.endswith("\n  hint: did you mean `kv_pos`?")


def test_unknown_name_without_close_match_has_no_hint():
    err = error("zzzzzz > 0")
    assert err.hint is None and "hint" not in str(err)


def test_caret_points_into_the_line():
    err = error("kv_pos <= q_pos and bogus_name")
    assert where(err) == at(20)
    assert str(err).splitlines()[1:3] == ["    kv_pos <= q_pos and bogus_name", "    " + " " * 20 + "^"]


def test_bool_used_as_int():
    err = error("kv_pos + true")
    assert where(err) == at(9)
    assert err.message == "'+' needs numbers, got bool"
    assert err.hint == "bools are not numbers here; use `1 if test else 0`"
    assert error("kv_pos < flag").message == "'<' compares numbers, got a bool operand"
    assert error("-flag").message == "unary '-' needs a number, got bool"
    assert error("abs(flag)").message == "`abs` needs numbers, got bool"
    assert error("t[flag, 0] > 0").message == "index of `t` must be an int, got bool"


def test_int_used_as_bool():
    err = error("w and flag")
    assert where(err) == at(0)
    assert err.message == "'and' needs bool operands, got int"
    assert err.hint == "compare the number first, e.g. `x != 0`"
    assert error("flag or kv_pos").message == "'or' needs bool operands, got int"
    not_err = error("not w")
    assert not_err.message == "'not' needs a bool, got int"
    assert not_err.hint == "compare first, e.g. `not (x > 0)`"
    cond = error("1 if w else 2")
    assert cond.message == "the test of 'a if test else b' must be a bool, got int"
    assert where(cond) == at(5)


def test_expected_type_of_the_whole_expression():
    err = error("kv_pos + 1", expect=Type.BOOL)
    assert err.message == "expression must be a bool, got int"
    assert err.hint == "a mask must be true where the key is visible, e.g. `kv_pos <= q_pos`"
    assert where(err) == at(0)
    err = error("kv_pos < 1", expect=Type.FLOAT)
    assert err.message == "expression must be a float, got bool" and err.hint is None


def test_mixed_branch_kinds():
    err = error("1 if flag else true")
    assert err.message == "both branches of 'a if test else b' must have the same kind, got int and bool"
    assert where(err) == at(2)


def test_tensor_indexed_with_wrong_number_of_indices():
    err = error("t[q_row] > 0")
    assert err.message == "tensor `t` has 2 dimension(s) but is indexed with 1"
    assert where(err) == at(0)
    assert error("s[0, 1] > 0").message == "tensor `s` has 1 dimension(s) but is indexed with 2"
    assert error("s[] > 0").message == "tensor `s` has 1 dimension(s) but is indexed with 0"


def test_float_index():
    err = error("t[q_row, f] > 0")
    assert err.message == "index of `t` must be an int, got float"
    assert where(err) == at(9)


def test_indexing_a_scalar():
    err = error("w[0] > 0")
    assert err.message == "`w` is a scalar and cannot be indexed; declared tensors: s, t"
    assert error("kv_pos[0] > 0").message.startswith("`kv_pos` is a scalar and cannot be indexed")
    undeclared = error("doc_idz[0] > 0")
    assert undeclared.message == "`doc_idz` is not a declared tensor and cannot be indexed; declared tensors: s, t"
    empty = error("x[0] > 0", TypeEnv({}, {}))
    assert empty.message.endswith("declared tensors: (none)")


def test_tensor_without_index():
    err = error("t > 0")
    assert err.message == "tensor `t` must be indexed, e.g. t[i, i]"


def test_calling_a_tensor():
    err = error("t(1, 2) > 0")
    assert err.message == "tensor `t` is indexed with [...], not called"
    assert err.hint == "write t[...]"
    assert where(err) == at(0)


def test_unknown_function():
    err = error("mn(1, 2) > 0")
    assert err.message == ("unknown function `mn`; functions: abs, bit, exp, float, log, max, min, sigmoid, sqrt, "
                           "tanh")
    assert err.hint == "did you mean `min`?"


def test_function_used_as_a_name():
    assert error("min > 0").message == "`min` is a function: call it, e.g. min(...)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("min(1) > 0", "`min` takes 2 to 8 argument(s), got 1"),
        ("max(1, 2, 3, 4, 5, 6, 7, 8, 9) > 0", "`max` takes 2 to 8 argument(s), got 9"),
        ("abs(1, 2) > 0", "`abs` takes 1 argument(s), got 2"),
        ("tanh() > 0", "`tanh` takes 1 argument(s), got 0"),
        ("float(1, 2) > 0", "`float` takes 1 argument(s), got 2"),
        ("bit(w)", "`bit` takes 2 argument(s), got 1"),
    ],
)
def test_wrong_function_arity(text, message):
    err = error(text)
    assert err.message == message
    assert where(err) == at(0)


@pytest.mark.parametrize(
    ("text", "message", "offset"),
    [
        ("kv_pos // 0 == 0", "'//' by zero", 10),
        ("kv_pos % 0 == 0", "'%' by zero", 9),
        ("kv_pos / 0 > 0", "division by zero", 9),
        ("kv_pos / 0.0 > 0", "division by zero", 9),
        # a divisor written as an expression of constants (`(1 - 1)`) used to pass and divide
        # by zero at run time, though the language promises an error at load time
        ("kv_pos // (1 - 1) == 0", "'//' by zero: `1 - 1` is 0", 13),
        ("kv_pos % min(0, 5) == 0", "'%' by zero: `min(0, 5)` is 0", 9),
        ("kv_pos / (2 * 3 % 3) > 0", "division by zero: `(2 * 3) % 3` is 0", 16),
        ("kv_pos // -(4 // 8) == 0", "'//' by zero: `-(4 // 8)` is 0", 10),
    ],
)
def test_division_by_constant_zero(text, message, offset):
    err = error(text)
    assert err.message == message
    assert where(err) == at(offset)


def test_division_by_a_variable_is_allowed():
    assert typed("kv_pos // w == 0").ty is Type.BOOL
    assert typed("kv_pos % (w - w) == 0").ty is Type.BOOL


def test_floordiv_needs_ints():
    assert error("f // 2 > 0").message == "'//' needs int operands, got float"
    assert error("1.5 % 2 > 0").message == "'%' needs int operands, got float"


def test_bit_is_a_bool_of_two_ints():
    node = typed("bit(t[q_row, 1], kv_pos - q_pos) and not bit(w, 3)", expect=Type.BOOL)
    assert node.ty is Type.BOOL and node.left.ty is Type.BOOL
    assert to_source(node) == "(bit(t[q_row, 1], (kv_pos - q_pos)) and (not bit(w, 3)))"
    assert typed("bit(w, 0) == flag").ty is Type.BOOL  # a bool: compared with bools only


@pytest.mark.parametrize(
    ("text", "message", "offset"),
    [
        ("bit(f, 1)", "`bit(x, i)` tests a bit of an int: x (the int whose bit is tested) is a float", 4),
        ("bit(w, 1.5)", "`bit(x, i)` tests a bit of an int: i (the bit index, 0 the lowest) is a float", 7),
        ("bit(w, flag)", "`bit` needs numbers, got bool", 7),
        ("bit(w, 1) + 1 > 0", "'+' needs numbers, got bool", 0),
        ("bit(w, 1) > 0", "'>' compares numbers, got a bool operand", 0),
    ],
)
def test_bit_type_errors(text, message, offset):
    err = error(text)
    assert err.message == message
    assert where(err) == at(offset)


def test_bit_cannot_be_declared():
    assert "bit" in expr.FUNCTIONS
    assert error("bit > 0").message == "`bit` is a function: call it, e.g. bit(...)"


def test_logits_only_in_transforms():
    err = error("logits > 0")
    assert err.message == "`logits` is only available in the `logits` transform, not in a mask"
    assert typed("logits > 0", LOGITS_ENV).ty is Type.BOOL


@pytest.mark.parametrize("literal", ["2147483648", "99999999999"])
def test_huge_int_literal(literal):
    err = error(f"kv_pos < {literal}")
    assert err.message == f"integer {literal} does not fit in 32 bits"
    assert where(err) == at(9)


@pytest.mark.parametrize("digits", [400, 4095 - 9])  # 4086: the longest literal an expression can hold
def test_very_long_int_literal_is_quoted_short(digits):
    err = error("kv_pos < " + "9" * digits)
    assert err.message == f"integer 9999999999999999...99999999 ({digits} characters) does not fit in 32 bits"


def test_negated_int_min_does_not_fit():
    assert error("-(-2147483648) > 0").message == "integer 2147483648 does not fit in 32 bits"


@pytest.mark.parametrize("literal", ["1e39", "3.5e38", "1e400", "3.4028236e38"])
def test_huge_float_literal(literal):
    err = error(f"f < {literal}")
    assert err.message == f"number {literal} does not fit in a 32-bit float"


def test_float_literal_limits():
    assert typed("f < 3.4028234e38").ty is Type.BOOL  # the largest float32
    assert error(f"f < {'9' * 50}.0").message == ("number 9999999999999999...999999.0 (52 characters) does not fit "
                                                  "in a 32-bit float")


def test_non_ascii_digits_are_not_numbers():
    err = error("kv_pos < \u0663")  # ARABIC-INDIC DIGIT THREE
    assert err.message == "unexpected character '\u0663'"
    assert where(err) == at(9)


def test_too_deep_parentheses():
    text = "(" * 70 + "kv_pos" + ")" * 70 + " > 0"
    err = error(text)
    assert err.message == f"expression is nested too deeply (more than {parsing.MAX_DEPTH} levels)"
    assert where(err).startswith(f"{FILE}:{LINE}:")


@pytest.mark.parametrize("text", ["not " * 70 + "flag", "-" * 70 + "1 > 0", "abs(" * 70 + "1" + ")" * 70 + " > 0"])
def test_too_deep_unary_and_calls(text):
    assert "nested too deeply" in error(text).message


@pytest.mark.parametrize(
    "text",
    [
        "1 + " * 500 + "1 > 0",  # long left-leaning chain: deep tree, no parentheses
        "kv_pos < " * 300 + "1",  # chained comparisons
        " or ".join(["flag"] * 200),
    ],
)
def test_long_operator_chains_are_refused_not_crashing(text):
    err = error(text)
    assert err.message == f"expression is nested too deeply (more than {parsing.MAX_TREE_DEPTH} levels of operations)"
    assert err.hint == "group long chains with parentheses, e.g. (a or b) or (c or d)"


def test_moderate_chains_are_fine():
    assert typed(" or ".join(["flag"] * 100)).ty is Type.BOOL
    assert typed("1 + " * 100 + "1 > 0").ty is Type.BOOL


def test_over_long_expression():
    text = "kv_pos <= q_pos and " * 250 + "true"
    err = error(text)
    assert err.message == f"expression is {len(text)} characters long; the limit is {parsing.MAX_EXPR_CHARS}"
    assert where(err) == at(0)


@pytest.mark.parametrize(
    ("text", "char", "offset", "hint"),
    [
        ("kv_pos <= q_pos && flag", "'&'", 16,
         "use 'and', 'or' and 'not' for boolean logic; bit(x, i) tests bit i of an int"),
        ("flag || flag", "'|'", 5, "use 'and', 'or' and 'not' for boolean logic; bit(x, i) tests bit i of an int"),
        ("!flag", "'!'", 0, "use 'and', 'or' and 'not' for boolean logic"),
        ("kv_pos = q_pos", "'='", 7, "use '==' to compare"),
        ("kv_pos $ 1", "'$'", 7, None),
        ('kv_pos < "1"', "'\"'", 9, None),
        ("kv_pos;", "';'", 6, None),
        ("kv_pos < 1\x00", "U+0000", 10, None),
        ("kv_pos\u00a0< 1", "U+00A0", 6, None),
    ],
)
def test_unexpected_character(text, char, offset, hint):
    err = error(text)
    assert err.message == f"unexpected character {char}"
    assert where(err) == at(offset)
    assert err.hint == hint


def test_empty_expression():
    err = error("   ")
    assert err.message == "expression is empty"
    assert where(err) == at(0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kv_pos q_pos", "unexpected 'q_pos' after a complete expression"),
        ("kv_pos <=", "expected a value (number, name or '('), found end of expression"),
        ("(kv_pos <= q_pos", "expected ')', found end of expression"),
        ("min(1, 2", "expected ')' closing the call, found end of expression"),
        ("t[1, 2 0", "expected ']' closing the index, found '0'"),
        ("1 if flag", "expected 'else' of the conditional 'a if test else b', found end of expression"),
        ("kv_pos <= )", "expected a value (number, name or '('), found ')'"),
        ("and flag", "expected a value (number, name or '('), found 'and'"),
    ],
)
def test_syntax_errors(text, message):
    assert error(text).message == message


def test_trailing_tokens_hint():
    err = error("kv_pos <= q_pos q_pos")
    assert err.hint == "join conditions with 'and' / 'or'; a conditional reads 'a if test else b'"
    assert where(err) == at(16)


# ----------------------------------------------------------------------------- index kinds

KIND_ENV = TypeEnv(
    scalars={"w": Type.INT, "f": Type.FLOAT},
    tensors={
        "p": TensorSig("p", ("batch",), Type.INT),
        "d": TensorSig("d", ("total_kv",), Type.INT),
        "r": TensorSig("r", ("total_q", 2), Type.INT),
        "h": TensorSig("h", ("num_qo_heads",), Type.FLOAT),
        "g": TensorSig("g", ("num_kv_heads", 3), Type.FLOAT),
        "fixed": TensorSig("fixed", (8,), Type.INT),
    },
)


@pytest.mark.parametrize("text", [
    "p[request] > 0",
    "d[kv_row] == d[q_kv_row]",
    "r[q_row, 0] <= kv_pos",
    "h[qo_head] > 0.0 and g[kv_head, 2] > 0.0",
    # an offset by a row-independent int keeps the kind
    "d[kv_row - 1] > 0", "d[1 + kv_row] > 0", "d[kv_row - w + 2] > 0", "d[+kv_row] > 0",
    "d[q_kv_row - kv_len] > 0", "r[q_row + qo_len - 1, 1] > 0", "d[kv_row + p[request]] > 0",
    "d[kv_row - (1 if w > 0 else 2)] > 0", "h[qo_head + 1] > 0.0",
    # fixed sizes take any int
    "fixed[kv_pos] > 0", "fixed[2 * q_row + kv_row] > 0", "r[q_row, q_idx] > 0", "fixed[-5] > 0",
    # rows are ordinary ints outside an index
    "2 * q_row > kv_row and float(qo_head + 1) > 0.5",
])
def test_index_kinds_that_check(text):
    assert typed(text, KIND_ENV).ty is Type.BOOL


@pytest.mark.parametrize(("text", "offset", "message", "hint"), [
    ("p[q_row] > 0", 2,
     "`p` has batch rows (one row per request), but `q_row` indexes total_q rows (one row per query token, in the "
     "order of q)", "`p` is per request: index it with request"),
    ("d[kv_pos] > 0", 2,
     "`kv_pos` is a position within its request, but `d` has total_kv rows (one row per key token, requests back "
     "to back): it would read the first request's rows for every request",
     "`d` is per key token: index it with kv_row (the row of kv_pos in the batch)"),
    ("d[q_pos + 1] > 0", 8,
     "`q_pos` is a position within its request, but `d` has total_kv rows (one row per key token, requests back "
     "to back): it would read the first request's rows for every request",
     "`d` is per key token: index it with q_kv_row (the row of q_pos in the batch)"),
    ("r[q_idx, 0] > 0", 2,
     "`q_idx` is a position within its request, but dimension 0 of `r` has total_q rows (one row per query token, "
     "in the order of q): it would read the first request's rows for every request",
     "`r` is per query token: index it with q_row (the row of q_idx in the batch)"),
    ("p[kv_pos] > 0", 2,
     "`kv_pos` is a position within its request, but `p` has batch rows (one row per request): it would read the "
     "first request's rows for every request", "`p` is per request: index it with request"),
    ("r[0, 1] > 0", 2, "dimension 0 of `r` has total_q rows (one row per query token, in the order of q); `0` is "
     "not a row index", "`r` is per query token: index it with q_row"),
    ("h[w] > 0.0", 2, "`h` has num_qo_heads rows (one row per query head); `w` is not a row index",
     "`h` is per query head: index it with qo_head"),
    ("h[kv_head] > 0.0", 2, "`h` has num_qo_heads rows (one row per query head), but `kv_head` indexes "
     "num_kv_heads rows (one row per key/value head)", "`h` is per query head: index it with qo_head"),
    ("d[2 * kv_row] > 0", 4,
     "`2 * kv_row` is not a row of `d` (total_kv): it computes with the row index `kv_row`, and only adding or "
     "subtracting an offset keeps an index a row",
     "`d` is per key token: index it with kv_row or q_kv_row, or kv_row + k / kv_row - k with k the same for every "
     "row of the request"),
    ("d[-kv_row] > 0", 2,
     "`-kv_row` is not a row of `d` (total_kv): it computes with the row index `kv_row`, and only adding or "
     "subtracting an offset keeps an index a row",
     "`d` is per key token: index it with kv_row or q_kv_row, or kv_row + k / kv_row - k with k the same for every "
     "row of the request"),
    ("d[q_row + kv_row] > 0", 8,
     "`q_row + kv_row` combines the row indices `q_row` and `kv_row`, which makes no row of any tensor",
     "`d` is per key token: index it with kv_row or q_kv_row"),
    ("d[kv_row + request] > 0", 9,
     "`kv_row + request` combines the row indices `kv_row` and `request`, which makes no row of any tensor",
     "`d` is per key token: index it with kv_row or q_kv_row"),
    ("d[kv_row - kv_pos] > 0", 11,
     "the offset `kv_pos` of `kv_row` reads `kv_pos`, which changes from row to row; an offset must be the same "
     "for every row of the request", "offset by ints, scalars, qo_len, kv_len or tensors indexed by request"),
    ("d[kv_row + d[q_kv_row]] > 0", 11,
     "the offset `d[q_kv_row]` of `kv_row` reads `q_kv_row`, which changes from row to row; an offset must be the "
     "same for every row of the request", "offset by ints, scalars, qo_len, kv_len or tensors indexed by request"),
    ("p[request + 1] > 0", 10,
     "`request + 1` would read another request's row of `p`: a query sees only its own request's values",
     "index `p` with request itself"),
    ("d[kv_row if w > 0 else q_kv_row] > 0", 9,
     "`kv_row if (w > 0) else q_kv_row` is not a row of `d` (total_kv): it computes with the row index `kv_row`, "
     "and only adding or subtracting an offset keeps an index a row",
     "`d` is per key token: index it with kv_row or q_kv_row, or kv_row + k / kv_row - k with k the same for every "
     "row of the request"),
])
def test_index_kind_mismatches(text, offset, message, hint):
    err = error(text, KIND_ENV)
    assert err.message == message
    assert err.hint == hint
    assert where(err) == at(offset)


def test_row_index_decomposition():
    ref = expr.row_index(parse("1 + kv_row - w"))
    assert ref.builtin == "kv_row" and ref.kind == "total_kv"
    assert [(sign, to_source(term)) for sign, term in ref.offsets] == [(1, "1"), (-1, "w")]
    assert expr.row_index(parse("q_kv_row")) == expr.RowIndex("q_kv_row")
    for text in ("kv_pos - 1", "2 * kv_row", "w - kv_row", "-q_row", "min(kv_row, 3)"):
        assert expr.row_index(parse(text)) is None, text


# ----------------------------------------------------------------------------- locations


def test_multi_line_source_locations():
    # A literal block: each line of the expression starts at its own file position.
    text = "kv_pos <= q_pos and\n  bogus >= 0"
    source = SourceText(text, "b.yaml", ((10, 3), (11, 3)), "mask")
    with pytest.raises(SpecError) as info:
        expr.parse_typed(source, ENV)
    err = info.value
    assert str(err.location) == "b.yaml:11:5"
    assert err.source_line == "  bogus >= 0" and err.caret_col == 3
    assert str(err).splitlines()[1:3] == ["      bogus >= 0", "      ^"]


def test_positions_override_line_starts():
    positions = tuple((7, 20 + i) for i in range(6))
    source = SourceText("a + b", "p.yaml", ((1, 1),), "logits", positions)
    assert source.locate(4) == Location("p.yaml", 7, 24)
    assert source.locate(99) == Location("p.yaml", 7, 25)


def test_location_rendering():
    assert str(Location("f.yaml", 0, 0)) == "f.yaml"
    assert str(Location("f.yaml", 3, 0)) == "f.yaml:3"
    assert str(Location("f.yaml", 3, 4)) == "f.yaml:3:4"


def test_every_error_message_starts_with_its_location():
    pattern = re.compile(rf"^{re.escape(FILE)}:{LINE}:\d+: mask: ")
    for text in ["kv_pos +", "x", "t[1]", "w[1]", "min(1)", "1 // 0", "&", "9" * 20, "", "flag + 1"]:
        assert pattern.match(str(error(text))), text


def test_an_int_expression_of_constants_must_fit_int32():
    """2147483647 + 1 is 2^31 to the reference (int64) and wraps in the kernel: refused where it
    is written, like a literal that does not fit."""
    for text, shown in (("kv_pos < 2147483647 + 1", "(2147483647 + 1)"), ("kv_pos < abs(-2147483648)",
                        "abs(-2147483648)"), ("kv_pos < 65536 * 65536 // 65536", "(65536 * 65536)")):
        with pytest.raises(SpecError) as err:
            variantgen.parse_spec(f"name: x\nmask: {text}\n", "c.yaml")
        value = eval(shown)  # (Python's ints: the reference's value)
        assert err.value.message == f"`{shown}` is {value}, outside the 32-bit int range (the kernel would wrap it)"
        assert str(err.value.location).startswith("c.yaml:2:")
    variantgen.parse_spec("name: x\nmask: kv_pos < -2147483648 + 2147483647 and kv_pos <= q_pos + 2147483647\n")


def test_a_float_literal_is_rounded_once():
    """1.0000000596046448 is just above the tie between 1 and 1 + 2^-23: C++ rounds `...f` up,
    while rounding through the double lands on the tie and rounds to even (1.0)."""
    from variantgen.codegen import expressions as codegen
    from variantgen.lang.nodes import to_float32
    from variantgen.lang.parsing import float32_of_decimal

    assert to_float32(float("1.0000000596046448")) == 1.0
    assert float32_of_decimal("1.0000000596046448") == 1.0000001192092896 == 1 + 2**-23
    assert float32_of_decimal("0.1") == to_float32(0.1) and float32_of_decimal("16777217.0") == 16777216.0
    # A literal whose exponent is huge is still read at once (its exact value was a billion-digit
    # power of ten: a spec file could hang the loader; found by test_fuzz's token soup)
    started = time.monotonic()
    assert float32_of_decimal("1e-999999999") == 0.0 and float32_of_decimal("7e-46") == 0.0
    assert float32_of_decimal("8e-46") == 2**-149  # (above half the smallest float32: rounds up)
    variantgen.parse_spec("name: x\nmask: float(kv_pos) > 1e-999999999\n")
    assert time.monotonic() - started < 5
    spec = variantgen.parse_spec("name: x\nmask: float(kv_pos) < 1.0000000596046448 and float(q_pos) < 0.1\n")
    code = codegen.emit_mask(spec).code
    assert "1.0000001192092896f" in code and "0.1f" in code  # (an ordinary literal as written)
