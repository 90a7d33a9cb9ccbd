#!/usr/bin/env python
"""The spec loader fuzzer (variantgen/testing/spec_fuzz.py) over many cases; writes the counts as JSON.

Counts: refused with a located SpecError / accepted / refused without the file's name / other
exceptions / hangs past a bound of CPU time (the last three must be 0; exit 1 otherwise), per kind of
hostile file, and the slowest case. CPU only.

    python bench/loader_fuzz.py                       # 5,000 cases, seed 0
    python bench/loader_fuzz.py -n 20000 --seed 3 --out /tmp/loader_fuzz.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from variantgen import __version__  # noqa: E402
from variantgen.testing import spec_fuzz  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5000, help="number of cases (default 5000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bound", type=float, default=10,
                    help="seconds of CPU after which a case counts as a hang (default 10)")
    ap.add_argument("--out", type=Path, help="JSON file (default bench/results/<date>-cpu/loader_fuzz.json)")
    args = ap.parse_args()
    start, cpu = time.perf_counter(), time.process_time()
    counts = spec_fuzz.run(args.seed, args.n, args.bound)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {"cases": args.n, "seed": args.seed, "hang_bound_cpu_s": args.bound, **counts.as_dict(),
              "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(time.process_time() - cpu, 1),
              "variantgen": __version__, "commit": commit, "python": platform.python_version()}
    out = args.out or ROOT / "bench" / "results" / f"{datetime.date.today()}-cpu" / "loader_fuzz.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.n} cases: {counts.refused} refused (located), {counts.accepted} accepted, "
          f"{counts.unlocated} refused without the file, {counts.other} other exceptions, {counts.hangs} hangs; "
          f"slowest {counts.slowest_s:.2f} s of CPU ({counts.slowest_kind}); written to {out}")
    return 1 if counts.other or counts.unlocated or counts.hangs else 0


if __name__ == "__main__":
    sys.exit(main())
