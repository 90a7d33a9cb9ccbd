"""The examples run as documented. `python examples/serving_engine.py` on a CPU box: every layer
group's FlashInfer module is demoted with the probe's reason, the flex route serves prefill and
decode, CUDA graphs are skipped with the reason, every check against the reference passes, and
nothing is built. It exits 1 when an output does not match the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "serving_engine.py"
# Makes the example's reference disagree with its kernels: every image span dropped.
BROKEN_REFERENCE = f"""
import runpy, sys
import variantgen.wrappers.reference as reference
real = reference.reference_attention
def without_spans(spec, q, kv, qo_indptr, kv_indptr, kv_indices, last_page_len, args):
    args = {{name: t.clone().fill_(-1) for name, t in args.items()}}
    return real(spec, q, kv, qo_indptr, kv_indptr, kv_indices, last_page_len, args)
reference.reference_attention = without_spans
sys.argv = [{str(EXAMPLE)!r}, "--decode-steps", "0"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_example(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VARIANTGEN_") and k != "FLASHINFER_DISABLE_JIT"}
    env.update(CUDA_VISIBLE_DEVICES="", VARIANTGEN_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_serving_engine_on_cpu(tmp_path):
    proc = run_example(tmp_path, str(EXAMPLE))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    # Startup: the probe passes over each group's modules with its reasons and takes the flex route.
    for group in ("global (head 128, kv bf16, page 16)", "local (head 64, kv fp8_e4m3, page 32)"):
        for kind in ("prefill", "decode"):
            first = "fa2" if kind == "decode" else "fa3"  # backend=None's order (decode: fa2 first)
            assert f"group {group} {kind}: FlashInfer module demoted: {first}: " in out
            assert f"group {group} {kind}: falling back to the flex route (FlexAttention on cpu" in out
    assert "fa2: no CUDA device visible" in out
    assert "kv_dtype=fp8_e4m3: fa3 variant modules need kv_dtype == q_dtype (bf16)" in out  # the local group
    # fa3 serves decode (on its prefill module): demoted for want of a GPU, or for the odd group's head dim
    assert "group global (head 128, kv bf16, page 16) decode: FlashInfer module demoted: fa2: no CUDA device " \
           "visible" in out
    assert "; fa3: head_dim_qk=80, head_dim_vo=80: fa3 prefill modules support head dims 64, 128, 256 (qk/vo where " \
           "they differ) (its decode runs the prefill module)" in out
    assert "group odd (head 80, kv bf16, page 16) prefill: FlashInfer module demoted: fa3: head_dim_qk=80" in out
    assert "advertising" not in out
    assert "probe mm_prefix (flex route): ok" in out  # the probe's log names the spec for a module-less route
    # CUDA graphs: skipped with the probe's reason for the flex route.
    assert out.count("decode: CUDA graphs off: cuda_graph=True: CUDA-graph mode needs backend 'fa3' or 'fa2' (got "
                     "'flex')") == 3
    assert "captured" not in out
    # The summary: routes per group, and the reference checks (prefill + 3 decode steps, 3 groups).
    lines = proc.stdout.splitlines()
    assert "group global layers [2, 5]: prefill flex, decode flex, CUDA graphs off (cuda_graph=True: " \
           "CUDA-graph mode needs backend 'fa3' or 'fa2' (got 'flex')" in proc.stdout
    checks = [line for line in lines if line.startswith("reference check ")]
    assert len(checks) == 12 and all(line.endswith(" ok") for line in checks), checks
    assert any(line.startswith("reference check prefill       group local  layer 0 (flex)") for line in checks)
    assert any(line.startswith("reference check decode step 2 group odd    layer 6 (flex)") for line in checks)
    assert lines[-1] == "12 of 12 reference checks passed"
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_serving_engine_exits_1_on_a_mismatch(tmp_path):
    proc = run_example(tmp_path, "-c", BROKEN_REFERENCE)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = [line for line in proc.stdout.splitlines() if line.startswith("reference check prefill")]
    assert len(checks) == 3 and all(line.endswith(" MISMATCH") for line in checks), checks
    assert proc.stdout.splitlines()[-1] == "0 of 3 reference checks passed"


def test_serving_engine_refuses_a_spec_it_cannot_feed(tmp_path):
    proc = run_example(tmp_path, str(EXAMPLE), "--spec", "document")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "spec document needs tensor(s) ['doc_ids']; this engine provides `ranges` (image spans) only" in proc.stderr
