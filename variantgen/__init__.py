"""variantgen: YAML attention-variant specs -> cached FlashInfer kernels.

Public API: load_spec / parse_spec, shipped_specs / resolve_spec (specs by name: wherever a
spec is accepted, "mm_prefix" names the shipped one), probe / probe_backends (ProbeResult),
make_wrapper, GraphCapacity (CUDA-graph mode), choose_backend, spans_to_ranges, tree_bits, and
the error classes. ``import variantgen`` does not import torch: GraphCapacity, spans_to_ranges
and tree_bits are imported on first access, make_wrapper imports it when called (the spec, probe and cache paths
need none).

The layout, by job: spec.py / expr.py (the spec language), capabilities.py / resolver.py (what can
run where: the backend table and the resolver), factory.py (make_wrapper), probing.py (probe),
render.py / codegen.py and templates/ (the generated sources), build.py / cache.py (compiling
and the module cache), wrapper.py / ragged.py / decode.py (the wrappers), the planning
modules (intervals.py, planner.py, plan_abi.py, plan.py, rowplan.py, graph.py), evaluate.py /
reference.py (the torch evaluator and the dense reference), cli.py (the command).
"""

from ._version import __version__
from .errors import BuildError, CacheError, LaunchError, SpecError, VariantgenError
from .factory import make_wrapper
from .library import load_spec, resolve_spec, shipped_specs
from .probing import ProbeResult, probe, probe_backends
from .resolver import choose_backend
from .spec import VariantSpec, parse_spec

# name -> submodule that defines it; these import torch, so only when first asked for
_TORCH_NAMES = {"GraphCapacity": "graph", "spans_to_ranges": "spans", "tree_bits": "trees"}


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
