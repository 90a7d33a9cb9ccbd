"""Cache faults, measured on the CPU: prints JSON counts (what tests/cpu/test_cache_fault_suite.py
asserts), so the figures can be re-measured after a change.

* corruptions of a published entry (tests/fakes/_cache_faults.py CORRUPTIONS): detected by the
  lookup, loaded anyway, hung (over the per-case bound), other errors; `list` verdicts;
* failure records and lock files that are FIFOs, links to /dev/zero or 4 GiB files: hung or not;
* kill -9 of builders mid-compile (fake toolchain, real ninja): processes left after a bound;
* N processes building one module at once (fake toolchain, real ninja): how many built.

Usage: python bench/cache_faults.py [--rounds 2] [--builders 8] [--verdicts] [--out FILE]
Nothing is compiled for real; everything happens in a temporary folder that is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "fakes"))

import _cache_faults as faults  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="kill -9 rounds (default 2)")
    parser.add_argument("--builders", type=int, default=8, help="concurrent builders (default 8)")
    parser.add_argument("--verdicts", action="store_true", help="also print every corruption's verdict")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    for name in ("VG_FAKE_NVCC_SLEEP", "VG_FAKE_NVCC_FAIL", "VG_FAKE_PIDS", "VG_FAKE_NVCC_IGNORE_TERM"):
        os.environ.pop(name, None)
    report: dict = {"bound_s": faults.BOUND_S}
    with tempfile.TemporaryDirectory(prefix="cache-faults-") as scratch:
        root = Path(scratch)
        os.environ["VARIANTGEN_CACHE_DIR"] = str(root / "default-cache")
        t0 = time.perf_counter()
        corruptions = faults.measure_corruptions(root / "corruptions")
        if not args.verdicts:
            corruptions.pop("verdicts")
        report["corruptions"] = corruptions
        records = faults.measure_hostile_records(root / "records")
        if not args.verdicts:
            records.pop("results")
        report["hostile_records"] = records
        report["killed_builders"] = faults.measure_killed_builders(root / "killed", rounds=args.rounds)
        report["concurrent_builders"] = faults.measure_concurrent_builders(root / "race", n=args.builders)
        report["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = (corruptions["loaded"] == corruptions["hung"] == corruptions["error"] == 0 and records["hung"] == 0
          and report["killed_builders"]["processes_left"] == 0 and report["concurrent_builders"]["built"] == 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
