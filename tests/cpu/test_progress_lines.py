"""A build a user waits on says what it does before it starts and shows each finished compile
unit with an estimate of the time left, on a terminal (a bar) and off one (a line per unit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from variantgen.build import builder as build
from variantgen.core.progress import BuildProgress, progress_text
from variantgen.tools.cli import main


def test_the_estimate_extrapolates_the_units_done():
    assert progress_text(100.0, 2, 6, now=130.0) == "30s elapsed, about 60s left"
    assert progress_text(100.0, 0, 6, now=101.0) == "1s elapsed"  # nothing to extrapolate from yet
    assert progress_text(100.0, 6, 6, now=190.0) == "90s elapsed"


def test_lines_off_a_terminal(capsys):
    p = BuildProgress("vg_causal_fa2_prefill_x_sm90a_0123abcd", 3, "fa2", bar=False, lines=True)
    p.update(1, 3)
    p.update(1, 3)  # ninja repeats a count: one line per unit finished
    p.update(3, 3)
    p.close(True)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("building vg_causal_fa2_prefill_x_sm90a_0123abcd (3 compile units; a first build takes about "
                      "a minute)")
    assert [line.split(",")[0] for line in err[1:]] == ["  causal_fa2_prefill_x_sm90a: 1/3 units",
                                                        "  causal_fa2_prefill_x_sm90a: 3/3 units"]
    assert "left" in err[1] and len(err) == 3


def test_without_lines_a_build_logs_only(capsys):
    p = BuildProgress("vg_causal_fa2_prefill_x_sm90a_0123abcd", 3, "fa2", bar=False)
    p.update(2, 3)
    p.close(True)
    assert capsys.readouterr().err == ""


@pytest.fixture
def fake_module_build(monkeypatch, tmp_path):
    def fake(cfg, cache, progress=None, **kwargs):
        report = progress("vg_mm_prefix_fa2_fake_0123abcd", 2, "fa2")
        report.update(1, 2)
        report.update(2, 2)
        report.close(True)
        return SimpleNamespace(built=True, entry=SimpleNamespace(uri="vg_mm_prefix_fa2_fake_0123abcd", path=tmp_path))

    monkeypatch.setattr(build, "build_module", fake)


def test_demo_says_why_it_waits_before_the_build(fake_module_build, vg_env, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["demo", "mm_prefix"])
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    assert err[0].startswith("[3/4] compiling the module with nvcc (")
    assert "compile units; a first build takes" in err[0]
    assert err[1] == "building vg_mm_prefix_fa2_fake_0123abcd (2 compile units; a first build takes about a minute)"
    assert err[2].startswith("  mm_prefix_fa2_fake: 1/2 units, ") and err[2].endswith("s left")
    assert "[3/4] module vg_mm_prefix_fa2_fake_0123abcd built in " in r.stdout


def test_the_first_flex_run_of_a_layout_says_it_traces(caplog):
    import logging

    from variantgen.wrappers import flex_blocks as flex

    with caplog.at_level(logging.INFO, logger="variantgen.wrappers.flex_blocks"):
        flex._compiled("eager", ("a layout no test uses", 1))
        flex._compiled("eager", ("a layout no test uses", 1))  # cached: said once
    said = [r.getMessage() for r in caplog.records if "traces FlexAttention" in r.getMessage()]
    assert said == ["flex route: the first run() of this spec and layout traces FlexAttention with torch.compile "
                    "(eager backend): a few seconds, once per process"]
