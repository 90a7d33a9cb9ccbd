"""Process bodies and fakes for test_cache.py.

They live in their own module (no pytest import) so that `multiprocessing` spawn children
import them quickly. Nothing here runs nvcc: the fake builder writes a dummy module file.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from variantgen.build import builder as build
from variantgen.build.builder import FlashInferInfo, Toolchain
from variantgen.build.cache import Cache, Entry, ModuleKey
from variantgen.core.env import REPO_DIR
from variantgen.core.errors import BuildError

FAKE_FLASHINFER = FlashInferInfo(
    version="0.7.2.post1",
    include_dirs=(),
    system_include_dirs=(),
    csrc_dir=Path("/nonexistent"),
    tvm_ffi_version="0.1.15.post2",
)


def fake_toolchain(nvcc_version: str = "V12.8.93", cxx_version: str = "c++ (GCC) 13.2.0") -> Toolchain:
    home = Path("/opt/fake-cuda")
    return Toolchain(home, home / "bin" / "nvcc", nvcc_version, "/usr/bin/c++", cxx_version)


def fake_module_bytes(uri: str) -> bytes:
    return b"\x7fELF not really a module: " + uri.encode() + b"\n" * 64


def publish_fake(cache: Cache, key: ModuleKey, *, extra: dict | None = None) -> Entry:
    """Publish a dummy module under ``key`` as a real build would (staging, then rename)."""
    staging = cache.new_staging(key.uri)
    module = staging / f"{key.uri}.so"
    module.write_bytes(fake_module_bytes(key.uri))
    manifest = {
        "module_file": module.name,
        "inputs": dict(key.inputs),
        "inputs_digest": key.inputs_digest,
        "toolchain": dict(key.toolchain),
        "key_digest": key.digest,
        "built_at": time.time(),
        "built_by_pid": os.getpid(),
        **(extra or {}),
    }
    return cache.publish(key.uri, staging, manifest)


class FakeBuilder:
    """Stands in for build._build_locked: records each build, optionally slowly; ``fail``: the
    build fails as a compile error does (kept in .failed with its record, BuildError)."""

    def __init__(self, record: str | None = None, delay: float = 0.0, hang_file: str | None = None,
                 fail: bool = False):
        self.record = record
        self.delay = delay
        self.hang_file = hang_file  # set: write a partial module, create this file, then hang
        self.fail = fail

    def __call__(self, rendered, key, tc, cache, jobs, progress=None):
        if self.record:
            fd = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, f"{os.getpid()} {key.uri}\n".encode())
            finally:
                os.close(fd)
        if self.hang_file:
            staging = cache.new_staging(key.uri)
            (staging / f"{key.uri}.so").write_bytes(b"\x7fELF half writ")
            tmp = Path(self.hang_file + ".tmp")  # renamed: the parent never reads it half written
            tmp.write_text(str(staging))
            os.replace(tmp, self.hang_file)
            while True:
                time.sleep(1)
        time.sleep(self.delay)
        if self.fail:
            staging = cache.new_staging(key.uri)
            output = "[1/2] nvcc kernel.cu\nkernel.cu(3): error: boom\n"
            (staging / "build.log").write_text(output)
            what = f"ninja exit 1 after {self.delay:.1f}s"
            error = BuildError(f"building module {key.uri} failed ({what})", output=output)
            kept = cache.keep_failed(key.uri, staging, {"key_digest": key.digest, "message": what,
                                                       "first_error": error.first_error})
            raise BuildError(str(error).splitlines()[0], log_path=str(kept / "build.log"), output=output)
        return publish_fake(cache, key)


def patch_build(record: str | None = None, delay: float = 0.0, hang_file: str | None = None,
                nvcc_version: str = "V12.8.93", fail: bool = False) -> None:
    """In this process: fake toolchain, flashinfer and builder (no nvcc, no flashinfer import)."""
    build.toolchain = lambda: fake_toolchain(nvcc_version)  # type: ignore[assignment]
    build.flashinfer_info = lambda: FAKE_FLASHINFER  # type: ignore[assignment]
    build._build_locked = FakeBuilder(record, delay, hang_file, fail)  # type: ignore[assignment]


def causal_config(arch: str = "9.0a"):
    import variantgen
    from variantgen.codegen.render import ModuleConfig

    spec = variantgen.load_spec(REPO_DIR / "specs" / "causal.yaml")
    return ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", arch)


# ----------------------------------------------------------------------------- process bodies


def hold_lock(root: str, uri: str, ready: str) -> None:
    """Take the URI's lock, say so, and keep it until killed."""
    with Cache(root).lock(uri):
        Path(ready).write_text(str(os.getpid()))
        while True:
            time.sleep(1)


def try_lock(root: str, uri: str, timeout: float, out: str) -> None:
    """Try to take the lock within ``timeout``; write 'acquired' or the error."""
    try:
        with Cache(root).lock(uri, timeout=timeout):
            Path(out).write_text("acquired")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        Path(out).write_text(f"{type(e).__name__}: {e}")


def race_build(root: str, record: str, out_dir: str, barrier, delay: float) -> None:
    """One of N processes building the same module at once."""
    patch_build(record=record, delay=delay)
    config = causal_config()
    cache = Cache(root)
    barrier.wait(timeout=120)
    result = build.build_module(config, cache)
    Path(out_dir, f"{os.getpid()}.json").write_text(json.dumps({
        "uri": result.entry.uri,
        "path": str(result.entry.path),
        "built": result.built,
        "sha": result.entry.manifest["module_sha256"],
        "built_by_pid": result.entry.manifest["built_by_pid"],
    }))


def race_failing_build(root: str, record: str, out_dir: str, barrier, delay: float) -> None:
    """One of N processes wanting a module whose build fails; writes the error it got."""
    patch_build(record=record, delay=delay, fail=True)
    config = causal_config()
    barrier.wait(timeout=120)
    try:
        build.build_module(config, Cache(root))
        text = "built"
    except Exception as e:  # noqa: BLE001 - reported to the parent
        text = f"{type(e).__name__}: {e}"
    Path(out_dir, f"{os.getpid()}.txt").write_text(text)


def count_under_lock(root: str, uri: str, counter: str, rounds: int, barrier) -> None:
    """Increment a counter file ``rounds`` times, each read-modify-write under the URI's lock."""
    cache = Cache(root)
    barrier.wait(timeout=120)
    for _ in range(rounds):
        with cache.lock(uri, timeout=120):
            value = int(Path(counter).read_text())
            Path(counter).write_text(str(value + 1))


def build_and_hang(root: str, hang_file: str) -> None:
    """Start a build that stops midway (to be SIGKILLed by the parent)."""
    patch_build(hang_file=hang_file)
    build.build_module(causal_config(), Cache(root))


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
