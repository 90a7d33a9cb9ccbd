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
