"""`variantgen explain`: the mask grid of one request, the planner's per-row intervals and
classes, and the launch requests - all on the CPU, from the same trees the kernel uses."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import ALL_SPECS, SPECS_DIR

import variantgen
from variantgen.tools import explain as ex
from variantgen.tools.cli import main
from variantgen.wrappers.reference import RequestGrid, mask_for_request

MM = SPECS_DIR / "mm_prefix.yaml"


def run(*args):
    return CliRunner().invoke(main, ["explain", *map(str, args)])


def grid_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("q_pos ")]


def test_mm_prefix_grid_intervals_and_launches():
    """Queries at q_pos 4..11, one image span 5-8: q_pos 5..8 see keys 0..8, the rest are causal."""
    r = run(MM, "--qo", 8, "--kv", 12, "--arg", "ranges=5-8", "--page-size", 4)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("spec `mm_prefix`: one request of 8 queries (q_pos 4..11) and 12 keys")
    assert "  ranges = [8, 2] [(-1, -1), (5, 8), (5, 8), (5, 8), (5, 8), (-1, -1), (-1, -1), (-1, -1)]  (given)" \
        in r.output
    assert "  causal_window_left = -1  (default)" in r.output
    rows = [line.split() for line in grid_lines(r.output)]
    assert [row[2] for row in rows] == ["#####.......", "#########...", "#########...", "#########...",
                                        "#########...", "##########..", "###########.", "############"]
    assert [" ".join(row[3:]) for row in rows[:2]] == ["[0, 4] exact causal", "[0, 8] exact dense"]
    assert "term 3: kv_pos >= ranges[q_row, 0] and kv_pos <= ranges[q_row, 1] and (range_window_left <= 0)" \
        in r.output
    launches = r.output.split("launch requests", 1)[1].splitlines()[1:4]
    assert launches[0].split(":")[1].split() == ["causal", "keys", "0-4", "(2", "page(s)),", "mask", "mode", "causal"]
    assert launches[1].strip().startswith("rows 1-3") and "dense   keys 0-8 (3 page(s)), mask mode none" in launches[1]
    assert "1 dense, 2 causal, 0 window, 0 custom (0 of 8 rows" in r.output


def test_sliding_window_rows_get_the_kernel_window():
    r = run(SPECS_DIR / "sliding_window.yaml", "--qo", 10, "--arg", "window=3", "--page-size", 2)
    assert r.exit_code == 0, r.output
    assert grid_lines(r.output)[-1].split()[2:] == ["......####", "[6,", "9]", "exact", "window", "w=3"]
    assert "window  keys 0-9 (5 page(s)), mask mode causal, kernel window 3" in r.output


@pytest.mark.parametrize("name", ALL_SPECS)
def test_grid_is_the_reference_mask_and_intervals_hold_it(name):
    """For every shipped spec (random tensors): the grid is the reference mask of that request,
    no visible key lies outside a row's interval, and exact rows are exactly their interval."""
    spec = variantgen.load_spec(SPECS_DIR / f"{name}.yaml")
    for qo, kv, seed in ((7, 7, 0), (5, 23, 1), (16, 40, 2)):
        args = ex.resolve_args(spec, [], qo, kv, 2, seed)
        e = ex.explain(spec, qo, kv, args, page_size=4, heads=2, head=1)
        values = {k: a.value for k, a in args.items()}
        ref = mask_for_request(spec, RequestGrid(0, qo, kv, 0, 0, 2, 1, torch.device("cpu")), values)[1]
        assert torch.equal(e.mask, ref)
        text = ex.render(e)
        assert [line.split()[2] for line in grid_lines(text)] == [
            "".join("#" if v else "." for v in row) for row in ref.tolist()]
        for r, info in enumerate(e.rows):
            assert info.outside == 0, (name, qo, kv, r, info)
            if info.exact and not info.empty:
                assert ref[r].nonzero().flatten().tolist() == list(range(info.lo, info.hi + 1))
        if e.form.planner_ready:  # the launch requests partition the rows
            covered = [i for la in e.launches for i in range(*la.rows)]
            assert sorted(covered) == list(range(qo))
            assert all(la.keys[0] <= info.lo and info.hi < la.keys[1]
                       for la in e.launches for info in e.rows[la.rows[0]:la.rows[1]] if not info.empty)


def test_random_tensors_are_seeded_and_marked():
    spec = variantgen.load_spec(SPECS_DIR / "document.yaml")
    a = ex.resolve_args(spec, [], 6, 10, 1, 3)
    b = ex.resolve_args(spec, [], 6, 10, 1, 3)
    assert a["doc_ids"].source == "random" and torch.equal(a["doc_ids"].value, b["doc_ids"].value)
    r = run(SPECS_DIR / "document.yaml", "--qo", 6, "--kv", 10, "--arg", "doc_ids=4x0,3x1,3x2")
    assert "  doc_ids = [10] [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]  (given)" in r.output


def test_a_mask_without_intervals_says_the_planner_is_off(spec_text):
    path = spec_text("name: per_head\nmask: kv_pos <= q_pos + qo_head\n")
    r = run(path, "--qo", 3, "--heads", 2, "--head", 1)
    assert r.exit_code == 0, r.output
    assert [line.split()[2] for line in grid_lines(r.output)] == ["##.", "###", "###"]
    assert "interval planner: off (the mask depends on the head index: intervals differ per head)" in r.output


@pytest.mark.parametrize("args, message", [
    (["--arg", "rangez=1-2"], "--arg rangez=...: spec `mm_prefix` has no argument 'rangez' (it takes: ranges, "
                              "causal_window_left, range_window_left)"),
    (["--arg", "ranges"], "--arg 'ranges': expected NAME=VALUE"),
    (["--arg", "ranges=3-20"], "--arg ranges=3-20: spans[0][0]=(3, 20): expected 0 <= start <= end < kv_lens[0]=12"),
    (["--arg", "ranges=1,2,3"], "--arg ranges=1,2,3: 3 value(s) for int32 tensor `ranges` of shape [total_q=8, 2] "
                                "(16 elements)"),
    (["--arg", "ranges=a"], "--arg ranges=a: 'a' is not a number (`ranges` holds whole numbers)"),
    (["--arg", "causal_window_left=1.5"], "--arg causal_window_left=1.5: expected a whole number (int scalar)"),
    (["--arg", "range_window_left=2", "--arg", "range_window_left=3"], "--arg range_window_left= is given twice"),
    (["--qo", "13"], "--qo=13 > --kv=12: a request's queries are its last keys (qo <= kv)"),
    (["--kv", "70000"], "--kv=70000: expected 1 <= kv <= 65536"),
    (["--page-size", "0"], "--page-size=0: expected 1 <= page-size"),
    (["--head", "1"], "--head=1: expected 0 <= head < --heads=1"),
])
def test_bad_input_is_one_clear_error(args, message):
    base = {"--qo": "8", "--kv": "12"}
    given = dict(zip(args[::2], args[1::2]))
    extra = [x for k, v in base.items() if k not in given for x in (k, v)]
    r = run(MM, *extra, *args)
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("error: ") and message in r.stderr and "Traceback" not in r.output


def test_bool_scalars_and_the_help_text(spec_text):
    path = spec_text("name: flag\nscalars:\n  full: {dtype: bool, default: false}\nmask: kv_pos <= q_pos or full\n")
    r = run(path, "--qo", 2, "--arg", "full=true")
    assert r.exit_code == 0 and [line.split()[2] for line in grid_lines(r.output)] == ["##", "##"]
    assert "expected true or false" in run(path, "--qo", 2, "--arg", "full=maybe").stderr
    help_text = CliRunner().invoke(main, ["explain", "--help"]).output
    assert "COUNTxVALUE" in help_text and "ranges=2-5,8-9" in help_text


def test_tree_verify_shows_a_dense_context_and_a_draft_hull():
    spec = variantgen.load_spec(SPECS_DIR / "tree_verify.yaml")
    bits = variantgen.tree_bits([[-1, 0, 0, 1]])
    e = ex.explain(spec, 4, 10, {"tree_bits": ex.ArgValue("tree_bits", bits, "given")})
    assert [(r.lo, r.dense_hi, r.hi, r.exact, r.hidden, r.outside) for r in e.rows] == [
        (0, 5, 6, False, 0, 0), (0, 5, 7, False, 0, 0), (0, 5, 8, False, 0, 0), (0, 5, 9, False, 0, 0)]
    text = ex.render(e)
    assert "q_pos    9  ########.#  [0, 5] dense + [6, 9] hull tail" in text, text
    assert "rows 0-3     (q_pos 6-9): tail    keys 0-9 (1 page(s)), mask mode causal (fa2, while" in text
    assert "0 dense, 0 causal, 0 window, 1 tail, 0 custom (0 of 4 rows" in text
    assert "WARNING" not in text
    # a longer context: the tail rows need the context dense up to the request's first query
    e = ex.explain(spec, 4, 40, {"tree_bits": ex.ArgValue("tree_bits", bits, "given")})
    assert [r.cls for r in e.rows] == ["tail"] * 4


@pytest.mark.parametrize("qo,kv", [(65536, 65536), (4096, 65536)])
def test_json_gives_the_cost_of_a_long_request_without_a_grid(qo, kv):
    r = run(str(SPECS_DIR / "sliding_window.yaml"), "--qo", str(qo), "--kv", str(kv), "--arg", "window=1023", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert "grid" not in out and "row_intervals" not in out and out["rows"] == qo
    # window + 1 keys per row once the window is full, fewer before
    first = kv - qo
    assert out["keys_visible"] == sum(min(q, 1023) + 1 for q in range(first, kv))
    assert out["keys_visible"] <= out["keys_read"] <= 1.15 * out["keys_visible"]
    assert sum(c["keys_read"] for c in out["by_class"].values()) == out["keys_read"]


def test_json_of_a_small_request_has_the_grid_and_the_cost_of_every_class():
    r = run(MM, "--qo", "8", "--kv", "12", "--json")
    out = json.loads(r.stdout)
    assert len(out["grid"]) == 8 and all(len(row) == 12 for row in out["grid"])
    assert out["keys_visible"] == sum(row.count("#") for row in out["grid"])
    assert out["keys_read"] == sum(c["keys_read"] for c in out["by_class"].values())
    text = run(MM, "--qo", "8", "--kv", "12").stdout
    assert f"cost: keys read {out['keys_read']} for {out['keys_visible']} visible" in text


def test_text_of_a_long_request_skips_the_grid_and_lists_some_launches():
    r = run(str(SPECS_DIR / "document.yaml"), "--qo", "16384", "--kv", "16384")
    assert r.exit_code == 0, r.output
    assert "drawn for requests of up to 256" in r.stdout and "more launch requests" in r.stdout
    assert "cost: keys read" in r.stdout


def test_explain_shows_the_pieces_plan_makes_and_their_cost():
    """A row of two key intervals (streaming_sink's sinks and window) is split into pieces by
    plan(): explain lists those launch requests and costs them - not the hull the row kernel
    alone would run (a regression: explain reported 4.31x at 8192 tokens where plan() reads 1.00x)."""
    r = run(str(SPECS_DIR / "streaming_sink.yaml"), "--qo", "8192", "--kv", "8192", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["keys_read"] == out["keys_visible"], out["by_class"]
    pieces = sorted({la["piece"] for la in out["launch_requests"]})
    assert pieces == [-1, 0, 1] and "custom" not in out["by_class"], out["launch_requests"]
    text = run(str(SPECS_DIR / "streaming_sink.yaml"), "--qo", "40", "--kv", "40", "--arg", "window=8",
               "--arg", "num_sink=2").stdout
    assert "piece 0" in text and "piece 1" in text and "split into 2 pieces" in text, text
