"""The one resolver: which backend serves a request at a site, and why the others do not.

``resolve`` reads the capability table (capabilities.py) for one ``Request`` at one ``Site``
and returns a ``Resolution``: the backend chosen (with its render.ModuleConfig for a module
backend), a note where that is not the preferred one, and why each other backend was not
chosen. make_wrapper (factory.py), probe (probing.py) and the command line (precompile's auto
backend, probe, render, check) ask here; none re-decides.

``backend=None`` prefers the table's order: fa3, fa2, then the flex route (decode: fa2 first,
capabilities.KIND_ORDER). Where modules
cannot be built (JIT disabled, ``build=False``) the cache decides among the backends that
could run: a precompiled fa2 module rather than a missing fa3 one, the flex route rather than
no module at all; with neither, the preferred module (the one to precompile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..lang.values import VariantSpec
from .capabilities import GRAPH_KINDS, TABLE, Request, Route, Site, no_graph_kind, preference
from .config import DEFAULT_MASK_MODES, ModuleConfig


@dataclass(frozen=True)
class Resolution:
    """resolve()'s answer; truthy when a backend was chosen."""

    request: Request
    backend: str | None
    config: ModuleConfig | None = None
    """The module to build or load (a module backend at a known arch), else None."""
    note: str = ""
    """Why the chosen backend is not the preferred one (a cache-aware choice), else ""."""
    rejected: tuple[tuple[str, str], ...] = ()
    """(backend, why it was not chosen), in the order backend=None prefers them."""
    problem: str = ""
    """What no backend could fix (e.g. CUDA-graph mode for a kind none captures), else ""."""

    def __bool__(self) -> bool:
        return self.backend is not None

    @property
    def route(self) -> Route | None:
        """The module-less route chosen (flex), or None."""
        return TABLE[self.backend].route if self.backend is not None else None

    @property
    def reason(self) -> str:
        """Why nothing was chosen ("" when something was): one line for one backend, else one
        line per backend."""
        return self.why()

    def why(self, *, lines: bool = True) -> str:
        """``reason``; with ``lines=False`` on one line (a table row, a skip message)."""
        if self.backend is not None:
            return ""
        if self.problem:
            return self.problem
        if len(self.rejected) == 1:
            return self.rejected[0][1]
        head, sep = ("no backend can run it here:\n  ", "\n  ") if lines else ("no backend can run it here: ", " | ")
        return head + sep.join(f"{b}: {why}" for b, why in self.rejected)


def module_config(request: Request, backend: str, arch: str) -> ModuleConfig:
    """The module ``backend`` runs for ``request`` on ``arch`` (every mask mode the wrapper launches)."""
    return ModuleConfig(request.spec, request.head_dim_qk, request.head_dim_vo, request.q_dtype, request.kv_dtype,
                        request.o_dtype, arch, backend, DEFAULT_MASK_MODES, request.module_kind(backend))


_NO_SITE = Site()  # no arch known, modules buildable, no route installed


def resolve(request: Request, site: Site = _NO_SITE) -> Resolution:
    """Which backend serves ``request`` at ``site``, and why the others do not. Pure: it reads
    only its arguments (the cache through ``site.lookup``, asked only where modules cannot be
    built and backend is None)."""
    if request.graph and request.kind not in GRAPH_KINDS:
        return Resolution(request, None, problem=no_graph_kind(request.kind, request.names.graph))
    names = (request.backend,) if request.backend is not None else preference(request.kind)
    why_not = {name: "; ".join(TABLE[name].problems(request, site)) for name in names}
    viable = [name for name in names if not why_not[name]]
    if not viable:
        return Resolution(request, None, rejected=tuple(why_not.items()))
    chosen, note = viable[0], ""
    if request.backend is None and not site.can_build and len(viable) > 1:
        chosen, note, passed = _cache_aware(request, site, viable)
        why_not.update(passed)
    for name in viable:
        if name != chosen and not why_not[name]:
            why_not[name] = f"{chosen} comes first" + (" (the module to precompile)" if not site.can_build else "")
    config = module_config(request, chosen, site.arch) if TABLE[chosen].module and site.arch is not None else None
    rejected = tuple((name, why) for name, why in why_not.items() if name != chosen)
    return Resolution(request, chosen, config, note, rejected)


def _cache_aware(request: Request, site: Site, viable: list[str]) -> tuple[str, str, dict[str, str]]:
    """Where modules cannot be built: the first viable backend whose module is precompiled (or
    that needs none), else the preferred one. (chosen, note, why the ones before it were passed over)."""
    preferred, passed = viable[0], {}
    for name in viable:
        backend = TABLE[name]
        if not backend.module:
            return name, (f"no precompiled {'/'.join(passed)} module in {site.cache_root} and {site.no_build}: "
                          f"serving through {backend.about}"), passed
        config = module_config(request, name, site.arch) if site.arch is not None else None
        uri = site.lookup(config) if config is not None and site.lookup is not None else None
        if uri is not None:
            note = "" if name == preferred else (
                f"the {preferred} module {module_config(request, preferred, site.arch).uri_prefix}_* is not "
                f"precompiled in {site.cache_root}; using the precompiled {name} module {uri} (correct, slower; "
                f"precompile the {preferred} module to serve {preferred})")
            return name, note, passed
        passed[name] = f"not precompiled in {site.cache_root} and {site.no_build}"
    passed.pop(preferred)  # nothing usable: the preferred module is the one to precompile
    return preferred, "", passed


def choose_backend(spec: VariantSpec, *, kind: str, head_dim_qk: int, head_dim_vo: int, q_dtype: Any,
                   kv_dtype: Any, o_dtype: Any, arch: str) -> str:
    """The module backend make_wrapper(backend=None) uses on a GPU of ``arch`` where modules can
    be built: fa3 where an fa3 module can run, else fa2. Pure: depends only on its arguments.
    ValueError with every backend's reason when neither can."""
    request = Request.of(spec, kind=kind, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_dtype=q_dtype,
                         kv_dtype=kv_dtype, o_dtype=o_dtype)
    resolution = resolve(request, Site(arch=arch, no_route="choose_backend() picks among the module backends"))
    if not resolution:
        raise ValueError(resolution.reason)
    assert resolution.backend is not None
    return resolution.backend
