"""Module keys and the on-disk cache: URIs, publishing, damage detection, locking across
processes, killed builds, build races and JIT-disabled (deployed, read-only) caches.

No nvcc runs here: builds are replaced by a fake builder that writes a dummy module."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import multiprocessing
import os
import shutil
import stat
import time
from pathlib import Path

import _cache_procs as procs
import pytest
from conftest import SPECS_DIR

import variantgen
from variantgen.build import builder as build
from variantgen.build import cache as cache_mod
from variantgen.build.cache import Cache, ModuleKey
from variantgen.codegen import render
from variantgen.codegen.render import ModuleConfig, render_module
from variantgen.core.errors import BuildError, CacheError, JitDisabledError, ToolchainError

SPAWN = multiprocessing.get_context("spawn")

INPUTS = (
    ("sources", "s" * 64),
    ("templates", "t" * 64),
    ("flags", "f" * 64),
    ("flashinfer", "0.7.2.post1"),
    ("tvm_ffi", "0.1.15.post2"),
    ("arch", "9.0a"),
    ("variantgen", "0.1.0"),
)
TOOLCHAIN = (("nvcc", "V12.8.93"), ("cxx", "c++ (GCC) 13.2.0"))
PREFIX = "vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a"


def key(inputs=INPUTS, toolchain=TOOLCHAIN, prefix=PREFIX) -> ModuleKey:
    return ModuleKey(prefix, tuple(inputs), tuple(toolchain))


def replaced(pairs, name, value):
    return tuple((k, value if k == name else v) for k, v in pairs)


def causal_config(**overrides) -> ModuleConfig:
    spec = overrides.pop("spec", None) or variantgen.load_spec(SPECS_DIR / "causal.yaml")
    kw = dict(head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", arch="9.0a")
    kw.update(overrides)
    return ModuleConfig(spec, **kw)


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """Fake toolchain, flashinfer and builder in this process (as procs.patch_build does in
    child processes, so keys agree); returns the record file of builds."""
    record = tmp_path / "builds.txt"
    monkeypatch.setattr(build, "flashinfer_info", lambda: procs.FAKE_FLASHINFER)
    monkeypatch.setattr(build, "toolchain", lambda: procs.fake_toolchain())
    monkeypatch.setattr(build, "_build_locked", procs.FakeBuilder(str(record)))
    return record


def builds(record: Path) -> list[str]:
    return record.read_text().splitlines() if record.exists() else []


# ----------------------------------------------------------------------------- ModuleKey


def test_uri_is_stable():
    k = key()
    assert k.uri == key().uri
    assert k.uri.startswith(PREFIX + "_")
    suffix = k.uri[len(PREFIX) + 1:]
    assert len(suffix) == cache_mod.HASH_CHARS and all(c in "0123456789abcdef" for c in suffix)
    # Golden value: if this changes, every existing cache entry is orphaned. Change it on purpose only.
    assert k.uri == f"{PREFIX}_67b32e3ed0ec"
    assert k.uri == f"{PREFIX}_{k.digest[:12]}"
    assert k.digest == cache_mod._digest({"inputs": [list(p) for p in INPUTS],
                                          "toolchain": [list(p) for p in TOOLCHAIN]})


def test_uri_does_not_depend_on_dict_order_or_process():
    import subprocess
    import sys

    code = ("from variantgen.build.cache import ModuleKey; import json, sys; a = json.loads(sys.argv[1]); "
            "print(ModuleKey(a[0], tuple(map(tuple, a[1])), tuple(map(tuple, a[2]))).uri)")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([PREFIX, INPUTS, TOOLCHAIN])],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == key().uri


@pytest.mark.parametrize("part", [name for name, _ in INPUTS])
def test_uri_changes_with_every_input(part):
    base = key()
    other = key(inputs=replaced(INPUTS, part, "something else"))
    assert other.uri != base.uri
    assert other.inputs_digest != base.inputs_digest
    assert other.uri.startswith(PREFIX + "_")


@pytest.mark.parametrize("part", ["nvcc", "cxx"])
def test_uri_changes_with_the_toolchain_but_inputs_digest_does_not(part):
    base = key()
    other = key(toolchain=replaced(TOOLCHAIN, part, "V99.9.99"))
    assert other.uri != base.uri
    assert other.inputs_digest == base.inputs_digest
    assert key(toolchain=()).uri != base.uri


def test_explain_names_every_part():
    assert key().explain() == {**dict(INPUTS), "toolchain.nvcc": "V12.8.93", "toolchain.cxx": "c++ (GCC) 13.2.0"}


# ----------------------------------------------------------------------------- build.module_key


@pytest.fixture
def keyed(vg_env):
    def make(config=None, tc=None, **overrides):
        config = config or causal_config(**overrides)
        return build.module_key(render_module(config), tc if tc is not None else procs.fake_toolchain())

    return make


def test_module_key_parts(keyed):
    k = keyed()
    assert [name for name, _ in k.inputs] == ["sources", "templates", "flags", "flashinfer", "tvm_ffi", "arch",
                                               "variantgen"]
    assert dict(k.inputs)["arch"] == "9.0a" and dict(k.inputs)["variantgen"] == variantgen.__version__
    assert dict(k.toolchain) == {"nvcc": "V12.8.93", "cxx": "c++ (GCC) 13.2.0"}
    assert k.uri.startswith("vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_")
    assert keyed().uri == k.uri  # rendering and hashing are deterministic
    assert build.module_key(render_module(causal_config()), None).toolchain == ()


def test_module_key_changes_with_the_spec_text(keyed, spec_from):
    a = keyed(spec=spec_from("name: causal\nmask: kv_pos <= q_pos\n"))
    b = keyed(spec=spec_from("name: causal\nmask: kv_pos < q_pos + 1\n"))
    same = keyed(spec=spec_from("name: causal\ndescription: other words\nmask: 'kv_pos <=  q_pos'  # c\n"))
    assert a.uri != b.uri
    assert a.uri == same.uri  # comments, description and spacing do not make a new module
    scal = keyed(spec=spec_from("name: causal\nscalars:\n  w: {dtype: int, default: 1}\nmask: kv_pos <= q_pos + w\n"))
    scal2 = keyed(spec=spec_from("name: causal\nscalars:\n  w: {dtype: int, default: 2}\nmask: kv_pos <= q_pos + w\n"))
    assert scal.uri != a.uri
    assert scal2.uri == scal.uri  # a default is a run-time value, not compiled in


def test_module_key_changes_with_the_arch(keyed):
    a, b = keyed(arch="9.0a"), keyed(arch="9.0")
    assert a.uri != b.uri
    assert dict(a.inputs)["flags"] != dict(b.inputs)["flags"]
    assert keyed(arch="sm_90a").uri == a.uri  # spellings of one arch are one module


def test_module_key_changes_with_the_toolchain(keyed):
    a = keyed(tc=procs.fake_toolchain("V12.8.93"))
    b = keyed(tc=procs.fake_toolchain("V13.0.88"))
    c = keyed(tc=procs.fake_toolchain(cxx_version="c++ (GCC) 14.1.0"))
    assert len({a.uri, b.uri, c.uri}) == 3
    assert a.inputs_digest == b.inputs_digest == c.inputs_digest


def test_module_key_changes_with_dtypes_and_head_dims(keyed):
    uris = {keyed().uri, keyed(kv_dtype="fp8_e4m3").uri, keyed(head_dim_qk=64, head_dim_vo=64).uri,
            keyed(mask_modes=("causal",)).uri}
    assert len(uris) == 4


def test_module_key_changes_with_a_template_file(keyed, template_copy, tmp_path, vg_env):
    base = keyed()
    variant = template_copy / "fa2" / "variant.cuh.jinja"
    # 1. an edit that changes the generated code
    variant.write_text(variant.read_text() + "\n// edited\n")
    render._template_digest.cache_clear()
    edited = keyed()
    assert edited.uri != base.uri
    assert dict(edited.inputs)["sources"] != dict(base.inputs)["sources"]
    # 2. an edit that changes only the template (a Jinja comment): still a new key
    other = tmp_path / "templates2"
    shutil.copytree(template_copy, other)
    comment_only = other / "fa2" / "variant.cuh.jinja"
    comment_only.write_text(comment_only.read_text() + "{# a note #}")
    vg_env.set(VARIANTGEN_TEMPLATE_DIR=other)
    noted = keyed()
    assert dict(noted.inputs)["sources"] == dict(edited.inputs)["sources"]
    assert dict(noted.inputs)["templates"] != dict(edited.inputs)["templates"]
    assert noted.uri != edited.uri


# ----------------------------------------------------------------------------- publish / lookup


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / "cache")


def test_publish_lookup_round_trip(cache):
    k = key()
    assert not cache.lookup(k.uri) and cache.lookup(k.uri).reason == "not in cache"
    staging = cache.new_staging(k.uri)
    assert staging.parent == cache.root / ".staging" and staging.name.startswith(k.uri + ".")
    (staging / "mod.so").write_bytes(b"\x7fELF dummy")
    (staging / "src").mkdir()
    (staging / "src" / "variant.cuh").write_text("// source")
    entry = cache.publish(k.uri, staging, {"module_file": "mod.so", "inputs_digest": k.inputs_digest})
    assert not staging.exists() and entry.path == cache.root / k.uri
    assert entry.module_path.read_bytes() == b"\x7fELF dummy"
    found = cache.lookup(k.uri)
    assert found and found.reason == "" and found.entry.path == entry.path
    manifest = json.loads((entry.path / "manifest.json").read_text())
    assert manifest["uri"] == k.uri and manifest["module_size"] == len(b"\x7fELF dummy")
    assert manifest["module_sha256"] == cache_mod.file_sha256(entry.module_path)
    assert manifest["manifest_version"] == cache_mod.MANIFEST_VERSION
    assert found.entry.manifest == manifest
    assert (entry.path / "src" / "variant.cuh").read_text() == "// source"
    assert [(uri, bool(look)) for uri, look in cache.entries()] == [(k.uri, True)]
    assert cache.find_same_inputs(PREFIX, k.inputs_digest)[0].uri == k.uri
    assert not list((cache.root / ".staging").iterdir())


def test_entries_skip_internal_folders(cache):
    procs.publish_fake(cache, key())
    cache.new_staging("other_uri")
    (cache.root / ".failed" / "x").mkdir(parents=True)
    assert [uri for uri, _ in cache.entries()] == [key().uri]
    assert list(Cache(cache.root / "missing").entries()) == []


def _published(cache):
    k = key()
    entry = procs.publish_fake(cache, k)
    assert cache.lookup(k.uri)
    return k, entry


def test_truncated_module_is_detected(cache):
    k, entry = _published(cache)
    data = entry.module_path.read_bytes()
    entry.module_path.write_bytes(data[: len(data) // 2])
    found = cache.lookup(k.uri)
    assert not found
    assert found.reason == f"entry {entry.path}: module file size differs from the manifest (truncated?)"
    assert not cache.lookup(k.uri, verify=False)  # the size is checked without reading the module


def test_corrupted_module_is_detected(cache):
    k, entry = _published(cache)
    data = bytearray(entry.module_path.read_bytes())
    data[5] ^= 0xFF
    entry.module_path.write_bytes(bytes(data))
    found = cache.lookup(k.uri)
    assert not found
    assert found.reason == f"entry {entry.path}: module file hash differs from the manifest (corrupted)"
    assert cache.lookup(k.uri, verify=False)  # same size: only the hash (read with verify=True) tells


def test_missing_module_is_detected(cache):
    k, entry = _published(cache)
    entry.module_path.unlink()
    assert cache.lookup(k.uri).reason == f"entry {entry.path}: module file {entry.module_path.name} is missing"


def test_missing_manifest_is_detected(cache):
    k, entry = _published(cache)
    (entry.path / "manifest.json").unlink()
    found = cache.lookup(k.uri)
    assert not found and found.reason == f"entry {entry.path} has no manifest (incomplete or damaged)"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "has an unreadable manifest"),
        ("", "has an unreadable manifest"),
        ("[1, 2]", "manifest is not a JSON object"),
        ('{"manifest_version": 99}', "manifest version 99 is not 1"),
    ],
)
def test_corrupted_manifest_is_detected(cache, content, reason):
    k, entry = _published(cache)
    (entry.path / "manifest.json").write_text(content)
    found = cache.lookup(k.uri)
    assert not found and reason in found.reason and found.reason.startswith(f"entry {entry.path}")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"uri": "vg_other_0123456789ab"}, "manifest names 'vg_other_0123456789ab', not this entry"),
        ({"module_file": "../../evil.so"}, "manifest names a module file outside the entry"),
        ({"module_file": ".hidden.so"}, "manifest names a module file outside the entry"),
        ({"module_sha256": None}, "manifest lacks module_sha256"),
        ({"module_size": "12"}, "manifest lacks module_size"),
    ],
)
def test_manifest_fields_are_checked(cache, change, reason):
    k, entry = _published(cache)
    manifest = json.loads((entry.path / "manifest.json").read_text())
    manifest.update(change)
    (entry.path / "manifest.json").write_text(json.dumps(manifest))
    assert cache.lookup(k.uri).reason == f"entry {entry.path}: {reason}"


def test_a_manifest_nested_too_deeply_is_a_damaged_entry(cache):
    """A regression: json raised RecursionError on `[[[[...` - a traceback from `variantgen list`,
    every lookup (make_wrapper, JIT-disabled servers) and failure()."""
    k, entry = _published(cache)
    (entry.path / "manifest.json").write_text("[" * 100_000)
    reason = f"entry {entry.path} has an unreadable manifest (JSON nested too deeply)"
    assert cache.lookup(k.uri).reason == reason
    assert [(uri, found.reason) for uri, found in cache.entries()] == [(k.uri, reason)]
    assert cache.damaged_same_inputs(k.prefix, k.inputs_digest) == [reason]
    cache.failed_dir(k.uri).mkdir(parents=True)
    (cache.failed_dir(k.uri) / "failure.json").write_text("{" * 100_000)
    assert cache.failure(k.uri) is None


def test_damaged_entry_is_replaced_by_the_next_publish(cache):
    k, entry = _published(cache)
    entry.module_path.write_bytes(b"junk")
    assert not cache.lookup(k.uri)
    with cache.lock(k.uri):
        procs.publish_fake(cache, k)
    assert cache.lookup(k.uri)
    assert not list((cache.root / ".trash").iterdir())


@pytest.mark.parametrize("uri", ["", ".staging", "../x", "a/b", "a\0b", "x" * 201])
def test_invalid_uris_are_refused(cache, uri):
    with pytest.raises(CacheError, match="invalid module URI"):
        cache.lookup(uri)


def test_remove(cache):
    k, entry = _published(cache)
    assert cache.remove(k.uri) is True
    assert not entry.path.exists() and not cache.lookup(k.uri)
    assert cache.remove(k.uri) is False


def test_remove_an_entry_another_process_removed_meanwhile(cache, monkeypatch):
    """Two `variantgen clear --yes` at once: the second saw the entry, waited for its lock while
    the first removed it, then failed with "No such file or directory". Checked again under the
    lock: an entry already gone is simply not removed."""
    k, entry = _published(cache)
    real_lock = cache.lock

    @contextlib.contextmanager
    def lock_taken_after_the_other_clear(uri, **kwargs):
        with real_lock(uri, **kwargs):  # the other clear, holding the lock first
            cache._discard(entry.path)
        with real_lock(uri, **kwargs):
            yield

    monkeypatch.setattr(cache, "lock", lock_taken_after_the_other_clear)
    assert cache.remove(k.uri) is False
    assert not entry.path.exists() and not list((cache.root / ".locks").iterdir())


def test_keep_failed(cache):
    staging = cache.new_staging("vg_x_0123")
    (staging / "build.log").write_text("error: boom")
    kept = cache.keep_failed("vg_x_0123", staging)
    assert kept == cache.root / ".failed" / "vg_x_0123" and (kept / "build.log").read_text() == "error: boom"
    again = cache.new_staging("vg_x_0123")
    (again / "build.log").write_text("error: twice")
    assert (cache.keep_failed("vg_x_0123", again) / "build.log").read_text() == "error: twice"


# ----------------------------------------------------------------------------- read-only caches


@pytest.fixture
def no_writes(monkeypatch):
    """Make every file-system write fail, as on a read-only mount (tests may run as root)."""

    def deny(*args, **kwargs):
        raise PermissionError(13, "Permission denied (read-only test)")

    real_open = io.open
    real_os_open = os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(ch in mode for ch in "wax+"):
            deny()
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
            deny()
        return real_os_open(path, flags, *args, **kwargs)

    def activate():
        monkeypatch.setattr(io, "open", guarded_open)
        monkeypatch.setattr(builtins, "open", guarded_open)
        monkeypatch.setattr(os, "open", guarded_os_open)
        for name in ("mkdir", "makedirs", "replace", "rename", "unlink", "remove", "rmdir"):
            monkeypatch.setattr(os, name, deny)
        monkeypatch.setattr(shutil, "rmtree", deny)

    return activate


def _make_read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _make_writable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def test_read_only_cache_serves_lookups(cache, no_writes):
    k, entry = _published(cache)
    _make_read_only(cache.root)
    try:
        no_writes()
        found = Cache(cache.root).lookup(k.uri)
        assert found and found.entry.module_path == entry.module_path
        assert [uri for uri, _ in Cache(cache.root).entries()] == [k.uri]
        assert Cache(cache.root).find_same_inputs(PREFIX, k.inputs_digest)[0].uri == k.uri
        writable, why = Cache(cache.root).writable()
        assert not writable and why.startswith(f"cache directory {cache.root} is not writable")
    finally:
        _make_writable(cache.root)


def test_jit_disabled_build_module_on_a_read_only_cache(vg_env, monkeypatch, no_writes):
    monkeypatch.setattr(build, "toolchain", lambda: procs.fake_toolchain())
    config = causal_config()
    k = build.module_key(render_module(config), procs.fake_toolchain())
    cache = Cache(vg_env.cache_dir)
    procs.publish_fake(cache, k)
    render_module(config)  # warm the template caches before writes are denied
    vg_env.set(VARIANTGEN_DISABLE_JIT="1")
    _make_read_only(cache.root)
    try:
        no_writes()
        result = build.build_module(config, cache)
        assert result.entry.uri == k.uri and result.built is False
    finally:
        _make_writable(cache.root)


def test_read_only_cache_refuses_to_build(vg_env, fake_build, monkeypatch):
    cache = Cache(vg_env.cache_dir)
    monkeypatch.setattr(Cache, "writable", lambda self: (False, f"cache directory {self.root} is not writable (x)"))
    with pytest.raises(JitDisabledError, match="is not writable .*; module vg_causal_.* is not in it and cannot be "
                                               "built there"):
        build.build_module(causal_config(), cache)
    assert builds(fake_build) == []


# ----------------------------------------------------------------------------- build_module (fake builder)


def test_build_module_builds_once_then_finds(vg_env, fake_build):
    cache = Cache(vg_env.cache_dir)
    first = build.build_module(causal_config(), cache)
    assert first.built is True and cache.lookup(first.key.uri)
    second = build.build_module(causal_config(), cache)
    assert second.built is False and second.entry.uri == first.entry.uri
    assert len(builds(fake_build)) == 1
    assert first.key.uri == build.module_key(render_module(causal_config()), procs.fake_toolchain()).uri


def test_build_module_rebuilds_a_damaged_entry(vg_env, fake_build):
    cache = Cache(vg_env.cache_dir)
    first = build.build_module(causal_config(), cache)
    first.entry.module_path.write_bytes(b"truncated")
    again = build.build_module(causal_config(), cache)
    assert again.built is True and cache.lookup(first.key.uri)
    assert len(builds(fake_build)) == 2


def test_build_module_without_toolchain_raises_when_jit_is_on(vg_env, monkeypatch):
    def missing():
        raise ToolchainError("nvcc not found")

    monkeypatch.setattr(build, "toolchain", missing)
    with pytest.raises(ToolchainError):
        build.build_module(causal_config(), Cache(vg_env.cache_dir))


@pytest.mark.parametrize("variable", ["VARIANTGEN_DISABLE_JIT", "FLASHINFER_DISABLE_JIT"])
def test_jit_disabled_and_missing_raises(vg_env, fake_build, variable):
    vg_env.set(**{variable: "1"})
    assert vg_env.settings.jit_disabled and vg_env.settings.jit_disabled_by == variable
    cache = Cache(vg_env.cache_dir)
    with pytest.raises(JitDisabledError) as info:
        build.build_module(causal_config(), cache)
    uri = build.module_key(render_module(causal_config()), procs.fake_toolchain()).uri
    assert str(info.value) == (f"JIT disabled by {variable} and module {uri} is not precompiled in {cache.root} "
                               "(not in cache)")
    assert builds(fake_build) == [] and not cache.root.exists()


def test_allow_build_false_is_lookup_only(vg_env, fake_build):
    with pytest.raises(JitDisabledError, match="^building not allowed and module"):
        build.build_module(causal_config(), Cache(vg_env.cache_dir), allow_build=False)
    assert builds(fake_build) == []


@pytest.mark.parametrize("local", ["other nvcc", "no toolchain"])
def test_jit_disabled_finds_a_build_from_another_toolchain(vg_env, monkeypatch, local):
    config = causal_config()
    built_by = build.module_key(render_module(config), procs.fake_toolchain("V12.4.131"))
    cache = Cache(vg_env.cache_dir)
    procs.publish_fake(cache, built_by)
    # also a build of *different* inputs under the same prefix: must not be picked
    other_inputs = ModuleKey(built_by.prefix, replaced(built_by.inputs, "sources", "x" * 64), built_by.toolchain)
    procs.publish_fake(cache, other_inputs, extra={"built_at": time.time() + 100})

    if local == "other nvcc":
        monkeypatch.setattr(build, "toolchain", lambda: procs.fake_toolchain("V13.0.88"))
    else:
        def missing():
            raise ToolchainError("nvcc not found")

        monkeypatch.setattr(build, "toolchain", missing)
    monkeypatch.setattr(build, "_build_locked", lambda *a: pytest.fail("must not build with JIT disabled"))
    vg_env.set(VARIANTGEN_DISABLE_JIT="1")
    result = build.build_module(config, cache)
    assert result.built is False
    assert result.entry.uri == built_by.uri != result.key.uri
    assert result.key.inputs_digest == built_by.inputs_digest


def test_relocated_cache_still_works(vg_env, tmp_path, monkeypatch):
    config = causal_config()
    k = build.module_key(render_module(config), procs.fake_toolchain("V12.4.131"))
    procs.publish_fake(Cache(vg_env.cache_dir), k)
    moved = tmp_path / "deployed" / "somewhere" / "else"
    shutil.copytree(vg_env.cache_dir, moved)
    shutil.rmtree(vg_env.cache_dir)
    found = Cache(moved).lookup(k.uri)
    assert found and found.entry.module_path == moved / k.uri / f"{k.uri}.so"
    monkeypatch.setattr(build, "toolchain", lambda: procs.fake_toolchain("V13.0.88"))
    monkeypatch.setattr(build, "_build_locked", lambda *a: pytest.fail("must not build with JIT disabled"))
    vg_env.set(VARIANTGEN_DISABLE_JIT="1", VARIANTGEN_CACHE_DIR=moved)
    assert build.default_cache().root == moved
    result = build.build_module(config, build.default_cache())
    assert result.entry.path == moved / k.uri and result.built is False


# ----------------------------------------------------------------------------- processes


def _start(target, *args):
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _stop(proc) -> None:
    if proc.is_alive():
        procs.kill(proc.pid)
    proc.join(30)


def _exit_codes(children, timeout: float) -> list[int | None]:
    """Wait for every child (up to ``timeout`` s each), kill those left; their exit codes."""
    try:
        for child in children:
            child.join(timeout)
    finally:
        for child in children:
            _stop(child)
    return [c.exitcode for c in children]


def test_lock_is_exclusive_across_processes_and_released_by_sigkill(tmp_path):
    root, uri = tmp_path / "cache", key().uri
    ready = tmp_path / "ready"
    holder = _start(procs.hold_lock, str(root), uri, str(ready))
    try:
        wait_for(ready)
        # another process cannot take it ...
        out = tmp_path / "other.txt"
        other = _start(procs.try_lock, str(root), uri, 0.3, str(out))
        other.join(60)
        assert out.read_text().startswith(f"LockTimeout: timed out after 0s waiting for another build of {uri} "
                                          f"(held by pid {holder.pid} on ")
        # ... nor can this one; the holder is named
        with pytest.raises(cache_mod.LockTimeout, match="timed out after 0s waiting for another build") as e:
            with Cache(root).lock(uri, timeout=0.2):
                pass
        assert e.value.holder.pid == holder.pid and e.value.uri == uri and e.value.waited >= 0.2
        assert Cache(root).holder(uri).pid == holder.pid
        # a different URI is not blocked
        with Cache(root).lock(uri + "x", timeout=1):
            pass
    finally:
        procs.kill(holder.pid)
        holder.join(30)
    assert holder.exitcode == -9
    start = time.monotonic()
    with Cache(root).lock(uri, timeout=10):
        assert time.monotonic() - start < 5  # the dead holder's lock is gone at once
        assert Cache(root).holder(uri).pid == os.getpid()  # its stale description replaced
    assert list((root / ".locks").iterdir()) == []


def test_lock_file_lives_only_while_held(tmp_path):
    cache = Cache(tmp_path / "cache")
    uri = key().uri
    path = cache.lock_path(uri)
    assert cache.holder(uri) is None
    with cache.lock(uri):
        holder = cache.holder(uri)
        assert path.exists() and holder.pid == os.getpid() and abs(holder.since - time.time()) < 60
        assert holder.describe().startswith(f"pid {os.getpid()} on ")
    assert not path.exists() and cache.holder(uri) is None
    with pytest.raises(RuntimeError):
        with cache.lock(uri):
            raise RuntimeError("a build failed")
    assert not path.exists()


def test_lock_waiters_are_told_once_who_holds_it(tmp_path):
    root, uri = tmp_path / "cache", key().uri
    ready = tmp_path / "ready"
    holder = _start(procs.hold_lock, str(root), uri, str(ready))
    try:
        wait_for(ready)
        told = []
        with pytest.raises(cache_mod.LockTimeout):
            with Cache(root).lock(uri, timeout=0.5, on_wait=told.append):
                pass
        assert [h.pid for h in told] == [holder.pid]
    finally:
        _stop(holder)


def test_lock_is_mutually_exclusive_under_contention(tmp_path):
    """Four processes x 40 read-modify-writes of one counter under the lock: none lost, although
    each holder unlinks the lock file on release (waiters that opened the old file retry)."""
    n, rounds = 4, 40
    root, counter = tmp_path / "cache", tmp_path / "counter"
    counter.write_text("0")
    barrier = SPAWN.Barrier(n)
    children = [_start(procs.count_under_lock, str(root), key().uri, str(counter), rounds, barrier)
                for _ in range(n)]
    assert _exit_codes(children, 120) == [0] * n
    assert int(counter.read_text()) == n * rounds
    assert list((root / ".locks").iterdir()) == []


def test_waiters_report_a_build_that_failed_while_they_waited(vg_env, tmp_path, monkeypatch):
    """Four processes want one module whose build fails: one builds (and fails), the three that
    waited report that failure instead of each compiling the same failing module in turn."""
    n = 4
    record, out_dir = tmp_path / "builds.txt", tmp_path / "results"
    out_dir.mkdir()
    barrier = SPAWN.Barrier(n)
    children = [_start(procs.race_failing_build, str(vg_env.cache_dir), str(record), str(out_dir), barrier, 1.0)
                for _ in range(n)]
    assert _exit_codes(children, 180) == [0] * n
    assert len(builds(record)) == 1, builds(record)
    builder = int(builds(record)[0].split()[0])
    results = {int(p.stem): p.read_text() for p in out_dir.iterdir()}
    assert len(results) == n
    assert results[builder].startswith("BuildError: building module vg_causal_") and "ninja exit 1" in results[builder]
    for pid, text in results.items():
        if pid != builder:
            assert text.startswith("BuildError: building module vg_causal_"), text
            assert f"failed in pid {builder} on " in text and "while this process waited for that build; not tried " \
                                                            "again (ninja exit 1 after 1.0s)" in text
            assert "first error: kernel.cu(3): error: boom" in text and "full log: " in text
    cache = Cache(vg_env.cache_dir)
    assert list(cache.entries()) == [] and list((vg_env.cache_dir / ".locks").iterdir()) == []
    # a build started after the failure tries again
    uri = builds(record)[0].split()[1]
    assert cache.failure(uri).pid == builder
    monkeypatch.setattr(build, "flashinfer_info", lambda: procs.FAKE_FLASHINFER)
    monkeypatch.setattr(build, "toolchain", lambda: procs.fake_toolchain())
    monkeypatch.setattr(build, "_build_locked", procs.FakeBuilder(str(record), fail=True))
    with pytest.raises(BuildError, match="ninja exit 1"):
        build.build_module(procs.causal_config(), cache)
    assert len(builds(record)) == 2


def test_lock_directory_must_be_creatable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheError, match="cannot create lock directory"):
        with Cache(blocker).lock("vg_x_1"):
            pass


def test_build_killed_midway_leaves_only_staging(vg_env, tmp_path, fake_build):
    root = vg_env.cache_dir
    hang = tmp_path / "hanging"
    child = _start(procs.build_and_hang, str(root), str(hang))
    try:
        wait_for(hang)
        staging = Path(hang.read_text())
        assert staging.is_dir() and staging.parent == root / ".staging"
    finally:
        _stop(child)
    assert child.exitcode == -9
    cache = Cache(root)
    uri = staging.name.split(".")[0]
    assert sorted(p.name for p in root.iterdir()) == [".locks", ".staging"]
    assert list((root / ".staging").iterdir()) == [staging]
    assert not cache.lookup(uri) and cache.lookup(uri).reason == "not in cache"
    assert list(cache.entries()) == [] and cache.find_same_inputs(uri.rsplit("_", 1)[0], "x") == []
    # the next build takes the (released) lock, clears the dead attempt and publishes
    with cache.lock(uri, timeout=5):
        fresh = cache.new_staging(uri)
    assert not staging.exists() and fresh.exists()
    shutil.rmtree(fresh)
    result = build.build_module(causal_config(), cache)
    assert result.built and result.entry.uri == uri
    assert list((root / ".staging").iterdir()) == []


def test_eight_processes_race_to_one_build(vg_env, tmp_path):
    n = 8
    record, out_dir = tmp_path / "builds.txt", tmp_path / "results"
    out_dir.mkdir()
    barrier = SPAWN.Barrier(n)
    children = [_start(procs.race_build, str(vg_env.cache_dir), str(record), str(out_dir), barrier, 0.5)
                for _ in range(n)]
    assert _exit_codes(children, 180) == [0] * n
    results = [json.loads(p.read_text()) for p in sorted(out_dir.iterdir())]
    assert len(results) == n
    assert len(builds(record)) == 1, builds(record)
    assert len({r["uri"] for r in results}) == 1
    assert len({r["path"] for r in results}) == 1 and len({r["sha"] for r in results}) == 1
    assert sum(r["built"] for r in results) == 1
    builder_pid = int(builds(record)[0].split()[0])
    assert {r["built_by_pid"] for r in results} == {builder_pid}
    cache = Cache(vg_env.cache_dir)
    assert [uri for uri, _ in cache.entries()] == [results[0]["uri"]]
    assert list((vg_env.cache_dir / ".staging").iterdir()) == []
