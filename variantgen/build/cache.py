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
    <root>/.failed/<uri>/    last failed build of a URI: log + sources + failure.json, to reproduce
    <root>/.locks/<uri>.lock per-URI build lock while a build runs (flock, released if the holder
                             dies; holds the holder's pid, host and start time; removed on release)
    <root>/.objects/         compile units shared between modules (objects.py): a cache of the
                             same layout, an object file per entry; only builds read it

Entries are immutable once published. A build happens in ``.staging`` under the URI's
lock and is published by one ``rename``; ``manifest.json`` is written last and records
the sha256 of the module file, so a truncated or altered entry is detected on lookup and
rebuilt, never loaded. Only folders named like a URI are entries: anything else a user
keeps in the cache root is listed as such and never removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import CacheError
from ..core.safe_read import lstat_kind, open_regular, read_text_bounded

log = logging.getLogger("variantgen.build.cache")
MANIFEST = "manifest.json"
FAILURE = "failure.json"
MANIFEST_VERSION = 1
HASH_CHARS = 12
# What ModuleConfig.uri_prefix / PlannerConfig.uri_prefix produce, plus the hash: only such
# folders are treated as entries (listed, verified, removed by `variantgen clear`).
URI_RE = re.compile(rf"^vg_[a-z][a-z0-9_]*_sm[0-9]+a?_[0-9a-f]{{{HASH_CHARS}}}$")
_SPEC_OF_URI = re.compile(r"^vg_([a-z][a-z0-9_]*?)_(?:fa[0-9]+_[a-z]+_q|planner_sm)")


def looks_like_uri(name: str) -> bool:
    """Whether a folder name is one of our module URIs (published or damaged)."""
    return bool(URI_RE.match(name))


def spec_of_uri(name: str) -> str | None:
    """The spec name inside a module URI (for entries whose manifest cannot be read)."""
    m = _SPEC_OF_URI.match(name)
    return m.group(1) if m else None


def path_error(e: OSError, path: Path | str, doing: str) -> CacheError:
    """A CacheError naming the path and what failed (an OSError from write() has no file name:
    a full disk gave `[Errno 28] No space left on device` and nothing else)."""
    why = e.strerror or str(e)
    hint = " (free space on that file system)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return CacheError(f"cannot {doing} {path}: {why}{hint}")


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read_json(path: Path) -> Any:
    """A JSON file's value: OSError if it cannot be read or is no regular file of a bounded size
    (a FIFO hung `list` and lookups, a link to /dev/zero ran out of memory: safe_read.py),
    ValueError if it is not JSON - nested too deeply included (``[[[[...``: json raised
    RecursionError, a traceback from `variantgen list` and from every lookup of the entry)."""
    text = read_text_bounded(path)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(open_regular(path), "rb") as f:  # a regular file, not a link: never a FIFO or a device
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
        # Absolute once: ninja runs in a staging folder (`ninja -C`), where a relative root
        # would name another folder, and a later chdir must not move the cache.
        self.root = Path(os.path.abspath(Path(root).expanduser()))

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
        """The entry ``uri`` if its manifest is valid and its module file is the one the manifest
        describes: present and of the recorded size always, of the recorded sha256 with
        ``verify`` (reads the file: ~1 ms per MiB)."""
        path = self.entry_dir(uri)
        manifest_path = path / MANIFEST
        if path.is_symlink():  # variantgen never makes one; its target may lie anywhere
            return Lookup(None, f"entry {path} is a symbolic link (not followed)")
        if not path.is_dir():
            return Lookup(None, "not in cache")
        try:
            manifest = _read_json(manifest_path)
        except FileNotFoundError:
            return Lookup(None, f"entry {path} has no manifest (incomplete or damaged)")
        except OSError as e:
            return Lookup(None, f"entry {path} has an unreadable manifest ({MANIFEST} {e.strerror or e})")
        except ValueError as e:
            return Lookup(None, f"entry {path} has an unreadable manifest ({e})")
        problem = _manifest_problem(manifest, uri)
        if problem:
            return Lookup(None, f"entry {path}: {problem}")
        entry = Entry(self.root, uri, manifest)
        module = entry.module_path
        kind = lstat_kind(module)  # not followed: the loader must read this very file
        if kind == "missing":
            return Lookup(None, f"entry {path}: module file {module.name} is missing")
        if kind is not None:
            return Lookup(None, f"entry {path}: module file {module.name} is {kind}, not a regular file")
        try:
            size = module.stat().st_size
        except OSError as e:
            return Lookup(None, f"entry {path}: module file {module.name} is unreadable ({e.strerror or e})")
        if size != manifest["module_size"]:
            return Lookup(None, f"entry {path}: module file size differs from the manifest (truncated?)")
        if verify:
            try:
                sha = file_sha256(module)
            except OSError as e:
                return Lookup(None, f"entry {path}: module file {module.name} is unreadable ({e.strerror or e})")
            if sha != manifest["module_sha256"]:
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

    def damaged_same_inputs(self, prefix: str, inputs_digest: str) -> list[str]:
        """Why entries of ``prefix`` that may hold these inputs are unusable: their manifest names
        these inputs but the module fails verification, or the manifest is unreadable."""
        out = []
        if not self.root.is_dir():
            return out
        for path in sorted(self.root.glob(f"{prefix}_*")):
            if not path.is_dir() or not looks_like_uri(path.name):
                continue
            found = self.lookup(path.name)
            if found:
                continue
            try:
                digest = _read_json(path / MANIFEST).get("inputs_digest")
            except (OSError, ValueError, AttributeError):
                digest = None  # cannot tell which inputs: it may be this module
            if digest in (None, inputs_digest):
                out.append(found.reason)
        return out

    def entries(self, *, verify: bool = True) -> Iterator[tuple[str, Lookup]]:
        """Every entry variantgen wrote (is_ours), with its lookup (a damaged entry says why)."""
        for path in self._top_level():
            if self.is_ours(path.name):
                yield path.name, self.lookup(path.name, verify=verify)

    def others(self) -> list[Path]:
        """What else lies in the cache root (not an entry, not one of our hidden folders): a
        user's files, a README, a folder that only looks like an entry. Listed, never removed."""
        return [p for p in self._top_level() if not self.is_ours(p.name)]

    def is_ours(self, name: str) -> bool:
        """Whether top-level folder ``name`` is an entry variantgen wrote: named like a URI, a real
        folder (not a link), and holding what a build writes (a manifest or its build.ninja), or
        named by a failure record, a staging folder or a lock file of that URI. A user's folder
        whose name merely looks like a URI (``vg_mydata_sm90a_0123456789ab``) is none of these:
        `clear` removed it as a "damaged entry"."""
        if not looks_like_uri(name):
            return False
        path = self.root / name
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return False
        except OSError:
            return False
        return (_written_by_us(path) or os.path.lexists(self.failed_dir(name) / FAILURE)
                or os.path.lexists(self.lock_path(name)) or bool(self.attempts(name)))

    def _top_level(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if not p.name.startswith("."))

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
    def lock(self, uri: str, timeout: float = 1800.0, *,
             on_wait: Callable[[LockHolder | None], None] | None = None,
             check: Callable[[], None] | None = None) -> Iterator[None]:
        """Exclusive per-URI lock for ``timeout`` seconds at most (then LockTimeout, which names
        the holder). ``on_wait(holder)`` is called once if another process holds it; ``check()``
        between tries (it may raise to stop waiting: an interrupted build)."""
        path = self.lock_path(uri)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cannot create lock directory {path.parent}: {e.strerror or e}") from None
        fd = _acquire(path, uri, timeout, on_wait, check)
        try:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                          "uri": uri}).encode(), 0)
            except OSError:
                pass  # the holder's description is for waiters' messages; the flock is what counts
            yield
        finally:
            # Unlink while still holding it: a waiter that opened this file sees it replaced
            # (another inode, or none) and tries again, so no lock file outlives its build.
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)

    def holder(self, uri: str) -> LockHolder | None:
        """Who holds ``uri``'s lock now (None if nobody, or nobody said)."""
        return _read_holder(self.lock_path(uri))

    def attempts(self, uri: str) -> list[Path]:
        """Staging folders of ``uri`` (builds in progress, or left by killed builds)."""
        staging_root = self.root / ".staging"
        return sorted(staging_root.glob(f"{uri}.*")) if staging_root.is_dir() else []

    def in_flight(self) -> list[str]:
        """URIs with a staging folder or a lock file: built now, or left so by a killed build (its
        staging folder stays until the next build of the URI; its lock file until the next lock)."""
        uris = set()
        for folder, suffix in ((".staging", None), (".locks", ".lock")):
            with contextlib.suppress(OSError):
                for p in (self.root / folder).iterdir():
                    uri = p.name.split(".", 1)[0] if suffix is None else p.name.removesuffix(suffix)
                    if looks_like_uri(uri):
                        uris.add(uri)
        return sorted(uris)

    def new_staging(self, uri: str) -> Path:
        """A fresh folder for one build attempt; call with the URI's lock held."""
        staging_root = self.root / ".staging"
        try:
            staging_root.mkdir(parents=True, exist_ok=True)
            # Attempts of this URI left by killed builds: nobody else holds the lock, so
            # they are garbage.
            for old in self.attempts(uri):
                shutil.rmtree(old, ignore_errors=True)
            path = staging_root / f"{uri}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            path.mkdir()
        except OSError as e:
            raise path_error(e, e.filename or staging_root, "create the staging folder") from None
        return path

    def discard_staging(self, staging: Path) -> None:
        """Remove a build attempt that will not be published (failed to write, interrupted)."""
        shutil.rmtree(staging, ignore_errors=True)

    def publish(self, uri: str, staging: Path, manifest: dict) -> Entry:
        """Write the manifest (last) and move the staging folder into place atomically.
        CacheError naming the path if a write fails (a full disk); the caller discards the
        staging folder."""
        module = staging / manifest["module_file"]
        manifest = dict(manifest)
        tmp = staging / (MANIFEST + ".tmp")
        target = self.entry_dir(uri)
        where: Path = module
        try:
            manifest.update(
                manifest_version=MANIFEST_VERSION,
                uri=uri,
                module_size=module.stat().st_size,
                module_sha256=file_sha256(module),
            )
            where = tmp
            with open(tmp, "w") as f:
                f.write(json.dumps(manifest, indent=1, sort_keys=True))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, staging / MANIFEST)
            where = target
            if os.path.lexists(target):  # a damaged entry found by lookup; we hold the lock
                if target.is_symlink() or not _written_by_us(target):
                    raise CacheError(f"cannot publish module {uri}: {target} exists and is not a variantgen entry "
                                     "(no manifest, no build.ninja); move it out of the cache folder")
                self._discard(target)
            os.replace(staging, target)
        except OSError as e:
            raise path_error(e, where, "publish module file" if where == module else "write") from None
        return Entry(self.root, uri, manifest)

    def keep_failed(self, uri: str, staging: Path, failure: dict | None = None) -> Path:
        """Move a failed attempt to ``.failed/<uri>`` (what reproduces it: log, sources, ninja
        file; not the objects) with ``failure.json`` describing it (FailureRecord fields)."""
        dest = self.failed_dir(uri)
        shutil.rmtree(staging / "obj", ignore_errors=True)  # bulky, and rebuilt by a re-run
        try:
            if dest.exists():
                shutil.rmtree(dest, ignore_errors=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, dest)
        except OSError as e:
            self.discard_staging(staging)
            raise path_error(e, dest, "keep the failed build in") from None
        if failure is not None:
            record = dict(failure, uri=uri, pid=os.getpid(), host=socket.gethostname(), failed_at=time.time(),
                          log_path=str(dest / "build.log"))
            with contextlib.suppress(OSError):  # without it, waiters build again: slower, not wrong
                (dest / FAILURE).write_text(json.dumps(record, indent=1, sort_keys=True))
        return dest

    def failure(self, uri: str) -> FailureRecord | None:
        """The last failed build of ``uri``, if one was recorded."""
        try:
            data = _read_json(self.failed_dir(uri) / FAILURE)
            return FailureRecord(uri=str(data["uri"]), key_digest=str(data["key_digest"]), pid=int(data["pid"]),
                                 host=str(data["host"]), failed_at=float(data["failed_at"]),
                                 message=str(data["message"]), first_error=data.get("first_error"),
                                 log_path=str(data["log_path"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remove(self, uri: str, *, timeout: float = 1800.0) -> bool:
        """Remove entry ``uri`` (under its lock: not while it is being built). A folder that is
        not variantgen's (is_ours) is left: CacheError."""
        path = self.entry_dir(uri)
        if not os.path.lexists(path):
            return False
        if not self.is_ours(uri):  # judged before our own lock file exists
            raise CacheError(f"{path} is not a variantgen entry (no manifest, no build record); not removed")
        with self.lock(uri, timeout=timeout):
            if not path.exists():  # removed by another process while we waited for the lock
                return False
            self._discard(path)
        return True

    def _discard(self, path: Path) -> None:
        # Rename first so the entry disappears atomically, then delete at leisure.
        trash = self.root / ".trash" / f"{path.name}.{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


@dataclass(frozen=True)
class LockHolder:
    """What a build lock's holder wrote into it."""

    pid: int
    host: str
    since: float

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host} since {started} ({max(0.0, time.time() - self.since):.0f}s)"


class LockTimeout(CacheError):
    """Another process held a module's build lock for longer than the caller waits."""

    def __init__(self, message: str, *, uri: str, holder: LockHolder | None, waited: float):
        super().__init__(message)
        self.uri = uri
        self.holder = holder
        self.waited = waited


@dataclass(frozen=True)
class FailureRecord:
    """A failed build, as kept in ``.failed/<uri>/failure.json``."""

    uri: str
    key_digest: str
    pid: int
    host: str
    failed_at: float
    message: str
    first_error: str | None
    log_path: str


def _read_holder(path: Path) -> LockHolder | None:
    try:
        data = _read_json(path)
        return LockHolder(int(data["pid"]), str(data["host"]), float(data["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _acquire(path: Path, uri: str, timeout: float, on_wait: Callable[[LockHolder | None], None] | None,
             check: Callable[[], None] | None = None) -> int:
    """Open and flock ``path`` within ``timeout`` seconds; the fd of the locked file."""
    start = time.monotonic()
    delay, told = 0.01, False
    while True:
        try:
            fd = _open_lock(path)
        except OSError as e:
            raise path_error(e, path, "open the build lock") from None
        if fd is None:
            continue  # something other than a lock file was there; removed
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            waited = time.monotonic() - start
            holder = _read_holder(path)
            if not told and on_wait is not None:
                on_wait(holder)
                told = True
            if check is not None:
                check()
            if waited >= timeout:
                who = f"held by {holder.describe()}" if holder else "held by another process"
                raise LockTimeout(f"timed out after {timeout:.0f}s waiting for another build of {uri} "
                                  f"({who}; lock {path})", uri=uri, holder=holder, waited=waited) from None
            time.sleep(min(delay, max(timeout - waited, 0.0)))
            delay = min(delay * 2, 0.25)
            continue
        except OSError as e:
            os.close(fd)
            raise path_error(e, path, "lock") from None
        # The previous holder unlinks the file before releasing it: if ours is no longer the
        # file at ``path``, lock the one that is.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _written_by_us(path: Path) -> bool:
    """Whether entry folder ``path`` holds a file every build writes into it (whatever state
    that file is in: a damaged manifest still marks the folder as ours)."""
    return os.path.lexists(path / MANIFEST) or os.path.lexists(path / "build.ninja")


def _open_lock(path: Path) -> int | None:
    """The lock file's descriptor, the file created if missing; None after removing something
    that is no lock file (a link, a FIFO: variantgen only ever creates regular files there, and
    opening a link would lock its target, a FIFO or /dev/zero would hang or fill a reader)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        fd = None
    if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    if fd is not None:
        os.close(fd)
    kind = lstat_kind(path)
    log.warning("removing %s: %s where a build lock file belongs", path, kind)
    try:
        if kind == "a folder":
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    return None


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
    # Optional fields readers use (list, clear, --check, JIT-off lookups): of the type they expect
    # if present, so a hand-edited manifest is a damaged entry, not a crash of its reader.
    for key, kind, what in _OPTIONAL_FIELDS:
        if key in manifest and not kind(manifest[key]):
            return f"manifest field {key!r} is {json.dumps(manifest[key])[:40]}, not {what}"
    return None


def _string_map(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


_OPTIONAL_FIELDS: tuple[tuple[str, Callable[[object], bool], str], ...] = (
    ("config", lambda v: isinstance(v, dict) and isinstance(v.get("spec", ""), str),
     "an object naming its spec as a string"),
    ("inputs", _string_map, "an object of strings"),
    ("toolchain", _string_map, "an object of strings"),
    ("shared_objects", _string_map, "an object of strings"),
    ("inputs_digest", lambda v: isinstance(v, str), "a string"),
    ("key_digest", lambda v: isinstance(v, str), "a string"),
    ("built_at", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
     "a time in seconds"),
)


def age_seconds(manifest: dict) -> float:
    return max(0.0, time.time() - float(manifest.get("built_at", time.time())))
