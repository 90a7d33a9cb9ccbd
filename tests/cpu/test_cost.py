"""The cost before a GPU (variantgen/planning/cost.py): keys the planned launches read against keys the
mask shows. Keys visible are checked against the mask evaluated element by element, keys read
against what the launch requests of a real plan (the launch builder on the CPU, fake kernels)
visit, element by element (Plan.to_dense)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ALL_SPECS, SPECS_DIR
from test_plan import reference_masks
from test_wrapper_cpu import batch_of, make

import variantgen
from variantgen import parse_spec
from variantgen.planning.cost import BLOCK_ELEMENTS, batch_cost, plan_cost, visible_keys
from variantgen.planning.plan import NOT_VISITED
from variantgen.testing.harness import random_spec_args
from variantgen.wrappers.reference import RequestGrid, mask_for_request

MASKS = sorted((Path(__file__).resolve().parents[2] / "bench" / "masks").glob("*.yaml"))
QO, KV = [37, 1, 20, 64, 5], [37, 90, 61, 200, 5]  # full and chunked prefill, a single-token request


def dense_visible(spec, args, qo_lens, kv_lens) -> list[int]:
    out, row, kv_row = [], 0, 0
    for r, (q, k) in enumerate(zip(qo_lens, kv_lens)):
        grid = RequestGrid(r, q, k, row, kv_row, 1, 1, torch.device("cpu"))
        out += mask_for_request(spec, grid, args)[0].sum(1).tolist()
        row, kv_row = row + q, kv_row + k
    return out


@pytest.mark.parametrize("path", [SPECS_DIR / f"{n}.yaml" for n in ALL_SPECS] + MASKS, ids=lambda p: p.stem)
def test_visible_keys_are_the_masks_and_the_launches_read_them_all(path):
    spec = variantgen.load_spec(path)
    batch = batch_of(QO, KV, 4, seed=5)
    args = random_spec_args(spec, batch, seed=5)
    for s in spec.scalars:  # bite at these lengths
        if s.dtype == "int" and s.default not in (-1, 0):
            args[s.name] = max(1, min(int(s.default), 9))
    cost = batch_cost(spec, args, QO, KV, page_size=4)
    visible, _ = visible_keys(spec, args, QO, KV)
    assert visible.tolist() == dense_visible(spec, args, QO, KV)
    assert cost.keys_visible == sum(visible.tolist())
    assert cost.keys_visible <= cost.keys_read <= cost.keys_total == sum(q * k for q, k in zip(QO, KV))
    assert sum(c.keys_read for c in cost.by_class.values()) == cost.keys_read
    assert sum(c.keys_visible for c in cost.by_class.values()) == cost.keys_visible
    assert sum(c.rows for c in cost.by_class.values()) == cost.rows == sum(QO)


@pytest.mark.parametrize("spec_name", ["causal", "sliding_window", "streaming_sink", "mm_prefix", "document",
                                       "tree_verify", "chunked_local"])
def test_a_plans_cost_is_what_its_launches_visit(spec_name):
    spec = variantgen.load_spec(SPECS_DIR / f"{spec_name}.yaml")
    batch = batch_of(QO, KV, 4, seed=3)
    args = random_spec_args(spec, batch, seed=3)
    w, _ = make(spec, backend="fa2")
    plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
    cost = plan_cost(plan, spec, args)
    grids = plan.to_dense()
    assert cost.keys_read == plan.keys_read()["total"] == sum(int((g != NOT_VISITED).sum()) for g in grids)
    assert {k: v.keys_read for k, v in cost.by_class.items()} == {k: v for k, v in plan.keys_read().items()
                                                                  if k != "total"}
    assert cost.keys_visible == sum(int(m.sum()) for m in reference_masks(spec, batch, args))
    # the CPU planner (rowrules: the row kernel's reference) plans what plan() planned
    assert batch_cost(spec, args, QO, KV, page_size=4).keys_read == cost.keys_read
    off = w.plan(*batch.plan_args(), skip_tiles=False)
    off_cost = plan_cost(off, spec, args)
    assert off_cost.planner == "off" and off_cost.keys_read == off_cost.keys_total


def test_rows_the_planner_cannot_bound_are_counted_element_by_element_in_blocks(monkeypatch):
    spec = parse_spec("name: d\nmask: kv_pos <= q_pos and (q_pos - kv_pos) % 3 == 0\n")
    monkeypatch.setattr("variantgen.planning.cost.BLOCK_ELEMENTS", 64)  # many small blocks
    visible, hull_rows = visible_keys(spec, {}, [40, 7], [40, 300])
    assert hull_rows == 47
    assert visible.tolist() == dense_visible(spec, {}, [40, 7], [40, 300])
    assert BLOCK_ELEMENTS >= 1 << 20


def test_a_planner_off_mask_reads_every_key():
    spec = parse_spec("name: h\nmask: kv_pos <= q_pos + qo_head\n")
    cost = batch_cost(spec, {}, [16], [16])
    assert cost.planner == "off" and "head" in cost.reason
    assert cost.keys_read == 256 and cost.keys_visible == 136  # head 0: causal
    assert cost.to_json()["planner_off"] == cost.reason


def test_the_issues_masks_at_8192_tokens():
    """The planner's work per visible key, computed on the CPU, for the issue's examples:
    a bidirectional window (planner-off before its abs() form was normalized) and frame-causal video."""
    window = parse_spec("name: b\nscalars:\n  w: {dtype: int, default: 512, min: 0}\nmask: abs(q_pos - kv_pos) <= w\n")
    frames = parse_spec("name: f\nscalars:\n  f: {dtype: int, default: 256, positive: true}\n"
                        "mask: kv_pos // f <= q_pos // f\n")
    for spec in (window, frames):
        cost = batch_cost(spec, {}, [8192], [8192])
        assert cost.planner == "module" and cost.hull_rows == 0
        assert cost.keys_visible == sum(dense_visible(spec, {}, [8192], [8192])[::1])
        assert cost.ratio <= 1.15, (spec.name, cost.ratio)


@pytest.mark.parametrize("spec_name", ["streaming_sink"])
def test_rows_of_several_intervals_cost_their_pieces(spec_name):
    """Sinks + window past the first window: the planner runs each interval as its own launch request
    (pieces.py), so the keys read are about the keys shown, not the hull's (4.3x before pieces)."""
    spec = variantgen.load_spec(SPECS_DIR / f"{spec_name}.yaml")
    args = {s.name: s.default for s in spec.scalars}
    cost = batch_cost(spec, args, [8192], [8192])
    assert cost.planner == "module" and cost.ratio <= 1.15, cost
    assert sum(c.rows for c in cost.by_class.values()) == cost.rows == 8192  # a split row counts once
    assert "custom" not in cost.by_class  # the sinks run dense, the window as window launches
