"""Kernel objects shared between modules: compiled once per cache, linked into every module
that needs them.

Some compile units name nothing of a spec (render.SharedUnit): the fa3 kernels of the plain
launches ('none', 'causal', 'causal + window') of every spec without a logits transform or
sink (templates/fa3/plain_variant.cuh; the value scale is the kernel's argument), and the
launch builder's plan.cu of every paged-prefill module. The kernels are most of a module's
compile time, so a library of specs would otherwise compile the same instantiation once per
spec.

Each such unit has an object key like a module's (cache.ModuleKey: a readable prefix and a hash
over the unit and the module files it includes, the templates, the flags, the versions and the
toolchain; build.py makes it). The objects live in a cache of their own under ``<cache
root>/.objects`` - the same layout, locks, staging and atomic publish as the modules, with
``unit.o`` as the entry's file, so a truncated or altered object is found by its sha256 and
rebuilt, never linked.

A module's build.ninja compiles such a unit through ``python -m variantgen.build.shared_compile``
(main below): it takes the object's lock (bounded wait), compiles the unit into the
object cache if no process has yet, and copies the object to the module's own build folder,
where the module links it. While one module's build compiles a shared unit, another waiting
for it goes on with its own units (ninja runs the wait as one more job).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ..core.errors import CacheError
from .cache import Cache, Entry, LockTimeout

OBJECTS_DIR = ".objects"  # under the cache root; hidden, so never listed as a module entry
OBJECT_FILE = "unit.o"
PLACEHOLDER = "{object}"  # in the compile command: where the compiler writes the object


def object_cache(cache: Cache) -> Cache:
    """The shared objects' cache inside a module cache."""
    return Cache(cache.root / OBJECTS_DIR)


def ensure(store: Cache, uri: str, command: list[str], out: Path, *, lock_timeout: float,
           describe: dict | None = None) -> bool:
    """Copy object ``uri`` of ``store`` to ``out``, compiling it first with ``command`` (the
    compiler's output path as PLACEHOLDER) if the store lacks it. True if this call compiled
    it. Raises LockTimeout, CacheError, or subprocess.CalledProcessError (the compiler failed;
    its output went to our stdout)."""
    found = store.lookup(uri)
    if found and _copy(found.entry.module_path, out):
        return False
    # Not there (or removed between the lookup and the copy, by `variantgen clear`): under the
    # object's lock, where nothing removes it.
    with store.lock(uri, timeout=lock_timeout):
        found = store.lookup(uri)  # another build may have published it meanwhile
        entry = found.entry if found else _compile(store, uri, command, describe or {})
        if not _copy(entry.module_path, out):
            raise CacheError(f"shared object {entry.module_path} vanished while its lock was held")
    return not found


def _copy(src: Path, out: Path) -> bool:
    """Copy ``src`` to ``out`` by a rename of a full copy; False if ``src`` is gone."""
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, out)
        return True
    except FileNotFoundError:
        if not src.exists():
            return False
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _compile(store: Cache, uri: str, command: list[str], describe: dict) -> Entry:
    """Compile object ``uri`` into a staging folder and publish it (the entry publish returns:
    its manifest has the sha256 it just computed, no need to read the object again)."""
    staging = store.new_staging(uri)
    # The compiler writes into the module's build folder (our working folder, whose path is plain:
    # build_place.py), by a relative name; the store's path may hold anything and must not reach
    # nvcc's shell. We move the object into the store's staging folder ourselves.
    local = Path(f".{uri}.{uuid.uuid4().hex[:8]}.o")
    try:
        target = staging / OBJECT_FILE
        cmd = [str(local) if arg == PLACEHOLDER else arg for arg in command]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
        shutil.move(local, target)
        return store.publish(uri, staging, {
            "module_file": OBJECT_FILE,
            **describe,
            "build_command": " ".join(cmd),
            "build_seconds": round(time.perf_counter() - t0, 2),
            "built_at": time.time(),
            "built_by_pid": os.getpid(),
            "host": socket.gethostname(),
        })
    except BaseException:
        store.discard_staging(staging)
        raise
    finally:
        local.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m variantgen.build.shared_compile",
                                     description="Compile a shared kernel unit once per cache; copy its object.")
    parser.add_argument("--store", required=True, help="the shared objects' cache folder")
    parser.add_argument("--uri", required=True, help="the object's key (prefix and hash)")
    parser.add_argument("--out", required=True, help="where the module's build wants the object")
    parser.add_argument("--lock-timeout", type=float, required=True, help="seconds to wait for another build")
    parser.add_argument("--describe", default=None, help="a JSON file of the key's parts, for the manifest")
    parser.add_argument("command", nargs=argparse.REMAINDER, help=f"-- the compile command, {PLACEHOLDER} as output")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if PLACEHOLDER not in command:
        parser.error(f"the compile command must name its output as {PLACEHOLDER}")
    describe = json.loads(Path(args.describe).read_text()) if args.describe else None
    try:
        compiled = ensure(Cache(args.store), args.uri, command, Path(args.out), lock_timeout=args.lock_timeout,
                          describe=describe)
    except subprocess.CalledProcessError as e:
        print(f"variantgen: compiling shared object {args.uri} failed (exit {e.returncode})", file=sys.stderr)
        return e.returncode or 1
    except (LockTimeout, CacheError, OSError) as e:
        print(f"variantgen: shared object {args.uri}: {e}", file=sys.stderr)
        return 1
    print(f"variantgen: shared object {args.uri} {'compiled' if compiled else 'from the cache'}", flush=True)
    return 0

