"""Warm-probe and module-load latency in a fresh process, from a relocated, JIT-disabled cache.

Copies VARIANTGEN_CACHE_DIR to a new folder, sets VARIANTGEN_DISABLE_JIT=1 and points CUDA_HOME at
a folder without nvcc (a server without a compiler), then in a new Python process times
`import variantgen` + `variantgen.probe(...)` (which loads the module) and `make_wrapper`.
Run on the GPU machine after the module was built:  python bench/bench_probe.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, time
# A serving engine has torch imported and CUDA initialised before it probes: time those
# apart from what variantgen adds.
t_start = time.perf_counter()
import torch
torch.empty(1, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
import variantgen
t1 = time.perf_counter()
r = variantgen.probe(sys.argv[1], head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16")
t2 = time.perf_counter()
ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
t3 = time.perf_counter()
w = variantgen.make_wrapper(sys.argv[1], ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16")
t4 = time.perf_counter()
print(json.dumps({"ok": bool(r), "reason": r.reason, "source": r.source, "loaded": r.details.get("loaded"),
                  "torch_import_and_cuda_init_s": t0 - t_start, "variantgen_import_s": t1 - t0,
                  "probe_s": t2 - t1, "import_plus_probe_s": t2 - t0,
                  "make_wrapper_after_probe_s": t4 - t3, "uri": r.uri}))
"""


def main() -> None:
    src = Path(os.environ.get("VARIANTGEN_CACHE_DIR", ROOT / "cache"))
    deployed = Path(tempfile.mkdtemp(prefix="vg-deployed-")) / "cache"
    shutil.copytree(src, deployed, ignore=shutil.ignore_patterns(".locks", ".staging", ".trash"))
    os.chmod(deployed, 0o555)  # a read-only deployed cache must still load
    env = dict(os.environ, VARIANTGEN_CACHE_DIR=str(deployed), VARIANTGEN_DISABLE_JIT="1",
               CUDA_HOME=str(deployed / "no-cuda-here"), PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "specs" / "mm_prefix.yaml")], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:])
            raise SystemExit(out.returncode)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    result = {"deployed_cache": str(deployed), "runs": runs,
              "best_import_plus_probe_s": min(r["import_plus_probe_s"] for r in runs)}
    os.chmod(deployed, 0o755)
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe-bench.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
