"""The C++ helpers of the expression language (templates/common) against the torch reference.

The generated kernels evaluate ``//``, ``%``, ``bit(x, i)`` and clamped indices through the
device helpers; the reference and the planner's torch rules evaluate the same trees in int64.
Here the helpers are compiled for the host (``__device__`` defined away) and both sides are
run on the same ints - edge values and hypothesis-drawn ones, negative and out-of-range shift
counts included - so a divergence shows up on a CPU box, not as a wrong mask on a GPU.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from variantgen.codegen import render
from variantgen.lang import expr, nodes, parsing
from variantgen.lang.evaluate import Evaluator
from variantgen.lang.spec import parse_spec

CXX = shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (c++ or g++)")

DRIVER = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#define __device__
#define __forceinline__ inline
{helpers}
int main() {{
  char op[16];
  long long a, b, c;
  while (std::scanf("%15s %lld %lld %lld", op, &a, &b, &c) == 4) {{
    long long r = 0;
    if (!std::strcmp(op, "bit")) r = vg_bit(int32_t(a), int32_t(b));
    else if (!std::strcmp(op, "floordiv")) r = vg_floordiv(int32_t(a), int32_t(b));
    else if (!std::strcmp(op, "mod")) r = vg_mod(int32_t(a), int32_t(b));
    else if (!std::strcmp(op, "floordiv_by") || !std::strcmp(op, "mod_by")) {{  // (a scalar divisor)
      vg::vg_int_divisor d;
      d.set(int32_t(b));
      r = op[0] == 'f' ? vg_floordiv_by(int32_t(a), d) : vg_mod_by(int32_t(a), d);
    }}
    else if (!std::strcmp(op, "clamp")) r = vg_clamp(int64_t(a), int32_t(b));
    else if (!std::strcmp(op, "prow")) r = vg_packed_row(uint32_t(a), int32_t(b), (65535u + uint32_t(b)) / uint32_t(b));
    else if (!std::strcmp(op, "phead"))  // (head 7 when not packed)
      r = vg_packed_head(uint32_t(a), 7, int32_t(c), int32_t(b), (65535u + uint32_t(b)) / uint32_t(b));
    else return 2;
    std::printf("%lld\n", r);
  }}
  return 0;
}}
"""
INT32 = st.integers(min_value=nodes.INT32_MIN, max_value=nodes.INT32_MAX)
EDGES = [0, 1, -1, 2, -2, 31, 32, 33, -31, -32, -33, 63, 64, 7, -7, 2**31 - 1, -(2**31), 2**30, -(2**30),
         0x55555555, -0x55555556]


@pytest.fixture(scope="module")
def helpers_binary(tmp_path_factory):
    folder = tmp_path_factory.mktemp("helpers_cxx")
    helpers = render.environment().get_template("common/helpers.cuh.jinja").render()
    source = folder / "driver.cpp"
    source.write_text(DRIVER.format(helpers=helpers))
    binary = folder / "driver"
    subprocess.run([CXX, "-std=c++17", "-O1", "-o", str(binary), str(source)], check=True, capture_output=True,
                   timeout=120)
    return binary


def run_cxx(binary, op: str, pairs: list[tuple[int, int]]) -> list[int]:
    lines = "".join(f"{op} {a} {b} 0\n" for a, b in pairs)
    done = subprocess.run([str(binary)], input=lines, capture_output=True, text=True, check=True, timeout=60)
    return [int(x) for x in done.stdout.split()]


SPEC = parse_spec("name: h\nmask: bit(q_pos, kv_pos) or q_pos // kv_pos == q_pos % kv_pos\n")
TREES = {"bit": expr.parse_typed(parsing.SourceText("bit(q_pos, kv_pos)"), SPEC.type_env()),
         "floordiv": expr.parse_typed(parsing.SourceText("q_pos // kv_pos"), SPEC.type_env()),
         "mod": expr.parse_typed(parsing.SourceText("q_pos % kv_pos"), SPEC.type_env())}


def run_reference(op: str, pairs: list[tuple[int, int]]) -> list[int]:
    """The reference evaluator on the same tree codegen turns into the helper call."""
    a = torch.tensor([x for x, _ in pairs], dtype=torch.int64)
    b = torch.tensor([y for _, y in pairs], dtype=torch.int64)
    got = Evaluator(SPEC, {"q_pos": a, "kv_pos": b}, {}).ev(TREES[op])
    return [int(v) for v in got.to(torch.int64).tolist()]


# INT32_MIN // -1 is 2^31, outside the int range (the language's contract): the reference says
# 2^31 (int64), the kernel wraps to INT32_MIN. Every other pair must agree exactly.
OUT_OF_RANGE = {("floordiv", (nodes.INT32_MIN, -1)): nodes.INT32_MIN}


def check(binary, op: str, pairs: list[tuple[int, int]]) -> None:
    """``op`` in C++ against the reference; ``floordiv_by`` / ``mod_by`` (a launch-uniform divisor's
    multiply-shift helpers, vg_int_divisor) against the reference's // and %."""
    cxx, ref = run_cxx(binary, op, pairs), run_reference(op.removesuffix("_by"), pairs)
    op = op.removesuffix("_by")
    bad = [(p, c, r) for p, c, r in zip(pairs, cxx, ref) if c != OUT_OF_RANGE.get((op, p), r)]
    assert not bad, f"{op}: C++ and reference disagree on (x, y) -> (c++, reference): {bad[:10]}"


@pytest.mark.parametrize("op", ["bit", "floordiv", "mod", "floordiv_by", "mod_by"])
def test_helpers_agree_with_the_reference_on_edge_ints(helpers_binary, op):
    pairs = [(a, b) for a in EDGES for b in EDGES + list(range(-3, 40))]
    check(helpers_binary, op, pairs)


def test_division_by_minus_one_is_defined_at_int32_min(helpers_binary):
    """INT32_MIN / -1 traps on x86 and is undefined C++: the helpers special-case -1 (the mask
    of a spec dividing by a scalar that is -1 must not take a process down when run on a host)."""
    for suffix in ("", "_by"):
        assert run_cxx(helpers_binary, f"floordiv{suffix}", [(nodes.INT32_MIN, -1), (7, -1)]) == [nodes.INT32_MIN, -7]
        assert run_cxx(helpers_binary, f"mod{suffix}", [(nodes.INT32_MIN, -1), (7, -1)]) == [0, 0]


def test_clamp_agrees_with_the_reference_clamp(helpers_binary):
    """vg_clamp(i, extent) is the reference's i.clamp(0, extent - 1), for int64 offsets too."""
    idx = EDGES + [2**40, -(2**40), 2**33 + 5]
    pairs = [(i, n) for i in idx for n in (1, 2, 3, 64, 65536)]
    want = [min(max(i, 0), n - 1) for i, n in pairs]
    assert run_cxx(helpers_binary, "clamp", pairs) == want


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["bit", "floordiv", "mod", "floordiv_by", "mod_by"]),
       st.lists(st.tuples(INT32, st.one_of(INT32, st.integers(-70, 70))), min_size=1, max_size=200))
def test_helpers_agree_with_the_reference_fuzzed(helpers_binary, op, pairs):
    check(helpers_binary, op, pairs)


def test_gqa_packed_rows_and_heads(helpers_binary):
    """fa3's GQA packing maps kernel row r of a launch request packing g query heads per key/value
    head to query row r // g and head kv_head * g + r % g, for every row of a packed tile (at most
    192 rows, g <= 192); unpacked (g = 1) rows pass through whole, past 2^16 too (a long request's
    causal launch), and the head is the kernel's."""
    pairs = [(r, g) for g in (2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 48, 96, 192) for r in range(192)]
    assert run_cxx(helpers_binary, "prow", pairs) == [r // g for r, g in pairs]
    lines = "".join(f"phead {r} {g} {kv} \n" for r, g in pairs for kv in (0, 5))
    done = subprocess.run([str(helpers_binary)], input=lines, capture_output=True, text=True, check=True, timeout=60)
    assert [int(x) for x in done.stdout.split()] == [kv * g + r % g for r, g in pairs for kv in (0, 5)]
    big = [0, 1, 191, 65535, 65536, 100000, 2**31 - 1]
    assert run_cxx(helpers_binary, "prow", [(r, 1) for r in big]) == big
    assert run_cxx(helpers_binary, "phead", [(r, 1) for r in big]) == [7] * len(big)


BOUNDS_DRIVER = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#define __device__
#define __forceinline__ inline
{helpers}
int main() {{
  long long qp, w, kl;
  while (std::scanf("%lld %lld %lld", &qp, &w, &kl) == 3) {{
    const int32_t q_pos = int32_t(qp), req_kv_len = int32_t(kl);  // as the planner's row kernel
    const int32_t arg_w = int32_t(w);
    std::printf("%lld %lld\n", (long long)({lo}), (long long)({hi}));
  }}
  return 0;
}}
"""


def test_the_planners_bounds_do_not_wrap_at_int32(tmp_path):
    """The planner's bounds are the mask rewritten: |q_pos - kv_pos| <= w gives kv_pos <= q_pos + w,
    computed as -((-q_pos) + (-w)), which leaves the int32 range for w = INT32_MAX though the
    mask's own values do not. The row kernel computes them in int64, as the torch rules do (a
    wrapped bound emptied every row: no key attended)."""
    from variantgen.codegen import expressions as codegen
    from variantgen.planning.intervals import analyze

    spec = parse_spec("name: b\nscalars:\n  w: {dtype: int, default: 3, min: 0}\n"
                      "mask: q_pos - kv_pos <= w and kv_pos - q_pos <= w and kv_pos < kv_len\n")
    (term,) = analyze(spec).terms
    lo = " > ".join(f"({codegen.emit_row_expr(spec, x).code})" for x in term.lows[:1])
    hi = codegen.emit_row_expr(spec, term.highs[0]).code
    source = tmp_path / "bounds.cpp"
    helpers = render.environment().get_template("common/helpers.cuh.jinja").render()
    source.write_text(BOUNDS_DRIVER.format(helpers=helpers, lo=lo, hi=hi))
    binary = tmp_path / "bounds"
    subprocess.run([CXX, "-std=c++17", "-O0", "-fsanitize=signed-integer-overflow",
                    "-fno-sanitize-recover=all", "-o", str(binary), str(source)], check=True, capture_output=True,
                   timeout=120)
    cases = [(q, w, 9) for q in (0, 4, 7, 8) for w in (0, 3, nodes.INT32_MAX)]
    done = subprocess.run([str(binary)], input="".join(f"{q} {w} {k}\n" for q, w, k in cases), capture_output=True,
                          text=True, check=True, timeout=60)
    got = [tuple(int(v) for v in line.split()) for line in done.stdout.splitlines()]
    assert got == [(q - w, q + w) for q, w, _ in cases]
    assert "int64_t(q_pos)" in hi and "int64_t(arg_w)" in hi
