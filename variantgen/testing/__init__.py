"""Test and benchmark harness (random batches, fuzzing, results): used by tests/ and bench/, not shipped in the wheel."""
