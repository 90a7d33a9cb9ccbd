#!/usr/bin/env python
"""GPU differential fuzzer (issue 14): random batches through every (backend, kind) path.

Each case - a random batch over a module of the matrix below (the shipped specs, fa2 / fa3,
paged prefill, decode on CUDA and tensor cores, ragged, CUDA-graph replays; page sizes 1-64,
GQA groups 1-16, windows none / 0 / 1 / small / large, chunked prefill, random spec tensors,
planner on / off) - is compared with the derived float32 reference (variantgen/testing/fuzz_*.py:
tolerances by dtype, NaN never passes, outputs poisoned before each run) and, where FlashInfer
has the same mask, with FlashInfer's own kernel; each plan runs twice, and a second run that
writes other bits is a failure of its own ('nondeterministic': a race). Cases are spread over the targets by time so
that each gets its share of ``--seconds``. Every failure is shrunk (fewer, shorter requests)
while it still fails, and printed as a pytest test for tests/gpu/test_gpu_regressions.py. The
results JSON (seed, commit, versions, counts per target and spec, max errors, failures with
their reproduction) goes to bench/results/.

Modules are only looked up, never built: precompile the matrix first (``--list-modules``
prints the commands: the modules + the specs' planner modules); a missing one is skipped and
counted. FlashInfer's comparison modules are JIT-built by FlashInfer before the clock starts,
within ``--flashinfer-setup-seconds`` (point FLASHINFER_WORKSPACE_BASE at a carried folder to
keep them between machines). Without a git checkout, set VARIANTGEN_COMMIT for the results.

    python bench/fuzz_gpu.py --list-modules                  # precompile commands
    python bench/fuzz_gpu.py --seconds 240 --seed 1          # on the GPU
    python bench/fuzz_gpu.py --fake --seconds 20             # the harness on the CPU (fake modules)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from variantgen.testing import fuzz_compare, fuzz_run, fuzz_shrink  # noqa: E402
from variantgen.testing.fuzz_cases import (  # noqa: E402
    SPEC_DIRS,
    TARGET_BY_NAME,
    TARGETS,
    Batch,
    FuzzCase,
    ModuleKey,
    Ranges,
    Target,
    shipped_spec,
    to_json,
)
from variantgen.testing.fuzz_compare import TOLERANCES, Verdict, is_fatal  # noqa: E402
from variantgen.testing.fuzz_draw import Limits, draw_case  # noqa: E402
from variantgen.testing.fuzz_run import CacheModules, CaseRunner, Outcome  # noqa: E402
from variantgen.testing.fuzz_shrink import Minimized, case_size  # noqa: E402
from variantgen.testing.fuzz_tensors import CaseTensors, make_tensors  # noqa: E402
from variantgen.testing.harness import source_commit  # noqa: E402

SPECS = tuple(sorted(p.stem for p in (REPO / "specs").glob("*.yaml")))
# --specs may name these too: the benchmarks' masks and their rewritten forms (bench/make_forms.py)
COLLECTION = tuple(sorted(p.stem for d in SPEC_DIRS[1:] for p in d.glob("*.yaml")))
M = ModuleKey
# Fuzzed on only some kinds, to keep the matrix small: learned sinks where a kernel adds the sink
# its own way (fa2 prefill's m/d update - also run by the graph and tensor-core decode targets -,
# fa3's softmax updater, CUDA-core decode's output transform), tree verification on the fa2
# prefill module (eager, graph and tensor-core decode targets run it). gemma4_sliding (a window
# with per-query spans: mm_prefix's shape, fuzzed) is left to tests/gpu/test_gpu_masks.py.
SOME_KINDS = {"attention_sink_learned": {("fa2", "prefill"), ("fa3", "prefill"), ("fa2", "decode"), ("fa3", "ragged")},
              "tree_verify": {("fa2", "prefill"), ("fa3", "prefill")}, "gemma4_sliding": set()}


# Kinds fuzzed on a sample of the specs: fa3 ragged's variant is the paged fa3 module's (fuzzed on
# every spec); what ragged adds - the work list over key rows, the launch's mask mode - does not
# depend on the spec beyond causal / masked, so the sample keeps the fuzzer's module budget.
SAMPLED = {("fa3", "ragged"): {"causal", "mm_prefix", "document", "attention_sink_learned", "softcap", "alibi"}}


def _every(kind: tuple[str, str]) -> tuple[ModuleKey, ...]:
    """Each shipped spec fuzzed on ``kind``, at hd 128 bf16."""
    return tuple(M(s) for s in SPECS if kind in SOME_KINDS.get(s, {kind}))


# The modules cases are drawn from, per (backend, module kind): the shipped specs at hd 128 bf16
# (SOME_KINDS: where), and for a few specs head dims 64 / 256 (ragged: 192/128), fp16 and an fp8
# KV cache. Tensor-core decode and the graph targets run the prefill / decode modules of their
# backend (fa3 decode: its prefill modules). What a build box precompiles for one run: --list-modules.
MODULES: dict[tuple[str, str], tuple[ModuleKey, ...]] = {
    ("fa2", "prefill"): (*_every(("fa2", "prefill")), M("mm_prefix", 64, 64, "fp16", "fp16"),
                         M("softcap", 256, 256, "fp16", "fp16"), M("alibi", 256, 256),
                         M("mm_prefix", kv_dtype="fp8_e4m3")),
    ("fa3", "prefill"): (*_every(("fa3", "prefill")), M("mm_prefix", 64, 64), M("softcap", 256, 256, "fp16", "fp16")),
    ("fa2", "decode"): (*_every(("fa2", "decode")), M("document", 64, 64), M("softcap", 256, 256, "fp16", "fp16"),
                        M("sliding_window", kv_dtype="fp8_e4m3")),
    ("fa2", "ragged"): (*_every(("fa2", "ragged")), M("mm_prefix", 192, 128), M("causal", 192, 128, "fp16", "fp16"),
                        M("softcap", 64, 64), M("alibi", 256, 256)),
    ("fa3", "ragged"): (M("causal"), M("mm_prefix"), M("document"), M("attention_sink_learned"), M("softcap", 64, 64),
                        M("alibi", 256, 256), M("mm_prefix", 192, 128)),
}
ARCH = "9.0a"


def modules_of(target: Target, specs: tuple[str, ...] = SPECS) -> tuple[ModuleKey, ...]:
    """The matrix's modules of ``specs`` for ``target``; a mask of the benchmarks' collection
    (bench/masks/, named in --specs) at hd 128 bf16 on the targets that run a prefill module."""
    collection = tuple(M(s) for s in specs if s not in SPECS) if target.module_kind == "prefill" else ()
    return tuple(m for m in MODULES[(target.backend, target.module_kind)] if m.spec in specs) + collection


def spec_path(name: str) -> str:
    """A --specs name as a path a precompile command takes (shipped spec or the collection's mask)."""
    path = next(d / f"{name}.yaml" for d in SPEC_DIRS if (d / f"{name}.yaml").is_file())  # (as shipped_spec finds it)
    return str(path.relative_to(REPO))


def list_modules(fmt: str, targets: list[Target], specs: tuple[str, ...]) -> str:
    """The module matrix: 'commands' (`variantgen precompile` command lines), 'args' (their
    arguments without --arch / -j, one line per command, for scripts), or 'table' (one row per
    module)."""
    keys = sorted({(t.backend, t.module_kind) for t in targets})
    modules = {(t.backend, t.module_kind): modules_of(t, specs) for t in targets}
    lines = []
    if fmt == "table":
        lines.append(f"{'spec':16s} {'head dims':9s} {'q':5s} {'kv':9s} {'backend':7s} kind     targets")
        for backend, kind in keys:
            for m in modules[(backend, kind)]:
                users = ",".join(t.name for t in targets if (t.backend, t.module_kind) == (backend, kind))
                lines.append(f"{m.spec:16s} {m.head_dim_qk}/{m.head_dim_vo:<5d} {m.q_dtype:5s} {m.kv_dtype:9s} "
                             f"{backend:7s} {kind:8s} {users}")
        return "\n".join(lines)
    groups: dict[tuple, list[str]] = defaultdict(list)
    for backend, kind in keys:
        for m in modules[(backend, kind)]:
            groups[(backend, kind, m.head_dim_qk, m.head_dim_vo, m.q_dtype, m.kv_dtype)].append(m.spec)
    args = []
    for (backend, kind, qk, vo, q, kv), names in sorted(groups.items()):
        hd = str(qk) if qk == vo else f"{qk}/{vo}"
        args.append(f"{' '.join(spec_path(n) for n in names)} --head-dim {hd} --dtype {q} --kv-dtype {kv} "
                    f"--backend {backend} --kind {kind}")
    if fmt == "args":
        return "\n".join(args)
    count = sum(len(v) for v in groups.values())
    lines.append(f"# {count} modules (+ the planner module of each spec with paged prefill or decode modules, built "
                 "with them)")
    lines += [f"python -m variantgen precompile {a} --arch {ARCH} -j 8" for a in args]
    lines.append("# FlashInfer modules for the comparisons (JIT-built by FlashInfer in the setup, in this order):")
    lines += [f"#   {e.name}: {e.describe()}" for e in FI_ENTRIES]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- FlashInfer comparisons


@dataclass(frozen=True)
class FiEntry:
    """One FlashInfer module a comparison uses (FlashInfer builds one per these flags)."""

    name: str
    api: str  # "prefill" (paged), "decode" (CUDA cores), "ragged", "mm_prefix" (its ranges wrapper, fa2)
    backend: str
    window: bool  # use_sliding_window
    soft_cap: bool  # use_logits_soft_cap

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        return (self.api, self.backend, self.window, self.soft_cap)

    def describe(self) -> str:
        what = {"prefill": "BatchPrefillWithPagedKVCacheWrapper", "decode": "BatchDecodeWithPagedKVCacheWrapper",
                "ragged": "BatchPrefillWithRaggedKVCacheWrapper",
                "mm_prefix": "BatchPrefillWithCausalBidirectionalRangesWrapper"}[self.api]
        flags = [f for f, on in (("window_left", self.window), ("logits_soft_cap", self.soft_cap)) if on]
        return f"{what} {self.backend} hd 128 bf16" + (f" with {', '.join(flags)}" if flags else "")


# In setup order (most telling first): the masks FlashInfer has of the shipped specs, hd 128, bf16.
FI_ENTRIES = (
    FiEntry("mm_prefix", "mm_prefix", "fa2", False, False),
    FiEntry("prefill-fa2-window", "prefill", "fa2", True, False),
    FiEntry("prefill-fa2-window-softcap", "prefill", "fa2", True, True),
    FiEntry("decode-window-softcap", "decode", "fa2", True, True),
    FiEntry("prefill-fa3-window", "prefill", "fa3", True, False),
    FiEntry("prefill-fa2", "prefill", "fa2", False, False),
    FiEntry("prefill-fa3", "prefill", "fa3", False, False),
    FiEntry("decode", "decode", "fa2", False, False),
    FiEntry("decode-window", "decode", "fa2", True, False),
    FiEntry("ragged-fa2", "ragged", "fa2", False, False),
    FiEntry("ragged-fa2-window", "ragged", "fa2", True, False),
    FiEntry("prefill-fa2-softcap", "prefill", "fa2", False, True),
    FiEntry("prefill-fa3-window-softcap", "prefill", "fa3", True, True),
)


FI_BY_KEY = {e.key: e for e in FI_ENTRIES}


@dataclass(frozen=True)
class FiCall:
    """How FlashInfer runs a case's mask."""

    api: str
    backend: str
    window_left: int = -1
    soft_cap: float | None = None

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """The FiEntry.key of the module FlashInfer runs it with."""
        return (self.api, self.backend, self.window_left >= 0, self.soft_cap is not None)

    def label(self) -> str:
        return f"{self.api} {self.backend}" + (" window" if self.window_left >= 0 else "") + (
            " soft-cap" if self.soft_cap is not None else "")


def flashinfer_call(case: FuzzCase) -> FiCall | None:
    """The FlashInfer call with the same mask as ``case``, or None (another mask, head dim or dtype,
    q/k/v scales, an empty request). ALiBi is not compared: FlashInfer's prefill biases by the
    query's index within the chunk, not its position, so it differs from the spec under chunked
    prefill."""
    m, target = case.module, TARGET_BY_NAME[case.target]
    if (m.head_dim_qk, m.head_dim_vo, m.q_dtype, m.kv_dtype) != (128, 128, "bf16", "bf16"):
        return None
    if case.scales != (None, None, None) or 0 in case.batch.kv_lens:
        return None
    s = dict(case.scalars)
    if m.spec == "mm_prefix":
        return FiCall("mm_prefix", "fa2") if target.kind == "prefill" and not target.tensor_cores else None
    if m.spec == "causal":
        window, cap = -1, None
    elif m.spec in ("sliding_window", "softcap"):
        window, cap = max(s["window"], -1), (s["soft_cap"] if m.spec == "softcap" else None)
    elif m.spec == "streaming_sink" and s["num_sink"] <= 0 and s["window"] >= 0:
        window, cap = s["window"], None  # no sinks: a sliding window
    else:
        return None
    # (tensor-core decode too is compared with FlashInfer's CUDA-core decode: the same attention)
    return FiCall(target.kind, target.backend if target.kind == "prefill" else "fa2", window, cap)


class FlashInferComparer:
    """FlashInfer's kernel on a case's batch, for the FI_ENTRIES made ready in ``setup``."""

    def __init__(self, device: torch.device, names: list[str]):
        self.device = device
        self.entries = [e for e in FI_ENTRIES if e.name in names]
        self.by_name = {e.name: e for e in self.entries}
        self.workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self.wrappers: dict[str, Any] = {}
        self.status: dict[str, dict[str, Any]] = {}
        self.stats: dict[str, Counter] = defaultdict(Counter)
        self.max_diff: dict[str, float] = defaultdict(float)
        self.not_in_matrix: Counter = Counter()  # cases with a FlashInfer mask whose module is not set up here
        self.disagreements: list[dict] = []

    def setup(self, budget_s: float) -> None:
        """Load (FlashInfer JIT-builds on first use) each entry's module by running it once on a
        small batch, in FI_ENTRIES order, until ``budget_s`` is spent."""
        t0 = time.perf_counter()
        for e in self.entries:
            if time.perf_counter() - t0 > budget_s:
                self.status[e.name] = {"status": "skipped: --flashinfer-setup-seconds spent"}
                continue
            t1 = time.perf_counter()
            case = self._warmup_case(e)
            call = flashinfer_call(case)
            assert call is not None and call.key == e.key, (e, call)
            try:
                t = make_tensors(case, case.batch, self.device)
                self._run(e, call, case, t)
                torch.cuda.synchronize()
                self.status[e.name] = {"status": "ready", "seconds": round(time.perf_counter() - t1, 1)}
            except Exception as ex:  # noqa: BLE001 - e.g. FLASHINFER_DISABLE_JIT without the module: no comparison
                self.wrappers.pop(e.name, None)
                self.status[e.name] = {"status": f"unavailable: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}",
                                       "seconds": round(time.perf_counter() - t1, 1)}
            print(f"  flashinfer {e.name}: {self.status[e.name]}", flush=True)

    @staticmethod
    def _warmup_case(e: FiEntry) -> FuzzCase:
        spec = ("mm_prefix" if e.api == "mm_prefix" else "softcap" if e.soft_cap else
                "sliding_window" if e.window else "causal")
        target = {"prefill": f"{e.backend}/prefill", "mm_prefix": "fa2/prefill", "decode": "fa2/decode",
                  "ragged": "fa2/ragged"}[e.api]
        scalars: dict[str, Any] = {"window": 8 if e.window else -1, "soft_cap": 30.0,
                                   "causal_window_left": -1, "range_window_left": -1}
        names = [s.name for s in shipped_spec(spec).scalars]
        decode = e.api == "decode"
        tensors = (("ranges", Ranges((((2, 9),),), ((),))),) if spec == "mm_prefix" else ()
        batch = Batch((1,) if decode else (12,), (40,), tensors, 0)
        return FuzzCase(target, ModuleKey(spec), batch, 8, 2, 1 if e.api == "ragged" else 16,
                        scalars=tuple((n, scalars[n]) for n in names))

    def _wrapper(self, e: FiEntry) -> Any:
        import flashinfer

        if e.name not in self.wrappers:
            ws = self.workspace
            if e.api == "mm_prefix":
                w = flashinfer.BatchPrefillWithCausalBidirectionalRangesWrapper(
                    ws, "NHD", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, head_dim_qk=128,
                    head_dim_vo=128)
            elif e.api == "prefill":
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=e.backend)
            elif e.api == "decode":
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            else:
                w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=e.backend)
            self.wrappers[e.name] = w
        return self.wrappers[e.name]

    def _run(self, e: FiEntry, call: FiCall, case: FuzzCase, t: CaseTensors) -> torch.Tensor:
        w = self._wrapper(e)
        hq, hkv, ps = case.num_qo_heads, case.num_kv_heads, case.page_size
        dt = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        flags = dict(window_left=call.window_left, logits_soft_cap=call.soft_cap)
        if e.api == "mm_prefix":
            s = dict(case.scalars)
            w.plan(t.qo_indptr, t.kv_indptr, t.kv_indices, t.last_page_len, hq, hkv, 128, ps)
            return w.run(t.q, (t.k, t.v), t.args["ranges"], causal_window_left=s["causal_window_left"],
                         range_window_left=s["range_window_left"])
        if e.api == "prefill":
            w.plan(t.qo_indptr, t.kv_indptr, t.kv_indices, t.last_page_len, hq, hkv, 128, ps, causal=True, **flags,
                   **dt)
            return w.run(t.q, (t.k, t.v))
        if e.api == "decode":
            w.plan(t.kv_indptr, t.kv_indices, t.last_page_len, hq, hkv, 128, ps, **flags, **dt)
            return w.run(t.q, (t.k, t.v))
        w.plan(t.qo_indptr, t.kv_indptr, hq, hkv, 128, head_dim_vo=128, causal=True, **flags, **dt)
        return w.run(t.q, t.k, t.v)

    def compare(self, case: FuzzCase, outcome: Outcome) -> None:
        """FlashInfer vs the reference (and vs ours) on the case's batch, where it has the mask."""
        call = flashinfer_call(case)
        if call is None:
            return
        entry = FI_BY_KEY.get(call.key)
        if entry is None or entry.name not in self.by_name:
            self.not_in_matrix[call.label()] += 1
            return
        st = self.stats[entry.name]
        if entry.name not in self.wrappers:
            st["not_ready"] += 1
            return
        try:
            fi_out = self._run(entry, call, case, outcome.tensors)
            v = fuzz_compare.compare(fi_out, outcome.ref, "bf16")
            diff = (fi_out.float() - outcome.out.float()).abs().max().item() if fi_out.numel() else 0.0
        except Exception as e:  # noqa: BLE001 - FlashInfer's own failures are counted, not ours
            st["errors"] += 1
            if st["errors"] <= 3:
                self.disagreements.append({"entry": entry.name, "error": f"{type(e).__name__}: {e}"[:400],
                                           "case": to_json(case)})
            return
        st["compared"] += 1
        self.max_diff[entry.name] = max(self.max_diff[entry.name], diff)
        if not v.ok:
            st["flashinfer_vs_reference_failed"] += 1
            if len(self.disagreements) < 20:
                self.disagreements.append({"entry": entry.name, "verdict": dataclasses.asdict(v),
                                           "max_abs_diff_vs_ours": diff, "case": to_json(case)})

    def results(self) -> dict[str, Any]:
        return {"entries": {e.name: {"describe": e.describe(), **self.status.get(e.name, {"status": "not set up"}),
                                     **self.stats.get(e.name, {}),
                                     "max_abs_diff_vs_ours": self.max_diff.get(e.name, 0.0)}
                            for e in self.entries},
                "not_in_matrix": dict(self.not_in_matrix), "disagreements": self.disagreements}


# ----------------------------------------------------------------------------- the fuzz loop


@dataclass
class Config:
    seconds: float = 240.0
    seed: int = 0
    targets: tuple[str, ...] = tuple(t.name for t in TARGETS)
    specs: tuple[str, ...] = SPECS
    limits: Limits = Limits()
    max_cases: int | None = None
    minimize_seconds: float = 120.0
    max_minimize: int = 12  # failure signatures (target, spec, kind) minimized
    session_reuse: float = 0.9  # graph targets: chance that a case replays in a live session
    max_sessions: int = 24  # live graph sessions (static buffers and a captured graph each)
    poison: tuple[str, ...] = ()  # isolation cases: POISONS values put into one request's K/V (--poison)


@dataclass
class Counts:
    """Cases of a target (or of one spec on it); max errors over the passing ones (how close they
    come to the tolerance - a failure carries its own)."""

    cases: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0

    def add(self, v: Verdict, seconds: float) -> None:
        self.cases += 1
        self.seconds += seconds
        if v.ok:
            self.passed += 1
            self.max_abs_err = max(self.max_abs_err, v.max_abs_err)
            self.max_rel_err = max(self.max_rel_err, v.rel_err)
        else:
            self.failed += 1


@dataclass
class TargetStats:
    total: Counts = field(default_factory=Counts)
    specs: dict[str, Counts] = field(default_factory=lambda: defaultdict(Counts))
    verdicts: Counter = field(default_factory=Counter)
    skip_reasons: Counter = field(default_factory=Counter)
    coverage: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def skip(self, spec: str, reason: str) -> None:
        self.total.skipped += 1
        self.specs[spec].skipped += 1
        self.skip_reasons[reason] += 1

    def record(self, case: FuzzCase, v: Verdict, seconds: float) -> None:
        self.total.add(v, seconds)
        self.specs[case.module.spec].add(v, seconds)
        self.verdicts[v.signature] += 1
        for name, value in (("plan", case.plan), ("page_size", case.page_size),
                            ("group", case.num_qo_heads // case.num_kv_heads), ("module", case.module.label()),
                            ("requests", len(case.batch.qo_lens))):
            self.coverage[name][str(value)] += 1

    def as_json(self, target: Target) -> dict[str, Any]:
        return {"backend": target.backend, "kind": target.kind, "tensor_cores": target.tensor_cores,
                "graph": target.graph, **dataclasses.asdict(self.total),
                "specs": {s: dataclasses.asdict(c) for s, c in sorted(self.specs.items())},
                "verdicts": dict(self.verdicts), "skip_reasons": dict(self.skip_reasons),
                "coverage": {k: dict(sorted(v.items())) for k, v in self.coverage.items()}}


def _is_capacity_skip(target: Target, v: Verdict) -> bool:
    """A graph-mode batch past the wrapper's documented capacity is refused by design, not a bug."""
    return target.graph and v.kind == "error" and "CUDA-graph capacity" in v.message


def _print(text: str) -> None:
    print(text, flush=True)


class Fuzzer:
    """One fuzz run: which modules can run here, the time-fair loop over the targets, the
    minimizing of what failed, the results."""

    def __init__(self, cfg: Config, modules: fuzz_run.Modules, flashinfer: FlashInferComparer | None = None,
                 log: Callable[[str], None] = _print):
        self.cfg, self.modules, self.flashinfer, self.log = cfg, modules, flashinfer, log
        self.targets = [TARGET_BY_NAME[n] for n in cfg.targets]
        self.stats = {t.name: TargetStats() for t in self.targets}
        self.available: dict[str, list[ModuleKey]] = {}
        self.missing: dict[tuple[str, str, ModuleKey], str] = {}  # (backend, module kind, module) -> why
        self.failures: list[tuple[FuzzCase, Verdict]] = []
        self.fatal: str | None = None
        self.interrupted = False
        self.seconds = {"setup": 0.0, "fuzz": 0.0, "minimize": 0.0}
        self.minimized: list[dict[str, Any]] | None = None

    def check_modules(self) -> None:
        """Which modules of each target's matrix can run here (asked once per module; never built)."""
        t0 = time.perf_counter()
        for target in self.targets:
            self.available[target.name] = []
            for m in modules_of(target, self.cfg.specs):
                key = (target.backend, target.module_kind, m)
                if key not in self.missing:
                    why = self.modules.missing(target, m)
                    if why:
                        self.missing[key] = why
                if key not in self.missing:
                    self.available[target.name].append(m)
            if not self.available[target.name]:
                self.log(f"  {target.name}: no module of its matrix is available - skipped")
        self.seconds["setup"] = time.perf_counter() - t0

    def _lose(self, key: tuple[str, str, ModuleKey], why: str) -> None:
        """A module found unusable mid-run: out of every target that runs it."""
        self.missing[key] = why
        for t in self.targets:
            if (t.backend, t.module_kind) == key[:2] and key[2] in self.available[t.name]:
                self.available[t.name].remove(key[2])
                if not self.available[t.name]:
                    self.log(f"  {t.name}: no module left ({why})")

    def fuzz(self) -> None:
        """Cases until the time (or case count) is spent: each from the target that has had the
        least time so far, on a random module of its matrix (a missing one is counted, skipped)."""
        cfg, master = self.cfg, random.Random(self.cfg.seed)
        runner = CaseRunner(self.modules, max_sessions=cfg.max_sessions)
        t0 = last_report = time.perf_counter()
        drawn = 0
        try:
            while time.perf_counter() - t0 < cfg.seconds and (cfg.max_cases is None or drawn < cfg.max_cases):
                active = [t for t in self.targets if self.available[t.name]]
                if not active:
                    break
                target = min(active, key=lambda t: self.stats[t.name].total.seconds)
                r = random.Random(master.getrandbits(64))
                if not self._one_case(runner, target, r):
                    continue
                drawn += 1
                if self.fatal:
                    break
                if time.perf_counter() - last_report > 30:
                    last_report = time.perf_counter()
                    done = sum(s.total.cases for s in self.stats.values())
                    self.log(f"  {last_report - t0:.0f}s: {done} cases, {len(self.failures)} failed")
        except KeyboardInterrupt:  # also SIGTERM (main): keep what was found
            self.interrupted = True
            self.log("  interrupted: writing what was found")
        self.seconds["fuzz"] = time.perf_counter() - t0

    def _one_case(self, runner: CaseRunner, target: Target, r: random.Random) -> bool:
        """Draw and run one case of ``target``; False when the draw hit a missing module."""
        st = self.stats[target.name]
        # Graph targets mostly replay in a live session (captured once, re-planned per batch).
        live = [s for s in runner.sessions() if s.target == target.name] if target.graph else []
        session = r.choice(live) if live and r.random() < self.cfg.session_reuse else None
        m = session.module if session is not None else r.choice(modules_of(target, self.cfg.specs))
        key = (target.backend, target.module_kind, m)
        if key in self.missing:
            st.skip(m.spec, "module not available")
            return False
        t1 = time.perf_counter()
        try:
            plans = runner.plan_paths(target, m)
        except Exception as e:  # noqa: BLE001 - a module that does not load is reported, then left out
            self._lose(key, f"wrapper failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
            st.skip(m.spec, "module not available")
            return False
        case = draw_case(r, target, m, limits=self.cfg.limits, plans=plans, session=session,
                         poison=self.cfg.poison)
        result = runner.run(case)
        v, dt = result.verdict, time.perf_counter() - t1
        if _is_capacity_skip(target, v):
            st.skip(m.spec, "batch past the CUDA-graph capacity")
            st.total.seconds += dt
            return True
        st.record(case, v, dt)
        if target.graph:
            st.coverage["graph"]["replayed in a live session" if session else "new session"] += 1
        if case.poison:
            st.coverage["poison"][case.poison] += 1
        if self.flashinfer is not None and result.outcome is not None and not case.poison:  # (rows kept apart)
            self.flashinfer.compare(case, result.outcome)
        if not v.ok:
            self.failures.append((case, v))
            if is_fatal(v):
                self.fatal = f"{case.label()}: {v.message}"
                self.log(f"  FATAL (the CUDA context is lost, stopping): {self.fatal}")
        return True

    def minimize(self) -> None:
        """The first failure of each (target, spec, verdict) minimized, within the budget; the
        others (up to 3 per signature) kept as found. Not after a lost CUDA context."""
        if self.fatal or self.interrupted:
            return
        groups: dict[tuple[str, str, str], list[tuple[FuzzCase, Verdict]]] = defaultdict(list)
        for case, v in self.failures:
            groups[(case.target, case.module.spec, v.signature)].append((case, v))
        out = []
        runner = CaseRunner(self.modules)  # fresh wrappers: a failure must not need the fuzz run's state
        t0 = time.perf_counter()
        budget = self.cfg.minimize_seconds
        try:
            for i, (key, items) in enumerate(groups.items()):
                left = budget - (time.perf_counter() - t0)
                case, v = items[0]
                mz = None
                if i < self.cfg.max_minimize and left > 0:
                    mz = fuzz_shrink.minimize(case, v.signature, runner, budget_s=min(left, max(budget / 4, 10.0)))
                    note = ("not reproduced in fresh wrappers (state the run left, or a race: run the case "
                            "many times)") if not mz.reproduced else \
                        f"{case_size(case)} -> {case_size(mz.case)} in {mz.steps} runs"
                    self.log(f"  minimized {key}: {note}")
                out.append(_failure_json(case, v, mz, self.cfg.seed))
                out += [_failure_json(c, vv, None, self.cfg.seed) for c, vv in items[1:3]]
        except KeyboardInterrupt:
            self.interrupted = True
            out = None
        self.minimized = out
        self.seconds["minimize"] = time.perf_counter() - t0

    def results(self) -> dict[str, Any]:
        """The results (main() adds the environment); failures as minimized, else as found."""
        cfg, stats = self.cfg, self.stats
        failures = self.minimized if self.minimized is not None else [
            _failure_json(c, v, None, cfg.seed) for c, v in self.failures[:20]]
        return {
            "seed": cfg.seed,
            "config": {"seconds": cfg.seconds, "targets": list(cfg.targets), "specs": list(cfg.specs),
                       "limits": dataclasses.asdict(cfg.limits), "max_cases": cfg.max_cases,
                       "minimize_seconds": cfg.minimize_seconds, "max_minimize": cfg.max_minimize,
                       "tolerances": {k: dict(zip(("atol", "rtol", "rel_norm"), v)) for k, v in TOLERANCES.items()}},
            **{f"{k}_seconds": round(v, 2) for k, v in self.seconds.items()},
            "cases": sum(s.total.cases for s in stats.values()),
            "failed": sum(s.total.failed for s in stats.values()),
            "skipped": sum(s.total.skipped for s in stats.values()),
            "targets": {t.name: stats[t.name].as_json(t) for t in self.targets},
            "modules": {"available": {t: [m.label() for m in ms] for t, ms in self.available.items()},
                        "missing": [{"backend": b, "kind": k, "module": m.label(), "reason": why}
                                    for (b, k, m), why in self.missing.items()]},
            "fatal": self.fatal,
            "interrupted": self.interrupted,
            "minimized": self.minimized is not None,
            "failures": failures,
            "failures_total": len(self.failures),
            "flashinfer_comparisons": self.flashinfer.results() if self.flashinfer is not None else None,
        }


def run_fuzz(cfg: Config, modules: fuzz_run.Modules, flashinfer: FlashInferComparer | None = None,
             log: Callable[[str], None] = _print,
             checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Fuzz for ``cfg.seconds`` (or ``cfg.max_cases``), then minimize; returns the results.
    ``checkpoint`` gets the results before minimizing too (a run stopped then still leaves them)."""
    f = Fuzzer(cfg, modules, flashinfer, log)
    f.check_modules()
    f.fuzz()
    if checkpoint is not None:
        checkpoint(f.results())
    f.minimize()
    return f.results()


def _failure_json(case: FuzzCase, v: Verdict, mz: Minimized | None, seed: int) -> dict[str, Any]:
    target = TARGET_BY_NAME[case.target]
    shown, verdict = (mz.case, mz.verdict) if mz is not None and mz.reproduced else (case, v)
    origin = f"bench/fuzz_gpu.py --seed {seed} ({source_commit()})"
    if mz is not None and mz.reproduced and mz.case != case:
        origin += f", minimized from {case_size(case)[0]} request(s) / {case_size(case)[1]} query rows"
    return {
        "target": case.target, "backend": target.backend, "kind": target.kind, "spec": case.module.spec,
        "module": case.module.label(), "label": case.label(), "verdict": dataclasses.asdict(v),
        "case": to_json(case),
        "minimized": None if mz is None else {"case": to_json(mz.case), "verdict": dataclasses.asdict(mz.verdict),
                                              "steps": mz.steps, "accepted": mz.accepted,
                                              "reproduced": mz.reproduced, "seconds": round(mz.seconds, 2),
                                              "size": case_size(mz.case)},
        "regression_test": fuzz_shrink.regression_test(shown, verdict, origin=origin),
    }


# ----------------------------------------------------------------------------- reporting


def environment(fake: bool) -> dict[str, Any]:
    from variantgen.testing.harness import run_environment

    env = run_environment()
    if fake:
        env["gpu"] = "none (fake modules on the CPU)"
    return env  # (its commit first: run_environment's)


def summary(results: dict[str, Any]) -> str:
    lines = [f"fuzz_gpu seed {results['seed']}: {results['cases']} cases in {results['fuzz_seconds']:.0f}s, "
             f"{results['failed']} failed, {results['skipped']} skipped"]
    lines.append(f"  {'target':20s} {'cases':>6s} {'passed':>6s} {'failed':>6s} {'skipped':>7s} {'cases/s':>7s} "
                 f"{'max abs err':>11s}")
    for name, t in results["targets"].items():
        rate = t["cases"] / t["seconds"] if t["seconds"] else 0.0
        lines.append(f"  {name:20s} {t['cases']:6d} {t['passed']:6d} {t['failed']:6d} {t['skipped']:7d} "
                     f"{rate:7.1f} {t['max_abs_err']:11.3g}")
    for m in results["modules"]["missing"]:
        lines.append(f"  missing: {m['module']} {m['backend']} {m['kind']}: {m['reason'][:150]}")
    if results.get("flashinfer_comparisons"):
        for name, e in results["flashinfer_comparisons"]["entries"].items():
            lines.append(f"  flashinfer {name}: {e['status']}; compared {e.get('compared', 0)}, "
                         f"vs reference failed {e.get('flashinfer_vs_reference_failed', 0)}, "
                         f"max |ours - FlashInfer| {e['max_abs_diff_vs_ours']:.3g}")
    for f in results["failures"]:
        lines.append(f"  FAIL {f['label']}: {f['verdict']['kind']}: {f['verdict']['message'][:200]}")
    if results["fatal"]:
        lines.append(f"  stopped early: {results['fatal']}")
    if results["interrupted"]:
        lines.append("  interrupted (SIGTERM or Ctrl-C): what ran is counted, failures are not minimized")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--seconds", type=float, default=240.0, help="time for the cases (setup and minimizing apart)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default=",".join(t.name for t in TARGETS),
                    help=f"comma-separated of: {', '.join(t.name for t in TARGETS)}")
    ap.add_argument("--specs", default=",".join(SPECS),
                    help="comma-separated shipped spec names, or masks of bench/masks/ (prefill modules)")
    ap.add_argument("--max-cases", type=int, default=None, help="stop after this many cases")
    ap.add_argument("--minimize-seconds", type=float, default=120.0)
    ap.add_argument("--max-minimize", type=int, default=12, help="failure signatures to minimize")
    ap.add_argument("--flashinfer", default="all",
                    help=f"'all', 'none' or comma-separated of: {', '.join(e.name for e in FI_ENTRIES)}")
    ap.add_argument("--flashinfer-setup-seconds", type=float, default=150.0,
                    help="time for loading (JIT-building) FlashInfer's modules before the clock starts")
    ap.add_argument("--list-modules", nargs="?", const="commands", choices=["commands", "args", "table"],
                    help="print the module matrix (precompile commands, their arguments, or a table) and exit")
    ap.add_argument("--fake", action="store_true",
                    help="run the harness on the CPU through the fake modules of tests/ (no GPU, no FlashInfer)")
    ap.add_argument("--poison", default="", help="isolation cases: comma-separated values (nan, inf) put into K and V "
                    "of one request's first and last key in every case of two requests or more; the other requests' "
                    "rows must match the reference (finite), the poisoned request's are not compared")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: bench/results/fuzz-gpu-...json)")
    args = ap.parse_args(argv)

    def names(text: str, known: list[str], what: str) -> tuple[str, ...]:
        got = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in got if x not in known]
        if bad or not got:
            ap.error(f"--{what}: unknown {', '.join(bad) or '(none given)'}; expected some of {', '.join(known)}")
        return got

    targets = names(args.targets, [t.name for t in TARGETS], "targets")
    specs = names(args.specs, [*SPECS, *COLLECTION], "specs")
    if args.list_modules:
        print(list_modules(args.list_modules, [TARGET_BY_NAME[n] for n in targets], specs))
        return 0
    fi_names = ([] if args.flashinfer == "none" or args.fake else [e.name for e in FI_ENTRIES]
                if args.flashinfer == "all" else list(names(args.flashinfer, [e.name for e in FI_ENTRIES],
                                                            "flashinfer")))
    limits = Limits()
    if args.fake:
        sys.path.insert(0, str(REPO / "tests" / "fakes"))
        from _fake_modules import FakeModules

        modules: fuzz_run.Modules = FakeModules()
        limits = FAKE_LIMITS
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA GPU visible (use --fake to run the harness on the CPU)")
        modules = CacheModules(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    cfg = Config(seconds=args.seconds, seed=args.seed, targets=targets, specs=specs, limits=limits,
                 max_cases=args.max_cases, minimize_seconds=args.minimize_seconds, max_minimize=args.max_minimize,
                 poison=names(args.poison, ["nan", "inf"], "poison") if args.poison else ())
    fi = None
    if fi_names:
        fi = FlashInferComparer(modules.device, fi_names)
        print(f"setting up {len(fi.entries)} FlashInfer comparison module(s) "
              f"(at most {args.flashinfer_setup_seconds:.0f}s)", flush=True)
        t = time.perf_counter()
        fi.setup(args.flashinfer_setup_seconds)
        print(f"  FlashInfer setup {time.perf_counter() - t:.1f}s", flush=True)
    env = {"tool": "bench/fuzz_gpu.py", **environment(args.fake)}
    out = args.out
    if out is None:
        from variantgen.testing.harness import result_file_name

        out = REPO / "bench" / "results" / result_file_name(f"fuzz-gpu-seed{args.seed}", env)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(results: dict[str, Any]) -> None:
        out.write_text(json.dumps({**env, **results}, indent=1) + "\n")

    def stop(signum: int, frame: Any) -> None:  # a time limit's SIGTERM: end the loop, keep the results
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    results = run_fuzz(cfg, modules, fi, checkpoint=write)
    write(results)
    print(summary(results))
    for f in results["failures"]:
        print("\n# " + f["label"] + "\n" + f["regression_test"])
    print(f"results: {out}")
    return 1 if results["failed"] else 0


# --fake: batches small enough for the CPU fake kernels (float32 torch loops).
FAKE_LIMITS = Limits(max_requests=3, max_qo_len=24, max_cached=40, max_decode_requests=4, max_decode_kv_len=80,
                     groups=(1, 2, 4), kv_heads=(1, 2), page_sizes=(1, 5, 16), boundaries=(15, 16, 17))


if __name__ == "__main__":
    sys.exit(main())
