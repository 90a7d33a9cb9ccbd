"""The YAML reader of spec files: PyYAML's safe loader, made strict and bounded.

* Limits are enforced while the text is read, never after: nesting (the scanner stops at
  MAX_YAML_DEPTH brackets or indentation levels) and the node count (the composer stops at
  MAX_YAML_NODES), so a hostile 256 KiB file costs a bounded amount of work.
* Anchors, aliases and explicit tags are refused as the composer meets them.
* Plain values that YAML 1.1 (PyYAML) reads otherwise than a reader of today's YAML or of
  the spec's own expressions would - ``010`` as octal 8, ``1:30`` as 90, ``yes`` as true,
  ``1_000`` as 1000, ``0o10`` as text - resolve to YAML11_TAG; the spec reader refuses such a
  value at its line and column with the form to write (``yaml11_problem``).
"""

from __future__ import annotations

import re

import yaml
from yaml.events import AliasEvent, CollectionStartEvent, ScalarEvent

MAX_YAML_NODES = 20_000
MAX_YAML_DEPTH = 32  # nested collections; a spec needs 4

MAX_NUMBER_CHARS = 64  # a YAML number literal longer than this is refused before it is converted
YAML11_TAG = "tag:variantgen,2026:yaml11-only"


class SpecYAMLError(yaml.MarkedYAMLError):
    """A YAML construct spec files refuse, at a mark; ``hint`` says what to write instead."""

    def __init__(self, message: str, mark: yaml.Mark | None, hint: str | None = None):
        super().__init__(problem=message, problem_mark=mark)
        self.hint = hint


_SIGN = r"[-+]?"
_OCTAL_11 = re.compile(_SIGN + r"0[0-9_]+")  # 010 (octal 8 in YAML 1.1); 09 (text there)
_OCTAL_12 = re.compile(_SIGN + r"0o[0-7_]+")  # 0o10 (YAML 1.2's octal; text in YAML 1.1)
_BINARY = re.compile(_SIGN + r"0b[0-1_]+")
_SEXAGESIMAL = re.compile(_SIGN + r"[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")
_UNDERSCORED = re.compile(_SIGN + r"(?:0x[0-9a-fA-F_]*_[0-9a-fA-F_]*|[0-9_]*_[0-9_]*(?:\.[0-9_]*)?"
                          r"(?:[eE][-+][0-9]+)?|[0-9_]*\.[0-9_]*_[0-9_]*(?:[eE][-+][0-9]+)?)")
_BOOL_WORDS = re.compile(r"yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF")
_TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}(?:(?:[Tt]|[ \t]+).*)?")

_NUMERIC_FORMS = (_OCTAL_11, _OCTAL_12, _BINARY, _SEXAGESIMAL, _UNDERSCORED)


def _digits(text: str) -> str:
    return text.replace("_", "")


def yaml11_problem(value: str) -> tuple[str, str] | None:
    """(what YAML 1.1 makes of the plain value ``value``, what to write instead), or None for
    a value whose reading is the same in YAML 1.1, YAML 1.2 and the spec's expressions."""
    if len(value) > MAX_NUMBER_CHARS and any(p.fullmatch(value) for p in _NUMERIC_FORMS):
        # (int() of thousands of digits is slow or refused; such a value is no spec value anyway)
        return "a number too long to be a spec value", "spec values are 32-bit ints and floats"
    sign = "-" if value.startswith("-") else ""
    body = value.lstrip("+-")
    if _BINARY.fullmatch(value):
        n = int(sign + _digits(body)[2:], 2)
        return f"YAML 1.1 reads {value} as the binary number {n}", f"write {n}, or quote the value for text"
    if _OCTAL_12.fullmatch(value):
        n = int(sign + _digits(body)[2:], 8)
        return (f"YAML 1.1 reads {value} as text (not as octal {n})",
                f"write {n} for the number, or quote the value for text")
    if _OCTAL_11.fullmatch(value):
        digits = _digits(body).lstrip("0") or "0"
        octal = f"octal {int(sign + digits, 8)}" if re.fullmatch(r"[0-7]+", digits) else "text"
        return (f"YAML 1.1 reads {value} as {octal} (a leading zero), where an expression reads it as "
                f"{int(sign + digits)}", f"write {sign}{digits} without the leading zero, or quote the value for text")
    if _SEXAGESIMAL.fullmatch(value):
        return (f"YAML 1.1 reads {value} as a base-60 number", "quote the value for text, or write the number "
                "it stands for in decimal")
    if _UNDERSCORED.fullmatch(value) and any(ch.isdigit() for ch in value):
        return (f"YAML 1.1 reads {value} as a number with the '_' dropped, YAML 1.2 as text",
                f"write {_digits(value)} without '_', or quote the value for text")
    if _BOOL_WORDS.fullmatch(value):
        truth = "true" if value.lower() in ("yes", "on") else "false"
        return f"YAML 1.1 reads {value} as the bool {truth}", f"write {truth}, or quote the value for text"
    if _TIMESTAMP.fullmatch(value):
        return f"YAML 1.1 reads {value} as a date", "quote the value"
    return None


class SpecLoader(yaml.SafeLoader):
    """The safe loader with the limits and refusals of the module docstring. ``events`` and
    ``nodes`` count the work done (the tests check that a refusal stops early)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.nodes = 0

    # -- scanner: nesting

    def _too_deep(self) -> None:
        raise yaml.scanner.ScannerError(
            None, None, f"collections are nested more than {MAX_YAML_DEPTH} levels deep", self.get_mark())

    def fetch_flow_collection_start(self, TokenClass):  # PyYAML names the argument so
        if self.flow_level >= MAX_YAML_DEPTH:
            self._too_deep()
        super().fetch_flow_collection_start(TokenClass)

    def add_indent(self, column: int) -> bool:
        added = super().add_indent(column)
        if added and len(self.indents) > MAX_YAML_DEPTH:
            self._too_deep()
        return added

    # -- resolver: YAML 1.1-only readings

    def resolve(self, kind, value, implicit):
        if kind is yaml.ScalarNode and implicit[0] and yaml11_problem(value) is not None:
            return YAML11_TAG
        return super().resolve(kind, value, implicit)

    # -- composer: node count, anchors, aliases, tags

    def compose_node(self, parent, index):
        event = self.peek_event()
        self.nodes += 1
        if self.nodes > MAX_YAML_NODES:
            raise SpecYAMLError(f"spec has more than {MAX_YAML_NODES} YAML nodes", event.start_mark,
                                "a spec needs a few dozen; this file is not a spec")
        if isinstance(event, AliasEvent):
            raise SpecYAMLError("YAML aliases (*name) are not allowed in spec files; write the value out",
                                event.start_mark)
        if event.anchor:
            raise SpecYAMLError("YAML anchors (&name) are not allowed in spec files; write the value out",
                                event.start_mark)
        tag = event.tag
        implicit = event.implicit
        if isinstance(event, ScalarEvent):
            explicit = tag is not None and not any(implicit)
        else:
            assert isinstance(event, CollectionStartEvent)
            explicit = tag is not None and not implicit
        if explicit:
            shown = ascii(tag)[1:-1]
            raise SpecYAMLError(f"YAML tags ({shown}) are not allowed in spec files", event.start_mark,
                                "quote the value if the '!' is part of it")
        return super().compose_node(parent, index)


def compose(text: str) -> yaml.Node | None:
    """The node tree of one YAML document, read with SpecLoader (raises yaml.YAMLError,
    SpecYAMLError among them)."""
    loader = SpecLoader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()
