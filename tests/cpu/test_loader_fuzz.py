"""The spec loader under hostile files (variantgen/testing/spec_fuzz.py): every case is accepted or
refused with a SpecError naming the file; no other exception, no case past the time bound."""

from __future__ import annotations

import pytest

from variantgen.testing import spec_fuzz


def check(counts: spec_fuzz.Counts, n: int) -> None:
    assert counts.other == 0, counts.examples
    assert counts.unlocated == 0, counts.examples
    assert counts.hangs == 0, counts.examples
    assert counts.refused + counts.accepted == n
    assert counts.refused > counts.accepted  # (they are hostile: most must be refused)


def test_every_kind_of_hostile_file_is_generated():
    kinds = {kind for kind, _ in spec_fuzz.cases(0, 400)}
    assert kinds == {k[0] for k in spec_fuzz.KINDS}


def test_hostile_spec_files_are_refused_located_or_accepted():
    # bound_s (CPU seconds) is a hang guard only: a case takes milliseconds to about a second of CPU
    counts = spec_fuzz.run(seed=1, n=150, bound_s=30)
    check(counts, 150)
    assert counts.by_kind["yaml 1.1 forms"] == {"refused": sum(counts.by_kind["yaml 1.1 forms"].values())}
    assert set(counts.by_kind["reserved names"]) == {"refused"}


@pytest.mark.slow
def test_a_longer_loader_fuzz_run():
    counts = spec_fuzz.run(seed=2, n=2000, bound_s=30)
    check(counts, 2000)


def test_a_hang_is_counted_not_waited_for(monkeypatch):
    """The bound works: a case that does not return is stopped and counted as a hang."""
    def stuck(text, path):
        while True:  # (a loop that never ends, as a hang in the loader would)
            pass

    monkeypatch.setattr(spec_fuzz, "parse_spec", stuck)
    counts = spec_fuzz.run(seed=0, n=1, bound_s=0.5)
    assert counts.hangs == 1 and counts.examples[0]["outcome"] == "hangs"
