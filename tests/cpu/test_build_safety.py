"""A cache path is data, never code: builds in folders whose paths hold $(...), backticks, $VAR,
quotes, line breaks and spaces, through the real ninja and the fake toolchain (whose nvcc hands
paths to a shell in double quotes, as the real one does), and once with the real nvcc
(marked ``nvcc``). Also: a full disk at link time is reported as such.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import _fake_toolchain as fake
import pytest
from _cache_procs import causal_config

from variantgen.build import builder as build
from variantgen.build import place as build_place
from variantgen.build.cache import Cache
from variantgen.core.errors import BuildError


def hostile_name(markers: Path, newline: bool = True) -> str:
    """A folder name that runs ``touch`` into ``markers`` wherever a shell expands it, and that
    names another folder wherever $HOME is expanded."""
    return (f"c $(touch {markers}/dollar-paren) `touch {markers}/backtick` $HOME ${{HOME}} \"dq\" 'sq' "
            "semi; amp& pipe| star* q?" + (" new\nline" if newline else ""))


@pytest.fixture
def toolchain(tmp_path, monkeypatch, vg_env):
    tc, info = fake.make_toolchain(tmp_path / "tools")
    monkeypatch.setattr(build, "toolchain", lambda: tc)
    monkeypatch.setattr(build, "flashinfer_info", lambda: info)
    for name in ("VG_FAKE_NVCC_SLEEP", "VG_FAKE_NVCC_FAIL", "VG_FAKE_PIDS"):
        monkeypatch.delenv(name, raising=False)
    return tc


@pytest.fixture
def markers(tmp_path) -> Path:
    path = tmp_path / "markers"
    path.mkdir()
    return path


@pytest.fixture
def temp_root(tmp_path, monkeypatch) -> Path:
    """A private temporary root (where builds in hostile paths run), to see what is left there."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setenv("TMPDIR", str(root))
    return root


def test_plain_paths():
    assert build_place.is_plain("/srv/my cache/vg_x_1.2+3,4@5%6=7:8~9-0")
    assert build_place.is_plain("/données/キャッシュ")
    for c in "$`\"'\\\n\r;&|*?!#(){}[]<>":
        assert not build_place.is_plain(f"/srv/a{c}b"), c


@pytest.mark.parametrize("newline", [True, False])
def test_a_cache_path_with_shell_characters_builds_and_runs_nothing(toolchain, tmp_path, markers, temp_root, newline):
    """`VARIANTGEN_CACHE_DIR="$PWD/c \\$(touch PWNED)" variantgen precompile ...` created PWNED
    (nvcc's shell expanded the path it was given) and a path holding $HOME failed to build. The
    build includes a shared object (the launch builder's plan.cu), compiled into the store. (A line
    break, which a ninja file cannot hold, made the build fail before any compile.)"""
    cache = Cache(tmp_path / hostile_name(markers, newline) / "cache")
    result = build.build_module(causal_config(), cache)
    assert result.built and cache.lookup(result.entry.uri)
    assert sorted(p.name for p in markers.iterdir()) == []
    log = (result.entry.path / "build.log").read_text()
    assert "fake nvcc: compiling src/plan.cu" in log and "did not find" not in log
    assert list(temp_root.iterdir()) == []  # the private build folder is gone
    assert sorted(p.name for p in result.entry.path.iterdir()) == sorted(
        ["build.log", "build.ninja", "manifest.json", f"{result.entry.uri}.so", "plan.object.json", "src"])
    shared = Cache(cache.root / ".objects")
    assert [found for _, found in shared.entries()] and all(found for _, found in shared.entries())
    again = build.build_module(causal_config(), cache)
    assert not again.built and again.entry.uri == result.entry.uri


def test_a_temporary_folder_with_shell_characters_is_not_handed_to_nvcc(toolchain, tmp_path, markers, monkeypatch):
    """TMPDIR names nvcc's temporary files on its shell's command lines too."""
    hostile_tmp = tmp_path / f"t $(touch {markers}/tmpdir)"
    hostile_tmp.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(hostile_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(hostile_tmp))
    result = build.build_module(causal_config(), Cache(tmp_path / "plain cache"))
    assert result.built and list(markers.iterdir()) == []


def test_a_failed_build_in_a_hostile_path_is_kept_and_runs_nothing(toolchain, tmp_path, markers, temp_root,
                                                                  monkeypatch):
    monkeypatch.setenv("VG_FAKE_NVCC_FAIL", "binding")
    cache = Cache(tmp_path / hostile_name(markers) / "cache")
    with pytest.raises(BuildError, match="binding.cu\\(3\\): error: fake failure") as e:
        build.build_module(causal_config(), cache)
    kept = Path(e.value.log_path).parent
    assert kept.parent == cache.root / ".failed" and (kept / "src").is_dir() and (kept / "build.ninja").is_file()
    assert list(markers.iterdir()) == [] and list(temp_root.iterdir()) == []
    assert list((cache.root / ".staging").iterdir()) == []
    # the printed command re-runs it in a plain-named copy: the compile error again, no payload
    again = subprocess.run(e.value.command, shell=True, capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "binding.cu(3): error: fake failure" in again.stdout, again.stdout
    assert list(markers.iterdir()) == []
    copy = Path(re.search(r"^variantgen: build folder (.*)$", again.stdout, re.M).group(1))
    assert copy.parent == temp_root and build_place.is_plain(copy)
    shutil.rmtree(copy)


def test_the_printed_command_of_a_plain_path_runs_ninja_there(tmp_path):
    assert build_place.reproduce_command(tmp_path / "my cache", "A=b ") == \
        f"A=b ninja -C '{tmp_path}/my cache' -f build.ninja"


def test_no_plain_temporary_root_is_a_clear_error(toolchain, tmp_path, markers, monkeypatch):
    monkeypatch.setattr(build_place, "plain_temp_root", lambda: (_ for _ in ()).throw(
        build_place.CacheError("the build needs a temporary folder whose path holds no shell characters")))
    cache = Cache(tmp_path / hostile_name(markers))
    with pytest.raises(build_place.CacheError, match="needs a temporary folder"):
        build.build_module(causal_config(), cache)
    assert list((cache.root / ".staging").iterdir()) == []


def test_a_full_disk_at_link_time_is_reported_as_such(toolchain, tmp_path, monkeypatch):
    """A full disk at link time reported `ld returned 1 exit status` and hid "No space left on
    device" (ld says it first, then gcc's collect2 says it failed)."""
    monkeypatch.setenv("VG_FAKE_LINK_ENOSPC", "1")
    cache = Cache(tmp_path / "cache")
    with pytest.raises(BuildError) as e:
        build.build_module(causal_config(), cache)
    first_line = str(e.value).splitlines()[0]
    assert re.fullmatch(r"building module \S+ failed \(ninja exit 1 after [0-9.]+s\): /usr/bin/ld: final link failed: "
                        rf"No space left on device \(in the cache {re.escape(str(cache.root))}, or the build's "
                        r"temporary folder \S+\)", first_line), first_line
    assert e.value.first_error == "/usr/bin/ld: final link failed: No space left on device"
    assert "first error: /usr/bin/ld: final link failed: No space left on device" in str(e.value)
    record = cache.failure(e.value.log_path.split("/")[-2])
    assert record is not None and record.first_error == e.value.first_error


@pytest.mark.nvcc
def test_a_real_fa2_build_in_a_hostile_cache_path_runs_nothing(tmp_path, markers, temp_root):
    """The real nvcc (CPU build), a small fa2 module, in a cache path holding a payload."""
    from conftest import SPECS_DIR

    import variantgen
    from variantgen.codegen.render import ModuleConfig
    from variantgen.core.errors import ToolchainError

    try:
        build.toolchain()
    except ToolchainError as e:
        pytest.skip(str(e))
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    config = ModuleConfig(spec, 64, 64, "fp16", "fp16", "fp16", "9.0a", mask_modes=("causal",))
    cache = Cache(tmp_path / hostile_name(markers) / "cache")
    result = build.build_module(config, cache, jobs=2)
    assert result.built and result.entry.module_path.read_bytes()[:4] == b"\x7fELF"
    assert list(markers.iterdir()) == []
    assert list(temp_root.iterdir()) == []
