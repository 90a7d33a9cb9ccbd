"""bench/bench_compile.py on the CPU: ninja-log and build.ninja parsing, the unit table and its
summary from a fake build folder with a synthetic .ninja_log, the JSON and its metadata, and the
whole benchmark through the real ninja with the fake compilers of tests/fakes/_fake_toolchain.py
(no nvcc): the log capture around variantgen.build.ninja.run, a failed build, --library, and
--flashinfer where its route cannot run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _fake_toolchain as fake
import pytest

from variantgen.build import builder as build
from variantgen.build import ninja
from variantgen.build.builder import rendered_sources
from variantgen.testing.harness import source_commit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_compile as bc  # noqa: E402

# ninja appends an edge as it finishes: in the order of the end times.
LOG = """# ninja log v5
120\t20500\t0\tobj/binding.o\t1a2b3c4d5e6f7081
20510\t38000\t0\tobj/plan.o\t99aa88bb77cc66dd
0\t41000\t0\tobj/paged_kernel_custom_cta128.o\t3b1f2a9c0d4e5f61
not a line
38010\t52000\t0\tobj/batch_prefill_paged.o\t0102030405060708
52010\t53500\t0\tvg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_0123456789ab.so\tdeadbeefdeadbeef
"""

BUILD_NINJA = """ninja_required_version = 1.3
nvcc = /usr/local/cuda/bin/nvcc

rule cuda_compile
  command = $nvcc -c $in -o $out
rule link
  command = c++ $in -o $out

build obj/paged_kernel_custom_cta128.o: cuda_compile /cache$ dir/a$:b/src/paged_kernel_custom_cta128.cu
build obj/binding.o: cuda_compile /cache$ dir/a$:b/src/binding.cu
build obj/plan.o: cuda_compile /cache$ dir/a$:b/src/plan.cu | /cache$ dir/a$:b/src/plan.h
build obj/batch_prefill_paged.o: cuda_compile /fi/csrc/batch_prefill_paged.cu
build vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_0123456789ab.so: link obj/paged_kernel_custom_cta128.o $
    obj/binding.o obj/plan.o obj/batch_prefill_paged.o
default vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_0123456789ab.so
"""


@pytest.fixture
def build_dir(tmp_path) -> Path:
    """A module build folder as ninja leaves it: build.ninja and a .ninja_log."""
    d = tmp_path / "staging"
    d.mkdir()
    (d / "build.ninja").write_text(BUILD_NINJA)
    (d / ".ninja_log").write_text(LOG)
    return d


@pytest.fixture
def toolchain(tmp_path, monkeypatch, vg_env):
    """Builds through the real ninja with the fake nvcc / c++."""
    tc, info = fake.make_toolchain(tmp_path / "tools")
    monkeypatch.setattr(build, "toolchain", lambda: tc)
    monkeypatch.setattr(build, "flashinfer_info", lambda: info)
    for name in ("VG_FAKE_NVCC_SLEEP", "VG_FAKE_NVCC_FAIL", "VG_FAKE_PIDS", "OUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VARIANTGEN_COMMIT", "abc123def456")
    return tc


# ----------------------------------------------------------------------------- parsing


def test_ninja_log_edges_and_runs():
    edges, runs = bc.parse_ninja_log(LOG)
    assert runs == 1
    assert [e.output for e in edges][:2] == ["obj/binding.o", "obj/plan.o"]
    assert edges[2] == bc.Edge(0, 41000, "obj/paged_kernel_custom_cta128.o")
    assert len(edges) == 5  # the malformed line and the header are skipped
    assert bc.parse_ninja_log("") == ([], 0)
    assert bc.parse_ninja_log("# ninja log v6\n") == ([], 0)


def test_ninja_log_keeps_the_last_run_and_the_last_line_of_an_output():
    """A log that two ninja runs appended to: times restart at 0 with the second one."""
    text = ("# ninja log v5\n0\t900\t0\ta.o\th\n10\t1200\t0\tb.o\th\n1210\t1300\t0\tm.so\th\n"
            "0\t50\t0\tb.o\th\n60\t80\t0\tb.o\th\n90\t100\t0\tm.so\th\n")
    edges, runs = bc.parse_ninja_log(text)
    assert runs == 2
    assert edges == [bc.Edge(60, 80, "b.o"), bc.Edge(90, 100, "m.so")]


def test_build_ninja_rules_inputs_and_escapes():
    rules = bc.parse_build_ninja(BUILD_NINJA)
    assert rules["obj/binding.o"] == ("cuda_compile", ["/cache dir/a:b/src/binding.cu"])
    assert rules["obj/plan.o"] == ("cuda_compile", ["/cache dir/a:b/src/plan.cu"])  # the implicit dep is not one
    so = "vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_0123456789ab.so"
    assert rules[so][0] == "link" and len(rules[so][1]) == 4  # a continued line
    assert "default" not in " ".join(rules)


def test_unit_names():
    assert bc.unit_name("obj/paged_kernel_none_cta16.o") == "paged_kernel_none_cta16"
    assert bc.unit_name("/x/vg_m_0123.so") == "link"
    name = "batch_prefill_with_kv_cache_dtype_q_bf16_sm90"
    assert bc.unit_name(f"/jit/{name}/{name}_batch_prefill_paged_sm90_kernel_mask_3.cuda.o", name) == \
        "batch_prefill_paged_sm90_kernel_mask_3"


def test_unit_table_and_summary_of_a_fake_build_dir(build_dir):
    table = bc.unit_table((build_dir / ".ninja_log").read_text(), (build_dir / "build.ninja").read_text())
    units = table["units"]
    assert [u["name"] for u in units] == ["paged_kernel_custom_cta128", "binding", "plan", "batch_prefill_paged",
                                          "link"]  # longest first
    pole = units[0]
    assert pole["seconds"] == 41.0 and pole["source"] == "paged_kernel_custom_cta128.cu" and not pole["link"]
    assert units[-1]["link"] and units[-1]["rule"] == "link" and units[-1]["source"] is None
    s = bc.summarize(units, slots=2)
    assert s["units"] == 4 and s["long_pole"] == "paged_kernel_custom_cta128" and s["long_pole_s"] == 41.0
    unit_s = 41.0 + 20.38 + 17.49 + 13.99 + 1.49
    assert s["unit_seconds"] == pytest.approx(unit_s) and s["link_seconds"] == pytest.approx(1.49)
    assert s["span_s"] == 53.5
    assert s["parallelism"] == pytest.approx(unit_s / 53.5, abs=1e-3)
    assert s["efficiency"] == pytest.approx(unit_s / 53.5 / 2, abs=1e-3)
    assert s["long_pole_plus_link_share"] == pytest.approx((41.0 + 1.49) / 53.5, abs=1e-3)
    assert bc.summarize([], slots=2) == {"units": 0}
    text = "\n".join(bc.unit_lines(units, s))
    assert "paged_kernel_custom_cta128" in text and "<- long pole" in text and "4 compile units" in text


def test_jobs_of_a_ninja_command_and_ninja_default():
    assert bc.ninja_jobs(["ninja", "-C", "x", "-j", "4"]) == 4
    assert bc.ninja_jobs(["ninja", "-j8"]) == 8
    assert bc.ninja_jobs(["ninja", "-C", "x"]) is None
    assert [bc.ninja_default_jobs(n) for n in (1, 2, 16)] == [2, 3, 18]
    run = bc.NinjaCapture(uri="vg_x_sm90a_0123456789ab", cmd=["ninja", "-f", "build.ninja"], started=0.0,
                          seconds=53.6, returncode=0, ninja_log=LOG, build_ninja=BUILD_NINJA)
    rec = bc.capture_record(run, cores=2)
    assert rec["ninja"]["jobs"] == 3 and not rec["ninja"]["jobs_given"] and rec["summary"]["slots"] == 3
    run.cmd += ["-j", "1"]
    rec = bc.capture_record(run, cores=2)
    assert rec["ninja"]["jobs"] == 1 and rec["ninja"]["jobs_given"] and rec["summary"]["slots"] == 1
    assert bc.capture_record(None, cores=2)["summary"] == {"units": 0}
    assert bc.cpu_figures(150.0, 100.0, 2) == {"cpu_per_wall": 1.5, "core_utilization": 0.75}
    assert bc.cpu_figures(1.0, 0.0, 2)["cpu_per_wall"] is None


# ----------------------------------------------------------------------------- metadata and JSON


def test_environment_names_commit_cpus_and_versions(monkeypatch, toolchain):
    env = bc.environment()
    assert env["commit"] == "abc123def456"
    for key in ("date", "measured_at", "host", "cpu_count", "cpus_usable", "cpu_model", "gpu", "torch",
                "flashinfer", "variantgen", "nvcc_version", "ninja", "tvm_ffi", "python", "nvcc_threads"):
        assert key in env, key
    assert env["nvcc_version"] == "V12.8.93"  # the toolchain a build uses (here the fake one)
    monkeypatch.delenv("VARIANTGEN_COMMIT")
    assert source_commit() != "abc123def456" and source_commit()


def test_write_json_needs_out_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    result = {"environment": {"gpu": "none", "date": "2026-12-02"}, "modules": []}
    assert bc.write_json(result, None) == []  # CPU figures are not written into bench/results
    out = tmp_path / "r" / "c.json"
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert bc.write_json(result, str(out)) == [out, tmp_path / "o" / "compile-bench.json"]
    assert json.loads(out.read_text()) == result


def test_flashinfer_route_without_a_gpu(monkeypatch):
    monkeypatch.setattr(bc, "has_gpu", lambda: False)
    route, note = bc.flashinfer_route("auto", "9.0a")
    assert route == "build" and "no sm90 GPU" in note and "gen_batch_prefill_module" in note
    assert bc.flashinfer_route("build", "9.0a")[0] == "build"
    route, note = bc.flashinfer_route("plan", "9.0a")
    assert route is None and "needs a Hopper GPU" in note and "no CUDA GPU is visible" in note
    route, note = bc.flashinfer_route("auto", "8.0")
    assert route is None and "sm90a only" in note


def test_arguments():
    with pytest.raises(SystemExit):
        bc.parse_args([])  # nothing to build
    with pytest.raises(SystemExit):
        bc.parse_args(["causal", "-j", "0"])
    args = bc.parse_args(["causal", "--backend", "fa2,fa3", "--head-dim", "192/128"])
    assert bc._csv(args.backend) == ["fa2", "fa3"] and bc.parse_head_dim(args.head_dim) == (192, 128)


# ----------------------------------------------------------------------------- through ninja (fake compilers)


def test_capture_saves_the_log_build_py_deletes(toolchain, tmp_path):
    """build.py removes .ninja_log before publishing; the capture has it, with every edge."""
    from _cache_procs import causal_config

    from variantgen.build.cache import Cache

    config = causal_config()
    rendered = rendered_sources(config)
    cache = Cache(tmp_path / "c")
    with bc.NinjaLogCapture() as capture:
        assert ninja.run == capture._run
        result = build.build_module(config, cache, jobs=2)
    assert ninja.run is not capture._run  # put back
    assert not (result.entry.path / ".ninja_log").exists()
    run = capture.find(config.uri_prefix)
    assert run is not None and run.uri == result.entry.uri and run.returncode == 0
    assert bc.ninja_jobs(run.cmd) == 2
    edges, runs = bc.parse_ninja_log(run.ninja_log)
    units = len(rendered.compile_units) + len(rendered.host_sources)
    assert runs == 1 and len(edges) == units + 1  # and the link
    assert "rule cuda_compile" in run.build_ninja


def test_benchmark_end_to_end_with_fake_compilers(toolchain, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bc, "has_gpu", lambda: False)
    out = tmp_path / "compile.json"
    rc = bc.main(["causal", "--backend", "fa2", "--kind", "prefill,decode", "--arch", "9.0a", "-j", "2",
                  "--with-planner", "--flashinfer", "--flashinfer-route", "plan", "--cache-dir", str(tmp_path / "c"),
                  "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["environment"]["commit"] == "abc123def456"
    assert data["matrix"]["arch"] == "9.0a" and data["matrix"]["dtype"] == "bf16"
    kinds = sorted(m["kind"] for m in data["modules"])
    assert kinds == ["decode", "planner", "prefill"]
    for m in data["modules"]:
        assert m["uri"].startswith(m["uri_prefix"] + "_")
        assert m["wall_s"] > 0 and m["ninja"]["jobs"] == 2 and m["ninja"]["jobs_given"]
        assert m["cpu_s"] >= 0 and "core_utilization" in m
        assert m["summary"]["units"] == len([u for u in m["units"] if not u["link"]]) > 0
        assert [u for u in m["units"] if u["link"]]
    assert "needs a Hopper GPU" in data["flashinfer"]["skipped"]  # degrades, does not fail
    assert not (tmp_path / "c" / "modules").exists()  # removed without --keep
    printed = capsys.readouterr().out
    assert "long pole" in printed and "FlashInfer fa3 prefill: skipped" in printed and f"wrote {out}" in printed


def test_a_failed_build_exits_1_and_keeps_its_log(toolchain, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VG_FAKE_NVCC_FAIL", "binding")
    out = tmp_path / "compile.json"
    rc = bc.main(["causal", "--arch", "9.0a", "--cache-dir", str(tmp_path / "c"), "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "error: building vg_causal_fa2_prefill" in err and "fake failure" in err and "kept" in err
    data = json.loads(out.read_text())
    (m,) = data["modules"]
    assert "fake failure" in m["error"] and m["ninja"]["returncode"] != 0
    assert "binding" not in [u["name"] for u in m["units"]]  # ninja logs the commands that succeeded
    failed = list((tmp_path / "c" / "modules" / ".failed").iterdir())
    assert len(failed) == 1 and (failed[0] / "build.log").is_file()


def test_library_precompiles_every_shipped_spec(toolchain, tmp_path, monkeypatch, capsys):
    from variantgen.lang.library import shipped_specs

    out = tmp_path / "compile.json"
    rc = bc.main(["--library", "--library-jobs", "3", "--library-backend", "fa2", "--arch", "9.0a",
                  "--cache-dir", str(tmp_path / "c"), "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    lib = json.loads(out.read_text())["library"]
    assert lib["specs"] == len(shipped_specs()) and lib["jobs"] == 3 and lib["exit_status"] == 0
    assert lib["command"][:2] == ["variantgen", "precompile"]
    uris = [m["uri"] for m in lib["modules"]]
    assert lib["modules_built"] == len(uris) >= len(shipped_specs()) and not lib["modules_failed"]
    assert any("_planner_" in u for u in uris)  # precompile adds the planner modules
    assert all(m["end_offset_s"] >= m["start_offset_s"] >= 0 for m in lib["modules"])
    assert lib["wall_s"] > 0 and lib["unit_seconds"] > 0
    assert "library: " in capsys.readouterr().out


def test_flashinfer_build_route_with_fake_compilers(toolchain, tmp_path, monkeypatch, capsys):
    """No GPU: FlashInfer's fa3 prefill module is built (not loaded) in a child process, with an
    empty FLASHINFER_WORKSPACE_BASE; its ninja log (kept in FlashInfer's build folder) gives the
    unit table. FlashInfer's ninja file does not escape paths: the fake toolkit is reached
    through a link without the space in its name."""
    monkeypatch.setattr(bc, "has_gpu", lambda: False)
    home = tmp_path / "cudahome"
    home.symlink_to(toolchain.cuda_home)
    (home / "lib64" / "stubs").mkdir()
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("CXX", str(home / "bin" / "c++"))
    out = tmp_path / "compile.json"
    rc = bc.main(["--flashinfer", "--arch", "9.0a", "-j", "2", "--cache-dir", str(tmp_path / "c"), "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    fi = json.loads(out.read_text())["flashinfer"]
    assert fi["route"] == "build" and "no sm90 GPU" in fi["note"] and fi["max_jobs"] == "2"
    assert fi["module"].endswith("_sm90") and str(tmp_path / "c" / "flashinfer") in fi["jit_dir"]
    (m,) = fi["modules"]
    names = [u["name"] for u in m["units"]]
    assert "link" in names and "batch_prefill_sm90_jit_binding" in names
    assert m["summary"]["units"] == len(names) - 1 and m["ninja"]["jobs"] == 2
    assert "FlashInfer 0." in capsys.readouterr().out
