"""Module builds through the real ninja with fake compilers (tests/fakes/_fake_toolchain.py):
paths ninja and the shell must not split, progress and the build log, and what a failed,
timed-out, interrupted or killed build leaves behind (nothing: no staging folder, no lock
file, no compiler process).
"""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import time
from pathlib import Path

import _fake_toolchain as fake
import pytest
from _cache_procs import causal_config

from variantgen.build import builder as build
from variantgen.build import ninja, objects
from variantgen.build import place as build_place
from variantgen.build.cache import Cache
from variantgen.codegen.render import render_module
from variantgen.core.errors import BuildError, CacheError

ODD = "dir with space, $dollar and a:colon"


@pytest.fixture
def toolchain(tmp_path, monkeypatch, vg_env):
    """The fake toolchain under a path with a space, a $ and a colon; the cache under another."""
    tc, info = fake.make_toolchain(tmp_path / ODD / "tools")
    monkeypatch.setattr(build, "toolchain", lambda: tc)
    monkeypatch.setattr(build, "flashinfer_info", lambda: info)
    for name in ("VG_FAKE_NVCC_SLEEP", "VG_FAKE_NVCC_FAIL", "VG_FAKE_PIDS"):
        monkeypatch.delenv(name, raising=False)
    return tc


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / ODD / "my cache")


def leftovers(cache: Cache) -> dict[str, list[str]]:
    return {name: sorted(p.name for p in (cache.root / name).iterdir()) if (cache.root / name).is_dir() else []
            for name in (".staging", ".locks")}


def pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def wait_for_pids(path: Path, n: int, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(pids(path)) < n:
        assert time.monotonic() < deadline, f"the fake compilers did not start ({path})"
        time.sleep(0.05)
    return pids(path)


def test_escapes():
    assert ninja.escape_path("/a b/c:d/$e.cu") == "/a$ b/c$:d/$$e.cu"
    assert ninja.shell_args(["-I/a b", "-DX=$Y", "plain"]) == "'-I/a b' '-DX=$$Y' plain"
    with pytest.raises(ValueError, match="contains a line break"):
        ninja.escape_path("/a\nb")


def test_ninja_file_escapes_every_path(toolchain, tmp_path):
    rendered = render_module(causal_config())
    text = build._ninja_file(rendered, toolchain, tmp_path / ODD / "src", "m.so")
    escaped = str(tmp_path / ODD).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")
    assert f"build obj/binding.o: cuda_compile {escaped}/src/binding.cu" in text.splitlines()
    assert f"'-I{tmp_path / ODD}/src'".replace("$", "$$") in text
    assert f"nvcc = '{toolchain.nvcc}'".replace("$", "$$") in text


def test_split_compile_reaches_nvcc_and_the_key(toolchain, tmp_path, vg_env):
    """VARIANTGEN_SPLIT_COMPILE=N: nvcc --split-compile=N on every unit (the module's longest unit
    may use cores the others leave idle). Its optimizer allocates registers otherwise (an fa2
    kernel unit's SASS differs with N=2), so a module built so has a key of its own; N=1 (off)
    keeps the plain key."""
    rendered = render_module(causal_config())
    key = build.module_key(rendered, toolchain)
    plain = build._ninja_file(rendered, toolchain, tmp_path / "src", "m.so")
    assert "--split-compile" not in plain
    vg_env.set(VARIANTGEN_SPLIT_COMPILE="8")
    cuda_flags = next(line for line in build._ninja_file(rendered, toolchain, tmp_path / "src", "m.so").splitlines()
                      if line.startswith("cuda_flags = "))
    assert "--split-compile=8" in cuda_flags.split()
    split = build.module_key(rendered, toolchain)
    assert split.digest != key.digest and ("nvcc_split_compile", "8") in split.inputs
    vg_env.set(VARIANTGEN_SPLIT_COMPILE="1")
    assert build.module_key(rendered, toolchain).digest == key.digest
    with pytest.raises(ValueError, match="VARIANTGEN_SPLIT_COMPILE='0': expected a number >= 1"):
        vg_env.set(VARIANTGEN_SPLIT_COMPILE="0")


def test_build_in_paths_with_spaces_dollars_and_colons(toolchain, cache, caplog):
    """Every build broke when the cache path held a space, a $ or a colon."""
    caplog.set_level(logging.INFO, logger="variantgen.build.builder")
    config = causal_config()
    rendered = render_module(config)
    seen: list[tuple[int, int]] = []

    class Recorder:
        def __init__(self, uri, units, kind):
            self.args = (uri, units, kind)

        def update(self, done, total):
            seen.append((done, total))

        def close(self, ok):
            seen.append(("closed", ok))

    result = build.build_module(config, cache, progress=Recorder)
    assert result.built and cache.lookup(result.entry.uri)
    units = len(rendered.compile_units) + len(rendered.host_sources)
    assert seen[-1] == ("closed", True) and seen[-2] == (units + 1, units + 1)  # the link is an edge too
    assert [d for d, _ in seen[:-1]] == sorted(d for d, _ in seen[:-1])
    log_text = (result.entry.path / "build.log").read_text()
    for unit in rendered.compile_units:  # in the staging folder, which the ninja file names relatively
        assert f"fake nvcc: compiling src/{unit}\n" in log_text
    assert "fake c++: linking" in log_text
    assert leftovers(cache) == {".staging": [], ".locks": []}
    assert not (result.entry.path / ninja.PID_FILE).exists() and not (result.entry.path / "obj").exists()


def test_default_progress_logs_start_and_finish_off_a_terminal(toolchain, cache, caplog):
    caplog.set_level(logging.INFO, logger="variantgen.build.builder")
    result = build.build_module(causal_config(), cache)
    messages = [r.getMessage() for r in caplog.records if r.name == "variantgen.build.builder"]
    units = len(render_module(causal_config()).compile_units) + 1
    assert messages[0] == (f"building {result.entry.uri} ({units} compile units; a first build takes about a "
                           "minute)")
    assert messages[-1].startswith(f"built {result.entry.uri} in ")


def test_progress_bar_on_a_terminal(toolchain, cache, monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    build.build_module(causal_config(), cache)
    err = capsys.readouterr().err
    units = len(render_module(causal_config()).compile_units) + 1
    assert "causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a: " in err
    assert f"{units + 1}/{units + 1} units" in err


def test_compile_error_is_kept_with_the_whole_log(toolchain, cache, monkeypatch):
    monkeypatch.setenv("VG_FAKE_NVCC_FAIL", "binding")
    with pytest.raises(BuildError) as e:
        build.build_module(causal_config(), cache)
    err = e.value
    assert err.first_error.endswith("binding.cu(3): error: fake failure")
    kept = Path(err.log_path).parent
    assert kept.parent == cache.root / ".failed" and not (kept / "obj").exists()
    log_text = (kept / "build.log").read_text()
    assert "binding.cu(3): error: fake failure" in log_text and log_text == err.output
    record = json.loads((kept / "failure.json").read_text())
    assert record["pid"] == os.getpid() and record["first_error"] == err.first_error
    assert leftovers(cache) == {".staging": [], ".locks": []}


def test_the_printed_command_reproduces_a_failed_build(toolchain, cache, monkeypatch, vg_env):
    """The kept build.ninja named the staging folder, deleted after the failure: "reproduce with:
    ninja -C .../.failed/<uri> -f build.ninja" could not run. Paths inside the folder are
    relative now, and the command (with the nvcc variables the build had) re-runs the compile."""
    import shlex
    import subprocess

    vg_env.set(NVCC_APPEND_FLAGS="-lineinfo")
    monkeypatch.setenv("VG_FAKE_NVCC_FAIL", "binding")
    with pytest.raises(BuildError) as e:
        build.build_module(causal_config(), cache)
    kept = Path(e.value.log_path).parent
    assert e.value.command == build_place.reproduce_command(kept, "NVCC_APPEND_FLAGS=-lineinfo ")
    assert f"cp -R {shlex.quote(str(kept))}/. " in e.value.command  # a $ in the cache path: run in a copy
    assert f"reproduce with: {e.value.command}" in str(e.value)
    assert ".staging" not in (kept / "build.ninja").read_text()
    assert not (cache.root / ".staging").exists() or not list((cache.root / ".staging").iterdir())
    env = {k: v for k, v in os.environ.items() if k != "NVCC_APPEND_FLAGS"}
    again = subprocess.run(e.value.command, shell=True, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "binding.cu(3): error: fake failure" in again.stdout, again.stdout
    assert "fake nvcc: NVCC_APPEND_FLAGS=-lineinfo" in again.stdout
    shutil.rmtree(re.search(r"^variantgen: build folder (.*)$", again.stdout, re.M).group(1))
    del env["VG_FAKE_NVCC_FAIL"]  # the compile error fixed: the kept folder builds the module
    fixed = subprocess.run(e.value.command, shell=True, env=env, capture_output=True, text=True, timeout=60)
    assert fixed.returncode == 0, fixed.stdout
    # the cache path holds a $: the command builds in a plain-named copy (build_place.py), and says where
    where = Path(re.search(r"^variantgen: build folder (.*)$", fixed.stdout, re.M).group(1))
    assert (where / f"{Path(kept).name}.so").is_file()
    shutil.rmtree(where)


def kill_a_builder_mid_compile(cache: Cache, monkeypatch, tmp_path: Path, *, ignore_term: bool = False) -> list[int]:
    """kill -9 of a process building the causal module while its compilers run (they sleep
    until ended, VG_FAKE_NVCC_SLEEP stays set): the pids of its ninja (first) and compilers.
    ``ignore_term``: the compilers ignore SIGTERM (so survive their builder's death)."""
    record = tmp_path / "pids"
    monkeypatch.setenv("VG_FAKE_NVCC_SLEEP", "300")
    monkeypatch.setenv("VG_FAKE_PIDS", str(record))
    if ignore_term:
        monkeypatch.setenv("VG_FAKE_NVCC_IGNORE_TERM", "1")
    child = multiprocessing.get_context("spawn").Process(
        target=fake.build_in_child, args=(str(tmp_path / ODD / "tools"), str(cache.root)), daemon=True)
    child.start()
    try:
        compilers = wait_for_pids(record, 2)
        staging = next((cache.root / ".staging").glob("vg_causal_*"))
        return [json.loads((staging / ninja.PID_FILE).read_text())["pid"], *compilers]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)


def _gone(all_pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(ninja._alive(p) for p in all_pids):
            return True
        time.sleep(0.05)
    return False


def test_timeout_ends_every_compiler(toolchain, cache, monkeypatch, vg_env, tmp_path):
    record = tmp_path / "pids"
    monkeypatch.setenv("VG_FAKE_NVCC_SLEEP", "120")
    monkeypatch.setenv("VG_FAKE_PIDS", str(record))
    vg_env.set(VARIANTGEN_BUILD_TIMEOUT="1.5", VARIANTGEN_BUILD_JOBS="2")
    t0 = time.monotonic()
    with pytest.raises(BuildError, match=r"failed \(timed out after 2s \(VARIANTGEN_BUILD_TIMEOUT=1.5\); ended\)"):
        build.build_module(causal_config(), cache)
    assert time.monotonic() - t0 < 30
    started = pids(record)
    assert len(started) >= 2 and _gone(started), [p for p in started if ninja._alive(p)]
    assert leftovers(cache) == {".staging": [], ".locks": []}


def test_interrupt_ends_every_compiler_and_cleans_up(toolchain, cache, monkeypatch, tmp_path):
    record = tmp_path / "pids"
    monkeypatch.setenv("VG_FAKE_NVCC_SLEEP", "120")
    monkeypatch.setenv("VG_FAKE_PIDS", str(record))

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(KeyboardInterrupt):
            build.build_module(causal_config(), cache)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    started = pids(record)
    assert started and _gone(started)
    assert leftovers(cache) == {".staging": [], ".locks": []}
    assert not (cache.root / ".failed").exists()  # an interrupt is not a failed build


def test_a_killed_ninja_leaves_no_compiler_running(toolchain, cache, monkeypatch, tmp_path):
    """kill -9 of ninja (the OOM killer) left its compilers running, children of init: the build
    failed, its compilers did not end. What is left of ninja's session is ended on any non-zero
    exit."""
    import threading

    record = tmp_path / "pids"
    monkeypatch.setenv("VG_FAKE_NVCC_SLEEP", "120")
    monkeypatch.setenv("VG_FAKE_PIDS", str(record))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            build.build_module(causal_config(), cache)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    builder = threading.Thread(target=run)
    builder.start()
    started = wait_for_pids(record, 2)
    staging = next((cache.root / ".staging").iterdir())
    os.kill(json.loads((staging / ninja.PID_FILE).read_text())["pid"], signal.SIGKILL)
    builder.join(60)
    assert not builder.is_alive()
    assert isinstance(errors[0], BuildError) and "ninja exit -9" in str(errors[0])
    assert _gone(started, timeout=1.0), [p for p in started if ninja._alive(p)]
    assert leftovers(cache) == {".staging": [], ".locks": []}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_precompile_ends_its_builds_at_once(tmp_path, sig, monkeypatch):
    """Ctrl-C of `variantgen precompile` waited for every queued build (its builds run in worker
    threads) before "Aborted!"; SIGTERM left ninja and the compilers running and staging folders
    behind. Both cancel the queued builds, end the running ones and leave nothing."""
    import subprocess
    import sys

    cache = Cache(tmp_path / "cache")
    record = tmp_path / "pids"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VARIANTGEN_", "VG_FAKE_", "NVCC_"))}
    env.update(VG_FAKE_NVCC_SLEEP="120", VG_FAKE_PIDS=str(record), VARIANTGEN_BUILD_JOBS="1",
               PYTHONPATH=str(Path(build.__file__).resolve().parents[1]))
    cmd = [sys.executable, fake.__file__, str(tmp_path / "tools"), "--cache-dir", str(cache.root), "precompile",
           "causal", "--head-dim", "64,128,256", "--dtype", "bf16", "--arch", "8.0", "--backend", "fa2", "-j", "2"]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = wait_for_pids(record, 4)  # a compile (and its sleep) in each of two builds
        t0 = time.monotonic()
        child.send_signal(sig)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert time.monotonic() - t0 < 15 and child.returncode != 0
    assert "Aborted!" in err, err
    assert _gone(started, timeout=1.0), [p for p in started if ninja._alive(p)]
    assert len(pids(record)) == len(started) or _gone(pids(record), timeout=1.0)
    assert leftovers(cache) == {".staging": [], ".locks": []}
    assert not list(cache.entries()) and not (cache.root / ".failed").exists()


def test_a_killed_builder_takes_ninja_and_its_compilers_with_it(toolchain, cache, monkeypatch, tmp_path):
    """kill -9 of a builder left ninja and its compilers running as orphans (one of them holding
    the shared object's lock) until a later build of the module: ninja now gets SIGTERM when its
    builder dies and passes it to every compiler's process group."""
    left = kill_a_builder_mid_compile(cache, monkeypatch, tmp_path)
    assert _gone(left), [p for p in left if ninja._alive(p)]
    killed = next((cache.root / ".staging").glob("vg_causal_*"))
    build_dir = Path((killed / build_place.BUILD_DIR_RECORD).read_text())  # (the cache path holds a $)
    assert build.discard_killed_builds(cache) >= 1  # what `clear` does: the staging and build folders go
    assert not killed.exists() and not build_dir.exists()
    store = objects.object_cache(cache)
    for uri in store.in_flight():  # the shared object's lock, if its compile had started, is free
        with store.lock(uri, timeout=1):
            pass


def test_next_build_ends_a_killed_builders_compilers(toolchain, cache, monkeypatch, tmp_path):
    """Compilers that ignore SIGTERM outlive their killed builder (and ninja waits for them); the
    next build of the module ends them (SIGKILL after the grace time) before it starts."""
    orphans = kill_a_builder_mid_compile(cache, monkeypatch, tmp_path, ignore_term=True)
    time.sleep(0.5)
    assert all(ninja._alive(p) for p in orphans[1:])  # still compiling, for nobody (ninja may be gone)
    # the cache path holds a $: it was building in a private temporary folder, left behind
    killed = next((cache.root / ".staging").glob("vg_causal_*"))
    build_dir = Path((killed / build_place.BUILD_DIR_RECORD).read_text())
    assert build_dir.is_dir() and build_dir.name.startswith(build_place.PREFIX)
    monkeypatch.delenv("VG_FAKE_NVCC_SLEEP")
    result = build.build_module(causal_config(), cache)
    assert not build_dir.exists()
    assert result.built and _gone(orphans), [(p, ninja._stat_fields(p)[:4]) for p in orphans if ninja._alive(p)]
    assert leftovers(cache) == {".staging": [], ".locks": []}


def test_clear_removes_what_killed_builders_left(toolchain, cache, monkeypatch, tmp_path):
    """A regression: `variantgen clear` left a killed builder's staging folders (its module's and
    its shared object's), lock files and running compilers; only a later build of the same URI
    removed them, and a new key (another FlashInfer or nvcc) never builds it again. A build
    running now keeps its folder."""
    from click.testing import CliRunner

    from variantgen.tools.cli import main

    orphans = kill_a_builder_mid_compile(cache, monkeypatch, tmp_path, ignore_term=True)
    store = objects.object_cache(cache)
    killed = list((cache.root / ".staging").iterdir())
    try:
        assert killed and leftovers(cache)[".locks"]  # (and the shared object's, if its compile started)
        busy = "vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd64x64_sm80_0123456789ab"
        with cache.lock(busy):
            running = cache.new_staging(busy)
            r = CliRunner().invoke(main, ["clear", "--yes", "--cache-dir", str(cache.root)])
        assert r.exit_code == 0 and re.search(r"^removed what [12] killed builds? left \(staging folders, lock "
                                              r"files\)$", r.output, re.MULTILINE), r.output
        assert _gone(orphans)
    finally:  # (a failure must not leave the compilers running)
        for staging in killed:
            ninja.end_recorded(staging)
    assert leftovers(cache) == {".staging": [running.name], ".locks": []}
    assert leftovers(store) == {".staging": [], ".locks": []}


@pytest.mark.parametrize("where", ["sources", "ninja file", "manifest"])
def test_full_disk_names_the_path_and_cleans_up(toolchain, cache, monkeypatch, where):
    """ENOSPC gave `internal error: OSError: [Errno 28]` with no path and left a staging folder
    and a lock behind."""
    real_write_text = Path.write_text
    full = OSError(errno.ENOSPC, "No space left on device")

    def write_text(self, *args, **kwargs):
        if self.name == {"sources": "variant.cuh", "ninja file": "build.ninja"}.get(where):
            raise full
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    if where == "manifest":
        def fsync(fd):
            raise full

        monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CacheError) as e:
        build.build_module(causal_config(), cache)
    name = {"sources": "src/variant.cuh", "ninja file": "build.ninja", "manifest": "manifest.json.tmp"}[where]
    text = str(e.value)
    assert text.startswith(f"cannot write {cache.root / '.staging'}/") and f"/{name}: No space left on device" in text
    assert text.endswith("(free space on that file system)")
    assert leftovers(cache) == {".staging": [], ".locks": []} and list(cache.entries()) == []


def test_a_failing_progress_display_does_not_stop_the_build(toolchain, cache):
    class Broken:
        def __init__(self, uri, units, kind):
            pass

        def update(self, done, total):
            raise RuntimeError("terminal went away")

        def close(self, ok):
            pass

    result = build.build_module(causal_config(), cache, progress=Broken)
    assert result.built and cache.lookup(result.entry.uri)


def test_ninja_that_cannot_run_is_a_toolchain_error(toolchain, cache, monkeypatch, tmp_path):
    from variantgen.core.errors import ToolchainError

    not_executable = tmp_path / "ninja"
    not_executable.write_text("not a program")
    monkeypatch.setattr(build, "_ninja", lambda: str(not_executable))
    with pytest.raises(ToolchainError, match=f"cannot run {not_executable}: Permission denied"):
        build.build_module(causal_config(), cache)
    assert leftovers(cache) == {".staging": [], ".locks": []}


# ----------------------------------------------------------------------------- shared objects


def fa3_config(name: str):
    import variantgen
    from variantgen.codegen.render import ModuleConfig

    return ModuleConfig(variantgen.resolve_spec(name), 128, 128, "bf16", "bf16", "bf16", "9.0a", "fa3")


def shared_lines(entry) -> dict[str, str]:
    """unit object URI -> 'compiled' / 'from the cache', as the module's build log says."""
    found = re.findall(r"variantgen: shared object (\S+) (compiled|from the cache)",
                       (entry.path / "build.log").read_text())
    return dict(found)


def test_shared_plain_units_are_compiled_once_per_cache(toolchain, cache):
    """Two specs without a logits transform share their plain kernel units: the first build
    compiles them into the object cache, the second links the same objects; a spec with a
    logits transform compiles its own."""
    first = build.build_module(fa3_config("causal"), cache)
    second = build.build_module(fa3_config("mm_prefix"), cache)
    shared = first.entry.manifest["shared_objects"]
    assert sorted(shared) == ["paged_kernel_causal.cu", "paged_kernel_causal_window.cu", "paged_kernel_none.cu",
                              "plan.cu"]
    assert second.entry.manifest["shared_objects"] == shared
    assert shared_lines(first.entry) == dict.fromkeys(shared.values(), "compiled")
    assert shared_lines(second.entry) == dict.fromkeys(shared.values(), "from the cache")
    assert "compiling" not in "".join(line for line in (second.entry.path / "build.log").read_text().splitlines()
                                      if "paged_kernel_causal" in line or "paged_kernel_none" in line)
    store = objects.object_cache(cache)
    for uri in shared.values():
        found = store.lookup(uri)
        assert found, found.reason
        manifest = found.entry.manifest
        assert manifest["inputs_digest"] and manifest["toolchain"] == {
            "nvcc": "V12.8.93", "cxx": "fake c++ 1.0", "host_cc": f"fake c++ 1.0 ({toolchain.host_cc})"}
        assert manifest["first_module"] == first.entry.uri
    # the object cache is hidden: neither a module entry nor someone else's file
    assert [uri for uri, _ in cache.entries()] == sorted([first.entry.uri, second.entry.uri])
    assert cache.others() == []
    own = build.build_module(fa3_config("softcap"), cache)
    assert own.entry.manifest["shared_objects"] == {"plan.cu": shared["plan.cu"]}  # its kernels are its own
    assert shared_lines(own.entry) == {shared["plan.cu"]: "from the cache"}
    assert leftovers(cache) == {".staging": [], ".locks": []}
    assert leftovers(store) == {".staging": [], ".locks": []}


def test_a_corrupted_shared_object_is_compiled_again_never_linked(toolchain, cache):
    first = build.build_module(fa3_config("causal"), cache)
    uri = first.entry.manifest["shared_objects"]["paged_kernel_causal.cu"]
    store = objects.object_cache(cache)
    damaged = store.lookup(uri).entry.module_path
    damaged.write_bytes(b"x" * len(damaged.read_bytes()))  # same size, other bytes
    assert not store.lookup(uri)
    second = build.build_module(fa3_config("prefix_lm"), cache)
    lines = shared_lines(second.entry)
    assert lines.pop(uri) == "compiled" and set(lines.values()) == {"from the cache"}
    assert store.lookup(uri)


def test_concurrent_builds_compile_each_shared_object_once(toolchain, cache, monkeypatch, vg_env):
    """Two modules built at once: one takes each object's lock and compiles it, the other waits
    for it (one more ninja job) and links the published object."""
    import concurrent.futures

    monkeypatch.setenv("VG_FAKE_NVCC_SLEEP", "1")
    vg_env.set(VARIANTGEN_BUILD_JOBS="3")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda name: build.build_module(fa3_config(name), cache), ["causal", "document"]))
    says = [shared_lines(r.entry) for r in results]
    uris = set(results[0].entry.manifest["shared_objects"].values())
    assert set(says[0]) == set(says[1]) == uris
    for uri in uris:
        assert sorted([says[0][uri], says[1][uri]]) == ["compiled", "from the cache"], uri


def test_a_failing_shared_unit_fails_the_build_and_leaves_nothing(toolchain, cache, monkeypatch):
    monkeypatch.setenv("VG_FAKE_NVCC_FAIL", "paged_kernel_causal_window")
    with pytest.raises(BuildError) as e:
        build.build_module(fa3_config("causal"), cache)
    assert e.value.first_error.endswith("paged_kernel_causal_window.cu(3): error: fake failure")
    assert "compiling shared object vg_fa3_plain_paged_causal_window_" in e.value.output
    store = objects.object_cache(cache)
    assert not any(uri.startswith("vg_fa3_plain_paged_causal_window_") for uri, _ in store.entries())
    assert leftovers(cache) == {".staging": [], ".locks": []}
    assert leftovers(store) == {".staging": [], ".locks": []}


def test_waiting_for_a_shared_object_is_bounded(toolchain, cache, vg_env):
    """Another process holding an object's lock longer than VARIANTGEN_LOCK_TIMEOUT fails the
    build with the holder named, instead of waiting for ever."""
    vg_env.set(VARIANTGEN_LOCK_TIMEOUT="1")
    rendered = render_module(fa3_config("causal"))
    unit = next(u for u in rendered.shared_units if u.file == "paged_kernel_none.cu")
    uri = build.shared_object_key(rendered, unit, build.toolchain()).uri
    with objects.object_cache(cache).lock(uri), pytest.raises(BuildError) as e:
        build.build_module(fa3_config("causal"), cache)
    assert f"timed out after 1s waiting for another build of {uri} (held by pid {os.getpid()}" in e.value.output
    assert leftovers(cache) == {".staging": [], ".locks": []}


def test_nvcc_flag_variables_are_part_of_the_key_and_reach_nvcc(toolchain, cache, vg_env, monkeypatch):
    """nvcc adds NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS to every command: a module built with
    NVCC_APPEND_FLAGS=-G (debug device code) was published under the normal module's URI and
    served later as that module. The key names them, and the build gets the keyed values."""
    plain = build.build_module(causal_config(), cache)
    vg_env.set(NVCC_APPEND_FLAGS="-G")
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-lineinfo")  # changed after the settings were read
    monkeypatch.setenv("NVCC_CCBIN", "/no/such/compiler")  # -ccbin names the keyed compiler instead
    debug = build.build_module(causal_config(), cache)
    assert debug.built and debug.entry.uri != plain.entry.uri
    assert ("nvcc_append_flags", "-G") in debug.key.inputs
    log_text = (debug.entry.path / "build.log").read_text()
    assert "fake nvcc: NVCC_APPEND_FLAGS=-G\n" in log_text and "NVCC_CCBIN" not in log_text
    assert f"-ccbin '{toolchain.host_cc}'".replace("$", "$$") in (debug.entry.path / "build.ninja").read_text()
    vg_env.set(NVCC_APPEND_FLAGS=None, NVCC_CCBIN=None)
    again = build.build_module(causal_config(), cache)
    assert not again.built and again.entry.uri == plain.entry.uri
    assert "NVCC_APPEND_FLAGS" not in (plain.entry.path / "build.log").read_text()


def test_a_relative_cache_dir_builds(toolchain, tmp_path, vg_env, monkeypatch):
    """VARIANTGEN_CACHE_DIR=../x or --cache-dir rel made every build fail (`ninja: fatal: chdir
    to ...`: ninja -C went into the staging folder, then looked for a path relative to it)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    vg_env.set(VARIANTGEN_CACHE_DIR="../rel cache")
    assert vg_env.settings.cache_dir == tmp_path / "rel cache"
    result = build.build_module(causal_config(), build.default_cache())
    assert result.built and result.entry.path == tmp_path / "rel cache" / result.entry.uri
    cache = Cache("again")
    monkeypatch.chdir(tmp_path)  # a later chdir does not move a cache
    assert cache.root == work / "again" and build.build_module(causal_config(), cache).built


def test_a_build_waiting_for_a_lock_ends_on_an_interrupt(cache):
    """An interrupted precompile's worker waiting for another build's lock stopped waiting only at
    the lock timeout (the interpreter's exit waited for it): the wait asks ninja.ABORT between tries."""
    import threading

    outcome: list[BaseException] = []

    def wait_for_it() -> None:
        try:
            with cache.lock("vg_x_0123456789ab", timeout=60, check=ninja.check_abort):
                pass
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome.append(e)

    with cache.lock("vg_x_0123456789ab"):
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        ninja.ABORT.set()
        try:
            waiter.join(10)
        finally:
            ninja.ABORT.clear()
    assert not waiter.is_alive() and time.monotonic() - t0 < 2
    assert isinstance(outcome[0], ninja.BuildAborted)
