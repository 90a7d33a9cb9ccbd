"""The GPU differential fuzzer's harness on the CPU (bench/fuzz_gpu.py, variantgen/testing/fuzz_*.py).

Cases are drawn, run through the fake modules of tests/fakes/_fake_kernel.py / _fake_decode.py
(tests/fakes/_fake_modules.py makes the wrappers), compared with the reference, minimized and written
as JSON exactly as on the GPU. Planted bugs - a kernel that leaves a row unwritten, one that
ignores the kernel window of its causal launches, one that loses the CUDA context - must be
found, and the first two minimized into a regression test that names a smaller case.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from _fake_kernel import FakeModule
from _fake_modules import FakeModules
from click.testing import CliRunner

from variantgen.codegen import render
from variantgen.routing import capabilities
from variantgen.testing import fuzz_cases, fuzz_tensors
from variantgen.testing.fuzz_cases import (
    PLAN_PATHS,
    TARGET_BY_NAME,
    TARGETS,
    Batch,
    DocRuns,
    FuzzCase,
    ModuleKey,
    PerHead,
    PerRequest,
    Ranges,
    case_literal,
    from_json,
    shipped_spec,
    to_json,
)
from variantgen.testing.fuzz_compare import compare
from variantgen.testing.fuzz_draw import Limits, draw_case
from variantgen.testing.fuzz_run import CaseRunner
from variantgen.testing.fuzz_shrink import case_size, shrink_candidates
from variantgen.testing.fuzz_tensors import POISON_K, POISON_V, SENTINEL, compared_rows, make_tensors
from variantgen.tools.cli import main as cli_main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fuzz_gpu  # noqa: E402

LIMITS = fuzz_gpu.FAKE_LIMITS


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def quiet(_text: str) -> None:
    pass


def config(**kw) -> fuzz_gpu.Config:
    kw.setdefault("seconds", 600.0)
    kw.setdefault("limits", LIMITS)
    kw.setdefault("minimize_seconds", 60.0)
    return fuzz_gpu.Config(**kw)


def drawn(n_per_target: int, seed: int = 0, specs=fuzz_gpu.SPECS) -> list[FuzzCase]:
    """Cases of every target (not run), graph targets also as replays in a drawn session."""
    r = random.Random(seed)
    out = []
    for target in TARGETS:
        for _ in range(n_per_target):
            m = r.choice(fuzz_gpu.modules_of(target, specs))
            case = draw_case(r, target, m, limits=LIMITS)
            out.append(case)
            if target.graph:
                out.append(draw_case(r, target, m, limits=LIMITS, session=case))
    return out


# ----------------------------------------------------------------------------- what is fuzzed


def test_targets_cover_every_backend_and_kind():
    """One table of (backend, kind): every pair capabilities.HEAD_DIMS compiles has a target, and every
    target's modules are valid configurations of its kind."""
    pairs = {(t.backend, t.module_kind) for t in TARGETS}
    assert pairs == set(capabilities.HEAD_DIMS)
    for t in TARGETS:
        assert t.kind in capabilities.KINDS and set(t.plans) <= set(PLAN_PATHS), t
        modules = fuzz_gpu.modules_of(t)
        want = {s for s in fuzz_gpu.SPECS if (t.backend, t.module_kind) in fuzz_gpu.SOME_KINDS.get(
            s, {(t.backend, t.module_kind)})}
        want = fuzz_gpu.SAMPLED.get((t.backend, t.module_kind), want)
        assert {m.spec for m in modules} == want, f"{t.name}: every shipped spec (SOME_KINDS: where listed; SAMPLED)"
        for m in modules:
            render.ModuleConfig(shipped_spec(m.spec), m.head_dim_qk, m.head_dim_vo, m.q_dtype, m.kv_dtype,
                                m.q_dtype, "9.0a", t.backend, kind=t.module_kind)  # raises if invalid
    assert {t.name for t in TARGETS if t.graph} == {"fa2/prefill-graph", "fa3/prefill-graph", "fa2/decode-graph",
                                                   "fa2/decode-tc-graph", "fa3/decode-graph"}
    # fa3's decode targets run its prefill modules (no fa3 decode module), always on tensor cores
    assert {(t.name, t.module_kind, t.tensor_cores) for t in TARGETS if t.backend == "fa3" and t.kind == "decode"} == {
        ("fa3/decode", "prefill", True), ("fa3/decode-graph", "prefill", True)}


def test_list_modules_commands_are_the_matrix(capsys):
    """The printed precompile commands expand (dry run) to exactly the matrix plus the planner
    modules, under the ~72 modules a build box precompiles for the fuzzer; every kind gets head
    dims 64, 128 and 256."""
    assert fuzz_gpu.main(["--list-modules"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python -m variantgen")]
    uris = []
    for line in lines:
        args = line.split()[3:] + ["--dry-run"]
        res = CliRunner().invoke(cli_main, args)
        assert res.exit_code == 0, (line, res.output)
        uris += [u for u in res.output.splitlines() if u.startswith("vg_")]
    matrix = {(b, k, m) for (b, k), ms in fuzz_gpu.MODULES.items() for m in ms}
    kernels = [u for u in uris if not u.endswith("_planner_sm90a")]
    planners = set(uris) - set(kernels)  # each command adds its specs' planner modules (built once)
    assert len(kernels) == len(set(kernels)) == len(matrix) == 61
    assert planners == {f"vg_{m.spec}_planner_sm90a" for (_, kind), ms in fuzz_gpu.MODULES.items() for m in ms
                        if kind in ("prefill", "decode")}
    assert len(set(uris)) <= 72
    for (backend, kind), ms in fuzz_gpu.MODULES.items():
        assert {64, 128, 256} <= {m.head_dim_qk for m in ms}, (backend, kind)
    assert fuzz_gpu.main(["--list-modules", "table"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1 + len(matrix)
    assert fuzz_gpu.main(["--list-modules", "args"]) == 0  # what scripts/precompile_gpu_tests.sh fuzz reads
    args = capsys.readouterr().out.strip().splitlines()
    assert [f"python -m variantgen precompile {a} --arch 9.0a -j 8" for a in args] == lines


def test_specs_option_takes_the_collections_masks(capsys):
    """--specs names a mask of bench/masks/ as its help says; the CLI used to refuse every such name
    (only the API took them) and --list-modules left their modules out."""
    assert "global_window" in fuzz_gpu.COLLECTION and "global_window" not in fuzz_gpu.SPECS
    assert fuzz_gpu.main(["--list-modules", "args", "--targets", "fa2/prefill,fa2/decode",
                          "--specs", "global_window,streaming_sink"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    prefill = [line for line in lines if "--kind prefill" in line]
    assert len(prefill) == 1 and "bench/masks/global_window.yaml" in prefill[0]
    assert "specs/streaming_sink.yaml" in prefill[0]
    assert all("global_window" not in line for line in lines if "--kind decode" in line)  # decode modules: shipped only
    with pytest.raises(SystemExit):
        fuzz_gpu.main(["--specs", "no_such_mask", "--list-modules"])
    assert "no_such_mask" in capsys.readouterr().err


def test_cases_round_trip_through_json_and_their_literal():
    for case in drawn(6, seed=1):
        assert from_json(json.loads(json.dumps(to_json(case)))) == case
        assert eval(case_literal(case), vars(fuzz_cases)) == case  # noqa: S307 - our own repr


def test_drawn_cases_cover_the_edges_the_fuzzer_promises():
    """Over many draws: every page size and GQA group, windows none / 0 / 1 / small / large,
    chunked prefill, spans crossing the chunk start, empty and future-only per-row ranges,
    documents of length 1, unsorted document ids, prefix lengths at the chunk start."""
    r = random.Random(7)
    t = TARGET_BY_NAME["fa2/prefill"]
    seen: dict[str, set] = {k: set() for k in ("page", "group", "window", "plan")}
    flags = set()
    for _ in range(600):
        m = ModuleKey(r.choice(["mm_prefix", "document", "prefix_lm", "sliding_window"]))
        c = draw_case(r, t, m, limits=Limits())
        b, s = c.batch, dict(c.scalars)
        seen["page"].add(c.page_size)
        seen["group"].add(c.num_qo_heads // c.num_kv_heads)
        seen["plan"].add(c.plan)
        for name in ("window", "causal_window_left"):
            if name in s:
                w = s[name]
                seen["window"].add("none" if w < 0 else w if w <= 1 else "small" if w <= 16 else "large")
        if any(k > q for q, k in zip(b.qo_lens, b.kv_lens)):
            flags.add("chunked")
        for _, arg in b.tensors:
            if isinstance(arg, Ranges):
                for q, k, spans, rows in zip(b.qo_lens, b.kv_lens, arg.spans, arg.rows):
                    if any(s0 < k - q <= e0 for s0, e0 in spans):
                        flags.add("span across the chunk start")
                    if any(s0 > e0 for *_, s0, e0 in rows):
                        flags.add("empty range")
                    if any(s0 > k - q + last for _, last, s0, _e in rows):
                        flags.add("future-only range")
            elif isinstance(arg, DocRuns):
                for k, runs in zip(b.kv_lens, arg.runs):
                    starts = [s0 for s0, _ in runs] + [k]
                    if any(b2 - a2 == 1 for a2, b2 in zip(starts, starts[1:])):
                        flags.add("document of length 1")
                    ids = [i for _, i in runs]
                    if ids != sorted(ids):
                        flags.add("unsorted ids")
            elif isinstance(arg, PerRequest):
                if any(v == k - q and k > q for v, q, k in zip(arg.values, b.qo_lens, b.kv_lens)):
                    flags.add("prefix at the chunk start")
    assert seen["page"] == {1, 5, 16, 64} and seen["group"] == {1, 2, 4, 8, 16}
    assert seen["window"] == {"none", 0, 1, "small", "large"} and seen["plan"] == {"off", "module", "nomodule"}
    assert flags == {"chunked", "span across the chunk start", "empty range", "future-only range",
                     "document of length 1", "unsorted ids", "prefix at the chunk start"}


def test_shrink_candidates_are_valid_and_smaller():
    for case in drawn(4, seed=2):
        target = TARGET_BY_NAME[case.target]
        size = case_size(case)
        for cand in shrink_candidates(case):
            assert cand != case
            for b in [cand.batch] + ([cand.graph.capture] if cand.graph else []):
                n = len(b.qo_lens)
                assert n >= 1 and len(b.kv_lens) == n and sum(b.qo_lens) >= 1
                assert all(0 <= q <= k for q, k in zip(b.qo_lens, b.kv_lens))
                if target.kind == "decode":  # the same query count T per request (T > 1: tensor cores only)
                    (q_len,) = set(b.qo_lens)
                    assert q_len >= 1 and min(b.kv_lens) >= q_len and (q_len == 1 or target.tensor_cores)
                for _, arg in b.tensors:
                    per = {Ranges: lambda a: (a.spans, a.rows), DocRuns: lambda a: (a.runs,),
                           PerRequest: lambda a: (a.values,)}.get(type(arg))
                    assert per is None or all(len(x) == n for x in per(arg))
                if cand.graph and target.kind == "decode" and not target.tensor_cores:
                    assert n == cand.graph.max_batch_size  # CUDA-core graph decode plans exactly that many
            assert cand.num_qo_heads % cand.num_kv_heads == 0
            assert all(a <= b for a, b in zip(case_size(cand), size)) or cand.graph != case.graph


def test_tensors_poison_what_no_request_owns():
    case = FuzzCase("fa2/prefill", ModuleKey("causal", 64, 64), Batch((3, 2), (21, 2), (), 11), 4, 2, 5)
    t = make_tensors(case, case.batch, torch.device("cpu"))
    pages = t.kv_indices.tolist()
    assert t.kv_indptr.tolist() == [0, 5, 6] and t.last_page_len.tolist() == [1, 2]
    assert len(set(pages)) == 6 and t.k.shape[0] >= 6 and t.k.shape[1:] == (5, 2, 64)
    owned = torch.zeros(t.k.shape[:2], dtype=torch.bool)
    for lo, hi, last in ((0, 5, 1), (5, 6, 2)):
        for j, p in enumerate(pages[lo:hi]):
            owned[p, :last if j == hi - lo - 1 else 5] = True
    assert (t.k[~owned].float() == POISON_K).all() and (t.v[~owned].float() == POISON_V).all()
    assert (t.k[owned].float().abs() < POISON_K).all()


def test_compare_names_what_went_wrong():
    ref = torch.randn(6, 2, 8)
    lse = torch.randn(6, 2)
    assert compare(ref.to(torch.bfloat16), ref, "bf16", lse, lse).ok
    out = ref.clone()
    out[2] = SENTINEL
    assert compare(out, ref, "bf16").kind == "unwritten"
    out = ref.clone()
    out[1, 0, 3] = math.nan
    assert compare(out, ref, "bf16").kind == "nan"
    out = ref.clone()
    out[4] += 0.5
    v = compare(out, ref, "bf16")
    assert v.kind == "mismatch" and v.bad_rows == 1 and v.max_abs_err == pytest.approx(0.5, rel=1e-3)
    bad_lse = lse.clone()
    bad_lse[0, 1] = -math.inf
    assert compare(ref, ref, "fp16", bad_lse, lse).kind == "lse"
    assert compare(ref, ref, "fp16", rows_past_written=3).kind == "rows_past_batch"
    zeros = torch.zeros(3, 2, 8)  # rows with no visible key: exact zeros pass, anything else fails
    assert compare(zeros, zeros, "bf16").ok and not compare(zeros + 0.1, zeros, "bf16").ok


def test_flashinfer_calls_have_the_cases_mask():
    """Where FlashInfer has a case's mask, the call carries its window and cap; most such cases
    fall on a FlashInfer module of the comparison matrix."""
    calls, in_matrix = 0, 0
    for case in drawn(40, seed=3):
        call = fuzz_gpu.flashinfer_call(case)
        m = case.module
        if call is None:
            continue
        calls += 1
        in_matrix += call.key in fuzz_gpu.FI_BY_KEY
        assert (m.head_dim_qk, m.q_dtype, m.kv_dtype) == (128, "bf16", "bf16") and m.spec != "alibi"
        assert case.scales == (None, None, None) and 0 not in case.batch.kv_lens
        s = dict(case.scalars)
        if m.spec in ("sliding_window", "softcap"):
            assert call.window_left == max(s["window"], -1)
        assert call.soft_cap == (s["soft_cap"] if m.spec == "softcap" else None)
        assert call.api == ("mm_prefix" if m.spec == "mm_prefix" else TARGET_BY_NAME[case.target].kind)
    assert calls > 20 and in_matrix > calls // 2
    assert len(fuzz_gpu.FI_BY_KEY) == len(fuzz_gpu.FI_ENTRIES)
    alibi = FuzzCase("fa2/prefill", ModuleKey("alibi"), Batch((4,), (9,), (("slopes", PerHead()),), 0), 4, 2, 16)
    assert fuzz_gpu.flashinfer_call(alibi) is None
    sink = FuzzCase("fa2/decode", ModuleKey("streaming_sink"), Batch((1,), (9,), (), 0), 4, 2, 16,
                    scalars=(("num_sink", 0), ("window", 5)))
    assert fuzz_gpu.flashinfer_call(sink) == fuzz_gpu.FiCall("decode", "fa2", 5, None)


# ----------------------------------------------------------------------------- the harness end to end


def capacity_skips(results: dict) -> int:
    return sum(t["skip_reasons"].get("batch past the CUDA-graph capacity", 0) for t in results["targets"].values())


def test_fuzz_run_on_the_fakes_writes_its_json():
    """A few dozen cases over every target through the fakes: all pass, the JSON has the counts
    per target and spec, and a module reported missing is skipped and counted, never run."""
    gone = ("fa2", "decode", ModuleKey("mm_prefix"))
    modules = FakeModules(missing=[gone])
    specs = ("causal", "mm_prefix")  # (half the decode draws hit the missing module)
    results = fuzz_gpu.run_fuzz(config(max_cases=64, seed=5, specs=specs), modules, log=quiet)
    json.dumps(results)
    assert results["cases"] + capacity_skips(results) == 64
    assert results["failed"] == 0 and results["failures"] == []
    for name, t in results["targets"].items():
        assert t["cases"] > 0, name
        assert t["passed"] + t["failed"] == t["cases"]
        assert sum(s["cases"] for s in t["specs"].values()) == t["cases"]
        assert sum(s["skipped"] for s in t["specs"].values()) == t["skipped"]
        assert t["max_abs_err"] < 0.1 and sum(t["coverage"]["plan"].values()) == t["cases"]
        if t["graph"]:
            assert sum(t["coverage"]["graph"].values()) == t["cases"]
    assert results["modules"]["missing"] == [{"backend": "fa2", "kind": "decode", "module": "mm_prefix hd128 bf16",
                                              "reason": modules.missing(TARGET_BY_NAME["fa2/decode"], gone[2])}]
    decode = [results["targets"][n] for n in ("fa2/decode", "fa2/decode-graph")]
    skips = sum(t["specs"].get("mm_prefix", {}).get("skipped", 0) for t in decode)
    assert skips > 0 and skips == sum(t["skip_reasons"].get("module not available", 0) for t in decode)
    assert all(t["specs"].get("mm_prefix", {}).get("cases", 0) == 0 for t in decode)
    assert not any(type(f).__name__ == "FakeDecodeModule" and f.spec.name == "mm_prefix" for f in modules.made)


def test_the_fuzzer_runs_the_collections_sparse_and_multi_interval_masks():
    """--specs takes the benchmarks' masks too (bench/masks/): global tokens (their flags drawn
    sparse), BigBird's random blocks, fixed sparse summary keys and sinks + a bidirectional window,
    on the paged prefill targets through the fakes: all pass, and page lists ran."""
    specs = ("global_window", "bigbird", "fixed_sparse", "sinks_bidirectional")
    modules = FakeModules()
    results = fuzz_gpu.run_fuzz(config(max_cases=48, seed=11, specs=specs, targets=("fa2/prefill", "fa3/prefill")),
                                modules, log=quiet)
    assert results["failed"] == 0 and results["failures"] == [], results["failures"][:1]
    for name in ("fa2/prefill", "fa3/prefill"):
        assert set(results["targets"][name]["specs"]) == set(specs), results["targets"][name]["specs"].keys()
    listed = [c for f in modules.made for c in getattr(f, "run_calls", []) if c.mask_mode == "listed"]
    assert listed, "no launch request ran through a page list"
    flags = shipped_spec("global_window").tensors[0]
    assert flags.name == "is_global"


def test_the_fuzzer_runs_rewritten_forms():
    """The rewritten forms of bench/masks/forms/ (bench/make_forms.py) as kernels of their own:
    the kernel evaluates the form as written, the planner plans its normalized tree; through the
    fakes on the paged prefill targets, in eager and CUDA-graph mode: all pass."""
    specs = tuple(p.stem for p in sorted((Path(fuzz_gpu.REPO) / "bench" / "masks" / "forms").glob("*.yaml")))
    assert len(specs) >= 6 and set(specs) <= set(fuzz_gpu.COLLECTION)
    modules = FakeModules()
    results = fuzz_gpu.run_fuzz(config(max_cases=48, seed=12, specs=specs,
                                       targets=("fa2/prefill", "fa3/prefill", "fa3/prefill-graph")), modules, log=quiet)
    assert results["failed"] == 0 and results["failures"] == [], results["failures"][:1]
    ran = {s for t in results["targets"].values() for s, v in t["specs"].items() if v.get("cases", 0)}
    assert len(ran) >= 4, ran


def test_main_fake_mode_writes_results_with_the_environment(tmp_path):
    """bench/fuzz_gpu.py --fake: the results file has the run's seed, commit and versions."""
    out = tmp_path / "fuzz.json"
    rc = fuzz_gpu.main(["--fake", "--seconds", "600", "--max-cases", "16", "--seed", "9", "--targets",
                        "fa2/decode,fa2/ragged", "--specs", "causal,document", "--out", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())
    for key in ("seed", "commit", "date", "gpu", "torch", "flashinfer", "variantgen", "targets", "failures"):
        assert key in results, key
    assert results["seed"] == 9 and results["cases"] == 16 and set(results["targets"]) == {"fa2/decode",
                                                                                            "fa2/ragged"}
    assert set(results["targets"]["fa2/ragged"]["specs"]) <= {"causal", "document"}


class DroppingRow(FakeModule):
    """A planted bug: the last row of every launch request of 5 or more rows stays unwritten."""

    def paged_run(self, *a):
        out, before = a[10], a[10].clone()
        super().paged_run(*a)
        for row in a[16 + len(self.spec.tensors)].tolist():
            if row[8] >= 5:
                out[row[0] + row[8] - 1] = before[row[0] + row[8] - 1]


class IgnoringWindow(FakeModule):
    """A planted bug: causal launches ignore the kernel window the planner gave their requests."""

    def paged_run(self, *a):
        a = list(a)
        at = 16 + len(self.spec.tensors)
        meta = a[at].clone()
        meta[:, 7] = -1
        a[at] = meta
        super().paged_run(*a)


class RacingRow(FakeModule):
    """A planted race: every second launch writes the first row of its first launch request one
    higher (the causal spec's fa2 plans are one launch per run(), planned or not)."""

    launches = 0

    def paged_run(self, *a):
        super().paged_run(*a)
        self.launches += 1
        if self.launches % 2 == 0:
            first_row = int(a[16 + len(self.spec.tensors)][0, 0])
            if first_row < a[10].shape[0]:
                a[10][first_row] += 1


def planted_failure(fake: type, specs: tuple[str, ...], kind: str, seed: int, target: str = "fa2/prefill") -> dict:
    modules = FakeModules({("fa2", "prefill"): fake})
    results = fuzz_gpu.run_fuzz(config(max_cases=40, seed=seed, targets=(target,), specs=specs), modules, log=quiet)
    assert results["failed"] > 0, f"the planted {fake.__name__} was not found"
    found = [f for f in results["failures"] if f["verdict"]["kind"] == kind and f["minimized"]]
    assert found, [f["verdict"] for f in results["failures"]]
    return found[0]


def check_minimized(f: dict, fake: type) -> FuzzCase:
    """The minimized case is smaller, still fails on the planted bug, passes without it, and its
    regression test is valid Python naming that very case."""
    original, small = from_json(f["case"]), from_json(f["minimized"]["case"])
    assert f["minimized"]["reproduced"] and f["minimized"]["accepted"] >= 1
    assert case_size(small) <= case_size(original) and small != original
    assert len(small.batch.qo_lens) == 1, small.label()
    assert CaseRunner(FakeModules({("fa2", "prefill"): fake})).run(small).verdict.signature == \
        f["minimized"]["verdict"]["kind"]
    assert CaseRunner(FakeModules()).run(small).verdict.ok
    text = f["regression_test"]
    namespace: dict = {}
    exec(compile(text, "regression_test", "exec"), namespace)  # noqa: S102 - the text we generated
    assert text.startswith(f"def test_fuzz_{small.target.replace('/', '_').replace('-', '_')}_")
    assert "assert_case_passes(case, workspace)" in text
    literal = text.split("    case = ", 1)[1].rsplit("\n    assert_case_passes", 1)[0]
    assert eval(literal, vars(fuzz_cases)) == small  # noqa: S307
    assert max(len(line) for line in text.splitlines()) <= 120
    return small


def test_planted_dropped_row_is_found_and_minimized():
    f = planted_failure(DroppingRow, ("causal", "prefix_lm"), "unwritten", seed=11)
    small = check_minimized(f, DroppingRow)
    assert 5 <= small.batch.qo_lens[0] <= 8, small.label()


def test_a_planted_race_is_found_as_a_second_run_that_differs():
    """Each case runs its plan twice: output that passes the reference once and differs the second
    time is 'nondeterministic' (the fa3 output-store race of 2026-12-04 first showed as a mismatch
    the minimizer could not reproduce)."""
    f = planted_failure(RacingRow, ("causal",), "nondeterministic", seed=13)
    assert "rows differ between two runs of one plan" in f["verdict"]["message"]
    check_minimized(f, RacingRow)


@pytest.mark.parametrize("target", ["fa2/prefill", "fa2/prefill-graph"])
def test_planted_ignored_window_is_found_and_minimized(target):
    """In graph mode the replayed batch and the capture batch both shrink."""
    f = planted_failure(IgnoringWindow, ("sliding_window",), "mismatch", seed=12, target=target)
    small = check_minimized(f, IgnoringWindow)
    assert small.plan == "module", "the kernel window exists only in planned causal launches"
    assert 0 <= dict(small.scalars)["window"] < small.batch.kv_lens[0] - 1
    if small.graph is not None:
        original = from_json(f["case"])
        assert sum(small.graph.capture.kv_lens) <= sum(original.graph.capture.kv_lens)


class LosingTheContext(FakeModule):
    def paged_run(self, *a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_lost_cuda_context_stops_the_run():
    modules = FakeModules({("fa2", "prefill"): LosingTheContext})
    results = fuzz_gpu.run_fuzz(config(max_cases=30, targets=("fa2/prefill", "fa2/decode")), modules, log=quiet)
    assert results["fatal"] and "illegal memory access" in results["fatal"]
    assert results["failed"] == 1 and results["failures"][0]["minimized"] is None
    assert "def test_fuzz_fa2_prefill" in results["failures"][0]["regression_test"]


@pytest.mark.parametrize("change, message", [
    (dict(target="fa4/prefill"), r"target='fa4/prefill': expected one of \['fa2/prefill'"),
    (dict(plan="trim"), r"plan='trim': target fa2/prefill plans with one of \['off', 'module', 'nomodule'\]"),
    (dict(num_qo_heads=6, num_kv_heads=4), r"num_qo_heads=6, num_kv_heads=4: expected whole GQA groups"),
    (dict(batch=Batch((3,), (2,), (), 0)), r"batch: qo_lens=\[3\], kv_lens=\[2\]: expected 0 <= qo_len <= kv_len"),
    (dict(target="fa2/decode", plan="off"), r"batch: .*decode has one query per request"),
    (dict(target="fa2/prefill-graph"), r"graph: target fa2/prefill-graph needs GraphSetup"),
    (dict(batch=Batch((3, 1), (9, 4), (("ranges", Ranges(((),), ((),))),), 0)),
     r"batch: tensor ranges: Ranges.spans has 1 entries for 2 requests"),
])
def test_a_case_that_could_not_be_drawn_is_refused_by_name(change, message):
    base = dict(target="fa2/prefill", module=ModuleKey("mm_prefix"), batch=Batch((3,), (9,), (), 0),
                num_qo_heads=4, num_kv_heads=2, page_size=16, plan="module")
    with pytest.raises(ValueError, match=r"^FuzzCase: " + message):
        FuzzCase(**{**base, **change})


def test_spec_tensors_must_be_the_specs():
    case = FuzzCase("fa2/prefill", ModuleKey("document"), Batch((3,), (9,), (), 0), 4, 2, 16)
    with pytest.raises(ValueError, match=r"batch.tensors names \[\], spec `document` has tensors \['doc_ids'\]"):
        make_tensors(case, case.batch, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"unknown type 'Case'"):
        from_json({"type": "Case"})


class Interrupting(FakeModule):
    """Ctrl-C (or the SIGTERM main() turns into it) in the middle of the ninth launch (each case
    runs its plan twice)."""

    calls = 0

    def paged_run(self, *a):
        Interrupting.calls += 1
        if Interrupting.calls == 9:
            raise KeyboardInterrupt
        super().paged_run(*a)


def test_an_interrupted_run_keeps_what_it_found():
    seen = []
    results = fuzz_gpu.run_fuzz(config(max_cases=40, targets=("fa2/prefill",), specs=("causal",)),
                                FakeModules({("fa2", "prefill"): Interrupting}), log=quiet, checkpoint=seen.append)
    assert results["interrupted"] and not results["minimized"] and 3 <= results["cases"] < 40
    assert len(seen) == 1 and seen[0]["cases"] == results["cases"]


# ----------------------------------------------------------------------------- isolation cases (--poison)


class LeakingValues(FakeModule):
    """A planted leak: every row of the batch meets every value of the cache (0 x NaN = NaN), as
    a kernel whose tiles straddle two requests would."""

    def paged_run(self, *a):
        super().paged_run(*a)
        a[10].add_(0 * a[5].float().sum().to(a[10].dtype))


def test_poisoned_cases_keep_every_other_request_finite_on_every_fake_target():
    """--poison: NaN / inf in one request's K and V; on every target (the fa2/fa3 prefill, decode and
    ragged fakes, graph replays too) the other requests' rows match the reference, while the
    poisoned request's reference rows do hold the NaN / inf."""
    r = random.Random(5)
    runner = CaseRunner(FakeModules())
    poisoned = set()
    for target in TARGETS:
        for _ in range(3):
            m = r.choice(fuzz_gpu.modules_of(target, ("causal", "sliding_window", "document")))
            case = draw_case(r, target, m, limits=LIMITS, poison=("nan", "inf"))
            if len(case.batch.qo_lens) < 2:
                continue
            assert case.poison in ("nan", "inf") and from_json(to_json(case)) == case
            t = make_tensors(case, case.batch, torch.device("cpu"))
            ref = fuzz_tensors.reference(case, t)[0]
            keep = compared_rows(case)
            held = not torch.isfinite(t.v.float()).all()  # (fp8 e4m3 has no inf: torch stores 448)
            if held and (~keep).any():
                assert not torch.isfinite(ref[~keep]).all(), case.label()  # the poison is there
            assert torch.isfinite(ref[keep]).all(), case.label()
            v = runner.run(case).verdict
            assert v.ok, f"{case.label()} poison={case.poison}: {v.kind}: {v.message}"
            poisoned.add((target.name, case.poison))
    assert {t for t, _ in poisoned} == {t.name for t in TARGETS}
    assert {p for _, p in poisoned} == {"nan", "inf"}


def test_a_value_leaking_across_requests_is_found():
    case = FuzzCase("fa2/prefill", ModuleKey("causal"), Batch((5, 1, 7), (9, 6, 20), (), seed=3), 4, 2, 4,
                    poison="nan")
    assert CaseRunner(FakeModules()).run(case).verdict.ok
    v = CaseRunner(FakeModules({("fa2", "prefill"): LeakingValues})).run(case).verdict
    assert v.kind == "nan" and "12 of 12 rows" in v.message, v.message  # (requests 0 and 2: request 1 is poisoned)
    assert CaseRunner(FakeModules({("fa2", "prefill"): LeakingValues})).run(
        dataclasses.replace(case, poison="")).verdict.ok  # (no poison, nothing to leak)


def test_the_poisoned_request_has_requests_on_both_sides():
    """The fuzzer poisons the middle request with keys: a kernel reading past a request's end (into
    the next one's first keys) or before its start meets the poison from a request compared."""
    assert fuzz_tensors.poisoned_request(Batch((1, 1, 1), (4, 5, 6), (), seed=0)) == 1
    assert fuzz_tensors.poisoned_request(Batch((1, 1), (4, 5), (), seed=0)) == 1
    assert fuzz_tensors.poisoned_request(Batch((1, 1, 1, 1), (0, 5, 0, 6), (), seed=0)) == 3
    assert fuzz_tensors.poisoned_request(Batch((1,), (0,), (), seed=0)) == 0


def test_the_fa3_ragged_over_read_is_found_without_the_gap(monkeypatch):
    """The fa3 ragged fake loads whole KV tiles past a request's end, as FlashInfer's sm90 kernel
    does: with run()'s zero gap between requests taken away, the fuzzer's poisoned cases find the
    leak (the GPU's finding, which the fuzzer missed while it poisoned the first request)."""
    from variantgen.abi import table as plan_abi
    from variantgen.wrappers import ragged

    r = random.Random(11)
    target = TARGET_BY_NAME["fa3/ragged"]
    cases = []
    while len(cases) < 12:
        case = draw_case(r, target, ModuleKey("causal"), limits=LIMITS, poison=("nan",))
        if len([n for n in case.batch.kv_lens if n]) >= 2:
            cases.append(case)
    assert all(CaseRunner(FakeModules()).run(c).verdict.ok for c in cases)
    monkeypatch.setattr(plan_abi, "RAGGED_KV_GAP", 0)
    monkeypatch.setattr(ragged, "RAGGED_KV_GAP", 0)
    verdicts = [CaseRunner(FakeModules()).run(c).verdict for c in cases]
    assert any(v.kind == "nan" for v in verdicts), [v.kind for v in verdicts]


def test_compare_requires_the_reference_nan_positions():
    ref = torch.tensor([[1.0, math.nan], [2.0, 3.0]])
    assert compare(ref.clone(), ref, "bf16").ok
    v = compare(torch.tensor([[1.0, 0.0], [2.0, 3.0]]), ref, "bf16")  # a NaN in, a number out
    assert v.kind == "nan" and v.message.startswith("1 of 2 rows"), v.message


def test_main_fake_mode_runs_isolation_cases(tmp_path):
    out = tmp_path / "fuzz.json"
    rc = fuzz_gpu.main(["--fake", "--seconds", "600", "--max-cases", "12", "--seed", "4", "--targets",
                        "fa2/prefill,fa2/ragged", "--specs", "causal", "--poison", "nan,inf", "--out", str(out)])
    results = json.loads(out.read_text())
    assert rc == 0 and results["cases"] == 12 and not results["failures"]
    counted = sum(sum(t["coverage"].get("poison", {}).values()) for t in results["targets"].values())
    assert counted > 0
    with pytest.raises(SystemExit):
        fuzz_gpu.main(["--fake", "--poison", "zero"])
