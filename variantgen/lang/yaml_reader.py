"""Reading a spec's YAML node tree with every error located in the file.

``SpecReader`` walks the composed nodes, converting values and collecting located errors;
``yaml_error`` turns a PyYAML failure into a message with the file's line and a caret;
``expr_source`` maps an expression scalar back to file positions (through YAML's folding,
quoting and block indentation) so expression errors name ``file:line:col`` too.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ..core.errors import MAX_SPEC_ERRORS, Location, SpecError
from . import parsing
from .parsing import SourceText
from .values import shown_value
from .yaml_loader import MAX_YAML_NODES, YAML11_TAG, SpecYAMLError, yaml11_problem

MAX_NUMBER_CHARS = 64  # a YAML number literal longer than this is refused before it is converted


def node_location(path: str, node: yaml.Node) -> Location:
    return Location(path, node.start_mark.line + 1, node.start_mark.column + 1)


def _shown_lines(text: str) -> list[str]:
    """The file's lines as an error shows them under its message, the caret at a YAML mark's
    column: YAML counts no byte-order mark (U+FEFF) as a column, so none is shown (a file saved
    with a BOM had the caret of an error on line 1 one column left)."""
    return text.replace("\ufeff", "").splitlines()


def _marked_error(text: str, path: str, mark: yaml.Mark | None, message: str, hint: str | None = None) -> SpecError:
    """A file-level error at a YAML mark, with the file's line and a caret like every other."""
    if mark is None:
        return SpecError(message, Location(path), hint=hint)
    lines = _shown_lines(text)
    # A mark just past the last line (end of the stream) gets an empty line to point at.
    line = lines[mark.line] if 0 <= mark.line < len(lines) else "" if mark.line == len(lines) else None
    return SpecError(message, Location(path, mark.line + 1, mark.column + 1), source_line=line, hint=hint)


# (substring of PyYAML's problem, hint); {open} is where the unclosed bracket or quote began.
_YAML_HINTS = (
    ("found character '\\t'", "indent with spaces: YAML does not allow tabs there"),
    ("mapping values are not allowed", "quote a value that contains ': ', and line nested keys up under their "
     "parent (e.g. mask: \"a: b\")"),
    ("could not find expected ':'", "each line of a mapping reads `key: value`; quote a value that continues "
     "on the next line"),
    ("expected ',' or ']'", "close the list opened {open} with ']'"),
    ("expected ',' or '}'", "close the mapping opened {open} with '}'"),
    ("found unexpected end of stream", "close the quote opened {open}"),
    ("found unknown escape character", "inside double quotes write a backslash as \\\\, or use single quotes"),
    ("did not find expected key", "keys of one mapping must start in the same column"),
    ("expected <block end>", "this line's indentation does not match the lines above it"),
    ("did not find expected node content", "a value is missing here; quote values that start with a special "
     "character (one of [ ] { } , : # & * ! | > ' \" % @ `)"),
    ("found character that cannot start any token", "quote values that start with a special character "
     "(one of [ ] { } , : # & * ! | > ' \" % @ `)"),
    ("collections are nested more than", None),
)


_YAML_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")


def _reader_error(e: yaml.reader.ReaderError, path: str, text: str) -> SpecError:
    """A character YAML refuses before it scans anything (a control character): PyYAML gives
    only its offset, so the line and column are counted here, the way its marks count them."""
    pos = max(0, min(e.position, len(text)))
    before = _YAML_BREAK.split(text[:pos])
    mark = yaml.Mark(path, pos, len(before) - 1, len(before[-1]) - before[-1].count("\ufeff"), None, None)
    if not isinstance(e.character, int):
        return _marked_error(text, path, mark, f"invalid YAML: {e.reason}")
    escape = f"\\x{e.character:02x}" if e.character < 0x100 else f"\\u{e.character:04x}"
    return _marked_error(text, path, mark, f"invalid YAML: character U+{e.character:04X} is not allowed in a YAML "
                         "file", f"remove it; inside double quotes it can be written as the escape {escape}")


def yaml_error(e: yaml.YAMLError, path: str, text: str) -> SpecError:
    if isinstance(e, SpecYAMLError):
        return _marked_error(text, path, e.problem_mark, e.problem, e.hint)
    if isinstance(e, yaml.reader.ReaderError):
        return _reader_error(e, path, text)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    msg = f"invalid YAML: {problem}" + (f" ({context})" if context else "")
    opened = getattr(e, "context_mark", None)
    where_open = f"at line {opened.line + 1}, column {opened.column + 1}" if opened is not None else "before"
    hint: str | None = "check the indentation and quoting around here"
    for needle, text_hint in _YAML_HINTS:
        if needle in problem:
            hint = text_hint.replace("{open}", where_open) if text_hint else None
            break
    return _marked_error(text, path, mark, msg, hint)


class SpecReader:
    """Walks the composed YAML node tree, converting values and collecting errors."""

    def __init__(self, path: str, text: str):
        self.path = path
        self.lines = _shown_lines(text)
        self.errors: list[SpecError] = []
        self.more = 0  # errors past MAX_SPEC_ERRORS: counted, not kept
        self.nodes = 0

    def add(self, err: SpecError) -> None:
        if len(self.errors) < MAX_SPEC_ERRORS:
            self.errors.append(err)
        else:
            self.more += 1

    def error(self, node: yaml.Node | None, field_name: str, message: str, hint: str | None = None) -> None:
        if len(self.errors) >= MAX_SPEC_ERRORS:
            self.more += 1
            return
        loc = node_location(self.path, node) if node is not None else Location(self.path)
        line = self.lines[loc.line - 1] if node is not None and 0 < loc.line <= len(self.lines) else None
        shown = _shown(field_name) if field_name else None  # '': the document itself
        self.errors.append(SpecError(message, loc, field=shown, source_line=line, hint=hint))

    def count(self) -> None:
        self.nodes += 1
        if self.nodes > MAX_YAML_NODES:
            raise SpecError(f"spec has more than {MAX_YAML_NODES} YAML nodes", Location(self.path))

    def mapping(self, node: yaml.Node, field_name: str) -> list[tuple[str, yaml.Node, yaml.Node]] | None:
        self.count()
        if not isinstance(node, yaml.MappingNode):
            self.error(node, field_name, f"expected a mapping (key: value lines), got {node_kind(node)}")
            return None
        out, seen = [], {}
        for key_node, value_node in node.value:
            self.count()
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                self.error(key_node, field_name, f"keys must be plain names, got {node_kind(key_node)}")
                continue
            key = key_node.value
            if key in seen:
                self.error(key_node, f"{field_name}.{key}" if field_name else key,
                           f"duplicate key `{_shown(key)}` (first at line {seen[key]})")
                continue
            seen[key] = key_node.start_mark.line + 1
            out.append((key, key_node, value_node))
        return out

    def scalar(self, node: yaml.Node, field_name: str) -> Any:
        self.count()
        if not isinstance(node, yaml.ScalarNode):
            self.error(node, field_name, f"expected a single value, got {node_kind(node)}")
            return MISSING
        if node.tag == YAML11_TAG:
            what, write = yaml11_problem(node.value) or ("", "")
            if what.startswith("a number too long"):  # (yaml11_problem did not convert it)
                self.error(node, field_name, f"integer {parsing.shorten(node.value)} is far too large", write)
            else:
                self.error(node, field_name, f"{what}: spec files refuse values that YAML versions read "
                           "differently", write)
            return MISSING
        if node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_NUMBER_CHARS:
            # Converting it is slow, past 4300 digits it raises, and no spec value needs it.
            self.error(node, field_name, f"integer {parsing.shorten(node.value)} is far too large",
                       "spec values are 32-bit ints and floats")
            return MISSING
        try:
            return yaml.SafeLoader(" ").construct_object(node)  # type: ignore[arg-type]
        except Exception as e:  # a malformed timestamp, a bad float ...
            self.error(node, field_name, f"cannot read value: {e}")
            return MISSING

    def string(self, node: yaml.Node, field_name: str) -> str | None:
        value = self.scalar(node, field_name)
        if value is MISSING:
            return None
        if not isinstance(value, str):
            self.error(node, field_name, f"expected text, got {type_word(value)} {shown_value(value)}",
                       "quote the value" if value is not None else None)
            return None
        return value


_PLAIN_FIELD = re.compile(r"[A-Za-z0-9_.\[\]]+")


def _shown(text: str) -> str:
    """A field name built from the file's keys, safe to print: as is when plain, else
    quoted and escaped (control characters, odd spaces or line breaks never reach a message);
    a long one is cut in the middle."""
    shown = text if _PLAIN_FIELD.fullmatch(text) else ascii(text)
    return shown if len(shown) <= 80 else f"{shown[:56]}...{shown[-8:]} ({len(shown)} characters)"


class _Missing:
    pass


MISSING = _Missing()


def node_kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"the value {shown_value(node.value)}"


def type_word(value: Any) -> str:
    if value is None:
        return "nothing"
    return {bool: "a bool", int: "an int", float: "a float", str: "text", list: "a list", dict: "a mapping"}.get(
        type(value), type(value).__name__
    )


_LINE_BREAKS = "\r\n\x85\u2028\u2029"


def _scalar_positions(node: yaml.ScalarNode, text: str) -> tuple[tuple[int, int], ...]:
    """(line, col) in the file of each offset 0..len(text) of a scalar's value; () if unsure.

    YAML folds plain, quoted and '>' scalars (a line break and the next line's indentation
    become one space), strips a block's indentation and unescapes quoted scalars, so the
    value's lines and columns are not the file's. Every non-blank character of the value
    comes from the source in order (an escape gives one character); we align the two,
    skipping only blanks and quoting, and give up on anything else.
    """
    start, end = node.start_mark, node.end_mark
    buf = start.buffer
    if not buf or start.pointer is None or end.pointer is None or end.pointer >= len(buf):
        return ()
    stop = end.pointer
    # File position of every source index of the scalar, counted the way YAML's reader does.
    where: dict[int, tuple[int, int]] = {}
    line, col = start.line + 1, start.column + 1
    for i in range(start.pointer, stop + 1):
        where[i] = (line, col)
        ch = buf[i]
        if ch in "\n\x85\u2028\u2029" or (ch == "\r" and buf[i + 1:i + 2] != "\n"):
            line, col = line + 1, 1
        elif ch != "\ufeff":
            col += 1
    j = start.pointer
    if node.style in ("|", ">"):  # skip the header line ('|', '>-', '|2  # comment' ...)
        while j < stop and buf[j] not in _LINE_BREAKS:
            j += 1
    elif node.style in ("'", '"'):
        j += 1
    double = node.style == '"'
    out: list[tuple[int, int]] = []
    for ch in text:
        if ch.isspace():  # a blank of the source, or a folded line break
            out.append(where[j])
            if buf[j] == ch:
                j += 1
            continue
        while j < stop:
            c = buf[j]
            if double and c == "\\":
                if buf[j + 1] in _LINE_BREAKS:  # escaped line break: continues the line
                    j += 2
                    continue
                break  # an escape: it gives this character
            if c == ch:
                break
            if not (c.isspace() or (c == "'" and node.style == "'")):
                return ()
            j += 1
        if j >= stop:
            return ()
        out.append(where[j])
        j += 2 + {"x": 2, "u": 4, "U": 8}.get(buf[j + 1], 0) if double and buf[j] == "\\" else 1
        j = min(j, stop)
    out.append(where[j])
    return tuple(out)


def expr_source(node: yaml.ScalarNode, text: str, path: str, field_name: str) -> SourceText:
    """Map an expression scalar back to file positions, for plain, quoted and block styles."""
    line0, col0 = node.start_mark.line + 1, node.start_mark.column + 1
    style = node.style
    positions = _scalar_positions(node, text)
    if positions:
        starts = tuple(positions[0:1]) + tuple(positions[i + 1] for i, ch in enumerate(text) if ch == "\n")
        return SourceText(text, path, starts, field_name, positions)
    n_lines = text.count("\n") + 1
    if style in ("|", ">"):
        # Block scalar: content starts on the next line, at the block's indentation.
        raw_lines = node.start_mark.buffer.splitlines() if node.start_mark.buffer else []
        starts = []
        file_line = line0 + 1
        for _ in range(n_lines):
            indent = 1
            if 0 < file_line <= len(raw_lines):
                raw = raw_lines[file_line - 1].rstrip("\0")
                indent = len(raw) - len(raw.lstrip(" ")) + 1
            starts.append((file_line, indent))
            file_line += 1
        return SourceText(text, path, tuple(starts), field_name)
    if style in ("'", '"'):
        col0 += 1
    starts = [(line0, col0)] + [(line0 + i, 1) for i in range(1, n_lines)]
    return SourceText(text, path, tuple(starts), field_name)
