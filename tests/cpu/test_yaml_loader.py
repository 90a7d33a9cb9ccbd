"""The YAML reader of spec files (variantgen/lang/yaml_loader.py): values YAML 1.1 reads otherwise
than an author means are refused where they stand, and the node limit stops the reader early."""

from __future__ import annotations

import pytest
import yaml

from variantgen.core.errors import SpecError
from variantgen.lang import yaml_loader
from variantgen.lang.spec import parse_spec

CAUSAL = "name: x\nmask: kv_pos <= q_pos\n"


def one(text: str) -> SpecError:
    err = pytest.raises(SpecError, parse_spec, text, "spec.yaml").value
    assert not getattr(err, "errors", None) or len(err.errors) == 1, str(err)
    return err


@pytest.mark.parametrize(("value", "reading", "write"), [
    ("010", "octal 8", "write 10 without the leading zero"),
    ("-010", "octal -8", "write -10 without the leading zero"),
    ("09", "text", "write 9 without the leading zero"),
    ("0o10", "text (not as octal 8)", "write 8 for the number"),
    ("0b1010", "the binary number 10", "write 10"),
    ("1:30", "a base-60 number", "quote the value for text"),
    ("1_000", "a number with the '_' dropped", "write 1000 without '_'"),
    ("1_000.5", "a number with the '_' dropped", "write 1000.5 without '_'"),
    ("0x_10", "a number with the '_' dropped", "write 0x10 without '_'"),
])
def test_yaml_1_1_number_forms_are_refused_at_their_place(value, reading, write):
    """`default: 010` was read as 8 and `1:30` as 90, silently (an expression reads 010 as 10)."""
    err = one(CAUSAL + f"scalars:\n  w: {{dtype: int, default: {value}}}\n")
    assert err.field == "scalars.w.default"
    assert err.location.line == 4 and err.source_line[err.location.col - 1:].startswith(value + "}")
    assert err.message.startswith(f"YAML 1.1 reads {value} as {reading}")
    assert err.hint.startswith(write)


@pytest.mark.parametrize(("where", "field_name", "line"), [
    ("tensors:\n  t: {{dtype: int32, shape: [total_q, {v}]}}\n", "tensors.t.shape[1]", 4),
    ("scalars:\n  w: {{dtype: float, default: 1.0, max: {v}}}\n", "scalars.w.max", 4),
    ("scales: {{sm_scale: {v}}}\n", "scales.sm_scale", 3),
    ("backends: [{v}]\n", "backends[0]", 3),
])
def test_every_field_is_covered(where, field_name, line):
    """The forms are caught where YAML resolves them, so no field reads them: `shape: [total_q, 010]`
    gave 8 columns."""
    for v in ("010", "1:30", "0b11", "1_0"):
        err = one(CAUSAL + where.format(v=v))
        assert (err.field, err.location.line) == (field_name, line), str(err)
        assert err.source_line[err.location.col - 1:].startswith(v), str(err)


@pytest.mark.parametrize("word", ["yes", "No", "ON", "off"])
def test_yaml_1_1_bool_words_are_refused(word):
    err = one(CAUSAL + f"scalars:\n  w: {{dtype: int, default: 1, positive: {word}}}\n")
    truth = "true" if word.lower() in ("yes", "on") else "false"
    assert err.message.startswith(f"YAML 1.1 reads {word} as the bool {truth}")
    assert err.hint == f"write {truth}, or quote the value for text"


def test_quoted_forms_and_common_numbers_keep_their_meaning():
    spec = parse_spec(CAUSAL + "description: '010 1:30 yes'\nscalars:\n"
                      "  a: {dtype: int, default: 10}\n  b: {dtype: int, default: 0x10}\n"
                      "  c: {dtype: float, default: -1.5e+3}\n  d: {dtype: bool, default: true}\n"
                      "  e: {dtype: int, default: 0}\n  f: {dtype: int, default: -0}\n"
                      "  g: {dtype: float, default: 0.5}\n")
    assert spec.description == "010 1:30 yes"
    assert [s.default for s in spec.scalars] == [10, 16, -1500.0, True, 0, 0, 0.5]


def test_many_forms_are_reported_together():
    err = pytest.raises(SpecError, parse_spec, CAUSAL + "scalars:\n  a: {dtype: int, default: 010}\n"
                        "  b: {dtype: int, default: 1:30}\n", "spec.yaml").value
    assert [e.field for e in err.errors] == ["scalars.a.default", "scalars.b.default"]


def _count_work(text: str, monkeypatch) -> tuple[int, int]:
    """(events the parser produced, nodes composed) while ``text`` is refused."""
    produced = [0]
    original = yaml_loader.SpecLoader.get_event

    def counting(self):
        produced[0] += 1
        return original(self)

    monkeypatch.setattr(yaml_loader.SpecLoader, "get_event", counting)
    loader = yaml_loader.SpecLoader(text)
    with pytest.raises(yaml_loader.SpecYAMLError, match="YAML nodes"):
        loader.get_single_node()
    return produced[0], loader.nodes


def test_a_huge_flow_list_is_refused_after_the_node_limit(monkeypatch):
    """131k small ints in a 255 KiB flow list took 7.7 s to refuse: the limit was checked after two
    full passes. The reader now stops at the limit, having produced as many events as nodes."""
    text = CAUSAL + "backends: [" + ",".join(["1"] * 131_000) + "]\n"
    assert len(text) < 256 * 1024
    events, nodes = _count_work(text, monkeypatch)
    assert nodes == yaml_loader.MAX_YAML_NODES + 1
    assert events < yaml_loader.MAX_YAML_NODES + 20
    err = pytest.raises(SpecError, parse_spec, text, "spec.yaml").value
    assert err.message == f"spec has more than {yaml_loader.MAX_YAML_NODES} YAML nodes" and err.location.line == 3


def test_duplicate_keys_are_refused_after_the_node_limit(monkeypatch):
    """52k duplicate keys took 5.7 s: the composer stops at the node limit."""
    text = CAUSAL + "description:\n" + "  a: 1\n" * 52_000
    events, nodes = _count_work(text[: 256 * 1024 - 1], monkeypatch)
    assert nodes == yaml_loader.MAX_YAML_NODES + 1 and events < yaml_loader.MAX_YAML_NODES + 20


@pytest.mark.parametrize(("text", "message"), [
    ("a: &x 1\nb: *x\n", "YAML anchors (&name) are not allowed"),
    ("a: !!python/object 1\n", "YAML tags (tag:yaml.org,2002:python/object) are not allowed"),
    ("a: !!str [1]\n", "YAML tags"),
])
def test_anchors_aliases_and_tags_are_refused_while_composing(text, message):
    err = pytest.raises(SpecError, parse_spec, text, "spec.yaml").value
    assert err.message.startswith(message) and err.location.line >= 1


def test_the_loader_is_still_safe():
    with pytest.raises(yaml.YAMLError):
        yaml_loader.compose("a: !!python/object:os.system 1\n")


@pytest.mark.parametrize("value", ["yes", "010", "1:30"])
def test_an_expression_field_with_a_yaml_1_1_form_is_one_error(value):
    """`mask: yes` was reported twice: as the YAML 1.1 form and as "expected an expression"."""
    err = one(f"name: x\nmask: {value}\n")
    assert err.field == "mask" and err.message.startswith(f"YAML 1.1 reads {value} as ")
