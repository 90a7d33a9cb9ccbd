"""Differential fuzzing of the generated modules: random cases, their tensors, running a case
through its wrapper, comparing it with the derived float32 reference, and shrinking a failure.

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
import random
import re
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from ..core.env import REPO_DIR
from ..lang.spec import load_spec
from ..lang.values import ScalarArg, VariantSpec
from .harness import nan_positions_differ, poison_keys, within_range

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
# head and element: the request the batch's first keys belong to, poisoned_request); the other
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


@functools.cache
def shipped_spec(name: str) -> VariantSpec:
    """A spec shipped in specs/, by name."""
    path = REPO_DIR / "specs" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (REPO_DIR / "specs").glob("*.yaml"))
        raise ValueError(f"spec {name!r}: no {path} (shipped specs: {', '.join(known)})")
    return load_spec(path)


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
                return Ranges(_without(t.spans, i), _without(t.rows, i))
            if isinstance(t, DocRuns):
                return DocRuns(_without(t.runs, i))
            if isinstance(t, PerRequest):
                return PerRequest(_without(t.values, i))
            if isinstance(t, Trees):
                return Trees(_without(t.parents, i))
            return t

        return Batch(_without(self.qo_lens, i), _without(self.kv_lens, i),
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


def _without(values: tuple, i: int) -> tuple:
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

_CLASSES = {c.__name__: c for c in (ModuleKey, Ranges, DocRuns, PerRequest, PerHead, Trees, Seeded, Batch,
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
        if name not in _CLASSES:
            raise ValueError(f"fuzz case JSON: unknown type {name!r} (expected one of {sorted(_CLASSES)})")
        return _CLASSES[name](**{k: from_json(v) for k, v in data.items() if k != "type"})
    if isinstance(data, list):
        return tuple(from_json(x) for x in data)
    return data


def case_literal(case: FuzzCase, column: int = 0, width: int = 118) -> str:
    """``case`` as a Python expression (its repr, wrapped to ``width``) for a line where it starts
    at ``column``."""
    text = pprint.pformat(case, width=width - column, sort_dicts=False)
    return text.replace("\n", "\n" + " " * column)


# ----------------------------------------------------------------------------- drawing cases


@dataclass(frozen=True)
class Limits:
    """How large drawn batches get (the defaults: the GPU fuzzer's; the CPU smoke test draws
    small ones)."""

    max_requests: int = 4
    max_qo_len: int = 700
    max_cached: int = 1000  # kv_len - qo_len of a prefill request
    max_decode_requests: int = 16
    max_decode_kv_len: int = 3000
    max_decode_q_len: int = 16  # multi-token decode (tensor cores): queries per request
    groups: tuple[int, ...] = (1, 2, 4, 8, 16)  # GQA group sizes
    kv_heads: tuple[int, ...] = (1, 2, 4)
    page_sizes: tuple[int, ...] = (1, 5, 16, 64)
    boundaries: tuple[int, ...] = (15, 16, 17, 63, 64, 65, 127, 128, 129)  # tile edges worth hitting


def _log_uniform(r: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi], small values as likely as large ones per factor of two."""
    if hi <= lo:
        return lo
    return min(hi, int(math.exp(r.uniform(math.log(lo), math.log(hi + 1)))))


def _length(r: random.Random, lo: int, hi: int, limits: Limits) -> int:
    edges = [b for b in limits.boundaries if lo <= b <= hi]
    if edges and r.random() < 0.15:
        return r.choice(edges)
    return _log_uniform(r, lo, hi)


def _window(r: random.Random) -> int:
    """A left window: none (-1), 0, 1, small or large."""
    pick = r.randrange(5)
    return (-1, 0, 1, r.randint(2, 16), r.randint(64, 1500))[pick]


# Scalars by name (the shipped specs' vocabulary); others by dtype in _draw_scalar.
SCALAR_DRAWS: dict[str, Callable[[random.Random], Scalar]] = {
    "window": _window,
    "causal_window_left": _window,
    "range_window_left": _window,  # <= 0: unbounded there
    "chunk_size": lambda r: r.choice([1, 2, r.randint(3, 32), r.randint(64, 300), 8192]),
    "num_sink": lambda r: r.choice([0, 1, r.randint(2, 8), r.randint(64, 512)]),
    "soft_cap": lambda r: r.choice([1.0, 5.0, 30.0, 50.0, round(r.uniform(0.5, 60.0), 3)]),
}


def _draw_scalar(r: random.Random, scalar: ScalarArg) -> Scalar:
    """A random value of one of the spec's scalars, within the range the spec declares for it."""
    if scalar.name in SCALAR_DRAWS:
        value = SCALAR_DRAWS[scalar.name](r)
    elif scalar.dtype == "bool":
        return r.random() < 0.5
    elif scalar.dtype == "int":
        value = _window(r)
    else:
        value = round(r.uniform(-2.0, 2.0), 4)
    return within_range(scalar, value)


def _draw_lengths(r: random.Random, target: Target, limits: Limits, n: int | None = None) -> tuple[list, list]:
    if target.kind == "decode":
        n = n or _log_uniform(r, 1, limits.max_decode_requests)
        # tensor cores: multi-token decode (speculative verification) in a third of the batches
        per = 1
        if target.tensor_cores and r.random() < 0.35:
            per = r.choice([q for q in (2, 3, 4, 8, 16) if q <= limits.max_decode_q_len] or [1])
        kv = [max(_length(r, 1, limits.max_decode_kv_len, limits), per) for _ in range(n)]
        return [per] * n, kv
    n = n or min(limits.max_requests, r.choice([1, 1, 2, 2, 3, 4]))
    qo, kv = [], []
    for _ in range(n):
        if r.random() < 0.04:
            q = k = 0  # a request with no queries and no keys
        else:
            q = 0 if r.random() < 0.04 else (1 if r.random() < 0.15 else _length(r, 1, limits.max_qo_len, limits))
            cached = 0 if r.random() < 0.35 else _length(r, 1, limits.max_cached, limits)
            k = max(q + cached, 1)
        qo.append(q)
        kv.append(k)
    if sum(qo) == 0:
        qo[0] = 1
        kv[0] = max(kv[0], 1)
    return qo, kv


def _draw_ranges(r: random.Random, qo_lens: list[int], kv_lens: list[int]) -> Ranges:
    spans, rows = [], []
    for q, k in zip(qo_lens, kv_lens):
        req: list[tuple[int, int]] = []
        start_of_chunk = k - q
        for _ in range(r.choice([0, 1, 1, 2, 3])):
            kind = r.randrange(4)
            if kind == 0 and 0 < start_of_chunk < k:  # crosses the chunk start
                s, e = r.randint(0, start_of_chunk - 1), r.randint(start_of_chunk, k - 1)
            elif kind == 1 and k:  # at the first or last key
                s = e = r.choice([0, k - 1])
            else:
                s = r.randint(0, max(k - 1, 0))
                e = min(k - 1, s + _log_uniform(r, 1, max(k // 2, 1)) - 1)
            if k and not any(s <= e2 and e >= s2 for s2, e2 in req):
                req.append((s, e))
        over: list[tuple[int, int, int, int]] = []
        if q and r.random() < 0.3:
            for _ in range(r.randint(1, 3)):
                a = r.randint(0, q - 1)
                b = min(q - 1, a + _log_uniform(r, 1, q) - 1)
                kind = r.randrange(5)
                if kind == 0:  # future-only: after the last of these queries
                    s = min(k + 2, start_of_chunk + b + 1 + r.randint(0, 5))
                    span = (s, s + r.randint(0, 20))
                elif kind == 1:  # empty
                    s = r.randint(1, max(k, 1))
                    span = (s, s - r.randint(1, 3))
                elif kind == 2:
                    span = (-1, -1)
                elif kind == 3:
                    span = (0, max(k - 1, 0))
                else:
                    span = tuple(sorted((r.randint(-3, k + 3), r.randint(-3, k + 3))))
                over.append((a, b, *span))
        spans.append(tuple(sorted(req)))
        rows.append(tuple(over))
    return Ranges(tuple(spans), tuple(rows))


def _draw_doc_runs(r: random.Random, qo_lens: list[int], kv_lens: list[int]) -> DocRuns:
    runs = []
    for q, k in zip(qo_lens, kv_lens):
        cuts = {0}
        for _ in range(r.choice([0, 1, 2, 3, 5])):
            cuts.add(r.randint(0, max(k - 1, 0)))
        if 0 < k - q < k and r.random() < 0.3:
            cuts.add(k - q)  # a document starting at the chunk start
        if k > 2 and r.random() < 0.3:  # documents of length 1
            p = r.randint(1, k - 2)
            cuts.update((p, p + 1))
        starts = sorted(c for c in cuts if c < max(k, 1))
        unsorted = r.random() < 0.2
        ids = [r.randint(0, 3) for _ in starts] if unsorted else list(range(len(starts)))
        runs.append(tuple(zip(starts, ids)))
    return DocRuns(tuple(runs))


def _draw_trees(r: random.Random, qo_lens: list[int], words: int) -> Trees:
    from ..wrappers.trees import random_tree_parents

    g = torch.Generator().manual_seed(r.getrandbits(31))
    shapes = ("chain", "star", "random", "forest")
    return Trees(tuple(tuple(random_tree_parents(min(q, 32 * words), g, r.choice(shapes))) for q in qo_lens))


def _draw_tensor(r: random.Random, t: Any, qo_lens: list[int], kv_lens: list[int]) -> TensorArg:
    shape = tuple(t.shape)
    if t.name == "tree_bits" and t.dtype == "int32" and len(shape) == 2 and shape[0] == "total_q":
        return _draw_trees(r, qo_lens, shape[1])
    if t.name == "sinks" and t.dtype == "float32" and shape == ("num_qo_heads",):
        # learned sink logits: a few units either way (gpt-oss), and ones that take all or no weight
        return PerHead(tuple(r.choice([round(r.uniform(-6.0, 6.0), 3), 40.0, -40.0, 0.0])
                             for _ in range(r.randint(1, 8))))
    if t.dtype == "int32" and shape == ("total_q", 2):
        return _draw_ranges(r, qo_lens, kv_lens)
    if t.dtype == "int32" and shape == ("total_kv",):
        return _draw_doc_runs(r, qo_lens, kv_lens)
    if t.dtype == "int32" and shape == ("batch",):
        vals = []
        for q, k in zip(qo_lens, kv_lens):
            vals.append(r.choice([0, 1, k - q, k - q + 1, r.randint(0, k + 3), k, k + 3]))
        return PerRequest(tuple(vals))
    if t.dtype == "float32" and shape == ("num_qo_heads",):
        if r.random() < 0.6:
            return PerHead()
        return PerHead(tuple(round(r.uniform(-0.5, 1.0), 4) for _ in range(r.randint(1, 8))))
    return Seeded(r.getrandbits(31))


def draw_batch(r: random.Random, spec: VariantSpec, target: Target, limits: Limits,
               n: int | None = None) -> Batch:
    """Random lengths and spec tensors for ``target`` (``n`` requests, or a random count)."""
    qo, kv = _draw_lengths(r, target, limits, n)
    tensors = tuple((t.name, _draw_tensor(r, t, qo, kv)) for t in spec.tensors)
    return Batch(tuple(qo), tuple(kv), tensors, r.getrandbits(31))


def graph_capacity(target: Target, limits: Limits, page_size: int, batch_size: int) -> tuple[int, int, int]:
    """(max_batch_size, max_total_q, max_kv_pages) of a graph-mode wrapper for ``limits``
    (CUDA-core decode: exactly ``batch_size`` requests per plan)."""
    if target.kind == "decode":
        n = batch_size if not target.tensor_cores else limits.max_decode_requests
        pages = n * -(-limits.max_decode_kv_len // page_size) + EXTRA_PAGES
        return n, n * (limits.max_decode_q_len if target.tensor_cores else 1), pages
    n = limits.max_requests
    longest = limits.max_qo_len + limits.max_cached
    return n, n * limits.max_qo_len, n * -(-longest // page_size) + EXTRA_PAGES


def draw_case(r: random.Random, target: Target, module: ModuleKey, *, limits: Limits = Limits(),
              plans: tuple[str, ...] | None = None, session: FuzzCase | None = None,
              poison: tuple[str, ...] = ()) -> FuzzCase:
    """A random case of ``target`` on ``module``. ``plans``: the plan paths available (default:
    the target's). ``session`` (graph targets): a case of an existing graph session - the new case
    replays another batch in it (same heads, page size, plan path, scalars, scales, capacity).
    ``poison``: POISONS keys, one drawn for each case of two requests or more (isolation cases;
    draws nothing more when empty, so a seed gives the same cases as without it)."""
    spec = shipped_spec(module.spec)
    if session is not None:
        if session.graph is None or session.target != target.name or session.module != module:
            raise ValueError(f"draw_case(session=...): {session.label()} is no graph session of {target.name} "
                             f"on {module.label()}")
        n = session.graph.max_batch_size if target.kind == "decode" and not target.tensor_cores else None
        return replace(session, batch=draw_batch(r, spec, target, limits, n))
    plans = plans or target.plans
    group = r.choice(limits.groups)
    hkv = r.choice(limits.kv_heads)
    page_size = 1 if target.kind == "ragged" else r.choice(limits.page_sizes)
    plan = r.choice([p for p in target.plans if p in plans] or ["off"])
    scalars = tuple((s.name, _draw_scalar(r, s)) for s in spec.scalars)
    scales: tuple[float | None, float | None, float | None] = (None, None, None)
    if spec.qkv_scales and (r.random() < 0.15 or module.kv_dtype.startswith("fp8") and r.random() < 0.6):
        scales = (r.choice([None, 0.5, 1.5]), r.choice([None, 0.25, 2.0]), r.choice([None, 0.5, 3.0]))
    batch = draw_batch(r, spec, target, limits)
    graph = None
    if target.graph:
        cap = graph_capacity(target, limits, page_size, len(batch.qo_lens))
        longest = limits.max_decode_q_len if target.kind == "decode" and target.tensor_cores else None
        graph = GraphSetup(batch, *cap, max_qo_len=longest)
    case = FuzzCase(target.name, module, batch, group * hkv, hkv, page_size, plan, scalars,
                    disable_split_kv=not target.graph and r.random() < 0.2, return_lse=r.random() < 0.5,
                    scales=scales, graph=graph)
    if poison and len(batch.qo_lens) > 1:
        case = replace(case, poison=r.choice(poison))
    return case


# ----------------------------------------------------------------------------- tensors of a case

EXTRA_PAGES = 3  # at most this many unused pages in a paged pool (filled with POISON_K / POISON_V)
# Finite poison in every KV slot no request owns (unused pages, the tail of a last page): a kernel
# that reads one unmasked gets logits of ~16 sigma and a value of 64, far off the reference.
POISON_K, POISON_V = 16.0, 64.0
SENTINEL = 12288.0  # what outputs hold before a run (exact in bf16 and fp16): rows left so were not written

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}


@dataclass
class CaseTensors:
    """One batch of a case on the device, as its wrapper takes it. Paged: k / v are page pools
    [pages, page_size, kv_heads, head_dim]; ragged: [total_kv, kv_heads, head_dim]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor | None
    last_page_len: torch.Tensor | None
    args: dict[str, Any]  # spec tensors and scalars, by name


def _int_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device)


def _ranges_tensor(arg: Ranges, qo_lens: tuple[int, ...], kv_lens: tuple[int, ...]) -> torch.Tensor:
    from .harness import spans_to_ranges

    out = spans_to_ranges(list(qo_lens), list(kv_lens), [list(s) for s in arg.spans])
    base = 0
    for q, rows in zip(qo_lens, arg.rows):
        for a, b, s, e in rows:
            a, b = max(a, 0), min(b, q - 1)
            if a <= b:
                out[base + a:base + b + 1, 0] = s
                out[base + a:base + b + 1, 1] = e
        base += q
    return out


def _doc_ids_tensor(arg: DocRuns, kv_lens: tuple[int, ...]) -> torch.Tensor:
    ids = []
    for k, runs in zip(kv_lens, arg.runs):
        row = torch.full((k,), runs[0][1] if runs else 0, dtype=torch.int32)
        for start, doc in sorted(runs):
            row[max(start, 0):] = doc
        ids.append(row)
    return torch.cat(ids) if ids else torch.empty(0, dtype=torch.int32)


def spec_tensor(t: Any, arg: TensorArg, batch: Batch, num_qo_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The host tensor of spec tensor ``t`` described by ``arg`` for ``batch``."""
    from .harness import alibi_slopes

    if isinstance(arg, Ranges):
        return _ranges_tensor(arg, batch.qo_lens, batch.kv_lens)
    if isinstance(arg, DocRuns):
        return _doc_ids_tensor(arg, batch.kv_lens)
    if isinstance(arg, PerRequest):
        return torch.tensor(arg.values, dtype=torch.int32)
    if isinstance(arg, PerHead):
        if not arg.values:
            return alibi_slopes(num_qo_heads)
        return torch.tensor([arg.values[h % len(arg.values)] for h in range(num_qo_heads)], dtype=torch.float32)
    if isinstance(arg, Trees):
        from ..wrappers.trees import tree_bits

        words = t.shape[1]
        out = torch.zeros(sum(batch.qo_lens), words, dtype=torch.int32)
        base = 0
        for q, parents in zip(batch.qo_lens, arg.parents):
            nodes = list(parents[:min(q, 32 * words)])
            if nodes:
                out[base:base + len(nodes)] = tree_bits([nodes], words=words)
            base += q
        return out
    dims = {"total_q": sum(batch.qo_lens), "total_kv": sum(batch.kv_lens), "batch": len(batch.qo_lens),
            "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads}
    shape = tuple(dims[d] if isinstance(d, str) else d for d in t.shape)
    g = torch.Generator().manual_seed(arg.seed)
    if t.dtype == "int32":
        return torch.randint(-2, max(batch.kv_lens, default=0) + 1, shape, generator=g, dtype=torch.int32)
    return torch.randn(shape, generator=g)


def make_tensors(case: FuzzCase, batch: Batch, device: torch.device) -> CaseTensors:
    """q, k, v, the index tensors and the spec arguments of ``batch`` (a case's own batch, or
    its graph capture batch), deterministic in the batch's seed."""
    spec = shipped_spec(case.module.spec)
    m, target = case.module, TARGET_BY_NAME[case.target]
    hq, hkv = case.num_qo_heads, case.num_kv_heads
    qo, kv = list(batch.qo_lens), list(batch.kv_lens)
    qdt, kvdt = _TORCH_DTYPES[m.q_dtype], _TORCH_DTYPES[m.kv_dtype]
    g = torch.Generator(device=device).manual_seed(batch.seed)
    host = random.Random(batch.seed)
    total_q = sum(qo)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    q = randn(total_q, hq, m.head_dim_qk).to(qdt)
    qo_indptr = [0]
    for n in qo:
        qo_indptr.append(qo_indptr[-1] + n)
    if [name for name, _ in batch.tensors] != [t.name for t in spec.tensors]:
        raise ValueError(f"FuzzCase: batch.tensors names {[n for n, _ in batch.tensors]}, spec `{spec.name}` has "
                         f"tensors {[t.name for t in spec.tensors]}")
    args: dict[str, Any] = {name: spec_tensor(t, arg, batch, hq, hkv).to(device).contiguous()
                            for t, (name, arg) in zip(spec.tensors, batch.tensors)}
    args.update(case.scalars)
    if target.kind == "ragged":
        kv_indptr = [0]
        for n in kv:
            kv_indptr.append(kv_indptr[-1] + n)
        k = randn(kv_indptr[-1], hkv, m.head_dim_qk).to(kvdt)
        v = randn(kv_indptr[-1], hkv, m.head_dim_vo).to(kvdt)
        if case.poison:
            poison_keys(k, v, kv, poisoned_request(batch), POISONS[case.poison])
        return CaseTensors(q, k, v, _int_tensor(qo_indptr, device), _int_tensor(kv_indptr, device), None, None,
                           args)
    ps = case.page_size
    pages = [-(-n // ps) for n in kv]
    used = sum(pages)
    pool = used + host.randint(0, EXTRA_PAGES)
    order = list(range(pool))
    host.shuffle(order)
    kv_indptr = [0]
    for p in pages:
        kv_indptr.append(kv_indptr[-1] + p)
    # Slots no request owns (pages past `used` in the shuffled order, last pages' tails) get poison.
    filled: list[int] = []  # keys held by each used page, in page-list order
    for n, p in zip(kv, pages):
        filled += [ps] * (p - 1) + [n - (p - 1) * ps] if p else []
    owned = torch.zeros(pool, ps, dtype=torch.bool)
    owned[torch.tensor(order[:used], dtype=torch.long)] = (
        torch.arange(ps).view(1, -1) < torch.tensor(filled, dtype=torch.long).view(-1, 1))
    owned = owned.to(device)[:, :, None, None]
    k = torch.where(owned, randn(pool, ps, hkv, m.head_dim_qk), POISON_K).to(kvdt)
    v = torch.where(owned, randn(pool, ps, hkv, m.head_dim_vo), POISON_V).to(kvdt)
    last = [(n - 1) % ps + 1 if n else 0 for n in kv]
    if case.poison:
        poison_keys(k, v, kv, poisoned_request(batch), POISONS[case.poison], kv_indptr=kv_indptr,
                    kv_indices=torch.tensor(order[:used]), page_size=ps)
    return CaseTensors(q, k, v, _int_tensor(qo_indptr, device), _int_tensor(kv_indptr, device),
                       _int_tensor(order[:used], device), _int_tensor(last, device), args)


def poisoned_request(batch: Batch) -> int:
    """The request an isolation case poisons: the first one with keys (0 if none has any)."""
    return next((i for i, n in enumerate(batch.kv_lens) if n), 0)


def compared_rows(case: FuzzCase) -> torch.Tensor | None:
    """Bool [total_q]: the rows compared with the reference (all but the poisoned request's in an
    isolation case), or None for all."""
    if not case.poison:
        return None
    from .harness import rows_of_requests

    return ~rows_of_requests(list(case.batch.qo_lens), [poisoned_request(case.batch)])


def reference(case: FuzzCase, t: CaseTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The derived float32 reference of a case's batch: (out, lse base 2)."""
    from ..wrappers.ragged import reference_ragged
    from ..wrappers.reference import reference_attention

    spec = shipped_spec(case.module.spec)
    q_scale, k_scale, v_scale = case.scales
    kw = dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    if t.kv_indices is None:
        return reference_ragged(spec, t.q, t.k, t.v, t.qo_indptr, t.kv_indptr, t.args, **kw)
    return reference_attention(spec, t.q, (t.k, t.v), t.qo_indptr, t.kv_indptr, t.kv_indices, t.last_page_len,
                               t.args, **kw)


# ----------------------------------------------------------------------------- comparing

# dtype of the output -> (abs tolerance, rel tolerance per element, rel. error of the whole output).
# Kernels round P to the 16-bit dtype before P.V and round o (2^-9 relative for bf16, 2^-11 for fp16);
# these bounds leave a few times that, while a wrong row is off by O(0.1) or more.
TOLERANCES = {"bf16": (2e-2, 2e-2, 1e-2), "fp16": (5e-3, 5e-3, 3e-3)}
LSE_TOLERANCE = (2e-2, 1e-3)  # abs, rel (base-2 LSE, as the GPU tests compare it)

VERDICTS = {
    "pass": "matches the reference",
    "error": "plan() or run() raised",
    "unwritten": "output rows left as they were before the run",
    "nan": "NaN or inf in the output where the reference has none (or the reverse)",
    "mismatch": "output off the reference beyond the tolerance",
    "lse": "LSE off the reference (or its -inf pattern differs)",
    "rows_past_batch": "graph replay wrote rows past the batch",
    "nondeterministic": "a second run of the same plan gave other output (a race: rerun the case many times)",
}


@dataclass
class Verdict:
    """How a case went. ``kind``: a VERDICTS key (errors: 'error' and ``error_type``)."""

    kind: str
    message: str = ""
    max_abs_err: float = 0.0
    rel_err: float = 0.0
    bad_rows: int = 0
    rows: int = 0
    error_type: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "pass"

    @property
    def signature(self) -> str:
        """What a shrunk case must still show to count as the same failure."""
        return f"error:{self.error_type}" if self.kind == "error" else self.kind


def compare(out: torch.Tensor, ref: torch.Tensor, o_dtype: str, lse: torch.Tensor | None = None,
            ref_lse: torch.Tensor | None = None, rows_past_written: int = 0) -> Verdict:
    """Kernel output (written over SENTINEL) vs the reference; one host sync."""
    atol, rtol, rel_tol = TOLERANCES[o_dtype]
    o = out.float()
    rows = o.shape[0]
    if rows == 0:
        return Verdict("pass")
    flat = o.reshape(rows, -1)
    ref_flat = ref.reshape(rows, -1)
    unwritten = (flat == SENTINEL).all(dim=1)
    # NaN / inf where the reference has none, or none where it has one: a NaN in is NaN out
    nonfinite = nan_positions_differ(flat, ref_flat)
    both = torch.isfinite(flat) & torch.isfinite(ref_flat)
    err = torch.where(both, (flat - ref_flat).abs(), torch.zeros_like(flat))
    bad = (err > atol + rtol * ref_flat.abs()).any(dim=1) | nonfinite
    finite_err = err
    stats = torch.stack([unwritten.sum().float(), nonfinite.sum().float(), bad.sum().float(),
                         finite_err.max() if err.numel() else err.new_zeros(()),
                         # (floored for an all-zero reference: rows with no visible key)
                         err.norm() / torch.where(both, ref_flat, 0).norm().clamp_min(atol * math.sqrt(err.numel()))])
    lse_bad = None
    if lse is not None and ref_lse is not None:
        fin = torch.isfinite(ref_lse)
        pattern = (torch.isfinite(lse) != fin)
        off = ((lse - ref_lse).abs() > LSE_TOLERANCE[0] + LSE_TOLERANCE[1] * ref_lse.abs()) & fin
        lse_bad = (pattern | off).any(dim=1).sum().float().view(1)
        stats = torch.cat([stats, lse_bad])
    values = stats.tolist()
    n_unwritten, n_nonfinite, n_bad, max_err, rel = (int(values[0]), int(values[1]), int(values[2]), values[3],
                                                     values[4])
    v = Verdict("pass", max_abs_err=max_err, rel_err=rel if math.isfinite(rel) else math.inf, bad_rows=n_bad,
                rows=rows)
    if n_unwritten:
        v.kind, v.message = "unwritten", f"{n_unwritten} of {rows} rows not written"
    elif n_nonfinite:
        v.kind, v.message = "nan", f"{n_nonfinite} of {rows} rows have NaN/inf where the reference has none (or none " \
                                   "where it has)"
    elif n_bad or not rel <= rel_tol:
        v.kind = "mismatch"
        v.message = (f"{n_bad} of {rows} rows off (max abs err {max_err:.3g}, tolerance {atol:g} + {rtol:g}|ref|); "
                     f"rel. error {rel:.3g} (tolerance {rel_tol:g})")
    elif rows_past_written:
        v.kind, v.message = "rows_past_batch", f"{rows_past_written} rows past the batch written by the replay"
    elif lse_bad is not None and values[5]:
        v.kind, v.message = "lse", f"{int(values[5])} of {rows} rows have an LSE off the reference"
    return v


def compare_runs(first: torch.Tensor, second: torch.Tensor, verdict: Verdict) -> Verdict:
    """``verdict`` (a pass of ``first``) unless a second run of the same plan wrote other bits
    (NaN equal to NaN): then 'nondeterministic', with the rows that differ."""
    rows = first.shape[0]
    if rows == 0:
        return verdict
    a, b = first.reshape(rows, -1), second.reshape(rows, -1)
    differ = ((a != b) & ~(torch.isnan(a) & torch.isnan(b))).any(dim=1)
    n = int(differ.sum())
    if not n:
        return verdict
    where = differ.nonzero().flatten()[:8].tolist()
    return Verdict("nondeterministic", f"{n} of {rows} rows differ between two runs of one plan (rows {where}"
                   f"{', ...' if n > 8 else ''})", max_abs_err=verdict.max_abs_err, rel_err=verdict.rel_err,
                   bad_rows=n, rows=rows)


def error_verdict(e: BaseException, rows: int = 0) -> Verdict:
    tb = traceback.extract_tb(e.__traceback__)
    where = " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(tb[-3:]))
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return Verdict("error", f"{type(e).__name__}: {text[:400]} [at {where}]", rows=rows, error_type=type(e).__name__)


_CUDA_FATAL = re.compile(r"illegal memory access|unspecified launch failure|device-side assert|CUDA error|"
                         r"cudaError|an illegal instruction|misaligned address", re.IGNORECASE)


def is_fatal(v: Verdict) -> bool:
    """Whether an error left the CUDA context unusable (later cases cannot run in this process):
    a CUDA error after which a small op fails too (sticky: illegal address, launch failure,
    device assert), not one it recovers from (invalid argument, out of memory)."""
    if v.kind != "error" or not _CUDA_FATAL.search(v.message):
        return False
    if not torch.cuda.is_available():
        return True  # (the CPU fakes plant such errors; nothing to probe)
    try:
        torch.ones(1, device="cuda").add_(1).item()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True
    return False


# ----------------------------------------------------------------------------- running a case


class Modules(Protocol):
    """Where a runner's wrappers come from: the module cache on the GPU (CacheModules), fake
    modules on the CPU (tests/fakes/_fake_modules.py)."""

    device: torch.device

    def missing(self, target: Target, module: ModuleKey) -> str | None:
        """Why ``module`` cannot run here now (not precompiled, ...), or None. Never builds."""

    def wrapper(self, target: Target, module: ModuleKey, graph: Any = None) -> Any:
        """A new wrapper of ``target`` on ``module`` (``graph``: a GraphCapacity)."""

    def capture(self, run: Callable[[], Any]) -> Callable[[], Any]:
        """``run`` captured (a CUDA graph on the GPU); calling the result replays it."""


@dataclass
class Outcome:
    """What one run produced, for comparisons beyond the reference (FlashInfer's kernel)."""

    tensors: CaseTensors
    out: torch.Tensor
    ref: torch.Tensor


@dataclass
class RunResult:
    verdict: Verdict
    outcome: Outcome | None = None


def _row_planner(w: Any) -> Any:
    return getattr(w, "row_planner", None)  # (ragged wrappers plan without one)


def _plan(w: Any, case: FuzzCase, t: CaseTensors, args: dict[str, Any]) -> None:
    """plan() as ``case.plan`` asks: planner (key trimming) off, with the spec's planner module,
    or asked for without it (the module set aside for this plan: plan() plans off)."""
    target = TARGET_BY_NAME[case.target]
    planned = case.plan != "off"
    plan_kw: dict[str, Any] = dict(args) if planned else {}
    sizes = (case.num_qo_heads, case.num_kv_heads, case.page_size)
    module = _row_planner(w)
    if case.plan == "nomodule":
        w.set_row_planner(None, "fuzz: no planner module")
    try:
        if target.kind == "ragged":
            w.plan(t.qo_indptr, t.kv_indptr, *sizes[:2], disable_split_kv=case.disable_split_kv)
        elif target.kind == "decode":
            per = case.batch.qo_lens[0]
            multi = {"q_len_per_request": per} if per > 1 else {}
            w.plan(t.kv_indptr, t.kv_indices, t.last_page_len, *sizes, skip_tiles=planned, **multi, **plan_kw)
        else:
            w.plan(t.qo_indptr, t.kv_indptr, t.kv_indices, t.last_page_len, *sizes, skip_tiles=planned,
                   disable_split_kv=case.disable_split_kv, **plan_kw)
    finally:
        if case.plan == "nomodule":
            w.set_row_planner(module)


def _run(w: Any, case: FuzzCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         args: dict[str, Any]) -> Any:
    q_scale, k_scale, v_scale = case.scales
    kw = dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, return_lse=case.return_lse, **args)
    if TARGET_BY_NAME[case.target].kind == "ragged":
        return w.run(q, k, v, **kw)
    return w.run(q, (k, v), **kw)


def _split(result: Any, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (result[0], result[1]) if return_lse else (result, None)


class GraphSession:
    """A graph-mode wrapper with the static buffers a serving engine would capture with, captured
    once on ``case.graph.capture``; ``replay`` plans another batch into it and replays."""

    def __init__(self, runner: CaseRunner, case: FuzzCase):
        from ..planning.graph import GraphCapacity

        assert case.graph is not None
        self.case = case
        target, m, g = TARGET_BY_NAME[case.target], case.module, case.graph
        self.target = target
        dev = runner.modules.device
        cap = GraphCapacity(max_batch_size=g.max_batch_size, max_total_q=g.max_total_q, max_kv_pages=g.max_kv_pages,
                            max_qo_len=g.max_qo_len)
        self.w = runner.modules.wrapper(target, m, cap)
        if case.plan == "nomodule":
            self.w.set_row_planner(None, "fuzz: no planner module")
        hq, hkv, ps = case.num_qo_heads, case.num_kv_heads, case.page_size
        qdt, kvdt = _TORCH_DTYPES[m.q_dtype], _TORCH_DTYPES[m.kv_dtype]
        rows = g.max_total_q
        self.q = torch.zeros(rows, hq, m.head_dim_qk, dtype=qdt, device=dev)
        self.out = torch.zeros(rows, hq, m.head_dim_vo, dtype=qdt, device=dev)
        self.k = torch.zeros(g.max_kv_pages, ps, hkv, m.head_dim_qk, dtype=kvdt, device=dev)
        self.v = torch.zeros(g.max_kv_pages, ps, hkv, m.head_dim_vo, dtype=kvdt, device=dev)
        dims = {"total_q": rows, "total_kv": g.max_kv_pages * ps, "batch": g.max_batch_size, "num_qo_heads": hq,
                "num_kv_heads": hkv}
        spec = shipped_spec(m.spec)
        self.static = {t.name: torch.zeros([dims[d] if isinstance(d, str) else d for d in t.shape],
                                           dtype=torch.int32 if t.dtype == "int32" else torch.float32, device=dev)
                       for t in spec.tensors}
        # The CUDA-core decode wrapper takes spec tensors of the batch's exact shape only: views of
        # the static buffers from their start, so the captured pointers stay right (a replay reads
        # no shape; the shipped specs clamp no index to a tensor's extent). The prefill wrapper
        # behind the other graph targets takes the capacity-sized buffers themselves.
        self.exact_views = target.kind == "decode" and not target.tensor_cores
        t = self.load(g.capture)
        _plan(self.w, case, t, self.args)
        self.out.fill_(SENTINEL)

        def run() -> Any:  # the arguments of the batch loaded last (the fakes' "replay" runs this again)
            return _run(self.w, case, self.q, self.k, self.v, self.out, self.args)

        run()  # warm-up outside the capture
        self.replay_fn = runner.modules.capture(run)

    def load(self, batch: Batch) -> CaseTensors:
        """Copy a batch into the static buffers (poison past it); sets the arguments run() sees."""
        t = make_tensors(self.case, batch, self.q.device)
        tq, pool = t.q.shape[0], t.k.shape[0]
        self.q[:tq] = t.q
        self.q[tq:] = float("nan")  # a kernel that reads past the batch must not write what it read
        self.k[:pool], self.v[:pool] = t.k, t.v
        args = dict(self.case.scalars)
        for name, buf in self.static.items():
            value = t.args[name]
            buf.fill_(-1)
            view = buf[tuple(slice(0, n) for n in value.shape)]
            view.copy_(value)
            args[name] = view if self.exact_views else buf
        self.args = args
        return t

    def replay(self, case: FuzzCase) -> tuple[CaseTensors, torch.Tensor, torch.Tensor | None, int, torch.Tensor]:
        """(tensors, out rows of the batch, lse or None, rows past the batch written, the out rows
        of a second replay of the same plan)."""
        t = self.load(case.batch)
        _plan(self.w, case, t, self.args)
        self.out.fill_(SENTINEL)
        out_all, lse_all = _split(self.replay_fn(), case.return_lse)
        tq = t.q.shape[0]
        past = int((self.out[tq:].float() != SENTINEL).flatten(1).any(dim=1).sum())
        out, lse = self.out[:tq].clone(), (lse_all[:tq].clone() if lse_all is not None else None)
        self.out.fill_(SENTINEL)
        self.replay_fn()
        return t, out, lse, past, self.out[:tq].clone()


class CaseRunner:
    """Runs cases through wrappers of ``modules`` (one per target and module, kept; graph sessions
    kept per capture, the least recently used dropped past ``max_sessions``)."""

    def __init__(self, modules: Modules, *, max_sessions: int = 8):
        self.modules = modules
        self.max_sessions = max_sessions
        self._wrappers: dict[tuple[str, ModuleKey], Any] = {}
        self._sessions: OrderedDict[tuple, GraphSession] = OrderedDict()

    def wrapper(self, target: Target, module: ModuleKey) -> Any:
        key = (target.name, module)
        if key not in self._wrappers:
            self._wrappers[key] = self.modules.wrapper(target, module)
        return self._wrappers[key]

    def plan_paths(self, target: Target, module: ModuleKey) -> tuple[str, ...]:
        """The target's plan paths this module can take ('module' needs the spec's planner module)."""
        if "module" not in target.plans:
            return target.plans
        has_module = _row_planner(self.wrapper(target, module)) is not None
        return tuple(p for p in target.plans if p != "module" or has_module)

    @staticmethod
    def session_key(case: FuzzCase) -> tuple:
        """What identifies a graph session: everything of the case but its replayed batch."""
        return tuple(getattr(case, f.name) for f in dataclasses.fields(case) if f.name != "batch")

    def sessions(self) -> list[FuzzCase]:
        """The first case of each live graph session (draw_case(session=...) replays in one)."""
        return [s.case for s in self._sessions.values()]

    def _session(self, case: FuzzCase) -> GraphSession:
        key = self.session_key(case)
        if key in self._sessions:
            self._sessions.move_to_end(key)
            return self._sessions[key]
        session = GraphSession(self, case)
        self._sessions[key] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session

    def run(self, case: FuzzCase) -> RunResult:
        """Plan and run ``case`` (graph targets: replay it), compare with the reference. Exceptions
        become 'error' verdicts."""
        target = TARGET_BY_NAME[case.target]
        rows = sum(case.batch.qo_lens)
        try:
            if target.graph:
                t, out, lse, past, again = self._session(case).replay(case)
            else:
                w = self.wrapper(target, case.module)
                t = make_tensors(case, case.batch, self.modules.device)
                _plan(w, case, t, t.args)
                shape = (t.q.shape[0], case.num_qo_heads, case.module.head_dim_vo)
                dtype = _TORCH_DTYPES[case.module.q_dtype]
                buf = torch.full(shape, SENTINEL, dtype=dtype, device=self.modules.device)
                out, lse = _split(_run(w, case, t.q, t.k, t.v, buf, t.args), case.return_lse)
                # the same plan run again: a race shows as a difference far more often than as an error
                again = torch.full(shape, SENTINEL, dtype=dtype, device=self.modules.device)
                _run(w, case, t.q, t.k, t.v, again, t.args)
                past = 0
            ref, ref_lse = reference(case, t)
            keep = compared_rows(case)
            if keep is not None:  # (an isolation case: the poisoned request's rows are not compared)
                keep = keep.to(out.device)
                out, ref, again = out[keep], ref[keep], again[keep]
                lse, ref_lse = (lse[keep], ref_lse[keep]) if lse is not None else (None, ref_lse)
            verdict = compare(out, ref, case.module.q_dtype, lse, ref_lse if lse is not None else None, past)
            if verdict.ok:
                verdict = compare_runs(out, again, verdict)
        except Exception as e:  # noqa: BLE001 - a raising case is a finding, reported with its message
            return RunResult(error_verdict(e, rows))
        return RunResult(verdict, Outcome(t, out, ref))


# ----------------------------------------------------------------------------- shrinking


def _batch_shrinks(case: FuzzCase, b: Batch, fixed_count: bool) -> Iterator[Batch]:
    """Smaller versions of batch ``b``: fewer requests, then shorter ones."""
    decode = TARGET_BY_NAME[case.target].kind == "decode"
    n = len(b.qo_lens)
    if not fixed_count:
        for i in reversed(range(n)):
            if n > 1 and sum(b.qo_lens) > b.qo_lens[i]:
                yield b.drop(i)
    for i in range(n):
        q, k = b.qo_lens[i], b.kv_lens[i]
        options: list[tuple[int, int]] = []
        if decode:  # the same query count per request: shorter contexts, or one query less everywhere
            options += [(q, q), (q, max(q, k // 2)), (q, k - 1)]
        else:
            cached = k - q
            options += [(q, q), (q, q + cached // 2), (q, k - 1)]  # fewer cached keys before the chunk
            options += [(1, cached + 1), (q // 2, cached + q // 2), (q - 1, k - 1)]  # keep the first queries
            options += [(1, k), (q // 2, k), (q - 1, k)]  # keep the last queries (and every key)
        seen = set()
        for nq, nk in options:
            smaller = nq <= q and nk <= k and (nq, nk) != (q, k)
            if smaller and 0 <= nq <= nk and (nk >= 1 or not decode) and (nq, nk) not in seen:
                seen.add((nq, nk))
                qo = b.qo_lens[:i] + (nq,) + b.qo_lens[i + 1:]
                kv = b.kv_lens[:i] + (nk,) + b.kv_lens[i + 1:]
                if sum(qo) > 0:
                    yield Batch(qo, kv, b.tensors, b.seed)
    for j, (name, arg) in enumerate(b.tensors):  # simpler spec tensors
        for simpler in _tensor_shrinks(arg):
            yield Batch(b.qo_lens, b.kv_lens, b.tensors[:j] + ((name, simpler),) + b.tensors[j + 1:], b.seed)


def _tensor_shrinks(arg: TensorArg) -> Iterator[TensorArg]:
    if isinstance(arg, Ranges):
        for i, spans in enumerate(arg.spans):
            for j in range(len(spans)):
                yield Ranges(arg.spans[:i] + (_without(spans, j),) + arg.spans[i + 1:], arg.rows)
        for i, rows in enumerate(arg.rows):
            for j in range(len(rows)):
                yield Ranges(arg.spans, arg.rows[:i] + (_without(rows, j),) + arg.rows[i + 1:])
    elif isinstance(arg, DocRuns):
        for i, runs in enumerate(arg.runs):
            for j in range(1, len(runs)):
                yield DocRuns(arg.runs[:i] + (_without(runs, j),) + arg.runs[i + 1:])
    elif isinstance(arg, PerRequest):
        for i, value in enumerate(arg.values):
            if value:
                yield PerRequest(arg.values[:i] + (0,) + arg.values[i + 1:])
    elif isinstance(arg, PerHead) and arg.values:
        yield PerHead()
    elif isinstance(arg, Trees):
        for i, parents in enumerate(arg.parents):
            chain = tuple(range(-1, len(parents) - 1))
            if parents != chain:  # the simplest tree of its size
                yield Trees(arg.parents[:i] + (chain,) + arg.parents[i + 1:])


def shrink_candidates(case: FuzzCase) -> Iterator[FuzzCase]:
    """Smaller cases to try, biggest cuts first: fewer and shorter requests, fewer heads,
    simpler spec tensors and options; in graph mode the capture batch shrinks too."""
    target = TARGET_BY_NAME[case.target]
    fixed = target.graph and target.kind == "decode" and not target.tensor_cores  # exactly max_batch_size
    g = case.graph
    if fixed and g is not None and len(case.batch.qo_lens) > 1:
        for i in reversed(range(len(case.batch.qo_lens))):  # one request fewer in both batches and the capacity
            cap = g.max_batch_size - 1
            yield replace(case, batch=case.batch.drop(i), graph=replace(g, capture=g.capture.drop(i),
                                                                       max_batch_size=cap, max_total_q=cap))
    for b in _batch_shrinks(case, case.batch, fixed):
        yield replace(case, batch=b)
    group = case.num_qo_heads // case.num_kv_heads
    if case.num_kv_heads > 1:
        yield replace(case, num_qo_heads=group, num_kv_heads=1)
    if group > 1:
        yield replace(case, num_qo_heads=case.num_kv_heads)
    if case.return_lse:
        yield replace(case, return_lse=False)
    if case.scales != (None, None, None):
        yield replace(case, scales=(None, None, None))
    if case.disable_split_kv:
        yield replace(case, disable_split_kv=False)
    if g is not None:
        for b in _batch_shrinks(case, g.capture, fixed):
            yield replace(case, graph=replace(g, capture=b))


def case_size(case: FuzzCase) -> tuple[int, int, int]:
    """(requests, query rows, keys): what shrinking reduces."""
    b = case.batch
    return len(b.qo_lens), sum(b.qo_lens), sum(b.kv_lens)


@dataclass
class Minimized:
    case: FuzzCase
    verdict: Verdict
    steps: int  # candidates run
    accepted: int  # of them still failing the same way (each became the new case)
    reproduced: bool  # the original failed again in the minimizing runner
    seconds: float


def minimize(case: FuzzCase, signature: str, runner: CaseRunner, *, budget_s: float = 30.0,
             max_steps: int = 400, clock: Callable[[], float] | None = None) -> Minimized:
    """Greedily shrink ``case`` while it still fails with ``signature`` (Verdict.signature):
    take the first smaller candidate that does, start over from it; stop when none does, or at
    the budget."""
    import time

    clock = clock or time.perf_counter
    t0 = clock()
    first = runner.run(case).verdict
    if first.signature != signature:
        return Minimized(case, first, 1, 0, False, clock() - t0)
    best, verdict, steps, accepted = case, first, 1, 0
    improved = True
    while improved and steps < max_steps and clock() - t0 < budget_s:
        improved = False
        for cand in shrink_candidates(best):
            if steps >= max_steps or clock() - t0 >= budget_s:
                break
            steps += 1
            v = runner.run(cand).verdict
            if v.signature == signature:
                best, verdict, accepted, improved = cand, v, accepted + 1, True
                if is_fatal(v):
                    return Minimized(best, verdict, steps, accepted, True, clock() - t0)
                break
    return Minimized(best, verdict, steps, accepted, True, clock() - t0)


# ----------------------------------------------------------------------------- regression tests


def regression_test(case: FuzzCase, verdict: Verdict, *, origin: str) -> str:
    """A pytest test (for tests/gpu/test_gpu_regressions.py, which has the ``workspace`` fixture)
    that fails while ``case`` still does. ``origin``: where it was found (seed, commit)."""
    import hashlib
    import textwrap

    head = "    case = "
    literal = case_literal(case, column=len(head))
    names = sorted(n for n in _CLASSES if re.search(rf"\b{n}\(", literal))
    digest = hashlib.sha1(repr(case).encode()).hexdigest()[:6]
    slug = re.sub(r"[^0-9a-z]+", "_", f"{case.target}_{case.module.spec}").strip("_")
    quotes = '"' * 3
    doc = textwrap.wrap(f"{origin}: {verdict.kind}: {verdict.message}".replace(quotes, "'''"), 108) or [""]
    if len(doc) == 1:
        doc_text = f"    {quotes}{doc[0]}{quotes}"
    else:
        doc_text = "\n".join([f"    {quotes}{doc[0]}", *(f"    {line}" for line in doc[1:]), f"    {quotes}"])
    return "\n".join([
        f"def test_fuzz_{slug}_{digest}(workspace):",
        doc_text,
        f"    from variantgen.testing.fuzzing import {', '.join(names + ['assert_case_passes'])}",
        "",
        head + literal,
        "    assert_case_passes(case, workspace)",
        "",
    ])


@dataclass
class CacheModules:
    """Wrappers over the module cache (make_wrapper); ``build``: build what is missing (the GPU
    tests do), else a missing module is reported by ``missing`` and never built."""

    workspace: torch.Tensor
    build: bool = False
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.device = self.workspace.device

    def _config(self, target: Target, module: ModuleKey) -> Any:
        from ..api.factory import device_arch
        from ..codegen.render import DEFAULT_MASK_MODES, ModuleConfig

        return ModuleConfig(shipped_spec(module.spec), module.head_dim_qk, module.head_dim_vo, module.q_dtype,
                            module.kv_dtype, module.q_dtype, device_arch(self.device), target.backend,
                            DEFAULT_MASK_MODES, target.module_kind)

    def missing(self, target: Target, module: ModuleKey) -> str | None:
        from ..build.builder import build_module, default_cache
        from ..core.errors import VariantgenError

        try:
            build_module(self._config(target, module), default_cache(), allow_build=False)
        except (VariantgenError, ValueError) as e:
            return str(e).splitlines()[0]
        return None

    def wrapper(self, target: Target, module: ModuleKey, graph: Any = None) -> Any:
        from ..api.factory import make_wrapper

        return make_wrapper(shipped_spec(module.spec), self.workspace, head_dim_qk=module.head_dim_qk,
                            head_dim_vo=module.head_dim_vo, q_dtype=module.q_dtype, kv_dtype=module.kv_dtype,
                            backend=target.backend, kind=target.kind, use_tensor_cores=target.tensor_cores,
                            build=self.build, graph=graph)

    def capture(self, run: Callable[[], Any]) -> Callable[[], Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = run()

        def replay() -> Any:
            graph.replay()
            torch.cuda.synchronize()
            return result

        return replay


def assert_case_passes(case: FuzzCase, workspace: torch.Tensor) -> None:
    """Run ``case`` on the GPU (building its module if needed) and fail with what went wrong."""
    verdict = CaseRunner(CacheModules(workspace, build=True)).run(case).verdict
    assert verdict.ok, f"{case.label()}: {verdict.kind}: {verdict.message}"
