"""variantgen: YAML attention-variant specs -> cached FlashInfer kernels.

Public API: load_spec / parse_spec, make_wrapper, probe, and the error classes.
Heavy imports (torch, flashinfer) happen lazily inside the functions that need them.
"""

__version__ = "0.1.0"

from .errors import BuildError, CacheError, LaunchError, SpecError, VariantgenError  # noqa: E402
from .spec import VariantSpec, load_spec, parse_spec  # noqa: E402


def make_wrapper(*args, **kwargs):
    from .wrapper import make_wrapper as _make_wrapper

    return _make_wrapper(*args, **kwargs)


def probe(*args, **kwargs):
    from .probe import probe as _probe

    return _probe(*args, **kwargs)


__all__ = [
    "BuildError",
    "CacheError",
    "LaunchError",
    "SpecError",
    "VariantSpec",
    "VariantgenError",
    "__version__",
    "load_spec",
    "make_wrapper",
    "parse_spec",
    "probe",
]
