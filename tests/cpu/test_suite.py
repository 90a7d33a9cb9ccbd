"""The test suite itself: plain `pytest` (no -m) on a machine without a GPU reports the GPU
tests as skipped, never as errors (their module-scoped fixtures allocate CUDA memory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_tests_skip_cleanly_without_a_gpu():
    files = sorted(str(p) for p in (REPO / "tests" / "gpu").glob("test_gpu_*.py"))
    assert files
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " skipped" in tail and "error" not in tail and "passed" not in tail and "failed" not in tail, tail


def test_skip_unbuilt_turns_a_missing_module_into_a_skip(tmp_path):
    """VARIANTGEN_TEST_SKIP_UNBUILT=1 (GPU runs against a precompiled cache, JIT off): a test stopped
    by JitDisabledError is reported skipped with the module's reason; without it, failed; any other
    error still fails."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_x.py").write_text(
        "import pytest\nfrom variantgen.core.errors import JitDisabledError\n\n"
        "@pytest.fixture(scope='module')\ndef wrapper():\n"
        "    raise JitDisabledError('module vg_x_fa3 is not precompiled')\n\n"
        "def test_missing():\n    raise JitDisabledError('module vg_y_fa2 is not precompiled')\n\n"
        "def test_missing_in_a_fixture(wrapper):\n    pass\n\n"
        "def test_other():\n    raise ValueError('a real failure')\n")

    def run(**extra: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "VARIANTGEN_TEST_SKIP_UNBUILT"}
        env.update(PYTHONPATH=str(REPO), **extra)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_x.py"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        return proc.stdout

    on = run(VARIANTGEN_TEST_SKIP_UNBUILT="1")
    assert "1 failed, 2 skipped" in on.splitlines()[-1], on[-2000:]
    assert "not precompiled: module vg_y_fa2 is not precompiled" in on and "vg_x_fa3" in on
    off = run()
    assert "2 failed" in off.splitlines()[-1] and "1 error" in off.splitlines()[-1], off[-2000:]
