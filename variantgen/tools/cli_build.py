"""The ``variantgen`` commands of building and the cache: precompile (a matrix of modules,
built in parallel, longest first, interruptible), list and clear."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from ..build.cache import Cache, LockTimeout, age_seconds, looks_like_uri, spec_of_uri
from ..build.objects import OBJECTS_DIR, object_cache
from ..codegen.render import ModuleConfig
from ..core import env
from ..core.errors import VariantgenError
from ..lang.library import resolve_spec
from ..routing.capabilities import BACKENDS, CLI_NAMES, KINDS, Request, Site, canonical_arch
from ..routing.resolver import resolve
from .cli_options import (
    DEFAULT_ARCH,
    FOLDER,
    MODULES_ONLY,
    Finite,
    chosen_arch,
    csv_list,
    open_cache,
    parse_arch,
    parse_choices,
    parse_head_dims,
    table,
)

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
        resolution = resolve(request, Site(arch=arch, no_route=MODULES_ONLY))
        hd_text = str(hd) if hd == hd_vo else f"{hd}/{hd_vo}"
        label = (f"{spec.name} hd={hd_text} q={request.q_dtype} kv={request.kv_dtype} o={request.o_dtype} "
                 f"arch={arch} backend={resolution.backend or backend} kind={kind}")
        if not resolution:
            skipped.append((label, resolution.why(lines=False)))
            continue
        assert resolution.config is not None
        configs.setdefault(resolution.config.uri_prefix, resolution.config)
    return [configs[k] for k in sorted(configs)], skipped


@click.command()
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
    backend_list = parse_choices(backends, (*BACKENDS, "auto"), "--backend", ["auto"])
    if "flex" in backend_list:
        click.echo("flex: nothing to precompile (the flex route runs torch's FlexAttention; it builds no module)")
        backend_list.remove("flex")
        if not backend_list:
            click.echo("nothing to build")
            return
    shard_i, shard_n = _parse_shard(shard)
    arch_list = [parse_arch(a) for a in csv_list(archs, "--arch")]
    if not arch_list:
        arch_list = [chosen_arch(None, say=True)]
    configs, skipped = expand_matrix(list(specs), parse_head_dims(head_dims, "--head-dim"), csv_list(dtypes, "--dtype"),
                                     csv_list(kv_dtypes, "--kv-dtype") or None, csv_list(o_dtypes, "--o-dtype") or None,
                                     arch_list, backend_list,
                                     parse_choices(kinds, list(KINDS), "--kind", ["prefill"]))
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
        _check_matrix(mine, open_cache(cache_dir))
        return
    if not mine:
        click.echo("nothing to build")
        return
    s = env.settings()
    if s.jit_disabled:
        click.echo(f"warning: JIT is disabled by {s.jit_disabled_by}; only modules already in the cache "
                   "will be found", err=True)
    cache = open_cache(cache_dir)
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
    click.echo(table(["uri", "status", "seconds"], rows))
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
        click.echo(table(["uri", "state"], rows))
    click.echo(f"{len(configs) - missing} of {len(configs)} module(s) in {cache.root}, {missing} missing or damaged")
    if missing:
        sys.exit(1)


# ----------------------------------------------------------------------------- list / clear


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


@click.command("list")
@click.option("--cache-dir", type=FOLDER, default=None)
@click.option("-v", "--verbose", is_flag=True, help="Also print every part of each module's key.")
@click.option("--no-verify", is_flag=True, help="Do not read the module files to check their sha256 (their size "
              "and the manifests are still checked).")
def list_cmd(cache_dir: str | None, verbose: bool, no_verify: bool) -> None:
    """Table of the modules in the cache; a damaged entry (truncated, corrupted, missing its module
    or manifest) says why in its last column."""
    cache = open_cache(cache_dir)
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
    click.echo(table(headers, rows))
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


@click.command()
@click.argument("spec_name", required=False)
@click.option("--older-than", type=Finite(min=0), default=None, help="Only entries older than DAYS.")
@click.option("--cache-dir", type=FOLDER, default=None)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def clear(spec_name: str | None, older_than: float | None, cache_dir: str | None, yes: bool) -> None:
    """Remove cached modules (all, or those of SPEC_NAME / older than --older-than days).

    Only module entries are removed (folders named like a module URI: healthy ones, and damaged
    ones, which are named in a note), and without SPEC_NAME the shared kernel objects builds
    link (.objects/) and what killed builds left (staging folders, their compilers, lock files);
    anything else in the cache folder is left and listed.
    A module being built is skipped (exit 1). SPEC_NAME with no module in the cache exits 1."""
    cache = open_cache(cache_dir)
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
