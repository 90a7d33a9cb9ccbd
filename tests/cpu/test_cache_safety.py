"""What a cache folder may hold that variantgen did not write, and how it is treated: a user's
folder named like a module is not an entry (`clear` leaves it); FIFOs, links to /dev/zero, huge
files and links out of the cache where a manifest, failure record or lock file belongs are
damaged entries (or replaced lock files), found in bounded time, never read without end; and
the build lock's re-check of the file it locked.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

import _cache_procs as procs
import pytest
from click.testing import CliRunner

from variantgen.build import cache as cache_mod
from variantgen.build.cache import Cache, LockTimeout, ModuleKey
from variantgen.core.errors import CacheError
from variantgen.core.safe_read import MAX_RECORD_BYTES, read_bounded
from variantgen.tools.cli import main

KEY = ModuleKey("vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a",
                (("sources", "s" * 64), ("arch", "9.0a")), (("nvcc", "V12.8.93"),))
LOOKALIKE = "vg_mydata_sm90a_0123456789ab"
BOUND_S = 10.0


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / "cache")


def bounded(fn, timeout: float = BOUND_S):
    """``fn()``'s value; fails (rather than hanging the suite) if it takes longer than ``timeout``."""
    out: list = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = threading.Thread(target=call, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout}s"
    assert time.monotonic() - t0 < timeout
    if errors:
        raise errors[0]
    return out[0]


def cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def user_folder(cache: Cache) -> Path:
    folder = cache.root / LOOKALIKE
    folder.mkdir(parents=True)
    (folder / "data.bin").write_bytes(b"precious")
    return folder


# ----------------------------------------------------------------------------- whose entries


def test_clear_leaves_a_users_folder_named_like_a_module(cache):
    """`clear --yes` removed vg_mydata_sm90a_0123456789ab/ ("removed damaged entry"): a folder
    without a manifest or a build record is not variantgen's, whatever its name."""
    folder = user_folder(cache)
    entry = procs.publish_fake(cache, KEY)
    r = cli("clear", "--yes", "--cache-dir", cache.root)
    assert r.exit_code == 0, r.output
    assert (folder / "data.bin").read_bytes() == b"precious"
    assert "damaged" not in r.output and "removed 1 module\n" in r.output
    assert f"not variantgen modules: {LOOKALIKE}/" in r.output
    assert not entry.path.exists()


def test_list_names_a_lookalike_as_not_variantgens(cache):
    user_folder(cache)
    assert [uri for uri, _ in cache.entries()] == []
    assert [p.name for p in cache.others()] == [LOOKALIKE]
    r = cli("list", "--cache-dir", cache.root)
    assert r.exit_code == 0, r.output
    assert f"no modules in {cache.root}" in r.output and "damaged" not in r.output
    assert f"not variantgen's (named like a module, without a manifest or build record; left alone): {LOOKALIKE}" \
        in r.output
    procs.publish_fake(cache, KEY)
    r = cli("list", "--cache-dir", cache.root)
    assert "1 module(s) in" in r.output and f"left alone): {LOOKALIKE}" in r.output


@pytest.mark.parametrize("record", ["manifest", "failure", "lock", "staging"])
def test_a_damaged_entry_is_still_ours(cache, record):
    """A folder variantgen wrote stays an entry when its manifest is damaged or gone, if a record
    of ours names its URI: the manifest (even unreadable), a failure record, a lock file or a
    staging folder."""
    folder = cache.root / KEY.uri
    folder.mkdir(parents=True)
    if record == "manifest":
        (folder / cache_mod.MANIFEST).write_text("{not json")
    elif record == "failure":
        cache.failed_dir(KEY.uri).mkdir(parents=True)
        (cache.failed_dir(KEY.uri) / cache_mod.FAILURE).write_text("{}")
    elif record == "lock":
        cache.lock_path(KEY.uri).parent.mkdir(parents=True)
        cache.lock_path(KEY.uri).write_text("{}")
    else:
        cache.new_staging(KEY.uri)
    assert cache.is_ours(KEY.uri)
    [(uri, found)] = list(cache.entries())
    assert uri == KEY.uri and not found
    assert cache.remove(KEY.uri, timeout=1) and not folder.exists()


def test_remove_refuses_a_folder_that_is_not_ours(cache):
    folder = user_folder(cache)
    with pytest.raises(CacheError, match=f"{LOOKALIKE} is not a variantgen entry .*; not removed"):
        cache.remove(LOOKALIKE)
    assert (folder / "data.bin").exists()


def test_a_build_does_not_replace_a_users_folder_of_its_uri(cache):
    """Publishing replaces a damaged entry, not a folder of someone else's that has its name."""
    folder = cache.root / KEY.uri
    folder.mkdir(parents=True)
    (folder / "mine.txt").write_text("x")
    with pytest.raises(CacheError, match="exists and is not a variantgen entry"):
        procs.publish_fake(cache, KEY)
    assert (folder / "mine.txt").read_text() == "x"


def test_a_linked_entry_is_not_followed(cache, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    entry = procs.publish_fake(Cache(elsewhere), KEY)
    cache.root.mkdir(parents=True)
    (cache.root / KEY.uri).symlink_to(entry.path)
    assert list(cache.entries()) == [] and [p.name for p in cache.others()] == [KEY.uri]
    found = cache.lookup(KEY.uri)
    assert not found and found.reason == f"entry {cache.root / KEY.uri} is a symbolic link (not followed)"


# ----------------------------------------------------------------------------- what a record may be


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _huge(path: Path) -> None:
    with open(path, "wb") as f:  # sparse: no disk used
        f.truncate(4 << 30)


def _link_out(path: Path) -> None:
    outside = path.parent.parent.parent / "outside.json"
    outside.write_text(json.dumps({"manifest_version": 1}))
    path.symlink_to(outside)


HOSTILE = {"fifo": (_fifo, "is a FIFO, not a regular file"),
           "dev_zero": (_dev_zero, "is a symbolic link (not followed)"),
           "huge": (_huge, f"is {4 << 30} bytes, more than the {MAX_RECORD_BYTES} a record may hold"),
           "link_out": (_link_out, "is a symbolic link (not followed)")}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_manifest_is_a_damaged_entry_found_in_bounded_time(cache, kind):
    """A FIFO as manifest.json hung `list`, the JIT-off probe and every lookup forever; a link to
    /dev/zero ended `list` in a MemoryError."""
    make, why = HOSTILE[kind]
    entry = procs.publish_fake(cache, KEY)
    (entry.path / cache_mod.MANIFEST).unlink()
    make(entry.path / cache_mod.MANIFEST)
    found = bounded(lambda: cache.lookup(KEY.uri))
    assert not found and found.reason == f"entry {entry.path} has an unreadable manifest (manifest.json {why})"
    assert bounded(lambda: cache.find_same_inputs(KEY.prefix, KEY.inputs_digest)) == []
    assert bounded(lambda: cache.damaged_same_inputs(KEY.prefix, KEY.inputs_digest)) == [found.reason]
    r = bounded(lambda: cli("list", "--cache-dir", cache.root))
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "1 module(s) in" in r.output and "1 damaged" in r.output and why in r.output
    r = bounded(lambda: cli("clear", "--yes", "--cache-dir", cache.root))
    assert r.exit_code == 0 and "note: removed damaged entry" in r.output, r.output
    assert not os.path.lexists(entry.path)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "link_out"])
def test_a_module_file_that_is_no_regular_file_is_damaged(cache, kind):
    make, _ = HOSTILE[kind]
    entry = procs.publish_fake(cache, KEY)
    entry.module_path.unlink()
    make(entry.module_path)
    found = bounded(lambda: cache.lookup(KEY.uri))
    assert not found and f"module file {entry.module_path.name} is a " in found.reason
    assert found.reason.endswith(", not a regular file")


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_failure_record_is_no_record(cache, kind):
    make, _ = HOSTILE[kind]
    folder = cache.failed_dir(KEY.uri)
    folder.mkdir(parents=True)
    make(folder / cache_mod.FAILURE)
    assert bounded(lambda: cache.failure(KEY.uri)) is None


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_lock_file_is_replaced_and_the_lock_works(cache, kind, tmp_path):
    """A FIFO or a link where a lock file belongs: waiters' holder() reads nothing, and taking the
    lock removes it (a link only, never its target) and locks a lock file of its own."""
    make, _ = HOSTILE[kind]
    path = cache.lock_path(KEY.uri)
    path.parent.mkdir(parents=True)
    make(path)
    assert bounded(lambda: cache.holder(KEY.uri)) is None

    def take() -> bool:
        with cache.lock(KEY.uri, timeout=2):
            return path.is_file() and not path.is_symlink() and json.loads(path.read_text())["uri"] == KEY.uri

    assert bounded(take)
    assert not os.path.lexists(path)
    if kind == "link_out":
        assert (tmp_path / "outside.json").exists()  # the link went, not what it named


def test_read_bounded_reads_a_regular_file(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert read_bounded(tmp_path / "f") == b"x" * 100
    with pytest.raises(OSError, match="is 100 bytes, more than the 99"):
        read_bounded(tmp_path / "f", limit=99)
    with pytest.raises(OSError, match="is a folder, not a regular file"):
        read_bounded(tmp_path)


# ----------------------------------------------------------------------------- the lock's re-check


def test_a_lock_file_replaced_between_open_and_flock_is_detected(cache, monkeypatch):
    """The lock re-checks, after flock, that the file it locked is still the one at the lock path.
    Here, between our open and our flock, another process replaces the file (as a releasing
    holder does by unlinking it) and locks the new one: our flock of the old file succeeds, but
    holding it excludes nobody. Without the check both would hold the build lock; with it we
    wait for the new file's holder (and time out)."""
    path = cache.lock_path(KEY.uri)
    path.parent.mkdir(parents=True)
    real_flock = fcntl.flock
    held: list[int] = []

    def flock(fd, op):
        if not held:  # the other process, between our open and our flock
            os.unlink(path)
            other = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            real_flock(other, fcntl.LOCK_EX)
            held.append(other)
        return real_flock(fd, op)

    monkeypatch.setattr(cache_mod.fcntl, "flock", flock)
    try:
        with pytest.raises(LockTimeout, match="timed out after 0s waiting for another build"):
            with cache.lock(KEY.uri, timeout=0.3):
                pass
        assert os.stat(path).st_ino == os.fstat(held[0]).st_ino  # the other holder's file is left alone
    finally:
        for fd in held:
            os.close(fd)


def test_a_jit_off_lookup_of_a_fifo_manifest_ends_with_the_reason(vg_env, monkeypatch, cache):
    """The JIT-off lookup (a server's probe and make_wrapper) hung forever on a FIFO manifest."""
    from variantgen.build import builder as build
    from variantgen.codegen.render import render_module
    from variantgen.core.errors import JitDisabledError

    monkeypatch.setattr(build, "flashinfer_info", lambda: procs.FAKE_FLASHINFER)
    monkeypatch.setattr(build, "toolchain", lambda: procs.fake_toolchain())
    config = procs.causal_config()
    key = build.module_key(render_module(config), procs.fake_toolchain())
    entry = procs.publish_fake(cache, key)
    (entry.path / cache_mod.MANIFEST).unlink()
    os.mkfifo(entry.path / cache_mod.MANIFEST)
    vg_env.set(VARIANTGEN_DISABLE_JIT="1")

    def look() -> None:
        with pytest.raises(JitDisabledError, match="manifest.json is a FIFO, not a regular file") as e:
            build.build_module(config, cache)
        assert e.value.damaged == [f"entry {entry.path} has an unreadable manifest (manifest.json is a FIFO, "
                                   "not a regular file)"]

    bounded(look)
