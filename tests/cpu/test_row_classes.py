"""The row kernel's launch classes (templates/plan/row_classes.h) against their reference,
planning/rowrules.py's classify_intervals, on the CPU: the same C++ the row kernel runs per row,
called on the host through the planner module's ``classify_rows``. Rows come from the shipped
specs, the benchmarks' collection and random bands (rows whose keys reach past their position:
the causal and window classes with a shift), over random batches."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
from _builder import plan_builder
from conftest import ALL_SPECS, SPECS_DIR

import variantgen
from variantgen.abi.table import RecField, RowClass
from variantgen.planning.intervals import analyze, row_intervals
from variantgen.planning.rowrules import classify_intervals, row_env
from variantgen.testing.harness import random_paged_batch, random_spec_args

MASKS = Path(__file__).resolve().parents[2] / "bench" / "masks"
BANDS = ["abs(q_pos - kv_pos) <= {a}", "q_pos - {a} <= kv_pos and kv_pos <= q_pos + {b}",
         "kv_pos < {s} or (q_pos - {a} <= kv_pos and kv_pos <= q_pos + {b})",
         "q_pos < {s} or abs(kv_pos - q_pos) <= {a}", "kv_pos <= q_pos + {b}"]


@pytest.fixture(scope="module")
def module():
    return plan_builder()


@functools.cache
def band(i: int) -> variantgen.VariantSpec:
    rng = random.Random(i)
    text = BANDS[i % len(BANDS)].format(a=rng.randrange(0, 300), b=rng.randrange(0, 300), s=rng.randrange(0, 64))
    return variantgen.parse_spec(f"name: band_{i}\nmask: {text}\n")


def specs() -> list[tuple[str, variantgen.VariantSpec]]:
    out = [(p.stem, variantgen.load_spec(p)) for p in sorted(SPECS_DIR.glob("*.yaml")) if p.stem in ALL_SPECS]
    out += [(p.stem, variantgen.load_spec(p)) for p in sorted(MASKS.glob("*.yaml"))]
    return out + [(f"band_{i}", band(i)) for i in range(10)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name,spec", specs(), ids=[n for n, _ in specs()])
def test_the_row_kernels_classes_are_the_references(module, name, spec, page_size):
    form = analyze(spec)
    if not form.planner_ready:
        pytest.skip(f"{name}: planner off ({form.reason})")
    for seed in range(3):
        rng = random.Random(seed)
        kv_lens = [rng.choice([1, 37, 300, 700, 1500]) for _ in range(3)]
        qo_lens = [rng.choice([k, max(1, k // 3), 1]) for k in kv_lens]
        qo_indptr = [0]
        for q in qo_lens:
            qo_indptr.append(qo_indptr[-1] + q)
        batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=1, num_kv_heads=1, head_dim=8, page_size=1,
                                   seed=seed)
        args = random_spec_args(spec, batch, seed=seed)
        env = row_env(qo_indptr, kv_lens, torch.device("cpu"))
        iv = row_intervals(form, spec, env, args)
        rec = classify_intervals(env, iv, page_size)
        dense_hi = iv.dense_hi if iv.dense_hi is not None else torch.where(iv.exact, iv.hi, iv.lo - 1)
        rows = torch.stack([iv.lo, iv.hi, iv.exact.long(), dense_hi, env["request"], env["q_pos"], env["q_idx"],
                            env["qo_len"]], 1).contiguous()
        out = torch.empty(rows.shape[0], 4, dtype=torch.int64)
        module.classify_rows(rows, out, page_size)
        want = torch.stack([rec[RecField.STARTS], rec[RecField.CLASS], rec[RecField.PARAM_A]], 1)
        bad = (out[:, :3] != want).any(1).nonzero().squeeze(1)
        assert bad.numel() == 0, (name, seed, [(int(r), out[r].tolist(), want[r].tolist(), rows[r].tolist())
                                               for r in bad[:4]])


def test_a_band_runs_in_the_kernels_causal_and_window_classes(module):
    """A bidirectional band (keys up to q_pos + b) classifies as the causal class while its rows
    start at key 0, then as the window class (width a + b), each with its shift, on both sides."""
    spec = variantgen.parse_spec("name: band\nmask: q_pos - 100 <= kv_pos and kv_pos <= q_pos + 30\n")
    env = row_env([0, 600], [600], torch.device("cpu"))
    iv = row_intervals(analyze(spec), spec, env, {})
    rec = classify_intervals(env, iv, 1)
    cls = rec[RecField.CLASS]
    assert set(cls[:100].tolist()) == {RowClass.CAUSAL} and set(cls[101:569].tolist()) == {RowClass.WINDOW}
    assert set(rec[RecField.PARAM_A, 101:569].tolist()) == {130}
    assert set(cls[570:].tolist()) <= {RowClass.CUSTOM, RowClass.DENSE}  # keys clamped at the end: no diagonal
