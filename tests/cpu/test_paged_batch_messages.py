"""Paged prefill's batch messages, on every paged-prefill route's shared checks (the flex wrapper's
plan() and reference_attention here): an empty batch says a request is required (as decode and
ragged do), and a decreasing indptr is named with its values."""

from __future__ import annotations

import re

import pytest
import torch

import variantgen
from variantgen.core.errors import LaunchError
from variantgen.wrappers.reference import reference_attention


def ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture(scope="module")
def flex():
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    return variantgen.make_wrapper("causal", ws, head_dim_qk=16, q_dtype="fp32", kv_dtype="fp32", backend="flex")


CASES = [
    ("empty", (ints(0), ints(0), ints(), ints()),
     "empty batch: `qo_indptr` has 1 entry; expected at least one request (batch + 1 >= 2 entries)"),
    ("no entries", (ints(), ints(), ints(), ints()),
     "empty batch: `qo_indptr` has 0 entries; expected at least one request (batch + 1 >= 2 entries)"),
    ("kv decreasing", (ints(0, 2, 4), ints(0, 2, 1), ints(0, 1), ints(4, 4)),
     "`paged_kv_indptr` decreases at request 1 (paged_kv_indptr[1]=2, paged_kv_indptr[2]=1): indptrs must be "
     "non-decreasing"),
    ("qo decreasing", (ints(0, 3, 2), ints(0, 1, 2), ints(0, 1), ints(4, 4)),
     "`qo_indptr` decreases at request 1 (qo_indptr[1]=3, qo_indptr[2]=2): indptrs must be non-decreasing"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_names_the_batch_problem(flex, case):
    _, (qo, kvp, idx, last), message = case
    with pytest.raises(LaunchError, match=f"^{re.escape('plan(): ' + message)}$"):
        flex.plan(qo, kvp, idx, last, 2, 1, 4)


@pytest.mark.parametrize("case", CASES[2:], ids=[c[0] for c in CASES[2:]])
def test_the_reference_says_the_same(case):
    _, (qo, kvp, idx, last), message = case
    spec = variantgen.resolve_spec("causal")
    q = torch.zeros(max(int(qo.max()), 1), 2, 16)
    kv = torch.zeros(4, 2, 4, 1, 16)  # pages, k/v, page size, kv heads, head dim (NHD)
    with pytest.raises(LaunchError, match=f"^{re.escape('reference_attention(): ' + message)}$"):
        reference_attention(spec, q, kv, qo, kvp, idx, last, {})
