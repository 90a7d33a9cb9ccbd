"""The `variantgen` command line, through click's CliRunner. Nothing is compiled: builds
are replaced by fakes, caches are filled with dummy modules."""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import variantgen
from variantgen.build import builder as build
from variantgen.build.builder import rendered_sources
from variantgen.build.cache import MANIFEST, Cache, Entry, ModuleKey
from variantgen.codegen.render import ModuleConfig, render_module
from variantgen.core.errors import BuildError, JitDisabledError
from variantgen.planning.rowplan import PlannerConfig
from variantgen.tools.cli import main

probe_mod = importlib.import_module("variantgen.api.probing")
REPO = Path(__file__).resolve().parents[2]
SPECS = REPO / "specs"
MM = SPECS / "mm_prefix.yaml"
CAUSAL = SPECS / "causal.yaml"
FAKE_TC = build.Toolchain(Path("/opt/fake-cuda"), Path("/opt/fake-cuda/bin/nvcc"), "V13.0.88", "/usr/bin/c++",
                          "c++ (fake) 12.2.0")


@pytest.fixture(autouse=True)
def clean(vg_env, monkeypatch):
    probe_mod.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(build, "toolchain", lambda: FAKE_TC)
    level = logging.getLogger("variantgen").level
    yield vg_env
    logging.getLogger("variantgen").setLevel(level)
    probe_mod.cache_clear()


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def publish_fake(cache: Cache, cfg: ModuleConfig, *, built_at: float | None = None) -> Entry:
    rendered = rendered_sources(cfg)
    key = build.module_key(rendered, FAKE_TC)
    staging = cache.new_staging(key.uri)
    (staging / f"{key.uri}.so").write_bytes(b"\x7fELF dummy " + key.uri.encode() + b"\0" * 4096)
    manifest = {"module_file": f"{key.uri}.so", "config": cfg.describe(), "inputs": dict(key.inputs),
                "inputs_digest": key.inputs_digest, "toolchain": dict(key.toolchain), "key_digest": key.digest,
                "built_at": built_at if built_at is not None else time.time()}
    return cache.publish(key.uri, staging, manifest)


def config(spec: Path = MM, hd: int = 128, arch: str = "9.0a", q: str = "bf16", kv: str = "bf16") -> ModuleConfig:
    return ModuleConfig(variantgen.load_spec(spec), hd, hd, q, kv, q, arch)


# ----------------------------------------------------------------------------- errors


def test_help_and_version():
    r = run("--help")
    assert r.exit_code == 0
    for cmd in ("validate", "render", "precompile", "probe", "list", "clear", "check", "demo", "doctor", "explain"):
        assert cmd in r.output
    assert variantgen.__version__ in run("--version").output


def test_errors_are_one_line_without_traceback():
    r = run("render", MM, "--head-dim", "128", "--dtype", "fp64")
    assert r.exit_code == 1
    assert r.stderr.strip() == ("error: --dtype='fp64': unsupported dtype; expected one of "
                                "['bf16', 'fp16', 'fp32', 'fp8_e4m3', 'fp8_e5m2']")
    assert "Traceback" not in r.output
    r = run("render", SPECS / "nope.yaml", "--head-dim", "128", "--dtype", "bf16")
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and "spec file not found" in r.stderr


def test_usage_errors_exit_2():
    r = run("render", MM, "--dtype", "bf16")
    assert r.exit_code == 2 and "Error: Missing option '--head-dim'." in r.stderr
    r = run("--log-level", "loud", "list")
    assert r.exit_code == 2
    assert "Error: Invalid value for '--log-level': 'loud' is not one of 'debug', 'info', 'warning', 'error'." \
        in r.stderr


def _help(*command: str) -> str:
    r = run(*command, "--help")
    assert r.exit_code == 0, r.output
    return " ".join(r.stdout.split())


def test_probe_help_states_its_exit_status():
    text = _help("probe")
    assert "Exit status: 0 every backend and kind asked for runs here" in text
    assert "or (the flex route) torch's FlexAttention runs it on this machine's device, the CPU included" in text
    assert "1 at least one cannot run here; its `reason:` says why." in text


def test_check_options_have_help():
    text = _help("check")
    assert "--head-dim INTEGER Head dim of q, k and v, e.g. 128." in text
    assert "--dtype TEXT Query dtype: bf16, fp16 (fp32 on the flex route)." in text
    assert "the flex route (FlexAttention) on a CPU" in text


# ----------------------------------------------------------------------------- validate


def test_validate_ok():
    paths = sorted(SPECS.glob("*.yaml"))
    r = run("validate", *paths)
    assert r.exit_code == 0, r.output
    for p in paths:
        assert f"ok  {p} ({p.stem})" in r.stdout


def test_validate_reports_every_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad\nmask: kv_pos <= qq_pos\nfoo: 1\n")
    r = run("validate", CAUSAL, bad)
    assert r.exit_code == 1
    assert f"ok  {CAUSAL} (causal)" in r.stdout
    assert f"{bad}: 3 errors\n" in r.stdout  # the file once, then each error at its line:col
    assert "\n  1:7: name: spec name 'Bad'" in r.stdout
    assert "\n  2:17: mask: unknown name `qq_pos`" in r.stdout
    assert "\n  3:1: foo: unknown field" in r.stdout
    assert "hint: did you mean `q_pos`?" in r.stdout
    assert re.search(r"\n\s+\^", r.stdout)  # caret lines
    assert "1 of 2 spec file(s) have errors" in r.stderr


def test_validate_missing_file(tmp_path):
    r = run("validate", tmp_path / "missing.yaml")
    assert r.exit_code == 1 and "spec file not found" in r.stdout


# ----------------------------------------------------------------------------- render


def test_render_prints_the_variant_struct():
    """--backend auto (the default): the module make_wrapper builds on a GPU of --arch (9.0a by
    default here: fa3); a backend by name, or an arch where fa3 cannot run, gives fa2's."""
    r = run("render", MM, "--head-dim", "128", "--dtype", "bf16")
    assert r.exit_code == 0, r.output
    assert "from spec `mm_prefix` (fa3)" in r.stdout and "ranges" in r.stdout
    for args in (("--backend", "fa2"), ("--arch", "8.0"), ("--kv-dtype", "fp8_e4m3")):
        r = run("render", MM, "--head-dim", "128", "--dtype", "bf16", *args)
        assert r.exit_code == 0 and "struct VG_MmPrefixOf : AttentionVariantBase" in r.stdout, args
        assert "using VG_MmPrefix = VG_MmPrefixOf<false>;" in r.stdout, args


def test_render_without_a_module_backend_names_every_reason():
    r = run("render", MM, "--head-dim", "128", "--dtype", "fp32")
    assert r.exit_code == 1 and r.stderr.splitlines() == [
        "error: no backend can run it here:",
        "  fa3: --dtype=fp32: fa3 modules take bf16, fp16",
        "  fa2: --dtype=fp32: fa2 modules take bf16, fp16; --kv-dtype=fp32: fa2 modules take bf16, fp16, fp8_e4m3, "
        "fp8_e5m2",
        "  flex: the flex route has no module to render or build (it runs through torch; probe it with --backend "
        "flex)"]


def test_render_one_file_or_all(tmp_path):
    r = run("render", CAUSAL, "--head-dim", "64", "--dtype", "fp16", "--file", "binding.cu")
    assert r.exit_code == 0 and "// =====" not in r.stdout
    r = run("render", CAUSAL, "--head-dim", "64", "--dtype", "fp16", "--file", "all")
    assert r.exit_code == 0
    assert "// ===== variant.cuh =====" in r.stdout and "// ===== binding.cu =====" in r.stdout
    r = run("render", CAUSAL, "--head-dim", "64", "--dtype", "fp16", "--file", "nope.cu")
    assert r.exit_code == 2 and "variant.cuh" in r.output


def test_render_writes_all_files(tmp_path):
    out = tmp_path / "out"
    r = run("render", MM, "--head-dim", "256", "--dtype", "bf16", "--kv-dtype", "fp8_e4m3", "-o", out)
    assert r.exit_code == 0, r.output
    names = {p.name for p in out.iterdir()}
    expected = set(render_module(config(hd=256, kv="fp8_e4m3")).files)
    assert names == expected and "variant.cuh" in names
    assert "__nv_fp8_e4m3" in (out / "batch_prefill_config.inc").read_text()


def test_render_unsupported_combination():
    r = run("render", MM, "--head-dim", "96", "--dtype", "bf16", "--backend", "fa2")
    assert r.exit_code == 1 and r.stderr == ("error: --head-dim=96, --head-dim-vo=96: fa2 prefill modules support head "
                                             "dims 64, 128, 256 (qk/vo where they differ)\n")


# ----------------------------------------------------------------------------- precompile


@pytest.fixture
def fake_builds(monkeypatch):
    """build.build_module replaced: records (uri_prefix, cache root, jobs), fails for hd 256 on request."""
    calls: list[tuple[str, str, int | None]] = []
    lock = threading.Lock()
    state = {"fail_hd": None, "threads": set(), "planners": []}

    def fake(cfg, cache, *, jobs=None, rendered=None, allow_build=True, progress=None):
        with lock:  # planner modules (one per spec and arch) are recorded apart
            (state["planners"] if cfg.kind == "planner" else calls).append((cfg.uri_prefix, str(cache.root), jobs))
            state["threads"].add(threading.get_ident())
        time.sleep(0.01)
        if cfg.kind != "planner" and cfg.head_dim_qk == state["fail_hd"]:
            raise BuildError(f"building module {cfg.uri_prefix}_0123456789ab failed (ninja exit 1 after 2.0s)",
                             log_path=f"/c/.failed/{cfg.uri_prefix}/build.log",
                             output="paged_kernel_custom_cta16.cu(3): error: expected a ';'\n")
        uri = f"{cfg.uri_prefix}_0123456789ab"
        entry = Entry(cache.root, uri, {"module_file": f"{uri}.so"})
        return build.BuildResult(entry, ModuleKey(cfg.uri_prefix, ()), built=cfg.arch != "8.0", seconds=1.5)

    monkeypatch.setattr(build, "build_module", fake)
    return calls, state


MATRIX = ("precompile", MM, CAUSAL, "--head-dim", "64,128,256", "--dtype", "bf16,fp16", "--arch", "8.0,9.0a")


def test_precompile_expands_the_matrix(fake_builds, clean):
    calls, state = fake_builds
    r = run(*MATRIX)
    assert r.exit_code == 0, r.output
    prefixes = sorted(c[0] for c in calls)
    assert len(prefixes) == 2 * 3 * 2 * 2 == len(set(prefixes))
    # plus each spec's interval-planner module (plan()'s row kernel), once per arch
    assert sorted(c[0] for c in state["planners"]) == [
        f"vg_{s}_planner_{a}" for s in ("causal", "mm_prefix") for a in ("sm80", "sm90a")]
    assert "vg_mm_prefix_fa2_prefill_qfp16_kvfp16_ofp16_hd256x256_sm80" in prefixes
    # --backend auto (the default): what make_wrapper picks - fa3 on sm90a, fa2 on sm80
    assert "vg_causal_fa3_prefill_qbf16_kvbf16_obf16_hd64x64_sm90a" in prefixes
    assert not any("fa2" in p and p.endswith("sm90a") for p in prefixes)
    assert {c[1] for c in calls} == {str(clean.cache_dir)}
    # summary table: uri, status, seconds
    assert re.search(r"vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd64x64_sm80_0123456789ab\s+cached\s+1\.5", r.stdout)
    assert re.search(r"vg_causal_fa3_prefill_qbf16_kvbf16_obf16_hd64x64_sm90a_0123456789ab\s+built\s+1\.5", r.stdout)
    assert "14 built, 14 cached, 0 failed" in r.stdout


def test_precompile_kv_dtypes_and_options(fake_builds, tmp_path):
    calls, state = fake_builds
    r = run("precompile", MM, "--head-dim", "128", "--dtype", "bf16", "--kv-dtype", "bf16,fp8_e4m3",
            "--arch", "sm_90a", "-j", "3", "--jobs-per-module", "5", "--cache-dir", tmp_path / "c")
    assert r.exit_code == 0, r.output
    assert sorted(c[0] for c in calls) == [  # auto: fa3 on sm90a, except for an fp8 KV cache
        "vg_mm_prefix_fa2_prefill_qbf16_kvfp8_e4m3_obf16_hd128x128_sm90a",
        "vg_mm_prefix_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a",
    ]
    assert {c[1] for c in calls} == {str(tmp_path / "c")} and {c[2] for c in calls} == {5}


def test_precompile_backends_and_kinds(fake_builds, tmp_path):
    calls, _ = fake_builds
    r = run("precompile", MM, "--head-dim", "128,192/128", "--dtype", "bf16", "--arch", "9.0a",
            "--backend", "fa2,fa3", "--kind", "prefill,ragged,decode", "--dry-run")
    assert r.exit_code == 0, r.output
    built = [line for line in r.stdout.splitlines() if line.startswith("vg_")]
    assert built == [
        "vg_mm_prefix_fa2_decode_qbf16_kvbf16_obf16_hd128x128_sm90a",
        "vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a",
        "vg_mm_prefix_fa2_ragged_qbf16_kvbf16_obf16_hd128x128_sm90a",
        "vg_mm_prefix_fa2_ragged_qbf16_kvbf16_obf16_hd192x128_sm90a",
        "vg_mm_prefix_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a",  # fa3 prefill and fa3 decode's module
        "vg_mm_prefix_fa3_ragged_qbf16_kvbf16_obf16_hd128x128_sm90a",
        "vg_mm_prefix_fa3_ragged_qbf16_kvbf16_obf16_hd192x128_sm90a",
        "vg_mm_prefix_planner_sm90a",  # plan()'s row kernel: one per spec and arch with prefill modules
    ]
    skips = [line for line in r.stdout.splitlines() if line.startswith("skip  ")]
    assert any("hd=192/128" in s and "backend=fa2 kind=prefill" in s for s in skips)
    assert any("hd=192/128" in s and "backend=fa3 kind=decode" in s and "fa3 prefill modules support head dims" in s
               and "(its decode runs the prefill module)" in s for s in skips)
    assert not any("hd=128 " in s for s in skips)  # every kind of both backends builds at 128
    assert not calls
    decode = run("precompile", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--backend", "fa3",
                 "--kind", "decode", "--dry-run")
    assert decode.exit_code == 0 and [line for line in decode.stdout.splitlines() if line.startswith("vg_")] == [
        "vg_mm_prefix_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a", "vg_mm_prefix_planner_sm90a"], decode.output
    bad = run("precompile", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--kind", "append")
    assert bad.exit_code == 2 and "append: expected one of prefill, ragged, decode" in bad.output
    bad = run("precompile", MM, "--head-dim", "192x128", "--dtype", "bf16", "--arch", "9.0a")
    assert bad.exit_code == 2 and "'192x128': expected a whole number or QK/VO" in bad.output


def test_precompile_skips_invalid_combinations(fake_builds, tmp_path):
    calls, _ = fake_builds
    fa3 = tmp_path / "fa3only.yaml"
    fa3.write_text("name: fa3only\nmask: kv_pos <= q_pos\nbackends: [fa3]\n")
    r = run("precompile", MM, fa3, "--head-dim", "96,128", "--dtype", "bf16,fp8_e4m3", "--arch", "9.0a",
            "--backend", "fa2")
    assert r.exit_code == 0, r.output
    assert [c[0] for c in calls] == ["vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a"]
    skips = [line for line in r.stdout.splitlines() if line.startswith("skip  ")]
    assert len(skips) == 2 * 2 * 2 - 1  # specs x head dims x dtypes, one valid
    assert any("hd=96" in s and "support head dims 64, 128, 256" in s for s in skips)
    assert any("q=fp8_e4m3" in s and "fp8 query is not supported" in s for s in skips)
    assert any(s.startswith("skip  fa3only ") and "allows only ['fa3']" in s for s in skips)


def test_precompile_sharding_is_a_deterministic_partition(fake_builds):
    calls, state = fake_builds
    full = run(*MATRIX, "--dry-run")
    assert full.exit_code == 0 and calls == []
    everything = [line for line in full.stdout.splitlines() if line.startswith("vg_")]
    assert everything == sorted(everything) and len(everything) == 24 + 4  # + a planner per spec and arch
    shards = []
    for i in range(5):
        r = run(*MATRIX, "--shard", f"{i}/5", "--dry-run")
        assert r.exit_code == 0 and f"shard {i}/5: " in r.stdout
        shards.append([line for line in r.stdout.splitlines() if line.startswith("vg_")])
        again = run(*MATRIX, "--shard", f"{i}/5", "--dry-run")
        assert again.stdout == r.stdout
    assert shards[1] == everything[1::5]
    assert sorted(sum(shards, [])) == everything  # disjoint and complete
    # The order of the arguments does not change the shards.
    r = run("precompile", CAUSAL, MM, "--head-dim", "256,64,128", "--dtype", "fp16,bf16", "--arch", "9.0a,8.0",
            "--shard", "1/5", "--dry-run")
    assert [line for line in r.stdout.splitlines() if line.startswith("vg_")] == shards[1]
    # Building a shard builds exactly its modules.
    r = run(*MATRIX, "--shard", "2/5")
    assert r.exit_code == 0 and sorted(c[0] for c in calls + state["planners"]) == shards[2]


@pytest.mark.parametrize("shard", ["5/5", "-1/2", "1", "a/b", "0/0", ""])
def test_precompile_bad_shard(shard):
    r = run(*MATRIX, "--shard", shard, "--dry-run")
    assert r.exit_code == 2 and "--shard" in r.output


def test_precompile_failures_exit_1_with_the_build_error(fake_builds):
    calls, state = fake_builds
    state["fail_hd"] = 256
    r = run(*MATRIX, "-j", "4")
    assert r.exit_code == 1
    assert len(calls) == 24
    assert "16 built" not in r.stdout and "8 failed" in r.stdout
    assert re.search(r"vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd256x256_sm80_\*\s+failed", r.stdout)
    assert "first error: paged_kernel_custom_cta16.cu(3): error: expected a ';'" in r.stderr
    assert "full log: /c/.failed/" in r.stderr and "Traceback" not in r.output


def test_precompile_runs_modules_in_parallel(fake_builds):
    calls, state = fake_builds
    r = run(*MATRIX, "-j", "4")
    assert r.exit_code == 0 and len(calls) == 24
    assert len(state["threads"]) > 1


def test_precompile_arch_defaults(fake_builds, clean):
    calls, _ = fake_builds
    r = run("precompile", CAUSAL, "--head-dim", "128", "--dtype", "bf16")  # render's and demo's default too
    assert r.exit_code == 0 and [c[0] for c in calls] == ["vg_causal_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a"]
    assert r.stderr.startswith("note: no --arch, VARIANTGEN_ARCH or visible GPU: targeting 9.0a (Hopper); pass "
                               "--arch to choose\n")
    for command in ("precompile", "render"):
        r = run(command, "--help")
        assert "(default: the visible GPU, VARIANTGEN_ARCH, else 9.0a)" in " ".join(r.output.split()), command
    calls.clear()
    clean.set(VARIANTGEN_ARCH="8.6")
    r = run("precompile", CAUSAL, "--head-dim", "128", "--dtype", "bf16")
    assert r.exit_code == 0 and [c[0] for c in calls] == ["vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm86"]


def test_precompile_bad_inputs(fake_builds, tmp_path):
    r = run("precompile", CAUSAL, "--head-dim", "128,big", "--dtype", "bf16", "--arch", "9.0a")
    assert r.exit_code == 2 and "'big': expected a whole number or QK/VO" in r.output
    r = run("precompile", CAUSAL, "--head-dim", "192/", "--dtype", "bf16", "--arch", "9.0a")  # was taken as 192
    assert r.exit_code == 2 and "'192/': expected a whole number or QK/VO" in r.output
    for dims in ("0", "192/0", "-64"):  # named as precompile's option (the message named --head-dim-vo)
        r = run("precompile", CAUSAL, "--head-dim", dims, "--dtype", "bf16", "--arch", "9.0a")
        assert r.exit_code == 2 and f"'{dims}': expected head dims > 0" in r.output and "head-dim-vo" not in r.output
    r = run("precompile", CAUSAL, "--head-dim", "128", "--dtype", "float64", "--arch", "9.0a")
    assert r.exit_code == 1 and r.stderr.startswith("error: --dtype='float64': unsupported dtype")
    r = run("precompile", CAUSAL, "--head-dim", "128", "--dtype", "float32", "--arch", "9.0a", "--dry-run")
    assert r.exit_code == 2 and "every combination was skipped" in r.output and r.stdout.startswith(
        "skip  causal hd=128 q=fp32 kv=fp32 o=fp32 arch=9.0a backend=auto kind=prefill: no backend can run it here: "
        "fa3: --dtype=fp32: fa3 modules take bf16, fp16 | fa2: ")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\n")
    r = run("precompile", bad, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a")
    assert r.exit_code == 1 and "missing required field `mask`" in r.stderr
    r = run("precompile", CAUSAL, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--jobs-per-module",
            "2147483648")  # past what ninja -j reads: it failed every build ("invalid -j parameter")
    assert r.exit_code == 2 and "Invalid value for '--jobs-per-module': 2147483648 is not in the range" in r.output
    assert fake_builds[0] == []


# ----------------------------------------------------------------------------- probe


@pytest.fixture
def gpu(monkeypatch):
    """A fake GPU of the given capability on which any module loads (the probe's last step)."""
    loaded: list[str] = []

    def make(capability=(9, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(build, "load_module", lambda entry: loaded.append(entry.uri) or object())
        return loaded

    return make


@pytest.mark.parametrize("arch", [[], ["--arch", "9.0a"]])
def test_probe_without_gpu_exits_1(arch):
    """`probe --backend fa2 --arch 9.0a` on a CPU box: no module runs here, whatever the arch."""
    r = run("probe", MM, "--head-dim", "128", "--dtype", "bf16", "--backend", "fa2,fa3", *arch)
    assert r.exit_code == 1
    assert r.stdout.count("ok:      no") == 2
    assert r.stdout.count("reason:  no CUDA device visible: probe() answers whether the module runs here") == 2
    assert "precompile ... --check" in r.stdout


def test_probe_auto_on_a_cpu_box_is_the_flex_route():
    """backend auto: where no module can run, the resolver's last choice, torch's FlexAttention
    on the CPU (it ran a small batch there)."""
    r = run("probe", MM, "--head-dim", "64", "--dtype", "bf16", "--json")
    data = json.loads(r.stdout)
    assert r.exit_code == 0, r.output
    assert data["ok"] and data["backend"] == "flex" and data["source"] == "torch" and data["uri"] is None
    assert data["details"]["not_chosen"]["fa2"].startswith("no CUDA device visible")


def test_probe_finds_a_cached_module(clean, gpu):
    loaded = gpu()
    entry = publish_fake(Cache(clean.cache_dir), config())
    r = run("probe", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--no-build", "--backend", "fa2")
    assert r.exit_code == 0, r.output
    assert "ok:      yes" in r.stdout and f"uri:     {entry.uri}" in r.stdout and "source:  cache" in r.stdout
    r = run("probe", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--json", "--backend", "fa2")
    data = json.loads(r.stdout)
    assert r.exit_code == 0 and data["ok"] is True and data["uri"] == entry.uri and data["details"]["loaded"]
    assert set(loaded) == {entry.uri}


def test_probe_no_build_prints_the_precompile_command(tmp_path, gpu):
    gpu((8, 0))
    r = run("probe", CAUSAL, "--head-dim", "64", "--dtype", "fp16", "--arch", "8.0", "--no-build",
            "--cache-dir", tmp_path / "c", "--backend", "fa2")
    assert r.exit_code == 1
    assert (f"copy the cache folder here: variantgen precompile {CAUSAL} --head-dim 64 --dtype fp16 --kv-dtype fp16 "
            "--backend fa2 --arch 8.0 "
            f"--cache-dir {tmp_path / 'c'}") in r.stdout


def test_probe_cuda_graph(clean, gpu):
    """--cuda-graph: the auto backend is fa2 (found here), ragged is demoted with the reason."""
    gpu()
    entry = publish_fake(Cache(clean.cache_dir), config())
    r = run("probe", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--no-build", "--cuda-graph")
    assert r.exit_code == 0, r.output
    assert "backend: fa2" in r.stdout and f"uri:     {entry.uri}" in r.stdout
    r = run("probe", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "--no-build", "--cuda-graph",
            "--kind", "prefill,ragged")
    assert r.exit_code == 1
    assert "reason:  cuda_graph=True: CUDA-graph mode is for kind 'prefill' and 'decode' (got 'ragged')" in r.stdout


def test_probe_unsupported_combination():
    r = run("probe", MM, "--head-dim", "128", "--dtype", "bf16", "--backend", "fa3", "--arch", "8.0")
    assert r.exit_code == 1 and "arch=8.0: fa3 modules run on sm90 (Hopper) only" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--head-dim", "0", "--dtype", "bf16"], "--head-dim=0: expected a whole number > 0"),
    (["--head-dim", "128", "--head-dim-vo", "-1", "--dtype", "bf16"], "--head-dim-vo=-1: expected a whole number > 0"),
    (["--head-dim", "128", "--dtype", "bf17"], "--dtype='bf17': unsupported dtype"),
    (["--head-dim", "128", "--dtype", "bf16", "--kv-dtype", "int8"], "--kv-dtype='int8': unsupported dtype"),
    (["--head-dim", "128", "--dtype", "bf16", "--arch", "9.0b"], "--arch='9.0b': expected a compute capability"),
    (["--head-dim", "128", "--dtype", "bf16", "--page-size", "0"], "'--page-size': 0 is not in the range x>=1"),
])
def test_probe_names_the_options_as_typed(args, message):
    """A malformed option is a usage error naming the option (the reasons of probe() name its
    Python arguments, head_dim_qk=0)."""
    r = run("probe", MM, *args)
    assert r.exit_code == 2 and message in r.output and "head_dim" not in r.output


@pytest.mark.parametrize("args", [
    ["render", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "abc"],
    ["render", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", ""],
    ["precompile", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "8.0,abc", "--dry-run"],
    ["demo", MM, "--arch", "abc"],
    ["probe", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "abc"],
])
def test_a_malformed_arch_is_a_usage_error_naming_the_option(args):
    """A regression: canonical_arch's error named Python's `arch='abc'` (exit 1; probe: its reason,
    as for --page-size=0's `page_size=0`), and render took `--arch ""` as not given."""
    r = run(*args)
    value = args[args.index("--arch") + 1].split(",")[-1]
    assert r.exit_code == 2 and f"Error: --arch={value!r}: expected a compute capability such as 8.0, 9.0a or " \
        "10.0a" in r.output, r.output
    assert "[1/4]" not in r.output  # demo: before any step


def test_probe_reports_per_backend_and_kind():
    r = run("probe", MM, "--head-dim", "96", "--dtype", "bf16", "--backend", "fa2,fa3", "--kind", "prefill,decode",
            "--arch", "9.0a", "--json")
    assert r.exit_code == 1
    answers = {(a["backend"], a["kind"]): a for a in json.loads(r.stdout)}
    assert set(answers) == {("fa2", "prefill"), ("fa3", "prefill"), ("fa2", "decode"), ("fa3", "decode")}
    assert "fa2 prefill modules support head dims 64, 128, 256" in answers["fa2", "prefill"]["reason"]
    assert "fa3 prefill modules support head dims 64, 128, 256 (qk/vo where they differ) (its decode runs the " \
           "prefill module)" in answers["fa3", "decode"]["reason"]
    assert not any(a["ok"] for a in answers.values())


# ----------------------------------------------------------------------------- list / clear


@pytest.fixture
def filled(clean):
    cache = Cache(clean.cache_dir)
    old = time.time() - 10 * 86400
    entries = {
        "mm": publish_fake(cache, config()),
        "causal": publish_fake(cache, config(CAUSAL, hd=64, arch="8.0"), built_at=old),
        "causal_fp8": publish_fake(cache, config(CAUSAL, kv="fp8_e4m3")),
    }
    damaged = cache.root / "vg_causal_fa2_prefill_qfp16_kvfp16_ofp16_hd128x128_sm80_000000000000"
    damaged.mkdir()
    (damaged / "half-written.so").write_bytes(b"x")
    (damaged / "build.ninja").write_text("")  # ours (every build writes one), its manifest lost
    return cache, entries, damaged


def test_list_shows_the_cache(filled):
    cache, entries, damaged = filled
    r = run("list")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["uri", "spec", "head", "dims", "q/kv/o", "backend", "size", "age", "flashinfer",
                                "nvcc", "arch"]
    row = next(line for line in lines if line.startswith(entries["causal"].uri)).split()
    assert row[1:5] == ["causal", "64x64", "bf16/bf16/bf16", "fa2"]
    assert row[7] == "10d" and row[-2:] == ["V13.0.88", "8.0"]
    assert row[8] == build.flashinfer_info().version
    assert any(line.startswith(entries["causal_fp8"].uri) and "bf16/fp8_e4m3/bf16" in line for line in lines)
    assert any(line.startswith(damaged.name) and "damaged: entry" in line and "no manifest" in line
               for line in lines)
    assert f"4 module(s) in {cache.root}" in r.stdout


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "module file size differs from the manifest (truncated?)"),
    ("flip", "module file hash differs from the manifest (corrupted)"),
    ("delete", "is missing"),
])
def test_list_verifies_modules(filled, damage, reason):
    """A truncated, bit-flipped or missing module file is listed as damaged, not as healthy."""
    cache, entries, _ = filled
    module = entries["mm"].module_path
    data = module.read_bytes()
    if damage == "truncate":
        module.write_bytes(data[:100])
    elif damage == "flip":
        module.write_bytes(data[:50] + bytes([data[50] ^ 0x10]) + data[51:])
    else:
        module.unlink()
    r = run("list")
    assert r.exit_code == 0
    row = next(line for line in r.stdout.splitlines() if line.startswith(entries["mm"].uri))
    assert f"damaged: entry {entries['mm'].path}: " in row and reason in row
    assert f"4 module(s) in {cache.root}, 2 damaged" in r.stdout
    quick = run("list", "--no-verify")
    row = next(line for line in quick.stdout.splitlines() if line.startswith(entries["mm"].uri))
    assert ("damaged" in row) == (damage != "flip")  # a same-size bit flip needs the hash


@pytest.mark.parametrize("field, value", [("config", "oops"), ("toolchain", None), ("built_at", "yesterday"),
                                          ("inputs", ["x"]), ("config", {"spec": ["causal"]}),
                                          ("inputs_digest", 7)])
def test_manifest_fields_of_the_wrong_type_are_a_damaged_entry(filled, field, value, vg_env):
    """A manifest whose fields have the wrong types crashed list, clear, precompile --check and
    JIT-off lookups (AttributeError, ValueError): it is a damaged entry, named with its path."""
    cache, entries, _ = filled
    entry = entries["causal"]
    manifest = json.loads((entry.path / MANIFEST).read_text())
    manifest[field] = value
    (entry.path / MANIFEST).write_text(json.dumps(manifest))
    r = run("list")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.stdout.splitlines() if line.startswith(entry.uri))
    assert f"damaged: entry {entry.path}: manifest field {field!r} is " in row
    assert f"4 module(s) in {cache.root}, 2 damaged" in r.stdout
    r = run("precompile", CAUSAL, "--head-dim", "64", "--dtype", "bf16", "--arch", "8.0", "--backend", "fa2", "--check")
    assert r.exit_code == 1 and f"corrupted: entry {entry.path}: manifest field {field!r}" in r.stdout, r.output
    vg_env.set(VARIANTGEN_DISABLE_JIT="1")
    with pytest.raises(JitDisabledError, match="manifest field"):
        build.build_module(config(CAUSAL, hd=64, arch="8.0"), cache)
    r = run("clear", "--yes")
    assert r.exit_code == 0, r.output
    assert f"note: removed damaged entry {entry.uri} (entry {entry.path}: manifest field" in r.stdout
    assert "removed 4 modules" in r.stdout and not entry.path.exists()


def test_list_shows_planner_modules(clean):
    entry = publish_fake(Cache(clean.cache_dir), PlannerConfig(variantgen.load_spec(MM), "9.0a"))
    r = run("list")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.stdout.splitlines() if line.startswith(entry.uri)).split()
    assert row[1:5] == ["mm_prefix", "-", "-", "planner"] and row[-1] == "9.0a"


def test_list_verbose_prints_the_key_parts(filled):
    _, entries, _ = filled
    r = run("list", "-v")
    assert r.exit_code == 0
    block = r.stdout.split(f"\n{entries['mm'].uri}\n", 1)[1]
    for part in ("sources:", "templates:", "flags:", "flashinfer:", "tvm_ffi:", "arch: 9.0a", "variantgen:",
                 "toolchain.nvcc: V13.0.88", "toolchain.cxx: c++ (fake) 12.2.0", "inputs_digest:",
                 "config.spec: mm_prefix"):
        assert part in block


def test_list_with_global_cache_dir(tmp_path, filled):
    other = Cache(tmp_path / "other")
    e = publish_fake(other, config(CAUSAL))
    r = run("--cache-dir", other.root, "--log-level", "debug", "list")
    assert r.exit_code == 0 and e.uri in r.stdout and "1 module(s)" in r.stdout
    r = run("list", "--cache-dir", tmp_path / "empty")
    assert r.exit_code == 0 and "no modules in" in r.stdout


def test_clear_by_spec_name(filled):
    cache, entries, damaged = filled
    r = run("clear", "causal", "--yes")
    assert r.exit_code == 0, r.output
    assert "removed 3 modules" in r.stdout  # two entries and the damaged causal folder
    assert [uri for uri, _ in cache.entries()] == [entries["mm"].uri]


def test_clear_older_than(filled):
    cache, entries, _ = filled
    r = run("clear", "--older-than", "7", "--yes")
    assert r.exit_code == 0 and "removed 1 module" in r.stdout
    assert entries["causal"].uri not in [uri for uri, _ in cache.entries()]


@pytest.mark.parametrize("value", ["nan", "inf", "1e999"])
def test_clear_older_than_a_non_finite_number_is_a_usage_error(filled, value):
    """nan passed click's range check (every comparison with it is false) and `clear --older-than
    nan --yes` removed every module."""
    cache, _, _ = filled
    r = run("clear", "--older-than", value, "--yes")
    assert r.exit_code == 2 and f"Invalid value for '--older-than': '{value}': expected a finite number" in r.output
    assert len(list(cache.entries())) == 4


def test_clear_asks_first(filled):
    cache, _, _ = filled
    r = run("clear", input="n\n")
    assert r.exit_code == 1 and len(list(cache.entries())) == 4
    r = run("clear", input="y\n")
    assert r.exit_code == 0 and "removed 4 modules" in r.stdout and list(cache.entries()) == []
    r = run("clear", "--yes")
    assert r.exit_code == 0 and "removed 0 modules" in r.stdout


def test_clear_unknown_spec_exits_1_and_removes_nothing(filled):
    cache, _, _ = filled
    for name in ("alibi", "nosuchspec"):
        r = run("clear", name, "--yes")
        assert r.exit_code == 1 and len(list(cache.entries())) == 4
        assert r.stderr.strip() == (f"error: no module of spec `{name}` in {cache.root} (specs with modules there: "
                                    "causal, mm_prefix)")
    assert (cache.root / next(iter(cache.entries()))[0] / MANIFEST).exists()


def test_clear_by_spec_file(filled):
    cache, entries, _ = filled
    r = run("clear", MM, "--yes")
    assert r.exit_code == 0 and "removed 1 module" in r.stdout
    assert entries["mm"].uri not in [uri for uri, _ in cache.entries()]


@pytest.mark.parametrize("args", [
    ["clear", "--yes", "--cache-dir", ""],
    ["--cache-dir", "", "clear", "--yes"],
    ["list", "--cache-dir", " "],
    ["render", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "9.0a", "-o", ""],
])
def test_an_empty_folder_option_is_a_usage_error(filled, args):
    """`--cache-dir "$UNSET"` names no cache: it was taken as not given, and `clear --yes` emptied
    the default cache (VARIANTGEN_CACHE_DIR's); `-o ""` printed the sources instead of writing."""
    cache, _, _ = filled
    r = run(*args)
    assert r.exit_code == 2 and "expected a folder, got an empty value" in r.output, r.output
    assert ("'--cache-dir'" if "-o" not in args else "'-o' / '--output-dir'") in r.output
    assert len(list(cache.entries())) == 4 and r.stdout == ""


def test_clear_never_removes_what_is_not_a_module(filled):
    """A user's folder in the cache root (and files, and folders named almost like a module)
    survive `clear --yes`; they are listed. Damaged module folders go, with a note."""
    cache, _, damaged = filled
    notes = cache.root / "my_notes"
    notes.mkdir()
    (notes / "thesis.txt").write_text("four years of work")
    (cache.root / "README.md").write_text("the team's cache")
    lookalike = cache.root / "vg_causal_not_a_module"
    lookalike.mkdir()
    (cache.root / "vg_file_sm90a_0123456789ab").write_text("a file named like a module")
    r = run("clear", "--yes")
    assert r.exit_code == 0, r.output
    assert "removed 4 modules" in r.stdout
    assert f"note: removed damaged entry {damaged.name} (entry {damaged} has no manifest" in r.stdout
    assert (notes / "thesis.txt").read_text() == "four years of work" and lookalike.is_dir()
    assert (cache.root / "README.md").exists() and (cache.root / "vg_file_sm90a_0123456789ab").exists()
    assert (f"left 4 item(s) in {cache.root} that are not variantgen modules: README.md, my_notes/, "
            "vg_causal_not_a_module/, vg_file_sm90a_0123456789ab") in r.stdout
    assert list(cache.entries()) == []


def test_clear_skips_a_module_being_built(filled, tmp_path):
    import multiprocessing

    import _cache_procs as procs

    cache, entries, _ = filled
    uri = entries["mm"].uri
    ready = tmp_path / "ready"
    holder = multiprocessing.get_context("spawn").Process(target=procs.hold_lock, args=(str(cache.root), uri,
                                                                                       str(ready)), daemon=True)
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = run("clear", "mm_prefix", "--yes")
    finally:
        procs.kill(holder.pid)
        holder.join(30)
    assert r.exit_code == 1 and "removed 0 modules" in r.stdout
    assert f"skipped {uri} (being built by pid {holder.pid} on " in r.stderr
    assert uri in [u for u, _ in cache.entries()]


# ----------------------------------------------------------------------------- precompile --check


def test_precompile_check_lists_what_is_missing(clean, fake_builds):
    calls, _ = fake_builds
    cache = Cache(clean.cache_dir)
    args = ("precompile", MM, "--head-dim", "128", "--dtype", "bf16", "--arch", "8.0,9.0a", "--check")
    r = run(*args)
    assert r.exit_code == 1 and calls == []
    assert f"0 of 4 module(s) in {cache.root}, 4 missing or damaged" in r.stdout
    assert re.search(r"vg_mm_prefix_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_\*\s+missing", r.stdout)
    fa3 = publish_fake(cache, ModuleConfig(variantgen.load_spec(MM), 128, 128, "bf16", "bf16", "bf16", "9.0a", "fa3"))
    fa2 = publish_fake(cache, config(arch="8.0"))
    planners = [publish_fake(cache, PlannerConfig(variantgen.load_spec(MM), a)) for a in ("8.0", "9.0a")]
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert f"4 of 4 module(s) in {cache.root}, 0 missing or damaged" in r.stdout
    for e in (fa3, fa2, *planners):
        assert re.search(rf"{e.uri}\s+ok", r.stdout)
    fa3.module_path.write_bytes(b"x")
    r = run(*args)
    assert r.exit_code == 1 and "3 of 4 module(s)" in r.stdout
    assert f"corrupted: entry {fa3.path}: module file size differs" in r.stdout
    r = run(*args, "--dry-run")
    assert r.exit_code == 2 and "Error: --dry-run and --check: pick one" in r.stderr


@pytest.mark.parametrize("option, value", [("--head-dim", ""), ("--dtype", ","), ("--arch", ""),
                                           ("--kv-dtype", " , "), ("--backend", ""), ("--kind", ",")])
def test_precompile_check_of_an_empty_matrix_is_a_usage_error(clean, option, value):
    """`precompile --check --head-dim "$UNSET"` printed "0 of 0 ... 0 missing" and exited 0: a
    deploy gate fed an empty variable passed. An option given empty names itself; a matrix
    whose every combination is skipped is refused too."""
    args = {"--head-dim": "128", "--dtype": "bf16", "--arch": "8.0", option: value}
    r = run("precompile", CAUSAL, *itertools.chain(*args.items()), "--check")
    assert r.exit_code == 2 and option in r.output and "expected a comma list of values, got none" in r.output
    r = run("precompile", CAUSAL, "--head-dim", "128", "--dtype", "fp32", "--arch", "8.0", "--backend", "fa3",
            "--check")
    assert r.exit_code == 2 and "the matrix has no module: every combination was skipped" in r.output
    assert "of 0 module(s)" not in r.output


def test_precompile_check_accepts_another_toolchains_build(clean, monkeypatch):
    cache = Cache(clean.cache_dir)
    publish_fake(cache, config(CAUSAL, arch="8.0"))
    publish_fake(cache, PlannerConfig(variantgen.load_spec(CAUSAL), "8.0"))
    other = build.Toolchain(FAKE_TC.cuda_home, FAKE_TC.nvcc, "V12.1.1", FAKE_TC.cxx, FAKE_TC.cxx_version)
    monkeypatch.setattr(build, "toolchain", lambda: other)
    r = run("precompile", CAUSAL, "--head-dim", "128", "--dtype", "bf16", "--arch", "8.0", "--check")
    assert r.exit_code == 0, r.output
    assert "ok (built by nvcc V13.0.88)" in r.stdout


# ----------------------------------------------------------------------------- pipes


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`variantgen probe ... | head -1`: the reader leaves early; no 'error: Broken pipe'."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", VARIANTGEN_CACHE_DIR=str(tmp_path / "c"))
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: the first write fails with EPIPE
    proc = subprocess.run([sys.executable, "-m", "variantgen", "probe", str(MM), "--head-dim", "128", "--dtype",
                           "bf16", "--backend", "fa2,fa3", "--kind", "prefill,decode"], stdout=write_end,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    os.close(write_end)
    assert proc.returncode == 1 and proc.stderr == ""


# ----------------------------------------------------------------------------- check


def test_check_runs_the_flex_route_on_a_cpu(monkeypatch):
    """No GPU: check takes the flex route (backend auto or flex) against the reference; a
    FlashInfer backend is refused naming the option and the route that runs here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    small = ("--head-dim", "16", "--dtype", "bf16", "--batch-size", "2", "--qo-len", "8", "--kv-len", "24")
    for backend in ("auto", "flex"):
        r = run("check", MM, *small, "--backend", backend)
        assert r.exit_code == 0, r.output
        assert "checking through the flex route on the CPU" in r.stdout
        assert "the flex route on cpu ready in " in r.stdout
        last = r.stdout.splitlines()[-1]
        assert last.startswith("mm_prefix: batch 2, q ") and last.endswith("(tolerance 0.02) -> ok"), last
    for backend in ("fa2", "fa3"):
        r = run("check", MM, *small, "--backend", backend)
        assert r.exit_code == 1 and r.stderr == (
            f"error: --backend {backend}: {backend} modules run on a CUDA GPU and none is visible here; --backend "
            "flex (or auto) runs the check on the CPU through torch's FlexAttention\n")


def test_check_refuses_bad_tolerances():
    for tol in ("nan", "inf", "-0.1"):  # nan: every run a MISMATCH; inf / negative: meaningless
        r = run("check", MM, "--head-dim", "128", "--dtype", "bf16", "--tol", tol)
        assert r.exit_code == 2 and "Invalid value for '--tol'" in r.output and "CUDA" not in r.output


def _publish_object(cache: Cache, name: str, *, built_at: float | None = None) -> str:
    from variantgen.build.objects import OBJECT_FILE, object_cache

    store = object_cache(cache)
    uri = f"vg_fa3_plain_paged_{name}_qbf16_kvbf16_obf16_hd128x128_sm90a_{'0' * 11}{len(name) % 10}"
    staging = store.new_staging(uri)
    (staging / OBJECT_FILE).write_bytes(b"\x7fELF object" + b"\0" * (1 << 20))
    store.publish(uri, staging, {"module_file": OBJECT_FILE, "built_at": built_at or time.time()})
    return uri


def test_list_and_clear_take_the_shared_kernel_objects_along(filled):
    """The shared kernel objects (.objects/) are no module entries: `list` counts them on a line
    of their own; `clear` (all, or by age) removes them too, `clear SPEC` leaves them."""
    from variantgen.build.objects import object_cache

    cache, _, _ = filled
    _publish_object(cache, "none")
    old = _publish_object(cache, "causal", built_at=time.time() - 10 * 86400)
    r = run("list")
    assert r.exit_code == 0, r.output
    assert f"2 shared kernel object(s), 2.0 MiB, in {cache.root / '.objects'} (only builds read them)" in r.stdout
    assert "vg_fa3_plain" not in r.stdout.split(" module(s) in ")[0]  # not rows of the module table
    r = run("clear", "causal", "--yes")
    assert r.exit_code == 0 and len(list(object_cache(cache).entries())) == 2
    r = run("clear", "--older-than", "7", "--yes")
    assert r.exit_code == 0 and "removed 1 shared kernel object (rebuilt by the next build" in r.stdout
    assert old not in [uri for uri, _ in object_cache(cache).entries()]
    r = run("clear", "--yes")
    assert r.exit_code == 0 and "removed 1 shared kernel object " in r.stdout
    assert list(object_cache(cache).entries()) == [] and "not variantgen modules" not in r.stdout


def test_precompile_starts_the_longest_builds_first():
    """precompile submits the modules with the most compile units of their own first (units
    shared through the object cache do not count), planner modules last: the long builds do not
    start late and stretch the tail."""
    from variantgen.planning.rowplan import planner_configs
    from variantgen.tools.cli_build import expand_matrix, longest_first

    configs, _ = expand_matrix(["causal", "softcap", "mm_prefix"], [(128, 128)], ["bf16"], None, None, ["9.0a"],
                               ["fa3"], ["prefill"])
    order = [c.uri_prefix for c in longest_first(sorted([*configs, *planner_configs(configs)],
                                                        key=lambda c: c.uri_prefix))]
    assert order[0] == "vg_softcap_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a"  # no shared kernel units
    assert order[1:3] == ["vg_causal_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a",
                          "vg_mm_prefix_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a"]
    assert all("_planner_" in uri for uri in order[3:])
