"""A logits transform at the cost of its math: launch-uniform factors folded out of the element loop.

A transform runs once per (query, key, head) element; as written, ``soft_cap * tanh(logits /
soft_cap)`` costs the softmax scale, ``/ soft_cap`` and ``* soft_cap`` there. The kernels already
multiply every transformed logit by one launch-wide factor (``sm_scale_log2``, before exp2), and
the transform reads the logits through one (``sm_scale``); ``fold`` moves into those two what the
tree lets it, working on the expression, not on soft-cap:

* out: ``c * f(logits)`` (or ``f(logits) * c``, ``f(logits) / c``) with ``c`` launch-uniform and
  positive -> the kernel computes ``f`` and multiplies ``sm_scale_log2`` by ``c``. Sound because
  softmax, its max and its LSE (both in the kernel's log2 domain, after the multiply) see
  ``c * f`` either way; -inf (a masked key) stays -inf times a positive ``c``; and a learned
  sink is joined in that same domain, after the multiply. ``c`` must be provably > 0: a
  positive constant, a scalar declared ``positive: true`` or ``min: > 0`` (plan()/run() refuse
  another value), or a product / quotient of those.
* in: every use of ``logits`` inside ``f`` scaled by the same launch-uniform factor ``k``
  (``logits / soft_cap``, ``logits * 0.5``) -> the transform reads ``logits * (sm_scale * k)``,
  ``sm_scale * k`` computed once per CTA. Any sign: it is a rescaling of the input, not of the
  softmax.
* hoisted: what is left of ``f`` that reads only scalars and constants (``2.0 / soft_cap``, a
  scalar's square) is computed once per CTA into a member of the variant.

Launch-uniform means: constants and spec scalars (one value per run()); no builtin (positions,
rows, heads), no tensor element, no ``logits``. Values per row or head (a tensor indexed by
``qo_head``) are not hoisted: an fa2 CTA covers several query heads (GQA rows) and rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lang import nodes
from ..lang.nodes import Binary, Call, Const, Index, Name, Node
from ..lang.values import VariantSpec


@dataclass(frozen=True)
class Factor:
    """A product of launch-uniform terms: ``x * a0 * a1 / b0 ...`` (``muls``, ``divs``)."""

    muls: tuple[Node, ...] = ()
    divs: tuple[Node, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.muls or self.divs)

    def times(self, other: Factor) -> Factor:
        return Factor(self.muls + other.muls, self.divs + other.divs)

    def key(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Equal for factors that are the same product (term order aside)."""
        return tuple(sorted(map(nodes.to_source, self.muls))), tuple(sorted(map(nodes.to_source, self.divs)))

    def source(self) -> str:
        """The factor as spec text (for comments and the report of what was folded)."""
        text = " * ".join(nodes.to_source(n) for n in self.muls) or "1"
        return text + "".join(f" / {nodes.to_source(n)}" for n in self.divs)


@dataclass(frozen=True)
class FoldedLogits:
    """The transform as the kernel runs it: ``body`` per element (``logits`` in it standing for
    ``logits * in_scale``), then the softmax's scale times ``out_scale``; ``hoisted``: the
    launch-uniform subtrees of ``body`` computed once per CTA (same nodes, by identity)."""

    body: Node
    in_scale: Factor
    out_scale: Factor
    hoisted: tuple[Node, ...]


def is_uniform(node: Node, spec: VariantSpec) -> bool:
    """Whether ``node`` has one value per launch: constants and spec scalars only."""
    scalars = {s.name for s in spec.scalars}
    for n in nodes.walk(node):
        if isinstance(n, Index) or (isinstance(n, Name) and n.id not in scalars):
            return False
    return True


def is_positive(node: Node, spec: VariantSpec) -> bool:
    """Whether ``node`` is provably > 0 for every value plan()/run() accept (and finite where it
    is a constant)."""
    if isinstance(node, Const):
        return not isinstance(node.value, bool) and 0 < node.value < float("inf")
    if isinstance(node, Name):
        s = next((s for s in spec.scalars if s.name == node.id), None)
        return s is not None and s.dtype != "bool" and (s.positive or (s.minimum is not None and s.minimum > 0))
    if isinstance(node, Binary) and node.op in ("*", "/"):
        return is_positive(node.left, spec) and is_positive(node.right, spec)
    if isinstance(node, Call) and node.func == "float":
        return is_positive(node.args[0], spec)
    return False


def _peel_out(node: Node, spec: VariantSpec) -> tuple[Node, Factor]:
    """``node`` without its outer positive launch-uniform factors, and those factors."""
    if isinstance(node, Binary) and node.op in ("*", "/"):
        left_ok = node.op == "*" and is_uniform(node.left, spec) and is_positive(node.left, spec)
        right_ok = is_uniform(node.right, spec) and is_positive(node.right, spec)
        if right_ok and not is_uniform(node.left, spec):
            inner, f = _peel_out(node.left, spec)
            return inner, f.times(Factor((node.right,)) if node.op == "*" else Factor((), (node.right,)))
        if left_ok and not is_uniform(node.right, spec):
            inner, f = _peel_out(node.right, spec)
            return inner, f.times(Factor((node.left,)))
    return node, Factor()


def _scaled_logits(node: Node, spec: VariantSpec) -> Factor | None:
    """The factor when ``node`` is ``logits`` times / divided by launch-uniform terms (Factor()
    for ``logits`` itself); None otherwise."""
    if isinstance(node, Name) and node.id == "logits":
        return Factor()
    if isinstance(node, Call) and node.func == "float":
        return _scaled_logits(node.args[0], spec)
    if isinstance(node, Binary) and node.op in ("*", "/"):
        if is_uniform(node.right, spec):
            inner = _scaled_logits(node.left, spec)
            if inner is not None:
                return inner.times(Factor((node.right,)) if node.op == "*" else Factor((), (node.right,)))
        if node.op == "*" and is_uniform(node.left, spec):
            inner = _scaled_logits(node.right, spec)
            if inner is not None:
                return inner.times(Factor((node.left,)))
    return None


def _logits_uses(node: Node, spec: VariantSpec, out: list[tuple[Node, Factor]]) -> None:
    """Every maximal scaled-logits subtree of ``node`` with its factor, in tree order."""
    f = _scaled_logits(node, spec)
    if f is not None:
        out.append((node, f))
        return
    for child in node.children():
        _logits_uses(child, spec, out)


def _hoistable(node: Node, spec: VariantSpec, out: list[Node]) -> None:
    """The maximal launch-uniform subtrees worth a member (not a bare constant or scalar)."""
    if is_uniform(node, spec):
        if not isinstance(node, (Const, Name)):
            out.append(node)
        return
    for child in node.children():
        _hoistable(child, spec, out)


def fold(spec: VariantSpec) -> FoldedLogits | None:
    """The spec's logits transform folded (see the module docstring); None without one."""
    if spec.logits is None:
        return None
    body, out_scale = _peel_out(spec.logits, spec)
    uses: list[tuple[Node, Factor]] = []
    _logits_uses(body, spec, uses)
    in_scale = Factor()
    if uses and len({f.key() for _, f in uses}) == 1 and uses[0][1]:
        in_scale = uses[0][1]
        body = nodes.substitute(body, {id(n): Name(pos=n.pos, ty=nodes.Type.FLOAT, id="logits") for n, _ in uses})
    hoisted: list[Node] = []
    _hoistable(body, spec, hoisted)
    return FoldedLogits(body, in_scale, out_scale, tuple(hoisted))


def evaluate(folded: FoldedLogits, spec: VariantSpec, env: dict, args: dict, scores):
    """The transformed scores the way the kernel computes them (torch, for the CPU fakes and the
    tests): ``body`` on ``scores x in_scale``, times ``out_scale`` - which the kernel leaves to
    its softmax scale. ``scores``: the raw scores times the softmax scale."""
    from ..lang.evaluate import Evaluator

    uniform = Evaluator(spec, env, args)

    def value(f: Factor):
        out = None
        for n in f.muls:
            out = uniform.as_float(n) if out is None else out * uniform.as_float(n)
        for n in f.divs:
            out = (1.0 if out is None else out) / uniform.as_float(n)
        return out

    inner = scores * value(folded.in_scale) if folded.in_scale else scores
    out = Evaluator(spec, env, args, logits=inner).as_float(folded.body)
    return out * value(folded.out_scale) if folded.out_scale else out
