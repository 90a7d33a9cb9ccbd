"""The wrappers engines call (plan/run) for every kind and backend, their input checks and the reference."""
