"""What the ``variantgen`` commands share: option types (a folder, a finite number), the parsers of
comma lists, head dims and archs, the target arch of commands that build, the module a
command's options name, and the plain-text table the commands print."""

from __future__ import annotations

import math
from typing import Any

import click

from ..build.cache import Cache
from ..codegen.render import ModuleConfig
from ..core.errors import VariantgenError
from ..lang.library import resolve_spec
from ..lang.values import VariantSpec
from ..routing.capabilities import CLI_NAMES, Request, Site, canonical_arch
from ..routing.resolver import resolve


class Folder(click.Path):
    """A folder option (click.Path, not a file). An empty value (``--cache-dir "$UNSET"``) is a
    usage error: read as "not given", it named the default cache (``clear --yes`` emptied that
    one) and ``-o ""`` printed instead of writing."""

    def __init__(self) -> None:
        super().__init__(file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail(f"{value!r}: expected a folder, got an empty value", param, ctx)
        return super().convert(value, param, ctx)


FOLDER = Folder()


class Finite(click.FloatRange):
    """A number >= ``min``, finite: nan passes click.FloatRange (every comparison with it is false),
    and was taken: `clear --older-than nan` removed every module, `check --tol nan` failed every run."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r}: expected a finite number", param, ctx)
        return number


def open_cache(cache_dir: str | None) -> Cache:
    if cache_dir:
        return Cache(cache_dir)
    from ..build.builder import default_cache

    return default_cache()


def csv_list(values: tuple[str, ...] | str | None, option: str | None = None) -> list[str]:
    """'64,128' / ('64', '128') / ('64,128', '256') -> ['64', '128', '256'] (order kept, no repeats).
    With ``option``: an option given with nothing in it (``--dtype ""``, ``--dtype ,``: an unset
    shell variable) is a usage error, not the default or an empty matrix."""
    if values is None:
        return []
    if isinstance(values, str):
        values = (values,)
    out: list[str] = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    if option is not None and values and not out:
        raise click.BadParameter(f"{', '.join(repr(v) for v in values)}: expected a comma list of values, got none",
                                 param_hint=option)
    return out


def parse_head_dims(values: Any, option: str) -> list[tuple[int, int]]:
    """'64,128,192/128' -> [(64, 64), (128, 128), (192, 128)]: qk head dim, or qk/vo."""
    out = []
    for v in csv_list(values, option):
        qk, slash, vo = v.partition("/")
        try:
            pair = (int(qk), int(vo if slash else qk))  # "128/" is no VO (it was taken as 128)
        except ValueError:
            raise click.BadParameter(f"{v!r}: expected a whole number or QK/VO, e.g. 128 or 192/128",
                                     param_hint=option) from None
        if min(pair) < 1:  # (the request's own check would name --head-dim-vo, an option precompile lacks)
            raise click.BadParameter(f"{v!r}: expected head dims > 0, e.g. 128 or 192/128", param_hint=option)
        if pair not in out:
            out.append(pair)
    return out


def parse_choices(values: Any, allowed: Any, option: str, default: list[str]) -> list[str]:
    out = csv_list(values, option) or default
    bad = [v for v in out if v not in allowed]
    if bad:
        raise click.BadParameter(f"{', '.join(bad)}: expected one of {', '.join(allowed)}", param_hint=option)
    return out


def parse_arch(value: str, option: str = "--arch") -> str:
    """An --arch value, canonical; a usage error naming the option (canonical_arch's ValueError
    named Python's `arch=`, with exit 1; an empty --arch was taken as not given)."""
    try:
        return canonical_arch(value, option)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def arch_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else parse_arch(value)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)



DEFAULT_ARCH = "9.0a"
"""The build target of render, demo and precompile where no --arch, VARIANTGEN_ARCH or GPU names one."""


def chosen_arch(arch: str | None, say: bool = False) -> str:
    """--arch, else the visible GPU's, else VARIANTGEN_ARCH, else DEFAULT_ARCH (with ``say``: a
    note on stderr, for commands that build what they target)."""
    if arch:
        return arch
    found = default_arch()
    if found is None and say:
        click.echo(f"note: no --arch, VARIANTGEN_ARCH or visible GPU: targeting {DEFAULT_ARCH} (Hopper); pass --arch "
                   "to choose", err=True)
    return found or DEFAULT_ARCH


def default_arch() -> str | None:
    """The visible GPU's arch, else VARIANTGEN_ARCH, else None (factory.target_arch)."""
    from ..api.factory import target_arch

    try:
        return target_arch()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken driver: say so instead of a traceback
        raise VariantgenError(f"cannot query the CUDA device ({type(e).__name__}: {e}); pass --arch") from None


# The command's generated sources and builds are modules: the flex route has none.
MODULES_ONLY = "the flex route has no module to render or build (it runs through torch; probe it with --backend flex)"


def module_config(spec: str | VariantSpec, head_dim: int, head_dim_vo: int | None, dtype: str, kv_dtype: str | None,
                   o_dtype: str | None, backend: str, arch: str, kind: str = "prefill") -> ModuleConfig:
    """The module the options name: ``backend`` "auto" is what make_wrapper picks on a GPU of
    ``arch`` (resolver.resolve); ValueError with the reasons when no module backend serves it."""
    request = Request.of(resolve_spec(spec), kind=kind,
                         head_dim_qk=head_dim, head_dim_vo=head_dim_vo, q_dtype=dtype, kv_dtype=kv_dtype,
                         o_dtype=o_dtype, backend=None if backend == "auto" else backend, names=CLI_NAMES)
    resolution = resolve(request, Site(arch=canonical_arch(arch), no_route=MODULES_ONLY))
    if not resolution:
        raise ValueError(resolution.reason)
    assert resolution.config is not None
    return resolution.config
