"""Spec files (YAML) -> frozen ``VariantSpec`` (values.py), with every error located in the file.

YAML is read with the safe loader only, after a size check and a scan that refuses
anchors, aliases and tags; the node tree keeps line/column marks, so every field error
and every expression error names ``file:line:col``.
"""

from __future__ import annotations

import keyword
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import Location, SpecError, SpecErrors
from . import expr, nodes, parsing, yaml_loader
from .expr import BUILTINS, DIMS, FUNCTIONS, TensorSig, TypeEnv
from .nodes import FLOAT32_MAX, Type
from .reserved import RESERVED_PATTERN, reserved_reason
from .values import BACKENDS, SCALAR_DTYPES, TENSOR_DTYPES, ScalarArg, TensorArg, VariantSpec, shown_value, value_fits
from .yaml_reader import MISSING, SpecReader, expr_source, node_kind, node_location, type_word, yaml_error

MAX_SPEC_BYTES = 256 * 1024
MAX_FIXED_DIM = 65536  # a tensor's fixed dimension (shape: [total_q, 2]): at most this
# Matched with fullmatch: `$` would also accept a trailing newline ("causal\n").
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,47}")
ARG_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")

SYMBOLIC_DIMS = {d.name: f"{d.rows} (index with {' / '.join(d.builtins)})" for d in DIMS.values()}
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
        raise yaml_error(e, path, text) from None
    except RecursionError:
        raise SpecError("YAML is nested too deeply", Location(path)) from None
    if root is None:
        raise SpecError("spec is empty; expected a mapping with at least `name` and `mask`", Location(path, 1, 1))
    r = SpecReader(path, text)
    try:
        spec = _build(r, root)
    except RecursionError:
        raise SpecError("spec is nested too deeply", Location(path)) from None
    if r.errors:
        raise SpecErrors(r.errors, r.more) if len(r.errors) > 1 or r.more else r.errors[0]
    assert spec is not None
    return spec


def _check_arg_name(r: SpecReader, key_node: yaml.Node, name: str, where: str, taken: dict[str, str]) -> bool:
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
    if name in CPP_KEYWORDS or name in RESERVED_NAMES or name in parsing.KEYWORDS:
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


def _build(r: SpecReader, root: yaml.Node) -> VariantSpec | None:
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
        if logits is not None and "logits" not in nodes.names_used(logits):
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
    locations = {key: node_location(r.path, k) for key, (k, _) in fields.items()}
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


def _arguments(r: SpecReader, fields: dict, section: str, read_one, taken: dict[str, str], failed: set[str]) -> list:
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


def _tensor(r: SpecReader, name: str, node: yaml.Node) -> TensorArg | None:
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
                if isinstance(d, bool) or d is MISSING:
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


def _scalar(r: SpecReader, name: str, node: yaml.Node) -> ScalarArg | None:
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
    if default is MISSING:
        return None
    if not value_fits(default, dtype):
        number = isinstance(default, (int, float)) and not isinstance(default, bool)
        in_range = " in 32-bit range" if dtype == "int" and isinstance(default, int) and number else ""
        if dtype == "float" and number:  # nan, inf, 1e300: not "a float, got a float nan"
            in_range = " (finite, in 32-bit float range)"
        r.error(dnode, f"{field_name}.default", f"default must be {_article(dtype)} {dtype}"
                + in_range + f", got {type_word(default)} {shown_value(default)}",
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


def _scalar_range(r: SpecReader, field_name: str, dtype: str, got: dict) -> tuple | None:
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
        if v is MISSING:
            ok = False
        elif not value_fits(v, dtype) or (dtype == "float" and isinstance(v, bool)):
            want = "an int in 32-bit range" if dtype == "int" else "a finite number in 32-bit float range"
            r.error(vnode, f"{field_name}.{key}", f"{key} of {_article(dtype)} {dtype} scalar must be {want}, got "
                    f"{type_word(v)} {shown_value(v)}", _number_hint(vnode, v))
            ok = False
        else:
            bound[key] = float(v) if dtype == "float" else v
    positive = False
    if "positive" in got:
        v = r.scalar(got["positive"][1], f"{field_name}.positive")
        if isinstance(v, bool):
            positive = v
        elif v is not MISSING:
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


def _expression(r: SpecReader, node: yaml.Node, field_name: str, env: TypeEnv, expect: Type):
    # A sink may be a plain number (`sink: 0.0`, a fixed sink logit): parsed as the expression it reads as.
    number = field_name == "sink" and isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS
    if not number and (not isinstance(node, yaml.ScalarNode) or node.tag not in ("tag:yaml.org,2002:str",)):
        if isinstance(node, yaml.ScalarNode):
            value = r.scalar(node, field_name)
            if value is MISSING:  # (reported: a YAML 1.1 form, a huge number ...)
                return None, None
            if isinstance(value, bool) and field_name == "mask":
                r.error(node, field_name, f"expected an expression, got the bool {value}",
                        "write `true` inside quotes, or `kv_pos <= q_pos` for causal")
                return None, None
        r.error(node, field_name, f"expected an expression (text), got {node_kind(node)}")
        return None, None
    text = node.value
    src = expr_source(node, text, r.path, field_name)
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


def _scales(r: SpecReader, entry) -> tuple[float | None, bool]:
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
            elif v is not MISSING:
                r.error(vn, "scales.sm_scale",
                        f"expected a positive number or `default` (1/sqrt(head_dim_qk)), got {shown_value(v)}",
                        _number_hint(vn, v))
        elif key == "qkv_scales":
            v = r.scalar(vn, "scales.qkv_scales")
            if isinstance(v, bool):
                qkv = v
            elif v is not MISSING:
                r.error(vn, "scales.qkv_scales", f"expected true or false, got {shown_value(v)}")
        else:
            r.error(kn, f"scales.{key}", "unknown field; expected sm_scale, qkv_scales",
                    expr._suggest(key, ["sm_scale", "qkv_scales"]))
    return sm_scale, qkv


def _backends(r: SpecReader, entry) -> tuple[str, ...]:
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
        elif v is not MISSING:
            r.error(item, f"backends[{i}]", f"unknown backend {shown_value(v)}; expected one of {list(BACKENDS)}")
    return tuple(out) or ("fa2",)
