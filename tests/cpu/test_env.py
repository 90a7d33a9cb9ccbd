"""The environment variables variantgen.core.env reads: a malformed value is a ValueError naming the
variable and what it expects, never a silent default or an error from deep in a build."""

from __future__ import annotations

import pytest

from variantgen.core import env


@pytest.mark.parametrize("variable", ["VARIANTGEN_BUILD_JOBS", "MAX_JOBS", "VARIANTGEN_NVCC_THREADS",
                                      "VARIANTGEN_SPLIT_COMPILE"])
def test_counts_fit_what_ninja_and_nvcc_read(vg_env, variable):
    """A regression: 2**31 and more passed, and every build then failed in ninja ("invalid -j
    parameter") or nvcc ("32-bit integer value out of range"), naming neither the variable."""
    vg_env.set(**{variable: str(env.MAX_COUNT)})  # the largest is taken
    with pytest.raises(ValueError, match=f"^environment variable {variable}='2147483648': expected a number "
                                         "<= 2147483647$"):
        vg_env.set(**{variable: str(env.MAX_COUNT + 1)})


@pytest.mark.parametrize("variable", ["VARIANTGEN_DISABLE_JIT", "FLASHINFER_DISABLE_JIT", "VARIANTGEN_CHECK_PLAN"])
def test_on_off_variables_refuse_other_values(vg_env, variable):
    """A regression: any value but 1/true/yes/on was read as off, so VARIANTGEN_DISABLE_JIT=Y (or
    =disable, =2) left JIT on and a server built the modules it was told not to."""
    field = "check_plan" if variable == "VARIANTGEN_CHECK_PLAN" else "jit_disabled"
    for value in ("1", "TRUE", " yes ", "on"):
        assert getattr(vg_env.set(**{variable: value}), field) is True
    for value in ("", "0", "False", "no", "OFF"):
        assert getattr(vg_env.set(**{variable: value}), field) is False
    for value in ("Y", "disable", "2"):
        with pytest.raises(ValueError, match=f"^environment variable {variable}='{value}': expected 1, true, yes or "
                                             r"on \(or 0, false, no, off, or unset\)$"):
            vg_env.set(**{variable: value})


def test_cache_dir_naming_a_file_is_an_error(vg_env, tmp_path):
    """A regression: VARIANTGEN_CACHE_DIR naming a file was taken - `variantgen list` said "no
    modules in" it (exit 0) and builds "cache directory ... is not writable (File exists)"."""
    from click.testing import CliRunner

    from variantgen.tools.cli import main

    (tmp_path / "notes.txt").write_text("not a cache")
    for value in (tmp_path / "notes.txt", "/dev/null"):
        with pytest.raises(ValueError, match=f"^environment variable VARIANTGEN_CACHE_DIR='{value}': expected a "
                                             f"folder, {value} is not one$"):
            vg_env.set(VARIANTGEN_CACHE_DIR=value)
    r = CliRunner().invoke(main, ["list"])
    assert r.exit_code == 1 and r.output.startswith("error: environment variable VARIANTGEN_CACHE_DIR=")
    assert vg_env.set(VARIANTGEN_CACHE_DIR=tmp_path / "not yet").cache_dir == tmp_path / "not yet"  # made by a build
