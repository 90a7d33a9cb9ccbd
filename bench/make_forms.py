"""Write fixed equivalent forms of the benchmarks' masks as spec files, for the differential
fuzzer (bench/fuzz_gpu.py --specs NAME_form): bench/masks/forms/<mask>_form.yaml.

Each is its mask rewritten by variantgen/testing/forms.py's random rules (three rewrites, the
first seed from 1 whose text differs from the mask as written), with the spec's other fields as
they are. The fuzzer then runs the form's own module - the kernel evaluates the form as written,
the planner its normalized tree - against the reference. tests/cpu/test_forms_files.py checks that
the files are what this script writes.

    python bench/make_forms.py            # rewrite bench/masks/forms/
    python bench/make_forms.py --check    # exit 1 if a file differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from variantgen.lang.spec import load_spec  # noqa: E402
from variantgen.testing.forms import random_form, spec_data  # noqa: E402

FORMS_DIR = ROOT / "bench" / "masks" / "forms"
# rows of several intervals, bands, sparse key sets, documents
SOURCES = ("specs/streaming_sink.yaml", "bench/masks/sinks_bidirectional.yaml", "bench/masks/global_window.yaml",
           "bench/masks/fixed_sparse.yaml", "bench/masks/document_sinks.yaml", "bench/masks/bidirectional_window.yaml")
REWRITES = 3


def form_text(source: str) -> str:
    """The form file of ``source`` (a path under the repository), as this script writes it."""
    spec = load_spec(ROOT / source)
    for seed in range(1, 100):
        text = random_form(spec, seed, REWRITES)
        if text != spec.mask_text:
            break
    data = spec_data(spec)
    data["name"] = f"{spec.name}_form"
    data["description"] = f"{spec.name}'s mask in an equivalent form (the fuzzer's rewritten forms)"
    data["mask"] = text
    head = (f"# {source} with its mask rewritten: bench/make_forms.py (variantgen/testing/forms.py, seed {seed},\n"
            f"# {REWRITES} rewrites). Generated: edit the script, not this file.\n")
    return head + yaml.safe_dump(data, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where a file is not what this script writes")
    args = ap.parse_args(argv)
    stale = []
    FORMS_DIR.mkdir(exist_ok=True)
    for source in SOURCES:
        path = FORMS_DIR / f"{Path(source).stem}_form.yaml"
        text = form_text(source)
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    raise SystemExit(main())
