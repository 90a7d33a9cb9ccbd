"""Equivalent forms on the GPU: the row kernel rendered from a normalized mask (variantgen/planning/normalize.py)
gives what the reference rules give, row for row, for the literature masks of bench/masks and their
equivalent forms (bench/masks/equivalent_forms.yml).
Run: pytest -m gpu tests/gpu/test_gpu_forms.py"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from test_gpu_planner import BATCHES, batch_args, compare

import variantgen
from variantgen import parse_spec
from variantgen.planning.intervals import analyze

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
MASKS = sorted((ROOT / "bench" / "masks").glob("*.yaml"))
FORMS = yaml.safe_load((ROOT / "bench" / "masks" / "equivalent_forms.yml").read_text())


def cases():
    out = []
    for path in MASKS + sorted((ROOT / "specs").glob("*.yaml")):
        spec = variantgen.load_spec(path)
        texts = ([spec.mask_text] if "bench" in str(path) else []) + [str(t) for t in FORMS.get(spec.name, [])]
        out += [pytest.param(path, t, id=f"{spec.name}-{i}") for i, t in enumerate(texts)]
    return out


@pytest.mark.parametrize("path,text", cases())
def test_row_kernel_of_a_normalized_form_matches_the_torch_rules(path, text):
    data = yaml.safe_load(Path(path).read_text())
    data["mask"] = text
    spec = parse_spec(yaml.safe_dump(data, sort_keys=False), str(path))
    if not analyze(spec).planner_ready:
        pytest.skip(analyze(spec).reason)
    for i, (qo, kv, ps) in enumerate(BATCHES):
        args = batch_args(spec, qo, kv, ps, seed=i)
        compare(spec, args, qo, kv, ps, f"{spec.name} {text!r} batch {i}")
