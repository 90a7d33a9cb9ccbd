"""Argument names the generated C++ cannot carry (variantgen/lang/reserved.py): every name of the
table is refused at load time, located at the name, and one name of each class that breaks the
code today is compiled the way the generated code uses an argument name, to show that it does."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from variantgen.core.errors import SpecError
from variantgen.lang import reserved
from variantgen.lang import spec as spec_mod
from variantgen.lang.spec import parse_spec

CXX = shutil.which("g++") or shutil.which("c++")
CAUSAL = "name: x\nmask: kv_pos <= q_pos\n"

# An argument as the modules carry it (templates fa2/macros.jinja, planner SpecArgs, the
# variant's arg_ copies): a params field, a kernel parameter vg_arg_<name>, a local arg_<name>.
SOURCE = """
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
struct Params {{ const int32_t* {name}; float sm_scale; }};
struct Variant {{ int32_t arg_{name}; }};
inline void set_params(Params& params, const int32_t* vg_arg_{name}) {{ params.{name} = vg_arg_{name}; }}
inline int32_t read(const Params& params, int32_t row) {{ return params.{name}[row]; }}
int main() {{ Params params; int32_t v[2] = {{1, 2}}; set_params(params, v); return read(params, 1) - 2; }}
"""


def compiles(tmp_path, name: str) -> tuple[bool, str]:
    source = tmp_path / f"arg_{abs(hash(name))}.cpp"
    source.write_text(SOURCE.format(name=name))
    # gnu++17: the dialect nvcc's host compiler builds the modules in (it predefines `linux`)
    done = subprocess.run([CXX, "-std=gnu++17", "-fsyntax-only", str(source)], capture_output=True, text=True,
                          timeout=120)
    return done.returncode == 0, done.stderr


BREAKING = [(cls.key, cls.example) for cls in reserved.CLASSES if cls.breaks_today] + [
    ("reserved_pattern", reserved.RESERVED_PATTERN_EXAMPLE),
    ("cpp_keyword", "xor"),
]


@pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler")
def test_a_harmless_name_compiles(tmp_path):
    ok, err = compiles(tmp_path, "window")
    assert ok, err


@pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler")
@pytest.mark.parametrize(("cls", "name"), BREAKING)
def test_each_breaking_class_really_breaks_the_generated_code(tmp_path, cls, name):
    ok, _ = compiles(tmp_path, name)
    assert not ok, f"{name} ({cls}) compiled: it need not be refused for the reason the table gives"


def test_the_issue_names_are_in_the_table():
    for name in ("errno", "math_errhandling", "assert", "NULL", "EOF", "INFINITY", "NAN", "M_PI", "FLT_MAX",
                 "CHAR_BIT", "stdin", "threadIdx", "blockIdx", "warpSize", "linux", "a__b", "__x"):
        assert reserved.reserved_reason(name) is not None, name
    for name in ("window", "doc_ids", "slopes", "sink_len", "a_b", "x1", "score"):
        assert reserved.reserved_reason(name) is None, name


@pytest.mark.parametrize("section", ["tensors", "scalars"])
def test_every_reserved_name_is_refused_at_the_name(section):
    """errno passed validate and render and failed to compile in the planner; every name of every
    class is now refused where it is declared, the message saying why."""
    decl = "{dtype: int32, shape: [batch]}" if section == "tensors" else "{dtype: int, default: 0}"
    names = sorted(set().union(*(cls.names for cls in reserved.CLASSES)) | {"a__b", "x__", "_x", "__cplusplus"})
    # one file per 15 names (errors past MAX_SPEC_ERRORS are counted, not kept)
    for start in range(0, len(names), 15):
        chunk = names[start:start + 15]
        text = CAUSAL + f"{section}:\n" + "".join(f"  '{n}': {decl}\n" for n in chunk)  # (NULL: YAML's null)
        err = pytest.raises(SpecError, parse_spec, text, "spec.yaml").value
        errors = getattr(err, "errors", [err])
        assert [e.field for e in errors] == [f"{section}.{n}" for n in chunk]
        for i, (e, n) in enumerate(zip(errors, chunk)):
            assert (e.location.line, e.location.col) == (4 + i, 3)
            if spec_mod.ARG_RE.fullmatch(n) or not reserved.RESERVED_PATTERN.fullmatch(n):
                assert e.message.startswith(f"`{n}` is ") and e.message.endswith("choose another name"), e.message
            else:  # _x, __cplusplus: the pattern's message says what a name may be
                assert e.message.startswith(f"argument name {n!r} must match"), e.message


def test_the_message_names_the_class():
    err = pytest.raises(SpecError, parse_spec, CAUSAL + "scalars:\n  errno: {dtype: int, default: 0}\n",
                        "spec.yaml").value
    assert str(err).startswith("spec.yaml:4:3: scalars.errno: `errno` is a macro of the C/C++ standard library")
    assert spec_mod.ARG_RE.fullmatch("errno")  # (the pattern alone let it through)
