"""The object cache of shared compile units (variantgen/build/objects.py), without ninja: what one
`python -m variantgen.build.shared_compile` call does (test_build_ninja.py builds modules through it)."""

from __future__ import annotations

import json
import sys

import pytest

from variantgen.build import objects
from variantgen.build.cache import Cache

URI = "vg_fa3_plain_paged_causal_qbf16_kvbf16_obf16_hd128x128_sm90a_0123456789ab"


def writer(payload: bytes = b"object") -> list[str]:
    """A 'compiler' that writes ``payload`` to its output."""
    return [sys.executable, "-c", f"import sys; open(sys.argv[1], 'wb').write({payload!r})", objects.PLACEHOLDER]


def test_ensure_compiles_once_then_copies(tmp_path):
    store = Cache(tmp_path / ".objects")
    assert objects.ensure(store, URI, writer(), tmp_path / "a.o", lock_timeout=5, describe={"unit": "x.cu"}) is True
    assert (tmp_path / "a.o").read_bytes() == b"object"
    found = store.lookup(URI)
    assert found and found.entry.manifest["unit"] == "x.cu" and found.entry.manifest["module_file"] == "unit.o"
    assert objects.ensure(store, URI, writer(b"other"), tmp_path / "b.o", lock_timeout=5) is False
    assert (tmp_path / "b.o").read_bytes() == b"object"
    assert list((store.root / ".staging").iterdir()) == []


def test_an_object_cleared_between_lookup_and_copy_is_compiled_again(tmp_path, monkeypatch):
    store = Cache(tmp_path / ".objects")
    objects.ensure(store, URI, writer(), tmp_path / "a.o", lock_timeout=5)
    real = store.lookup

    def lookup_then_clear(uri, **kwargs):
        found = real(uri, **kwargs)
        monkeypatch.setattr(store, "lookup", real)
        store.remove(uri)  # `variantgen clear` in another process, right after our lookup
        return found

    monkeypatch.setattr(store, "lookup", lookup_then_clear)
    assert objects.ensure(store, URI, writer(b"again"), tmp_path / "b.o", lock_timeout=5) is True
    assert (tmp_path / "b.o").read_bytes() == b"again"


def test_a_failed_compile_publishes_nothing_and_keeps_no_staging(tmp_path, capfd):
    store = tmp_path / ".objects"
    fail = [sys.executable, "-c", "import sys; print('error: no luck'); sys.exit(3)", objects.PLACEHOLDER]
    rc = objects.main(["--store", str(store), "--uri", URI, "--out", str(tmp_path / "a.o"), "--lock-timeout", "5",
                       "--", *fail])
    out = capfd.readouterr()
    assert rc == 3 and "error: no luck" in out.out
    assert f"variantgen: compiling shared object {URI} failed (exit 3)" in out.err
    assert list(Cache(store).entries()) == [] and list((store / ".staging").iterdir()) == []
    assert not (tmp_path / "a.o").exists()


def test_the_command_line_says_what_it_did(tmp_path, capfd):
    describe = tmp_path / "unit.object.json"
    describe.write_text(json.dumps({"unit": "paged_kernel_causal.cu", "inputs_digest": "abc"}))
    args = ["--store", str(tmp_path / ".objects"), "--uri", URI, "--lock-timeout", "5", "--describe", str(describe)]
    assert objects.main([*args, "--out", str(tmp_path / "a.o"), "--", *writer()]) == 0
    assert objects.main([*args, "--out", str(tmp_path / "b.o"), "--", *writer()]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines == [f"variantgen: shared object {URI} compiled", f"variantgen: shared object {URI} from the cache"]
    assert Cache(tmp_path / ".objects").lookup(URI).entry.manifest["inputs_digest"] == "abc"


def test_a_command_without_the_output_placeholder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        objects.main(["--store", str(tmp_path), "--uri", URI, "--out", str(tmp_path / "a.o"), "--lock-timeout", "1",
                      "--", "nvcc", "-c", "x.cu", "-o", "x.o"])
    assert e.value.code == 2 and "must name its output as {object}" in capsys.readouterr().err
