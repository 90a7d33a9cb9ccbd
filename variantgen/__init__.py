"""variantgen: YAML attention-variant specs -> cached FlashInfer kernels.

Public API: load_spec / parse_spec, shipped_specs / resolve_spec (specs by name: wherever a
spec is accepted, "mm_prefix" names the shipped one), make_wrapper, GraphCapacity (CUDA-graph
mode), choose_backend, probe, probe_backends, and the error classes.
Heavy imports (torch, flashinfer) happen lazily inside the functions that need them.
"""

__version__ = "0.1.0"

from .errors import BuildError, CacheError, LaunchError, SpecError, VariantgenError  # noqa: E402
from .library import resolve_spec, shipped_specs  # noqa: E402
from .spec import VariantSpec, load_spec, parse_spec  # noqa: E402


def make_wrapper(*args, **kwargs):
    from .wrapper import make_wrapper as _make_wrapper

    return _make_wrapper(*args, **kwargs)


def choose_backend(*args, **kwargs):
    from .render import choose_backend as _choose_backend

    return _choose_backend(*args, **kwargs)


def __getattr__(name):
    if name == "GraphCapacity":  # imports torch: only when asked for
        from .graph import GraphCapacity

        return GraphCapacity
    raise AttributeError(f"module 'variantgen' has no attribute {name!r}")


def probe(*args, **kwargs):
    from .probe import probe as _probe

    return _probe(*args, **kwargs)


def probe_backends(*args, **kwargs):
    from .probe import probe_backends as _probe_backends

    return _probe_backends(*args, **kwargs)


__all__ = [
    "BuildError",
    "GraphCapacity",
    "CacheError",
    "LaunchError",
    "SpecError",
    "VariantSpec",
    "VariantgenError",
    "__version__",
    "choose_backend",
    "load_spec",
    "make_wrapper",
    "parse_spec",
    "probe",
    "probe_backends",
    "resolve_spec",
    "shipped_specs",
]
