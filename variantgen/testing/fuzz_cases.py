"""The cases of the differential fuzzer of the generated modules: what is fuzzed (TARGETS, the
module matrix's ModuleKey), the spec tensors kept as structure, FuzzCase, and their JSON and
Python literals.

The fuzzer draws random cases (fuzz_draw), builds their tensors and the derived float32
reference (fuzz_tensors), runs a case through its wrapper (fuzz_run), compares the output
(fuzz_compare), and shrinks a failure into a regression test (fuzz_shrink).

bench/fuzz_gpu.py drives this on the GPU over a bounded module matrix; every failure it finds
is printed as a pytest test (a ``FuzzCase`` literal and ``assert_case_passes``) to paste into
tests/gpu/test_gpu_regressions.py. tests/cpu/test_fuzz_gpu_cpu.py runs the same code on the CPU through
the fake modules: ``Modules`` is the seam (where wrappers come from, how a run is captured).

A FuzzCase holds plain values only (it round-trips through JSON and through its own repr). Spec
tensors are kept as structure - key spans, document runs, per-request values - rather than as
tensors, so that dropping a request or shortening one while shrinking keeps the other
requests' arguments as they were.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pprint
from dataclasses import dataclass
from typing import Any

from ..core.env import REPO_DIR
from ..lang.spec import load_spec
from ..lang.values import VariantSpec

# ----------------------------------------------------------------------------- what is fuzzed


@dataclass(frozen=True)
class Target:
    """One path through the wrappers: a backend and kernel kind, on CUDA or tensor cores, eager
    or replayed from a CUDA graph. ``plans``: how plan() may be asked (PLAN_PATHS)."""

    name: str
    backend: str
    kind: str  # make_wrapper(kind=...)
    module_kind: str  # the kind of module it runs (render.KINDS): tensor-core decode runs prefill modules
    tensor_cores: bool = False
    graph: bool = False
    plans: tuple[str, ...] = ("off",)


PLAN_PATHS = {
    "off": "interval planner (decode: key trimming) off",
    "module": "interval planner with the spec's planner module (on the GPU: its row pass and launch builder)",
    "nomodule": ("interval planner (decode: key trimming) asked for without the spec's planner module: prefill "
                 "plans off and says why, CUDA-core decode trims in torch ops"),
    "trim": "CUDA-core decode with key trimming (the row pass of the spec's planner module where there is one)",
}
_PLANNED = ("off", "module", "nomodule")

# Isolation cases: this value goes into K and V of one request's first and last key (every KV
# head and element: the middle request of those with keys, poisoned_request); the other
# requests' rows must come out finite and equal to the reference, the poisoned request's rows are
# not compared (a kernel computes whole tiles: a masked key's NaN may reach its own request's rows).
POISONS = {"": 0.0, "nan": math.nan, "inf": math.inf}

# Every (backend, kind) path the fuzzer covers, in one table. A (backend, kind) pair that
# capabilities.HEAD_DIMS gains (say fa3 ragged) needs its row here (tests/cpu/test_fuzz_gpu_cpu.py checks).
TARGETS: tuple[Target, ...] = (
    Target("fa2/prefill", "fa2", "prefill", "prefill", plans=_PLANNED),
    Target("fa3/prefill", "fa3", "prefill", "prefill", plans=_PLANNED),
    Target("fa2/prefill-graph", "fa2", "prefill", "prefill", graph=True, plans=_PLANNED),
    Target("fa3/prefill-graph", "fa3", "prefill", "prefill", graph=True, plans=_PLANNED),
    Target("fa2/decode", "fa2", "decode", "decode", plans=("off", "trim", "nomodule")),
    Target("fa2/decode-graph", "fa2", "decode", "decode", graph=True, plans=("off", "trim", "nomodule")),
    Target("fa2/decode-tc", "fa2", "decode", "prefill", tensor_cores=True, plans=_PLANNED),
    Target("fa2/decode-tc-graph", "fa2", "decode", "prefill", tensor_cores=True, graph=True, plans=_PLANNED),
    Target("fa3/decode", "fa3", "decode", "prefill", tensor_cores=True, plans=_PLANNED),
    Target("fa3/decode-graph", "fa3", "decode", "prefill", tensor_cores=True, graph=True, plans=_PLANNED),
    Target("fa2/ragged", "fa2", "ragged", "ragged"),
    Target("fa3/ragged", "fa3", "ragged", "ragged"),
)
TARGET_BY_NAME = {t.name: t for t in TARGETS}


@dataclass(frozen=True)
class ModuleKey:
    """A module of the matrix: shipped spec (specs/<spec>.yaml), head dims, dtypes (o = q)."""

    spec: str
    head_dim_qk: int = 128
    head_dim_vo: int = 128
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"

    def label(self) -> str:
        hd = str(self.head_dim_qk) if self.head_dim_qk == self.head_dim_vo else f"{self.head_dim_qk}/{self.head_dim_vo}"
        dt = self.q_dtype if self.q_dtype == self.kv_dtype else f"{self.q_dtype}/{self.kv_dtype}"
        return f"{self.spec} hd{hd} {dt}"


# the shipped specs, then the benchmarks' masks and their rewritten forms (bench/make_forms.py)
SPEC_DIRS = (REPO_DIR / "specs", REPO_DIR / "bench" / "masks", REPO_DIR / "bench" / "masks" / "forms")


@functools.cache
def shipped_spec(name: str) -> VariantSpec:
    """A spec shipped in specs/, or a mask of the benchmarks' collection (bench/masks/: sparse key
    sets, BigBird, the literature's masks), by name."""
    for folder in SPEC_DIRS:
        path = folder / f"{name}.yaml"
        if path.is_file():
            return load_spec(path)
    known = sorted(p.stem for folder in SPEC_DIRS for p in folder.glob("*.yaml"))
    raise ValueError(f"spec {name!r}: not in {' or '.join(str(d) for d in SPEC_DIRS)} (known: {', '.join(known)})")


# ----------------------------------------------------------------------------- spec tensors as structure


@dataclass(frozen=True)
class Ranges:
    """An int32 [total_q, 2] tensor of inclusive key spans per query (mm_prefix's ``ranges``).
    Per request: ``spans`` [start, end] - a query whose position lies in one gets it, the rest
    (-1, -1) - then ``rows`` (first query, last query, start, end) overriding those query rows
    with any span at all: empty (start > end), future-only, past the keys, negative."""

    spans: tuple[tuple[tuple[int, int], ...], ...]
    rows: tuple[tuple[tuple[int, int, int, int], ...], ...]


@dataclass(frozen=True)
class DocRuns:
    """An int32 [total_kv] tensor of document ids (document's ``doc_ids``): per request, runs
    (first key, id); ids need not increase (a document may resume after another)."""

    runs: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class PerRequest:
    """An int32 [batch] tensor (prefix_lm's ``prefix_len``)."""

    values: tuple[int, ...]


@dataclass(frozen=True)
class PerHead:
    """A float32 [num_qo_heads] tensor (alibi's ``slopes``): the ALiBi slopes of the head count
    when ``values`` is empty, else ``values`` repeated to the head count."""

    values: tuple[float, ...] = ()


@dataclass(frozen=True)
class Trees:
    """An int32 [total_q, W] ancestor bitmask (tree_verify's ``tree_bits``): per request the
    parent of each draft node (-1: a root; variantgen.wrappers.trees). A request's first qo_len nodes are
    used (a prefix of a parent list is a tree); rows past 32 * W nodes, or past the list, are 0."""

    parents: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Seeded:
    """Any other spec tensor: random values from ``seed`` (ints in [-2, max kv_len], floats N(0, 1))."""

    seed: int


TensorArg = Ranges | DocRuns | PerRequest | PerHead | Trees | Seeded
Scalar = int | float | bool


@dataclass(frozen=True)
class Batch:
    """The requests of one plan(): lengths (queries are the last qo_len of each request's kv_len
    keys), the spec tensors' structure, and the seed of q, k, v and the page order."""

    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    tensors: tuple[tuple[str, TensorArg], ...]
    seed: int

    def drop(self, i: int) -> Batch:
        """Without request i (its entries of every per-request structure too)."""
        def cut(t: TensorArg) -> TensorArg:
            if isinstance(t, Ranges):
                return Ranges(without(t.spans, i), without(t.rows, i))
            if isinstance(t, DocRuns):
                return DocRuns(without(t.runs, i))
            if isinstance(t, PerRequest):
                return PerRequest(without(t.values, i))
            if isinstance(t, Trees):
                return Trees(without(t.parents, i))
            return t

        return Batch(without(self.qo_lens, i), without(self.kv_lens, i),
                     tuple((n, cut(t)) for n, t in self.tensors), self.seed)

    def problem(self, decode: bool, multi_token: bool = False) -> str | None:
        n = len(self.qo_lens)
        if n < 1 or len(self.kv_lens) != n:
            return f"qo_lens={list(self.qo_lens)}, kv_lens={list(self.kv_lens)}: expected one of each per request"
        if not all(0 <= q <= k for q, k in zip(self.qo_lens, self.kv_lens)) or not sum(self.qo_lens):
            return f"qo_lens={list(self.qo_lens)}, kv_lens={list(self.kv_lens)}: expected 0 <= qo_len <= kv_len " \
                   "and some query"
        if decode and (len(set(self.qo_lens)) != 1 or self.qo_lens[0] < 1 or min(self.kv_lens) < self.qo_lens[0]
                       or (self.qo_lens[0] > 1 and not multi_token)):
            return f"qo_lens={list(self.qo_lens)}, kv_lens={list(self.kv_lens)}: decode has one query per request " \
                   "(multi-token decode on tensor cores: the same count T per request) and kv_len >= T"
        for name, t in self.tensors:
            per = {Ranges: ("spans", "rows"), DocRuns: ("runs",), PerRequest: ("values",),
                   Trees: ("parents",)}.get(type(t), ())
            for f in per:
                if len(getattr(t, f)) != n:
                    return f"tensor {name}: {type(t).__name__}.{f} has {len(getattr(t, f))} entries for {n} requests"
        return None


def without(values: tuple, i: int) -> tuple:
    return values[:i] + values[i + 1:]


@dataclass(frozen=True)
class GraphSetup:
    """CUDA-graph mode: the wrapper's capacity and the batch run() was captured with; the case's
    own batch is then planned into the same graph and replayed."""

    capture: Batch
    max_batch_size: int
    max_total_q: int
    max_kv_pages: int
    max_qo_len: int | None = None  # decode on tensor cores: queries per request (fa3 graphs run GQA-packed)


@dataclass(frozen=True)
class FuzzCase:
    """Everything one differential check needs (see the module doc)."""

    target: str  # a TARGETS name
    module: ModuleKey
    batch: Batch
    num_qo_heads: int
    num_kv_heads: int
    page_size: int  # ragged: 1 (no pages)
    plan: str = "off"  # a PLAN_PATHS key the target allows
    scalars: tuple[tuple[str, Scalar], ...] = ()
    disable_split_kv: bool = False
    return_lse: bool = False
    scales: tuple[float | None, float | None, float | None] = (None, None, None)  # q, k, v
    graph: GraphSetup | None = None
    poison: str = ""  # a POISONS key: NaN / inf in one request's K and V (isolation), or "" for none

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(f"FuzzCase: {problem}")

    def problem(self) -> str | None:
        """What makes this case not one the fuzzer could have drawn (None: nothing)."""
        target = TARGET_BY_NAME.get(self.target)
        if target is None:
            return f"target={self.target!r}: expected one of {list(TARGET_BY_NAME)}"
        if self.plan not in target.plans:
            return f"plan={self.plan!r}: target {self.target} plans with one of {list(target.plans)}"
        if not (self.num_kv_heads >= 1 and self.num_qo_heads >= 1 and self.num_qo_heads % self.num_kv_heads == 0):
            return f"num_qo_heads={self.num_qo_heads}, num_kv_heads={self.num_kv_heads}: expected whole GQA groups"
        if self.page_size < 1:
            return f"page_size={self.page_size}: expected >= 1"
        if len(self.scales) != 3:
            return f"scales={self.scales!r}: expected (q_scale, k_scale, v_scale)"
        if self.poison not in POISONS:
            return f"poison={self.poison!r}: expected one of {list(POISONS)}"
        if (self.graph is not None) != target.graph:
            return f"graph: target {self.target} {'needs' if target.graph else 'takes no'} GraphSetup"
        batches = [("batch", self.batch)] + ([("graph.capture", self.graph.capture)] if self.graph else [])
        for where, b in batches:
            problem = b.problem(decode=target.kind == "decode", multi_token=target.tensor_cores)
            if problem:
                return f"{where}: {problem}"
        return None

    def label(self) -> str:
        b = self.batch
        return (f"{self.target} {self.module.label()} qo={list(b.qo_lens)} kv={list(b.kv_lens)} "
                f"heads={self.num_qo_heads}/{self.num_kv_heads} page={self.page_size} plan={self.plan} "
                f"{dict(self.scalars)}")


# ----------------------------------------------------------------------------- JSON and Python literals

CASE_CLASSES = {c.__name__: c for c in (ModuleKey, Ranges, DocRuns, PerRequest, PerHead, Trees, Seeded, Batch,
                                    GraphSetup, FuzzCase)}


def to_json(obj: Any) -> Any:
    """A FuzzCase (or any of its parts) as JSON values; dataclasses carry their type name."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"type": type(obj).__name__, **{f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, (tuple, list)):
        return [to_json(x) for x in obj]
    return obj


def from_json(data: Any) -> Any:
    """The inverse of to_json (lists come back as tuples)."""
    if isinstance(data, dict):
        name = data.get("type")
        if name not in CASE_CLASSES:
            raise ValueError(f"fuzz case JSON: unknown type {name!r} (expected one of {sorted(CASE_CLASSES)})")
        return CASE_CLASSES[name](**{k: from_json(v) for k, v in data.items() if k != "type"})
    if isinstance(data, list):
        return tuple(from_json(x) for x in data)
    return data


def case_literal(case: FuzzCase, column: int = 0, width: int = 118) -> str:
    """``case`` as a Python expression (its repr, wrapped to ``width``) for a line where it starts
    at ``column``."""
    text = pprint.pformat(case, width=width - column, sort_dicts=False)
    return text.replace("\n", "\n" + " " * column)
