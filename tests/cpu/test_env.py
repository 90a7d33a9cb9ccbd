"""The environment variables variantgen.env reads: a malformed value is a ValueError naming the
variable and what it expects, never a silent default or an error from deep in a build."""

from __future__ import annotations

import pytest

from variantgen import env


@pytest.mark.parametrize("variable", ["VARIANTGEN_BUILD_JOBS", "MAX_JOBS", "VARIANTGEN_NVCC_THREADS",
                                      "VARIANTGEN_SPLIT_COMPILE"])
def test_counts_fit_what_ninja_and_nvcc_read(vg_env, variable):
    """A regression: 2**31 and more passed, and every build then failed in ninja ("invalid -j
    parameter") or nvcc ("32-bit integer value out of range"), naming neither the variable."""
    vg_env.set(**{variable: str(env.MAX_COUNT)})  # the largest is taken
    with pytest.raises(ValueError, match=f"^environment variable {variable}='2147483648': expected a number "
                                         "<= 2147483647$"):
        vg_env.set(**{variable: str(env.MAX_COUNT + 1)})
