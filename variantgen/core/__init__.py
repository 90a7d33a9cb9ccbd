"""Foundations every layer uses: the error hierarchy, the environment variables, flags, progress, host staging."""
