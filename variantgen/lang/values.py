"""The validated spec as values: ``VariantSpec`` and its ``TensorArg`` / ``ScalarArg``
arguments (frozen; hashed and digested for the caches), the dtypes and backends a spec may
name, and the bounded way a value is shown in a message (``shown_value``, ``value_fits``).

spec.py builds these from a spec file; everything downstream takes them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field, fields
from typing import Any

from ..core.errors import Location
from . import nodes
from .expr import TensorSig, TypeEnv
from .nodes import FLOAT32_MAX, Type

TENSOR_DTYPES = {"int32": Type.INT, "float32": Type.FLOAT}
SCALAR_DTYPES = {"int": Type.INT, "float": Type.FLOAT, "bool": Type.BOOL}
# The backends a spec may name in `backends:` (capabilities.TABLE describes each).
BACKENDS = ("fa2", "fa3", "flex")


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
    mask: nodes.Node
    mask_text: str
    logits: nodes.Node | None = None
    logits_text: str | None = None
    # A learned attention sink (gpt-oss): a logit per query head that joins every row's softmax
    # denominator and has no value; float, in the domain of the (transformed) logits.
    sink: nodes.Node | None = None
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
            "mask": nodes.to_source(self.mask),
            "logits": nodes.to_source(self.logits) if self.logits is not None else None,
            "sm_scale": self.sm_scale,
            "qkv_scales": self.qkv_scales,
        }
        if self.sink is not None:
            out["sink"] = nodes.to_source(self.sink)
        return out

    @property
    def digest(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def uses(self, name: str) -> bool:
        used = nodes.names_used(self.mask)
        for extra in (self.logits, self.sink):
            if extra is not None:
                used |= nodes.names_used(extra)
        return name in used


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
        return isinstance(value, int) and nodes.INT32_MIN <= value <= nodes.INT32_MAX
    # abs() compares ints of any size exactly (math.isfinite overflows past a double); NaN fails it.
    return isinstance(value, (int, float)) and abs(value) <= FLOAT32_MAX


def _float32(value: int | float) -> float:
    return struct.unpack("f", struct.pack("f", float(value)))[0]
