"""Module keys, URIs and the on-disk cache of built modules.

A module's URI is a readable prefix plus a short hash over named parts::

    vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_3f9c2a1b7d04
    \\_____________________ prefix ____________________________/ \\__ hash __/

The hash covers ``inputs`` (rendered sources, templates, flags, flashinfer, tvm-ffi and
variantgen versions, arch) and ``toolchain`` (nvcc and host compiler versions). Any
change gives a new URI, so a stale module is never found under a new key.

Layout of a cache root::

    <root>/<uri>/            published entry: module .so, sources, build.ninja, manifest.json
    <root>/.staging/         builds in progress (one folder per attempt)
    <root>/.failed/<uri>/    last failed build of a URI: log + sources, to reproduce
    <root>/.locks/<uri>.lock per-URI build lock (flock: released if the holder dies)

Entries are immutable once published. A build happens in ``.staging`` under the URI's
lock and is published by one ``rename``; ``manifest.json`` is written last and records
the sha256 of the module file, so a truncated or altered entry is detected on lookup and
rebuilt, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import filelock

from .errors import CacheError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
HASH_CHARS = 12


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class ModuleKey:
    """The identity of one module: readable prefix + named parts."""

    prefix: str
    inputs: tuple[tuple[str, str], ...]  # what the module computes and is built from
    toolchain: tuple[tuple[str, str], ...] = ()  # what built it (nvcc, host compiler)

    @property
    def inputs_digest(self) -> str:
        return _digest(list(self.inputs))

    @property
    def digest(self) -> str:
        return _digest({"inputs": list(self.inputs), "toolchain": list(self.toolchain)})

    @property
    def uri(self) -> str:
        return f"{self.prefix}_{self.digest[:HASH_CHARS]}"

    def explain(self) -> dict[str, str]:
        """Each named part and its value (what `variantgen list -v` shows)."""
        return {**dict(self.inputs), **{f"toolchain.{k}": v for k, v in self.toolchain}}


@dataclass(frozen=True)
class Entry:
    root: Path
    uri: str
    manifest: dict = field(hash=False, compare=False)

    @property
    def path(self) -> Path:
        return self.root / self.uri

    @property
    def module_path(self) -> Path:
        return self.path / self.manifest["module_file"]


@dataclass(frozen=True)
class Lookup:
    """Result of a cache lookup: an entry, or why there is none."""

    entry: Entry | None
    reason: str = ""

    def __bool__(self) -> bool:
        return self.entry is not None


class Cache:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()

    # -- paths
    def entry_dir(self, uri: str) -> Path:
        _check_uri(uri)
        return self.root / uri

    def lock_path(self, uri: str) -> Path:
        return self.root / ".locks" / f"{uri}.lock"

    def failed_dir(self, uri: str) -> Path:
        return self.root / ".failed" / uri

    # -- reading (never needs write access: a read-only deployed cache works)
    def lookup(self, uri: str, *, verify: bool = True) -> Lookup:
        path = self.entry_dir(uri)
        manifest_path = path / MANIFEST
        if not path.is_dir():
            return Lookup(None, "not in cache")
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            return Lookup(None, f"entry {path} has no manifest (incomplete or damaged)")
        except (OSError, ValueError) as e:
            return Lookup(None, f"entry {path} has an unreadable manifest ({e})")
        problem = _manifest_problem(manifest, uri)
        if problem:
            return Lookup(None, f"entry {path}: {problem}")
        entry = Entry(self.root, uri, manifest)
        if verify:
            module = entry.module_path
            if not module.is_file():
                return Lookup(None, f"entry {path}: module file {module.name} is missing")
            if module.stat().st_size != manifest["module_size"]:
                return Lookup(None, f"entry {path}: module file size differs from the manifest (truncated?)")
            if file_sha256(module) != manifest["module_sha256"]:
                return Lookup(None, f"entry {path}: module file hash differs from the manifest (corrupted)")
        return Lookup(entry)

    def find_same_inputs(self, prefix: str, inputs_digest: str) -> list[Entry]:
        """Entries built from the same inputs by any toolchain (JIT-disabled lookups)."""
        out = []
        if not self.root.is_dir():
            return out
        for path in sorted(self.root.glob(f"{prefix}_*")):
            found = self.lookup(path.name)
            if found and found.entry.manifest.get("inputs_digest") == inputs_digest:
                out.append(found.entry)
        return sorted(out, key=lambda e: e.manifest.get("built_at", 0), reverse=True)

    def entries(self) -> Iterator[tuple[str, Lookup]]:
        if not self.root.is_dir():
            return
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not path.is_dir():
                continue
            yield path.name, self.lookup(path.name, verify=False)

    # -- writing
    def writable(self) -> tuple[bool, str]:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"")
            probe.unlink()
            return True, ""
        except OSError as e:
            return False, f"cache directory {self.root} is not writable ({e.strerror or e})"

    @contextlib.contextmanager
    def lock(self, uri: str, timeout: float = 1800.0) -> Iterator[None]:
        """Exclusive per-URI lock. flock-based: a holder that dies releases it."""
        path = self.lock_path(uri)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cannot create lock directory {path.parent}: {e.strerror or e}") from None
        lock = filelock.FileLock(str(path), timeout=timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise CacheError(f"timed out after {timeout:.0f}s waiting for another build of {uri} "
                             f"(lock {path})") from None
        try:
            yield
        finally:
            lock.release()

    def new_staging(self, uri: str) -> Path:
        """A fresh folder for one build attempt; call with the URI's lock held."""
        staging_root = self.root / ".staging"
        staging_root.mkdir(parents=True, exist_ok=True)
        # Attempts of this URI left by killed builds: nobody else holds the lock, so
        # they are garbage.
        for old in staging_root.glob(f"{uri}.*"):
            shutil.rmtree(old, ignore_errors=True)
        path = staging_root / f"{uri}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def publish(self, uri: str, staging: Path, manifest: dict) -> Entry:
        """Write the manifest (last) and move the staging folder into place atomically."""
        module = staging / manifest["module_file"]
        manifest = dict(manifest)
        manifest.update(
            manifest_version=MANIFEST_VERSION,
            uri=uri,
            module_size=module.stat().st_size,
            module_sha256=file_sha256(module),
        )
        tmp = staging / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, staging / MANIFEST)
        target = self.entry_dir(uri)
        if target.exists():  # a damaged entry found by lookup; we hold the lock
            self._discard(target)
        os.replace(staging, target)
        return Entry(self.root, uri, manifest)

    def keep_failed(self, uri: str, staging: Path) -> Path:
        dest = self.failed_dir(uri)
        if dest.exists():
            shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, dest)
        return dest

    def remove(self, uri: str) -> bool:
        path = self.entry_dir(uri)
        if not path.exists():
            return False
        with self.lock(uri):
            self._discard(path)
        return True

    def _discard(self, path: Path) -> None:
        # Rename first so the entry disappears atomically, then delete at leisure.
        trash = self.root / ".trash" / f"{path.name}.{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _check_uri(uri: str) -> None:
    if not uri or "/" in uri or "\0" in uri or uri.startswith(".") or len(uri) > 200:
        raise CacheError(f"invalid module URI {uri!r}")


def _manifest_problem(manifest: object, uri: str) -> str | None:
    if not isinstance(manifest, dict):
        return "manifest is not a JSON object"
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        return f"manifest version {manifest.get('manifest_version')!r} is not {MANIFEST_VERSION}"
    if manifest.get("uri") != uri:
        return f"manifest names {manifest.get('uri')!r}, not this entry"
    for key, kind in (("module_file", str), ("module_sha256", str), ("module_size", int)):
        if not isinstance(manifest.get(key), kind):
            return f"manifest lacks {key}"
    if "/" in manifest["module_file"] or manifest["module_file"].startswith("."):
        return "manifest names a module file outside the entry"
    return None


def age_seconds(manifest: dict) -> float:
    return max(0.0, time.time() - float(manifest.get("built_at", time.time())))
