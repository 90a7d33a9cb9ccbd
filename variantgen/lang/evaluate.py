"""The expression tree evaluated with torch: the one evaluator of the spec language.

``Evaluator`` computes a mask or logits transform over tensors of builtin values
(``q_pos``, ``kv_pos``, ``request`` ...) that broadcast against each other: the dense
reference builds them over a request's [heads, qo_len, kv_len] grid (reference.py), the
interval planner over one entry per query row (intervals.row_intervals), the CPU fake
kernels over a launch request. Its semantics are the ones codegen.py promises the kernels
have: Python-style ``//`` and ``%`` (0 for a zero divisor), float ``/``, ``bit(x, i)`` on the
32-bit two's complement (false for i outside 0..31), offset row indices
(``kv_row - 1``) clamped to the rows of their request, other indices clamped to the
tensor's extent. Integers are evaluated in int64; expressions whose values leave the int32
range are outside the language's contract.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .expr import REQUEST_ROWS, row_index
from .nodes import Binary, Call, Cond, Const, Index, Name, Node, Type, Unary
from .values import VariantSpec

_SCALAR_TORCH_TYPES = {Type.BOOL: torch.bool, Type.INT: torch.int64, Type.FLOAT: torch.float32}
_FUNCTIONS = {"tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "sigmoid": torch.sigmoid}


class Evaluator:
    """Evaluates ``spec``'s expressions over ``env`` (builtin name -> int64 tensor; every
    builtin the expressions read) with the spec arguments ``args`` (tensors by name; scalars
    by name, their defaults where absent). ``logits``: the scores a logits transform reads."""

    def __init__(self, spec: VariantSpec, env: Mapping[str, torch.Tensor], args: Mapping[str, Any],
                 logits: torch.Tensor | None = None):
        if not env:
            raise ValueError("Evaluator: env must hold the builtin tensors the expressions read")
        self.spec = spec
        self.env = dict(env)
        self.args = args
        self.logits = logits
        self.device = next(iter(self.env.values())).device
        self._scalars: dict[tuple[Any, torch.dtype], torch.Tensor] = {}

    def ev(self, node: Node) -> torch.Tensor:
        """The value of ``node``: bool, int64 or float32 by its type, broadcast over the env."""
        return getattr(self, "_" + type(node).__name__.lower())(node)

    def as_float(self, node: Node) -> torch.Tensor:
        return self.ev(node).to(torch.float32)

    def _scalar_tensor(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        # One device tensor per distinct value: creating one is a host-to-device copy, and
        # the planner evaluates the same few constants many times per plan().
        # (the sign too: 0.0 == -0.0 would share a tensor, and 1.0 / -0.0 is -inf)
        key = (dtype, value, isinstance(value, float) and math.copysign(1.0, value) < 0)
        if key not in self._scalars:
            self._scalars[key] = torch.tensor(value, dtype=dtype, device=self.device)
        return self._scalars[key]

    def _const(self, node: Const) -> torch.Tensor:
        v = node.value
        dtype = torch.bool if isinstance(v, bool) else torch.int64 if isinstance(v, int) else torch.float32
        return self._scalar_tensor(v, dtype)

    def _name(self, node: Name) -> torch.Tensor:
        if node.id == "logits":
            assert self.logits is not None, "logits outside a transform passed type checking"
            return self.logits
        if node.id in self.env:
            return self.env[node.id]
        scalar = next(s for s in self.spec.scalars if s.name == node.id)
        return self._scalar_tensor(self.args.get(node.id, scalar.default), _SCALAR_TORCH_TYPES[scalar.ty])

    def _index(self, node: Index) -> torch.Tensor:
        tensor = self.args[node.tensor]
        shape = next(t.shape for t in self.spec.tensors if t.name == node.tensor)
        idx = []
        for k, (dim, sub) in enumerate(zip(shape, node.indices)):
            ref = row_index(sub) if isinstance(dim, str) else None
            if ref is not None and ref.offsets and ref.builtin in REQUEST_ROWS:
                # first row of the request + (position + offset) clamped to the request's rows
                position, count = (self.env[n] for n in REQUEST_ROWS[ref.builtin])
                local = position + sum(sign * self.ev(term).to(torch.int64) for sign, term in ref.offsets)
                i = self.env[ref.builtin] - position + torch.minimum(local.clamp_min(0), count - 1)
            else:
                i = self.ev(sub).to(torch.int64)
            idx.append(i.clamp(0, tensor.shape[k] - 1))
        idx = torch.broadcast_tensors(*idx)
        value = tensor.to(self.device)[tuple(idx)]
        return value.to(torch.int64) if tensor.dtype == torch.int32 else value.to(torch.float32)

    def _unary(self, node: Unary) -> torch.Tensor:
        x = self.ev(node.operand)
        if node.op == "not":
            return ~x
        return -x if node.op == "-" else x

    def _binary(self, node: Binary) -> torch.Tensor:
        op = node.op
        if op in ("and", "or"):
            a, b = self.ev(node.left), self.ev(node.right)
            return a & b if op == "and" else a | b
        float_math = node.left.ty is Type.FLOAT or node.right.ty is Type.FLOAT or op == "/"
        a = self.as_float(node.left) if float_math else self.ev(node.left)
        b = self.as_float(node.right) if float_math else self.ev(node.right)
        if op == "<":
            return a < b
        if op == "<=":
            return a <= b
        if op == ">":
            return a > b
        if op == ">=":
            return a >= b
        if op == "==":
            return a == b
        if op == "!=":
            return a != b
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return a / b
        zero = b == 0
        safe_b = torch.where(zero, torch.ones_like(b), b)
        if op == "//":
            return torch.where(zero, torch.zeros_like(a), torch.div(a, safe_b, rounding_mode="floor"))
        if op == "%":
            return torch.where(zero, torch.zeros_like(a), torch.remainder(a, safe_b))
        raise AssertionError(op)

    def _call(self, node: Call) -> torch.Tensor:
        f = node.func
        if f in ("min", "max"):
            vals = [self.as_float(a) if node.ty is Type.FLOAT else self.ev(a) for a in node.args]
            out = vals[0]
            # fmin / fmax: a NaN operand gives the other one, as the kernels' fminf / fmaxf do
            pick = (torch.fmin if f == "min" else torch.fmax) if node.ty is Type.FLOAT else \
                (torch.minimum if f == "min" else torch.maximum)
            for v in vals[1:]:
                out = pick(out, v)
            return out
        if f == "abs":
            return self.ev(node.args[0]).abs()
        if f == "bit":
            return bit(self.ev(node.args[0]), self.ev(node.args[1]))
        x = self.as_float(node.args[0])
        if f == "float":
            return x
        return _FUNCTIONS[f](x)

    def _cond(self, node: Cond) -> torch.Tensor:
        test = self.ev(node.test)
        if node.ty is Type.FLOAT:
            return torch.where(test, self.as_float(node.then), self.as_float(node.orelse))
        return torch.where(test, self.ev(node.then), self.ev(node.orelse))


def bit(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """The language's ``bit(x, i)`` on int64 tensors: bit i of x's low 32 bits (its int32 two's
    complement, as the kernel holds it), false for i outside 0..31."""
    in_range = (i >= 0) & (i < 32)
    word = torch.bitwise_and(x, 0xFFFFFFFF)
    return in_range & (torch.bitwise_and(torch.bitwise_right_shift(word, i.clamp(0, 31)), 1) == 1)
