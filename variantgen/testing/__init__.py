"""The harness of tests/ and bench/ (fuzzing, timing, result files): not shipped in the wheel."""
