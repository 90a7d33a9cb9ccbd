"""Typed expression trees -> CUDA C++ for the variant hooks of FlashInfer's kernels.

Only this module turns expressions into C++: the expressions (``emit_mask``, ``emit_logits``,
``emit_row_expr``), the locals a hook defines for the builtins they read (``hook_locals``)
and the spec text quoted in comments (``comment_text``, ``comment_lines``). Every identifier
it emits is either one of those locals (``q_pos``, ``kv_pos`` ...), a checked spec argument
read through ``params.<name>``, or a helper of common/vg_helpers.cuh; numbers are re-emitted
from parsed values. The spec text reaches the sources only inside comments, made safe.

Semantics shared with reference.py (the torch reference must agree bit for bit on ints):
  * ints are 32-bit; ``//`` and ``%`` follow Python (floor) and give 0 for a zero divisor;
  * ``bit(x, i)`` is bit i of x's 32-bit two's complement, false for i outside 0..31;
  * ``/`` is float division; mixed int/float arithmetic is float;
  * a symbolic dimension is indexed by its row builtin (the type checker saw to it), in range
    by construction; an offset row (``kv_row - 1``) is clamped to the rows of its request, an
    offset head to the head count; a fixed-size dimension clamps any index that is not a
    constant in range.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lang import nodes, parsing
from ..lang.expr import REQUEST_ROWS, row_index
from ..lang.nodes import Binary, Call, Cond, Const, Index, Name, Node, Type, Unary, names_used
from ..lang.values import TensorArg, VariantSpec

# Built-in name -> local variable of the generated hook that holds it.
BUILTIN_LOCALS = {
    "q_pos": "q_pos",
    "kv_pos": "kv_pos",
    "q_idx": "q_idx",
    "q_row": "q_row",
    "kv_row": "kv_row",
    "q_kv_row": "q_kv_row",
    "request": "request",
    "qo_head": "qo_head",
    "kv_head": "kv_head",
    "qo_len": "req_qo_len",
    "kv_len": "req_kv_len",
}


@dataclass(frozen=True)
class Target:
    """How a hook of one kernel's variant reaches run()'s extra arguments and head counts."""

    args: str  # prefix of an extra argument, e.g. "params." -> params.<name>
    num_qo_heads: str
    num_kv_heads: str
    # hook locals defined otherwise than LOCAL_DEFS says: (builtin, C++ definition)
    local_overrides: tuple[tuple[str, str], ...] = ()
    # ints read as int64 (every name, constant and tensor element): the planner's bounds are the
    # mask rewritten (kv_pos - q_pos <= w gives kv_pos <= q_pos + w), whose values may leave the
    # int32 range where the mask's own do not; the torch rules (rowrules.py) compute in int64 too
    wide_ints: bool = False


# FA2 kernels hand the hooks their Params struct: paged prefill and decode keep the key/value
# head count in their paged_kv, the ragged kernel's RaggedParams in a field of its own.
FA2_PAGED = Target("params.", "int32_t(params.num_qo_heads)", "int32_t(params.paged_kv.num_heads)")
FA2_RAGGED = Target("params.", "int32_t(params.num_qo_heads)", "int32_t(params.num_kv_heads)")
# FA3 hooks get the mainloop's params; our arguments live in its additional_params. Its
# launches may be GQA-packed (the variant's pack_gqa > 1): a kernel row is then a query row and
# head of the launch request (vg_packed_row / vg_packed_head in vg_helpers.cuh).
FA3 = Target("params.additional_params.", "int32_t(params.additional_params.vg_num_qo_heads)",
             "int32_t(params.additional_params.vg_num_kv_heads)", local_overrides=(
                 ("q_local", "const int32_t q_local = vg_packed_row(uint32_t(qo_idx < qo_len ? qo_idx : qo_len - 1), "
                             "pack_gqa, pack_magic);  // padding lanes clamped first"),
                 ("qo_head", "const int32_t qo_head = vg_packed_head(uint32_t(qo_idx), int32_t(qo_head_idx), "
                             "int32_t(kv_head_idx), pack_gqa, pack_magic);"),
             ))

# The interval planner's row kernel (templates/planner): arguments are fields of its PlanArgs
# `p`; row-only expressions never read head counts (analyze refuses head-dependent masks).
PLANNER = Target("p.spec.", "int32_t(0)", "int32_t(0)", wide_ints=True)

CMP = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}


# The hook locals of the builtins (see hook_locals): builtin -> (C++ definition, the builtins
# it is computed from). The variant's constructor sets the *_base members from vg_meta.
LOCAL_DEFS = {
    "q_local": ("const int32_t q_local = int32_t(qo_idx < qo_len ? qo_idx : qo_len - 1);"
                "  // padding lanes: clamp before any per-token load", ()),
    "kv_local": ("const int32_t kv_local = int32_t(kv_idx < kv_len ? kv_idx : kv_len - 1);", ()),
    "q_pos": ("const int32_t q_pos = q_pos_base + q_local;", ("q_local",)),
    # The request's query index, not the launch request's (the planner splits requests).
    "q_idx": ("const int32_t q_idx = q_pos - (req_kv_len - req_qo_len);", ("q_pos",)),
    "kv_pos": ("const int32_t kv_pos = key_pos(kv_local);  // (past the gaps its page list skips)", ("kv_local",)),
    "q_row": ("const int32_t q_row = q_row_base + q_local;", ("q_local",)),
    "kv_row": ("const int32_t kv_row = kv_row_base + kv_pos;", ("kv_pos",)),
    "q_kv_row": ("const int32_t q_kv_row = kv_row_base + q_pos;", ("q_pos",)),
    "qo_head": ("const int32_t qo_head = int32_t(qo_head_idx);", ()),
    "kv_head": ("const int32_t kv_head = int32_t(kv_head_idx);", ()),
}
MEMBER_BUILTINS = frozenset({"request", "qo_len", "kv_len"})  # variant members, no local needed


def local_names(builtins: frozenset[str]) -> list[str]:
    """The hook locals ``builtins`` need, each after the ones it is computed from."""
    need: list[str] = []

    def add(name: str) -> None:
        if name in need:
            return
        for dep in LOCAL_DEFS[name][1]:
            add(dep)
        need.append(name)

    for b in sorted(builtins - MEMBER_BUILTINS):
        add(b)
    return need


def hook_locals(builtins: frozenset[str], indent: str = "    ", defined: frozenset[str] = frozenset(),
                target: Target | None = None) -> str:
    """The C++ lines defining the locals that ``builtins`` need, minus those already ``defined``
    (by an enclosing block of the same hook), as ``target``'s hooks define them."""
    defs = {name: code for name, (code, _) in LOCAL_DEFS.items()}
    if target is not None:
        defs.update(target.local_overrides)
    return "\n".join(indent + defs[n] for n in local_names(builtins) if n not in defined)


BREAK_WIDTH = 88  # a mask longer than this is broken at its top-level || / &&


@dataclass(frozen=True)
class Snippet:
    """A C++ expression plus what the hook must set up before evaluating it."""

    code: str
    builtins: frozenset[str]  # expression builtins it reads
    terms: tuple[str, ...] = ()  # the operands of its top-level || / && chain (more than one)
    joiner: str = ""  # that operator
    # launch-uniform int divisors (a scalar, not a constant) as (variant member, its value):
    # the hook divides by the member (vg::vg_int_divisor), which the constructor sets once
    divisors: tuple[tuple[str, str], ...] = ()

    def broken(self) -> str:
        """``code``, or where it is long and a chain at the top, one operand per line, each
        continuation line starting with the operator (a template indents them)."""
        if len(self.code) <= BREAK_WIDTH or len(self.terms) < 2:
            return self.code
        return f"\n{self.joiner} ".join(self.terms)


class _Emitter:
    def __init__(self, spec: VariantSpec, target: Target, logits_local: str | None = None,
                 exact_float: bool = False, fast_division: bool = False):
        self.spec = spec
        self.target = target
        # Float + - * / and sqrt rounded as IEEE float32 (vg_*_rn): a mask decides which keys are
        # seen, so its comparisons must see the values the reference computes - the modules'
        # -use_fast_math would fuse a * b + c and approximate / and sqrt. The logits transform and
        # the sink are values (compared with a tolerance): they keep the fast forms.
        self.exact_float = exact_float
        self.tensors: dict[str, TensorArg] = {t.name: t for t in spec.tensors}
        self.scalars = {s.name: s for s in spec.scalars}
        self.logits_local = logits_local
        self.builtins: set[str] = set()
        self.hoisted: dict[int, str] = {}  # id(node) -> the variant member computed from it once per CTA
        # int divisors of scalars only -> the variant's vg_int_divisor member (fast_division: the
        # kernel variants; not the planner's int64 row kernel)
        self.fast_division = fast_division and not target.wide_ints
        self.divisors: dict[str, str] = {}

    def emit(self, node: Node) -> str:
        if id(node) in self.hoisted:
            return self.hoisted[id(node)]
        return getattr(self, "_" + type(node).__name__.lower())(node)

    def as_float(self, node: Node) -> str:
        code = self.emit(node)
        return f"float({code})" if node.ty is not Type.FLOAT else code

    def _int(self, code: str) -> str:
        """An int leaf as the target computes ints (Target.wide_ints)."""
        return f"int64_t({code})" if self.target.wide_ints else code

    def _const(self, node: Const) -> str:
        v = node.value
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            width = "int64_t" if self.target.wide_ints else "int32_t"
            return f"{width}({v})" if v >= 0 else f"{width}({v}LL)"
        text = repr(float(v))
        if parsing.float32_of_decimal(text) != nodes.to_float32(v):  # (the float32 the reference computes with)
            text = repr(nodes.to_float32(v))
        if "e" not in text and "." not in text:
            text += ".0"
        return f"{text}f"

    def _name(self, node: Name) -> str:
        if node.id in BUILTIN_LOCALS:
            self.builtins.add(node.id)
            return self._int(BUILTIN_LOCALS[node.id])
        if node.id == "logits":
            assert self.logits_local is not None, "logits outside a transform passed type checking"
            return self.logits_local
        if node.id in self.scalars:
            code = f"arg_{node.id}"  # copied (and cast) from params once per CTA
            return self._int(code) if node.ty is Type.INT else code
        raise AssertionError(f"unchecked name {node.id!r}")

    def _index(self, node: Index) -> str:
        t = self.tensors[node.tensor]
        parts = [(dim, self._subscript(dim, idx)) for dim, idx in zip(t.shape, node.indices)]
        # Row-major flat offset; the loader allows only fixed sizes and head counts after the first.
        flat = parts[0][1]
        for dim, code in parts[1:]:
            flat = f"({flat}) * {self._extent(dim)} + {code}"
        code = f"{self.target.args}{t.name}[{flat}]"
        return self._int(code) if node.ty is Type.INT else code

    def _subscript(self, dim: str | int, idx: Node) -> str:
        """One index, in range: see the module docstring for which are clamped and how."""
        if isinstance(dim, int):
            code = self.emit(idx)
            in_range = isinstance(idx, Const) and 0 <= idx.value < dim
            return code if in_range else f"vg_clamp({code}, {self._extent(dim)})"
        ref = row_index(idx)
        assert ref is not None and ref.kind == dim, "an index the type checker refused"
        base = self.emit(Name(id=ref.builtin))
        if not ref.offsets:
            return base
        # int64: an offset must not overflow before it is clamped.
        shifted = "".join(f" {'+' if sign > 0 else '-'} {self.emit(term)}" for sign, term in ref.offsets)
        wide = (lambda code: code) if self.target.wide_ints else (lambda code: f"int64_t({code})")
        if ref.builtin not in REQUEST_ROWS:  # a head index: clamped to the head count
            return f"vg_clamp({wide(base)}{shifted}, {self._extent(dim)})"
        position, count = (self.emit(Name(id=n)) for n in REQUEST_ROWS[ref.builtin])
        return f"vg_request_row({base} - {position}, {wide(position)}{shifted}, {count})"

    def _extent(self, dim: str | int) -> str:
        if isinstance(dim, int):
            return f"int32_t({dim})"
        assert dim in ("num_qo_heads", "num_kv_heads"), f"no extent for dimension {dim!r} in a kernel"
        return getattr(self.target, dim)

    def _divisor(self, node: Node) -> str | None:
        """The variant member dividing by ``node``, where it is an int of the spec's scalars (the
        same for the whole launch) and not a constant (which the compiler divides by itself)."""
        used = names_used(node)
        if not self.fast_division or node.ty is not Type.INT or not used or not used <= set(self.scalars):
            return None
        value = self.emit(node)
        if value not in self.divisors:
            self.divisors[value] = f"vg_divisor{len(self.divisors)}"
        return self.divisors[value]

    def _unary(self, node: Unary) -> str:
        inner = self.emit(node.operand)
        if node.op == "not":
            return f"(!{inner})"
        return f"({node.op}{inner})"

    def _binary(self, node: Binary) -> str:
        op = node.op
        if op == "and":
            return f"({self.emit(node.left)} && {self.emit(node.right)})"
        if op == "or":
            return f"({self.emit(node.left)} || {self.emit(node.right)})"
        if op in CMP:
            if node.left.ty is Type.FLOAT or node.right.ty is Type.FLOAT:
                return f"({self.as_float(node.left)} {op} {self.as_float(node.right)})"
            return f"({self.emit(node.left)} {op} {self.emit(node.right)})"
        if op in ("//", "%"):
            member = self._divisor(node.right)
            if member is not None:  # (a multiply-high and a shift, where division costs ~30 instructions)
                return f"{'vg_floordiv_by' if op == '//' else 'vg_mod_by'}({self.emit(node.left)}, {member})"
            return f"{'vg_floordiv' if op == '//' else 'vg_mod'}({self.emit(node.left)}, {self.emit(node.right)})"
        if op == "/":
            div = "vg_fdiv_rn" if self.exact_float else "vg_div"
            return f"{div}({self.as_float(node.left)}, {self.as_float(node.right)})"
        if node.ty is Type.FLOAT:
            if self.exact_float:
                name = {"+": "vg_fadd_rn", "-": "vg_fsub_rn", "*": "vg_fmul_rn"}[op]
                return f"{name}({self.as_float(node.left)}, {self.as_float(node.right)})"
            return f"({self.as_float(node.left)} {op} {self.as_float(node.right)})"
        return f"({self.emit(node.left)} {op} {self.emit(node.right)})"

    def _call(self, node: Call) -> str:
        f = node.func
        if f in ("min", "max"):
            args = [self.as_float(a) if node.ty is Type.FLOAT else self.emit(a) for a in node.args]
            code = args[0]
            for a in args[1:]:
                code = f"vg_{f}({code}, {a})"
            return code
        if f == "abs":
            return f"vg_abs({self.emit(node.args[0])})"
        if f == "float":
            return self.as_float(node.args[0])
        if f == "bit":
            return f"vg_bit({self.emit(node.args[0])}, {self.emit(node.args[1])})"
        if f == "sqrt" and self.exact_float:
            return f"vg_sqrt_rn({self.as_float(node.args[0])})"
        return f"vg_{f}({self.as_float(node.args[0])})"

    def _cond(self, node: Cond) -> str:
        if node.ty is Type.FLOAT:
            then, orelse = self.as_float(node.then), self.as_float(node.orelse)
        else:
            then, orelse = self.emit(node.then), self.emit(node.orelse)
        return f"({self.emit(node.test)} ? {then} : {orelse})"


def _chain(node: Node, op: str) -> list[Node]:
    """The operands of a chain of ``op`` (left-associated, as the parser builds it)."""
    if isinstance(node, Binary) and node.op == op:
        return _chain(node.left, op) + _chain(node.right, op)
    return [node]


def emit_mask(spec: VariantSpec, target: Target = FA2_PAGED) -> Snippet:
    e = _Emitter(spec, target, exact_float=True, fast_division=True)
    code = e.emit(spec.mask)
    root = spec.mask
    terms, joiner = (), ""
    if isinstance(root, Binary) and root.op in ("or", "and"):
        terms, joiner = tuple(e.emit(t) for t in _chain(root, root.op)), "||" if root.op == "or" else "&&"
    divisors = tuple((member, value) for value, member in e.divisors.items())
    return Snippet(code, frozenset(e.builtins), terms, joiner, divisors)


def emit_logits(spec: VariantSpec, logits_local: str = "score", target: Target = FA2_PAGED) -> Snippet | None:
    if spec.logits is None:
        return None
    e = _Emitter(spec, target, logits_local)
    code = e.as_float(spec.logits)
    return Snippet(code, frozenset(e.builtins))


@dataclass(frozen=True)
class LogitsCode:
    """A logits transform folded (logits_fold.py) as C++: ``code`` per element, reading
    ``score`` = logits x sm_scale ``score_scale``; the softmax's scale (``sm_scale_log2``) taken
    ``softmax_scale`` times; ``hoisted``: (C++ type, member, its value) set once per CTA."""

    code: str
    builtins: frozenset[str]
    score_scale: str  # "" or C++ factors, e.g. " / (arg_soft_cap)"
    softmax_scale: str  # "" or a C++ product, e.g. "(arg_soft_cap)"
    hoisted: tuple[tuple[str, str, str], ...]
    folded: tuple[str, ...]  # what was folded, for comments


_MEMBER_TYPES = {Type.FLOAT: "float", Type.INT: "int32_t", Type.BOOL: "bool"}


def emit_logits_folded(spec: VariantSpec, logits_local: str = "score", target: Target = FA2_PAGED) -> LogitsCode | None:
    """The spec's logits transform with its launch-uniform factors folded into the kernel's
    scales and its launch-uniform subtrees hoisted (logits_fold.fold); None without one."""
    from .logits_fold import fold

    folded = fold(spec)
    if folded is None:
        return None
    e = _Emitter(spec, target, logits_local)
    hoisted = []
    for i, node in enumerate(folded.hoisted):
        value = e.emit(node)
        e.hoisted[id(node)] = name = f"vg_uniform{i}"
        hoisted.append((_MEMBER_TYPES[node.ty], name, value))
    code = e.as_float(folded.body)

    def factors(f) -> str:
        return "".join(f" * ({e.as_float(n)})" for n in f.muls) + "".join(f" / ({e.as_float(n)})" for n in f.divs)

    softmax = factors(folded.out_scale).removeprefix(" * ")
    if softmax.startswith(" / "):
        softmax = "1.f" + softmax
    notes = []
    if folded.out_scale:
        notes.append(f"the outer factor {folded.out_scale.source()}: into the softmax scale (sm_scale_log2)")
    if folded.in_scale:
        notes.append(f"the factor of logits, {folded.in_scale.source()}: into the score scale (sm_scale)")
    notes += [f"{name} = {describe(node)}, once per CTA" for (_, name, _), node in zip(hoisted, folded.hoisted)]
    return LogitsCode(code, frozenset(e.builtins), factors(folded.in_scale), softmax, tuple(hoisted), tuple(notes))


def emit_sink(spec: VariantSpec, target: Target = FA2_PAGED) -> Snippet | None:
    """The spec's learned sink logit as a float C++ expression (None: no sink). It reads only
    expr.SINK_BUILTINS (the type checker saw to it): per query head and request."""
    if spec.sink is None:
        return None
    e = _Emitter(spec, target)
    code = e.as_float(spec.sink)
    return Snippet(code, frozenset(e.builtins))


def emit_row_expr(spec: VariantSpec, node: Node, target: Target = PLANNER) -> Snippet:
    """A row-only sub-expression of the mask (an interval bound or condition) as C++."""
    e = _Emitter(spec, target, exact_float=True)
    code = e.emit(node)
    return Snippet(code, frozenset(e.builtins))


def comment_text(text: str) -> str:
    """Spec text made safe for a C++ line comment: one line, no comment terminators."""
    flat = " ".join(text.split())
    # Backslashes first: turned into '/', they could otherwise form a new '*/' or '/*'.
    flat = flat.replace("\\", "/").replace("*/", "* /").replace("/*", "/ *")
    flat = "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in flat)
    return flat[:300] + (" ..." if len(flat) > 300 else "")


def comment_lines(text: str, width: int = 84) -> list[str]:
    """``text`` for line comments: made safe (comment_text: one line, whitespace normalised,
    capped), then wrapped at spaces into lines of at most ``width`` characters where it can."""
    lines: list[str] = []
    for word in comment_text(text).split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def describe(node: Node) -> str:
    return comment_text(nodes.to_source(node))
