"""The interval planner's generated row kernel (variantgen/planning/rowplan.py) on the CPU: what it
renders for every shipped spec, its cache identity, planner-off plans without it, and a real
nvcc build. Its results are compared with the reference rules (rowrules.py) on the GPU
(tests/gpu/test_gpu_planner.py)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import ALL_SPECS, SPECS_DIR

import variantgen
from variantgen.build import builder as build
from variantgen.build.builder import rendered_sources
from variantgen.build.cache import Cache
from variantgen.codegen import expressions as codegen
from variantgen.codegen import render
from variantgen.planning.intervals import analyze
from variantgen.planning.rowplan import PlannerConfig, load_planner, planner_configs, render_planner


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def spec(name: str) -> variantgen.VariantSpec:
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


@pytest.mark.parametrize("name", ALL_SPECS)
def test_every_shipped_spec_renders_its_terms(name):
    s = spec(name)
    form = analyze(s)
    assert form.planner_ready, form.reason
    rendered = render_planner(PlannerConfig(s, "9.0a"))
    text = rendered.files["planner.cu"]
    assert rendered.compile_units == ("planner.cu",) and rendered.host_sources == ()
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_rows, PlanRows);" in text
    # one block per interval term, each with its description as a comment
    assert len(re.findall(r"\{  // term \d+: ", text)) == len(form.terms)
    for t in form.terms:
        assert codegen.comment_text(t.describe()) in text
    # exactly the spec arguments the intervals read reach the kernel
    names = {a.name for a in rendered.tensor_args} | {a.name for a in rendered.scalar_args}
    for arg in [t.name for t in s.tensors] + [x.name for x in s.scalars]:
        assert (f"p.spec.{arg}" in text) == (arg in names), arg
    assert ("sorted_flags_kernel" in text) == any(t.sorted_eqs for t in form.terms)
    assert text == render_planner(PlannerConfig(s, "9.0a")).files["planner.cu"]  # pure
    assert "{{" not in text and "{%" not in text


def test_identity_depends_on_spec_and_arch_only():
    mm = PlannerConfig(spec("mm_prefix"), "9.0a")
    assert mm.uri_prefix == "vg_mm_prefix_planner_sm90a"
    assert PlannerConfig(spec("mm_prefix"), "8.0").uri_prefix == "vg_mm_prefix_planner_sm80"
    configs = [render.ModuleConfig(spec("mm_prefix"), hd, hd, dt, dt, dt, "9.0a", be)
               for hd in (64, 128) for dt in ("bf16", "fp16") for be in ("fa2", "fa3")]
    configs.append(render.ModuleConfig(spec("mm_prefix"), 128, 128, "bf16", "bf16", "bf16", "9.0a", "fa2",
                                       kind="decode"))
    assert [p.uri_prefix for p in planner_configs(configs)] == ["vg_mm_prefix_planner_sm90a"]
    key = build.module_key(rendered_sources(mm), None)
    assert dict(key.inputs)["templates"] == render.template_digest("planner")
    assert key.uri != build.module_key(PlannerConfig(spec("causal"), "9.0a").render(), None).uri


def test_template_change_changes_the_key(template_copy):
    cfg = PlannerConfig(spec("causal"), "9.0a")
    before = build.module_key(rendered_sources(cfg), None).uri
    path = template_copy / "planner" / "planner.cu.jinja"
    path.write_text(path.read_text() + "\n// changed\n")
    render._template_digest.cache_clear()
    render._environment.cache_clear()
    assert build.module_key(rendered_sources(cfg), None).uri != before


def test_spec_without_intervals_has_no_planner(spec_from):
    s = spec_from('name: per_head\nmask: "qo_head == 0 or kv_pos <= q_pos"\n')
    with pytest.raises(ValueError, match="no usable key intervals"):
        render_planner(PlannerConfig(s, "9.0a"))
    module, why = load_planner(s, "9.0a", Cache("/nonexistent"))
    assert module is None and "no usable key intervals" in why


def test_jit_disabled_without_a_cached_planner_falls_back_with_a_reason(vg_env, caplog):
    vg_env.set(VARIANTGEN_DISABLE_JIT="1")
    module, why = load_planner(spec("mm_prefix"), "9.0a", Cache(vg_env.cache_dir))
    assert module is None and "not precompiled" in why and "vg_mm_prefix_planner_sm90a" in why
    assert "run planner-off" in caplog.text


def test_without_a_planner_module_plan_runs_planner_off_and_says_why():
    from test_run_checks_cpu import assert_reference
    from test_wrapper_cpu import batch_of, make

    w, _ = make(spec("mm_prefix"), planner_module=False)
    b = batch_of([5, 40], [5, 60], 4)
    args = {"ranges": torch.full((45, 2), -1, dtype=torch.int32)}
    plan = w.plan(*b.plan_args(), **args)
    assert w.row_planner is None and plan.planner == "off" and plan is w.last_plan
    assert w.plan_stats == {"launches": [("custom", 2)],
                            "planner_off": "no planner module (a CPU wrapper): one custom launch per request"}
    assert "planner off: no planner module (a CPU wrapper)" in str(plan)
    assert_reference(w.spec, w.run(b.q, (b.k_cache, b.v_cache), **args), b, args)


@pytest.mark.nvcc
def test_real_build_of_a_planner(vg_env, toolchain):
    cache = Cache(vg_env.cache_dir)
    cfg = PlannerConfig(spec("document"), "9.0a")  # the sorted-id pass and a binary search
    result = build.build_module(cfg, cache)
    assert result.built and result.entry.module_path.read_bytes()[:4] == b"\x7fELF"
    assert result.entry.manifest["config"] == cfg.describe()
    again = build.build_module(cfg, cache)
    assert not again.built and again.entry.uri == result.entry.uri


INT_FORMS = """
name: ints
tensors:
  qt: {dtype: int32, shape: [total_q, 2]}
  b: {dtype: int32, shape: [8]}
scalars:
  w: {dtype: int, default: 3}
  enabled: {dtype: bool, default: true}
mask: "kv_pos >= max(q_pos - w, 0) and kv_pos <= min(q_pos + abs(w), q_pos // 2 + q_pos % 3 + b[w])
  and (enabled if bit(q_pos, 1) else qt[q_row + 1, 0] > 0)
  and kv_pos // 4 == (q_pos if float(q_pos) > 2.5 else q_pos - 1) // 4"
"""


@pytest.mark.nvcc
def test_real_build_of_a_planner_with_every_int_form(vg_env, toolchain, spec_from):
    """The row kernel reads ints as int64 (codegen.Target.wide_ints): every helper the language
    has takes them (min, max, abs, //, %, bit, a clamped index, an offset row, float())."""
    cfg = PlannerConfig(spec_from(INT_FORMS), "9.0a")
    text = render_planner(cfg).files["planner.cu"]
    assert "vg_min((int64_t(q_pos) + vg_abs(int64_t(arg_w)))" in text
    result = build.build_module(cfg, Cache(vg_env.cache_dir))
    assert result.built and result.entry.module_path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.nvcc
def test_planner_schedule_is_one_cta_per_query_tile(vg_env, toolchain):
    """The planner module's host scheduler (no GPU needed): FlashInfer's PrefillPlanInfo layout
    with one work item per (launch request, query tile) and o_indptr = the rows given."""
    module = build.load_module(build.build_module(PlannerConfig(spec("causal"), "9.0a"), Cache(vg_env.cache_dir)).entry)
    pinned = torch.full((1 << 16,), 0xAB, dtype=torch.uint8)
    qo = torch.tensor([0, 300, 300, 1000, 1001], dtype=torch.int32)  # lengths 300, 0, 700, 1
    o_rows = torch.tensor([5, 400, 700, 1500, 9000], dtype=torch.int32)
    info = list(module.schedule(pinned, 0, qo, o_rows, 32, 8, 128, 128, 2, 0))
    nbytes = info.pop()
    assert len(info) == 15
    tiles, total_rows, cta = info[0], info[1], info[3]
    assert cta == 128 and total_rows == 1001  # packed average (4 heads per group) > 64: 128-row tiles
    per_request = [-(-n * 4 // cta) for n in (300, 0, 700, 1)]  # 10, 0, 22, 1
    assert tiles == sum(per_request) == 33
    ints = pinned.view(torch.int32)

    def at(offset, count):
        assert offset % 16 == 0 and offset + 4 * count <= nbytes
        return ints[offset // 4:offset // 4 + count].tolist()

    want_req = [b for b, t in enumerate(per_request) for _ in range(t)]
    want_tile = [i for t in per_request for i in range(t)]
    assert at(info[4], tiles) == want_req and at(info[5], tiles) == want_tile and at(info[6], tiles) == [0] * tiles
    assert at(info[8], 5) == o_rows.tolist()
    assert info[13] == 0 and info[14] == 0  # no CUDA graph, no split-KV
    # at an offset (launches share one buffer): the same data, every offset moved by it
    shifted = torch.full_like(pinned, 0xAB)
    info2 = list(module.schedule(shifted, 4096, qo, o_rows, 32, 8, 128, 128, 2, 0))
    assert info2.pop() == nbytes + 4096
    assert [x + 4096 if k in (4, 5, 6, 8, 9) else x for k, x in enumerate(info)] == info2
    assert torch.equal(shifted[4096:4096 + nbytes], pinned[:nbytes])
    with pytest.raises(Exception, match="expected batch \\+ 1 entries"):
        module.schedule(pinned, 0, qo, o_rows[:3], 32, 8, 128, 128, 2, 0)


@pytest.mark.nvcc
def test_planner_schedule_in_graph_mode_depends_on_the_capacity_only(vg_env, toolchain):
    """graph_rows > 0: grid and offsets from the capacity (the same for any batch that fits),
    the real tiles first, then padding CTAs switched off by the valid mask."""
    module = build.load_module(build.build_module(PlannerConfig(spec("causal"), "9.0a"), Cache(vg_env.cache_dir)).entry)
    infos = []
    for lens in ([300, 0, 700, 1], [4096, 0, 0, 0], [1, 1, 1, 1]):
        pinned = torch.full((1 << 16,), 0xAB, dtype=torch.uint8)
        qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        info = list(module.schedule(pinned, 0, qo, qo, 32, 8, 128, 128, 2, 4096))
        nbytes = info.pop()
        infos.append(info)
        padded, cta = info[0], info[3]
        assert cta == 128 and padded == -(-4096 * 4 // 128) + 4 - 1 and info[1] == 4096 and info[13] == 1
        tiles = sum(-(-n * 4 // cta) for n in lens)
        ints = pinned.view(torch.int32)
        assert ints[info[2] // 4].item() == sum(lens)  # this batch's rows, for the kernel's merge step
        valid = pinned[info[12]:info[12] + padded].tolist()
        assert valid == [1] * tiles + [0] * (padded - tiles) and info[12] + padded == nbytes
        assert ints[info[4] // 4:info[4] // 4 + tiles].tolist() == [b for b, n in enumerate(lens)
                                                                     for _ in range(-(-n * 4 // cta))]
    assert infos[0] == infos[1] == infos[2]
    with pytest.raises(Exception, match="graph_rows=100 is below the rows"):
        rows = torch.tensor([0, 200], dtype=torch.int32)
        module.schedule(pinned, 0, rows, rows, 32, 8, 128, 128, 2, 100)
