"""The entry points: make_wrapper and probe."""
