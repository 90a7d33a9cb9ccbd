"""Text from a spec file reaches messages escaped: a tensor's doc with control characters or a
lone surrogate used to reach LaunchError raw (a terminal escape, an unprintable message)."""

from __future__ import annotations

import pytest
import torch

from variantgen.core.errors import LaunchError, user_text
from variantgen.lang.spec import parse_spec
from variantgen.wrappers.checks import check_spec_args

SPEC = ('name: x\nmask: kv_pos <= q_pos + r[q_row, 0]\n'
        'tensors:\n  r: {dtype: int32, shape: [total_q, 2], doc: "red \\e[31m alarm\\a\\u2028next \\ud800 end"}\n')


def test_a_tensor_doc_reaches_launch_error_escaped():
    spec = parse_spec(SPEC)
    err = pytest.raises(LaunchError, check_spec_args, spec, {}, {"total_q": 4}, torch.device("cpu"),
                        where="run()").value
    text = str(err)
    assert "red \\x1b[31m alarm\\x07\\u2028next \\ud800 end" in text
    assert text.isprintable()
    text.encode("utf-8")  # no lone surrogate left to fail the encoder


def test_user_text_is_bounded_and_keeps_plain_text():
    assert user_text("inclusive key span [lo, hi]") == "inclusive key span [lo, hi]"
    long = user_text("a\tb" * 1000)
    assert len(long) < 260 and "\\t" in long and long.isprintable()
