"""The ``variantgen`` command: validate, render, precompile, probe, list, clear, check, demo,
doctor, explain.

Errors variantgen raises on purpose (and ValueErrors from bad settings) are printed as one
``error: ...`` message on stderr with exit status 1; usage errors exit with 2 (click). Output
piped into a reader that stops early (``| head``) ends the command quietly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from .._version import __version__
from ..build.cache import Cache, LockTimeout, age_seconds, looks_like_uri, spec_of_uri
from ..build.objects import OBJECTS_DIR, object_cache
from ..codegen.render import ModuleConfig
from ..core import env
from ..core.errors import SpecError, VariantgenError, printable
from ..lang.library import resolve_spec, shipped_specs
from ..lang.values import VariantSpec
from ..routing.capabilities import BACKENDS, CLI_NAMES, KINDS, MODULE_BACKENDS, Request, Site, canonical_arch
from ..routing.resolver import resolve
from .explain import ARG_FORMS

log = logging.getLogger("variantgen.tools.cli")

LOG_LEVELS = ("debug", "info", "warning", "error")


class _Group(click.Group):
    """Turns deliberate errors into one clear line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (VariantgenError, ValueError, OSError) as e:
            if isinstance(e, OSError) and e.errno == errno.EPIPE:
                raise  # the reader went away (`| head`): click's main ends quietly
            text = str(e) if not isinstance(e, OSError) or not e.strerror else f"{e.strerror}: {e.filename}"
            click.echo(f"error: {text}", err=True)
            ctx.exit(1)


class _Folder(click.Path):
    """A folder option (click.Path, not a file). An empty value (``--cache-dir "$UNSET"``) is a
    usage error: read as "not given", it named the default cache (``clear --yes`` emptied that
    one) and ``-o ""`` printed instead of writing."""

    def __init__(self) -> None:
        super().__init__(file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail(f"{value!r}: expected a folder, got an empty value", param, ctx)
        return super().convert(value, param, ctx)


FOLDER = _Folder()


class _Finite(click.FloatRange):
    """A number >= ``min``, finite: nan passes click.FloatRange (every comparison with it is false),
    and was taken: `clear --older-than nan` removed every module, `check --tol nan` failed every run."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r}: expected a finite number", param, ctx)
        return number


def _cache(cache_dir: str | None) -> Cache:
    if cache_dir:
        return Cache(cache_dir)
    from ..build.builder import default_cache

    return default_cache()


def _csv(values: tuple[str, ...] | str | None, option: str | None = None) -> list[str]:
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


def _head_dims(values: Any, option: str) -> list[tuple[int, int]]:
    """'64,128,192/128' -> [(64, 64), (128, 128), (192, 128)]: qk head dim, or qk/vo."""
    out = []
    for v in _csv(values, option):
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


def _choices(values: Any, allowed: Any, option: str, default: list[str]) -> list[str]:
    out = _csv(values, option) or default
    bad = [v for v in out if v not in allowed]
    if bad:
        raise click.BadParameter(f"{', '.join(bad)}: expected one of {', '.join(allowed)}", param_hint=option)
    return out


def _arch(value: str, option: str = "--arch") -> str:
    """An --arch value, canonical; a usage error naming the option (canonical_arch's ValueError
    named Python's `arch=`, with exit 1; an empty --arch was taken as not given)."""
    try:
        return canonical_arch(value, option)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _arch_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else _arch(value)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                pass
    return total


DEFAULT_ARCH = "9.0a"
"""The build target of render, demo and precompile where no --arch, VARIANTGEN_ARCH or GPU names one."""


def _target_arch(arch: str | None, say: bool = False) -> str:
    """--arch, else the visible GPU's, else VARIANTGEN_ARCH, else DEFAULT_ARCH (with ``say``: a
    note on stderr, for commands that build what they target)."""
    if arch:
        return arch
    found = _default_arch()
    if found is None and say:
        click.echo(f"note: no --arch, VARIANTGEN_ARCH or visible GPU: targeting {DEFAULT_ARCH} (Hopper); pass --arch "
                   "to choose", err=True)
    return found or DEFAULT_ARCH


def _default_arch() -> str | None:
    """The visible GPU's arch, else VARIANTGEN_ARCH, else None (factory.target_arch)."""
    from ..api.factory import target_arch

    try:
        return target_arch()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken driver: say so instead of a traceback
        raise VariantgenError(f"cannot query the CUDA device ({type(e).__name__}: {e}); pass --arch") from None


# The command's generated sources and builds are modules: the flex route has none.
_MODULES_ONLY = "the flex route has no module to render or build (it runs through torch; probe it with --backend flex)"


def _module_config(spec: str | VariantSpec, head_dim: int, head_dim_vo: int | None, dtype: str, kv_dtype: str | None,
                   o_dtype: str | None, backend: str, arch: str, kind: str = "prefill") -> ModuleConfig:
    """The module the options name: ``backend`` "auto" is what make_wrapper picks on a GPU of
    ``arch`` (resolver.resolve); ValueError with the reasons when no module backend serves it."""
    request = Request.of(resolve_spec(spec), kind=kind,
                         head_dim_qk=head_dim, head_dim_vo=head_dim_vo, q_dtype=dtype, kv_dtype=kv_dtype,
                         o_dtype=o_dtype, backend=None if backend == "auto" else backend, names=CLI_NAMES)
    resolution = resolve(request, Site(arch=canonical_arch(arch), no_route=_MODULES_ONLY))
    if not resolution:
        raise ValueError(resolution.reason)
    assert resolution.config is not None
    return resolution.config


# ----------------------------------------------------------------------------- group


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="variantgen")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default=None,
              help="Logging level of the variantgen.* loggers (default: warning).")
@click.option("--cache-dir", type=FOLDER, default=None,
              help="Module cache root (sets VARIANTGEN_CACHE_DIR for this run).")
def main(log_level: str | None, cache_dir: str | None) -> None:
    """YAML attention-variant specs -> cached FlashInfer kernels.

    SPEC arguments are spec files or names of the specs shipped with variantgen
    (`variantgen specs` lists them), e.g. `variantgen demo mm_prefix`.
    """
    level = getattr(logging, (log_level or "warning").upper())
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")  # no-op if configured
    if log_level:
        logging.getLogger("variantgen").setLevel(level)
    if cache_dir:
        os.environ["VARIANTGEN_CACHE_DIR"] = str(cache_dir)
    env.reload_settings()


# ----------------------------------------------------------------------------- validate


@main.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path())
def validate(specs: tuple[str, ...]) -> None:
    """Check spec files (or shipped specs by name); print every error with its file:line:col."""
    failed = 0
    for path in specs:
        try:
            spec = resolve_spec(path)
        except SpecError as e:  # one or several (SpecErrors), each line naming the file
            failed += 1
            click.echo(str(e))
            continue
        click.echo(f"ok  {printable(path)} ({spec.name})")
        _planner_notes(spec)
    if failed:
        click.echo(f"{failed} of {len(specs)} spec file(s) have errors", err=True)
        sys.exit(1)


def _planner_notes(spec: VariantSpec) -> None:
    """Where the interval planner cannot bound the mask: a note at the mask's line saying what it
    needs and, where one exists, an equivalent form it plans (planner_notes.py)."""
    from ..planning.notes import planner_notes

    where = spec.locations.get("mask") or spec.path
    for note in planner_notes(spec):
        click.echo(f"{where}: note: {note.message}" + (f"\n  hint: {note.hint}" if note.hint else ""))


@main.command("specs")
def specs_cmd() -> None:
    """Table of the specs shipped with variantgen: pass a name wherever a spec file is accepted."""
    rows = []
    for name, path in shipped_specs().items():
        spec = resolve_spec(path)
        rows.append([name, " ".join(spec.description.split()), str(path)])
    click.echo(_table(["name", "description", "file"], rows))


# ----------------------------------------------------------------------------- render


@main.command()
@click.argument("spec", type=click.Path())
@click.option("--head-dim", type=int, required=True, help="Head dim of q/k (and v unless --head-dim-vo).")
@click.option("--head-dim-vo", type=int, default=None)
@click.option("--dtype", required=True, help="Query dtype: bf16, fp16.")
@click.option("--kv-dtype", default=None, help="KV cache dtype (default: --dtype).")
@click.option("--o-dtype", default=None, help="Output dtype (default: --dtype).")
@click.option("--backend", type=click.Choice([*MODULE_BACKENDS, "auto"]), default="auto", show_default=True,
              help="auto: what make_wrapper picks on a GPU of --arch.")
@click.option("--kind", type=click.Choice(list(KINDS)), default="prefill", show_default=True,
              help="Kernel kind.")
@click.option("--arch", default=None, callback=_arch_option,
              help=f"Target arch (default: the visible GPU, VARIANTGEN_ARCH, else {DEFAULT_ARCH}).")
@click.option("-o", "--output-dir", type=FOLDER, default=None,
              help="Write the rendered files here instead of printing.")
@click.option("--file", "file_name", default=None,
              help="File to print (default variant.cuh), or 'all'.")
def render(spec: str, head_dim: int, head_dim_vo: int | None, dtype: str, kv_dtype: str | None,
           o_dtype: str | None, backend: str, kind: str, arch: str | None, output_dir: str | None,
           file_name: str | None) -> None:
    """Print the generated variant.cuh (or write every generated file to -o DIR) of the module
    make_wrapper would build (--backend auto) or of the backend named."""
    from ..codegen.render import render_module

    config = _module_config(spec, head_dim, head_dim_vo, dtype, kv_dtype, o_dtype, backend,
                            _target_arch(arch), kind)
    rendered = render_module(config)
    if file_name not in (None, "all") and file_name not in rendered.files:
        raise click.BadParameter(f"{file_name!r}: expected 'all' or one of {', '.join(rendered.files)}",
                                 param_hint="--file")
    if output_dir:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        names = list(rendered.files) if file_name in (None, "all") else [file_name]
        for name in names:
            (out / name).write_text(rendered.files[name])
            click.echo(str(out / name))
        return
    if file_name == "all":
        for name, text in rendered.files.items():
            click.echo(f"// ===== {name} =====")
            click.echo(text, nl=not text.endswith("\n"))
        return
    text = rendered.files[file_name or "variant.cuh"]
    click.echo(text, nl=not text.endswith("\n"))


# ----------------------------------------------------------------------------- precompile


def _parse_shard(value: str | None) -> tuple[int, int]:
    if value is None:
        return 0, 1
    try:
        i_text, n_text = value.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected I/N, e.g. 0/4", param_hint="--shard") from None
    if n < 1 or not 0 <= i < n:
        raise click.BadParameter(f"{value!r}: expected 0 <= I < N (I is 0-based)", param_hint="--shard")
    return i, n


def expand_matrix(spec_paths: list[str], head_dims: list[int] | list[tuple[int, int]], dtypes: list[str],
                  kv_dtypes: list[str] | None, o_dtypes: list[str] | None, archs: list[str], backends: list[str],
                  kinds: tuple[str, ...] | list[str] = ("prefill",),
                  ) -> tuple[list[ModuleConfig], list[tuple[str, str]]]:
    """Every valid ModuleConfig of the matrix (unique, sorted by URI prefix) and the skipped
    combinations with their reason. Backend "auto": what make_wrapper picks on a GPU of that
    arch (resolver.resolve)."""
    specs = [resolve_spec(p) for p in spec_paths]
    arch_list = [canonical_arch(a) for a in archs]
    configs: dict[str, ModuleConfig] = {}
    skipped: list[tuple[str, str]] = []
    dims = [d if isinstance(d, tuple) else (d, d) for d in head_dims]
    combos = itertools.product(specs, dims, dtypes, kv_dtypes or [None], o_dtypes or [None], arch_list, backends,
                               kinds)
    for spec, (hd, hd_vo), q, kv, o, arch, backend, kind in combos:
        request = Request.of(spec, kind=kind, head_dim_qk=hd, head_dim_vo=hd_vo, q_dtype=q, kv_dtype=kv, o_dtype=o,
                             backend=None if backend == "auto" else backend, names=CLI_NAMES)
        resolution = resolve(request, Site(arch=arch, no_route=_MODULES_ONLY))
        hd_text = str(hd) if hd == hd_vo else f"{hd}/{hd_vo}"
        label = (f"{spec.name} hd={hd_text} q={request.q_dtype} kv={request.kv_dtype} o={request.o_dtype} "
                 f"arch={arch} backend={resolution.backend or backend} kind={kind}")
        if not resolution:
            skipped.append((label, resolution.why(lines=False)))
            continue
        assert resolution.config is not None
        configs.setdefault(resolution.config.uri_prefix, resolution.config)
    return [configs[k] for k in sorted(configs)], skipped


@main.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path())
@click.option("--head-dim", "head_dims", multiple=True, required=True,
              help="Comma list, e.g. 64,128,256; QK/VO for different dims, e.g. 192/128.")
@click.option("--dtype", "dtypes", multiple=True, required=True, help="Query dtypes, e.g. bf16,fp16.")
@click.option("--kv-dtype", "kv_dtypes", multiple=True, help="KV dtypes (default: the query dtype).")
@click.option("--o-dtype", "o_dtypes", multiple=True, help="Output dtypes (default: the query dtype).")
@click.option("--arch", "archs", multiple=True, help="Target archs, e.g. 8.0,9.0a "
              f"(default: the visible GPU, VARIANTGEN_ARCH, else {DEFAULT_ARCH}).")
@click.option("--backend", "backends", multiple=True,
              help="Backends: fa2, fa3, or auto (default: what make_wrapper picks for each arch and kind); flex "
                   "builds nothing.")
@click.option("--kind", "kinds", multiple=True,
              help="Kernel kinds, e.g. prefill,decode,ragged (default prefill).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Modules built in parallel.")
@click.option("--jobs-per-module", type=click.IntRange(min=1, max=env.MAX_COUNT), default=None,
              help="ninja -j within one module (default: VARIANTGEN_BUILD_JOBS or ninja's).")
@click.option("--cache-dir", type=FOLDER, default=None)
@click.option("--shard", default=None, help="I/N: build every N-th module starting at I (0-based).")
@click.option("--dry-run", is_flag=True, help="List the modules of the matrix (and this shard); build nothing.")
@click.option("--check", is_flag=True, help="Say which modules of the matrix are missing from the cache or damaged "
              "(what a server with JIT disabled would not find); build nothing; exit 1 if any.")
def precompile(specs: tuple[str, ...], head_dims: tuple[str, ...], dtypes: tuple[str, ...],
               kv_dtypes: tuple[str, ...], o_dtypes: tuple[str, ...], archs: tuple[str, ...],
               backends: tuple[str, ...], kinds: tuple[str, ...], jobs: int, jobs_per_module: int | None,
               cache_dir: str | None, shard: str | None, dry_run: bool, check: bool) -> None:
    """Build the modules of a matrix into the cache (spec x head dim x dtype x kv dtype x arch x
    backend x kind); combinations a backend does not support are listed as skipped. With
    --check: only say whether the cache holds them all (for copying it to servers)."""
    from ..build import builder as build
    from ..core.progress import BuildProgress

    if dry_run and check:
        raise click.UsageError("--dry-run and --check: pick one")
    backend_list = _choices(backends, (*BACKENDS, "auto"), "--backend", ["auto"])
    if "flex" in backend_list:
        click.echo("flex: nothing to precompile (the flex route runs torch's FlexAttention; it builds no module)")
        backend_list.remove("flex")
        if not backend_list:
            click.echo("nothing to build")
            return
    shard_i, shard_n = _parse_shard(shard)
    arch_list = [_arch(a) for a in _csv(archs, "--arch")]
    if not arch_list:
        arch_list = [_target_arch(None, say=True)]
    configs, skipped = expand_matrix(list(specs), _head_dims(head_dims, "--head-dim"), _csv(dtypes, "--dtype"),
                                     _csv(kv_dtypes, "--kv-dtype") or None, _csv(o_dtypes, "--o-dtype") or None,
                                     arch_list, backend_list,
                                     _choices(kinds, list(KINDS), "--kind", ["prefill"]))
    for label, reason in skipped:
        click.echo(f"skip  {label}: {reason}")
    if not configs:  # a gate (--check) must not pass on a matrix of nothing
        raise click.UsageError("the matrix has no module: every combination was skipped (reasons above)")
    from ..planning.rowplan import planner_configs

    # plan()'s row kernel for each spec with paged prefill modules (small: ~10 s to build)
    configs = sorted([*configs, *planner_configs(configs)], key=lambda c: c.uri_prefix)
    mine = configs[shard_i::shard_n]
    if shard_n > 1:
        click.echo(f"shard {shard_i}/{shard_n}: {len(mine)} of {len(configs)} module(s)")
    if dry_run:
        for cfg in mine:
            click.echo(cfg.uri_prefix)
        return
    if check:
        _check_matrix(mine, _cache(cache_dir))
        return
    if not mine:
        click.echo("nothing to build")
        return
    s = env.settings()
    if s.jit_disabled:
        click.echo(f"warning: JIT is disabled by {s.jit_disabled_by}; only modules already in the cache "
                   "will be found", err=True)
    cache = _cache(cache_dir)
    results: dict[str, tuple[str, str, float, str]] = {}  # prefix -> (uri, status, seconds, error)

    def module_progress(uri: str, units: int, kind: str) -> BuildProgress:
        # the summary line below stays instead of the bar; off a terminal, a line per compile unit
        return BuildProgress(uri, units, kind, leave=False, lines=jobs == 1)

    def one(cfg: ModuleConfig):
        t0 = time.perf_counter()
        try:
            r = build.build_module(cfg, cache, jobs=jobs_per_module, progress=module_progress)
        except (VariantgenError, ValueError, OSError) as e:
            return cfg, None, time.perf_counter() - t0, e
        except Exception as e:  # noqa: BLE001 - one module's surprise must not stop the others
            return cfg, None, time.perf_counter() - t0, RuntimeError(f"{type(e).__name__}: {e}")
        return cfg, r, r.seconds, None

    from tqdm import tqdm

    with tqdm(total=len(mine), desc="precompile", unit="module", file=sys.stderr, disable=None) as bar, \
            _interruptible_builds(jobs) as pool:
        futures = [pool.submit(one, cfg) for cfg in longest_first(mine)]
        for done, fut in enumerate(_completed(futures), 1):
            cfg, r, seconds, err = fut.result()
            if err is None:
                status = "built" if r.built else "cached"
                results[cfg.uri_prefix] = (r.entry.uri, status, seconds, "")
            else:
                results[cfg.uri_prefix] = (cfg.uri_prefix + "_*", "failed", seconds, str(err))
            bar.update(1)
            bar.write(f"[{done}/{len(mine)}] {results[cfg.uri_prefix][1]:6}  {results[cfg.uri_prefix][0]} "
                      f"({seconds:.1f}s)", file=sys.stderr)
    rows = [[uri, status, f"{sec:.1f}"] for uri, status, sec, _ in (results[c.uri_prefix] for c in mine)]
    click.echo(_table(["uri", "status", "seconds"], rows))
    failures: dict[str, list[str]] = {}
    for cfg in mine:
        uri, status, _, err = results[cfg.uri_prefix]
        if status == "failed":
            failures.setdefault(err, []).append(uri)
    counts = {k: sum(1 for v in results.values() if v[1] == k) for k in ("built", "cached", "failed")}
    click.echo(f"{counts['built']} built, {counts['cached']} cached, {counts['failed']} failed")
    if failures:
        for err, uris in failures.items():
            head = uris[0] if len(uris) == 1 else f"{len(uris)} modules ({', '.join(uris)})"
            click.echo(f"\nFAILED {head}:\n{err}", err=True)
        sys.exit(1)


ABORT_WAIT_S = 30.0
"""How long an interrupted precompile waits for its running builds to end their compilers."""


def _completed(futures: list[concurrent.futures.Future]) -> Iterator[concurrent.futures.Future]:
    """``futures`` as they finish; KeyboardInterrupt here, between waits, once an interrupt set
    ninja.ABORT (_interruptible_builds)."""
    from ..build import ninja

    pending = set(futures)
    while pending:
        done, pending = concurrent.futures.wait(pending, timeout=0.2, return_when=concurrent.futures.FIRST_COMPLETED)
        if ninja.ABORT.is_set():
            raise KeyboardInterrupt("interrupted")
        yield from done


@contextlib.contextmanager
def _interruptible_builds(jobs: int) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """A pool for module builds that an interrupt ends at once: Ctrl-C or SIGTERM cancels the
    builds not started, ends the running ones' ninja trees (ninja.ABORT: the worker threads get
    no signal) and their staging folders go, instead of waiting for every queued build before
    "Aborted!". The signals only set ninja.ABORT: a KeyboardInterrupt raised inside
    concurrent.futures' waiting (which holds the futures' locks) could leave a lock held, and the
    workers, then the interpreter's exit, waiting on it for ever. _completed raises the interrupt
    between waits instead."""
    from ..build import ninja

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)

    def interrupted(signum: int, frame: Any) -> None:
        ninja.ABORT.set()

    main_thread = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    ninja.ABORT.clear()
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        ninja.ABORT.set()
        ending = threading.Thread(target=pool.shutdown, name="variantgen-abort", daemon=True)
        ending.start()
        ending.join(ABORT_WAIT_S)  # bounded: running builds end their compilers at their next poll
        if not ending.is_alive():
            ninja.ABORT.clear()  # builds later in this process (an API caller's) run normally
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def longest_first(configs: list[Any]) -> list[Any]:
    """The build order of a matrix: most compile units of its own first (its units less those
    shared with other modules, objects.py), so the longest builds do not start last and
    stretch the tail while the cores idle."""

    from ..build.builder import rendered_sources

    def own_units(cfg: Any) -> int:
        try:
            r = rendered_sources(cfg)
        except Exception:  # noqa: BLE001 - the build reports it
            return 0
        return len(r.compile_units) + len(r.host_sources) - len(r.shared_units)

    return sorted(configs, key=lambda c: (-own_units(c), c.uri_prefix))


def _check_matrix(configs: list, cache: Cache) -> None:
    """precompile --check: each module's state in the cache, as a JIT-disabled server finds it."""
    from ..build.builder import lookup_module

    rows, missing = [], 0
    for cfg in configs:
        found, key, damaged = lookup_module(cfg, cache)
        if found is not None:
            by = found.entry.manifest.get("toolchain", {}).get("nvcc", "?")
            rows.append([found.entry.uri, "ok" if found.entry.uri == key.uri else f"ok (built by nvcc {by})"])
        else:
            missing += 1
            rows.append([f"{cfg.uri_prefix}_*", f"corrupted: {damaged[0]}" if damaged else "missing"])
    if rows:
        click.echo(_table(["uri", "state"], rows))
    click.echo(f"{len(configs) - missing} of {len(configs)} module(s) in {cache.root}, {missing} missing or damaged")
    if missing:
        sys.exit(1)


# ----------------------------------------------------------------------------- probe


@main.command("probe")
@click.argument("spec", type=click.Path())
@click.option("--head-dim", type=int, required=True)
@click.option("--head-dim-vo", type=int, default=None)
@click.option("--dtype", required=True, help="Query dtype.")
@click.option("--kv-dtype", default=None, help="KV dtype (default: --dtype).")
@click.option("--o-dtype", default=None)
@click.option("--backend", "backends", default="auto", show_default=True,
              help="Backend(s): auto (what make_wrapper picks here), fa2, fa3, flex (torch's FlexAttention), or "
                   "a list such as fa2,fa3,flex: one answer per backend and kind.")
@click.option("--kind", "kinds", default="prefill", show_default=True,
              help="Kernel kind(s): prefill, ragged, decode (comma list).")
@click.option("--arch", default=None, callback=_arch_option, help="The arch the GPU must have (the probe answers "
              "for this machine: to check a cache for another GPU, use `precompile ... --check`).")
@click.option("--device", default=None, help="CUDA device, e.g. cuda:1 (default: the current one).")
@click.option("--page-size", type=click.IntRange(min=1), default=None)
@click.option("--no-build", is_flag=True, help="Only look in the cache.")
@click.option("--cuda-graph", is_flag=True, help="For CUDA-graph mode (make_wrapper(graph=...)): paged prefill "
              "on fa2 and decode.")
@click.option("--cache-dir", type=FOLDER, default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def probe_cmd(spec: str, head_dim: int, head_dim_vo: int | None, dtype: str, kv_dtype: str | None,
              o_dtype: str | None, backends: str, kinds: str, arch: str | None, device: str | None,
              page_size: int | None, no_build: bool, cuda_graph: bool, cache_dir: str | None,
              as_json: bool) -> None:
    """Say whether SPEC can run here, now, or why not, per backend and kind.

    \b
    Exit status:
      0  every backend and kind asked for runs here: its FlashInfer module was found or built and
         loaded on a visible GPU, or (the flex route) torch's FlexAttention runs it on this
         machine's device, the CPU included. --backend auto answers for what make_wrapper
         would pick here, so on a CPU machine it is the flex route and exits 0.
      1  at least one cannot run here; its `reason:` says why.
      2  a usage error (an option's value)."""
    from ..api.probing import probe_backends

    try:
        parsed = resolve_spec(spec)
    except (VariantgenError, OSError, TypeError):
        parsed = None  # (the probe's answer says why)
    if parsed is not None:
        try:  # the arguments' own errors, named as typed here (the probe's reasons name Python's)
            Request.of(parsed, head_dim_qk=head_dim, head_dim_vo=head_dim_vo, q_dtype=dtype, kv_dtype=kv_dtype,
                       o_dtype=o_dtype, names=CLI_NAMES)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    results = probe_backends(
        parsed if parsed is not None else spec, kinds=tuple(_choices(kinds, list(KINDS), "--kind", ["prefill"])),
        backends=tuple(None if b == "auto" else b for b in _choices(backends, (*BACKENDS, "auto"),
                                                                   "--backend", ["auto"])), head_dim_qk=head_dim,
        head_dim_vo=head_dim_vo, q_dtype=dtype, kv_dtype=kv_dtype or dtype, o_dtype=o_dtype, page_size=page_size,
        device=device, build=not no_build, cache_dir=cache_dir, arch=arch, cuda_graph=cuda_graph)
    if as_json:
        payload = [{"backend": r.details.get("backend", b or "auto"), "kind": k, "ok": r.ok, "reason": r.reason,
                    "uri": r.uri, "source": r.source,
                    "module_path": r.module_path, "seconds": round(r.seconds, 3), "details": r.details}
                   for (b, k), r in results.items()]
        click.echo(json.dumps(payload[0] if len(payload) == 1 else payload, indent=1, default=str))
        sys.exit(0 if all(r.ok for r in results.values()) else 1)
    for i, ((b, k), r) in enumerate(results.items()):
        if len(results) > 1:
            click.echo(("\n" if i else "") + f"[{r.details.get('backend', b or 'auto')} {k}]")
        click.echo(f"ok:      {'yes' if r.ok else 'no'}")
        if not r.ok:
            click.echo(f"reason:  {r.reason}")
        click.echo(f"backend: {r.details.get('backend', b or 'auto')}")
        click.echo(f"uri:     {r.uri or '-'}")
        click.echo(f"source:  {r.source}")
        if r.module_path:
            click.echo(f"module:  {r.module_path}")
        if r.details.get("note"):
            click.echo(f"note:    {r.details['note']}")
        click.echo(f"seconds: {r.seconds:.2f}")
    sys.exit(0 if all(r.ok for r in results.values()) else 1)


# ----------------------------------------------------------------------------- list / clear


def _entry_row(uri: str, found, root: Path) -> list[str]:
    path = root / uri
    if not found:
        return [uri, "-", "-", "-", "-", _human_size(_dir_size(path)), "-", "-", "-", f"damaged: {found.reason}"]
    m = found.entry.manifest
    cfg = m.get("config", {})
    hd = f"{cfg.get('head_dim_qk', '?')}x{cfg.get('head_dim_vo', '?')}"
    dtypes = f"{cfg.get('q_dtype', '?')}/{cfg.get('kv_dtype', '?')}/{cfg.get('o_dtype', '?')}"
    backend = cfg.get("backend", "?")
    if cfg.get("kind") == "planner":  # plan()'s row kernel: one per spec and arch
        hd, dtypes, backend = "-", "-", "planner"
    return [uri, cfg.get("spec", "?"), hd, dtypes, backend, _human_size(_dir_size(path)),
            _human_age(age_seconds(m)), m.get("inputs", {}).get("flashinfer", "?"),
            m.get("toolchain", {}).get("nvcc", "?"), cfg.get("arch", "?")]


@main.command("list")
@click.option("--cache-dir", type=FOLDER, default=None)
@click.option("-v", "--verbose", is_flag=True, help="Also print every part of each module's key.")
@click.option("--no-verify", is_flag=True, help="Do not read the module files to check their sha256 (their size "
              "and the manifests are still checked).")
def list_cmd(cache_dir: str | None, verbose: bool, no_verify: bool) -> None:
    """Table of the modules in the cache; a damaged entry (truncated, corrupted, missing its module
    or manifest) says why in its last column."""
    cache = _cache(cache_dir)
    entries = list(cache.entries(verify=not no_verify))
    # Folders named like a module that variantgen did not write (no manifest, no build record):
    # a user's, left alone by `clear` too
    lookalikes = [p.name for p in cache.others() if looks_like_uri(p.name)]
    if not entries:
        click.echo(f"no modules in {cache.root}")
        _echo_lookalikes(lookalikes)
        return
    headers = ["uri", "spec", "head dims", "q/kv/o", "backend", "size", "age", "flashinfer", "nvcc", "arch"]
    rows = [_entry_row(uri, found, cache.root) for uri, found in entries]
    click.echo(_table(headers, rows))
    damaged = sum(1 for _, found in entries if not found)
    click.echo(f"{len(entries)} module(s) in {cache.root}" + (f", {damaged} damaged" if damaged else ""))
    _echo_lookalikes(lookalikes)
    shared = [found for _, found in object_cache(cache).entries(verify=False) if found]
    if shared:
        size = sum(f.entry.manifest.get("module_size", 0) for f in shared)
        click.echo(f"{len(shared)} shared kernel object(s), {size / 2**20:.1f} MiB, in "
                   f"{cache.root / OBJECTS_DIR} (only builds read them)")
    if verbose:
        for uri, found in entries:
            click.echo(f"\n{uri}")
            click.echo(f"  path: {cache.root / uri}")
            if not found:
                click.echo(f"  damaged: {found.reason}")
                continue
            m = found.entry.manifest
            for k, v in m.get("config", {}).items():
                click.echo(f"  config.{k}: {v}")
            for k, v in m.get("inputs", {}).items():
                click.echo(f"  {k}: {v}")
            for k, v in m.get("toolchain", {}).items():
                click.echo(f"  toolchain.{k}: {v}")
            if "inputs_digest" in m:
                click.echo(f"  inputs_digest: {m['inputs_digest']}")


def _echo_lookalikes(names: list[str]) -> None:
    if names:
        click.echo(f"not variantgen's (named like a module, without a manifest or build record; left alone): "
                   f"{', '.join(names)}")


@main.command()
@click.argument("spec_name", required=False)
@click.option("--older-than", type=_Finite(min=0), default=None, help="Only entries older than DAYS.")
@click.option("--cache-dir", type=FOLDER, default=None)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def clear(spec_name: str | None, older_than: float | None, cache_dir: str | None, yes: bool) -> None:
    """Remove cached modules (all, or those of SPEC_NAME / older than --older-than days).

    Only module entries are removed (folders named like a module URI: healthy ones, and damaged
    ones, which are named in a note), and without SPEC_NAME the shared kernel objects builds
    link (.objects/) and what killed builds left (staging folders, their compilers, lock files);
    anything else in the cache folder is left and listed.
    A module being built is skipped (exit 1). SPEC_NAME with no module in the cache exits 1."""
    cache = _cache(cache_dir)
    if spec_name is not None and spec_name.endswith((".yaml", ".yml")):
        spec_name = resolve_spec(spec_name).name  # a spec file: its name
    chosen: list[tuple[str, str]] = []  # (uri, why it is damaged or "")
    names: set[str] = set()
    for uri, found in cache.entries(verify=False):
        if found:
            m = found.entry.manifest
            name = m.get("config", {}).get("spec") or spec_of_uri(uri)
            age = age_seconds(m)
        else:  # damaged: judge by name and folder time
            name = spec_of_uri(uri)
            try:
                age = time.time() - (cache.root / uri).stat().st_mtime
            except OSError:
                age = 0.0
        if name:
            names.add(name)
        if spec_name is not None and name != spec_name:
            continue
        if older_than is not None and age < older_than * 86400:
            continue
        chosen.append((uri, "" if found else found.reason))
    if spec_name is not None and spec_name not in names:
        present = ", ".join(sorted(names)) or "none"
        raise VariantgenError(f"no module of spec `{spec_name}` in {cache.root} (specs with modules there: "
                              f"{present})")
    if chosen and not yes:
        click.confirm(f"remove {len(chosen)} module(s) from {cache.root}?", abort=True)
    removed, skipped = 0, []
    for uri, damaged in chosen:
        try:
            if cache.remove(uri, timeout=2.0):
                removed += 1
                if damaged:
                    click.echo(f"note: removed damaged entry {uri} ({damaged})")
        except LockTimeout as e:
            skipped.append(f"{uri} (being built by {e.holder.describe() if e.holder else 'another process'})")
    click.echo(f"removed {removed} module{'s' if removed != 1 else ''}")
    if spec_name is None:  # the shared kernel objects belong to no one spec; only builds read them
        store, dropped = object_cache(cache), 0
        for uri, found in store.entries(verify=False):
            age = age_seconds(found.entry.manifest) if found else 0.0
            if older_than is not None and found and age < older_than * 86400:
                continue
            try:
                dropped += store.remove(uri, timeout=2.0)
            except LockTimeout:
                skipped.append(f"shared object {uri} (being compiled)")
        if dropped:
            click.echo(f"removed {dropped} shared kernel object{'s' if dropped != 1 else ''} (rebuilt by the next "
                       "build that needs them)")
        from ..build.builder import discard_killed_builds

        killed = discard_killed_builds(cache)
        if killed:
            click.echo(f"removed what {killed} killed build{'s' if killed != 1 else ''} left (staging folders, lock "
                       "files)")
    others = cache.others()
    if others and spec_name is None and older_than is None:
        shown = ", ".join(p.name + ("/" if p.is_dir() else "") for p in others)
        click.echo(f"left {len(others)} item(s) in {cache.root} that are not variantgen modules: {shown}")
    if skipped:
        click.echo("skipped " + "; ".join(skipped), err=True)
        sys.exit(1)


# ----------------------------------------------------------------------------- check


@main.command()
@click.argument("spec", type=click.Path())
@click.option("--head-dim", type=int, required=True, help="Head dim of q, k and v, e.g. 128.")
@click.option("--dtype", required=True, help="Query dtype: bf16, fp16 (fp32 on the flex route).")
@click.option("--kv-dtype", default=None, help="KV cache dtype (default: --dtype).")
@click.option("--o-dtype", default=None, help="Output dtype (default: --dtype).")
@click.option("--backend", type=click.Choice([*BACKENDS, "auto"]), default="auto", show_default=True,
              help="auto: what make_wrapper picks here (on a CPU machine: flex, torch's FlexAttention).")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--qo-len", type=click.IntRange(min=1), default=128, show_default=True, help="Max queries per request.")
@click.option("--kv-len", type=click.IntRange(min=1), default=512, show_default=True, help="Max keys per request.")
@click.option("--num-qo-heads", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--num-kv-heads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--planner/--no-planner", default=False, show_default=True,
              help="Use the interval planner (skip_tiles) in plan().")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tol", type=_Finite(min=0), default=2e-2, show_default=True, help="Largest relative error accepted.")
@click.option("--cache-dir", type=FOLDER, default=None)
def check(spec: str, head_dim: int, dtype: str, kv_dtype: str | None, o_dtype: str | None, backend: str,
          batch_size: int, qo_len: int, kv_len: int, num_qo_heads: int, num_kv_heads: int, page_size: int,
          planner: bool, seed: int, tol: float, cache_dir: str | None) -> None:
    """Run SPEC on a random batch through a backend that runs here and compare it with the
    derived reference: its module on a GPU, the flex route (FlexAttention) on a CPU. Exit 0 when
    it matches, 1 when not."""
    from .check import run_check

    variant = resolve_spec(spec)  # a wrong spec is reported wherever this runs
    result = run_check(variant, head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                       backend=None if backend == "auto" else backend, batch_size=batch_size, qo_len=qo_len,
                       kv_len=kv_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                       planner=planner, seed=seed, tol=tol, cache=_cache(cache_dir), echo=click.echo)
    click.echo(result.line(batch_size, num_qo_heads, num_kv_heads))
    sys.exit(0 if result.ok else 1)



@main.command()
@click.argument("spec", type=click.Path())
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--arch", default=None, callback=_arch_option,
              help=f"Target arch (default: the visible GPU, VARIANTGEN_ARCH, else {DEFAULT_ARCH}).")
@click.pass_context
def demo(ctx: click.Context, spec: str, head_dim: int, dtype: str, arch: str | None) -> None:
    """The main job end to end: validate SPEC, render its CUDA, compile and cache the module
    (nvcc; no GPU needed), then run it against the derived reference if a GPU is present. It
    builds the fa2 module, which runs on every supported GPU (`precompile` builds what
    make_wrapper picks per arch, fa3 on sm90)."""
    from ..build.builder import build_module
    from ..codegen.render import render_module

    variant = resolve_spec(spec)
    click.echo(f"[1/4] {spec}: valid spec `{variant.name}` ({len(variant.tensors)} tensor(s), "
               f"{len(variant.scalars)} scalar(s))")
    cfg = _module_config(variant, head_dim, None, dtype, None, None, "fa2", _target_arch(arch))
    rendered = render_module(cfg)
    body = rendered.files["variant.cuh"]
    start = body.index("struct ")
    click.echo(f"[2/4] rendered {len(rendered.files)} files; the variant:\n" + body[start:start + 1800] + "\n  ...")
    from ..core.progress import BuildProgress, first_build_takes

    click.echo(f"[3/4] compiling the module with nvcc ({len(rendered.compile_units)} compile units; a first build "
               f"takes {first_build_takes('fa2')} on 16 cores, several minutes on 2; the cache serves it after)",
               err=True)
    t0 = time.perf_counter()
    result = build_module(cfg, env.settings() and _cache(None),
                          progress=lambda uri, units, kind: BuildProgress(uri, units, kind, lines=True))
    status = "built" if result.built else "found in cache"
    click.echo(f"[3/4] module {result.entry.uri} {status} in {time.perf_counter() - t0:.1f}s "
               f"({result.entry.path})")
    import torch

    if not torch.cuda.is_available():
        click.echo("[4/4] no CUDA GPU here: skipped running the kernel (run `variantgen check` on a GPU)")
        return
    click.echo("[4/4] running on the GPU against the derived reference:")
    ctx.invoke(check, spec=spec, head_dim=head_dim, dtype=dtype, planner=True, backend="fa2")  # the module built above


# ----------------------------------------------------------------------------- explain


@main.command(epilog="\b\nSpec arguments: " + ARG_FORMS)
@click.argument("spec", type=click.Path())
@click.option("--qo", "qo_len", type=int, default=8, show_default=True, help="Queries of the request.")
@click.option("--kv", "kv_len", type=int, default=None, help="Keys of the request, cached ones included "
              "(default: --qo); the queries are the last --qo of them.")
@click.option("--arg", "arg_items", multiple=True, metavar="NAME=VALUE", help="A spec argument (repeatable; "
              "forms below).")
@click.option("--page-size", type=int, default=16, show_default=True, help="KV page size the planner aligns to.")
@click.option("--heads", type=int, default=1, show_default=True, help="Query heads (num_qo_heads).")
@click.option("--head", type=int, default=0, show_default=True, help="The query head whose mask is shown.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random tensors not given.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: keys_read, keys_visible (per launch class too), "
              "the terms and launch requests, and the grid for small requests.")
def explain(spec: str, qo_len: int, kv_len: int | None, arg_items: tuple[str, ...], page_size: int, heads: int,
            head: int, seed: int, as_json: bool) -> None:
    """Show SPEC's mask for one request as a grid (queries x keys), the key intervals the planner
    derives per row, which rows run dense / causal / window / custom, and the cost: keys the
    launches read against keys the mask shows - on the CPU. Requests of up to 65536 tokens; the
    grid is drawn up to 256."""
    from . import explain as ex

    variant = resolve_spec(spec)
    kv = qo_len if kv_len is None else kv_len
    ex.check_request(qo_len, kv, page_size=page_size, heads=heads, head=head)
    args = ex.resolve_args(variant, arg_items, qo_len, kv, heads, seed)
    e = ex.explain(variant, qo_len, kv, args, page_size=page_size, head=head, heads=heads)
    click.echo(json.dumps(ex.to_json(e), indent=1) if as_json else ex.render(e))


# ----------------------------------------------------------------------------- doctor


@main.command()
@click.option("--need", "needs", default=None,
              help="What this machine is for, comma list of build, run, gpu, flex: exit 0 only if it can do all of "
                   "it. run: a spec runs here on either route (FlashInfer modules on a GPU, or the flex route, "
                   "FlexAttention, on any device); gpu: FlashInfer modules run here; flex: the flex route runs "
                   "here. Default: run, and build too where a GPU runs modules and JIT is on. A build box: "
                   "--need build; a GPU server: --need gpu.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(needs: str | None, as_json: bool) -> None:
    """Check that this machine can build modules (FlashInfer, nvcc, host compilers, ninja, CUDA
    and FlashInfer headers, a writable cache) and run specs (FlashInfer modules on a GPU, the flex
    route anywhere); each line says ok / missing and the fix. Builds nothing. Takes 10-20 s: it
    runs nvcc and the compilers and renders a module to find the headers it includes."""
    from . import doctor as doc

    if needs is not None:
        _choices(needs, doc.NEEDS, "--need", [])  # a usage error before the slow checks
    click.echo("checking the toolchain, FlashInfer's headers, the cache and the GPU (10-20 s)...", err=True)
    report = doc.run_checks()
    default = [doc.RUN] + ([doc.BUILD] if report.can(doc.GPU) and not env.settings().jit_disabled else [])
    wanted = tuple(_choices(needs, doc.NEEDS, "--need", default))
    ok = all(report.can(what) for what in wanted)
    if as_json:
        click.echo(json.dumps({"checks": [dict(name=c.name, status=c.status, detail=c.detail, fix=c.fix,
                                               needed_for=list(c.needed_for)) for c in report.checks],
                               "can_build": report.can(doc.BUILD), "can_run": report.can(doc.RUN),
                               "can_run_modules": report.can(doc.GPU), "can_run_flex": report.can(doc.FLEX),
                               "needed": list(wanted), "ok": ok}, indent=1))
    else:
        click.echo(doc.render(report, wanted))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # pragma: no cover
    main()
