"""What can run where: every backend's capabilities in one table (resolver.py decides with it).

Each backend declares what it serves as fields (tinygrad's habit: a renderer's fields, not
if-chains spread over the callers): kernel kinds, (head_dim_qk, head_dim_vo) pairs per kind,
query / KV / output dtypes, target archs, the kinds it has a CUDA-graph mode for, and whether
it needs a compiled module. A ``Request`` (spec, kind, head
dims, dtypes, backend or None, CUDA-graph mode) is checked against a backend at a ``Site``
(the target arch, whether modules may be built, which are precompiled, which module-less routes
are installed) by ``Backend.problems``; resolver.resolve chooses with it.

ModuleConfig's validation (render.py), the resolver (and through it make_wrapper, probe and
the command line) ask this table; none re-decides.

``backend=None`` prefers fa3 where an fa3 module can run (paged and ragged prefill on sm90,
16-bit KV and output in the query's dtype: faster than fa2 on both plan routes, measured by
bench/bench_prefill.py and bench/bench_ragged.py, results in bench/results/), else fa2, else the
flex route; for decode fa2 first (KIND_ORDER) (torch's FlexAttention: no module, any device).
Where modules cannot be built (JIT disabled, ``build=False``) the cache decides among the
backends that could run: a precompiled fa2 module rather than a missing fa3 one, the flex route
rather than no module at all; with neither, the preferred module (the one to precompile).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..lang.values import BACKENDS

if TYPE_CHECKING:
    from ..lang.values import VariantSpec

KINDS = {
    "prefill": "paged-KV prefill",
    "ragged": "ragged-KV prefill",
    "decode": "paged-KV decode (CUDA cores)",
}
FLASHINFER_DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")  # what FlashInfer's kernels take
DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")  # every dtype some backend takes
DTYPE_ALIASES = {
    "bfloat16": "bf16", "bf16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "fp16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "float32": "fp32", "fp32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "float8_e4m3fn": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8": "fp8_e4m3",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "fp8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2", "torch.float8_e5m2": "fp8_e5m2",
}
MIN_ARCH = 8  # the oldest major arch FlashInfer's FA2 kernels run on (sm80)
# Why a kind has no CUDA-graph mode on any backend.
NOGRAPH_KINDS = {"ragged": "ragged wrappers allocate their metadata per plan()"}


def canonical_dtype(value: object, arg: str) -> str:
    """'bf16' for torch.bfloat16, 'bfloat16', 'bf16' ...; ValueError naming ``arg`` otherwise.
    A name is not a promise: which backends take it is the table's business."""
    key = str(value).strip().lower()
    if key in DTYPE_ALIASES:
        return DTYPE_ALIASES[key]
    raise ValueError(f"{arg}={value!r}: unsupported dtype; expected one of {sorted(DTYPE_NAMES)}")


def canonical_arch(value: str, name: str = "arch") -> str:
    """'9.0a' / '90a' / 'sm_90a' -> '9.0a'; ValueError naming the value (as ``name``) otherwise."""
    raw = str(value).strip().lower().removeprefix("sm_").removeprefix("sm").removeprefix("compute_")
    suffix = raw[-1] if raw and raw[-1] in "af" else ""
    digits = raw[:-1] if suffix else raw
    if "." in digits:
        major, _, minor = digits.partition(".")
    elif digits.isdigit() and len(digits) >= 2:
        major, minor = digits[:-1], digits[-1]
    else:
        major, minor = "", ""
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"{name}={value!r}: expected a compute capability such as 8.0, 9.0a or 10.0a")
    return f"{int(major)}.{int(minor)}{suffix}"


# Majors whose GPUs get modules built for the architecture-specific target (9.0a, 10.0a, 12.0a), as
# FlashInfer builds its own kernels for them: sm90's wgmma / TMA (fa3) need it, and on Blackwell
# (sm100 / sm103 / sm110 / sm120 / sm121) a build box's `precompile --arch 10.0a` must be the
# module a B200 looks up. fa2 uses no arch-specific instruction; its sm80 code runs unchanged there.
ARCH_SPECIFIC_MAJORS = (9, 10, 11, 12)


def arch_of_capability(major: int, minor: int) -> str:
    """A GPU's compute capability -> the arch its modules are built for: the architecture-specific
    target on Hopper and Blackwell (ARCH_SPECIFIC_MAJORS: 9.0a, 10.0a, 12.0a), others their own."""
    return canonical_arch(f"{major}.{minor}{'a' if major in ARCH_SPECIFIC_MAJORS else ''}")


class ArgNames(NamedTuple):
    """How a caller names the request's arguments, so a reason names what the user typed."""

    q_dtype: str = "q_dtype"
    kv_dtype: str = "kv_dtype"
    o_dtype: str = "o_dtype"
    head_dim_qk: str = "head_dim_qk"
    head_dim_vo: str = "head_dim_vo"
    graph: str = "graph="


PYTHON_NAMES = ArgNames()
CLI_NAMES = ArgNames("--dtype", "--kv-dtype", "--o-dtype", "--head-dim", "--head-dim-vo", "--cuda-graph")


@dataclass(frozen=True)
class Route:
    """A backend served without a compiled module: the module that holds its wrapper factory
    (make_wrapper's arguments) and its probe (probe()'s; returns {"ok", "reason", "details"})."""

    module: str
    factory: str
    probe: str

    def installed(self) -> bool:
        """Whether ``module`` is part of this variantgen (imported already, or a file in the
        package: found without importing it, and never a module of that name elsewhere)."""
        if self.module in sys.modules:
            return True
        package = self.module.rpartition(".")[0]
        try:
            path = importlib.import_module(package).__path__
            return importlib.machinery.PathFinder.find_spec(self.module, list(path)) is not None
        except (ImportError, AttributeError, ValueError):
            return False

    def load(self, attr: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), attr)


@dataclass(frozen=True)
class Request:
    """What a caller asks for: the spec's attention of one kind, head dims and dtypes (names
    canonical: see ``Request.of``), on one backend or the resolver's choice (None)."""

    spec: VariantSpec
    kind: str
    head_dim_qk: int
    head_dim_vo: int
    q_dtype: str
    kv_dtype: str
    o_dtype: str
    backend: str | None = None
    graph: bool = False  # a CUDA-graph mode wrapper (make_wrapper(graph=...), probe(cuda_graph=True))
    tensor_cores: bool = False  # decode through the prefill module (use_tensor_cores=True)
    names: ArgNames = PYTHON_NAMES

    def module_kind(self, backend: str | None = None) -> str:
        """The kind of module it runs on ``backend`` (None: the request's own): tensor-core decode
        runs the prefill kernel, one query (or a few) per request - on fa2 where asked for, on a
        backend whose decode is its prefill kernel (fa3) always."""
        name = backend if backend is not None else self.backend
        on_prefill = self.tensor_cores or (name in TABLE and TABLE[name].decode_on_prefill)
        return "prefill" if self.kind == "decode" and on_prefill else self.kind

    @classmethod
    def of(cls, spec: VariantSpec, *, kind: Any = "prefill", head_dim_qk: Any, head_dim_vo: Any = None,
           q_dtype: Any, kv_dtype: Any = None, o_dtype: Any = None, backend: Any = None, graph: bool = False,
           tensor_cores: bool = False, names: ArgNames = PYTHON_NAMES) -> Request:
        """The request for these arguments (dtypes by any name or torch dtype; ``head_dim_vo``,
        ``kv_dtype`` and ``o_dtype`` default to their query counterparts). ValueError listing
        every malformed argument."""
        problems = []
        dims = {}
        for name, value in ((names.head_dim_qk, head_dim_qk), (names.head_dim_vo, head_dim_vo)):
            if value is None and name == names.head_dim_vo:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"{name}={value!r}: expected a whole number > 0 (the module backends take "
                                f"{'/'.join(str(d) for d in _MODULE_HEAD_DIMS)})")
            dims[name] = value
        dtypes = {}
        for name, value in ((names.q_dtype, q_dtype), (names.kv_dtype, kv_dtype), (names.o_dtype, o_dtype)):
            if value is None and name != names.q_dtype:
                continue
            try:
                dtypes[name] = canonical_dtype(value, name)
            except ValueError as e:
                problems.append(str(e))
        if backend is not None and (not isinstance(backend, str) or backend not in TABLE):
            problems.append(f"backend={backend!r}: expected one of {list(BACKENDS)} (or None: the resolver's choice)")
        if not isinstance(kind, str) or kind not in KINDS:
            problems.append(f"kind={kind!r}: expected one of {list(KINDS)}")
        if tensor_cores and kind != "decode":
            problems.append(f"use_tensor_cores=True: only for kind='decode' (got kind={kind!r})")
        if problems:
            raise ValueError("; ".join(problems))
        q = dtypes[names.q_dtype]
        return cls(spec, kind, dims[names.head_dim_qk], dims.get(names.head_dim_vo, dims[names.head_dim_qk]), q,
                   dtypes.get(names.kv_dtype, q), dtypes.get(names.o_dtype, q), backend, bool(graph),
                   bool(tensor_cores), names)


@dataclass(frozen=True)
class Site:
    """Where the request would run (factory.module_site makes the one of this machine). The
    defaults: any target arch (arch checks skipped), modules can run and may be built, no
    module-less route."""

    arch: str | None = None
    """The target arch of compiled modules ('9.0a'); None: not known (arch checks skipped)."""
    arch_source: str = ""
    """Where ``arch`` came from, when the caller did not name it ("the visible GPU's")."""
    modules: bool = True
    """Whether compiled modules can run here at all (a CUDA target, flashinfer installed)."""
    no_modules: str = "no CUDA GPU to run a module on (pass arch= to build one for another GPU)"
    """Why not, in the caller's words (the reason every module backend gets)."""
    can_build: bool = True
    """Whether a missing module may be built (JIT on and building allowed)."""
    no_build: str = "building is disabled"
    """Why not, in the caller's words (for the note of a cache-aware choice)."""
    lookup: Callable[[Any], str | None] | None = None
    """The URI of a render.ModuleConfig's precompiled module, or None: asked only where modules
    cannot be built."""
    cache_root: str = "the cache"
    routes: tuple[str, ...] = ()
    """The module-less backends (flex) that may be chosen here: installed_routes(), or () where only
    modules count (precompile, render, a cache check)."""
    no_route: str = ""
    """Why a module-less backend not in ``routes`` cannot be chosen (default: it is not installed)."""


@dataclass(frozen=True)
class Backend:
    """One backend's capabilities. ``problems`` is the only place they are checked."""

    name: str
    about: str
    kinds: tuple[str, ...]
    head_dims: Mapping[str, tuple[tuple[int, int], ...]] | None
    """kind -> the (head_dim_qk, head_dim_vo) pairs its modules compile; None: any."""
    q_dtypes: tuple[str, ...]
    kv_dtypes: tuple[str, ...]
    o_dtypes: tuple[str, ...]
    kv_as_q: bool = False  # the KV cache must be in the query's dtype
    o_as_q: bool = False  # o is written in the query's dtype
    archs: tuple[str, ...] = ()  # the only target archs (with arch_text saying what they are); (): sm80 on
    arch_text: str = ""
    arch_why: str = ""  # why only those, said where an arch is refused
    graph_kinds: tuple[str, ...] = ()  # kinds with a CUDA-graph mode
    no_graph: str = ""  # why the others have none here
    route: Route | None = None  # module-less: where its wrapper factory and probe live
    decode_on_prefill: bool = False  # its decode is its prefill module with qo_len 1 (no decode kernel)
    module: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "module", self.route is None)

    def problems(self, request: Request, site: Site = Site()) -> list[str]:
        """Why this backend cannot serve ``request`` at ``site`` (all of it; [] when it can).
        Takes the fields as they are (ModuleConfig passes uncanonicalised values)."""
        out: list[str] = []
        r, n = request, request.names
        if r.kind not in KINDS:
            out.append(f"kind={r.kind!r}: expected one of {list(KINDS)}")
        elif r.kind not in self.kinds:
            out.append(f"kind={r.kind!r}: backend {self.name!r} " + (
                f"generates only {sorted(self.kinds)} modules" if self.module else f"serves only {list(self.kinds)}"))
        if r.graph and r.kind in GRAPH_KINDS and r.kind not in self.graph_kinds:
            out.append(graph_problem(self.name, r.kind, n.graph))
        if self.name not in r.spec.backends:
            out.append(f"backend={self.name!r}: spec `{r.spec.name}` allows only {list(r.spec.backends)}")
        out += self._dtype_problems(r)
        module_kind = r.module_kind(self.name)
        dims = self.head_dims.get(module_kind) if self.head_dims is not None else None
        if dims and (r.head_dim_qk, r.head_dim_vo) not in dims:
            pairs = ", ".join(f"{a}" if a == b else f"{a}/{b}" for a, b in dims)
            runs = f" (its decode runs the {module_kind} module)" if module_kind != r.kind else ""
            out.append(f"{n.head_dim_qk}={r.head_dim_qk}, {n.head_dim_vo}={r.head_dim_vo}: {self.name} "
                       f"{module_kind} modules support head dims {pairs} (qk/vo where they differ){runs}")
        if self.module:
            out += self._arch_problems(site)
        elif self.name not in site.routes:
            assert self.route is not None
            out.append(site.no_route or f"the {self.name} route ({self.about}) is not installed here "
                                        f"({self.route.module} is missing)")
        return out

    def _dtype_problems(self, r: Request) -> list[str]:
        n, out = r.names, []

        def other(arg: str, value: str, allowed: tuple[str, ...]) -> str:
            if value in DTYPE_NAMES:
                takes = f"{self.name} modules take" if self.module else f"the {self.name} route takes"
                return f"{arg}={value}: {takes} {', '.join(allowed)}"
            return f"{arg}={value!r}: expected one of {sorted(allowed)}"

        q_ok = r.q_dtype in self.q_dtypes
        if not q_ok:
            out.append(f"{n.q_dtype}={r.q_dtype}: fp8 query is not supported by {self.name} (its tensor-core path "
                       "needs 16-bit queries); use bf16 or fp16 queries with an fp8 KV cache"
                       if r.q_dtype.startswith("fp8") and self.module else other(n.q_dtype, r.q_dtype, self.q_dtypes))
        # kv / o "in the query's dtype" only say more where the query's dtype is one it takes
        if self.kv_as_q and q_ok and r.kv_dtype != r.q_dtype:
            out.append(f"{n.kv_dtype}={r.kv_dtype}: {self.name} variant modules need {n.kv_dtype} == {n.q_dtype} "
                       f"({r.q_dtype}); use backend fa2 for an fp8 KV cache")
        elif not self.kv_as_q and r.kv_dtype not in self.kv_dtypes:
            out.append(other(n.kv_dtype, r.kv_dtype, self.kv_dtypes))
        if not q_ok and r.o_dtype == r.q_dtype:
            pass  # o in the query's dtype: its problem is the query's, said once
        elif r.o_dtype.startswith("fp8") and r.o_dtype not in self.o_dtypes:
            out.append(f"{n.o_dtype}={r.o_dtype}: fp8 output is not supported by {self.name}")
        elif self.o_as_q and q_ok and r.o_dtype != r.q_dtype:
            # Only o in the query's dtype has run on the H200; other outputs go to fa2.
            out.append(f"{n.o_dtype}={r.o_dtype}: {self.name} variant modules write o in the query dtype "
                       f"({r.q_dtype}); use backend fa2 for another output dtype")
        elif not self.o_as_q and r.o_dtype not in self.o_dtypes:
            out.append(other(n.o_dtype, r.o_dtype, self.o_dtypes))
        return out

    def _arch_problems(self, site: Site) -> list[str]:
        """The target arch's problems, then why no module runs here (both: each is a fix to make)."""
        out = []
        if site.arch is not None:
            label = f"arch={site.arch}" + (f" ({site.arch_source})" if site.arch_source else "")
            try:
                arch = canonical_arch(site.arch)
            except ValueError as e:
                arch = None
                out.append(str(e))
            if arch is not None and int(arch.split(".")[0]) < MIN_ARCH:
                out.append(f"{label}: {self.name} needs sm{MIN_ARCH}0 or newer")
            if arch is not None and self.archs and arch not in self.archs:
                out.append(f"{label}: {self.name} modules run on {self.arch_text} only, compiled for "
                           f"{'/'.join(self.archs)}" + (f" ({self.arch_why})" if self.arch_why else ""))
        if not site.modules:
            out.append(site.no_modules)
        return out


_EQUAL_DIMS = tuple((d, d) for d in (64, 128, 256))
FA2 = Backend(
    "fa2", "FlashInfer's FA2 kernels, compiled per spec", kinds=("prefill", "ragged", "decode"),
    # 192/128: MLA-shaped prefill (DeepSeek)
    head_dims={"prefill": _EQUAL_DIMS, "ragged": _EQUAL_DIMS + ((192, 128),), "decode": _EQUAL_DIMS},
    q_dtypes=("bf16", "fp16"), kv_dtypes=FLASHINFER_DTYPES, o_dtypes=("bf16", "fp16"),
    graph_kinds=("prefill", "decode"))
FA3 = Backend(
    "fa3", "FlashInfer's sm90 (FA3) kernel, compiled per spec", kinds=("prefill", "ragged", "decode"),
    # 192/128: MLA-shaped ragged prefill (DeepSeek; FlashInfer's sm90 ragged kernel has that tile, its
    # paged one does not). Decode runs the paged prefill module (decode_on_prefill).
    head_dims={"prefill": _EQUAL_DIMS, "ragged": _EQUAL_DIMS + ((192, 128),)},
    q_dtypes=("bf16", "fp16"), kv_dtypes=("bf16", "fp16"), o_dtypes=("bf16", "fp16"), kv_as_q=True, o_as_q=True,
    archs=("9.0a",), arch_text="sm90 (Hopper)",
    # Blackwell (sm100 / sm120) runs fa2: FlashInfer's Blackwell kernels (cute-dsl, trtllm-gen, cutlass)
    # take no variant with a custom mask. Not run on a Blackwell GPU here: its modules are only built.
    arch_why="FlashInfer's FA3 kernel is sm90-only (wgmma); Blackwell (sm100 / sm120) and sm80 / sm89 run fa2",
    # graph mode: a fixed launch set for a capacity (graph.py, GraphCapacity(window_widths=...)); decode
    # captures its prefill module's
    graph_kinds=("prefill", "decode"), decode_on_prefill=True)
FLEX = Backend(
    "flex", "torch's FlexAttention, no compiled module", kinds=tuple(KINDS), head_dims=None,
    q_dtypes=("bf16", "fp16", "fp32"), kv_dtypes=DTYPE_NAMES, o_dtypes=("bf16", "fp16", "fp32"),
    no_graph="its plan() and run() read the batch on the host",
    route=Route("variantgen.wrappers.flex_wrapper", factory="make_flex_wrapper", probe="probe_flex"))

TABLE: dict[str, Backend] = {b.name: b for b in (FA3, FA2, FLEX)}  # in the order backend=None prefers them
assert tuple(sorted(TABLE)) == tuple(sorted(BACKENDS)), "spec.BACKENDS names the table's backends"
MODULE_BACKENDS = tuple(b for b in BACKENDS if TABLE[b].module)
# backend=None's order for a kind where it is not the table's, from measurements: decode prefers
# fa2, whose tensor-core decode is faster than fa3's GQA-packed decode on the shipped masks, and a
# learned sink runs unpacked on fa3. bench/bench_decode.py measures both (its results, with the
# GPU and versions, are under bench/results/; the README's Speed table links the latest).
KIND_ORDER = {"decode": ("fa2", "fa3", "flex")}


def preference(kind: str) -> tuple[str, ...]:
    """The backends in the order backend=None prefers them for ``kind``."""
    return KIND_ORDER.get(kind, tuple(TABLE))


assert all(sorted(order) == sorted(TABLE) for order in KIND_ORDER.values())
HEAD_DIMS: dict[tuple[str, str], tuple[tuple[int, int], ...]] = {
    (b.name, kind): dims for b in (FA2, FA3) for kind, dims in (b.head_dims or {}).items()}
_MODULE_HEAD_DIMS = sorted({d for pairs in HEAD_DIMS.values() for pair in pairs for d in pair})
GRAPH_KINDS = tuple(k for k in KINDS if any(k in b.graph_kinds for b in TABLE.values()))


def graph_problem(backend: str, kind: str, arg: str = "graph=") -> str:
    """Why ``backend`` has no CUDA-graph mode for ``kind`` ("" when it has one): the table's
    graph_kinds, which make_wrapper, probe and the wrappers' own constructors all read."""
    if kind in TABLE[backend].graph_kinds:
        return ""
    if kind not in GRAPH_KINDS:
        return no_graph_kind(kind, arg)
    having = " or ".join(repr(b.name) for b in TABLE.values() if kind in b.graph_kinds)
    return f"{arg}: CUDA-graph mode needs backend {having} (got {backend!r}): {TABLE[backend].no_graph}"


def no_graph_kind(kind: str, arg: str) -> str:
    kinds = " and ".join(repr(k) for k in GRAPH_KINDS)
    why = NOGRAPH_KINDS.get(kind, "no backend has one")
    return f"{arg}: CUDA-graph mode is for kind {kinds} (got {kind!r}); {why}"


def installed_routes() -> tuple[str, ...]:
    """The module-less backends whose code is installed here."""
    return tuple(b.name for b in TABLE.values() if b.route is not None and b.route.installed())
