"""The cache-fault suite (tests/fakes/_cache_faults.py): every corruption of a published entry is
detected and never loaded, within a time bound; hostile records never hang a reader or the lock;
kill -9 of builders leaves no process; concurrent builders build once. bench/cache_faults.py
prints the same counts as JSON."""

from __future__ import annotations

import _cache_faults as faults
import pytest


@pytest.fixture(autouse=True)
def clean_env(vg_env, monkeypatch):
    for name in ("VG_FAKE_NVCC_SLEEP", "VG_FAKE_NVCC_FAIL", "VG_FAKE_PIDS", "VG_FAKE_NVCC_IGNORE_TERM"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", sorted(faults.CORRUPTIONS))
def test_every_corruption_is_detected_and_never_loaded(tmp_path, name):
    verdict = faults.run_corruption(tmp_path, name)
    assert verdict["lookup"] == "detected", verdict
    assert verdict["list"] in ("damaged", "not listed"), verdict
    if name == "entry a link out of the cache":
        assert verdict["list"] == "not listed"  # a link is not one of our entries
    else:
        assert verdict["list"] == "damaged"


def test_the_corruption_counts(tmp_path):
    counts = faults.measure_corruptions(tmp_path)
    assert counts["cases"] == len(faults.CORRUPTIONS) >= 35
    assert (counts["detected"], counts["loaded"], counts["hung"], counts["error"]) == (counts["cases"], 0, 0, 0)
    assert counts["listed_healthy"] == 0 and counts["list_hung"] == 0


def test_hostile_records_never_hang(tmp_path):
    counts = faults.measure_hostile_records(tmp_path)
    assert counts["cases"] == 3 * len(faults.HOSTILE_RECORDS) and counts["hung"] == 0 and counts["error"] == 0
    assert {r["outcome"] for r in counts["results"]} == {"ignored", "locked"}, counts["results"]


@pytest.mark.slow
def test_killed_builders_leave_no_process(tmp_path):
    counts = faults.measure_killed_builders(tmp_path, rounds=2)
    assert counts["processes_started"] >= 6 and counts["processes_left"] == 0, counts


@pytest.mark.slow
def test_concurrent_builders_build_once(tmp_path):
    counts = faults.measure_concurrent_builders(tmp_path, n=4)
    assert counts == {"processes": 4, "succeeded": 4, "failed": 0, "built": 1, "distinct_modules": 1, "entries": 1,
                      "staging_left": 0}, counts
