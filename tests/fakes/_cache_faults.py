"""A catalogue of cache faults and the measurements over it, shared by the cache-fault test suite
(tests/cpu/test_cache_fault_suite.py) and bench/cache_faults.py (which prints the counts).

* ``CORRUPTIONS``: ways a published entry can be damaged (module file, manifest, entry folder:
  truncation, flipped bytes, wrong fields, FIFOs, links to /dev/zero or out of the cache, huge
  files). ``measure_corruptions`` applies each to a fresh entry and counts how many are detected
  (lookup refuses the entry, `list` shows it damaged) and how many would be loaded, with a time
  bound per case (a hang counts as such, never blocks the run).
* ``HOSTILE_RECORDS``: failure records and lock files that are FIFOs, links or huge files.
* ``measure_killed_builders``: kill -9 of builders mid-compile (fake toolchain, real ninja), and
  how many of their processes are left after a bounded wait.
* ``measure_concurrent_builders``: N processes building the same module at once (fake toolchain,
  real ninja): how many built, how many got the same entry.

Own module (no pytest import), so that spawned child processes and the bench script can use it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from variantgen.build import cache as cache_mod
from variantgen.build.cache import Cache, Entry, ModuleKey

BOUND_S = 5.0
KEY = ModuleKey("vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a",
                (("sources", "s" * 64), ("arch", "9.0a")), (("nvcc", "V12.8.93"),))


def publish(cache: Cache, key: ModuleKey = KEY) -> Entry:
    staging = cache.new_staging(key.uri)
    module = staging / f"{key.uri}.so"
    module.write_bytes(b"\x7fELF fake module " + os.urandom(4096))
    (staging / "build.ninja").write_text("# what a real build leaves beside its module\n")
    return cache.publish(key.uri, staging, {"module_file": module.name, "inputs": dict(key.inputs),
                                            "inputs_digest": key.inputs_digest, "toolchain": dict(key.toolchain),
                                            "key_digest": key.digest, "built_at": time.time()})


# ----------------------------------------------------------------------------- corruptions


def _rewrite(path: Path, change: Callable[[bytes], bytes]) -> None:
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(change(data))


def _flip(at: Callable[[int], int]) -> Callable[[bytes], bytes]:
    def change(data: bytes) -> bytes:
        i = at(len(data))
        return data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
    return change


def _manifest_edit(edit: Callable[[dict], object]) -> Callable[[Entry], None]:
    def apply(entry: Entry) -> None:
        path = entry.path / cache_mod.MANIFEST
        manifest = json.loads(path.read_text())
        changed = edit(manifest)
        path.write_text(json.dumps(manifest if changed is None else changed))
    return apply


def _replace(relative: str, make: Callable[[Path, Path], None]) -> Callable[[Entry], None]:
    """Replace the file ``relative`` of the entry (the module file if "") by what ``make(path,
    scratch)`` puts there (scratch: a folder outside the cache)."""
    def apply(entry: Entry) -> None:
        path = entry.module_path if relative == "" else entry.path / relative
        scratch = entry.root.parent / "outside"
        scratch.mkdir(exist_ok=True)
        shutil.copyfile(path, scratch / path.name)
        path.unlink()
        make(path, scratch)
    return apply


def _fifo(path: Path, scratch: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path, scratch: Path) -> None:
    path.symlink_to("/dev/zero")


def _link_out(path: Path, scratch: Path) -> None:  # to an intact copy of itself, outside the cache
    path.symlink_to(scratch / path.name)


def _folder(path: Path, scratch: Path) -> None:
    path.mkdir()


def _huge(path: Path, scratch: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(4 << 30)  # sparse


def _entry_link_out(entry: Entry) -> None:
    outside = entry.root.parent / "outside-entry"
    shutil.copytree(entry.path, outside)
    shutil.rmtree(entry.path)
    entry.path.symlink_to(outside)


def _nested(entry: Entry) -> None:
    (entry.path / cache_mod.MANIFEST).write_text("[" * 200_000 + "]" * 200_000)


CORRUPTIONS: dict[str, Callable[[Entry], None]] = {
    "module truncated to half": lambda e: _rewrite(e.module_path, lambda d: d[: len(d) // 2]),
    "module emptied": lambda e: _rewrite(e.module_path, lambda d: b""),
    "module first byte flipped": lambda e: _rewrite(e.module_path, _flip(lambda n: 0)),
    "module middle byte flipped": lambda e: _rewrite(e.module_path, _flip(lambda n: n // 2)),
    "module last byte flipped": lambda e: _rewrite(e.module_path, _flip(lambda n: n - 1)),
    "module one byte appended": lambda e: _rewrite(e.module_path, lambda d: d + b"\0"),
    "module replaced, same size": lambda e: _rewrite(e.module_path, lambda d: os.urandom(len(d))),
    "module deleted": lambda e: e.module_path.unlink(),
    "module a folder": _replace("", _folder),
    "module a FIFO": _replace("", _fifo),
    "module a link to /dev/zero": _replace("", _dev_zero),
    "module a link out of the cache": _replace("", _link_out),
    "manifest deleted": lambda e: (e.path / cache_mod.MANIFEST).unlink(),
    "manifest emptied": lambda e: (e.path / cache_mod.MANIFEST).write_text(""),
    "manifest not JSON": lambda e: (e.path / cache_mod.MANIFEST).write_text("{module_file: x"),
    "manifest truncated": lambda e: _rewrite(e.path / cache_mod.MANIFEST, lambda d: d[: len(d) // 2]),
    "manifest a JSON list": _manifest_edit(lambda m: [m]),
    "manifest NUL bytes": lambda e: (e.path / cache_mod.MANIFEST).write_bytes(b"\0" * 512),
    "manifest invalid UTF-8": lambda e: (e.path / cache_mod.MANIFEST).write_bytes(b"{\"a\": \"\xff\xfe\"}"),
    "manifest nested 200k deep": _nested,
    "manifest other version": _manifest_edit(lambda m: m.update(manifest_version=99)),
    "manifest names another uri": _manifest_edit(lambda m: m.update(uri=m["uri"][:-1] + "0")),
    "manifest lacks module_file": _manifest_edit(lambda m: m.pop("module_file")),
    "manifest module_file outside": _manifest_edit(lambda m: m.update(module_file="../" + m["module_file"])),
    "manifest wrong sha256": _manifest_edit(lambda m: m.update(module_sha256="0" * 64)),
    "manifest wrong size": _manifest_edit(lambda m: m.update(module_size=m["module_size"] + 1)),
    "manifest size a string": _manifest_edit(lambda m: m.update(module_size=str(m["module_size"]))),
    "manifest built_at a string": _manifest_edit(lambda m: m.update(built_at="yesterday")),
    "manifest inputs not strings": _manifest_edit(lambda m: m.update(inputs={"a": 1})),
    "manifest a folder": _replace(cache_mod.MANIFEST, _folder),
    "manifest a FIFO": _replace(cache_mod.MANIFEST, _fifo),
    "manifest a link to /dev/zero": _replace(cache_mod.MANIFEST, _dev_zero),
    "manifest a link out of the cache": _replace(cache_mod.MANIFEST, _link_out),
    "manifest 4 GiB": _replace(cache_mod.MANIFEST, _huge),
    "entry a link out of the cache": _entry_link_out,
}


def bounded(fn: Callable[[], object], timeout: float = BOUND_S) -> tuple[str, object]:
    """("ok", value), ("error", exception) or ("hung", None) after ``timeout`` seconds (the call
    goes on in a daemon thread)."""
    out: list = []

    def call() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - reported
            out.append(("error", e))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else ("hung", None)


def run_corruption(root: Path, name: str) -> dict:
    """Apply corruption ``name`` to a fresh entry under ``root``: how lookups and `list` see it."""
    cache = Cache(root / "cache")
    entry = publish(cache)
    CORRUPTIONS[name](entry)
    verdict: dict = {"case": name}
    status, found = bounded(lambda: cache.lookup(KEY.uri))
    verdict["lookup"] = status if status != "ok" else ("loaded" if found else "detected")
    verdict["reason"] = "" if status != "ok" or found else found.reason
    status, listed = bounded(lambda: [(uri, bool(f)) for uri, f in cache.entries()])
    if status != "ok":
        verdict["list"] = status
    elif (KEY.uri, False) in listed:
        verdict["list"] = "damaged"
    elif (KEY.uri, True) in listed:
        verdict["list"] = "healthy"
    else:
        verdict["list"] = "not listed"  # e.g. an entry that is a link: not one of ours
    return verdict


def measure_corruptions(scratch: Path) -> dict:
    """Every corruption of CORRUPTIONS, each in its own folder under ``scratch``: the verdicts,
    and counts (detected, loaded, hung, errors)."""
    verdicts = []
    for i, name in enumerate(CORRUPTIONS):
        root = scratch / f"case{i}"
        root.mkdir(parents=True)
        verdicts.append(run_corruption(root, name))
    count = {k: sum(v["lookup"] == k for v in verdicts) for k in ("detected", "loaded", "hung", "error")}
    return {"cases": len(verdicts), **count,
            "listed_healthy": sum(v["list"] == "healthy" for v in verdicts),
            "list_hung": sum(v["list"] == "hung" for v in verdicts), "verdicts": verdicts}


# ----------------------------------------------------------------------------- records


HOSTILE_RECORDS: dict[str, Callable[[Path, Path], None]] = {
    "FIFO": _fifo, "link to /dev/zero": _dev_zero, "4 GiB file": _huge,
}


def measure_hostile_records(scratch: Path) -> dict:
    """Failure records and lock files that are FIFOs, links to /dev/zero or huge: whether reading
    the record (failure(), holder()) and taking the lock end within the bound."""
    results = []
    for i, (kind, make) in enumerate(HOSTILE_RECORDS.items()):
        results += _hostile_record(Cache(scratch / f"records{i}" / "cache"), kind, make, scratch)
    return {"cases": len(results), "hung": sum(r["outcome"] == "hung" for r in results),
            "error": sum(r["outcome"] == "error" for r in results), "results": results}


def _hostile_record(cache: Cache, kind: str, make: Callable[[Path, Path], None], scratch: Path) -> list[dict]:
    results = []
    failed = cache.failed_dir(KEY.uri)
    failed.mkdir(parents=True)
    make(failed / cache_mod.FAILURE, scratch)
    status, record = bounded(lambda: cache.failure(KEY.uri))
    results.append({"record": f"failure.json a {kind}", "outcome": status if status != "ok" else
                    ("ignored" if record is None else "read")})
    lock = cache.lock_path(KEY.uri)
    lock.parent.mkdir(parents=True)
    make(lock, scratch)
    status, holder = bounded(lambda: cache.holder(KEY.uri))
    results.append({"record": f"lock file a {kind} (holder)", "outcome": status if status != "ok" else
                    ("ignored" if holder is None else "read")})

    def take() -> bool:
        with cache.lock(KEY.uri, timeout=2):
            return True

    status, _ = bounded(take)
    results.append({"record": f"lock file a {kind} (lock)", "outcome": "locked" if status == "ok" else status})
    return results


# ----------------------------------------------------------------------------- processes


def _pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def measure_killed_builders(scratch: Path, rounds: int = 2, wait_s: float = 10.0) -> dict:
    """kill -9 of a builder while its compilers run (fake toolchain, real ninja), ``rounds``
    times: how many ninja/compiler processes of it are left after ``wait_s`` seconds. Left-overs
    are ended before returning (by their recorded session, as `clear` does)."""
    import _fake_toolchain as fake

    from variantgen.build import ninja

    spawn = multiprocessing.get_context("spawn")
    left_total, started_total, seconds = 0, 0, []
    for i in range(rounds):
        root = scratch / f"killed{i}"
        record = root / "pids"
        root.mkdir(parents=True)
        env = {"VG_FAKE_NVCC_SLEEP": "300", "VG_FAKE_PIDS": str(record)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            child = spawn.Process(target=fake.build_in_child, args=(str(root / "tools"), str(root / "cache")),
                                  daemon=True)
            child.start()
            deadline = time.monotonic() + 60
            while len(_pids(record)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            staging = next((root / "cache" / ".staging").glob("vg_causal_*"))
            started = [json.loads((staging / ninja.PID_FILE).read_text())["pid"], *_pids(record)]
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
            t0 = time.monotonic()
            while any(_alive(p) for p in started) and time.monotonic() - t0 < wait_s:
                time.sleep(0.05)
            seconds.append(round(time.monotonic() - t0, 2))
            left = [p for p in started if _alive(p)]
            started_total += len(started)
            left_total += len(left)
            ninja.end_recorded(staging)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return {"rounds": rounds, "processes_started": started_total, "processes_left": left_total,
            "seconds_until_gone": seconds}


def race_real_build(tool_root: str, cache_root: str, out_dir: str, barrier) -> None:
    """One of N processes building the causal module at once (fake toolchain, real ninja)."""
    import _fake_toolchain as fake
    from _cache_procs import causal_config

    from variantgen.build import builder as build

    fake.patch(Path(tool_root))
    barrier.wait(timeout=120)
    result = build.build_module(causal_config(), Cache(cache_root))
    Path(out_dir, f"{os.getpid()}.json").write_text(json.dumps({"built": result.built, "uri": result.entry.uri,
                                                                "sha": result.entry.manifest["module_sha256"]}))


def measure_concurrent_builders(scratch: Path, n: int = 8) -> dict:
    """``n`` processes build the same module at once: builds, distinct results, failures."""
    import _fake_toolchain as fake

    fake.make_toolchain(scratch / "tools")  # once, before the children use it
    spawn = multiprocessing.get_context("spawn")
    out_dir = scratch / "race"
    out_dir.mkdir(parents=True)
    barrier = spawn.Barrier(n)
    children = [spawn.Process(target=race_real_build, args=(str(scratch / "tools"), str(scratch / "race-cache"),
                                                            str(out_dir), barrier)) for _ in range(n)]
    for c in children:
        c.start()
    for c in children:
        c.join(300)
    results = [json.loads(p.read_text()) for p in out_dir.iterdir()]
    cache = Cache(scratch / "race-cache")
    return {"processes": n, "succeeded": len(results), "failed": sum(c.exitcode != 0 for c in children),
            "built": sum(r["built"] for r in results), "distinct_modules": len({(r["uri"], r["sha"]) for r in results}),
            "entries": len(list(cache.entries())),
            "staging_left": len(list((cache.root / ".staging").iterdir())) if (cache.root / ".staging").exists() else 0}
