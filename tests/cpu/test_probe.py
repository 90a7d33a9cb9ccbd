"""variantgen.probe: every reason, injected; never raises; memoization; relocatable caches;
runtime probes (a GPU, loaded) and cache checks (runtime=False).

No test compiles anything: the toolchain is faked (or deliberately broken), builds are
replaced by a function that publishes a dummy module into the cache, and the GPU is a fake
sm90 (torch.cuda's capability query and build.load_module patched) unless a test says
otherwise.
"""

from __future__ import annotations

import importlib
import multiprocessing
import shutil
import time
from pathlib import Path

import _cache_procs as procs
import pytest
import torch

import variantgen
from variantgen.api.probing import ProbeResult, probe
from variantgen.build import builder as build
from variantgen.build.builder import rendered_sources
from variantgen.build.cache import Cache, LockHolder, LockTimeout, ModuleKey
from variantgen.codegen import fi_versions
from variantgen.codegen.render import ModuleConfig, render_module
from variantgen.core.errors import BuildError
from variantgen.routing import capabilities

# `variantgen.probe` is both the package's function and the submodule; take the module.
probe_mod = importlib.import_module("variantgen.api.probing")

REPO = Path(__file__).resolve().parents[2]
MM = REPO / "specs" / "mm_prefix.yaml"
CAUSAL = REPO / "specs" / "causal.yaml"
FAKE_TC = build.Toolchain(Path("/opt/fake-cuda"), Path("/opt/fake-cuda/bin/nvcc"), "V13.0.88", "/usr/bin/c++",
                          "c++ (fake) 12.2.0")
REAL_TOOLCHAIN = build.toolchain
REAL_ROUTES = capabilities.installed_routes
BASE = dict(head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="fa2")


def publish_fake(cache: Cache, cfg: ModuleConfig, tc: build.Toolchain | None = FAKE_TC,
                 toolchain_parts: tuple | None = None):
    """Publish a dummy module for ``cfg`` whose key matches what build_module computes."""
    rendered = rendered_sources(cfg)
    base = build.module_key(rendered, tc)
    key = ModuleKey(base.prefix, base.inputs, toolchain_parts) if toolchain_parts is not None else base
    staging = cache.new_staging(key.uri)
    (staging / f"{key.uri}.so").write_bytes(b"\x7fELF not really a module " + key.uri.encode())
    manifest = {
        "module_file": f"{key.uri}.so",
        "config": cfg.describe(),
        "inputs": dict(key.inputs),
        "inputs_digest": key.inputs_digest,
        "toolchain": dict(key.toolchain),
        "key_digest": key.digest,
        "built_at": time.time(),
    }
    return cache.publish(key.uri, staging, manifest)


def mm_config(arch: str = "9.0a", **kw) -> ModuleConfig:
    fields = dict(head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", arch=arch)
    fields.update(kw)
    return ModuleConfig(variantgen.load_spec(MM), **fields)


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_device(device=None):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_device)


@pytest.fixture(autouse=True)
def clean(vg_env, monkeypatch):
    """Private cache, clean environment, a fake sm90 GPU that loads any module (``clean.loaded``
    lists what it loaded), a fake toolchain, an empty memo; the module backends only (what the
    resolver does with the flex route installed: test_capabilities.py)."""
    monkeypatch.setattr(capabilities, "installed_routes", lambda: ())
    probe_mod.cache_clear()
    _fake_gpu(monkeypatch, (9, 0))
    loaded: list[str] = []
    monkeypatch.setattr(build, "load_module", lambda entry: loaded.append(entry.uri) or object())
    monkeypatch.setattr(build, "toolchain", lambda: FAKE_TC)
    vg_env.loaded = loaded
    yield vg_env
    probe_mod.cache_clear()


@pytest.fixture
def fake_build(monkeypatch):
    """Replace the ninja build with publishing a dummy module; counts the builds."""
    calls = []

    def fake_build_locked(rendered, key, tc, cache, jobs, progress=None):
        calls.append(key.uri)
        return publish_fake(cache, rendered.config, tc)

    monkeypatch.setattr(build, "_build_locked", fake_build_locked)
    return calls


# ----------------------------------------------------------------------------- result type


def test_result_is_frozen_and_truthy():
    r = ProbeResult(True, "", "vg_x", "cache", "/x.so", 0.1, {})
    assert bool(r) and r.reason == ""
    assert not ProbeResult(False, "nope")
    with pytest.raises(AttributeError):
        r.ok = False  # type: ignore[misc]


def test_package_level_probe_stays_callable():
    # `import variantgen.probe` rebinds the package attribute to the module; it must still work.
    r = variantgen.probe(MM, **BASE, arch="9.0a", build=False)
    assert isinstance(r, ProbeResult)
    r2 = variantgen.probe(MM, **BASE, arch="9.0a", build=False)
    assert r2 is r


# ----------------------------------------------------------------------------- 1. spec


def test_invalid_spec_reason_is_the_spec_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmask: kv_pos <= qq_pos\n")
    with pytest.raises(variantgen.SpecError) as e:
        variantgen.load_spec(bad)
    r = probe(bad, **BASE, arch="9.0a")
    assert not r and r.reason == str(e.value)
    assert f"{bad}:2:" in r.reason and "qq_pos" in r.reason
    assert r.source == "not built" and r.uri is None


def test_missing_spec_file(tmp_path):
    r = probe(tmp_path / "nope.yaml", **BASE, arch="9.0a")
    assert not r and "spec file not found" in r.reason


def test_spec_of_wrong_type():
    r = probe(42, **BASE, arch="9.0a")  # type: ignore[arg-type]
    assert not r and r.reason == "spec must be a VariantSpec, a path to a spec file or a shipped spec name, got int"


# ----------------------------------------------------------------------------- 2. flashinfer


def test_flashinfer_not_installed(monkeypatch):
    def missing():
        raise ImportError("flashinfer is not installed")

    monkeypatch.setattr(variantgen.build.builder, "flashinfer_package_dir", missing)
    r = probe(MM, **BASE, arch="9.0a")
    assert not r
    assert "flashinfer is not installed" in r.reason and ">= 0.7.2" in r.reason


def test_flashinfer_too_old(monkeypatch):
    monkeypatch.setattr(fi_versions, "package_versions", lambda: ("0.6.1", "0.1.15.post2"))
    r = probe(MM, **BASE, arch="9.0a")
    assert not r
    assert "flashinfer 0.6.1 is too old" in r.reason and ">= 0.7.2" in r.reason


def test_flashinfer_0_7_2_before_its_post_release_is_too_old(monkeypatch):
    """The templates were checked against 0.7.2.post1 onwards (fi_versions.py): a build would refuse 0.7.2."""
    monkeypatch.setattr(fi_versions, "package_versions", lambda: ("0.7.2", "0.1.15.post2"))
    r = probe(MM, **BASE, arch="9.0a")
    assert not r and "flashinfer 0.7.2 is too old: variantgen needs flashinfer-python >= 0.7.2.post1" in r.reason


def _fake_package(tmp_path, *, host: bool, plan: bool):
    (tmp_path / "data" / "csrc").mkdir(parents=True)
    if host:
        (tmp_path / "data" / "csrc" / "batch_prefill_paged.cu").write_text("// host\n")
    sched = tmp_path / "data" / "include" / "flashinfer" / "attention"
    sched.mkdir(parents=True)
    (sched / "scheduler.cuh").write_text("PrefillPlan\n" if plan else "// old scheduler\n")
    return tmp_path


def test_flashinfer_without_sources(monkeypatch, tmp_path):
    monkeypatch.setattr(variantgen.build.builder, "flashinfer_package_dir",
                        lambda: _fake_package(tmp_path, host=False, plan=True))
    r = probe(MM, **BASE, arch="9.0a")
    assert not r and "batch_prefill_paged.cu" in r.reason and ">= 0.7.2" in r.reason


def test_flashinfer_without_prefill_plan(monkeypatch, tmp_path):
    monkeypatch.setattr(variantgen.build.builder, "flashinfer_package_dir",
                        lambda: _fake_package(tmp_path, host=True, plan=False))
    r = probe(MM, **BASE, arch="9.0a")
    assert not r and "PrefillPlan" in r.reason


def test_version_comparison():
    assert probe_mod._version_at_least("0.7.2.post1", "0.7.2")
    assert probe_mod._version_at_least("0.8.0rc1", "0.7.2")
    assert not probe_mod._version_at_least("0.7.1", "0.7.2")
    assert not probe_mod._version_at_least("garbage", "0.7.2")


# ----------------------------------------------------------------------------- 3. combinations


@pytest.mark.parametrize("kwargs, expected", [
    (dict(q_dtype="fp8_e4m3"), "fp8 query is not supported by fa2"),
    (dict(o_dtype="fp8_e4m3"), "fp8 output is not supported by fa2"),
    (dict(head_dim_qk=96), "fa2 prefill modules support head dims 64, 128, 256"),
    (dict(head_dim_qk=128, head_dim_vo=64), "fa2 prefill modules support head dims"),
    (dict(head_dim_qk=192, head_dim_vo=128, kind="ragged", arch="7.5"), "fa2 needs sm80 or newer"),
    (dict(backend="fa3", arch="8.6"), "arch=8.6: fa3 modules run on sm90 (Hopper) only"),
    (dict(backend="fa3", kv_dtype="fp8_e4m3"), "fa3 variant modules need kv_dtype == q_dtype"),
    (dict(backend="fa3", kind="decode", head_dim_qk=96), "fa3 prefill modules support head dims 64, 128, 256 (qk/vo "
                                                          "where they differ) (its decode runs the prefill module)"),
    (dict(backend="fa3", kind="ragged", kv_dtype="fp8_e4m3"), "fa3 variant modules need kv_dtype == q_dtype"),
    (dict(backend="fa3", kind="decode", head_dim_qk=192, head_dim_vo=128), "fa3 prefill modules support head dims"),
    (dict(kind="append"), "kind='append': expected one of ['prefill', 'ragged', 'decode']"),
    (dict(backend="cudnn"), "backend='cudnn'"),
    (dict(q_dtype="fp32"), "q_dtype=fp32: fa2 modules take bf16, fp16"),
    (dict(q_dtype="fp64"), "q_dtype='fp64': unsupported dtype"),
    (dict(head_dim_qk="128"), "expected a whole number"),
    (dict(page_size=0), "page_size=0: expected a positive whole number"),
    (dict(page_size=-16), "page_size=-16"),
    (dict(page_size=16.0), "page_size=16.0"),
    (dict(page_size=True), "page_size=True"),
    (dict(arch="7.5"), "fa2 needs sm80 or newer"),
    (dict(arch="hopper"), "expected a compute capability"),
    (dict(cache_dir=""), "cache_dir='': expected a folder, or None for VARIANTGEN_CACHE_DIR"),
    (dict(cache_dir=7), "cache_dir=7: expected a folder, or None for VARIANTGEN_CACHE_DIR"),
])
def test_unsupported_combinations(kwargs, expected):
    args = dict(BASE, arch="9.0a")
    args.update(kwargs)
    r = probe(MM, **args)
    assert not r and expected in r.reason
    assert r.source == "not built"


def test_backend_not_allowed_by_spec(tmp_path):
    spec = tmp_path / "fa3only.yaml"
    spec.write_text("name: fa3only\nmask: kv_pos <= q_pos\nbackends: [fa3]\n")
    r = probe(spec, **BASE, arch="9.0a")
    assert not r and "spec `fa3only` allows only ['fa3']" in r.reason


def test_torch_dtypes_are_accepted(fake_build):
    r = probe(MM, head_dim_qk=128, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, arch="9.0a")
    assert r, r.reason
    assert "_qbf16_kvfp8_e4m3_obf16_" in r.uri


def test_valid_page_size(fake_build):
    assert probe(MM, **BASE, arch="9.0a", page_size=16)


# ----------------------------------------------------------------------------- 4. device


def test_gpu_too_old(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5))
    r = probe(MM, **BASE)
    assert not r and r.reason == "arch=7.5 (the visible GPU's): fa2 needs sm80 or newer"


NO_GPU_REASON = ("no CUDA device visible: probe() answers whether the module runs here, and nothing can run "
                 "without a GPU (to check a cache for another machine: probe(..., runtime=False, arch=...) or "
                 "`variantgen precompile ... --check`)")


def test_no_device(monkeypatch):
    _no_gpu(monkeypatch)
    r = probe(MM, **BASE)
    assert not r and r.reason == NO_GPU_REASON
    assert "VARIANTGEN_ARCH" not in r.reason  # it would make a serving box compile


def test_a_target_arch_does_not_make_a_cpu_box_say_yes(monkeypatch, clean, fake_build):
    """On a machine without a GPU the answer is no, whatever arch is named: the README's
    `if variantgen.probe(...)` must not go on to make_wrapper there; nothing is built."""
    _no_gpu(monkeypatch)
    for kwargs in (dict(arch="9.0a"), dict(arch="8.0"), dict()):
        r = variantgen.probe(MM, **BASE, **kwargs)
        assert not r and r.reason == NO_GPU_REASON
    clean.set(VARIANTGEN_ARCH="9.0a")
    probe_mod.cache_clear()
    assert probe(MM, **BASE).reason == NO_GPU_REASON
    assert fake_build == [] and clean.loaded == []


def test_device_given_but_unusable(monkeypatch):
    def bad_index(device=None):
        raise RuntimeError("Invalid device id")

    monkeypatch.setattr(torch.cuda, "get_device_capability", bad_index)
    r = probe(MM, **BASE, device="cuda:3")
    assert not r and r.reason == "cannot query CUDA device cuda:3: RuntimeError: Invalid device id"
    _no_gpu(monkeypatch)
    probe_mod.cache_clear()
    assert probe(MM, **BASE, device="cuda:3").reason == NO_GPU_REASON  # named, on a box without CUDA
    r = probe(MM, **BASE, device="cpu")
    assert not r and r.reason == "device='cpu' is not a CUDA device: the compiled modules run on NVIDIA GPUs"


@pytest.mark.parametrize("capability, arch", [((9, 0), "9.0a"), ((8, 6), "8.6"), ((8, 0), "8.0"), ((10, 0), "10.0a"),
                                                ((12, 0), "12.0a")])  # Blackwell: the arch-specific target
def test_arch_from_device(monkeypatch, clean, capability, arch):
    _fake_gpu(monkeypatch, capability)
    clean.set(VARIANTGEN_DISABLE_JIT="1")
    r = probe(MM, **BASE)
    assert not r and f"--arch {arch} " in r.reason
    assert r.details["arch"] == arch


def test_explicit_arch_must_be_the_gpus(clean, fake_build):
    r = probe(MM, **BASE, arch="8.0")
    assert not r and r.reason == ("arch=8.0 was given, but the visible GPU is 9.0a: a module for 8.0 does not run "
                                  "here (probe(..., runtime=False) checks a cache for another GPU)")
    assert fake_build == []
    r = probe(MM, **BASE, arch="sm_90a")  # the GPU's own arch, spelled another way
    assert r and "_sm90a_" in r.uri and r.details["loaded"] is True


def test_explicit_arch_is_refused_where_a_route_could_serve(monkeypatch, clean, fake_build):
    """With the flex route installed (it runs on any GPU) an arch= that is not the GPU's is still
    refused: the caller asked about modules for that arch. The probe had answered "flex", while
    make_wrapper built the module for the other arch."""
    monkeypatch.setattr(capabilities, "installed_routes", REAL_ROUTES)
    assert "flex" in REAL_ROUTES()
    r = probe(MM, **{**BASE, "backend": None}, arch="8.0")
    assert not r and r.reason == ("arch=8.0 was given, but the visible GPU is 9.0a: a module for 8.0 does not run "
                                  "here (probe(..., runtime=False) checks a cache for another GPU)")
    assert fake_build == []


@pytest.mark.parametrize("flag, value", [("cuda_graph", "no"), ("build", 1), ("runtime", None),
                                         ("use_tensor_cores", "yes"), ("build", "false")])
def test_probe_flags_must_be_bools(clean, fake_build, flag, value):
    """probe() read its flags as truthy: cuda_graph="no" asked for CUDA-graph mode, build="false"
    allowed a build. Now the reason names the flag (probe never raises)."""
    r = probe(MM, **BASE, **{flag: value})
    assert not r and r.reason == f"`{flag}`={value!r}: expected True or False"
    assert fake_build == []


def test_make_wrapper_refuses_an_arch_that_is_not_the_workspaces_gpu():
    from variantgen.api.factory import workspace_arch

    cuda = torch.device("cuda", 0)  # (the autouse fixture's fake sm90 GPU)
    with pytest.raises(ValueError, match=r"^make_wrapper\(\): arch=8\.0 was given, but the workspace's GPU is 9\.0a: "
                                         r"a module for 8\.0 does not run here \(leave arch= out"):
        workspace_arch("8.0", cuda)
    assert workspace_arch("sm_90a", cuda) == "9.0a" and workspace_arch(None, cuda) == "9.0a"
    assert workspace_arch("8.0", None) == "8.0" and workspace_arch(None, None) is None  # a CPU workspace


# ----------------------------------------------------------------------------- runtime=False


def test_cache_check_without_a_gpu(monkeypatch, clean, fake_build):
    """runtime=False: is the module a JIT-disabled server would load in the cache? No GPU
    needed, nothing built or loaded, with JIT on or off."""
    _no_gpu(monkeypatch)
    r = probe(MM, **BASE, arch="90a", runtime=False)
    uri = _expected_uri(mm_config())
    assert not r and r.uri == uri and fake_build == []
    assert r.reason == (f"runtime=False (a cache check) and module {uri} is not precompiled in {clean.cache_dir}; "
                        f"build it: variantgen precompile {MM} --head-dim 128 --dtype bf16 --kv-dtype bf16 "
                        f"--backend fa2 --arch 9.0a --cache-dir {clean.cache_dir}")
    entry = publish_fake(Cache(clean.cache_dir), mm_config())
    probe_mod.cache_clear()  # results are memoized per process
    r = probe(MM, **BASE, arch="90a", runtime=False)
    assert r and r.source == "cache" and r.uri == entry.uri and r.details["loaded"] is False
    assert fake_build == [] and clean.loaded == []


def test_cache_check_finds_another_toolchains_build(monkeypatch, clean):
    """As a server with JIT disabled would: a build of the same inputs by any nvcc counts."""
    entry = publish_fake(Cache(clean.cache_dir), mm_config(), toolchain_parts=(("nvcc", "V12.4.1"), ("cxx", "g")))
    r = probe(MM, **BASE, arch="9.0a", runtime=False)
    assert r and r.uri == entry.uri and r.source == "cache"


def test_cache_check_arch_from_the_gpu_or_the_environment(monkeypatch, clean):
    _fake_gpu(monkeypatch, (8, 6))
    r = probe(MM, **BASE, runtime=False)
    assert not r and "_sm86_" in r.uri and "--arch 8.6 " in r.reason
    _no_gpu(monkeypatch)
    clean.set(VARIANTGEN_ARCH="sm_80")
    r = probe(MM, **BASE, runtime=False)
    assert not r and "--arch 8.0 " in r.reason and "_sm80_" in r.uri
    clean.set(VARIANTGEN_ARCH=None)
    probe_mod.cache_clear()  # the memo knows the environment, not the GPU
    r = probe(MM, **BASE, runtime=False)
    assert not r and r.reason.startswith("runtime=False: no target arch (pass arch=")


# ----------------------------------------------------------------------------- 5. JIT disabled


def _expected_uri(cfg: ModuleConfig) -> str:
    return build.module_key(render_module(cfg), FAKE_TC).uri


@pytest.mark.parametrize("variable", ["VARIANTGEN_DISABLE_JIT", "FLASHINFER_DISABLE_JIT"])
def test_jit_disabled_reason_has_the_exact_precompile_command(clean, variable):
    clean.set(**{variable: "1"})
    cache_dir = clean.cache_dir
    r = probe(MM, **BASE, arch="9.0a")
    uri = _expected_uri(mm_config())
    assert not r
    assert r.reason == (
        f"JIT disabled by {variable} and module {uri} is not precompiled in {cache_dir}; build it where nvcc is "
        f"(a build box) and copy the cache folder here: "
        f"variantgen precompile {MM} --head-dim 128 --dtype bf16 --kv-dtype bf16 --backend fa2 --arch 9.0a "
        f"--cache-dir {cache_dir}")
    assert r.uri == uri


@pytest.mark.parametrize("damage", ["truncated", "bit flip", "missing"])
@pytest.mark.parametrize("nvcc", ["same nvcc", "no nvcc"])
def test_jit_disabled_names_a_corrupted_module(clean, monkeypatch, damage, nvcc):
    """A damaged precompiled module is reported as corrupted, with its path - not as missing
    (a server without nvcc finds modules by their inputs: that path too)."""
    entry = publish_fake(Cache(clean.cache_dir), mm_config())
    data = entry.module_path.read_bytes()
    if damage == "truncated":
        entry.module_path.write_bytes(data[:10])
    elif damage == "bit flip":
        entry.module_path.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
    else:
        entry.module_path.unlink()
    if nvcc == "no nvcc":
        def no_nvcc():
            raise build.ToolchainError("nvcc not found")

        monkeypatch.setattr(build, "toolchain", no_nvcc)
    clean.set(VARIANTGEN_DISABLE_JIT="1")
    r = probe(MM, **BASE)
    assert not r
    assert r.reason.startswith("JIT disabled by VARIANTGEN_DISABLE_JIT and module ")
    assert f" in {clean.cache_dir} is corrupted: entry {entry.path}: module file " in r.reason
    assert {"truncated": "(truncated?)", "bit flip": "(corrupted)", "missing": "is missing"}[damage] in r.reason
    assert "copy a good one from the build box's cache" in r.reason and clean.loaded == []
    probe_mod.cache_clear()
    r = probe(MM, **BASE, runtime=False)
    assert not r and "is corrupted: entry " in r.reason


def test_build_false_reason_and_command_with_other_dtypes(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch, (8, 0))
    r = probe(MM, head_dim_qk=256, q_dtype="fp16", kv_dtype="fp8_e5m2", build=False,
              cache_dir=tmp_path / "c")
    assert not r
    assert r.reason.startswith("building disabled (build=False) and module vg_mm_prefix_fa2_prefill_qfp16_kvfp8_e5m2")
    assert r.reason.endswith(f"copy the cache folder here: variantgen precompile {MM} --head-dim 256 --dtype fp16 "
                             f"--kv-dtype fp8_e5m2 "
                             f"--backend fa2 --arch 8.0 --cache-dir {tmp_path / 'c'}")


def test_jit_disabled_reason_quotes_paths(clean, tmp_path):
    clean.set(VARIANTGEN_DISABLE_JIT="1")
    odd = tmp_path / "my specs"
    odd.mkdir()
    shutil.copy(CAUSAL, odd / "causal.yaml")
    r = probe(odd / "causal.yaml", **BASE, arch="9.0a", cache_dir=tmp_path / "a cache")
    assert f"precompile '{odd / 'causal.yaml'}' " in r.reason
    assert r.reason.endswith(f"--cache-dir '{tmp_path / 'a cache'}'")


def test_jit_disabled_without_toolchain_finds_precompiled_module(clean, monkeypatch):
    entry = publish_fake(Cache(clean.cache_dir), mm_config())  # built on a "build box"
    clean.set(VARIANTGEN_DISABLE_JIT="1")

    def no_nvcc():
        raise build.ToolchainError("nvcc not found")

    monkeypatch.setattr(build, "toolchain", no_nvcc)
    r = probe(MM, **BASE, arch="9.0a")
    assert r, r.reason
    assert r.source == "cache" and r.uri == entry.uri and r.module_path == str(entry.module_path)


# ----------------------------------------------------------------------------- 6. toolchain


def test_nvcc_not_found_lists_the_paths_tried(clean, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "toolchain", REAL_TOOLCHAIN)  # the real discovery this time
    clean.set(CUDA_HOME=tmp_path / "no-cuda")
    build.toolchain.cache_clear()
    try:
        r = probe(MM, **BASE, arch="9.0a")
    finally:
        build.toolchain.cache_clear()
    assert not r
    assert "nvcc not found" in r.reason and str(tmp_path / "no-cuda" / "bin" / "nvcc") in r.reason
    assert "CUDA_HOME" in r.reason
    # and the way to serve without a compiler
    assert r.reason.splitlines()[1] == (
        "  (or, to serve without a compiler: precompile it on a build box, copy the cache here and set "
        f"VARIANTGEN_DISABLE_JIT=1: variantgen precompile {MM} --head-dim 128 --dtype bf16 --kv-dtype bf16 --backend "
        f"fa2 --arch 9.0a --cache-dir {clean.cache_dir})")


def test_nvcc_missing_but_module_built_elsewhere_gets_a_hint(clean, monkeypatch):
    publish_fake(Cache(clean.cache_dir), mm_config(), toolchain_parts=(("nvcc", "V12.8.93"), ("cxx", "other")))

    def no_nvcc():
        raise build.ToolchainError("nvcc not found (looked in CUDA_HOME: tried /x/bin/nvcc)")

    monkeypatch.setattr(build, "toolchain", no_nvcc)
    r = probe(MM, **BASE, arch="9.0a")
    assert not r and r.reason.startswith("nvcc not found") and "VARIANTGEN_DISABLE_JIT=1" in r.reason


# ----------------------------------------------------------------------------- 7. cache not writable


def _read_only(monkeypatch):
    def writable(self):
        return False, f"cache directory {self.root} is not writable (Permission denied)"

    monkeypatch.setattr(Cache, "writable", writable)


def test_cache_not_writable(monkeypatch, clean, fake_build):
    _read_only(monkeypatch)
    r = probe(MM, **BASE, arch="9.0a")
    assert not r and r.reason.startswith(f"cache directory {clean.cache_dir} is not writable")
    assert fake_build == []


def test_read_only_cache_with_the_module_succeeds(monkeypatch, clean, fake_build):
    entry = publish_fake(Cache(clean.cache_dir), mm_config())
    _read_only(monkeypatch)
    r = probe(MM, **BASE, arch="9.0a")
    assert r, r.reason
    assert r.source == "cache" and r.uri == entry.uri and r.details["loaded"] is True
    assert fake_build == [] and clean.loaded == [entry.uri]


# ----------------------------------------------------------------------------- 8. build failure


def test_build_failure_names_first_error_and_log(monkeypatch, tmp_path):
    log_path = tmp_path / "build.log"

    def failing(rendered, key, tc, cache, jobs, progress=None):
        raise BuildError(f"building module {key.uri} failed (ninja exit 1 after 3.0s)", log_path=str(log_path),
                         output="[1/13] nvcc binding.cu\nvariant.cuh(57): error: identifier \"qq\" is undefined\n"
                                "1 error detected\n")

    monkeypatch.setattr(build, "_build_locked", failing)
    r = probe(MM, **BASE, arch="9.0a")
    assert not r
    assert 'variant.cuh(57): error: identifier "qq" is undefined' in r.reason
    assert str(log_path) in r.reason
    assert r.details["log_path"] == str(log_path) and r.uri and r.uri in r.reason


# ----------------------------------------------------------------------------- 9. success


def test_success_builds_then_finds_in_cache(fake_build):
    r = probe(MM, **BASE, arch="9.0a")
    assert r and r.source == "built" and r.reason == ""
    assert Path(r.module_path).is_file() and r.details["loaded"] is True
    probe_mod.cache_clear()
    r2 = probe(MM, **BASE, arch="9.0a")
    assert r2 and r2.source == "cache" and r2.uri == r.uri
    assert len(fake_build) == 1


def test_success_on_a_gpu_loads_the_module(clean, fake_build):
    r = probe(MM, **BASE)
    assert r, r.reason
    assert r.details["loaded"] is True and clean.loaded == [r.uri] and "_sm90a_" in r.uri


def test_load_failure_is_a_reason(monkeypatch, fake_build):
    def bad_load(entry):
        raise RuntimeError("undefined symbol: foo")

    monkeypatch.setattr(build, "load_module", bad_load)
    r = probe(MM, **BASE)
    assert not r and "failed to load" in r.reason and "undefined symbol: foo" in r.reason
    assert r.uri and "_sm90a_" in r.uri


def test_spec_object_is_accepted(fake_build):
    spec = variantgen.load_spec(CAUSAL)
    r = probe(spec, **BASE, arch="9.0a")
    assert r and r.uri.startswith("vg_causal_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_")


# ----------------------------------------------------------------------------- never raises


def test_unexpected_exception_becomes_internal_error(monkeypatch):
    def boom(config):
        raise RuntimeError("boom")

    monkeypatch.setattr(probe_mod.render, "render_module", boom)
    r = probe(MM, **BASE, arch="9.0a")
    assert not r and r.reason == "internal error: RuntimeError: boom"


@pytest.mark.parametrize("kwargs", [
    dict(head_dim_qk=None, q_dtype="bf16", kv_dtype="bf16"),
    dict(head_dim_qk=128, q_dtype=object(), kv_dtype="bf16"),
    dict(head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", cache_dir=123),
    dict(head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", device=object()),
    dict(head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend=["fa2"]),
])
def test_never_raises_on_garbage(kwargs):
    r = probe(MM, **kwargs, arch="9.0a")
    assert isinstance(r, ProbeResult) and isinstance(r.reason, str)


def test_bad_environment_is_a_reason(monkeypatch):
    from variantgen.core import env

    monkeypatch.setenv("VARIANTGEN_BUILD_JOBS", "lots")
    env.settings.cache_clear()  # settings() now raises ValueError; probe must not
    r = probe(MM, **BASE, arch="9.0a")
    assert not r and "VARIANTGEN_BUILD_JOBS" in r.reason


# ----------------------------------------------------------------------------- memoization


def test_results_are_memoized_per_argument_combination(fake_build, monkeypatch):
    calls = []
    real = build.build_module
    monkeypatch.setattr(build, "build_module", lambda *a, **k: calls.append(1) or real(*a, **k))
    r1 = probe(MM, **BASE, arch="9.0a")
    r2 = probe(MM, **BASE, arch="9.0a")
    assert r1 is r2 and len(calls) == 1
    r3 = probe(MM, **BASE, arch="9.0a", kind="decode")
    assert r3 is not r1 and len(calls) == 2
    r4 = probe(MM, head_dim_qk=128, q_dtype=torch.bfloat16, kv_dtype="bfloat16", arch="9.0a", backend="fa2")
    assert r4.uri == r1.uri and len(calls) == 3  # other spelling: another combination, same module
    probe_mod.cache_clear()
    probe(MM, **BASE, arch="9.0a")
    assert len(calls) == 4


def test_default_backend_is_what_make_wrapper_picks(fake_build, monkeypatch):
    """backend=None: the probe answers for the module make_wrapper would load on this GPU."""
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", arch="9.0a")
    assert r and r.details["backend"] == "fa3" and "_fa3_prefill_" in r.uri
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="fp8_e4m3", arch="9.0a")
    assert r and r.details["backend"] == "fa2"  # fa3 modules need a 16-bit KV cache
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="decode")
    assert r and r.details["backend"] == "fa2" and "_fa2_decode_" in r.uri  # decode: fa2 first (KIND_ORDER)
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="decode", backend="fa3")
    assert r and r.details["backend"] == "fa3" and "_fa3_prefill_" in r.uri  # fa3 decode: its prefill module
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="ragged")
    assert r and r.details["backend"] == "fa3" and "_fa3_ragged_" in r.uri
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="fp8_e4m3", kind="decode")
    assert r and r.details["backend"] == "fa2" and "_fa2_decode_" in r.uri
    _fake_gpu(monkeypatch, (8, 0))  # no fa3 on an A100: CUDA-core decode
    probe_mod.cache_clear()  # (the memo takes the GPU as fixed for the process)
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="decode")
    assert r and r.details["backend"] == "fa2" and "_fa2_decode_" in r.uri


def test_probe_backends_answers_per_backend_and_kind(fake_build):
    out = variantgen.probe_backends(MM, kinds=("prefill", "ragged"), head_dim_qk=192, head_dim_vo=128,
                                    q_dtype="bf16", kv_dtype="bf16", arch="9.0a")
    assert set(out) == {(b, k) for b in ("fa2", "fa3", "flex") for k in ("prefill", "ragged")}
    assert not out["flex", "ragged"] and "the flex route (torch's FlexAttention, no compiled module) is not " \
        "installed here (variantgen.wrappers.flex_wrapper is missing)" == out["flex", "ragged"].reason
    assert out["fa2", "ragged"].ok
    assert not out["fa2", "prefill"] and "fa2 prefill modules support head dims" in out["fa2", "prefill"].reason
    assert out["fa3", "ragged"].ok and "_fa3_ragged_qbf16_kvbf16_obf16_hd192x128_sm90a_" in out["fa3", "ragged"].uri
    assert not out["fa3", "prefill"] and "fa3 prefill modules support head dims" in out["fa3", "prefill"].reason


@pytest.mark.parametrize("spec_name", ["attention_sink_learned", "tree_verify", "gemma4_sliding"])
def test_probe_backends_answer_for_the_new_masks(fake_build, spec_name):
    """The sinks, tree and Gemma 4 specs: every (backend, kind) gets an answer (the fake build
    renders each module, so one whose templates broke would be a reason, not ok); fa3 serves every
    kind (its decode on its paged prefill module), and Gemma 4's global head dim 512 is refused with
    the supported list."""
    out = variantgen.probe_backends(spec_name, kinds=("prefill", "ragged", "decode"), head_dim_qk=256,
                                    q_dtype="bf16", kv_dtype="bf16", arch="9.0a")
    assert {key for key, r in out.items() if r.ok} == {(b, k) for b in ("fa2", "fa3") for k in (
        "prefill", "ragged", "decode")}, {k: r.reason for k, r in out.items()}
    assert "_fa3_prefill_" in out["fa3", "decode"].uri and out["fa3", "decode"].uri == out["fa3", "prefill"].uri
    assert "_fa3_ragged_" in out["fa3", "ragged"].uri and "_fa2_decode_" in out["fa2", "decode"].uri
    wide = variantgen.probe(spec_name, head_dim_qk=512, q_dtype="bf16", kv_dtype="bf16", arch="9.0a")
    assert not wide and "support head dims 64, 128, 256" in wide.reason


def test_negative_results_are_memoized(monkeypatch):
    _no_gpu(monkeypatch)
    r1 = probe(MM, **BASE)
    assert not r1 and probe(MM, **BASE) is r1


def test_environment_change_is_a_new_combination(clean, fake_build):
    clean.set(VARIANTGEN_DISABLE_JIT="1")
    assert not probe(MM, **BASE, arch="9.0a")
    clean.set(VARIANTGEN_DISABLE_JIT=None)
    assert probe(MM, **BASE, arch="9.0a")


def test_lock_timeout_is_not_memoized(monkeypatch, fake_build):
    real = build.build_module
    attempts = []

    def flaky(config, cache, **kwargs):
        attempts.append(kwargs["lock_timeout"])
        if len(attempts) == 1:
            raise LockTimeout("timed out", uri="vg_x", holder=LockHolder(4242, "box", time.time() - 7), waited=5.0)
        return real(config, cache, **kwargs)

    monkeypatch.setattr(build, "build_module", flaky)
    r1 = probe(MM, **BASE, arch="9.0a")
    assert not r1 and r1.reason.startswith("module vg_mm_prefix_fa2_prefill_") and r1.details["building_pid"] == 4242
    assert " is being built by pid 4242 on box since " in r1.reason
    assert "probe again when that build is done" in r1.reason
    r2 = probe(MM, **BASE, arch="9.0a")
    assert r2, r2.reason
    assert attempts == [probe_mod.PROBE_LOCK_WAIT_S] * 2  # a short wait, never VARIANTGEN_LOCK_TIMEOUT


def test_edited_spec_file_is_a_new_combination(tmp_path, fake_build):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nmask: kv_pos <= q_pos\n")
    assert probe(spec, **BASE, arch="9.0a")
    spec.write_text("name: s\nmask: kv_pos <= qq_pos   # broken\n")
    assert not probe(spec, **BASE, arch="9.0a")


# ----------------------------------------------------------------------------- relocatable


def test_precompiled_cache_is_relocatable(clean, tmp_path, monkeypatch):
    """A cache built on a build box (other toolchain, other path), copied to a server with JIT
    disabled and no nvcc, is found by its inputs."""
    box = Cache(tmp_path / "build-box-cache")
    cfg = mm_config()
    entry = publish_fake(box, cfg, toolchain_parts=(("nvcc", "V12.8.93"), ("cxx", "g++ 11.4.0")))
    assert entry.manifest["inputs_digest"] == build.module_key(render_module(cfg), None).inputs_digest
    served = tmp_path / "served" / "cache"
    shutil.copytree(box.root, served)
    shutil.rmtree(box.root)

    def no_nvcc():
        raise build.ToolchainError("nvcc not found")

    monkeypatch.setattr(build, "toolchain", no_nvcc)
    clean.set(VARIANTGEN_DISABLE_JIT="1")
    r = probe(MM, **BASE, arch="9.0a", cache_dir=served)
    assert r, r.reason
    assert r.source == "cache" and r.uri == entry.uri
    assert Path(r.module_path) == served / entry.uri / f"{entry.uri}.so"

    # With a local nvcc (another version) and JIT disabled, the same entry is still used.
    probe_mod.cache_clear()
    monkeypatch.setattr(build, "toolchain", lambda: FAKE_TC)
    r2 = probe(MM, **BASE, arch="9.0a", cache_dir=served)
    assert r2 and r2.uri == entry.uri and r2.source == "cache"


def test_row_planner_status_is_reported_never_a_failure(clean, fake_build):
    """plan()'s planner module: built by make_wrapper, cached, or (JIT disabled, not precompiled)
    none - plans run planner-off, slower kernels, so the probe still says yes (and says why)."""
    from variantgen.planning.rowplan import PlannerConfig

    r = probe(MM, **BASE, arch="9.0a")
    assert r and r.details["row_planner"].startswith("built by make_wrapper on first use: vg_mm_prefix_planner_sm90a_")
    publish_fake(Cache(clean.cache_dir), mm_config())
    probe_mod.cache_clear()
    clean.set(VARIANTGEN_DISABLE_JIT="1")
    r = probe(MM, **BASE, arch="9.0a")
    assert r and r.details["row_planner"].startswith(
        "planner off (one custom launch per request: the mask on every element, slower kernels): "
        "vg_mm_prefix_planner_sm90a is not precompiled")
    publish_fake(Cache(clean.cache_dir), PlannerConfig(variantgen.load_spec(MM), "9.0a"))
    probe_mod.cache_clear()
    r = probe(MM, **BASE, arch="9.0a")
    assert r and r.details["row_planner"].startswith("cached: vg_mm_prefix_planner_sm90a_")
    publish_fake(Cache(clean.cache_dir), mm_config(kind="decode"))
    r = probe(MM, **BASE, arch="9.0a", kind="decode")
    # CUDA-core decode's key trimming runs the planner module's row pass too
    assert r and r.details["row_planner"].startswith("cached: vg_mm_prefix_planner_sm90a_")


def test_cuda_graph_probe_follows_what_graph_mode_supports(monkeypatch):
    """cuda_graph=True answers for make_wrapper(graph=...): paged prefill and decode (fa3 on sm90,
    as without it)."""
    base = dict(BASE, backend=None)  # what make_wrapper picks
    auto = probe(MM, **base, arch="9.0a", build=False)
    assert auto.details["backend"] == "fa3" and not auto.details["cuda_graph"]
    r = probe(MM, **base, arch="9.0a", build=False, cuda_graph=True)
    assert r.details["backend"] == "fa3" and r.details["cuda_graph"]  # as make_wrapper picks with graph=
    assert r.reason.startswith("building disabled (build=False) and module vg_mm_prefix_fa3_prefill")
    r = probe(MM, **dict(base, backend="fa2"), arch="9.0a", build=False, cuda_graph=True)
    assert r.details["backend"] == "fa2" and r.reason.startswith("building disabled (build=False) and module "
                                                                 "vg_mm_prefix_fa2_prefill")
    r = probe(MM, **base, arch="9.0a", build=False, cuda_graph=True, kind="ragged")
    assert not r.ok and r.reason.startswith("cuda_graph=True: CUDA-graph mode is for kind 'prefill' and "
                                            "'decode' (got 'ragged')")
    r = probe(MM, **base, arch="9.0a", build=False, cuda_graph=True, kind="decode")
    assert r.details["backend"] == "fa2" and r.details["cuda_graph"]  # decode: fa2 first
    r = probe(MM, **dict(base, backend="fa3"), arch="9.0a", build=False, cuda_graph=True, kind="decode")
    assert r.details["backend"] == "fa3" and r.details["cuda_graph"]  # fa3 decode: its prefill module's graph mode
    assert r.reason.startswith("building disabled (build=False) and module vg_mm_prefix_fa3_prefill")
    _fake_gpu(monkeypatch, (8, 0))
    r = probe(MM, **base, build=False, cuda_graph=True, kind="decode")
    assert r.details["backend"] == "fa2" and r.reason.startswith("building disabled (build=False) and module "
                                                                 "vg_mm_prefix_fa2_decode")


# ----------------------------------------------------------------------------- backend=None with JIT off


@pytest.mark.parametrize("cached", [(), ("fa2",), ("fa3",), ("fa2", "fa3")])
@pytest.mark.usefixtures("host_modules")
def test_jit_off_serves_a_precompiled_fa2_module_when_fa3_is_missing(clean, monkeypatch, cached):
    """backend=None on sm90 prefers fa3; a server that cannot build, whose cache has only the fa2
    module, serves that (and says so) instead of demoting the layer. make_wrapper(backend=None)
    makes the same choice (resolver.resolve, cache-aware where modules cannot be built)."""
    from _fake_kernel import FakeFa3Module, FakeModule


    cache = Cache(clean.cache_dir)
    for backend in cached:
        publish_fake(cache, mm_config(backend=backend))
    clean.set(VARIANTGEN_DISABLE_JIT="1")
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16")
    expected = "fa2" if cached == ("fa2",) else "fa3"
    assert r.details["backend"] == expected and bool(r) == bool(cached)
    if cached == ("fa2",):
        assert r.uri.startswith("vg_mm_prefix_fa2_prefill_") and r.details["note"] == (
            f"the fa3 module vg_mm_prefix_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_* is not precompiled in "
            f"{clean.cache_dir}; using the precompiled fa2 module {r.uri} (correct, slower; precompile the fa3 "
            "module to serve fa3)")
    else:
        assert "note" not in r.details
    if not cached:
        assert "_fa3_prefill_" in r.reason  # the module to precompile is the preferred one
        return
    spec = variantgen.load_spec(MM)

    def load(entry):
        backend = entry.manifest["config"]["backend"]
        return (FakeFa3Module if backend == "fa3" else FakeModule)(spec)

    monkeypatch.setattr(build, "load_module", load)
    w = variantgen.make_wrapper(MM, torch.empty(1 << 20, dtype=torch.uint8), head_dim_qk=128, q_dtype="bf16",
                                kv_dtype="bf16", arch="9.0a")
    assert w.config.backend == expected and w.uri == r.uri


def test_jit_on_builds_the_preferred_fa3_module(clean, fake_build):
    publish_fake(Cache(clean.cache_dir), mm_config(backend="fa2"))
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16")
    assert r and r.details["backend"] == "fa3" and r.source == "built" and "note" not in r.details
    probe_mod.cache_clear()
    r = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", build=False)
    assert r and r.details["backend"] == "fa3" and r.source == "cache"


# ----------------------------------------------------------------------------- another process's build


def test_a_build_in_another_process_is_reported_not_waited_for(clean, tmp_path, monkeypatch, fake_build):
    """A stuck builder holding the module's lock: probe() answers within PROBE_LOCK_WAIT_S,
    naming the holder, and does not memoize it (the next probe, once the lock is free, builds)."""
    monkeypatch.setattr(probe_mod, "PROBE_LOCK_WAIT_S", 0.5)
    uri = _expected_uri(mm_config())
    ready = tmp_path / "ready"
    holder = multiprocessing.get_context("spawn").Process(
        target=procs.hold_lock, args=(str(clean.cache_dir), uri, str(ready)), daemon=True)
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "the lock holder did not start"
            time.sleep(0.02)
        t0 = time.monotonic()
        r = probe(MM, **BASE)
        waited = time.monotonic() - t0
        assert not r and 0.4 < waited < 5
        assert r.reason.startswith(f"module {uri} is being built by pid {holder.pid} on ")
        assert f"(lock {clean.cache_dir / '.locks' / (uri + '.lock')}); probe() waits 0.5s at most" in r.reason
        assert "probe again when that build is done" in r.reason and r.details["building_pid"] == holder.pid
        assert fake_build == []
    finally:
        procs.kill(holder.pid)
        holder.join(30)
    r = probe(MM, **BASE)
    assert r and r.source == "built" and fake_build == [uri]


def test_full_disk_is_a_reason_naming_the_path(clean, monkeypatch):
    """ENOSPC while building gave `internal error: OSError: [Errno 28] No space left on device`."""
    import errno

    monkeypatch.setattr(build, "flashinfer_info", lambda: procs.FAKE_FLASHINFER)
    real_write_text = Path.write_text

    def write_text(self, *args, **kwargs):
        if ".staging" in self.parts:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    r = probe(MM, **BASE)
    assert not r and r.reason.startswith(f"cannot write {clean.cache_dir / '.staging'}/")
    assert "/src/" in r.reason and r.reason.endswith(": No space left on device (free space on that file system)")
    assert list((clean.cache_dir / ".staging").iterdir()) == [] and list((clean.cache_dir / ".locks").iterdir()) == []
    monkeypatch.setattr(Path, "write_text", real_write_text)  # space freed: not memoized
    monkeypatch.setattr(build, "_build_locked", lambda rendered, key, tc, cache, jobs, progress=None:
                        publish_fake(cache, rendered.config, tc))
    assert probe(MM, **BASE)


def test_every_answer_names_its_row_planner(vg_env, clean, fake_build):
    """docs/serving.md has engines log details["row_planner"]: every backend's and kind's answer
    has it (the flex route's and ragged modules' lacked the key)."""
    ragged = probe(MM, **BASE, kind="ragged", arch="9.0a")
    assert ragged, ragged.reason
    assert ragged.details["row_planner"] == ("none: ragged modules have no interval planner (the mask on every "
                                             "tile)")

