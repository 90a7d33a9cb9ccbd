"""variantgen: YAML attention-variant specs -> cached FlashInfer kernels.

Public API: load_spec / parse_spec, shipped_specs / resolve_spec (specs by name: wherever a
spec is accepted, "mm_prefix" names the shipped one), probe / probe_backends (ProbeResult),
make_wrapper, GraphCapacity (CUDA-graph mode), choose_backend, spans_to_ranges, tree_bits, and
the error classes. ``import variantgen`` does not import torch: make_wrapper, GraphCapacity,
spans_to_ranges and tree_bits are imported on first access (they need torch; the spec, probe and
cache paths do not).
"""

__version__ = "0.1.0"

from .errors import BuildError, CacheError, LaunchError, SpecError, VariantgenError  # noqa: E402
from .library import resolve_spec, shipped_specs  # noqa: E402

# Bound after the submodule import, so `variantgen.probe` is the function (not the module of
# the same name): help(variantgen.probe) shows its signature and docstring.
from .probe import ProbeResult, probe, probe_backends  # noqa: E402
from .render import choose_backend  # noqa: E402
from .spec import VariantSpec, load_spec, parse_spec  # noqa: E402

# name -> submodule that defines it; these import torch, so only when first asked for
_TORCH_NAMES = {"make_wrapper": "wrapper", "GraphCapacity": "graph", "spans_to_ranges": "spans",
                "tree_bits": "trees"}


def __getattr__(name):
    if name in _TORCH_NAMES:
        import importlib

        value = getattr(importlib.import_module(f".{_TORCH_NAMES[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'variantgen' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_TORCH_NAMES))


__all__ = [
    "BuildError",
    "CacheError",
    "GraphCapacity",
    "LaunchError",
    "ProbeResult",
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
    "spans_to_ranges",
    "tree_bits",
]
