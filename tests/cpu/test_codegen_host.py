"""The generated C++ of every shipped spec's expressions, compiled for the host (g++) and run
over batches of random arguments, against the torch evaluator (tests/fakes/_host_expr.py).

The fake kernels evaluate masks in torch, never the generated code: an index codegen left
unclamped (`r[q_row, 2]` on a [total_q, 2] tensor) passed every other test.
"""

from __future__ import annotations

import random

import pytest
from _host_expr import CXX, build, mismatches, random_batch
from conftest import SPEC_FILES

from variantgen.codegen import expressions as codegen
from variantgen.lang import nodes
from variantgen.lang.spec import load_spec, parse_spec

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (g++ or c++)")


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_shipped_spec_expressions_agree_with_the_evaluator(tmp_path, path):
    spec = load_spec(path)
    binary = build(spec, tmp_path)
    rng = random.Random(path.stem)
    for round_ in range(4):
        batch = random_batch(spec, rng, defaults=round_ == 0)
        bad = mismatches(spec, binary, batch)
        assert not bad, f"{spec.name} (round {round_}):\n" + "\n".join(bad)


INDEXING = {
    "constant index at the last column": "r[q_row, 1] <= kv_pos",
    "constant index past the last column": "r[q_row, 2] <= kv_pos",
    "negative constant index": "r[q_row, -1] <= kv_pos",
    "computed column": "r[q_row, kv_pos % 3] <= kv_pos",
    "row before the request's first": "r[q_row - 2, 0] <= kv_pos",
    "row past the request's last": "r[q_row + 7, 1] >= kv_pos",
    "key row offsets": "d[kv_row - 1] == d[kv_row + 3] or d[q_kv_row + 1] == d[kv_row]",
    "head offsets": "hs[qo_head + 2] > 0.0 and kh[kv_head - 1] != kv_pos",
    "per request": "kv_pos <= max(q_pos, pl[request, 0] - 1) and pl[request, 1] != 0",
}
DECLS = ("tensors:\n  r: {dtype: int32, shape: [total_q, 2]}\n  d: {dtype: int32, shape: [total_kv]}\n"
         "  hs: {dtype: float32, shape: [num_qo_heads]}\n  kh: {dtype: int32, shape: [num_kv_heads]}\n"
         "  pl: {dtype: int32, shape: [batch, 2]}\n")


def _indexing_spec(mask: str):
    logits = "logits: logits + hs[qo_head - 1] * float(r[q_row, 5])\n"  # (a constant index past the end too)
    return parse_spec(f"name: idx\nmask: \"{mask}\"\n" + DECLS + logits)


@pytest.mark.parametrize("case", list(INDEXING))
def test_indexing_edge_cases_agree_with_the_evaluator(tmp_path, case):
    spec = _indexing_spec(INDEXING[case])
    binary = build(spec, tmp_path)
    rng = random.Random(case)
    for _ in range(3):
        batch = random_batch(spec, rng)
        batch.args["r"] = batch.args["r"].remainder(13) - 2  # key positions, mostly
        bad = mismatches(spec, binary, batch)
        assert not bad, f"{case}:\n" + "\n".join(bad)


def test_an_unclamped_constant_index_is_caught(tmp_path, monkeypatch):
    """The mutant of the issue: a constant index is emitted without its clamp even where it is
    past the dimension. The harness must see the out-of-row read."""
    original = codegen._Emitter._subscript

    def unclamped(self, dim, idx):
        if isinstance(dim, int) and isinstance(idx, nodes.Const):
            return self.emit(idx)
        return original(self, dim, idx)

    spec = _indexing_spec(INDEXING["constant index past the last column"])
    batch = random_batch(spec, random.Random(7))
    batch.args["r"] = batch.args["r"].remainder(13) - 2
    assert not mismatches(spec, build(spec, tmp_path), batch)
    monkeypatch.setattr(codegen._Emitter, "_subscript", unclamped)
    (tmp_path / "mutant").mkdir()
    assert mismatches(spec, build(spec, tmp_path / "mutant"), batch)


def test_a_wrong_offset_clamp_is_caught(tmp_path, monkeypatch):
    """A second mutant: offset rows clamped to the whole tensor instead of the request's rows."""
    spec = _indexing_spec(INDEXING["row past the request's last"])
    batch = random_batch(spec, random.Random(3))
    batch.args["r"] = batch.args["r"].remainder(13) - 2
    original = codegen._Emitter._subscript

    def whole_tensor(self, dim, idx):
        code = original(self, dim, idx)
        return code.replace("vg_request_row(", "vg_any_row(") if "vg_request_row(" in code else code

    monkeypatch.setattr(codegen._Emitter, "_subscript", whole_tensor)
    monkeypatch.setattr("_host_expr.PROGRAM", __import__("_host_expr").PROGRAM.replace(
        "struct Args {{", "inline int32_t vg_any_row(int32_t first, int64_t local, int32_t) {{ return int32_t(first + "
        "local); }}\nstruct Args {{"))
    assert mismatches(spec, build(spec, tmp_path), batch)
