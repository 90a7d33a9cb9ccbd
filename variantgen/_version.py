"""variantgen's version: one place, read by the package, the module keys (build.py), the
generated sources' headers (render.py, rowplan.py), the CLI's --version, doctor and the
packaging metadata (pyproject.toml reads it statically)."""

__version__ = "0.1.0"
