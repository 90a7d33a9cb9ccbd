"""The FlashInfer routes (fa2 / fa3 paged prefill, decode on CUDA and tensor cores, ragged) run
inference kernels with no backward pass: run() with an input that requires grad is refused
with a LaunchError naming the argument and the flex route (on the fake modules)."""

from __future__ import annotations

import random

import pytest
import torch
from _fake_modules import FakeModules

from variantgen.core.errors import LaunchError
from variantgen.testing import fuzz_run
from variantgen.testing.fuzz_cases import TARGETS, ModuleKey
from variantgen.testing.fuzz_draw import Limits, draw_case
from variantgen.testing.fuzz_tensors import make_tensors

LIMITS = Limits(max_requests=2, max_qo_len=6, max_cached=10, max_decode_requests=2, max_decode_kv_len=20,
                groups=(1, 2), kv_heads=(1,), page_sizes=(4,))
EAGER = [t for t in TARGETS if not t.graph]


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def planned(target):
    case = draw_case(random.Random(1), target, ModuleKey("alibi"), limits=LIMITS)
    w = FakeModules().wrapper(target, case.module)
    t = make_tensors(case, case.batch, torch.device("cpu"))
    fuzz_run._plan(w, case, t, t.args)
    return case, w, t


@pytest.mark.parametrize("target", EAGER, ids=[t.name for t in EAGER])
def test_inputs_that_require_grad_are_refused_naming_them(target):
    case, w, t = planned(target)
    ragged = target.kind == "ragged"
    names = ("q", "k", "v") if ragged else ("q", "k_cache", "v_cache")
    for i, name in enumerate([*names, "slopes"]):
        q, k, v = t.q, t.k, t.v
        args = dict(t.args)
        if i < 3:
            q, k, v = [x.float().requires_grad_(True).to(x.dtype) if j == i else x for j, x in enumerate((q, k, v))]
        else:
            args["slopes"] = args["slopes"].clone().requires_grad_(True)
        with pytest.raises(LaunchError, match=rf"`{name}` requires grad.*flex route.*train"):
            w.run(q, k, v, **args) if ragged else w.run(q, (k, v), **args)
        with torch.no_grad():  # the same inputs where autograd records nothing: they run
            out = w.run(q, k, v, **args) if ragged else w.run(q, (k, v), **args)
        assert torch.isfinite(out.float()).all()
