"""The capability table and the resolver: every decision, table-driven against rules written
out plainly here; the names (dtypes, archs); the flex route's wiring (a stand-in module in
place of variantgen.wrappers.flex_wrapper); and probe / make_wrapper / the command line agreeing with
the resolver on a fake GPU."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import itertools
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import SPECS_DIR

import variantgen
from variantgen.api.probing import probe
from variantgen.build import builder as build
from variantgen.routing import capabilities
from variantgen.routing.capabilities import (
    KINDS,
    TABLE,
    Request,
    Site,
    canonical_arch,
    canonical_dtype,
    graph_problem,
)
from variantgen.routing.resolver import choose_backend, resolve
from variantgen.tools.cli import main

FAKE_TC = build.Toolchain(Path("/opt/fake-cuda"), Path("/opt/fake-cuda/bin/nvcc"), "V13.0.88", "/usr/bin/c++",
                          "c++ (fake) 12.2.0")


def shipped(name: str):
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


MM = shipped("mm_prefix")

# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("9.0a", "9.0a"), ("90a", "9.0a"), ("sm_90a", "9.0a"), ("sm90a", "9.0a"), ("SM_90A", "9.0a"),
        ("compute_90a", "9.0a"), ("8.0", "8.0"), ("80", "8.0"), ("sm_86", "8.6"), ("10.0a", "10.0a"),
        ("100a", "10.0a"), ("sm_120f", "12.0f"), (" 8.9 ", "8.9"), ("09.0", "9.0"),
    ],
)
def test_canonical_arch(value, expected):
    assert canonical_arch(value) == expected


@pytest.mark.parametrize("value", ["", "9", "sm_9", "9.x", "x.0", "9.0.1", "hopper", "9.0b", "a"])
def test_canonical_arch_rejects(value):
    with pytest.raises(ValueError, match=re.escape(f"arch={value!r}: expected a compute capability")):
        canonical_arch(value)


def test_the_gpu_arch_of_a_capability():
    assert [capabilities.arch_of_capability(*c) for c in ((9, 0), (8, 6), (8, 0), (10, 0), (12, 0))] == [
        "9.0a", "8.6", "8.0", "10.0a", "12.0a"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), ("BF16", "bf16"),
        ("half", "fp16"), ("float16", "fp16"), ("fp8", "fp8_e4m3"), ("float8_e4m3fn", "fp8_e4m3"),
        ("e5m2", "fp8_e5m2"), ("torch.float8_e5m2", "fp8_e5m2"), ("float32", "fp32"), ("fp32", "fp32"),
    ],
)
def test_canonical_dtype(value, expected):
    assert canonical_dtype(value, "q_dtype") == expected


def test_canonical_dtype_of_torch_dtypes():
    assert canonical_dtype(torch.bfloat16, "q") == "bf16"
    assert canonical_dtype(torch.float16, "q") == "fp16"
    assert canonical_dtype(torch.float8_e4m3fn, "kv") == "fp8_e4m3"
    assert canonical_dtype(torch.float32, "q") == "fp32"  # a name; the flex route takes it, modules do not
    with pytest.raises(ValueError) as info:
        canonical_dtype(torch.float64, "kv_dtype")
    assert str(info.value) == ("kv_dtype=torch.float64: unsupported dtype; expected one of "
                               "['bf16', 'fp16', 'fp32', 'fp8_e4m3', 'fp8_e5m2']")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(head_dim_qk="128"), "head_dim_qk='128': expected a whole number > 0 (the module backends take "
                              "64/128/192/256)"),
    (dict(head_dim_qk=0), "head_dim_qk=0: expected a whole number > 0"),
    (dict(head_dim_qk=True), "head_dim_qk=True: expected a whole number > 0"),
    (dict(head_dim_vo=-1), "head_dim_vo=-1: expected a whole number > 0"),
    (dict(q_dtype=object()), "q_dtype=<object object at"),
    (dict(backend="cudnn"), "backend='cudnn': expected one of ['fa2', 'fa3', 'flex'] (or None: the resolver's "
                            "choice)"),
    (dict(backend=["fa2"]), "backend=['fa2']: expected one of"),
    (dict(kind="append"), "kind='append': expected one of ['prefill', 'ragged', 'decode']"),
    (dict(kind=["prefill"]), "kind=['prefill']: expected one of"),
    (dict(tensor_cores=True), "use_tensor_cores=True: only for kind='decode' (got kind='prefill')"),
])
def test_malformed_requests_name_the_argument(kwargs, message):
    args = dict(head_dim_qk=128, q_dtype="bf16")
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        Request.of(MM, **args)
    assert message in str(e.value)


def test_a_request_defaults_to_its_query_counterparts():
    r = Request.of(MM, head_dim_qk=192, q_dtype=torch.float16)
    assert (r.head_dim_vo, r.kv_dtype, r.o_dtype, r.kind, r.backend, r.graph) == (192, "fp16", "fp16", "prefill",
                                                                                    None, False)
    assert Request.of(MM, head_dim_qk=128, q_dtype="bf16", kind="decode", tensor_cores=True).module_kind() == "prefill"


# ----------------------------------------------------------------------------- the table


def test_the_table_is_the_one_description_of_the_backends():
    assert tuple(TABLE) == ("fa3", "fa2", "flex")  # the order backend=None prefers them
    assert capabilities.BACKENDS == ("fa2", "fa3", "flex") and capabilities.MODULE_BACKENDS == ("fa2", "fa3")
    assert capabilities.HEAD_DIMS == {
        ("fa2", "prefill"): ((64, 64), (128, 128), (256, 256)),
        ("fa2", "ragged"): ((64, 64), (128, 128), (256, 256), (192, 128)),
        ("fa2", "decode"): ((64, 64), (128, 128), (256, 256)),
        ("fa3", "prefill"): ((64, 64), (128, 128), (256, 256)),
        ("fa3", "ragged"): ((64, 64), (128, 128), (256, 256), (192, 128)),
    }  # fa3 decode has no dims of its own: it runs the prefill module
    assert [b.name for b in TABLE.values() if b.decode_on_prefill] == ["fa3"]
    assert [b.module for b in TABLE.values()] == [True, True, False] and TABLE["flex"].route is not None
    # CUDA-graph mode is one field per backend: fa2 and fa3 paged prefill and decode
    assert {name: b.graph_kinds for name, b in TABLE.items()} == {"fa3": ("prefill", "decode"),
                                                                 "fa2": ("prefill", "decode"), "flex": ()}
    assert variantgen.lang.values.BACKENDS is capabilities.BACKENDS  # spec files name the same backends


def test_graph_problems():
    assert graph_problem("fa2", "prefill") == "" and graph_problem("fa2", "decode") == ""
    assert graph_problem("fa3", "prefill", "cuda_graph=True") == ""  # a fixed launch set for a capacity
    assert graph_problem("fa3", "decode") == ""  # its prefill module's launch set
    assert graph_problem("flex", "prefill") == ("graph=: CUDA-graph mode needs backend 'fa3' or 'fa2' (got 'flex'): "
                                                "its plan() and run() read the batch on the host")
    assert graph_problem("flex", "decode") == ("graph=: CUDA-graph mode needs backend 'fa3' or 'fa2' (got 'flex'): "
                                               "its plan() and run() read the batch on the host")
    assert graph_problem("fa2", "ragged") == ("graph=: CUDA-graph mode is for kind 'prefill' and 'decode' (got "
                                              "'ragged'); ragged wrappers allocate their metadata per plan()")


# ----------------------------------------------------------------------------- every decision

KIND_DIMS = {"prefill": [(64, 64), (128, 128), (96, 96), (192, 128)], "ragged": [(128, 128), (192, 128), (96, 96)],
             "decode": [(256, 256), (96, 96)]}
DTYPES = [("bf16", "bf16", "bf16"), ("fp16", "fp16", "fp16"), ("bf16", "fp8_e4m3", "bf16"), ("bf16", "bf16", "fp16"),
          ("fp8_e4m3", "fp8_e4m3", "bf16"), ("fp32", "fp32", "fp32"), ("bf16", "bf16", "fp8_e5m2")]
ARCHS = ["8.0", "8.6", "9.0a", "10.0a", "7.5", None]  # None: no CUDA target (a CPU box)
CACHES = [(), ("fa2",), ("fa3",), ("fa2", "fa3")]


def plain_rules(backend: str, kind: str, dims: tuple[int, int], dtypes: tuple[str, str, str], arch: str | None,
                graph: bool, flex: bool) -> bool:
    """Whether ``backend`` serves the request, written out from the design notes, not the table."""
    q, kv, o = dtypes
    sixteen = ("bf16", "fp16")
    equal = dims in ((64, 64), (128, 128), (256, 256))
    dims_ok = equal or (kind == "ragged" and dims == (192, 128))  # 192/128: MLA ragged prefill only
    if backend == "fa3":  # every kind (decode on its prefill module), graph mode for paged kinds
        return (dims_ok and q in sixteen and kv == q and o == q and arch == "9.0a"
                and (not graph or kind in ("prefill", "decode")))
    if backend == "fa2":
        arch_ok = arch is not None and int(arch.split(".")[0]) >= 8
        return (dims_ok and q in sixteen and kv in (*sixteen, "fp8_e4m3", "fp8_e5m2") and o in sixteen and arch_ok
                and (not graph or kind in ("prefill", "decode")))
    return flex and q in (*sixteen, "fp32") and o in (*sixteen, "fp32") and not graph


def preferred_order(kind: str) -> tuple[str, ...]:
    """fa3 first, but fa2 for decode (fa3's decode measured 4x slower on the H200)."""
    return ("fa2", "fa3", "flex") if kind == "decode" else ("fa3", "fa2", "flex")


def expected_choice(backend: str | None, serves: dict[str, bool], can_build: bool,
                    cached: tuple[str, ...], kind: str = "prefill") -> str | None:
    if backend is not None:
        return backend if serves[backend] else None
    viable = [b for b in preferred_order(kind) if serves[b]]
    if not viable:
        return None
    if can_build or len(viable) == 1:
        return viable[0]
    for b in viable:
        if b == "flex" or b in cached:
            return b
    return viable[0]  # nothing usable: the preferred module is the one to precompile


def test_every_decision_follows_the_rules():
    """backend x kind x head dims x dtypes x arch x CUDA graph x JIT on/off x cache contents x
    flex installed: the choice, its module, its note and a reason for each backend not chosen."""
    checked = 0
    for (backend, kind, dtypes, arch, graph, can_build, cached, flex) in itertools.product(
            (None, "fa2", "fa3", "flex"), KINDS, DTYPES, ARCHS, (False, True), (True, False), CACHES, (False, True)):
        if can_build and cached:
            continue  # the cache is asked only where modules cannot be built
        for dims in KIND_DIMS[kind]:
            request = Request.of(MM, kind=kind, head_dim_qk=dims[0], head_dim_vo=dims[1], q_dtype=dtypes[0],
                                 kv_dtype=dtypes[1], o_dtype=dtypes[2], backend=backend, graph=graph)
            site = Site(arch=arch, modules=arch is not None, no_modules="no GPU here", can_build=can_build,
                        no_build="JIT disabled", lookup=lambda c, cached=cached: f"vg_{c.backend}_x" if c.backend in
                        cached else None, cache_root="/cache", routes=("flex",) if flex else ())
            r = resolve(request, site)
            serves = {b: plain_rules(b, kind, dims, dtypes, arch, graph, flex) for b in TABLE}
            label = (backend, kind, dims, dtypes, arch, graph, can_build, cached, flex)
            assert r.backend == expected_choice(backend, serves, can_build, cached, kind), (label, r)
            assert bool(r) == (r.backend is not None) and (r.reason == "") == bool(r), label
            named = [name for name, _ in r.rejected]
            assert all(why for _, why in r.rejected), (label, r.rejected)
            if graph and kind == "ragged":
                assert not r and r.problem.startswith("graph=: CUDA-graph mode is for kind") and not r.rejected
                continue
            considered = [backend] if backend else list(preferred_order(kind))
            assert named == [b for b in considered if b != r.backend], (label, named)
            if r.backend in ("fa2", "fa3"):
                c = r.config
                module_kind = "prefill" if (r.backend, kind) == ("fa3", "decode") else kind  # fa3 decode: prefill
                assert (c.backend, c.kind, c.arch, c.head_dim_qk, c.head_dim_vo) == (
                    r.backend, module_kind, arch, *dims), label
                assert (c.q_dtype, c.kv_dtype, c.o_dtype) == dtypes and c.mask_modes == ("none", "causal", "custom")
            else:
                assert r.config is None, label
            preferred = next((b for b in preferred_order(kind) if serves[b]), None) if backend is None else backend
            assert bool(r.note) == (r.backend is not None and r.backend != preferred), (label, r.note)
            checked += 1
    assert checked > 20_000


def test_tensor_core_decode_resolves_to_a_prefill_module():
    for tensor_cores in (True, False):  # fa3's decode is its prefill module either way
        request = Request.of(MM, kind="decode", head_dim_qk=128, q_dtype="bf16", tensor_cores=tensor_cores,
                             backend="fa3")
        r = resolve(request, Site(arch="9.0a"))
        assert r.backend == "fa3" and r.config.kind == "prefill" and r.config.backend == "fa3"
        # backend=None: fa2 first for decode (KIND_ORDER), its prefill module where tensor cores are asked for
        r = resolve(dataclasses.replace(request, backend=None), Site(arch="9.0a"))
        assert (r.backend, r.config.kind) == ("fa2", "prefill" if tensor_cores else "decode")
        assert dict(r.rejected)["fa3"] == "fa2 comes first"
        assert request.module_kind("fa3") == "prefill" and request.module_kind("flex") == (
            "prefill" if tensor_cores else "decode")
    r = resolve(Request.of(MM, kind="decode", head_dim_qk=128, q_dtype="bf16", tensor_cores=True), Site(arch="8.0"))
    assert r.backend == "fa2" and r.config.kind == "prefill"
    r = resolve(Request.of(MM, kind="decode", head_dim_qk=128, q_dtype="bf16"), Site(arch="8.0"))
    assert r.backend == "fa2" and r.config.kind == "decode"  # CUDA cores where fa3 cannot run
    r = resolve(Request.of(MM, kind="decode", head_dim_qk=96, q_dtype="bf16", backend="fa3"), Site(arch="9.0a"))
    assert r.reason == ("head_dim_qk=96, head_dim_vo=96: fa3 prefill modules support head dims 64, 128, 256 (qk/vo "
                        "where they differ) (its decode runs the prefill module)")


@pytest.mark.parametrize("kind, dims, module_kind", [
    ("ragged", (128, 128), "ragged"), ("ragged", (192, 128), "ragged"), ("decode", (128, 128), "prefill"),
    ("decode", (64, 64), "prefill")])
def test_fa3_serves_ragged_and_decode_on_sm90(kind, dims, module_kind):
    """On sm90: fa3's ragged module (MLA's 192/128 too; backend=None's choice) and, for decode
    (backend="fa3": fa2 comes first for decode), its paged prefill module; fa2's own module of the
    kind elsewhere."""
    request = Request.of(MM, kind=kind, head_dim_qk=dims[0], head_dim_vo=dims[1], q_dtype="bf16",
                         backend="fa3" if kind == "decode" else None)
    r = resolve(request, Site(arch="9.0a"))
    c = r.config
    assert r.backend == "fa3" and (c.backend, c.kind, c.head_dim_qk, c.head_dim_vo) == ("fa3", module_kind, *dims)
    assert c.uri_prefix.startswith(f"vg_mm_prefix_fa3_{module_kind}_")
    if kind == "ragged":
        assert dict(r.rejected)["fa2"] == "fa3 comes first"
    request = dataclasses.replace(request, backend=None)
    old = resolve(request, Site(arch="8.0"))
    assert old.backend == "fa2" and (old.config.backend, old.config.kind) == ("fa2", kind)
    assert dict(old.rejected)["fa3"] == ("arch=8.0: fa3 modules run on sm90 (Hopper) only, compiled for 9.0a "
                                         f"({capabilities.FA3.arch_why})")
    fp8 = Request.of(MM, kind=kind, head_dim_qk=dims[0], head_dim_vo=dims[1], q_dtype="bf16", kv_dtype="fp8_e4m3")
    why = "kv_dtype=fp8_e4m3: fa3 variant modules need kv_dtype == q_dtype (bf16); use backend fa2 for an fp8 KV cache"
    r = resolve(fp8, Site(arch="9.0a"))
    assert r.backend == "fa2" and r.config.kind == kind and dict(r.rejected)["fa3"] == why
    only = resolve(Request.of(MM, kind=kind, head_dim_qk=dims[0], head_dim_vo=dims[1], q_dtype="bf16",
                              kv_dtype="fp8_e4m3", backend="fa3"), Site(arch="9.0a"))
    assert not only and only.reason == why


def test_graph_mode_decode_on_sm90():
    r = resolve(Request.of(MM, kind="decode", head_dim_qk=128, q_dtype="bf16", graph=True), Site(arch="9.0a"))
    assert r.backend == "fa2" and r.config.kind == "decode" and r.note == ""  # fa2 first for decode
    r = resolve(Request.of(MM, kind="decode", head_dim_qk=128, q_dtype="bf16", graph=True, backend="fa3"),
                Site(arch="9.0a"))
    assert r.backend == "fa3" and (r.config.backend, r.config.kind) == ("fa3", "prefill") and r.note == ""
    r = resolve(Request.of(MM, kind="decode", head_dim_qk=128, q_dtype="bf16", graph=True), Site(arch="8.0"))
    assert r.backend == "fa2" and r.config.kind == "decode"
    r = resolve(Request.of(MM, kind="ragged", head_dim_qk=128, q_dtype="bf16", graph=True, backend="fa3"),
                Site(arch="9.0a"))
    assert not r and r.problem.startswith("graph=: CUDA-graph mode is for kind 'prefill' and 'decode' (got 'ragged')")


def test_the_reasons_a_backend_is_not_chosen():
    request = Request.of(MM, head_dim_qk=128, q_dtype="bf16")
    r = resolve(request, Site(arch="8.6"))
    assert r.backend == "fa2" and r.note == "" and r.rejected == (
        ("fa3", "arch=8.6: fa3 modules run on sm90 (Hopper) only, compiled for 9.0a "
        f"({capabilities.FA3.arch_why})"),
        ("flex", "the flex route (torch's FlexAttention, no compiled module) is not installed here "
                 "(variantgen.wrappers.flex_wrapper is missing)"))
    r = resolve(request, Site(arch="9.0a", routes=("flex",)))
    assert r.backend == "fa3" and dict(r.rejected) == {"fa2": "fa3 comes first", "flex": "fa3 comes first"}
    r = resolve(Request.of(MM, head_dim_qk=96, q_dtype="bf16"), Site(arch="9.0a"))
    assert not r and r.reason.splitlines() == [
        "no backend can run it here:",
        "  fa3: head_dim_qk=96, head_dim_vo=96: fa3 prefill modules support head dims 64, 128, 256 (qk/vo where they "
        "differ)",
        "  fa2: head_dim_qk=96, head_dim_vo=96: fa2 prefill modules support head dims 64, 128, 256 (qk/vo where they "
        "differ)",
        "  flex: the flex route (torch's FlexAttention, no compiled module) is not installed here "
        "(variantgen.wrappers.flex_wrapper is missing)"]
    assert r.why(lines=False).startswith("no backend can run it here: fa3: head_dim_qk=96") and "\n" not in r.why(
        lines=False)
    one = resolve(Request.of(MM, head_dim_qk=96, q_dtype="bf16", backend="fa2"), Site(arch="9.0a"))
    assert one.reason == ("head_dim_qk=96, head_dim_vo=96: fa2 prefill modules support head dims 64, 128, 256 "
                          "(qk/vo where they differ)")
    spec = variantgen.parse_spec("name: only_fa3\nmask: kv_pos <= q_pos\nbackends: [fa3]\n")
    r = resolve(Request.of(spec, head_dim_qk=128, q_dtype="bf16", kv_dtype="fp8_e4m3"), Site(arch="9.0a"))
    assert not r and dict(r.rejected)["fa2"] == "backend='fa2': spec `only_fa3` allows only ['fa3']"


def test_jit_off_notes_name_what_is_missing_and_what_serves():
    request = Request.of(MM, head_dim_qk=128, q_dtype="bf16")

    def site(cached, routes=()):
        return Site(arch="9.0a", can_build=False, no_build="JIT disabled by VARIANTGEN_DISABLE_JIT",
                    lookup=lambda c: f"{c.uri_prefix}_abc" if c.backend in cached else None, cache_root="/srv/cache",
                    routes=routes)

    r = resolve(request, site(("fa2",)))
    assert r.backend == "fa2" and r.note == (
        "the fa3 module vg_mm_prefix_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_* is not precompiled in "
        "/srv/cache; using the precompiled fa2 module vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_abc "
        "(correct, slower; precompile the fa3 module to serve fa3)")
    assert dict(r.rejected)["fa3"] == "not precompiled in /srv/cache and JIT disabled by VARIANTGEN_DISABLE_JIT"
    r = resolve(request, site((), ("flex",)))
    assert r.backend == "flex" and r.config is None and r.note == (
        "no precompiled fa3/fa2 module in /srv/cache and JIT disabled by VARIANTGEN_DISABLE_JIT: serving through "
        "torch's FlexAttention, no compiled module")
    r = resolve(request, site(()))
    assert r.backend == "fa3" and r.note == "" and r.config.backend == "fa3"  # the one to precompile
    assert dict(r.rejected)["fa2"] == "not precompiled in /srv/cache and JIT disabled by VARIANTGEN_DISABLE_JIT"
    asked = []
    resolve(request, Site(arch="9.0a", lookup=lambda c: asked.append(c) or None))
    assert asked == []  # JIT on: the cache is not consulted


@pytest.mark.parametrize(("overrides", "expected"), [
    ({}, "fa3"),
    ({"arch": "8.0"}, "fa2"),
    ({"arch": "10.0a"}, "fa2"),
    ({"kind": "decode"}, "fa2"),  # fa2 first for decode (capabilities.KIND_ORDER)
    ({"kind": "ragged"}, "fa3"),
    ({"kv_dtype": "fp8_e4m3"}, "fa2"),
    ({"head_dim_qk": 192, "head_dim_vo": 128, "kind": "ragged"}, "fa3"),
    ({"kind": "decode", "kv_dtype": "fp8_e4m3"}, "fa2"),
    ({"kind": "ragged", "arch": "8.0"}, "fa2"),
    ({"head_dim_qk": 192, "head_dim_vo": 128, "kind": "ragged", "kv_dtype": "fp8_e5m2"}, "fa2"),
    ({"o_dtype": "fp16"}, "fa2"),
    ({"q_dtype": "fp16", "kv_dtype": "fp16", "o_dtype": "fp16", "head_dim_qk": 64, "head_dim_vo": 64}, "fa3"),
])
def test_choose_backend(overrides, expected):
    kw = dict(kind="prefill", head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16",
              arch="9.0a")
    kw.update(overrides)
    assert choose_backend(MM, **kw) == expected


def test_choose_backend_respects_the_spec_and_says_when_nothing_serves(spec_from):
    spec = spec_from("name: only_fa2\nmask: kv_pos <= q_pos\nbackends: [fa2]\n")
    assert choose_backend(spec, kind="prefill", head_dim_qk=128, head_dim_vo=128, q_dtype="bf16",
                          kv_dtype="bf16", o_dtype="bf16", arch="9.0a") == "fa2"
    with pytest.raises(ValueError) as e:
        choose_backend(MM, kind="prefill", head_dim_qk=96, head_dim_vo=96, q_dtype="bf16", kv_dtype="bf16",
                       o_dtype="bf16", arch="9.0a")
    assert str(e.value).splitlines()[-1] == "  flex: choose_backend() picks among the module backends"


# ----------------------------------------------------------------------------- the flex route's wiring


@pytest.fixture
def flex_route(monkeypatch):
    """A stand-in for variantgen.wrappers.flex_wrapper (the flex route's module): records the calls of its
    factory and probe with make_wrapper's / probe()'s arguments."""
    calls: dict[str, list] = {"factory": [], "probe": []}
    module = types.ModuleType("variantgen.wrappers.flex_wrapper")
    module.__spec__ = importlib.machinery.ModuleSpec("variantgen.wrappers.flex_wrapper", loader=None)

    def make_flex_wrapper(spec, workspace, **kwargs):
        calls["factory"].append((spec.name, kwargs))
        return types.SimpleNamespace(backend="flex", spec=spec, **kwargs)

    def probe_flex(spec, **kwargs):
        calls["probe"].append((spec.name, kwargs))
        return {"ok": True, "reason": "", "details": {"checked": "ran a 2-request batch"}}

    module.make_flex_wrapper, module.probe_flex = make_flex_wrapper, probe_flex
    monkeypatch.setitem(sys.modules, "variantgen.wrappers.flex_wrapper", module)
    monkeypatch.setattr(capabilities, "installed_routes", lambda: ("flex",))
    return calls


@pytest.fixture
def machine(vg_env, monkeypatch):
    """No GPU, a fake toolchain, an empty probe memo."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(build, "toolchain", lambda: FAKE_TC)
    probe.cache_clear()
    yield vg_env
    probe.cache_clear()


def test_the_flex_route_is_found_without_importing_it():
    """variantgen/wrappers/flex_wrapper.py is the route's module: installed_routes() finds it, and asking
    imports neither it nor torch (probe's and make_wrapper's cheap paths stay cheap)."""
    import subprocess

    code = ("import sys, variantgen.routing.capabilities as c; print(c.installed_routes(), "
            "'variantgen.wrappers.flex_wrapper' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=SPECS_DIR.parent, env={"PYTHONPATH": str(SPECS_DIR.parent), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["('flex',)", "False", "False"]


def test_flex_serves_where_no_module_can(flex_route, machine):
    """A CPU box: make_wrapper(backend=None) and probe() take the flex route; its factory and
    probe get the request's canonical arguments."""
    w = variantgen.make_wrapper("mm_prefix", torch.empty(0, dtype=torch.uint8), head_dim_qk=96, q_dtype=torch.float32,
                                kv_dtype="fp32", kind="ragged")
    assert w.backend == "flex" and flex_route["factory"] == [("mm_prefix", dict(
        head_dim_qk=96, head_dim_vo=96, q_dtype="fp32", kv_dtype="fp32", o_dtype="fp32", kind="ragged",
        kv_layout="NHD", use_tensor_cores=False, graph=None))]
    r = probe("mm_prefix", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind="decode")
    assert r and r.source == "torch" and r.uri is None and r.details["backend"] == "flex"
    assert r.details["checked"] == "ran a 2-request batch"
    assert r.details["not_chosen"]["fa2"].startswith("no CUDA device visible: probe() answers")
    assert flex_route["probe"] == [("mm_prefix", dict(head_dim_qk=128, head_dim_vo=128, q_dtype="bf16",
                                                      kv_dtype="bf16", o_dtype="bf16", kind="decode", device=None,
                                                      cuda_graph=False, page_size=None))]
    # named explicitly, a module backend still says why not
    r = probe("mm_prefix", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="fa2")
    assert not r and r.reason.startswith("no CUDA device visible")
    # and CUDA-graph mode is no flex feature
    r = probe("mm_prefix", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", cuda_graph=True)
    assert not r and r.reason.startswith("no CUDA device visible")
    with pytest.raises(ValueError, match="graph=: CUDA-graph mode needs backend 'fa3' or 'fa2' \\(got 'flex'\\)"):
        variantgen.make_wrapper("mm_prefix", torch.empty(0, dtype=torch.uint8), head_dim_qk=128, q_dtype="bf16",
                                kv_dtype="bf16", graph=object(), backend="flex")


def test_jit_off_without_precompiled_modules_serves_through_flex(flex_route, machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    machine.set(VARIANTGEN_DISABLE_JIT="1")
    r = probe("mm_prefix", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16")
    assert r and r.details["backend"] == "flex" and r.details["note"] == (
        f"no precompiled fa3/fa2 module in {machine.cache_dir} and JIT disabled by VARIANTGEN_DISABLE_JIT: serving "
        "through torch's FlexAttention, no compiled module")
    # a cache check asks about modules only
    check = probe("mm_prefix", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", runtime=False)
    assert not check and check.details["backend"] == "fa3" and "is not precompiled" in check.reason
    assert flex_route["probe"] and len(flex_route["probe"]) == 1


# ----------------------------------------------------------------------------- the callers agree


@pytest.fixture
def gpu(machine, monkeypatch):
    """A fake GPU whose capability the test sets (``gpu.on``); builds publish dummy modules,
    which 'load' as plain objects."""
    from test_probe import publish_fake

    monkeypatch.setattr(capabilities, "installed_routes", lambda: ())  # the module routes (flex: above)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "load_module", lambda entry: object())
    monkeypatch.setattr(build, "_build_locked", lambda rendered, key, tc, cache, jobs, progress=None:
                        publish_fake(cache, rendered.config, tc))

    def on(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    machine.on, machine.publish = on, lambda cache, config: publish_fake(cache, config, FAKE_TC)
    return machine


AGREEMENT = [  # (capability, kind, head dims, q / kv dtypes, graph)
    ((9, 0), "prefill", (128, 128), ("bf16", "bf16"), False),
    ((9, 0), "prefill", (128, 128), ("bf16", "fp8_e4m3"), False),
    ((9, 0), "prefill", (64, 64), ("fp16", "fp16"), True),
    ((9, 0), "ragged", (192, 128), ("bf16", "bf16"), False),
    ((9, 0), "decode", (128, 128), ("fp16", "fp8_e5m2"), False),
    ((9, 0), "decode", (128, 128), ("bf16", "bf16"), True),  # fa3: its prefill module, in graph mode
    ((9, 0), "ragged", (64, 64), ("fp16", "fp16"), False),
    ((8, 6), "prefill", (256, 256), ("bf16", "bf16"), False),
    ((8, 0), "decode", (64, 64), ("bf16", "bf16"), True),
    ((10, 0), "prefill", (128, 128), ("bf16", "bf16"), False),  # Blackwell: fa2 (fa3 is sm90-only)
    ((10, 0), "decode", (128, 128), ("bf16", "fp8_e4m3"), True),
    ((12, 0), "prefill", (128, 128), ("fp16", "fp16"), True),
    ((12, 0), "ragged", (192, 128), ("bf16", "bf16"), False),
]


@pytest.mark.parametrize("capability, kind, dims, dtypes, graph", AGREEMENT)
@pytest.mark.parametrize("cached", [(), ("fa2",), ("fa3",), ("fa2", "fa3")])
@pytest.mark.parametrize("jit", ["on", "off"])
@pytest.mark.usefixtures("host_modules")
def test_probe_make_wrapper_and_the_command_agree_with_the_resolver(gpu, capability, kind, dims, dtypes, graph,
                                                                    cached, jit):
    """The same request on the same machine: probe's backend and note, `variantgen probe`'s,
    and the module make_wrapper wraps are the resolver's."""
    from variantgen.api.factory import module_site
    from variantgen.build.cache import Cache
    from variantgen.planning.graph import GraphCapacity

    gpu.on(capability)
    if jit == "off":
        gpu.set(VARIANTGEN_DISABLE_JIT="1")
    cache = Cache(gpu.cache_dir)
    arch = capabilities.arch_of_capability(*capability)
    request = Request.of(MM, kind=kind, head_dim_qk=dims[0], head_dim_vo=dims[1], q_dtype=dtypes[0],
                         kv_dtype=dtypes[1], graph=graph)
    for backend in cached:
        r = resolve(Request.of(MM, kind=kind, head_dim_qk=dims[0], head_dim_vo=dims[1], q_dtype=dtypes[0],
                               kv_dtype=dtypes[1], backend=backend), Site(arch=arch))
        if r:
            gpu.publish(cache, r.config)
    expected = resolve(request, module_site(arch, cache, build=True))
    assert expected, expected.reason

    args = dict(head_dim_qk=dims[0], head_dim_vo=dims[1], q_dtype=dtypes[0], kv_dtype=dtypes[1], kind=kind)
    answer = probe(MM, **args, cuda_graph=graph)
    assert answer.details.get("backend") == expected.backend and answer.details.get("note", "") == expected.note
    assert bool(answer) == (jit == "on" or expected.backend in cached), answer.reason  # JIT on: built

    out = CliRunner().invoke(main, ["probe", MM.path, "--head-dim", str(dims[0]), "--head-dim-vo", str(dims[1]),
                                    "--dtype", dtypes[0], "--kv-dtype", dtypes[1], "--kind", kind, "--json",
                                    *(["--cuda-graph"] if graph else [])])
    assert f'"backend": "{expected.backend}"' in out.stdout, out.output

    if answer:
        capacity = GraphCapacity(max_batch_size=4, max_total_q=64, max_kv_pages=64) if graph else None
        w = variantgen.make_wrapper(MM, torch.empty(1 << 20, dtype=torch.uint8), **args, arch=arch, graph=capacity)
        assert w.config == expected.config and w.uri == answer.uri


def test_a_cache_check_of_the_flex_route_says_it_has_no_module(flex_route, machine):
    r = probe("mm_prefix", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", backend="flex", runtime=False,
              arch="9.0a")
    assert not r and r.reason == "runtime=False checks the module cache; the flex route has no module"


def test_a_route_is_installed_only_inside_this_package(tmp_path, monkeypatch):
    """A module of the route's name elsewhere on the path (another checkout, an editable
    install's finder) is not this variantgen's route."""
    from variantgen.routing.capabilities import Route

    assert Route("variantgen.lang.evaluate", "Evaluator", "x").installed()  # a file of the package
    assert not Route("variantgen.no_such_route", "f", "p").installed()
    elsewhere = tmp_path / "variantgen_elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stray_route.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    assert importlib.util.find_spec("stray_route") is not None
    assert not Route("variantgen.stray_route", "f", "p").installed()


def test_probe_takes_tensor_core_decode_as_make_wrapper_does(tmp_path):
    """probe(kind="decode", use_tensor_cores=True) answers for the module make_wrapper then loads
    (the fa2 prefill module, one query per request; with backend="fa3" on sm90 fa3's prefill module,
    with or without the flag), and refuses the flag for another kind."""
    spec = variantgen.resolve_spec("mm_prefix")
    probe.cache_clear()
    r = probe(spec, kind="decode", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", use_tensor_cores=True,
              runtime=False, arch="8.0", cache_dir=tmp_path)
    assert not r and r.details["backend"] == "fa2"
    assert "vg_mm_prefix_fa2_prefill_qbf16_kvbf16_obf16_hd128x128_sm80_" in r.reason  # the prefill module
    plain = probe(spec, kind="decode", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", runtime=False, arch="8.0",
                  cache_dir=tmp_path)
    assert "vg_mm_prefix_fa2_decode_" in plain.reason
    for tensor_cores in (True, False):
        r = probe(spec, kind="decode", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", use_tensor_cores=tensor_cores,
                  runtime=False, arch="9.0a", cache_dir=tmp_path, backend="fa3")
        assert not r and r.details["backend"] == "fa3"
        assert "vg_mm_prefix_fa3_prefill_qbf16_kvbf16_obf16_hd128x128_sm90a_" in r.reason, r.reason
    r = probe(spec, kind="prefill", head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", use_tensor_cores=True)
    assert not r and r.reason == "use_tensor_cores=True: only for kind='decode' (got kind='prefill')"


@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (12, 0), (12, 1)])
@pytest.mark.parametrize("kind", ["prefill", "ragged", "decode"])
@pytest.mark.usefixtures("host_modules")
def test_blackwell_runs_fa2_and_says_why_not_fa3(gpu, capability, kind):
    """sm100 / sm120 (no Blackwell GPU was lent to run on: the answers, not the kernels, are
    tested): modules for the arch-specific target (10.0a, 12.0a, as `precompile --arch 10.0a`
    builds them), fa2 chosen, fa3 refused with the reason - probe, its command and the resolver."""
    arch = capabilities.arch_of_capability(*capability)
    assert arch == f"{capability[0]}.{capability[1]}a"
    gpu.on(capability)
    why = (f"arch={arch} (the visible GPU's): fa3 modules run on sm90 (Hopper) only, compiled for 9.0a "
           f"(FlashInfer's FA3 kernel is sm90-only (wgmma); Blackwell (sm100 / sm120) and sm80 / sm89 run fa2)")
    answer = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind=kind)
    assert answer and answer.details["backend"] == "fa2", answer.reason
    assert f"_sm{arch.replace('.', '')}_" in answer.uri
    forced = probe(MM, head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16", kind=kind, backend="fa3")
    assert not forced and why in forced.reason, forced.reason
    out = CliRunner().invoke(main, ["probe", MM.path, "--head-dim", "128", "--dtype", "bf16", "--kind", kind,
                                    "--backend", "fa3"])
    assert out.exit_code != 0 and "sm90-only" in out.output, out.output
    r = resolve(Request.of(MM, kind=kind, head_dim_qk=128, q_dtype="bf16"), Site(arch=arch))
    assert r.backend == "fa2" and dict(r.rejected)["fa3"].endswith(f"({capabilities.FA3.arch_why})")
