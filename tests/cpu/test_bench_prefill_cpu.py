"""bench/bench_prefill.py's Flex rows on the CPU (dynamo with the eager backend): every mask of a
long list gets its row. Each mask_mod is a new code object, a recompile of the compiled
flex_attention; past dynamo's recompile limit torch ran Flex unfused, and on the H100 the ninth
mask's unfused Flex ran out of memory and took the rows after it along."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_prefill as bp  # noqa: E402


def _window_mask(width: int):
    # a distinct code object per mask, as the benchmark's masks are
    namespace: dict = {}
    exec(f"def mask(b, h, qi, ki):\n    return (ki <= qi) & (qi - ki <= {width})\n", namespace)
    return namespace["mask"]


def test_every_mask_gets_its_flex_row_past_dynamos_recompile_limit():
    limit = getattr(torch._dynamo.config, "recompile_limit", 8)
    masks = [(f"window{w}", _window_mask(w), None) for w in range(limit + 3)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
    rows, notes = {}, {}

    def record(name, fn):
        rows[name] = fn()

    bp.flex_rows(masks, q, k, v, record, notes, backend="eager")
    assert not [n for n in notes if n.endswith("_error")], notes
    assert sorted(rows) == sorted(f"flex_{name}" for name, _, _ in masks)
    # each row is its own mask's attention, not the first one compiled
    assert not torch.equal(rows["flex_window0"], rows[f"flex_window{limit + 2}"])
