"""`variantgen explain` checks the spec's arguments as plan() and run() do: a grid of arguments
the kernels would refuse (a `positive: true` scalar at 0, a scalar below its min) is an error
naming the --arg, not a drawing; and no row prints an inverted interval."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import variantgen
from variantgen.core.errors import LaunchError
from variantgen.tools import explain as ex
from variantgen.tools.cli import main


def run(*args):
    return CliRunner().invoke(main, ["explain", *map(str, args)])


@pytest.mark.parametrize("spec, item, message", [
    ("chunked_local", "chunk_size=0", "--arg chunk_size=0: `chunk_size`: 0 is out of range: the spec allows > 0"),
    ("gemma4_sliding", "window=0", "--arg window=0: `window`: 0 is out of range: the spec allows > 0"),
    ("sliding_window", "window=-2", "--arg window=-2: `window`: -2 is out of range: the spec allows >= -1"),
])
def test_an_argument_plan_refuses_is_refused(spec, item, message):
    r = run(spec, "--qo", 4, "--arg", item)
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr == f"error: {message} (plan() and run() refuse it too)\n"
    # the same value, refused by plan() on the flex route
    variant = variantgen.resolve_spec(spec)
    name, value = item.split("=")
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    w = variantgen.make_wrapper(variant, ws, head_dim_qk=16, q_dtype="fp32", kv_dtype="fp32", backend="flex")
    i = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    args = {t: torch.full((4, 2), -1, dtype=torch.int32) for t in variant.tensor_names}
    with pytest.raises(LaunchError, match=message.split(": ", 1)[1]):
        w.plan(i(0, 4), i(0, 1), i(0), i(4), 2, 1, 16, **args, **{name: int(value)})


def test_explain_from_python_checks_given_args_too():
    spec = variantgen.resolve_spec("chunked_local")
    args = {"chunk_size": ex.ArgValue("chunk_size", 0, "given")}
    with pytest.raises(ValueError, match=r"^--arg chunk_size=0: `chunk_size`: 0 is out of range"):
        ex.explain(spec, 4, 4, args)


def test_a_valid_argument_is_still_drawn():
    r = run("chunked_local", "--qo", 4, "--arg", "chunk_size=2")
    assert r.exit_code == 0, r.output
    rows = [line.split()[2] for line in r.stdout.splitlines() if line.startswith("q_pos ")]
    assert rows == ["#...", "##..", "..#.", "..##"]


def test_an_inverted_interval_is_printed_as_no_key():
    spec = variantgen.resolve_spec("causal")
    e = ex.explain(spec, 2, 2, ex.resolve_args(spec, (), 2, 2, 1, 0))
    row = ex.RowInfo(1, 4, 3, False, False, "custom", 0, 0)
    text = ex._row_text(e, row)
    assert text.startswith("no key (empty)") and "[4, 3]" not in text
