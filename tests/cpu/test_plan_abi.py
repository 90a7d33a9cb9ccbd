"""The plan ABI's one table (variantgen/abi/table.py) against what the generated modules use: the
rendered header says what the table says, every module carries the same header among its
sources (hashed into its key), and no template spells one of its constants itself."""

from __future__ import annotations

import re

import pytest
from conftest import SPECS_DIR, TEMPLATES_DIR

import variantgen
from variantgen.abi import table as plan_abi
from variantgen.abi.table import (
    HEADER_NAME,
    META_COLUMNS,
    HeaderField,
    LaunchField,
    MaskMode,
    MetaColumn,
    PrefillPlanInfo,
    RecField,
    RowClass,
    Schedule,
    SegField,
    SM90PlanInfo,
)
from variantgen.build import builder as build
from variantgen.build.builder import rendered_sources
from variantgen.codegen import render
from variantgen.planning.rowplan import PlannerConfig

CONSTANT = re.compile(r"^constexpr int(?:32_t|64_t)? (k\w+) = (.+);$", re.M)
DEFINE = re.compile(r"^#define (VG_META_\w+) (\d+)", re.M)


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """Render from the checkout's templates with a private cache dir."""


def header_values() -> dict[str, int]:
    text = plan_abi.header_text()
    values = {name: eval(value.replace("int64_t(1)", "1"))  # noqa: S307 - our own header's int literals
              for name, value in CONSTANT.findall(text)}
    values.update({name: int(v) for name, v in DEFINE.findall(text)})
    return values


def cpp_name(prefix: str, member) -> str:
    words = {"FLASHINFER": "FlashInfer"}
    return prefix + "".join(words.get(p, p.capitalize()) for p in member.name.split("_"))


def test_the_header_says_what_the_table_says():
    values = header_values()
    for enum, prefix in ((MaskMode, "kMode"), (RowClass, "k"), (RecField, "kRec"), (SegField, "kSeg"),
                         (Schedule, "kSchedule"), (HeaderField, "kHead"), (LaunchField, "kLaunch"),
                         (PrefillPlanInfo, "kFa2Info"), (SM90PlanInfo, "kFa3Info")):
        for member in enum:
            assert values[cpp_name(prefix, member)] == int(member), (enum.__name__, member)
    for column in MetaColumn:
        assert values[f"VG_META_{column.name}"] == int(column)
    assert values["VG_META_STRIDE"] == META_COLUMNS == values["kMetaColumns"] == len(MetaColumn)
    limits = {"kRecFields": len(RecField), "kSegFields": len(SegField), "kHeaderFields": len(HeaderField),
              "kLaunchFields": plan_abi.LAUNCH_FIELDS, "kMaxPlanInfo": len(PrefillPlanInfo),
              "kFa3PlanInfo": len(SM90PlanInfo), "kCustomRows": plan_abi.CUSTOM_ROWS,
              "kFa3MaxWindowLaunches": plan_abi.FA3_MAX_WINDOW_LAUNCHES, "kMaxLaunches": plan_abi.MAX_LAUNCHES,
              "kRowBlock": plan_abi.ROW_BLOCK, "kNoInterval": plan_abi.NO_INTERVAL}
    assert {k: values[k] for k in limits} == limits
    assert plan_abi.LAUNCH_FIELDS == LaunchField.INFO + len(PrefillPlanInfo)
    assert plan_abi.DESC_FIELDS == len(HeaderField) + plan_abi.LAUNCH_FIELDS * plan_abi.MAX_LAUNCHES
    assert plan_abi.header_text() == plan_abi.header_text()  # pure


def test_mask_modes_and_classes():
    assert [m.label for m in MaskMode] == ["none", "causal", "custom"]
    assert render.MASK_MODES == {"none": (0, "MaskMode::kNone"), "causal": (1, "MaskMode::kCausal"),
                                 "custom": (2, "MaskMode::kCustom")}
    assert [c.mode for c in RowClass] == [MaskMode.NONE, MaskMode.CAUSAL, MaskMode.CAUSAL, MaskMode.CUSTOM,
                                          MaskMode.CAUSAL]
    assert MaskMode.of("causal") is MaskMode.CAUSAL


def test_meta_rows_lays_out_by_the_table():
    columns = {c.name.lower(): [10 * int(c), 10 * int(c) + 1] for c in MetaColumn}
    flat = plan_abi.meta_rows(**columns)
    assert flat[:META_COLUMNS] == [10 * int(c) for c in MetaColumn]
    assert flat[META_COLUMNS + MetaColumn.KERNEL_WINDOW] == 71
    with pytest.raises(ValueError, match="expected the columns"):
        plan_abi.meta_rows(**{k: v for k, v in columns.items() if k != "request"})


def every_module() -> list[render.RenderedModule]:
    spec = variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")
    configs = [render.ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", backend, kind=kind)
               for backend, kind in render.RENDERERS]
    return [rendered_sources(c) for c in configs] + [PlannerConfig(spec, "9.0a").render()]


def test_every_module_carries_the_header_and_declares_none_of_its_names():
    header = plan_abi.header_text()
    names = set(header_values())
    declared = re.compile(r"(?:constexpr[^=;]*\b|#define\s+)(" + "|".join(sorted(names)) + r")\b")
    for module in every_module():
        assert module.files[HEADER_NAME] == header, module.config.uri_prefix
        includes = [n for n, text in module.files.items() if f'#include "{HEADER_NAME}"' in text]
        assert includes, f"{module.config.uri_prefix}: no source includes {HEADER_NAME}"
        for name, text in module.files.items():
            hit = declared.search(text) if name != HEADER_NAME else None
            assert not hit, f"{module.config.uri_prefix}/{name} declares {hit and hit[1]}"
    for path in sorted(TEMPLATES_DIR.rglob("*")):
        if path.is_file():
            hit = declared.search(path.read_text())
            assert not hit, f"{path.relative_to(TEMPLATES_DIR)} declares {hit[1]}: use {HEADER_NAME}"


def test_the_table_is_part_of_every_modules_key(monkeypatch):
    spec = variantgen.load_spec(SPECS_DIR / "causal.yaml")
    configs = [render.ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a"), PlannerConfig(spec, "9.0a")]
    before = [build.module_key(rendered_sources(c), None).uri for c in configs]
    monkeypatch.setattr(plan_abi, "CUSTOM_ROWS", 64)
    assert "kCustomRows = 64;" in plan_abi.header_text()
    after = [build.module_key(rendered_sources(c), None).uri for c in configs]
    assert all(a != b for a, b in zip(before, after))
