"""Shipped specs by name: variantgen.shipped_specs / resolve_spec, and every entry point that
takes a spec (make_wrapper, probe, the command line) accepting a name where it accepts a path."""

from __future__ import annotations

import importlib

import pytest
import torch
from click.testing import CliRunner
from conftest import SPEC_FILES, SPECS_DIR

import variantgen
from variantgen.build import builder as build
from variantgen.core.errors import SpecError
from variantgen.lang import library
from variantgen.tools.cli import main

probe_mod = importlib.import_module("variantgen.api.probing")
SHIPPED = ", ".join(p.stem for p in SPEC_FILES)


def unknown(name: str) -> str:
    return f"{name}: not a spec file, nor the name of a shipped spec ({SHIPPED})"


@pytest.fixture(autouse=True)
def clean(vg_env, monkeypatch):
    probe_mod.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield vg_env
    probe_mod.cache_clear()


def run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


# ----------------------------------------------------------------------------- the library


def test_shipped_specs_are_the_specs_folder():
    shipped = variantgen.shipped_specs()
    assert list(shipped) == [p.stem for p in SPEC_FILES] and len(shipped) >= 9
    assert list(shipped.values()) == SPEC_FILES and all(p.parent == SPECS_DIR for p in shipped.values())
    for name, path in shipped.items():  # the name users pass is the spec's own name (its URI prefix)
        assert variantgen.load_spec(path).name == name
    shipped.clear()  # a copy: callers cannot change the library
    assert "mm_prefix" in variantgen.shipped_specs()


@pytest.mark.parametrize("name", ["mm_prefix", "sliding_window", "causal"])
def test_a_name_resolves_to_the_shipped_file(name):
    spec = variantgen.resolve_spec(name)
    assert spec == variantgen.load_spec(SPECS_DIR / f"{name}.yaml") and spec.path == str(SPECS_DIR / f"{name}.yaml")


def test_a_renamed_spec_still_resolves(caplog):
    """`attention_sink` (StreamingLLM's kept first tokens) is `streaming_sink` now, apart from the
    learned sinks of `attention_sink_learned`; the old name still works, with a warning."""
    with caplog.at_level("WARNING", logger="variantgen.lang.library"):
        spec = variantgen.resolve_spec("attention_sink")
    assert spec.name == "streaming_sink" and spec == variantgen.load_spec(SPECS_DIR / "streaming_sink.yaml")
    assert "`attention_sink` is now called `streaming_sink`" in caplog.text
    assert "attention_sink" not in variantgen.shipped_specs()
    assert variantgen.resolve_spec("attention_sink_learned").sink is not None


def test_specs_and_paths_resolve_as_given(spec_text):
    path = spec_text("name: strict\nmask: kv_pos < q_pos\n", name="strict.yaml")
    spec = variantgen.resolve_spec(path)
    assert spec.name == "strict" and variantgen.resolve_spec(spec) is spec
    assert variantgen.resolve_spec(str(path)) == spec


def test_an_existing_file_beats_the_shipped_name(tmp_path, monkeypatch):
    (tmp_path / "causal").write_text("name: mine\nmask: kv_pos < q_pos\n")
    monkeypatch.chdir(tmp_path)
    assert variantgen.resolve_spec("causal").name == "mine"
    (tmp_path / "sliding_window").mkdir()  # a folder is no spec file: the name still wins
    assert variantgen.resolve_spec("sliding_window").name == "sliding_window"


@pytest.mark.parametrize(("text", "hint"), [
    ("mm_prefx", "did you mean `mm_prefix`?"),
    ("MM_PREFIX", "did you mean `mm_prefix`?"),
    ("slidingwindow", "did you mean `sliding_window`?"),
    ("gqa_tree", "pass the path of a spec file, e.g. ./my_mask.yaml"),
])
def test_an_unknown_name_lists_the_shipped_specs(tmp_path, monkeypatch, text, hint):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as e:
        variantgen.resolve_spec(text)
    assert str(e.value) == f"{unknown(text)}\n  hint: {hint}"


def test_a_missing_path_named_like_a_shipped_spec_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # e.g. the README's specs/mm_prefix.yaml, run outside the checkout
    for text in ("specs/mm_prefix.yaml", "mm_prefix.yaml"):
        with pytest.raises(SpecError) as e:
            variantgen.resolve_spec(text)
        assert str(e.value) == (f"{text}: spec file not found\n"
                                "  hint: variantgen ships a spec named `mm_prefix`: pass that name to use it")
    with pytest.raises(SpecError, match=r"^other/thing\.yaml: spec file not found$"):
        variantgen.resolve_spec("other/thing.yaml")
    (tmp_path / "folder.yaml").mkdir()
    with pytest.raises(SpecError, match=r"^folder\.yaml: not a regular file$"):
        variantgen.resolve_spec("folder.yaml")
    with pytest.raises(SpecError, match=r"nope\.yaml: spec file not found$"):
        variantgen.resolve_spec(tmp_path / "nope.yaml")  # a Path is always a path


def test_bad_arguments():
    with pytest.raises(SpecError, match=r"^<spec>: empty spec argument: expected a spec file path or a shipped "
                                        r"spec name$"):
        variantgen.resolve_spec("  ")
    with pytest.raises(TypeError, match=r"^spec: expected a VariantSpec, a spec file path or a shipped spec name, "
                                        r"got int$"):
        variantgen.resolve_spec(7)  # type: ignore[arg-type]


def test_an_installation_without_specs_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(library, "SPECS_DIR", tmp_path / "absent")
    library._shipped.cache_clear()
    try:
        assert variantgen.shipped_specs() == {}
        with pytest.raises(SpecError, match=r"^causal: not a spec file, nor the name of a shipped spec "
                                            r"\(none: this installation has no specs folder\)"):
            variantgen.resolve_spec("causal")
    finally:
        library._shipped.cache_clear()


# ----------------------------------------------------------------------------- Python entry points


@pytest.mark.usefixtures("host_modules")
def test_make_wrapper_takes_a_name(monkeypatch):
    built = []

    class Stop(Exception):
        pass

    def record(config, cache, **kwargs):
        built.append(config)
        raise Stop

    monkeypatch.setattr(build, "build_module", record)
    ws = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(Stop):
        variantgen.make_wrapper("mm_prefix", ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", arch="9.0a",
                                backend="fa2")
    assert built[0].spec == variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")
    assert built[0].uri_prefix == "vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a"
    with pytest.raises(SpecError) as e:  # before anything is built
        variantgen.make_wrapper("mm_prefx", ws, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", arch="9.0a")
    assert str(e.value) == f"{unknown('mm_prefx')}\n  hint: did you mean `mm_prefix`?" and len(built) == 1


def test_probe_takes_a_name(clean):
    by_name = variantgen.probe("sliding_window", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", arch="9.0a",
                               backend="fa2", build=False, runtime=False)
    by_path = variantgen.probe(SPECS_DIR / "sliding_window.yaml", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16",
                               arch="9.0a", backend="fa2", build=False, runtime=False)
    # nothing is precompiled here: both say so, for the same module
    assert not by_name and by_name.source == by_path.source == "not built"
    assert by_name.uri is not None and by_name.uri == by_path.uri and "vg_sliding_window_fa2" in by_name.uri
    typo = variantgen.probe("sliding_windw", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", arch="9.0a")
    assert not typo and typo.reason == f"{unknown('sliding_windw')}\n  hint: did you mean `sliding_window`?"


# ----------------------------------------------------------------------------- command line


@pytest.fixture
def fake_builds(monkeypatch):
    """build.build_module replaced: records each config, publishes nothing."""
    configs = []

    def fake(cfg, cache, *, jobs=None, rendered=None, allow_build=True, **_):
        configs.append(cfg)
        entry = build.Entry(cache.root, f"{cfg.uri_prefix}_0123456789ab", {"module_file": "x.so"})
        return build.BuildResult(entry, build.ModuleKey(cfg.uri_prefix, ()), built=True, seconds=0.1)

    monkeypatch.setattr(build, "build_module", fake)
    return configs


def test_cli_specs_lists_the_shipped_specs():
    r = run("specs")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["name", "description", "file"] and len(lines) == 2 + len(SPEC_FILES)
    for path, line in zip(SPEC_FILES, lines[2:]):
        assert line.startswith(path.stem + " ") and line.endswith(str(path))
    assert "specs" in run("--help").stdout


def test_cli_validate_and_render_take_names():
    r = run("validate", "mm_prefix", "sliding_window")
    assert r.exit_code == 0, r.output
    assert r.stdout == "ok  mm_prefix (mm_prefix)\nok  sliding_window (sliding_window)\n"
    r = run("validate", "mm_prefix", "mm_prefx")
    assert r.exit_code == 1
    assert f"{unknown('mm_prefx')}\n  hint: did you mean `mm_prefix`?" in r.stdout
    r = run("render", "mm_prefix", "--head-dim", "128", "--dtype", "bf16", "--file", "all")
    by_path = run("render", SPECS_DIR / "mm_prefix.yaml", "--head-dim", "128", "--dtype", "bf16", "--file", "all")
    assert r.exit_code == 0 and "from spec `mm_prefix` (fa3)" in r.stdout and r.stdout == by_path.stdout
    r = run("render", "mm_prefx", "--head-dim", "128", "--dtype", "bf16")
    assert r.exit_code == 1 and r.stderr.startswith(f"error: {unknown('mm_prefx')}")


def test_cli_precompile_and_demo_take_names(fake_builds):
    r = run("precompile", "mm_prefix", "sliding_window", "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a",
            "--backend", "fa2")
    assert r.exit_code == 0, r.output
    assert sorted(c.uri_prefix for c in fake_builds if c.kind != "planner") == [
        "vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a",
        "vg_sliding_window_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a"]
    fake_builds.clear()
    r = run("demo", "mm_prefix")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("[1/4] mm_prefix: valid spec `mm_prefix` (1 tensor(s), 2 scalar(s))")
    assert "[4/4] no CUDA GPU here" in r.stdout and fake_builds[0].spec.name == "mm_prefix"
    r = run("demo", "mm_prefx")
    assert r.exit_code == 1 and "did you mean `mm_prefix`?" in r.stderr and "[1/4]" not in r.stdout


def test_cli_probe_and_check_take_names(tmp_path):
    # (no GPU here: whether the cache holds it is precompile --check's question)
    r = run("precompile", "mm_prefix", "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--backend", "fa2",
            "--check", "--cache-dir", tmp_path / "c")
    assert r.exit_code == 1 and "vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_*  missing" in r.stdout
    r = run("probe", "mm_prefix", "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--no-build",
            "--backend", "fa2", "--cache-dir", tmp_path / "c")
    assert r.exit_code == 1 and "ok:      no" in r.stdout and "no CUDA device visible" in r.stdout
    r = run("probe", "mm_prefx", "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a")
    assert r.exit_code == 1 and f"reason:  {unknown('mm_prefx')}" in r.stdout
    # fa2's check needs a GPU, but a wrong spec is reported first, wherever it runs
    r = run("check", "mm_prefx", "--head-dim", "128", "--dtype", "bf16", "--backend", "fa2")
    assert r.exit_code == 1 and r.stderr.startswith(f"error: {unknown('mm_prefx')}")
    r = run("check", "mm_prefix", "--head-dim", "128", "--dtype", "bf16", "--backend", "fa2")
    assert r.exit_code == 1 and r.stderr.startswith("error: --backend fa2: fa2 modules run on a CUDA GPU")



def test_a_name_too_long_to_be_a_path_is_an_unknown_name():
    """pathlib raises ENAMETOOLONG instead of answering is_file(): probe() said `internal error:
    OSError`, the other entry points a bare OSError."""
    with pytest.raises(variantgen.SpecError, match="not a spec file, nor the name of a shipped spec"):
        variantgen.resolve_spec("x" * 5000)
    with pytest.raises(variantgen.SpecError, match="cannot read spec file: File name too long"):
        variantgen.resolve_spec("specs/" + "x" * 5000 + ".yaml")
    r = variantgen.probe("y" * 5000, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16")
    assert not r and "not a spec file, nor the name of a shipped spec" in r.reason and "internal" not in r.reason


def test_load_spec_takes_a_shipped_name_too(tmp_path, monkeypatch):
    """The README: anywhere a spec is accepted its name works too - load_spec included (it said
    `spec file not found` for "document")."""
    monkeypatch.chdir(tmp_path)
    assert variantgen.load_spec("document") == variantgen.load_spec(SPECS_DIR / "document.yaml")
    with pytest.raises(variantgen.SpecError, match="ships a spec named `document`: pass that name"):
        variantgen.load_spec("document.yaml")
    (tmp_path / "document.yaml").write_text("name: mine\nmask: kv_pos <= q_pos\n")
    assert variantgen.load_spec("document.yaml").name == "mine"  # a file of that name wins
