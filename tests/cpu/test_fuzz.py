"""Hardening (issue 6): hostile spec files and expressions fail with located SpecErrors,
never with any other exception, and nothing from a spec reaches C++ except via codegen.

Hypothesis profiles: ``ci`` (default, ~300 examples over all fuzz tests, well under a
minute) and ``long`` (VARIANTGEN_FUZZ_PROFILE=long). bench/fuzz_long.py runs 10,000 cases
outside pytest.
"""

from __future__ import annotations

import os
import re

import fuzz_corpus
import pytest
import yaml
from click.testing import CliRunner
from conftest import SPEC_FILES
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import variantgen
from variantgen.codegen import expressions as codegen
from variantgen.codegen.render import ModuleConfig, kernel_args, render_module
from variantgen.core.errors import MAX_SPEC_ERRORS, SpecError, SpecErrors
from variantgen.lang import expr, nodes, parsing, yaml_reader
from variantgen.lang.expr import TypeEnv
from variantgen.lang.nodes import Type
from variantgen.lang.parsing import SourceText
from variantgen.tools.cli import main as cli_main

_COMMON = dict(
    deadline=None,
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)
# 8 fuzz tests: ~320 examples in CI (a few seconds); ~20,000 with the long profile (about a minute).
settings.register_profile("variantgen-fuzz-ci", max_examples=40, **_COMMON)
settings.register_profile("variantgen-fuzz-long", max_examples=2500, **_COMMON)
PROFILE = os.environ.get("VARIANTGEN_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"VARIANTGEN_FUZZ_PROFILE={PROFILE!r}: expected 'ci' or 'long'")
FUZZ = settings(settings.get_profile(f"variantgen-fuzz-{PROFILE}"))

PATH = "fuzz.yaml"
LOCATED = re.compile(rf"^{re.escape(PATH)}(:\d+(:\d+)?)?: \S")
EXPR_LOCATED = re.compile(r"^<string>:\d+:\d+: expression: \S")
YAML_BREAKS = re.compile("\r\n|[\r\n\x85\u2028\u2029]")
ROUND_TRIP_DEPTH = 24  # to_source parenthesises every operation; deeper trees may exceed MAX_DEPTH
SHIPPED = [p.read_text() for p in SPEC_FILES]
MARKER = "ZQXMARKER"  # put into descriptions and docs: must never reach the sources


# What one error may print at most: message and hint (600 each), field, location, two excerpt lines.
ERROR_CHARS = 1800


def errors_of(err: SpecError) -> list[SpecError]:
    return err.errors if isinstance(err, SpecErrors) else [err]


def check_error_text(err: SpecError, path: str = PATH) -> None:
    """Printable, at most MAX_SPEC_ERRORS errors of bounded size, each located in ``path``."""
    text = str(err)
    text.encode("utf-8")  # a lone surrogate would make printing fail
    errors = errors_of(err)
    assert len(errors) <= MAX_SPEC_ERRORS
    assert len(text) <= (len(errors) + 1) * (ERROR_CHARS + len(path)), len(text)


def check_spec(text: str):
    """parse_spec(text): a spec, or a SpecError whose every message starts with a location."""
    try:
        spec = variantgen.parse_spec(text, PATH)
    except SpecError as e:
        assert LOCATED.match(str(e)), str(e)
        check_error_text(e)
        n_lines = len(YAML_BREAKS.findall(text)) + 2
        for one in errors_of(e):
            assert LOCATED.match(str(one)), str(one)
            assert one.location.file == PATH
            assert 0 <= one.location.line <= n_lines, (one.location, n_lines)
        return None
    exercise(spec)
    return spec


def exercise(spec) -> None:
    """Everything downstream of a valid spec must work on it too."""
    assert spec.mask.ty is Type.BOOL
    codegen.emit_mask(spec)
    codegen.emit_logits(spec)
    codegen.emit_sink(spec)
    kernel_args(spec)
    if all(node is None or shallow(node) for node in (spec.mask, spec.logits, spec.sink)):
        assert variantgen.parse_spec(_canonical_yaml(spec), PATH).digest == spec.digest
    if "fa2" in spec.backends:
        module = render_module(ModuleConfig(spec, 64, 64, "fp16", "fp16", "fp16", "8.0"))
        assert MARKER not in "\n".join(module.files.values())


def shallow(node: nodes.Node) -> bool:
    return parsing._deeper_than(node, ROUND_TRIP_DEPTH) is None


def _canonical_yaml(spec) -> str:
    """A spec file rebuilt from a spec's canonical form (re-parsing it must give the same digest)."""
    c = spec.canonical()
    doc: dict = {"name": c["name"], "mask": c["mask"]}
    if c["logits"] is not None:
        doc["logits"] = c["logits"]
    if "sink" in c:
        doc["sink"] = c["sink"]
    if c["tensors"]:
        doc["tensors"] = {n: {"dtype": d, "shape": s} for n, d, s in c["tensors"]}
    if c["scalars"]:
        doc["scalars"] = {n: {"dtype": d, "default": v} for n, d, v in c["scalars"]}
    doc["scales"] = {"sm_scale": c["sm_scale"] if c["sm_scale"] is not None else "default",
                     "qkv_scales": c["qkv_scales"]}
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


# ----------------------------------------------------------------------------- strategies

YAML_TOKENS = [*fuzz_corpus.YAML_TOKENS, MARKER]
EXPR_TOKENS = fuzz_corpus.EXPR_TOKENS
ENV = TypeEnv(fuzz_corpus.ENV.scalars, fuzz_corpus.ENV.tensors)
LOGITS_ENV = TypeEnv(ENV.scalars, ENV.tensors, allow_logits=True)

any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=300)
yaml_soup = st.lists(st.sampled_from(YAML_TOKENS) | st.text(max_size=4), max_size=80).map("".join)
expr_soup = st.lists(st.sampled_from(EXPR_TOKENS), max_size=40).map(" ".join)
expr_soup_tight = st.lists(st.sampled_from(EXPR_TOKENS), max_size=40).map("".join)


def _expr_tree(depth: int):
    """Well-formed-ish expressions: right grammar, random names, types and literals."""
    leaf = st.one_of(
        st.sampled_from(["kv_pos", "q_pos", "q_idx", "kv_len", "w", "f", "flag", "logits", "undefined_name",
                         "true", "false"]),
        st.integers(min_value=-(2**33), max_value=2**33).map(str),
        st.floats(allow_nan=False, allow_infinity=False, width=64).map(repr),
        st.sampled_from(["t[q_row, 0]", "s[qo_head]", "t[1]", "s[f]", "w[0]", "t(1)", "min(1)", "t[q_row - w, 1]",
                         "t[1 + q_row, 0]", "t[kv_row, 0]", "t[q_idx, 1]", "t[2 * q_row, 0]", "t[q_row + kv_pos, 0]",
                         "s[kv_pos - 1]", "t[q_row + qo_len, 1]", "bit(t[q_row, 1], kv_pos - q_pos)",
                         "bit(w, kv_pos % 32)", "bit(f, 1)", "bit(w)"]),
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%", "<", "<=", "==", "!=", "and", "or"]),
                      inner).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
            inner.map(lambda e: f"({e})"),
            inner.map(lambda e: f"not {e}"),
            inner.map(lambda e: f"-{e}"),
            st.tuples(inner, inner, inner).map(lambda t: f"{t[0]} if {t[1]} else {t[2]}"),
            st.tuples(st.sampled_from(["min", "max", "abs", "tanh", "float", "bit"]), st.lists(inner, min_size=1,
                      max_size=3)).map(lambda t: f"{t[0]}({', '.join(t[1])})"),
        ),
        max_leaves=depth,
    )


expressions = _expr_tree(40)
names = st.one_of(
    st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True),
    st.sampled_from(["params", "kv_len", "q_indptr", "int", "vg_x", "Abc", "../x", "a/b", "x\0", "x" * 60,
                     "x); asm(\"trap\");", "#include <x>", "../../etc", "sm_scale", "logits", "min", "and"]),
    st.text(max_size=12),
)
HUGE = "ZQXHUGE"  # replaced by a 5000-digit int after dumping (the YAML dumper cannot print one)
scalar_values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**40), max_value=2**40), st.floats(), st.text(max_size=8),
    st.just(10**400), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                           max_size=2),
    st.just(HUGE), st.just("\ud83d"), st.just("causal\n"),
)


@st.composite
def structured_specs(draw):
    """A dict shaped like a spec, with random omissions and wrong types, dumped as YAML."""
    doc: dict = {}
    if draw(st.integers(0, 9)) > 0:
        doc["name"] = draw(st.one_of(names, scalar_values))
    if draw(st.integers(0, 9)) > 0:
        doc["mask"] = draw(st.one_of(expressions, expressions, scalar_values))
    if draw(st.booleans()):
        doc["description"] = draw(st.one_of(st.text(max_size=40).map(lambda s: MARKER + s), scalar_values))
    if draw(st.booleans()):
        doc["tensors"] = draw(st.dictionaries(
            names,
            st.one_of(
                st.fixed_dictionaries({
                    "dtype": st.sampled_from(["int32", "float32", "float64", 1]),
                    "shape": st.lists(st.sampled_from(["total_q", "total_kv", "batch", "num_qo_heads",
                                                       "num_kv_heads", 2, 0, 70000, "total_qq", True]),
                                      max_size=5),
                }, optional={"doc": st.text(max_size=10).map(lambda s: MARKER + s), "extra": scalar_values}),
                scalar_values,
            ),
            max_size=3,
        ))
    if draw(st.booleans()):
        doc["scalars"] = draw(st.dictionaries(
            names,
            st.one_of(
                st.fixed_dictionaries({"dtype": st.sampled_from(["int", "float", "bool", "int32"]),
                                       "default": scalar_values},
                                      optional={"doc": st.text(max_size=10).map(lambda s: MARKER + s),
                                                "min": scalar_values, "max": scalar_values,
                                                "positive": scalar_values}),
                scalar_values,
            ),
            max_size=3,
        ))
    if draw(st.booleans()):
        doc["logits"] = draw(st.one_of(expressions.map(lambda e: f"logits + {e}"), expressions, scalar_values))
    if draw(st.integers(0, 3)) == 0:
        doc["sink"] = draw(st.one_of(expressions, st.sampled_from(["s[qo_head]", "s[q_row]", "0", "-1.5e3"]),
                                     scalar_values))
    if draw(st.booleans()):
        doc["scales"] = draw(st.one_of(
            st.fixed_dictionaries({}, optional={"sm_scale": scalar_values, "qkv_scales": scalar_values,
                                                "other": scalar_values}),
            scalar_values,
        ))
    if draw(st.booleans()):
        doc["backends"] = draw(st.one_of(st.lists(st.sampled_from(["fa2", "fa3", "fa4", 2]), max_size=3),
                                         scalar_values))
    if draw(st.booleans()):
        doc[draw(st.text(max_size=8))] = draw(scalar_values)
    items = list(doc.items())
    order = draw(st.permutations(range(len(items))))
    text = yaml.safe_dump(dict(items[i] for i in order), sort_keys=False, allow_unicode=draw(st.booleans()),
                          default_style=draw(st.sampled_from([None, None, "'", '"', "|"])))
    if draw(st.booleans()) and items:  # duplicate a key line
        lines = text.splitlines(keepends=True)
        text += draw(st.sampled_from(lines))
    return text.replace(HUGE, draw(st.sampled_from(["9" * 5000, "0x" + "F" * 4000, "-" + "1" * 4500])))


@st.composite
def mutated_shipped(draw):
    text = draw(st.sampled_from(SHIPPED))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["insert", "delete", "replace", "dup_line", "swap_lines", "truncate", "indent"]))
        pos = draw(st.integers(0, len(text)))
        if op == "insert":
            text = text[:pos] + draw(st.sampled_from(YAML_TOKENS) | st.text(max_size=6)) + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 20)):]
        elif op == "replace" and text:
            pos = min(pos, len(text) - 1)
            text = text[:pos] + draw(st.characters()) + text[pos + 1:]
        elif op in ("dup_line", "swap_lines", "indent"):
            lines = text.splitlines(keepends=True) or [""]
            i = draw(st.integers(0, len(lines) - 1))
            j = draw(st.integers(0, len(lines) - 1))
            if op == "dup_line":
                lines.insert(j, lines[i])
            elif op == "swap_lines":
                lines[i], lines[j] = lines[j], lines[i]
            else:
                lines[i] = draw(st.sampled_from([" ", "  ", "\t", "- "])) + lines[i]
            text = "".join(lines)
        elif op == "truncate":
            text = text[:pos]
    return text


# ----------------------------------------------------------------------------- spec fuzzing


@FUZZ
@given(any_text)
@example("")
@example("name: x\nmask: kv_pos <= q_pos\nscales: {sm_scale: " + "9" * 400 + "}\n")
@example("name: x\nmask: kv_pos <= q_pos\nscalars:\n  f: {dtype: float, default: " + "9" * 400 + "}\n")
@example("name: x\nmask: " + "1 + " * 500 + "1 > 0\n")
@example("name: x\nmask: " + "(" * 200 + "\n")
@example("name: x\nmask: kv_pos <= q_pos\ndescription: " + "[" * 100_000 + "\n")
@example("\ud800")
def test_random_text(text):
    check_spec(text)


@FUZZ
@given(yaml_soup)
def test_yaml_token_soup(text):
    check_spec(text)


@FUZZ
@given(mutated_shipped())
def test_mutated_shipped_specs(text):
    check_spec(text)


@FUZZ
@given(structured_specs())
def test_structured_specs(text):
    check_spec(text)


@FUZZ
@given(st.binary(max_size=400))
@example(b"name: x\nmask: kv_pos <= q_pos\ndescription: caf\xe9\n")
@example(b"\xff\xfe")
@example(b"\x00")
def test_binary_junk_files(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("junk") / "fuzz.yaml"
    path.write_bytes(data)
    try:
        spec = variantgen.load_spec(path)
    except SpecError as e:
        assert str(e).startswith(str(path)), str(e)
        return
    exercise(spec)


# ----------------------------------------------------------------------------- expression fuzzing


def check_expr(text: str, env: TypeEnv = ENV, expect: Type | None = None):
    src = SourceText(text)
    try:
        tree = parsing.parse(src)
    except SpecError as e:
        assert EXPR_LOCATED.match(str(e)), str(e)
        return None
    # a parsed tree prints back to text that parses to the same tree
    if shallow(tree):
        assert parsing.parse(nodes.to_source(tree)) == tree
    try:
        typed = expr.typecheck(tree, env, src, expect)
    except SpecError as e:
        for one in getattr(e, "errors", [e]):  # (ExprErrors: every independent error, each located)
            assert EXPR_LOCATED.match(str(one)), str(one)
        return None
    assert all(n.ty is not None for n in nodes.walk(typed))
    return typed


@FUZZ
@given(st.one_of(expr_soup, expr_soup_tight))
@example("(" * 65 + "1" + ")" * 65)
@example("1 + " * 1000 + "1")
@example("kv_pos < " * 400 + "1")
@example("9" * 5000)
@example("kv_pos <= q_pos && flag")
def test_expression_token_soup(text):
    check_expr(text)
    check_expr(text, LOGITS_ENV, Type.FLOAT)


@FUZZ
@given(expressions, st.sampled_from([None, Type.BOOL, Type.FLOAT]))
def test_generated_expressions(text, expect):
    typed = check_expr(text, LOGITS_ENV if expect is Type.FLOAT else ENV, expect)
    if typed is None or expect is not Type.BOOL:
        return
    # a well-typed mask goes all the way through a spec file and code generation
    doc = {"name": "fz", "scalars": {"w": {"dtype": "int", "default": 1}, "f": {"dtype": "float", "default": 1.0},
                                     "flag": {"dtype": "bool", "default": True}},
           "tensors": {"t": {"dtype": "int32", "shape": ["total_q", 2]}, "s": {"dtype": "float32", "shape": [4]}},
           "mask": text}
    spec = check_spec(yaml.safe_dump(doc, sort_keys=False))
    assert spec is not None
    if shallow(spec.mask):
        assert parsing.parse(spec.canonical()["mask"]) == spec.mask


@FUZZ
@given(any_text)
def test_random_text_expressions(text):
    check_expr(text)


# ----------------------------------------------------------------------------- injection


INJECTIONS = [
    'x); asm("trap");',
    "x) { asm(\"trap\"); } //",
    "#include <x>",
    "../../etc",
    "params",
    "params.q",
    "kv_len",
    "q_indptr",
    "__global__",
    "x\\\nasm",
    "x */ y",
    "`x`",
    "x; y",
    "x\u037e y",  # GREEK QUESTION MARK, looks like ';'
    "ｘ",  # fullwidth x
    "x\u200by",  # zero-width space
]


@pytest.mark.parametrize("payload", [p for p in INJECTIONS if p != "kv_len"])  # kv_len: a builtin here
def test_injection_in_expressions_is_refused(payload):
    for text in (payload, f"kv_pos <= {payload}", f"{payload} and kv_pos <= q_pos", f"t[{payload}, 0] > 0"):
        with pytest.raises(SpecError) as info:
            expr.parse_typed(SourceText(text, PATH, ((2, 7),), "mask"), ENV, Type.BOOL)
        assert str(info.value).startswith(f"{PATH}:2:")


@pytest.mark.parametrize("payload", INJECTIONS + ["vg_rows_x", "sm_scale", "v_scale", "window_left", "batch_idx",
                                                  "qo_idx", "kv_idx", "smem_ptr", "int32_t", "std", "Params"])
@pytest.mark.parametrize("section", ["tensors", "scalars"])
def test_injection_in_argument_names_is_refused(payload, section):
    decl = {"dtype": "int32", "shape": ["batch"]} if section == "tensors" else {"dtype": "int", "default": 0}
    text = yaml.safe_dump({"name": "x", "mask": "kv_pos <= q_pos", section: {payload: decl}}, sort_keys=False)
    with pytest.raises(SpecError) as info:
        variantgen.parse_spec(text, PATH)
    err = errors_of(info.value)
    assert len(err) == 1 and err[0].field == yaml_reader._shown(f"{section}.{payload}"), str(info.value)
    assert "\n" not in err[0].field and all(ch.isprintable() for ch in err[0].field)
    assert LOCATED.match(str(info.value))


@pytest.mark.parametrize("payload", ["..", "../x", "a/b", "/abs", "x\0y", "x" * 49, "x" * 10_000, "X", "x y", "x.so",
                                     "x\ny", 'x"; rm -rf /', "", "x-y", "é"])
def test_bad_spec_names_are_refused(payload):
    text = yaml.safe_dump({"name": payload, "mask": "kv_pos <= q_pos"})
    with pytest.raises(SpecError) as info:
        variantgen.parse_spec(text, PATH)
    assert LOCATED.match(str(info.value))
    assert info.value.field == "name"


def test_nul_byte_anywhere_is_refused():
    with pytest.raises(SpecError, match=r"^fuzz\.yaml:3: spec contains a NUL byte$"):
        variantgen.parse_spec("name: x\nmask: kv_pos <= q_pos\n# \0\n", PATH)


def test_spec_text_reaches_sources_only_through_codegen():
    text = f"""\
# {MARKER}_FILE_COMMENT #include <evil>
name: inj
description: "{MARKER}_DESC */ #include <evil> /* \\n #define X"
tensors:
  ids: {{dtype: int32, shape: [total_kv], doc: "{MARKER}_TDOC"}}
scalars:
  win: {{dtype: int, default: 7, doc: "{MARKER}_SDOC */"}}
mask: >-
  kv_pos <= q_pos and   ids[kv_row]==ids[q_kv_row]
  and (win < 0 or q_pos - kv_pos <= win)
logits: logits*1.0   # {MARKER}_EXPR_COMMENT
"""
    spec = variantgen.parse_spec(text, PATH)
    module = render_module(ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a"))
    sources = "\n".join(module.files.values())
    assert MARKER not in sources and "#include <evil>" not in sources and "#define X" not in sources
    # the expression text reaches comments only (codegen.comment_lines: whitespace normalised,
    # made safe), beside the canonical, re-generated form; the code comes from the tree
    quoted = [line for line in sources.splitlines() if "ids[kv_row]==ids[q_kv_row]" in line]
    assert quoted and all(line.lstrip().startswith("//") for line in quoted)
    assert "kv_pos <= q_pos and ids[kv_row]==ids[q_kv_row] and (win < 0" in sources  # one space between words
    assert all(f"{line}\n" in sources for line in codegen.comment_lines(nodes.to_source(spec.mask)))
    assert "params.ids[" in sources and "arg_win" in sources
    # every identifier that reads params comes from a declared argument or FlashInfer's own fields
    fields = set(re.findall(r"\bparams\.([A-Za-z_]\w*)", sources))
    assert fields <= {"ids", "win", "sm_scale", "v_scale", "vg_meta", "num_qo_heads", "paged_kv",
                      "get_qo_len", "get_kv_len"} | {"q", "k", "v", "o", "lse"}, fields


@pytest.mark.parametrize("text", [
    "name: x\nmask: !!python/object/apply:os.system ['echo pwned']\n",
    "name: x\nmask: kv_pos <= q_pos\ndescription: !!python/name:os.system\n",
    "name: x\nmask: kv_pos <= q_pos\ndescription: !!binary aGVsbG8=\n",
    "name: x\nmask: kv_pos <= q_pos\nx: &a [*a]\n",
    "a: &a [*a, *a, *a]\nb: &b [*a, *a, *a]\nc: &c [*b, *b, *b]\nname: x\nmask: kv_pos <= q_pos\n",
])
def test_yaml_code_execution_and_bombs_are_refused(text):
    with pytest.raises(SpecError) as info:
        variantgen.parse_spec(text, PATH)
    assert LOCATED.match(str(info.value))
    assert "not allowed in spec files" in str(info.value)


def test_long_error_lines_do_not_crash():
    text = "name: x\nmask: " + "kv_pos <= q_pos and " * 300 + "nope\n"
    with pytest.raises(SpecError, match=r"^fuzz\.yaml:2:7: mask: expression is \d+ characters long"):
        variantgen.parse_spec(text, PATH)


# ----------------------------------------------------------------------------- hostile files and validate


@pytest.mark.parametrize("name", sorted(fuzz_corpus.HOSTILE_SPECS))
def test_hostile_specs_fail_cleanly(name):
    with pytest.raises(SpecError) as info:
        variantgen.parse_spec(fuzz_corpus.HOSTILE_SPECS[name], PATH)
    assert LOCATED.match(str(info.value)), str(info.value)
    check_error_text(info.value)


def validate_files(tmp_path, texts: list[str | bytes]):
    """`variantgen validate` over one file per text: every file is reported (an ok line or
    errors located in it), nothing but SpecErrors, no traceback, bounded output per file."""
    paths = []
    for i, text in enumerate(texts):
        path = tmp_path / f"spec{i}.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        paths.append(path)
    result = CliRunner().invoke(cli_main, ["validate", *map(str, paths)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 1)
    # Every line belongs to a file: its ok line, an error (or "... and N more") starting with its
    # path, or the excerpt / hint lines under such an error.
    chars = dict.fromkeys(paths, 0)
    current = None
    for line in result.stdout.splitlines():
        owner = next((p for p in paths if line.startswith((f"{p}:", f"ok  {p} "))), None)
        if owner is None:
            assert current is not None and line.startswith("  "), line
        else:
            current = owner
        chars[current] += len(line) + 1
    for path, n in chars.items():
        assert n, f"{path} not reported"
        assert n <= (MAX_SPEC_ERRORS + 1) * (ERROR_CHARS + len(str(path))), (path, n)
    return result


@FUZZ
@given(st.lists(st.one_of(structured_specs(), mutated_shipped(), yaml_soup,
                          st.sampled_from(sorted(fuzz_corpus.HOSTILE_SPECS.values()))), min_size=1, max_size=4))
def test_validate_reports_every_file(tmp_path_factory, texts):
    validate_files(tmp_path_factory.mktemp("validate"), texts)


def test_validate_of_the_hostile_corpus_reports_every_file(tmp_path):
    texts = [*fuzz_corpus.HOSTILE_SPECS.values(), SHIPPED[0], b"\xff\xfe not utf-8"]
    result = validate_files(tmp_path, texts)
    assert result.exit_code == 1
    assert result.stdout.count("ok  ") == 1
    assert f"{len(texts) - 1} of {len(texts)} spec file(s) have errors" in result.stderr


def test_probe_keeps_a_bounded_reason_for_a_hostile_file(tmp_path, vg_env):
    """probe() memoizes the reason: it is the capped error text, not megabytes of it."""
    import importlib

    probe_mod = importlib.import_module("variantgen.api.probing")
    path = tmp_path / "hostile.yaml"
    path.write_text(fuzz_corpus.HOSTILE_SPECS["many bad keys on one line"])
    probe_mod.cache_clear()
    try:
        result = variantgen.probe(str(path), head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", page_size=16)
        assert not result
        reason = str(result.reason)
        assert reason.startswith(f"{path}: 8000 errors\n  1:34: k0: unknown field")
        assert len(reason) <= (MAX_SPEC_ERRORS + 1) * (ERROR_CHARS + len(str(path)))
    finally:
        probe_mod.cache_clear()
