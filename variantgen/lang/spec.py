"""Spec files (YAML) -> frozen ``VariantSpec``, with every error located in the file.

YAML is read with the safe loader only, after a size check and a scan that refuses
anchors, aliases and tags; the node tree keeps line/column marks, so every field error
and every expression error names ``file:line:col``.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import os
import re
import struct
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import MAX_SPEC_ERRORS, Location, SpecError, SpecErrors
from . import expr, yaml_loader
from .expr import BUILTINS, DIMS, FLOAT32_MAX, FUNCTIONS, SourceText, TensorSig, Type, TypeEnv
from .reserved import RESERVED_PATTERN, reserved_reason
from .yaml_loader import MAX_YAML_DEPTH, MAX_YAML_NODES, YAML11_TAG, SpecYAMLError, yaml11_problem  # noqa: F401

MAX_SPEC_BYTES = 256 * 1024
MAX_FIXED_DIM = 65536  # a tensor's fixed dimension (shape: [total_q, 2]): at most this
# Matched with fullmatch: `$` would also accept a trailing newline ("causal\n").
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,47}")
ARG_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_NUMBER_CHARS = 64  # a YAML number literal longer than this is refused before it is converted

TENSOR_DTYPES = {"int32": Type.INT, "float32": Type.FLOAT}
SCALAR_DTYPES = {"int": Type.INT, "float": Type.FLOAT, "bool": Type.BOOL}
SYMBOLIC_DIMS = {d.name: f"{d.rows} (index with {' / '.join(d.builtins)})" for d in DIMS.values()}
# The backends a spec may name in `backends:` (capabilities.TABLE describes each).
BACKENDS = ("fa2", "fa3", "flex")
TOP_LEVEL_KEYS = ("name", "description", "tensors", "scalars", "mask", "logits", "sink", "scales", "backends")

# Names an argument may not take: C++ keywords and identifiers that would shadow or
# collide with FlashInfer's params fields, the kernel's locals or our own internals.
CPP_KEYWORDS = frozenset(
    """alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t
    char32_t class compl concept const consteval constexpr constinit const_cast continue co_await
    co_return co_yield decltype default delete do double dynamic_cast else enum explicit export
    extern false float for friend goto if inline int long mutable namespace new noexcept not not_eq
    nullptr operator or or_eq private protected public register reinterpret_cast requires return
    short signed sizeof static static_assert static_cast struct switch template this thread_local
    throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t while
    xor xor_eq int32_t int64_t uint32_t uint8_t half nv_bfloat16 math std flashinfer""".split()
)
RESERVED_NAMES = frozenset(
    """params q k v o lse paged_kv q_indptr kv_indptr o_indptr group_size num_qo_heads num_kv_heads
    q_stride_n q_stride_h k_stride_n k_stride_h v_stride_n v_stride_h window_left request_indices
    qo_tile_indices kv_tile_indices merge_indptr block_valid_mask kv_chunk_size_ptr
    max_total_num_rows total_num_rows padded_batch_size partition_kv sm_scale sm_scale_log2 v_scale
    q_scale k_scale logits_soft_cap rope_scale rope_theta additional_params maybe_custom_mask
    maybe_mask_indptr maybe_alibi_slopes maybe_prefix_len_ptr batch_idx qo_idx kv_idx qo_head_idx
    kv_head_idx smem_ptr out return_lse plan run workspace enable_pdl get_kv_len get_qo_len k_sf_stride_page
    k_sf_stride_n k_sf_stride_h v_sf_stride_page v_sf_stride_n v_sf_stride_h
    decode_maybe_q_rope_offset maybe_q_rope_offset maybe_k_rope_offset maybe_k_cache_sf maybe_v_cache_sf
    maybe_scale_q maybe_scale_k maybe_scale_v maybe_max_item_len_ptr maybe_token_pos_in_items_ptr
    token_pos_in_items_len scale_q_scalar scale_k_scalar scale_v_scalar scale_pv""".split()
)
# (The last lines: members FlashInfer's kernels test for by name, DEFINE_HAS_MEMBER, and use
# where a Params has one - a spec argument so named would switch on a scale or a RoPE offset.)
# The parameters of the wrappers' plan() and run(), which take spec arguments as **kwargs: an
# argument so named could not be passed (`got multiple values`), or would set the wrapper's own
# option instead. (Those already reserved above - q, k, v, out, num_qo_heads ... - are left out.)
WRAPPER_PARAMS = frozenset(
    """qo_indptr paged_kv_indptr paged_kv_indices paged_kv_last_page_len page_size skip_tiles disable_split_kv
    q_len_per_request paged_kv_cache""".split()
)


@dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: str  # 'int32' | 'float32'
    shape: tuple[str | int, ...]
    doc: str = ""

    @property
    def elem(self) -> Type:
        return TENSOR_DTYPES[self.dtype]

    @property
    def cpp_type(self) -> str:
        return {"int32": "int32_t", "float32": "float"}[self.dtype]


@dataclass(frozen=True)
class ScalarArg:
    name: str
    dtype: str  # 'int' | 'float' | 'bool'
    default: bool | int | float
    doc: str = ""
    # The valid range (spec keys `min`, `max`, `positive`), checked for the default at load
    # time and for every value plan()/run() get. Not part of the generated code.
    minimum: int | float | None = None  # inclusive
    maximum: int | float | None = None  # inclusive
    positive: bool = False  # > 0

    @property
    def ty(self) -> Type:
        return SCALAR_DTYPES[self.dtype]

    @property
    def has_range(self) -> bool:
        return self.positive or self.minimum is not None or self.maximum is not None

    def range_text(self) -> str:
        """The valid range as `> 0 and <= 8`, for messages and docs."""
        parts = ["> 0"] if self.positive else []
        if self.minimum is not None:
            parts.append(f">= {self.minimum!r}")
        if self.maximum is not None:
            parts.append(f"<= {self.maximum!r}")
        return " and ".join(parts) or "any value"

    def out_of_range(self, value: int | float) -> str | None:
        """Why ``value`` (already of the scalar's type, see value_fits) is outside the valid
        range, or None. A float is judged as the kernel will see it: rounded to float32."""
        def inside(x: int | float) -> bool:
            return ((not self.positive or x > 0) and (self.minimum is None or x >= self.minimum)
                    and (self.maximum is None or x <= self.maximum))

        seen = _float32(value) if self.dtype == "float" else value
        if self.dtype == "bool" or inside(seen):
            return None
        rounded = f" (as a 32-bit float it is {seen!r})" if inside(value) else ""
        return f"{shown_value(value)}{rounded} is out of range: the spec allows {self.range_text()}"


@dataclass(frozen=True)
class VariantSpec:
    """A validated spec. Immutable; everything downstream takes this object."""

    name: str
    description: str
    tensors: tuple[TensorArg, ...]
    scalars: tuple[ScalarArg, ...]
    mask: expr.Node
    mask_text: str
    logits: expr.Node | None = None
    logits_text: str | None = None
    # A learned attention sink (gpt-oss): a logit per query head that joins every row's softmax
    # denominator and has no value; float, in the domain of the (transformed) logits.
    sink: expr.Node | None = None
    sink_text: str | None = None
    sm_scale: float | None = None  # None: 1/sqrt(head_dim_qk)
    qkv_scales: bool = True
    backends: tuple[str, ...] = BACKENDS
    path: str = "<string>"
    locations: dict[str, Location] = field(default_factory=dict, compare=False, hash=False)

    def __hash__(self) -> int:
        # Specs key caches looked up on every plan() (intervals.analyze): hash the deep, immutable
        # expression trees once, not per lookup. Same fields as the generated hash would use.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare and f.hash is not False))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def scalar_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.scalars)

    def type_env(self, allow_logits: bool = False) -> TypeEnv:
        return TypeEnv(
            scalars={s.name: s.ty for s in self.scalars},
            tensors={t.name: TensorSig(t.name, t.shape, t.elem) for t in self.tensors},
            allow_logits=allow_logits,
        )

    def canonical(self) -> dict[str, Any]:
        """Everything that changes the generated code, in a stable form (a spec without a sink
        keeps the form, and so the digest, it had before sinks existed)."""
        out = {
            "name": self.name,
            "tensors": [[t.name, t.dtype, list(t.shape)] for t in self.tensors],
            "scalars": [[s.name, s.dtype, s.default] for s in self.scalars],
            "mask": expr.to_source(self.mask),
            "logits": expr.to_source(self.logits) if self.logits is not None else None,
            "sm_scale": self.sm_scale,
            "qkv_scales": self.qkv_scales,
        }
        if self.sink is not None:
            out["sink"] = expr.to_source(self.sink)
        return out

    @property
    def digest(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def uses(self, name: str) -> bool:
        used = expr.names_used(self.mask)
        for extra in (self.logits, self.sink):
            if extra is not None:
                used |= expr.names_used(extra)
        return name in used


# ----------------------------------------------------------------------------- YAML


def _loc(path: str, node: yaml.Node) -> Location:
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


def _yaml_error(e: yaml.YAMLError, path: str, text: str) -> SpecError:
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


class _Reader:
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
        loc = _loc(self.path, node) if node is not None else Location(self.path)
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
            self.error(node, field_name, f"expected a mapping (key: value lines), got {_kind(node)}")
            return None
        out, seen = [], {}
        for key_node, value_node in node.value:
            self.count()
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                self.error(key_node, field_name, f"keys must be plain names, got {_kind(key_node)}")
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
            self.error(node, field_name, f"expected a single value, got {_kind(node)}")
            return _MISSING
        if node.tag == YAML11_TAG:
            what, write = yaml11_problem(node.value) or ("", "")
            if what.startswith("a number too long"):  # (yaml11_problem did not convert it)
                self.error(node, field_name, f"integer {expr._shorten(node.value)} is far too large", write)
            else:
                self.error(node, field_name, f"{what}: spec files refuse values that YAML versions read "
                           "differently", write)
            return _MISSING
        if node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_NUMBER_CHARS:
            # Converting it is slow, past 4300 digits it raises, and no spec value needs it.
            self.error(node, field_name, f"integer {expr._shorten(node.value)} is far too large",
                       "spec values are 32-bit ints and floats")
            return _MISSING
        try:
            return yaml.SafeLoader(" ").construct_object(node)  # type: ignore[arg-type]
        except Exception as e:  # a malformed timestamp, a bad float ...
            self.error(node, field_name, f"cannot read value: {e}")
            return _MISSING

    def string(self, node: yaml.Node, field_name: str) -> str | None:
        value = self.scalar(node, field_name)
        if value is _MISSING:
            return None
        if not isinstance(value, str):
            self.error(node, field_name, f"expected text, got {_pytype(value)} {shown_value(value)}",
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


_MISSING = _Missing()


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"the value {shown_value(node.value)}"


def _pytype(value: Any) -> str:
    if value is None:
        return "nothing"
    return {bool: "a bool", int: "an int", float: "a float", str: "text", list: "a list", dict: "a mapping"}.get(
        type(value), type(value).__name__
    )


def shown_value(value: Any, limit: int = 60) -> str:
    """repr() of a value for a message, bounded: a huge int is described (repr of one over
    4300 digits raises), long text is cut in the middle."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4096:
        return f"{'-' if value < 0 else ''}<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 24]}...{text[-8:]} ({len(text)} characters)"


def value_fits(value: Any, dtype: str) -> bool:
    """Whether ``value`` is a value of a scalar of this dtype as the kernel holds it: a bool;
    an int in 32-bit range; an int or float within float32's finite range (1e300 would be inf)."""
    if dtype == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if dtype == "int":
        return isinstance(value, int) and expr.INT32_MIN <= value <= expr.INT32_MAX
    # abs() compares ints of any size exactly (math.isfinite overflows past a double); NaN fails it.
    return isinstance(value, (int, float)) and abs(value) <= FLOAT32_MAX


def _float32(value: int | float) -> float:
    return struct.unpack("f", struct.pack("f", float(value)))[0]


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


def _expr_source(node: yaml.ScalarNode, text: str, path: str, field_name: str) -> SourceText:
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


# ----------------------------------------------------------------------------- loading


def load_spec(path: str | Path) -> VariantSpec:
    """Read and validate one spec file. Raises SpecError (SpecErrors for several); TypeError
    for a ``path`` that is not a str or os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_spec: path: expected a spec file path (str or os.PathLike), got {type(path).__name__}")
    p = Path(path)
    shown = str(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise SpecError("spec file not found", Location(shown)) from None
    except OSError as e:
        raise SpecError(f"cannot read spec file: {e.strerror}", Location(shown)) from None
    if not p.is_file():
        raise SpecError("not a regular file", Location(shown))
    if size > MAX_SPEC_BYTES:
        raise SpecError(f"spec file is {size} bytes; the limit is {MAX_SPEC_BYTES}", Location(shown))
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise SpecError(f"cannot read spec file: {e.strerror or e}", Location(shown)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise SpecError(f"spec file is not UTF-8 text (bad byte at offset {e.start})", Location(shown, line)) from None
    return parse_spec(text, shown)


def parse_spec(text: str, path: str = "<string>") -> VariantSpec:
    """Validate spec text. All independent field errors are reported together. TypeError for a
    ``text`` that is not a str (a file's bytes: decode them, or use load_spec)."""
    if not isinstance(text, str):
        raise TypeError(f"parse_spec: text: expected the spec's YAML as a str, got {type(text).__name__}"
                        + (" (decode it, or pass the file to load_spec)" if isinstance(text, bytes) else ""))
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is larger than {MAX_SPEC_BYTES} bytes", Location(path))
    if "\0" in text:
        line = text[: text.index("\0")].count("\n") + 1
        raise SpecError("spec contains a NUL byte", Location(path, line))
    try:
        root = yaml_loader.compose(text)
    except yaml.YAMLError as e:
        raise _yaml_error(e, path, text) from None
    except RecursionError:
        raise SpecError("YAML is nested too deeply", Location(path)) from None
    if root is None:
        raise SpecError("spec is empty; expected a mapping with at least `name` and `mask`", Location(path, 1, 1))
    r = _Reader(path, text)
    try:
        spec = _build(r, root)
    except RecursionError:
        raise SpecError("spec is nested too deeply", Location(path)) from None
    if r.errors:
        raise SpecErrors(r.errors, r.more) if len(r.errors) > 1 or r.more else r.errors[0]
    assert spec is not None
    return spec


def _check_arg_name(r: _Reader, key_node: yaml.Node, name: str, where: str, taken: dict[str, str]) -> bool:
    field_name = f"{where}.{name}"
    why = reserved_reason(name)
    # (a name like _x: the pattern's message says what a name may be)
    if why is not None and (ARG_RE.fullmatch(name) or not RESERVED_PATTERN.fullmatch(name)):
        r.error(key_node, field_name, f"{why}; choose another name")
        return False
    if not ARG_RE.fullmatch(name):
        r.error(key_node, field_name, f"argument name {shown_value(name)} must match {ARG_RE.pattern} "
                "(lower case letters, digits, '_'; at most 32 characters)")
        return False
    if name.startswith("vg_"):
        r.error(key_node, field_name, "names starting with 'vg_' are reserved for variantgen internals: "
                f"{shown_value(name)}")
        return False
    if name in BUILTINS or name in FUNCTIONS or name == "logits":
        r.error(key_node, field_name, f"`{name}` is a built-in name of the expression language and cannot be declared")
        return False
    if name in CPP_KEYWORDS or name in RESERVED_NAMES or name in expr.KEYWORDS:
        r.error(key_node, field_name, f"`{name}` is reserved (a C++ keyword or a FlashInfer kernel "
                "parameter it would shadow); choose another name")
        return False
    if keyword.iskeyword(name):
        r.error(key_node, field_name, f"`{name}` is a Python keyword: the wrappers' plan() and run() take spec "
                f"arguments by name, and `{name}=...` is a syntax error (only **{{'{name}': ...}} could pass it); "
                "choose another name")
        return False
    if name in WRAPPER_PARAMS:
        r.error(key_node, field_name, f"`{name}` is a parameter of the wrappers' plan() or run(), which take spec "
                "arguments by name: it could not be passed; choose another name")
        return False
    if name in taken:
        r.error(key_node, field_name, f"`{name}` is already declared as a {taken[name]}")
        return False
    return True


def _build(r: _Reader, root: yaml.Node) -> VariantSpec | None:
    items = r.mapping(root, "")
    if items is None:
        return None
    fields = {key: (k, v) for key, k, v in items}
    for key, key_node, _ in items:
        if key not in TOP_LEVEL_KEYS:
            hint = expr._suggest(key, list(TOP_LEVEL_KEYS))
            r.error(key_node, key, f"unknown field; expected one of: {', '.join(TOP_LEVEL_KEYS)}", hint)

    name = None
    if "name" not in fields:
        r.error(root, "name", "missing required field `name`")
    else:
        name = r.string(fields["name"][1], "name")
        if name is not None and not NAME_RE.fullmatch(name):
            r.error(fields["name"][1], "name", f"spec name {shown_value(name)} must match {NAME_RE.pattern} "
                    "(it becomes part of module names and cache paths)")
            name = None
    description = ""
    if "description" in fields:
        description = r.string(fields["description"][1], "description") or ""

    taken: dict[str, str] = {}  # argument name -> 'tensor' | 'scalar', shared by both sections
    failed: set[str] = set()  # declarations refused: their uses are not reported again
    tensors: list[TensorArg] = _arguments(r, fields, "tensors", _tensor, taken, failed)
    scalars: list[ScalarArg] = _arguments(r, fields, "scalars", _scalar, taken, failed)

    env = TypeEnv(
        scalars={s.name: s.ty for s in scalars},
        tensors={t.name: TensorSig(t.name, t.shape, t.elem) for t in tensors},
        failed=frozenset(failed - set(taken)),
    )
    mask = mask_text = None
    if "mask" not in fields:
        r.error(root, "mask", "missing required field `mask` (a bool expression; `kv_pos <= q_pos` is causal)")
    else:
        mask, mask_text = _expression(r, fields["mask"][1], "mask", env, Type.BOOL)
    logits = logits_text = None
    if "logits" in fields and not _is_null(fields["logits"][1]):
        logits, logits_text = _expression(
            r, fields["logits"][1], "logits",
            replace(env, allow_logits=True), Type.FLOAT,
        )
        if logits is not None and "logits" not in expr.names_used(logits):
            r.error(fields["logits"][1], "logits", "the logits transform never reads `logits`; "
                    "it would replace every score with a constant")
            logits = None

    sink = sink_text = None
    if "sink" in fields and not _is_null(fields["sink"][1]):
        sink, sink_text = _expression(r, fields["sink"][1], "sink", replace(env, sink=True), Type.FLOAT)

    sm_scale, qkv_scales = _scales(r, fields.get("scales"))
    backends = _backends(r, fields.get("backends"))
    if r.errors or name is None or mask is None:
        return None
    locations = {key: _loc(r.path, k) for key, (k, _) in fields.items()}
    return VariantSpec(
        name=name,
        description=description.strip(),
        tensors=tuple(tensors),
        scalars=tuple(scalars),
        mask=mask,
        mask_text=mask_text or "",
        logits=logits,
        logits_text=logits_text,
        sink=sink,
        sink_text=sink_text,
        sm_scale=sm_scale,
        qkv_scales=qkv_scales,
        backends=backends,
        path=r.path,
        locations=locations,
    )


def _arguments(r: _Reader, fields: dict, section: str, read_one, taken: dict[str, str], failed: set[str]) -> list:
    """The declared arguments of one section ('tensors' or 'scalars'), names checked; the
    names of refused declarations go to ``failed`` (a built-in name keeps its meaning)."""
    out = []
    if section not in fields:
        return out
    for name, key_node, value in r.mapping(fields[section][1], section) or []:
        if not _check_arg_name(r, key_node, name, section, taken):
            if name not in BUILTINS and name not in FUNCTIONS and name != "logits":
                failed.add(name)
            continue
        arg = read_one(r, name, value)
        if arg is not None:
            out.append(arg)
            taken[name] = section[:-1]
        else:
            failed.add(name)
    return out


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _tensor(r: _Reader, name: str, node: yaml.Node) -> TensorArg | None:
    field_name = f"tensors.{name}"
    items = r.mapping(node, field_name)
    if items is None:
        return None
    got = {k: (kn, v) for k, kn, v in items}
    for key, kn, _ in items:
        if key not in ("dtype", "shape", "doc"):
            r.error(kn, f"{field_name}.{key}", "unknown field; expected dtype, shape, doc",
                    expr._suggest(key, ["dtype", "shape", "doc"]))
    ok = True
    dtype = None
    if "dtype" not in got:
        r.error(node, f"{field_name}.dtype", f"missing dtype; expected one of: {', '.join(TENSOR_DTYPES)}")
        ok = False
    else:
        dtype = r.string(got["dtype"][1], f"{field_name}.dtype")
        if dtype is not None and dtype not in TENSOR_DTYPES:
            r.error(got["dtype"][1], f"{field_name}.dtype", f"unsupported tensor dtype {shown_value(dtype)}; "
                    f"expected one of: {', '.join(TENSOR_DTYPES)}", expr._suggest(dtype, list(TENSOR_DTYPES)))
            ok = False
        ok = ok and dtype is not None
    shape: list[str | int] = []
    if "shape" not in got:
        r.error(node, f"{field_name}.shape", "missing shape, e.g. [total_q, 2]")
        ok = False
    else:
        snode = got["shape"][1]
        if not isinstance(snode, yaml.SequenceNode) or not snode.value:
            r.error(snode, f"{field_name}.shape", "expected a non-empty list of dimensions, e.g. [total_q, 2]")
            ok = False
        elif len(snode.value) > 4:
            r.error(snode, f"{field_name}.shape", f"at most 4 dimensions are supported, got {len(snode.value)}")
            ok = False
        else:
            for i, dnode in enumerate(snode.value):
                d = r.scalar(dnode, f"{field_name}.shape[{i}]")
                if isinstance(d, bool) or d is _MISSING:
                    ok = False
                    if isinstance(d, bool):
                        r.error(dnode, f"{field_name}.shape[{i}]", "expected a dimension name or a size, got a bool")
                elif isinstance(d, int):
                    if not 1 <= d <= MAX_FIXED_DIM:
                        r.error(dnode, f"{field_name}.shape[{i}]",
                                f"fixed size must be 1..{MAX_FIXED_DIM}, got {shown_value(d)}")
                        ok = False
                    shape.append(d)
                elif isinstance(d, str) and d in SYMBOLIC_DIMS:
                    if i > 0 and d in expr.BATCH_SIZED:
                        # The kernel knows the extents of heads and fixed sizes, not of batch-sized
                        # dimensions, so only the first may be one (its rows are addressed by index).
                        r.error(dnode, f"{field_name}.shape[{i}]", f"`{d}` can only be a tensor's first dimension "
                                "(the dimensions after the first must be fixed sizes or head counts)")
                        ok = False
                    shape.append(d)
                else:
                    r.error(dnode, f"{field_name}.shape[{i}]",
                            f"unknown dimension {shown_value(d)}; expected a positive int or one of: "
                            f"{', '.join(SYMBOLIC_DIMS)}", expr._suggest(str(d), list(SYMBOLIC_DIMS)))
                    ok = False
    doc = ""
    if "doc" in got:
        doc = r.string(got["doc"][1], f"{field_name}.doc") or ""
    if not ok or dtype is None:
        return None
    return TensorArg(name, dtype, tuple(shape), doc.strip())


SCALAR_KEYS = ("dtype", "default", "doc", "min", "max", "positive")


def _scalar(r: _Reader, name: str, node: yaml.Node) -> ScalarArg | None:
    field_name = f"scalars.{name}"
    items = r.mapping(node, field_name)
    if items is None:
        return None
    got = {k: (kn, v) for k, kn, v in items}
    for key, kn, _ in items:
        if key not in SCALAR_KEYS:
            r.error(kn, f"{field_name}.{key}", f"unknown field; expected {', '.join(SCALAR_KEYS)}",
                    expr._suggest(key, list(SCALAR_KEYS)))
    if "dtype" not in got:
        r.error(node, f"{field_name}.dtype", f"missing dtype; expected one of: {', '.join(SCALAR_DTYPES)}")
        return None
    dtype = r.string(got["dtype"][1], f"{field_name}.dtype")
    if dtype is None:
        return None
    if dtype not in SCALAR_DTYPES:
        r.error(got["dtype"][1], f"{field_name}.dtype", f"unsupported scalar dtype {shown_value(dtype)}; expected "
                f"one of: {', '.join(SCALAR_DTYPES)}", expr._suggest(dtype, list(SCALAR_DTYPES)))
        return None
    bounds = _scalar_range(r, field_name, dtype, got)
    if "default" not in got:
        r.error(node, f"{field_name}.default",
                f"missing default ({_article(dtype)} {dtype}); run() uses it when the argument is omitted")
        return None
    dnode = got["default"][1]
    default = r.scalar(dnode, f"{field_name}.default")
    if default is _MISSING:
        return None
    if not value_fits(default, dtype):
        number = isinstance(default, (int, float)) and not isinstance(default, bool)
        in_range = " in 32-bit range" if dtype == "int" and isinstance(default, int) and number else ""
        if dtype == "float" and number:  # nan, inf, 1e300: not "a float, got a float nan"
            in_range = " (finite, in 32-bit float range)"
        r.error(dnode, f"{field_name}.default", f"default must be {_article(dtype)} {dtype}"
                + in_range + f", got {_pytype(default)} {shown_value(default)}",
                _number_hint(dnode, default))
        return None
    if dtype == "float":
        default = float(default)
    doc = (r.string(got["doc"][1], f"{field_name}.doc") or "") if "doc" in got else ""
    if bounds is None:
        return None
    arg = ScalarArg(name, dtype, default, doc.strip(), *bounds)
    problem = arg.out_of_range(default)
    if problem:
        r.error(dnode, f"{field_name}.default", f"default {problem}",
                "change the default or the range; run() uses the default when the argument is omitted")
        return None
    return arg


def _scalar_range(r: _Reader, field_name: str, dtype: str, got: dict) -> tuple | None:
    """(minimum, maximum, positive) from a scalar's `min`, `max` and `positive`; None (errors
    reported) when they are malformed or leave no valid value."""
    if dtype == "bool":
        for key in ("min", "max", "positive"):
            if key in got:
                r.error(got[key][0], f"{field_name}.{key}", "a bool scalar has no range")
        return None if any(key in got for key in ("min", "max", "positive")) else (None, None, False)
    ok = True
    bound: dict[str, int | float | None] = {"min": None, "max": None}
    for key in bound:
        if key not in got:
            continue
        vnode = got[key][1]
        v = r.scalar(vnode, f"{field_name}.{key}")
        if v is _MISSING:
            ok = False
        elif not value_fits(v, dtype) or (dtype == "float" and isinstance(v, bool)):
            want = "an int in 32-bit range" if dtype == "int" else "a finite number in 32-bit float range"
            r.error(vnode, f"{field_name}.{key}", f"{key} of {_article(dtype)} {dtype} scalar must be {want}, got "
                    f"{_pytype(v)} {shown_value(v)}", _number_hint(vnode, v))
            ok = False
        else:
            bound[key] = float(v) if dtype == "float" else v
    positive = False
    if "positive" in got:
        v = r.scalar(got["positive"][1], f"{field_name}.positive")
        if isinstance(v, bool):
            positive = v
        elif v is not _MISSING:
            r.error(got["positive"][1], f"{field_name}.positive", f"expected true or false, got {shown_value(v)}")
            ok = False
    lo, hi = bound["min"], bound["max"]
    if ok and hi is not None and ((lo is not None and hi < lo) or (positive and hi <= 0)):
        why = f"min {lo!r}" if lo is not None and hi < lo else "positive: true"
        r.error(got["max"][1], f"{field_name}.max", f"max {hi!r} with {why} leaves no valid value")
        ok = False
    return (lo, hi, positive) if ok else None


# A number YAML 1.1 (PyYAML) reads as text: its floats need a '.' and a signed exponent (1e-3, 1.5e5).
_TEXT_NUMBER = re.compile(r"([-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))[eE]([-+]?)([0-9]+)")


def _number_hint(node: yaml.Node, value: Any) -> str | None:
    """A hint for a number written so that YAML read it as text (`1e-3`): how to write it."""
    m = _TEXT_NUMBER.fullmatch(value) if isinstance(value, str) else None
    if m is None or not isinstance(node, yaml.ScalarNode) or node.style is not None:
        return None
    mantissa, sign, digits = m.groups()
    fixed = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{sign or '+'}{digits}"
    return f"YAML reads {value} as text (its floats need a '.' and a signed exponent); write {fixed}"


def _article(dtype: str) -> str:
    return "an" if dtype == "int" else "a"


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _expression(r: _Reader, node: yaml.Node, field_name: str, env: TypeEnv, expect: Type):
    # A sink may be a plain number (`sink: 0.0`, a fixed sink logit): parsed as the expression it reads as.
    number = field_name == "sink" and isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS
    if not number and (not isinstance(node, yaml.ScalarNode) or node.tag not in ("tag:yaml.org,2002:str",)):
        if isinstance(node, yaml.ScalarNode):
            value = r.scalar(node, field_name)
            if value is _MISSING:  # (reported: a YAML 1.1 form, a huge number ...)
                return None, None
            if isinstance(value, bool) and field_name == "mask":
                r.error(node, field_name, f"expected an expression, got the bool {value}",
                        "write `true` inside quotes, or `kv_pos <= q_pos` for causal")
                return None, None
        r.error(node, field_name, f"expected an expression (text), got {_kind(node)}")
        return None, None
    text = node.value
    src = _expr_source(node, text, r.path, field_name)
    try:
        return expr.parse_typed(src, env, expect), text
    except expr.FollowOnError:
        return None, None  # the refused declaration it uses is reported already
    except expr.ExprErrors as e:  # independent errors of the expression, each reported
        for one in e.errors:
            r.add(one)
        return None, None
    except SpecError as e:
        r.add(e)
        return None, None


def _scales(r: _Reader, entry) -> tuple[float | None, bool]:
    if entry is None:
        return None, True
    _, node = entry
    items = r.mapping(node, "scales")
    if items is None:
        return None, True
    sm_scale, qkv = None, True
    for key, kn, vn in items:
        if key == "sm_scale":
            v = r.scalar(vn, "scales.sm_scale")
            if v == "default" or v is None:
                sm_scale = None
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= FLOAT32_MAX:
                sm_scale = float(v)
            elif v is not _MISSING:
                r.error(vn, "scales.sm_scale",
                        f"expected a positive number or `default` (1/sqrt(head_dim_qk)), got {shown_value(v)}",
                        _number_hint(vn, v))
        elif key == "qkv_scales":
            v = r.scalar(vn, "scales.qkv_scales")
            if isinstance(v, bool):
                qkv = v
            elif v is not _MISSING:
                r.error(vn, "scales.qkv_scales", f"expected true or false, got {shown_value(v)}")
        else:
            r.error(kn, f"scales.{key}", "unknown field; expected sm_scale, qkv_scales",
                    expr._suggest(key, ["sm_scale", "qkv_scales"]))
    return sm_scale, qkv


def _backends(r: _Reader, entry) -> tuple[str, ...]:
    if entry is None:
        return BACKENDS  # a spec may restrict its backends; by default every one may run it
    _, node = entry
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        r.error(node, "backends", f"expected a non-empty list drawn from {list(BACKENDS)}")
        return ("fa2",)
    out: list[str] = []
    for i, item in enumerate(node.value):
        v = r.scalar(item, f"backends[{i}]")
        if v in BACKENDS:
            if v not in out:
                out.append(v)
        elif v is not _MISSING:
            r.error(item, f"backends[{i}]", f"unknown backend {shown_value(v)}; expected one of {list(BACKENDS)}")
    return tuple(out) or ("fa2",)
