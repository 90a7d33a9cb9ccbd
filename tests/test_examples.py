"""The examples run as documented: `python examples/serving_engine.py` on a CPU box demotes
every layer group to the plain causal backend and says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_serving_engine_demotes_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VARIANTGEN_") and k != "FLASHINFER_DISABLE_JIT"}
    env.update(CUDA_VISIBLE_DEVICES="", VARIANTGEN_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "serving_engine.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    # Each group is demoted with the probe's reason ...
    assert "group global (head 256, kv bf16): demoted to plain causal: no CUDA device visible" in out
    assert "group local (head 128, kv fp8_e4m3): demoted to plain causal: no CUDA device visible" in out
    # (head 80: no module has it, the flex route would run it on a GPU)
    assert "group odd (head 80, kv bf16): demoted to plain causal: no CUDA device visible" in out
    # ... and dispatch falls back to the plain backend, with and without multimodal spans.
    assert proc.stdout.count("-> plain causal prefill") == 6
    assert not (tmp_path / "cache").exists()  # nothing was built
