"""make_wrapper: a spec's attention behind plan() / run(), on the backend the resolver picks.

This module holds the factory and what it needs to know about its surroundings: the kind
registry (kernel kind -> wrapper class; the wrappers live in wrapper.py, ragged.py,
decode.py), the GPU's arch (``device_arch``, the one device -> arch mapping; ``target_arch``
for build boxes and cache checks) and the site a choice is made for (``module_site``: the
target arch, whether modules may be built, what the cache holds, which module-less routes
are installed). Which backend serves a request is resolver.resolve's answer; probing.py
asks the same questions of the same functions, so ``probe(...)`` says yes exactly when this
would succeed without building.

Importing it does not import torch (make_wrapper does, when called).
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..build import builder as _build
from ..build.cache import Cache
from ..core.env import MAX_COUNT, settings
from ..core.flags import check_flags
from ..lang.library import resolve_spec
from ..lang.values import VariantSpec
from ..routing import capabilities
from ..routing.capabilities import Request, Site, arch_of_capability, canonical_arch
from ..routing.resolver import resolve

if TYPE_CHECKING:
    import torch

    from ..planning.graph import GraphCapacity
    from ..wrappers.base import WrapperBase

log = logging.getLogger("variantgen.api.factory")

# kind -> "module:class" of its wrapper (imported on first use: they import torch)
WRAPPERS = {
    "prefill": "variantgen.wrappers.paged:VariantWrapper",
    "ragged": "variantgen.wrappers.ragged:RaggedWrapper",
    "decode": "variantgen.wrappers.decode:DecodeWrapper",
}


def wrapper_class(kind: str) -> type[WrapperBase]:
    if kind not in WRAPPERS:
        raise ValueError(f"kind={kind!r}: expected one of {list(WRAPPERS)}")
    module, _, name = WRAPPERS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


# ----------------------------------------------------------------------------- where


def device_arch(device: Any = None) -> str | None:
    """The arch modules are built for on a CUDA device ('9.0a' on sm90, '8.6'): ``device``, or
    the current one when None, where None is returned if torch sees no CUDA device. A device
    that cannot be queried (a bad index, a broken driver) raises what torch raises."""
    import torch

    if device is None and not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return arch_of_capability(major, minor)


def arch_mismatch(explicit: str, gpu: str, gpu_name: str = "the visible GPU") -> str:
    """Why modules for ``explicit`` (an arch= given) cannot run on ``gpu``, the arch of the GPU
    they would run on; "" where they can. probe() and make_wrapper() both refuse such a request
    rather than serve it some other way: the caller asked about that arch."""
    if explicit == gpu:
        return ""
    return f"arch={explicit} was given, but {gpu_name} is {gpu}: a module for {explicit} does not run here"


def module_workspace_problem(workspace: Any) -> str:
    """Why no compiled module can run over ``workspace`` ("" where one can): its kernels run on a
    CUDA GPU, reading the workspace there. (Building modules for a machine without a GPU is
    `variantgen precompile --arch`'s job. The CPU tests replace this check to run fake modules.)"""
    import torch

    if isinstance(workspace, torch.Tensor) and workspace.device.type == "cuda":
        return ""
    where = f"a tensor on {workspace.device}" if isinstance(workspace, torch.Tensor) else type(workspace).__name__
    return (f"workspace: expected a CUDA tensor for a compiled module, got {where} (to build modules for another "
            "machine: `variantgen precompile --arch`)")


def workspace_arch(arch: str | None, cuda_device: Any) -> str | None:
    """The arch make_wrapper builds for: ``arch`` when given, else that of the workspace's GPU
    (``cuda_device``; None for a workspace elsewhere). ValueError for an ``arch`` that is not the
    workspace GPU's: the module could not run on it."""
    if arch is None:
        return device_arch(cuda_device) if cuda_device is not None else None
    target = canonical_arch(arch)
    if cuda_device is not None:  # (a workspace elsewhere: module_workspace_problem refuses the modules)
        wrong = arch_mismatch(target, device_arch(cuda_device), "the workspace's GPU")
        if wrong:
            raise ValueError(f"make_wrapper(): {wrong} (leave arch= out to build for the workspace's GPU; "
                             "`variantgen precompile --arch` builds for another)")
    return target


def target_arch(arch: str | None = None, device: Any = None) -> str | None:
    """The arch to build or look up modules for: ``arch`` when given, else the visible GPU's
    (``device``), else VARIANTGEN_ARCH (the target of build boxes and CI, which have no GPU);
    None when none is known. ValueError for a malformed ``arch`` or VARIANTGEN_ARCH."""
    if arch is not None:
        return canonical_arch(arch)
    found = device_arch(device)
    if found is not None:
        return found
    env_arch = settings().arch
    if env_arch:
        try:
            return canonical_arch(env_arch)
        except ValueError as e:
            raise ValueError(f"VARIANTGEN_ARCH: {e}") from None
    return None


def module_site(arch: str | None, cache: Cache, *, build: bool, no_modules: str = "", routes: bool = True,
                arch_source: str = "") -> Site:
    """The Site of a choice on this machine: modules for ``arch``, unless ``no_modules`` says why
    none can run (no CUDA target, no flashinfer), built where JIT is on and ``build``, else looked
    up in ``cache`` (the way a server with JIT disabled finds them); module-less routes where
    installed and ``routes``."""
    s = settings()
    can_build = bool(build) and not s.jit_disabled
    why = f"JIT disabled by {s.jit_disabled_by}" if s.jit_disabled else "building disabled (build=False)"

    def lookup(config) -> str | None:
        found = _build.lookup_module(config, cache)[0]
        return found.entry.uri if found is not None else None

    return Site(arch=arch, arch_source=arch_source, modules=not no_modules, no_modules=no_modules or Site.no_modules,
                can_build=can_build, no_build=why, lookup=lookup, cache_root=str(cache.root),
                routes=capabilities.installed_routes() if routes else ())


# ----------------------------------------------------------------------------- the factory


def make_wrapper(spec: VariantSpec | str | Path, workspace: torch.Tensor, *, head_dim_qk: int,
                 head_dim_vo: int | None = None, q_dtype: Any, kv_dtype: Any, o_dtype: Any = None,
                 backend: str | None = None, kind: str = "prefill", kv_layout: str = "NHD",
                 arch: str | None = None, cache: Cache | None = None, build: bool = True,
                 jobs: int | None = None, use_tensor_cores: bool = False,
                 graph: GraphCapacity | None = None, check_plan: bool | None = None) -> WrapperBase:
    """Build (or load from the cache) the spec's module for one kernel kind and wrap it.

    ``spec``: a VariantSpec, a spec file's path, or a shipped spec's name ("mm_prefix";
    variantgen.shipped_specs() lists them).
    ``kind``: "prefill" (paged KV), "ragged" (ragged KV) or "decode" (paged KV, one query
    per request). ``backend``: "fa2", "fa3", "flex", or None for the resolver's choice
    (resolver.resolve: fa3 where an fa3 module runs - for decode fa2 first -, else fa2, else the flex route; with
    JIT disabled or ``build=False`` a precompiled fa2 module rather than a missing fa3 one,
    with a warning - the choice probe() reports). ``workspace`` is the float workspace
    (uint8, on the GPU the kernels run on; 128 MiB is plenty: a compiled module needs a CUDA
    workspace, so with one elsewhere backend=None takes the flex route and "fa2"/"fa3" raise);
    ``arch`` (default: the workspace's GPU) must be the workspace GPU's (ValueError otherwise:
    `variantgen precompile --arch` builds modules for another GPU). ``use_tensor_cores`` (decode only): run fa2's
    decode through the spec's prefill module (one query per request) instead of the
    CUDA-core decode kernel - FlashInfer's advice for large GQA groups (fa3's decode always
    runs its prefill module). ``graph``
    (kind "prefill"): CUDA-graph mode with fixed buffers for at most that batch, so a
    captured run() can be replayed after each plan() (graph.py; the backends whose table
    entry has it: fa2 and fa3, chosen as without it); also kind "decode" (tensor cores: any
    batch up to the capacity; CUDA cores: exactly max_batch_size requests per plan, as FlashInfer's CUDA-graph decode).
    ``check_plan`` (default: the VARIANTGEN_CHECK_PLAN variable): debug mode, in which run()
    verifies that the spec tensors plan() planned from (e.g. ``ranges``) were not changed
    since, and raises naming the tensor (a device sync per run(); under CUDA-graph capture the
    comparison is recorded and the next plan() raises if a replay found a change).
    Raises SpecError / ValueError / BuildError / JitDisabledError with what went wrong;
    call variantgen.probe() first to get a reason instead of an exception.
    """
    import torch

    check_flags("make_wrapper()", build=build, use_tensor_cores=use_tensor_cores, check_plan=check_plan)
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(f"make_wrapper(): cache={cache!r}: expected a variantgen.build.cache.Cache (e.g. "
                         "Cache(path)), or None for the default cache (VARIANTGEN_CACHE_DIR)")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_COUNT):
        raise ValueError(f"make_wrapper(): jobs={jobs!r}: expected a positive int (parallel compile jobs, at most "
                         f"{MAX_COUNT}), or None")
    spec = resolve_spec(spec)
    request = Request.of(spec, kind=kind, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype,
                         kv_dtype=kv_dtype, o_dtype=o_dtype, backend=backend, graph=graph is not None,
                         tensor_cores=use_tensor_cores)
    on_cuda = isinstance(workspace, torch.Tensor) and workspace.device.type == "cuda"
    target = workspace_arch(arch, workspace.device if on_cuda else None)
    cache = cache or _build.default_cache()
    site = module_site(target, cache, build=build, no_modules=module_workspace_problem(workspace))
    resolution = resolve(request, site)
    if not resolution:
        raise ValueError(resolution.reason)
    if resolution.note:
        log.warning("make_wrapper(%s): %s", spec.name, resolution.note)
    if resolution.route is not None:  # no module: the route's own factory (e.g. flex_wrapper.py)
        if check_plan:
            raise ValueError(f"check_plan=True: the plan check is the FlashInfer routes' debug mode; the "
                             f"{resolution.backend} route has none")
        return resolution.route.load(resolution.route.factory)(
            spec, workspace, head_dim_qk=request.head_dim_qk, head_dim_vo=request.head_dim_vo,
            q_dtype=request.q_dtype, kv_dtype=request.kv_dtype, o_dtype=request.o_dtype, kind=kind,
            kv_layout=kv_layout, use_tensor_cores=use_tensor_cores, graph=graph)
    config = resolution.config
    assert config is not None
    result = _build.build_module(config, cache, jobs=jobs, allow_build=build)
    module = _build.load_module(result.entry)
    extra = {"graph": graph} if graph is not None else {}
    wrapper = wrapper_class(kind)(spec, config, module, result, workspace, kv_layout, check_plan=check_plan, **extra)
    # The paged prefill kernel (also behind tensor-core decode) is planned by the interval planner;
    # the CUDA-core decode kernel's key trimming uses its row kernel.
    if config.kind in ("prefill", "decode") and wrapper.device.type == "cuda":
        from ..planning.intervals import analyze

        if analyze(spec).planner_ready:
            from ..planning.rowplan import load_planner

            wrapper.set_row_planner(*load_planner(spec, config.arch, cache, allow_build=build, jobs=jobs))
    return wrapper
