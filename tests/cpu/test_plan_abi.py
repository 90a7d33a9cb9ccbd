"""The plan ABI's one table (variantgen/abi/table.py) against what the generated modules use: the
rendered header says what the table says, every module carries the same header among its
sources (hashed into its key), and no template spells one of its constants itself."""

from __future__ import annotations

import re
import shutil
import subprocess
from enum import IntEnum

import pytest
from conftest import SPECS_DIR, TEMPLATES_DIR

import variantgen
from variantgen.abi import table as plan_abi
from variantgen.abi.table import (
    HEADER_NAME,
    META_COLUMNS,
    HeaderField,
    LaunchArray,
    LaunchField,
    MaskMode,
    MetaColumn,
    PlanOption,
    PrefillPlanInfo,
    RecField,
    RowClass,
    Schedule,
    SegField,
    SM90PlanInfo,
    Status,
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


# Every layout of the table, with the prefix its members take in the header.
LAYOUTS = ((MaskMode, "kMode"), (RowClass, "k"), (RecField, "kRec"), (SegField, "kSeg"), (Schedule, "kSchedule"),
           (PlanOption, "kOption"), (Status, "kStatus"), (HeaderField, "kHead"), (LaunchField, "kLaunch"),
           (LaunchArray, "kArray"), (PrefillPlanInfo, "kFa2Info"), (SM90PlanInfo, "kFa3Info"))
# The sizes and limits, as the header must spell them (name: Python's value).
LIMITS = {"kRecFields": len(RecField), "kSegFields": plan_abi.SEG_FIELDS, "kOptionFields": plan_abi.OPTION_FIELDS,
          "kHeaderFields": plan_abi.HEADER_FIELDS, "kLaunchFields": plan_abi.LAUNCH_FIELDS,
          "kMetaColumns": META_COLUMNS, "kMaxPlanInfo": plan_abi.MAX_PLAN_INFO, "kFa3PlanInfo": plan_abi.FA3_PLAN_INFO,
          "kCustomRows": plan_abi.CUSTOM_ROWS, "kTailMaxQoLen": plan_abi.TAIL_MAX_QO_LEN,
          "kFa2Launches": plan_abi.FA2_LAUNCHES, "kFa3MaxWindowLaunches": plan_abi.FA3_MAX_WINDOW_LAUNCHES,
          "kMaxLaunches": plan_abi.MAX_LAUNCHES, "kRowBlock": plan_abi.ROW_BLOCK, "kNoInterval": plan_abi.NO_INTERVAL,
          "kReadIndicesExtra": plan_abi.READ_INDICES_EXTRA, "kVisEveryKey": plan_abi.VIS_EVERY_KEY,
          "kFa2TailRunCode": plan_abi.FA2_TAIL_RUN_CODE, "kListedRunCode": plan_abi.LISTED_RUN_CODE,
          "kMaxPieces": plan_abi.MAX_PIECES,
          "kRaggedKvGap": plan_abi.RAGGED_KV_GAP, "kMaxKeyGaps": plan_abi.MAX_KEY_GAPS, "kNoGapAt": plan_abi.NO_GAP_AT}


def every_plan_abi_enum() -> set[type[IntEnum]]:
    return {v for v in vars(plan_abi).values()
            if isinstance(v, type) and issubclass(v, IntEnum) and v.__module__ == plan_abi.__name__}


def expected_constants() -> dict[str, int]:
    """Every name the header must declare inside vg_abi, with its value: the layouts' members and the limits."""
    want = {cpp_name(prefix, m): int(m) for enum, prefix in LAYOUTS for m in enum}
    assert not set(want) & set(LIMITS)
    return {**want, **LIMITS}


def test_every_layout_of_the_table_is_in_the_header_in_order():
    """Each layout is one block: its comment line, then its members in field order with their offsets;
    the header declares exactly the table's names (none missing, none of its own)."""
    assert {enum for enum, _ in LAYOUTS} == every_plan_abi_enum() - {MetaColumn}  # no layout left out here
    text = plan_abi.header_text()
    lines = text.splitlines()
    for enum, prefix in LAYOUTS:
        block = [f"constexpr int32_t {cpp_name(prefix, m)} = {int(m)};" for m in enum]
        first = lines.index(block[0])
        assert lines[first - 1].startswith("// "), f"{enum.__name__}: no comment above its block"
        assert lines[first:first + len(block)] == block, enum.__name__
        assert [int(m) for m in enum] == list(range(len(enum))), f"{enum.__name__}: offsets are not 0..n-1"
    assert dict(CONSTANT.findall(text)).keys() == expected_constants().keys()
    assert {k: v for k, v in header_values().items() if not k.startswith("VG_META_")} == expected_constants()
    # vg_meta's columns: one #define per column in column order with its comment, then the stride
    meta = [line for line in lines if line.startswith("#define VG_META_")]
    assert [re.match(r"#define (\w+) (\d+)", line).groups() for line in meta] == (
        [(f"VG_META_{c.name}", str(int(c))) for c in MetaColumn] + [("VG_META_STRIDE", str(META_COLUMNS))])
    assert all("  // " in line for line in meta[:-1]), "a vg_meta column without its comment"
    assert text.startswith("// The plan's ABI, generated from variantgen/abi/table.py")
    assert lines[lines.index("#pragma once") + 1] == "#include <cstdint>"
    assert text.count("namespace vg_abi {") == 1 and text.rstrip().endswith("}  // namespace vg_abi")


CXX = shutil.which("c++") or shutil.which("g++")


def compile_against_header(tmp_path, asserts: list[str]) -> subprocess.CompletedProcess:
    (tmp_path / HEADER_NAME).write_text(plan_abi.header_text())
    source = tmp_path / "check.cpp"
    source.write_text("\n".join([f'#include "{HEADER_NAME}"', "#include <type_traits>", "using namespace vg_abi;",
                                  *asserts, "int main() { return 0; }", ""]))
    return subprocess.run([CXX, "-std=c++17", "-Wall", "-Werror", "-fsyntax-only", str(source)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def table_asserts(values: dict[str, int]) -> list[str]:
    lines = [f'static_assert({name} == {value}LL, "{name}");' for name, value in values.items()]
    lines += [f'static_assert(VG_META_{c.name} == {int(c)}, "VG_META_{c.name}");' for c in MetaColumn]
    lines.append(f'static_assert(VG_META_STRIDE == {META_COLUMNS} && VG_META_STRIDE == kMetaColumns, "stride");')
    # the row pass's and the builder's int64 fields are read through int32 offsets; the sentinel must be 64-bit
    lines.append('static_assert(std::is_same<decltype(kNoInterval), const int64_t>::value, "kNoInterval type");')
    lines.append('static_assert(std::is_same<decltype(kRecStarts), const int32_t>::value, "offset type");')
    # the descriptor as the builder sizes it: header, then kMaxLaunches launches of kLaunchFields
    lines.append(f'static_assert(kHeaderFields + kLaunchFields * kMaxLaunches == {plan_abi.DESC_FIELDS}, "desc");')
    lines.append('static_assert(kLaunchFields == kLaunchInfo + kMaxPlanInfo, "launch fields");')
    lines.append('static_assert(kOptionFields == kOptionWindows + kFa3MaxWindowLaunches, "options");')
    return lines


@pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler (c++ or g++)")
def test_the_header_compiles_and_the_compiler_agrees_with_python(tmp_path):
    """The rendered header compiles on its own (-Wall -Werror), and static_asserts of every value
    Python's table holds - the compiler's reading of each constant, sentinel and size - hold."""
    done = compile_against_header(tmp_path, table_asserts(expected_constants()))
    assert done.returncode == 0, done.stderr
    # and the check can fail: one value off is a compile error naming it
    wrong = {**expected_constants(), "kLaunchInfo": int(LaunchField.INFO) + 1}
    done = compile_against_header(tmp_path, table_asserts(wrong))
    assert done.returncode != 0 and '"kLaunchInfo"' in done.stderr, done.stderr


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
    # the gap and page-list columns may be left out: no gap, no page list
    optional = {"page_table_at", "list_page_size"} | {c.name.lower() for c in MetaColumn if c.name.startswith("GAP_")}
    flat = plan_abi.meta_rows(**{k: v[:1] for k, v in columns.items() if k not in optional})
    assert flat[MetaColumn.PAGE_TABLE_AT] == -1 and flat[MetaColumn.LIST_PAGE_SIZE] == 0
    assert flat[MetaColumn.GAP_AT_1] == plan_abi.NO_GAP_AT and flat[MetaColumn.GAP_LEN_1] == 0


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
