"""The rewritten forms the differential fuzzer runs as kernels (bench/masks/forms/, written by
bench/make_forms.py): current with the script, the same mask as the spec they rewrite (element by
element on a small batch) and planned no worse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from variantgen.lang.spec import load_spec
from variantgen.planning.cost import batch_cost
from variantgen.planning.intervals import analyze
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.reference import RequestGrid, mask_for_request

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import make_forms  # noqa: E402

QO_LENS, KV_LENS = [5, 40, 1, 33], [5, 90, 61, 33]


def test_the_files_are_what_the_script_writes():
    assert make_forms.main(["--check"]) == 0, "run python bench/make_forms.py"
    assert sorted(p.name for p in make_forms.FORMS_DIR.glob("*.yaml")) == sorted(
        f"{Path(s).stem}_form.yaml" for s in make_forms.SOURCES)


def _masks(spec, args) -> list[torch.Tensor]:
    out, q_base, kv_base = [], 0, 0
    for b, (ql, kl) in enumerate(zip(QO_LENS, KV_LENS)):
        out.append(mask_for_request(spec, RequestGrid(b, ql, kl, q_base, kv_base, 1, 1, torch.device("cpu")), args))
        q_base += ql
        kv_base += kl
    return out


@pytest.mark.parametrize("source", make_forms.SOURCES)
def test_a_form_is_its_masks_equal_planned_no_worse(source):
    written = load_spec(ROOT / source)
    form = load_spec(make_forms.FORMS_DIR / f"{written.name}_form.yaml")
    assert form.mask_text != written.mask_text
    assert [s.name for s in form.scalars] == [s.name for s in written.scalars]
    assert [t.name for t in form.tensors] == [t.name for t in written.tensors]
    batch = random_paged_batch(QO_LENS, KV_LENS, num_qo_heads=1, num_kv_heads=1, head_dim=8, page_size=4, seed=0)
    for seed in range(3):
        args = random_spec_args(written, batch, seed=seed)
        for s in written.scalars:  # (windows that bite at these lengths)
            if s.dtype == "int" and s.name in ("window", "num_sink", "sinks"):
                args[s.name] = 6
        assert all(torch.equal(a, b) for a, b in zip(_masks(form, args), _masks(written, args))), seed
        assert analyze(form).planner_ready == analyze(written).planner_ready
        cost_form = batch_cost(form, args, QO_LENS, KV_LENS, page_size=4)
        cost_written = batch_cost(written, args, QO_LENS, KV_LENS, page_size=4)
        assert cost_form.keys_read <= cost_written.keys_read, (seed, cost_form.keys_read, cost_written.keys_read)
