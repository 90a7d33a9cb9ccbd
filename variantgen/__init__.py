"""variantgen: YAML attention-variant specs -> cached FlashInfer kernels.

Public API: load_spec / parse_spec, shipped_specs / resolve_spec (specs by name: wherever a
spec is accepted, "mm_prefix" names the shipped one), probe / probe_backends (ProbeResult),
make_wrapper, GraphCapacity (CUDA-graph mode), choose_backend, spans_to_ranges, tree_bits, and
the error classes. ``import variantgen`` does not import torch: GraphCapacity, spans_to_ranges
and tree_bits are imported on first access, make_wrapper imports it when called (the spec, probe and cache paths
need none).

The subpackages are the pipeline's layers, bottom first: core, abi, lang (the spec
language), routing (what can run where), codegen, build (compiling and the module cache),
planning (the interval planner and Plan values), wrappers, api (make_wrapper, probe), tools
(the CLI), integrations; a module imports only from its own layer or those below it.
testing/ is the harness of the tests and benchmarks, not part of the wheel.
"""

from ._version import __version__
from .api.factory import make_wrapper
from .api.probing import ProbeResult, probe, probe_backends
from .core.errors import BuildError, CacheError, LaunchError, SpecError, VariantgenError
from .lang.library import load_spec, resolve_spec, shipped_specs
from .lang.spec import parse_spec
from .lang.values import VariantSpec
from .routing.resolver import choose_backend

# name -> submodule that defines it; these import torch, so only when first asked for
_TORCH_NAMES = {"GraphCapacity": "planning.graph", "spans_to_ranges": "wrappers.spans", "tree_bits": "wrappers.trees"}


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
