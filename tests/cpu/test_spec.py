"""Spec files: every shipped spec loads; bad specs fail with exact, located messages."""

from __future__ import annotations

import keyword
import re
import time
import tracemalloc

import pytest
from conftest import SPEC_FILES, SPECS_DIR

import variantgen
from variantgen.core import errors as errors_mod
from variantgen.core.errors import SpecError, SpecErrors
from variantgen.lang import nodes, parsing, yaml_loader, yaml_reader
from variantgen.lang import spec as spec_mod
from variantgen.lang.nodes import Type
from variantgen.lang.reserved import reserved_reason

CAUSAL = "name: x\nmask: kv_pos <= q_pos\n"


def fails(text: str, path: str = "spec.yaml") -> SpecError:
    with pytest.raises(SpecError) as info:
        variantgen.parse_spec(text, path)
    return info.value


def all_errors(err: SpecError) -> list[SpecError]:
    return err.errors if isinstance(err, SpecErrors) else [err]


def one(text: str) -> SpecError:
    err = fails(text)
    errors = all_errors(err)
    assert len(errors) == 1, [str(e) for e in errors]
    return errors[0]


# ----------------------------------------------------------------------------- shipped specs


def test_specs_are_shipped():
    assert {p.stem for p in SPEC_FILES} >= {
        "alibi", "streaming_sink", "causal", "chunked_local", "document", "mm_prefix", "prefix_lm",
        "sliding_window", "softcap",
    }


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_every_shipped_spec_loads(path):
    spec = variantgen.load_spec(path)
    assert spec.name == path.stem
    assert spec.path == str(path)
    assert spec.mask.ty is Type.BOOL
    assert spec.description and spec.description == spec.description.strip()
    assert spec.backends == ("fa2", "fa3", "flex")  # every backend of capabilities.TABLE by default
    if spec.logits is not None:
        assert spec.logits.ty in (Type.FLOAT, Type.INT)
        assert "logits" in nodes.names_used(spec.logits)
    # the canonical form is stable and re-parses to the same tree
    assert parsing.parse(spec.canonical()["mask"]) == spec.mask
    assert len(spec.digest) == 64 and spec.digest == variantgen.load_spec(path).digest
    for name in spec.tensor_names + spec.scalar_names:
        assert spec_mod.ARG_RE.match(name)


def test_shipped_spec_details():
    mm = variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")
    assert mm.tensor_names == ("ranges",)
    assert mm.tensors[0].shape == ("total_q", 2) and mm.tensors[0].dtype == "int32"
    assert mm.scalar_names == ("causal_window_left", "range_window_left")
    assert [s.default for s in mm.scalars] == [-1, -1]
    softcap = variantgen.load_spec(SPECS_DIR / "softcap.yaml")
    assert softcap.scalars[0].default == 50.0 and isinstance(softcap.scalars[0].default, float)
    assert nodes.to_source(softcap.logits) == "(soft_cap * tanh((logits / soft_cap)))"
    assert softcap.uses("soft_cap") and softcap.uses("logits") and not softcap.uses("q_idx")


def test_digest_ignores_description_and_comments_but_not_the_mask(spec_from):
    a = spec_from("# one\nname: x\ndescription: first\nmask: kv_pos <= q_pos\n")
    b = spec_from("name: x\ndescription: second\nmask: 'kv_pos   <=   q_pos'  # two\n")
    c = spec_from("name: x\nmask: kv_pos < q_pos\n")
    assert a.digest == b.digest
    assert a.digest != c.digest


def test_optional_fields_and_defaults(spec_from):
    spec = spec_from(
        """
        name: full
        description: |
          Two lines
          of text.
        tensors:
          ids: {dtype: int32, shape: [total_kv], doc: "  ids  "}
          bias: {dtype: float32, shape: [num_qo_heads, 4]}
        scalars:
          n: {dtype: int, default: -3}
          g: {dtype: float, default: 2}
          enabled: {dtype: bool, default: false}
        mask: "ids[kv_row] == ids[q_kv_row] and (enabled or n < 0)"
        logits: logits * g + bias[qo_head, 3]
        scales: {sm_scale: 0.125, qkv_scales: false}
        backends: [fa2, fa3, fa2]
        """
    )
    assert spec.description == "Two lines\nof text."
    assert spec.tensors[0].doc == "ids" and spec.tensors[0].cpp_type == "int32_t"
    assert spec.tensors[1].cpp_type == "float" and spec.tensors[1].elem is Type.FLOAT
    assert [(s.name, s.dtype, s.default) for s in spec.scalars] == [("n", "int", -3), ("g", "float", 2.0),
                                                                    ("enabled", "bool", False)]
    assert isinstance(spec.scalars[1].default, float)
    assert spec.sm_scale == 0.125 and spec.qkv_scales is False
    assert spec.backends == ("fa2", "fa3")
    assert spec.logits_text == "logits * g + bias[qo_head, 3]"
    assert set(spec.locations) == {"name", "description", "tensors", "scalars", "mask", "logits", "scales",
                                   "backends"}
    assert str(spec.locations["mask"]) == "spec.yaml:12:1"


def test_sm_scale_default_and_null_logits(spec_from):
    spec = spec_from("name: x\nmask: kv_pos <= q_pos\nlogits: null\nscales: {sm_scale: default}\n")
    assert spec.logits is None and spec.sm_scale is None and spec.qkv_scales is True


# ----------------------------------------------------------------------------- learned sinks

SINKS = "name: x\ntensors:\n  sinks: {dtype: float32, shape: [num_qo_heads]}\nmask: kv_pos <= q_pos\n"


def test_sink_is_a_float_expression_per_head(spec_from):
    spec = spec_from(SINKS + "scalars:\n  bias: {dtype: float, default: 0.5}\nsink: sinks[qo_head] + bias\n")
    assert spec.sink.ty is Type.FLOAT and spec.sink_text == "sinks[qo_head] + bias"
    assert nodes.to_source(spec.sink) == "(sinks[qo_head] + bias)"
    assert spec.uses("sinks") and spec.uses("bias") and "sink" in spec.locations
    assert spec.canonical()["sink"] == "(sinks[qo_head] + bias)"
    # an int sink is a float logit; `request`, the lengths and kv_head are the same for a head's rows
    spec = spec_from("name: x\ntensors:\n  s: {dtype: float32, shape: [batch, num_kv_heads]}\nmask: kv_pos <= q_pos\n"
                     "sink: s[request, kv_head] * float(qo_len) - float(kv_len) if qo_head > 0 else 0\n")
    assert spec.sink.ty is Type.FLOAT


def test_a_spec_without_a_sink_keeps_its_digest():
    """canonical() gains `sink` only when there is one: modules built before sinks keep their keys."""
    plain = variantgen.parse_spec(CAUSAL)
    assert "sink" not in plain.canonical() and plain.sink is None
    assert variantgen.parse_spec(CAUSAL + "sink: null\n").digest == plain.digest
    assert variantgen.parse_spec(CAUSAL + "sink: 0.0\n").digest != plain.digest


def test_a_plain_number_is_a_constant_sink():
    """`sink: 0` is the "softmax + 1" denominator (a sink logit fixed at 0); numbers read as expressions."""
    assert nodes.to_source(variantgen.parse_spec(CAUSAL + "sink: 0\n").sink) == "0"
    assert nodes.to_source(variantgen.parse_spec(CAUSAL + "sink: -1.5e2\n").sink) == "-150.0"
    err = one(CAUSAL + "sink: 0x1F\n")
    assert err.field == "sink" and str(err.location) == "spec.yaml:3:8"
    assert one(CAUSAL + "sink: [1]\n").message == "expected an expression (text), got a list"


@pytest.mark.parametrize(
    ("sink", "col", "message"),
    [
        ("sinks[qo_head] + float(q_pos)", 30, "`q_pos` is not available in a sink: the sink is one logit per query "
                                             "head (and request), shared by all its query rows and keys"),
        ("float(kv_pos)", 13, "`kv_pos` is not available in a sink: the sink is one logit per query head (and "
                              "request), shared by all its query rows and keys"),
        ("sinks[q_row]", 13, "`q_row` is not available in a sink: the sink is one logit per query head (and "
                             "request), shared by all its query rows and keys"),
        ("logits", 7, "`logits` is only available in the `logits` transform, not in a sink (a logit of its own)"),
        ("qo_head > 0", 7, "expression must be a float, got bool"),
        ("sinks[kv_head]", 13, "`sinks` has num_qo_heads rows (one row per query head), but `kv_head` indexes "
                               "num_kv_heads rows (one row per key/value head)"),
        ("sinks", 7, "tensor `sinks` must be indexed, e.g. sinks[i]"),
    ],
)
def test_sink_errors(sink, col, message):
    err = one(SINKS + f"sink: {sink}\n")
    assert err.field == "sink" and err.message == message
    assert str(err.location) == f"spec.yaml:5:{col}"


def test_sink_error_hints():
    assert one(SINKS + "sink: float(q_idx)\n").hint == ("a sink may read kv_head, kv_len, qo_head, qo_len, request, "
                                                         "scalars and tensors indexed by them, e.g. sinks[qo_head]")
    assert one(SINKS + "sink: qo_head > 0\n").hint == "a sink is a logit (a float), e.g. sinks[qo_head]"
    # only the names a sink may read are suggested
    err = one(SINKS + "sink: float(qo_hed)\n")
    assert err.hint == "did you mean `qo_head`?" and "q_pos" not in err.message


# ----------------------------------------------------------------------------- required / unknown fields


def test_missing_name():
    err = one("mask: kv_pos <= q_pos\n")
    assert str(err.location) == "spec.yaml:1:1"
    assert err.field == "name" and err.message == "missing required field `name`"


def test_missing_mask():
    err = one("name: x\n")
    assert str(err).startswith("spec.yaml:1:1: mask: missing required field `mask` "
                               "(a bool expression; `kv_pos <= q_pos` is causal)")


def test_unknown_top_level_field_with_suggestion():
    err = one(CAUSAL + "maks: kv_pos < 3\n")
    assert str(err.location) == "spec.yaml:3:1"
    assert err.field == "maks"
    assert err.message == ("unknown field; expected one of: name, description, tensors, scalars, mask, logits, "
                           "sink, scales, backends")
    assert err.hint == "did you mean `mask`?"
    assert str(err).endswith("\n    maks: kv_pos < 3\n    ^\n  hint: did you mean `mask`?")


def test_unknown_nested_fields():
    err = one(CAUSAL + "tensors:\n  a: {dtype: int32, shape: [batch], dtyp: x}\n")
    assert err.field == "tensors.a.dtyp" and err.hint == "did you mean `dtype`?"
    assert err.message == "unknown field; expected dtype, shape, doc"
    err = one(CAUSAL + "scalars:\n  a: {dtype: int, default: 1, defualt: 2}\n")
    assert err.field == "scalars.a.defualt"
    assert err.message == "unknown field; expected dtype, default, doc, min, max, positive"
    err = one(CAUSAL + "scales: {sm_scal: 1.0}\n")
    assert err.field == "scales.sm_scal" and err.hint == "did you mean `sm_scale`?"


def test_duplicate_top_level_key():
    err = one("name: x\nmask: kv_pos <= q_pos\nname: y\n")
    assert str(err.location) == "spec.yaml:3:1"
    assert err.field == "name" and err.message == "duplicate key `name` (first at line 1)"


def test_duplicate_nested_key():
    err = one(CAUSAL + "scalars:\n  w: {dtype: int, default: 1}\n  w: {dtype: int, default: 2}\n")
    assert str(err.location) == "spec.yaml:5:3"
    assert err.field == "scalars.w" and err.message == "duplicate key `w` (first at line 4)"


def test_non_mapping_documents():
    err = one("- name\n- mask\n")
    assert str(err.location) == "spec.yaml:1:1"
    assert err.message == "expected a mapping (key: value lines), got a list"
    assert one("just text\n").message == "expected a mapping (key: value lines), got the value 'just text'"


def test_non_string_keys():
    err = one(CAUSAL + "1: 2\n")
    assert err.message == "keys must be plain names, got the value '1'"
    assert one(CAUSAL + "? [a, b]\n: 1\n").message == "keys must be plain names, got a list"
    assert "keys must be plain names" in one(CAUSAL + "<<: {a: 1}\n").message


def test_empty_document_marker():
    err = one("---\n")
    assert str(err) == "spec.yaml:2:1: expected a mapping (key: value lines), got the value ''"


def test_empty_spec():
    for text in ("", "\n\n", "# just a comment\n", "# a\n\n# b\n"):
        err = fails(text)
        assert str(err) == "spec.yaml:1:1: spec is empty; expected a mapping with at least `name` and `mask`"


def test_empty_file(spec_text):
    path = spec_text("")
    err = pytest.raises(SpecError, variantgen.load_spec, path).value
    assert str(err) == f"{path}:1:1: spec is empty; expected a mapping with at least `name` and `mask`"


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["../x", "a/b", "Causal", "1abc", "_x", "a-b", "a.b", "a" * 49, "caus al", "é"])
def test_bad_spec_names(name):
    err = one(f"name: {name!r}\nmask: kv_pos <= q_pos\n".replace("\\", "\\\\"))
    assert err.field == "name"
    assert err.message == (f"spec name {name!r} must match [a-z][a-z0-9_]{{0,47}} "
                           "(it becomes part of module names and cache paths)")
    assert str(err.location) == "spec.yaml:1:7"


def test_longest_spec_name_is_fine(spec_from):
    assert spec_from("name: " + "a" * 48 + "\nmask: kv_pos <= q_pos\n").name == "a" * 48


def test_spec_name_with_nul():
    err = fails('name: "a\\0b"\nmask: kv_pos <= q_pos\n')
    assert err.message == "spec name 'a\\x00b' must match [a-z][a-z0-9_]{0,47} " \
                          "(it becomes part of module names and cache paths)"
    raw = fails("name: a\0b\nmask: kv_pos <= q_pos\n")
    assert str(raw) == "spec.yaml:1: spec contains a NUL byte"


def test_spec_name_must_be_text():
    err = one("name: 5\nmask: kv_pos <= q_pos\n")
    assert err.message == "expected text, got an int 5" and err.hint == "quote the value"
    assert one("name: [a]\nmask: kv_pos <= q_pos\n").message == "expected a single value, got a list"
    assert one("name:\nmask: kv_pos <= q_pos\n").message == "expected text, got nothing None"


RESERVED_MSG = "`{}` is reserved (a C++ keyword or a FlashInfer kernel parameter it would shadow); choose another name"
BUILTIN_MSG = "`{}` is a built-in name of the expression language and cannot be declared"
PATTERN_MSG = ("argument name {!r} must match [a-z][a-z0-9_]{{0,31}} (lower case letters, digits, '_'; "
               "at most 32 characters)")


@pytest.mark.parametrize(
    ("name", "template"),
    [
        ("params", RESERVED_MSG),
        ("q_indptr", RESERVED_MSG),
        ("kv_indptr", RESERVED_MSG),
        ("sm_scale", RESERVED_MSG),
        ("window_left", RESERVED_MSG),
        ("int", RESERVED_MSG),
        ("float", BUILTIN_MSG),  # a function of the language
        ("asm", RESERVED_MSG),
        ("return", RESERVED_MSG),
        ("std", RESERVED_MSG),
        ("and", RESERVED_MSG),
        ("if", RESERVED_MSG),
        ("kv_len", BUILTIN_MSG),
        ("q_pos", BUILTIN_MSG),
        ("min", BUILTIN_MSG),
        ("logits", BUILTIN_MSG),
        ("Abc", PATTERN_MSG),
        ("x" * 33, PATTERN_MSG),
        ("_x", PATTERN_MSG),
        ("9x", PATTERN_MSG),
    ],
)
@pytest.mark.parametrize("section", ["tensors", "scalars"])
def test_reserved_and_invalid_argument_names(name, template, section):
    decl = "{dtype: int32, shape: [batch]}" if section == "tensors" else "{dtype: int, default: 0}"
    err = one(f"{CAUSAL}{section}:\n  {name}: {decl}\n")
    assert err.field == f"{section}.{name}"
    assert err.message == template.format(name)
    assert str(err.location) == "spec.yaml:4:3"


def test_vg_prefix_is_reserved():
    err = one(CAUSAL + "scalars:\n  vg_x: {dtype: int, default: 0}\n")
    assert err.message == "names starting with 'vg_' are reserved for variantgen internals: 'vg_x'"


def _fa2_params_members() -> set[str]:
    """Every field and member function of the fa2 kernels' Params (templates/fa2/kernel_params.cuh):
    a spec's arguments become fields of a struct derived from it, which would hide them."""
    from variantgen.codegen.render import TEMPLATES_DIR

    text = re.sub(r"//.*", "", (TEMPLATES_DIR / "fa2" / "kernel_params.cuh").read_text())
    fields = re.findall(r"^\s+[\w:<>, ]+?[\s*]+(\w+)\s*;", text, re.M)
    functions = re.findall(r"__forceinline__\s+\w+\s+(\w+)\s*\(", text)
    return {n for n in fields + functions if not n.startswith("using")}


def _flashinfer_member_probes() -> set[str]:
    """The Params members FlashInfer's kernels test for by name (DEFINE_HAS_MEMBER): an argument
    so named would switch on what FlashInfer does with it (a scale, a RoPE offset)."""
    from variantgen.build.builder import flashinfer_info

    fi = flashinfer_info()
    found: set[str] = set()
    for folder in (*fi.include_dirs, fi.csrc_dir):
        for path in folder.rglob("*"):
            if path.suffix in (".h", ".cuh", ".cu", ".inc") and path.is_file():
                found |= set(re.findall(r"DEFINE_HAS_MEMBER\((\w+)\)", path.read_text(errors="replace")))
    return found - {"member"}  # (the macro's own definition)


def test_names_flashinfer_or_the_params_struct_use_are_reserved():
    members, probes = _fa2_params_members(), _flashinfer_member_probes()
    assert {"q", "paged_kv", "enable_pdl", "get_kv_len", "k_sf_stride_page"} <= members
    assert {"maybe_k_cache_sf", "scale_pv"} <= probes
    for name in sorted(members | probes):
        if spec_mod.ARG_RE.fullmatch(name):
            err = one(f"{CAUSAL}scalars:\n  {name}: {{dtype: int, default: 0}}\n")
            assert err.message == RESERVED_MSG.format(name), name


WRAPPER_PARAM_MSG = ("`{}` is a parameter of the wrappers' plan() or run(), which take spec arguments by name: "
                     "it could not be passed; choose another name")


def _wrapper_parameters() -> set[str]:
    """Every named parameter of the wrappers' plan() and run() (they take spec arguments as **kwargs)."""
    import inspect

    from variantgen.wrappers import decode, flex_wrapper, ragged
    from variantgen.wrappers import paged as wrapper

    names: set[str] = set()
    for module in (wrapper, decode, ragged, flex_wrapper):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            for method in ("plan", "run"):
                params = inspect.signature(getattr(cls, method)).parameters.values() if hasattr(cls, method) else ()
                if any(p.kind is p.VAR_KEYWORD for p in params):  # a wrapper's: spec arguments by name
                    names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return names - {"self"}


@pytest.mark.parametrize("section", ["tensors", "scalars"])
def test_names_of_wrapper_parameters_are_refused(section):
    # A tensor `paged_kv_cache` or a scalar `page_size` validated, then run() / plan() raised a raw
    # TypeError (got multiple values for argument ...); `skip_tiles` set the planner option instead.
    names = _wrapper_parameters()
    assert {"page_size", "paged_kv_cache", "skip_tiles", "q_len_per_request", "qo_indptr"} <= names
    decl = "{dtype: int32, shape: [batch]}" if section == "tensors" else "{dtype: int, default: 0}"
    for name in sorted(names):
        err = one(f"{CAUSAL}{section}:\n  {name}: {decl}\n")
        assert str(err.location) == "spec.yaml:4:3" and err.field == f"{section}.{name}"
        if name not in spec_mod.WRAPPER_PARAMS:  # already reserved as a kernel parameter or keyword
            assert err.message == RESERVED_MSG.format(name), name
        else:
            assert err.message == WRAPPER_PARAM_MSG.format(name), name


PYTHON_KEYWORD_MSG = ("`{0}` is a Python keyword: the wrappers' plan() and run() take spec arguments by name, and "
                      "`{0}=...` is a syntax error (only **{{'{0}': ...}} could pass it); choose another name")


@pytest.mark.parametrize("section", ["tensors", "scalars"])
def test_python_keywords_are_refused(section):
    # A scalar `lambda` validated, and then plan() / run() could only take it as **{"lambda": ...}.
    decl = "{dtype: int32, shape: [batch]}" if section == "tensors" else "{dtype: int, default: 0}"
    names = [k for k in keyword.kwlist if spec_mod.ARG_RE.fullmatch(k)]
    assert {"lambda", "from", "class", "in"} <= set(names)
    for name in names:
        err = one(f"{CAUSAL}{section}:\n  {name}: {decl}\n")
        assert str(err.location) == "spec.yaml:4:3" and err.field == f"{section}.{name}"
        if reserved_reason(name) is not None:  # (a C++ macro: refused as such first)
            assert err.message == f"{reserved_reason(name)}; choose another name", name
        elif name in spec_mod.CPP_KEYWORDS or name in parsing.KEYWORDS:  # (refused as such first)
            assert err.message == RESERVED_MSG.format(name), name
        else:
            assert err.message == PYTHON_KEYWORD_MSG.format(name), name
    # soft keywords are names a keyword argument may have
    spec = variantgen.parse_spec(f"{CAUSAL}{section}:\n  match: {decl}\n")
    assert [a.name for a in (*spec.tensors, *spec.scalars)] == ["match"]


@pytest.mark.parametrize(("decl", "field", "message"), [
    ("scalars:\n  w: {dtype: float, default: 1e-3}\n", "scalars.w.default", "default must be a float, got text '1e-3'"),
    ("scalars:\n  w: {dtype: float, default: 0, max: 1e-3}\n", "scalars.w.max",
     "max of a float scalar must be a finite number in 32-bit float range, got text '1e-3'"),
    ("scales: {sm_scale: 1e-3}\n", "scales.sm_scale",
     "expected a positive number or `default` (1/sqrt(head_dim_qk)), got '1e-3'"),
])
def test_a_number_yaml_reads_as_text_says_how_to_write_it(decl, field, message):
    # YAML 1.1 reads 1e-3 as text: "must be a float, got text '1e-3'" alone left the author puzzled.
    err = one(CAUSAL + decl)
    assert (err.field, err.message) == (field, message)
    assert err.hint == "YAML reads 1e-3 as text (its floats need a '.' and a signed exponent); write 1.0e-3"
    fixed = variantgen.parse_spec(CAUSAL + decl.replace("1e-3", "1.0e-3"), "spec.yaml")
    values = [fixed.sm_scale] + [v for s in fixed.scalars for v in (s.default, s.maximum)]
    assert 1e-3 in values
    assert one(CAUSAL + "scalars:\n  w: {dtype: float, default: 2E5}\n").hint.endswith("write 2.0e+5")
    assert one(CAUSAL + "scalars:\n  w: {dtype: float, default: '1e-3'}\n").hint is None  # quoted: text meant


def test_name_declared_twice_across_sections():
    err = one(CAUSAL + "tensors:\n  a: {dtype: int32, shape: [batch]}\nscalars:\n  a: {dtype: int, default: 1}\n")
    assert err.field == "scalars.a" and err.message == "`a` is already declared as a tensor"


# ----------------------------------------------------------------------------- tensors and scalars


def test_wrong_tensor_dtype():
    err = one(CAUSAL + "tensors:\n  a:\n    dtype: float64\n    shape: [total_q]\n")
    assert str(err.location) == "spec.yaml:5:12"
    assert err.field == "tensors.a.dtype"
    assert err.message == "unsupported tensor dtype 'float64'; expected one of: int32, float32"
    assert err.hint == "did you mean `float32`?"


def test_wrong_scalar_dtype():
    err = one(CAUSAL + "scalars:\n  a: {dtype: int32, default: 1}\n")
    assert err.field == "scalars.a.dtype"
    assert err.message == "unsupported scalar dtype 'int32'; expected one of: int, float, bool"
    assert err.hint == "did you mean `int`?"


def test_missing_dtype_shape_default():
    text = CAUSAL + ("tensors:\n  a: {shape: [batch]}\n  b: {dtype: int32}\n"
                     "scalars:\n  c: {dtype: int}\n  d: {default: 1}\n")
    errors = all_errors(fails(text))
    assert [(e.field, e.message) for e in errors] == [
        ("tensors.a.dtype", "missing dtype; expected one of: int32, float32"),
        ("tensors.b.shape", "missing shape, e.g. [total_q, 2]"),
        ("scalars.c.default", "missing default (an int); run() uses it when the argument is omitted"),
        ("scalars.d.dtype", "missing dtype; expected one of: int, float, bool"),
    ]


def test_unknown_shape_dimension():
    err = one(CAUSAL + "tensors:\n  a:\n    dtype: int32\n    shape: [total_qq]\n")
    assert str(err.location) == "spec.yaml:6:13"
    assert err.field == "tensors.a.shape[0]"
    assert err.message == ("unknown dimension 'total_qq'; expected a positive int or one of: total_q, total_kv, "
                           "batch, num_qo_heads, num_kv_heads")
    assert err.hint == "did you mean `total_q`?"


def test_bad_shapes():
    text = CAUSAL + ("tensors:\n  a: {dtype: int32, shape: [total_q, 0, 70000, true]}\n"
                     "  b: {dtype: int32, shape: []}\n  c: {dtype: int32, shape: [1, 2, 3, 4, 5]}\n"
                     "  d: {dtype: int32, shape: batch}\n")
    errors = all_errors(fails(text))
    assert [(str(e.location), e.field, e.message) for e in errors] == [
        ("spec.yaml:4:38", "tensors.a.shape[1]", "fixed size must be 1..65536, got 0"),
        ("spec.yaml:4:41", "tensors.a.shape[2]", "fixed size must be 1..65536, got 70000"),
        ("spec.yaml:4:48", "tensors.a.shape[3]", "expected a dimension name or a size, got a bool"),
        ("spec.yaml:5:28", "tensors.b.shape", "expected a non-empty list of dimensions, e.g. [total_q, 2]"),
        ("spec.yaml:6:28", "tensors.c.shape", "at most 4 dimensions are supported, got 5"),
        ("spec.yaml:7:28", "tensors.d.shape", "expected a non-empty list of dimensions, e.g. [total_q, 2]"),
    ]


@pytest.mark.parametrize(
    ("dtype", "default", "message"),
    [
        ("int", "1.5", "default must be an int, got a float 1.5"),
        ("int", '"x"', "default must be an int, got text 'x'"),
        ("int", "true", "default must be an int, got a bool True"),
        ("int", "2147483648", "default must be an int in 32-bit range, got an int 2147483648"),
        ("int", "-2147483649", "default must be an int in 32-bit range, got an int -2147483649"),
        ("int", "", "default must be an int, got nothing None"),
        ("float", "true", "default must be a float, got a bool True"),
        ("float", '"1.0"', "default must be a float, got text '1.0'"),
        ("float", ".nan", "default must be a float (finite, in 32-bit float range), got a float nan"),
        ("float", ".inf", "default must be a float (finite, in 32-bit float range), got a float inf"),
        ("float", "1.0e+39", "default must be a float (finite, in 32-bit float range), got a float 1e+39"),
        ("float", "1e39", "default must be a float, got text '1e39'"),  # YAML 1.1: not a number
        ("float", "9" * 60, f"default must be a float (finite, in 32-bit float range), got an int {'9' * 60}"),
        ("bool", "1", "default must be a bool, got an int 1"),
        ("bool", '"true"', "default must be a bool, got text 'true'"),
    ],
)
def test_scalar_default_of_the_wrong_type(dtype, default, message):
    err = one(f"{CAUSAL}scalars:\n  a:\n    dtype: {dtype}\n    default: {default}\n")
    assert err.field == "scalars.a.default"
    assert err.message == message
    assert str(err.location) == ("spec.yaml:6:13" if default == "" else "spec.yaml:6:14")


def test_scalar_default_edge_values(spec_from):
    spec = spec_from(CAUSAL + "scalars:\n  a: {dtype: int, default: -2147483648}\n  b: {dtype: float, default: 3}\n"
                     "  c: {dtype: int, default: 0x10}\n")
    assert [s.default for s in spec.scalars] == [-(2**31), 3.0, 16]


def test_a_date_is_refused_as_a_yaml_1_1_reading():
    """YAML 1.1 reads 2022-13-45 as a date (and fails on the month): refused before it is converted."""
    err = one(CAUSAL + "scalars:\n  a: {dtype: int, default: 2022-13-45}\n")
    assert err.message == ("YAML 1.1 reads 2022-13-45 as a date: spec files refuse values that YAML versions "
                           "read differently")
    assert err.hint == "quote the value"


def test_scales_and_backends_errors():
    text = CAUSAL + "scales: {sm_scale: -1, qkv_scales: 2}\nbackends: [fa2, fa4]\n"
    errors = all_errors(fails(text))
    assert [(e.field, e.message) for e in errors] == [
        ("scales.sm_scale", "expected a positive number or `default` (1/sqrt(head_dim_qk)), got -1"),
        ("scales.qkv_scales", "expected true or false, got 2"),
        ("backends[1]", "unknown backend 'fa4'; expected one of ['fa2', 'fa3', 'flex']"),
    ]
    assert one(CAUSAL + "backends: []\n").message == "expected a non-empty list drawn from ['fa2', 'fa3', 'flex']"


def test_huge_sm_scale_is_an_error_not_a_crash():
    err = one(CAUSAL + "scales: {sm_scale: " + "9" * 400 + "}\n")
    assert err.field == "scales.sm_scale"
    assert err.message == "integer 9999999999999999...99999999 (400 characters) is far too large"
    err = one(CAUSAL + "scales: {sm_scale: " + "9" * 60 + "}\n")
    assert err.message.startswith("expected a positive number or `default` (1/sqrt(head_dim_qk)), got 9999")


# ----------------------------------------------------------------------------- YAML features


@pytest.mark.parametrize(
    ("text", "message", "where"),
    [
        ("name: &a x\nmask: kv_pos <= q_pos\n",
         "YAML anchors (&name) are not allowed in spec files; write the value out", "spec.yaml:1:7"),
        ("name: x\nmask: &m kv_pos <= q_pos\nlogits: *m\n",
         "YAML anchors (&name) are not allowed in spec files; write the value out", "spec.yaml:2:7"),
        ("name: x\nmask: kv_pos <= q_pos\ndescription: *m\n",
         "YAML aliases (*name) are not allowed in spec files; write the value out", "spec.yaml:3:14"),
        ("name: !!python/object:os.system x\nmask: kv_pos <= q_pos\n",
         "YAML tags (tag:yaml.org,2002:python/object:os.system) are not allowed in spec files", "spec.yaml:1:7"),
        ("name: !!python/object/apply:os.system ['true']\nmask: kv_pos <= q_pos\n",
         "YAML tags (tag:yaml.org,2002:python/object/apply:os.system) are not allowed in spec files",
         "spec.yaml:1:7"),
        ("name: !!str x\nmask: kv_pos <= q_pos\n",
         "YAML tags (tag:yaml.org,2002:str) are not allowed in spec files", "spec.yaml:1:7"),
        ("name: x\nmask: !custom kv_pos <= q_pos\n", "YAML tags (!custom) are not allowed in spec files",
         "spec.yaml:2:7"),
        ("!!map\nname: x\nmask: kv_pos <= q_pos\n",
         "YAML tags (tag:yaml.org,2002:map) are not allowed in spec files", "spec.yaml:1:1"),
    ],
)
def test_anchors_aliases_and_tags_are_refused(text, message, where):
    err = fails(text)
    assert err.message == message
    assert str(err.location) == where


def test_invalid_yaml_is_located():
    err = fails("name: x\nmask: [kv_pos\n")
    assert str(err).startswith("spec.yaml:3:1: invalid YAML: ")
    err = fails("name: x\n  mask: y\n")
    assert re.match(r"spec\.yaml:2:7: invalid YAML: mapping values are not allowed here", str(err))
    err = fails("name: x\nmask: kv_pos <= q_pos\n---\nname: y\n")
    assert "invalid YAML: " in str(err) and str(err).startswith("spec.yaml:3:1")


def test_deep_flow_nesting_is_refused_quickly():
    # PyYAML's scanner is quadratic in flow depth: a file of brackets must stop early.
    start = time.perf_counter()
    err = fails("name: x\nmask: kv_pos <= q_pos\ndescription: " + "[" * 200_000 + "\n")
    assert time.perf_counter() - start < 5
    assert str(err).splitlines()[0] == (f"spec.yaml:3:{14 + yaml_loader.MAX_YAML_DEPTH}: invalid YAML: collections "
                                        f"are nested more than {yaml_loader.MAX_YAML_DEPTH} levels deep")
    assert err.hint is None and len(str(err)) < 400  # the line is shown around the caret only


def test_deep_block_nesting_is_refused():
    text = "name: x\nmask: kv_pos <= q_pos\ndescription:\n" + "".join(" " * i + "a:\n" for i in range(1, 200))
    err = fails(text)
    assert re.match(r"spec\.yaml:\d+:\d+: invalid YAML: collections are nested more than 32 levels deep\n", str(err))
    assert "nested more than" in fails("name: x\nmask: kv_pos <= q_pos\ndescription:\n" + "- " * 5000).message


def test_nesting_within_the_limit_is_only_a_type_error():
    err = one("name: x\nmask: kv_pos <= q_pos\nbackends: " + "[" * 30 + "]" * 30 + "\n")
    assert (str(err.location), err.message) == ("spec.yaml:3:12", "expected a single value, got a list")


def test_too_many_yaml_nodes():
    err = fails("name: x\nmask: kv_pos <= q_pos\nbackends: [" + "fa2, " * 30_000 + "]\n")
    assert err.message == f"spec has more than {yaml_loader.MAX_YAML_NODES} YAML nodes"
    # located at the first node past the limit, an item of the list: refused while the list was read
    assert err.location.line == 3 and err.source_line[err.location.col - 1:].startswith("fa2, ")
    assert err.location.col < 5 * yaml_loader.MAX_YAML_NODES + 20


# ----------------------------------------------------------------------------- files


def test_missing_file(tmp_path):
    err = pytest.raises(SpecError, variantgen.load_spec, tmp_path / "nope.yaml").value
    assert str(err) == f"{tmp_path / 'nope.yaml'}: spec file not found"


def test_directory_is_not_a_spec(tmp_path):
    err = pytest.raises(SpecError, variantgen.load_spec, tmp_path).value
    assert str(err) == f"{tmp_path}: not a regular file"


def test_unreadable_file(spec_text, monkeypatch):
    path = spec_text(CAUSAL)

    def deny(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(spec_mod.Path, "read_bytes", deny)
    err = pytest.raises(SpecError, variantgen.load_spec, path).value
    assert str(err) == f"{path}: cannot read spec file: Permission denied"


def test_non_utf8_file(spec_text):
    path = spec_text(b"name: x\nmask: kv_pos <= q_pos\ndescription: caf\xe9\n")
    err = pytest.raises(SpecError, variantgen.load_spec, path).value
    assert str(err) == f"{path}:3: spec file is not UTF-8 text (bad byte at offset 46)"


def test_file_over_the_size_limit(spec_text):
    path = spec_text(CAUSAL + "# " + "x" * spec_mod.MAX_SPEC_BYTES + "\n")
    size = path.stat().st_size
    err = pytest.raises(SpecError, variantgen.load_spec, path).value
    assert str(err) == f"{path}: spec file is {size} bytes; the limit is {spec_mod.MAX_SPEC_BYTES}"


def test_text_over_the_size_limit():
    err = fails(CAUSAL + "# " + "é" * (spec_mod.MAX_SPEC_BYTES // 2) + "\n")
    assert str(err) == f"spec.yaml: spec is larger than {spec_mod.MAX_SPEC_BYTES} bytes"


def test_load_spec_reports_the_given_path(spec_text):
    path = spec_text("name: x\nmask: kv_pos <= bogus\n", name="my spec.yaml")
    err = pytest.raises(SpecError, variantgen.load_spec, str(path)).value
    assert str(err).startswith(f"{path}:2:17: mask: unknown name `bogus`")


def test_non_printable_characters():
    err = fails("name: x\nmask: kv_pos <= q_pos\x07\n")
    assert str(err).startswith("spec.yaml") and "invalid YAML" in str(err)


@pytest.mark.parametrize("text, where, source, escape", [
    ("name: x\nmask: kv_pos <= q_pos\x07\n", "spec.yaml:2:22", "mask: kv_pos <= q_pos\x07", "\\x07"),
    ("name: x\r\ndescription: a\rb: \x7f\nmask: kv_pos <= q_pos\n", "spec.yaml:3:4", "b: \x7f", "\\x7f"),
    ('name: x\nmask: "kv_pos <= q_pos"\ndescription: "\u2029a\x9b"\n', "spec.yaml:4:2", 'a\x9b"', "\\x9b"),
])
def test_characters_yaml_refuses_are_located(text, where, source, escape):
    # PyYAML's reader refuses them before scanning, with an offset but no line: the message
    # used to name the file only, with a hint about indentation.
    err = fails(text)
    code = f"U+{int(escape[2:], 16):04X}"
    assert str(err.location) == where
    assert err.message == f"invalid YAML: character {code} is not allowed in a YAML file"
    assert err.source_line == source
    assert str(err).splitlines()[2].strip() == "^"
    assert err.hint == f"remove it; inside double quotes it can be written as the escape {escape}"


# ----------------------------------------------------------------------------- expressions in specs


def test_mask_that_is_not_bool():
    err = one("name: x\nmask: kv_pos + 1\n")
    assert str(err.location) == "spec.yaml:2:7"
    assert err.field == "mask"
    assert err.message == "expression must be a bool, got int"
    assert err.hint == "a mask must be true where the key is visible, e.g. `kv_pos <= q_pos`"


def test_mask_written_as_a_yaml_bool_or_number():
    err = one("name: x\nmask: true\n")
    assert err.message == "expected an expression, got the bool True"
    assert err.hint == "write `true` inside quotes, or `kv_pos <= q_pos` for causal"
    assert one("name: x\nmask: 1\n").message == "expected an expression (text), got the value '1'"
    assert one("name: x\nmask: [a]\n").message == "expected an expression (text), got a list"
    assert one("name: x\nmask: {a: 1}\n").message == "expected an expression (text), got a mapping"


def test_quoted_true_mask_is_fine(spec_from):
    assert nodes.to_source(spec_from("name: x\nmask: 'true'\n").mask) == "true"


def test_logits_transform_that_never_reads_logits():
    err = one(CAUSAL + "logits: 1.0 + 2.0\n")
    assert str(err.location) == "spec.yaml:3:9"
    assert err.field == "logits"
    assert err.message == "the logits transform never reads `logits`; it would replace every score with a constant"


def test_logits_must_be_a_number():
    err = one(CAUSAL + "logits: logits > 0\n")
    assert err.message == "expression must be a float, got bool"


def test_logits_in_a_mask():
    err = one("name: x\nmask: logits > 0\n")
    assert err.message == "`logits` is only available in the `logits` transform, not in a mask"


def test_expression_errors_point_into_the_file():
    err = one("name: x\nmask: kv_pos <= q_pos and kv_poss >= 0\n")
    assert str(err.location) == "spec.yaml:2:27"
    assert err.hint == "did you mean `kv_pos`?"
    err = one("name: x\nmask: 'kv_pos <= q_pos and kv_poss > 0'\n")
    assert str(err.location) == "spec.yaml:2:28"
    err = one('{name: x, mask: "kv_pos <= q_pos and kv_poss > 0"}\n')
    assert str(err.location) == "spec.yaml:1:38"


def test_expression_uses_declared_arguments(spec_from):
    err = one("name: x\nmask: w < 0\nscalars:\n  u: {dtype: int, default: 1}\n")
    assert err.message.startswith("unknown name `w`; known names: ")
    assert err.hint is None
    assert "u" in err.message.split("known names: ")[1].split(", ")
    assert spec_from("name: x\nmask: w < 0\nscalars:\n  w: {dtype: int, default: 1}\n").uses("w")


# Multi-line scalars: the error must point at the line and column in the file.
MULTI_LINE = [
    ("literal block", "mask: |\n  kv_pos <= q_pos and\n    kv_poss >= 0\n", (4, 5)),
    ("literal block, strip", "mask: |-\n  kv_pos <= q_pos\n  and kv_poss >= 0\n", (4, 7)),
    ("literal block, indicator and comment",
     "mask: |2+  # note\n      kv_pos <= q_pos and\n\n      (q_pos < 3 or kv_poss)\n", (5, 21)),
    ("folded block", "mask: >\n  kv_pos <= q_pos and\n  kv_poss >= 0\n", (4, 3)),
    ("folded block, strip", "mask: >-\n  kv_pos <= q_pos and\n  kv_poss >= 0\n", (4, 3)),
    ("folded block, more indented", "mask: >\n  kv_pos <= q_pos and\n    kv_poss >= 0\n", (4, 5)),
    ("folded block, blank line", "mask: >\n  kv_pos <= q_pos and\n\n  kv_poss >= 0\n", (5, 3)),
    ("plain, continued", "mask: kv_pos <= q_pos and\n  kv_poss >= 0\n", (3, 3)),
    ("plain, continued twice", "mask: kv_pos <= q_pos\n  and q_pos >= 0\n  and kv_poss >= 0\n", (4, 7)),
    ("double quoted, continued", 'mask: "kv_pos <= q_pos and\n  kv_poss >= 0"\n', (3, 3)),
    ("double quoted, escaped break", 'mask: "kv_pos <= q_pos and \\\n   kv_poss >= 0"\n', (3, 4)),
    ("double quoted, escape", 'mask: "kv_pos <= q_pos and \\x41 kv_poss >= 0"\n', (2, 33)),
    ("single quoted, continued", "mask: 'kv_pos <= q_pos and\n    kv_poss >= 0'\n", (3, 5)),
]


@pytest.mark.parametrize(("style", "mask", "where"), MULTI_LINE, ids=[m[0] for m in MULTI_LINE])
def test_multi_line_mask_errors_are_located_in_the_file(style, mask, where):
    text = "name: x\n" + mask
    errors = all_errors(fails(text))
    assert len(errors) == 1
    err = errors[0]
    assert (err.location.line, err.location.col) == where
    line, col = where
    assert text.splitlines()[line - 1][col - 1:].startswith("kv_poss") or "\\x41" in mask
    # the message shows the offending line of the expression with a caret under the name
    shown = str(err).splitlines()
    caret_line = next(i for i, s in enumerate(shown) if s.strip() == "^")
    assert shown[caret_line - 1][shown[caret_line].index("^"):].startswith("kv_poss")


def test_end_of_expression_error_in_a_block():
    err = one("name: x\nmask: >-\n  kv_pos <= q_pos and\n")
    assert err.message == "expected a value (number, name or '('), found end of expression"
    assert str(err.location) == "spec.yaml:3:22"


def test_empty_expression_in_a_spec():
    err = one('name: x\nmask: ""\n')
    assert err.message == "expression is empty" and str(err.location) == "spec.yaml:2:8"


# ----------------------------------------------------------------------------- aggregation


def test_independent_errors_are_reported_together():
    text = (
        "name: Bad\n"
        "mask: kv_pos + 1\n"
        "tensors:\n"
        "  params: {dtype: int32, shape: [batch]}\n"
        "scalars:\n"
        "  w: {dtype: int, default: 1.5}\n"
        "extra: 1\n"
    )
    err = fails(text)
    assert isinstance(err, SpecErrors)
    got = [(str(e.location), e.field) for e in err.errors]
    assert got == [
        ("spec.yaml:7:1", "extra"),
        ("spec.yaml:1:7", "name"),
        ("spec.yaml:4:3", "tensors.params"),
        ("spec.yaml:6:28", "scalars.w.default"),
        ("spec.yaml:2:7", "mask"),
    ]
    text_lines = str(err).splitlines()
    assert text_lines[0] == "spec.yaml: 5 errors"  # the file once, each error under it at its line:col
    starts = [line for line in text_lines if re.match(r"^  \d+:\d+: ", line)]
    assert len(starts) == 5
    # the first error is also the SpecError's own fields
    assert err.location == err.errors[0].location and err.field == "extra"
    assert isinstance(err, variantgen.VariantgenError)


def test_a_long_path_is_printed_once_and_the_message_is_capped():
    """A 4 KB path was repeated per error: a 90 KB message. The path is printed once, cut in the
    middle, and the whole message is bounded whatever each error holds."""
    path = "/" + "d" * 4096 + "/spec.yaml"
    text = CAUSAL + "".join(f"k{i}: 1\n" for i in range(30))
    err = pytest.raises(SpecError, variantgen.parse_spec, text, path).value
    rendered = str(err)
    assert len(rendered) < 8_000 and rendered.count("/spec.yaml") == 1
    assert rendered.splitlines()[1].startswith("  3:1: k0: unknown field")
    assert rendered.endswith(f"  ... and {30 - errors_mod.MAX_SPEC_ERRORS} more error(s)")
    single = pytest.raises(SpecError, variantgen.parse_spec, CAUSAL + "k0: 1\n", path).value
    assert len(str(single)) < 1_500 and "/spec.yaml:3:1: k0: unknown field" in str(single)


def test_errors_of_hostile_length_are_capped_in_total():
    fields = "".join(f"  {'x' * 30}{i}: 1\n" for i in range(40))
    long_line = "scales: {" + ", ".join(f"{'y' * 500}{i}: 1" for i in range(20)) + "}\n"
    err = pytest.raises(SpecError, variantgen.parse_spec, CAUSAL + "description:\n" + fields + long_line,
                        "spec.yaml").value
    assert len(str(err)) <= errors_mod.MAX_ERRORS_CHARS + 2_000


def test_single_error_is_not_wrapped():
    err = fails("name: x\nmask: kv_pos + 1\n")
    assert type(err) is SpecError


def test_spec_errors_render_each_error():
    a = SpecError("first", errors_mod.Location("f.yaml", 1, 2), field="x")
    b = SpecError("second", errors_mod.Location("f.yaml", 3, 4), hint="try this")
    both = SpecErrors([a, b])
    assert str(both) == "f.yaml: 2 errors\n  1:2: x: first\n  3:4: second\n    hint: try this"
    assert both.message == "first" and both.errors == [a, b]


# ----------------------------------------------------------------------------- hostile input (issue 14)


@pytest.mark.parametrize("text", [
    'name: "causal\\n"\nmask: kv_pos <= q_pos\n',
    "name: |\n  causal\nmask: kv_pos <= q_pos\n",  # a literal block keeps its final newline
    'name: "causal\\r"\nmask: kv_pos <= q_pos\n',
])
def test_spec_name_with_a_line_break_is_refused(text):
    err = one(text)
    assert err.field == "name" and "must match [a-z][a-z0-9_]{0,47}" in err.message


@pytest.mark.parametrize("name", ["q\\n", "ids\\n", "w\\n"])
@pytest.mark.parametrize("section", ["tensors", "scalars"])
def test_argument_name_with_a_trailing_newline_is_refused(section, name):
    decl = "{dtype: int32, shape: [batch]}" if section == "tensors" else "{dtype: int, default: 0}"
    err = one(f'{CAUSAL}{section}:\n  "{name}": {decl}\n')
    assert err.field == yaml_reader._shown(f"{section}.{name[:-2]}\n")
    assert err.message.startswith(f"argument name {name[:-2] + chr(10)!r} must match [a-z][a-z0-9_]{{0,31}}")


HUGE_DEC, HUGE_HEX = "9" * 5000, "0x" + "F" * 4000


@pytest.mark.parametrize(("where", "field_name"), [
    ("scalars:\n  w: {{dtype: int, default: {n}}}\n", "scalars.w.default"),
    ("scalars:\n  w: {{dtype: float, default: 1.0, min: {n}}}\n", "scalars.w.min"),
    ("tensors:\n  t: {{dtype: int32, shape: [{n}]}}\n", "tensors.t.shape[0]"),
    ("scales: {{sm_scale: {n}}}\n", "scales.sm_scale"),
    ("backends: [{n}]\n", "backends[0]"),
    ("description: {n}\n", "description"),
])
@pytest.mark.parametrize("number", [HUGE_DEC, HUGE_HEX, "-" + HUGE_DEC, "1_" + "0" * 100])
def test_huge_integers_are_located_errors(where, field_name, number):
    """Past 4300 digits Python refuses to convert (or print) an int: never a plain ValueError."""
    err = one(CAUSAL + where.format(n=number))
    assert err.field == field_name and err.location.line == where.count("\n") + 2
    assert err.message.startswith("integer ") and err.message.endswith(" is far too large")
    assert len(str(err)) < 500


def test_lone_surrogates_are_printable_in_errors():
    err = one('name: x\nmask: "kv_pos <= q_pos and \\ud83d"\n')
    assert err.message == "unexpected character U+D83D"
    str(err).encode("utf-8")  # printing it cannot fail
    assert "kv_pos <= q_pos and ?" in str(err)
    err = one('name: "\\ud83d"\nmask: kv_pos <= q_pos\n')
    assert err.message.startswith("spec name '\\ud83d' must match")
    str(err).encode("utf-8")
    assert variantgen.parse_spec('name: x\nmask: kv_pos <= q_pos\ndescription: "\\ud83d"\n').description == "\ud83d"


def test_errors_per_file_are_capped():
    """A 79 KB one-line spec with thousands of bad keys: 20 errors and a count, bounded output."""
    keys = ", ".join(f"k{i}: 1" for i in range(9_000))  # (18,000 nodes: under the node limit)
    text = "{name: x, mask: kv_pos <= q_pos, " + keys + "}\n"
    assert len(text) > 78_000
    tracemalloc.start()
    try:
        err = fails(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # the YAML tree; errors used to take gigabytes
    assert isinstance(err, SpecErrors) and len(err.errors) == errors_mod.MAX_SPEC_ERRORS
    assert err.more == 9_000 - errors_mod.MAX_SPEC_ERRORS
    rendered = str(err)
    assert rendered.endswith(f"\n  ... and {err.more} more error(s)")
    assert rendered.startswith("spec.yaml: 9000 errors\n")
    assert len(rendered) < 20 * 400
    for e in err.errors:  # each shows the line around its own caret
        line, caret = str(e).splitlines()[1:3]
        key = e.field
        assert line[caret.index("^"):].startswith(key), (line, caret, key)


def test_expression_errors_count_towards_the_cap():
    scalars = "".join(f"  s{i}: {{dtype: int, default: 1.5}}\n" for i in range(30))
    err = fails("name: x\nmask: nope\nscalars:\n" + scalars)
    assert len(err.errors) == errors_mod.MAX_SPEC_ERRORS and err.more == 31 - errors_mod.MAX_SPEC_ERRORS


def test_long_source_lines_are_shown_around_the_caret():
    text = "name: x\nmask: " + "kv_pos <= q_pos and " * 60 + "kv_poss > 0\n"
    assert len(text) < parsing.MAX_EXPR_CHARS
    err = one(text)
    line, caret = str(err).splitlines()[1:3]
    assert line.startswith("    ...") and not line.endswith("...") and len(line) <= 4 + 3 + 100
    assert line[caret.index("^"):] == "kv_poss > 0"
    head = one("name: x\nmask: kv_poss > 0 and " + "kv_pos <= q_pos and " * 60 + "true\n")
    line, caret = str(head).splitlines()[1:3]
    assert line.endswith("...") and line[caret.index("^"):].startswith("kv_poss > 0 and")


@pytest.mark.parametrize(("text", "where", "source", "hint"), [
    ("name: x\nmask: kv_pos <= q_pos\nbackends: [fa2, fa3\n", "spec.yaml:4:1", "",
     "close the list opened at line 3, column 11 with ']'"),
    ("name: x\nmask: kv_pos <= q_pos\nscales: {sm_scale: 1.0\n", "spec.yaml:4:1", "",
     "close the mapping opened at line 3, column 9 with '}'"),
    ("name: x\n\tmask: kv_pos <= q_pos\n", "spec.yaml:2:1", "\tmask: kv_pos <= q_pos",
     "indent with spaces: YAML does not allow tabs there"),
    ("name: x\nmask: kv_pos <= q_pos\ndescription: a: b\n", "spec.yaml:3:15", "description: a: b",
     "quote a value that contains ': ', and line nested keys up under their parent (e.g. mask: \"a: b\")"),
    ('name: x\nmask: "kv_pos <= q_pos\n', "spec.yaml:3:1", "",
     "close the quote opened at line 2, column 7"),
    ('name: x\nmask: "kv_pos \\q"\n', "spec.yaml:2:16", 'mask: "kv_pos \\q"',
     "inside double quotes write a backslash as \\\\, or use single quotes"),
    ("name: x\nmask: kv_pos <= q_pos\n  logits: logits\n", "spec.yaml:3:9", "  logits: logits", None),
])
def test_yaml_syntax_errors_have_a_caret_and_a_hint(text, where, source, hint):
    err = fails(text)
    assert str(err.location) == where and err.message.startswith("invalid YAML: ")
    assert err.source_line == source
    lines = str(err).splitlines()
    assert lines[2].strip() == "^"
    if hint is not None:
        assert err.hint == hint
    else:
        assert err.hint  # every YAML error gets some advice


def test_refused_yaml_features_show_their_line():
    err = fails("name: x\nmask: kv_pos <= q_pos\ndescription: *m\n")
    assert str(err).splitlines()[1:] == ["    description: *m", "                 ^"]


@pytest.mark.parametrize(("text", "where", "shown"), [
    ("name: 7bad\nmask: 'true'\n", "1:7", ["    name: 7bad", "          ^"]),  # a field's value
    ("description: *m\nname: x\nmask: 'true'\n", "1:14", ["    description: *m", "                 ^"]),  # YAML
    ("name: x\x01\nmask: 'true'\n", "1:8", ["    name: x?", "           ^"]),  # a character YAML refuses
    ("mask: kv_pos <= q_po\nname: x\n", "1:17", ["    kv_pos <= q_po", "              ^"]),  # an expression
])
def test_a_byte_order_mark_moves_no_caret(spec_text, text, where, shown):
    """A file saved with a UTF-8 byte-order mark: errors on its first line have their caret under
    the column they name, as without one (a regression: the shown line counted the BOM, which
    YAML's columns do not, and the caret sat one column left)."""
    for raw, name in ((text.encode(), "plain.yaml"), (b"\xef\xbb\xbf" + text.encode(), "bom.yaml")):
        with pytest.raises(SpecError) as info:
            variantgen.load_spec(spec_text(raw, name))
        err = all_errors(info.value)[0]
        assert str(err.location).endswith(f"{name}:{where}")
        assert str(err).splitlines()[1:3] == shown, name


# ----------------------------------------------------------------------------- follow-on errors


@pytest.mark.parametrize(("decl", "use", "field_name"), [
    ("tensors:\n  t: {dtype: int64, shape: [batch]}\n", "t[request] > 0", "tensors.t.dtype"),
    ("tensors:\n  t: {dtype: int32, shape: [batchh]}\n", "t[request] > 0", "tensors.t.shape[0]"),
    ("tensors:\n  t: [batch]\n", "t[request] > 0", "tensors.t"),
    ("tensors:\n  params: {dtype: int32, shape: [batch]}\n", "params[request] > 0", "tensors.params"),
    ("tensors:\n  Tt: {dtype: int32, shape: [batch]}\n", "Tt[request] > 0", "tensors.Tt"),
    ("scalars:\n  w: {dtype: int, default: 1.5}\n", "q_pos - kv_pos <= w", "scalars.w.default"),
    ("scalars:\n  w: {dtype: int}\n", "q_pos - kv_pos <= w", "scalars.w.default"),
    ("scalars:\n  w: {dtype: int, default: 5, max: 3}\n", "q_pos - kv_pos <= w", "scalars.w.default"),
    ("tensors:\n  w: {dtype: int32, shape: [batch]}\nscalars:\n  w: {dtype: int, default: 1}\n",
     "w[request] > 0", "scalars.w"),  # the tensor stands: the mask checks
    ("tensors:\n  kv_pos: {dtype: int32, shape: [batch]}\n", "kv_pos <= q_pos", "tensors.kv_pos"),
])
def test_uses_of_a_refused_declaration_are_not_reported_again(decl, use, field_name):
    err = one(f"name: x\n{decl}mask: kv_pos <= q_pos and {use}\n")
    assert err.field == field_name


def test_undeclared_names_are_still_reported_beside_a_refused_one():
    errors = all_errors(fails("name: x\ntensors:\n  t: {dtype: int64, shape: [batch]}\n"
                              "mask: t[request] > 0\nlogits: logits + u\n"))
    assert [e.field for e in errors] == ["tensors.t.dtype", "logits"]
    assert errors[1].message.startswith("unknown name `u`")


# ----------------------------------------------------------------------------- shapes and index kinds


@pytest.mark.parametrize("shape", ["[2, total_q]", "[num_qo_heads, total_kv]", "[total_q, batch]", "[4, 2, batch]"])
def test_batch_sized_dimensions_only_first(shape):
    err = one(CAUSAL + f"tensors:\n  t: {{dtype: int32, shape: {shape}}}\n")
    assert re.fullmatch(r"tensors\.t\.shape\[\d\]", err.field)
    assert err.message.endswith("can only be a tensor's first dimension (the dimensions after the first must be "
                                "fixed sizes or head counts)")


def test_head_dimensions_anywhere(spec_from):
    spec = spec_from(CAUSAL + "tensors:\n  t: {dtype: float32, shape: [total_q, num_qo_heads, 2]}\n"
                     "  u: {dtype: float32, shape: [3, num_kv_heads]}\n")
    assert spec.tensors[0].shape == ("total_q", "num_qo_heads", 2)


def test_index_kind_mismatch_in_a_spec_file():
    err = one("name: x\ntensors:\n  prefix_len: {dtype: int32, shape: [batch]}\n"
              "mask: kv_pos <= max(q_pos, prefix_len[q_row] - 1)\n")
    assert str(err.location) == "spec.yaml:4:39" and err.field == "mask"
    assert err.hint == "`prefix_len` is per request: index it with request"
    assert str(err).splitlines()[1:3] == ["    kv_pos <= max(q_pos, prefix_len[q_row] - 1)",
                                          "                                    ^"]


# ----------------------------------------------------------------------------- scalar ranges


def test_scalar_ranges(spec_from):
    spec = spec_from(CAUSAL + "scalars:\n"
                     "  w: {dtype: int, default: -1, min: -1}\n"
                     "  c: {dtype: int, default: 8, positive: true, max: 8192}\n"
                     "  f: {dtype: float, default: 0.5, min: 0, max: 1}\n"
                     "  g: {dtype: float, default: 2, positive: true}\n"
                     "  h: {dtype: float, default: 2, positive: false}\n")
    w, c, f, g, h = spec.scalars
    assert (w.minimum, w.maximum, w.positive, w.range_text()) == (-1, None, False, ">= -1")
    assert c.range_text() == "> 0 and <= 8192" and f.range_text() == ">= 0.0 and <= 1.0"
    assert g.range_text() == "> 0" and h.range_text() == "any value" and not h.has_range
    assert isinstance(f.minimum, float)
    assert w.out_of_range(-1) is None and w.out_of_range(-2) == "-2 is out of range: the spec allows >= -1"
    assert c.out_of_range(0) == "0 is out of range: the spec allows > 0 and <= 8192"
    assert c.out_of_range(8193) is not None and c.out_of_range(8192) is None
    assert f.out_of_range(1.0000001) is not None
    # judged as the kernel sees it: 1e-50 is 0.0 in float32
    assert g.out_of_range(1e-50) == "1e-50 (as a 32-bit float it is 0.0) is out of range: the spec allows > 0"
    # ranges describe valid values; they do not change the module
    plain = spec_from(CAUSAL + "scalars:\n  w: {dtype: int, default: -1}\n  c: {dtype: int, default: 8}\n"
                      "  f: {dtype: float, default: 0.5}\n  g: {dtype: float, default: 2}\n"
                      "  h: {dtype: float, default: 2}\n")
    assert plain.digest == spec.digest


@pytest.mark.parametrize(("decl", "field_name", "message"), [
    ("{dtype: int, default: -2, min: -1}", "scalars.w.default", "default -2 is out of range: the spec allows >= -1"),
    ("{dtype: int, default: 0, positive: true}", "scalars.w.default",
     "default 0 is out of range: the spec allows > 0"),
    ("{dtype: float, default: 1.0e-46, positive: true}", "scalars.w.default",
     "default 1e-46 (as a 32-bit float it is 0.0) is out of range: the spec allows > 0"),
    ("{dtype: int, default: 1, min: 2, max: 1}", "scalars.w.max", "max 1 with min 2 leaves no valid value"),
    ("{dtype: int, default: 1, positive: true, max: 0}", "scalars.w.max",
     "max 0 with positive: true leaves no valid value"),
    ("{dtype: int, default: 1, min: 0.5}", "scalars.w.min",
     "min of an int scalar must be an int in 32-bit range, got a float 0.5"),
    ("{dtype: int, default: 1, max: 2147483648}", "scalars.w.max",
     "max of an int scalar must be an int in 32-bit range, got an int 2147483648"),
    ("{dtype: float, default: 1.0, max: 1.0e+39}", "scalars.w.max",
     "max of a float scalar must be a finite number in 32-bit float range, got a float 1e+39"),
    ("{dtype: float, default: 1.0, min: true}", "scalars.w.min",
     "min of a float scalar must be a finite number in 32-bit float range, got a bool True"),
    ("{dtype: int, default: 1, min: '0'}", "scalars.w.min",
     "min of an int scalar must be an int in 32-bit range, got text '0'"),
    ("{dtype: int, default: 1, positive: 1}", "scalars.w.positive", "expected true or false, got 1"),
    ("{dtype: bool, default: true, min: 0}", "scalars.w.min", "a bool scalar has no range"),
    ("{dtype: bool, default: true, positive: true}", "scalars.w.positive", "a bool scalar has no range"),
])
def test_bad_scalar_ranges(decl, field_name, message):
    err = one(f"{CAUSAL}scalars:\n  w: {decl}\n")
    assert (err.field, err.message) == (field_name, message)
    assert str(err.location).startswith("spec.yaml:4:")


def test_misspelt_range_key():
    err = one(CAUSAL + "scalars:\n  w: {dtype: int, default: 1, minimum: 0}\n")
    assert err.field == "scalars.w.minimum" and err.hint == "did you mean `min`?"


def test_shipped_scalar_ranges():
    ranges = {(spec.name, s.name): s.range_text() for spec in map(variantgen.load_spec, SPEC_FILES)
              for s in spec.scalars}
    assert ranges == {
        ("streaming_sink", "num_sink"): ">= 0", ("streaming_sink", "window"): ">= 0",
        ("chunked_local", "chunk_size"): "> 0",
        ("mm_prefix", "causal_window_left"): ">= -1", ("mm_prefix", "range_window_left"): ">= -1",
        ("sliding_window", "window"): ">= -1",
        ("softcap", "soft_cap"): "> 0", ("softcap", "window"): ">= -1",
        ("attention_sink_learned", "window"): ">= -1", ("gemma4_sliding", "window"): "> 0",
    }


@pytest.mark.parametrize("value,got", [(None, "NoneType"), (5, "int")])
def test_load_spec_names_a_path_that_is_not_one(value, got):
    """A regression: None or an int reached pathlib, whose TypeError named no argument."""
    with pytest.raises(TypeError, match=re.escape("load_spec: path: expected a spec file path (str or os.PathLike) or "
                                                  f"a shipped spec name, got {got}")):
        variantgen.load_spec(value)


@pytest.mark.parametrize("value,message", [
    (None, "parse_spec: text: expected the spec's YAML as a str, got NoneType"),
    (5, "parse_spec: text: expected the spec's YAML as a str, got int"),
    (b"name: x\nmask: kv_pos <= q_pos\n", "parse_spec: text: expected the spec's YAML as a str, got bytes (decode it, "
                                          "or pass the file to load_spec)"),
])
def test_parse_spec_names_text_that_is_not_a_str(value, message):
    """A regression: a non-str text raised AttributeError ('NoneType' object has no attribute 'encode')."""
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        variantgen.parse_spec(value)
