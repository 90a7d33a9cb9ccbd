"""The interval planner's work per visible key, on the CPU, for every shipped spec and a collection
of masks from the literature, each in several equivalent forms.

For one request of 8192 tokens (prefill) and the last 2048 queries of an 8192-token request
(chunked prefill, kv_len > qo_len) this plans every form with the planner's own rules on the
CPU (variantgen.planning.cost: the row rules the GPU's row kernel runs, the launch requests fa2 lays out)
and reports per mask and form

* keys_read / keys_visible: the keys the planned launches read against the keys the mask shows;
* for sparse key sets (rows the planner keeps as a hull): the page-granular live area (per row, the
  keys of the pages that hold a key it sees) and keys_read against it; and the tile-granular
  live area (per 128 rows, the pages of their union), the least a list per query tile reaches;
* whether the planner is off, and why; whether another form of the same mask plans.

Targets (issue 41): read/visible <= 1.15 where rows see a few intervals, <= 1.15 x the
page-granular live area for sparse key sets, no form planner-off where another form plans. Keys
read are computed from the launch requests plan() makes - rows of several intervals split into
pieces (pieces.py), custom runs of key-set rows, or of rows whose keys are picked per row block
(BigBird's random blocks), through their page lists (keysets.py) - so the
figures follow the planner without a change here.

Masks: specs/*.yaml, bench/masks/*.yaml; forms: the spec's own mask and those of
bench/masks/equivalent_forms.yml. Writes bench/results/<date>-cpu/planner-<commit>.json (or --out).
Run:  python bench/bench_planner.py [--tokens 8192] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from variantgen import parse_spec  # noqa: E402
from variantgen.lang.evaluate import Evaluator  # noqa: E402
from variantgen.lang.spec import load_spec  # noqa: E402
from variantgen.lang.values import VariantSpec  # noqa: E402
from variantgen.planning.cost import Cost, batch_cost  # noqa: E402
from variantgen.planning.intervals import analyze  # noqa: E402
from variantgen.planning.rowrules import row_env  # noqa: E402
from variantgen.testing.harness import random_paged_batch, random_spec_args, source_commit  # noqa: E402

MASK_DIRS = (ROOT / "specs", ROOT / "bench" / "masks")
FORMS_FILE = ROOT / "bench" / "masks" / "equivalent_forms.yml"
TARGET = 1.15
PAGE = 16
TILE_ROWS = 128  # the sm90 kernel's query tile (hd 128): one page list serves a tile's rows


def environment() -> dict[str, Any]:
    from variantgen._version import __version__

    try:
        import flashinfer

        fi = flashinfer.__version__
    except Exception:  # the CPU figures need no FlashInfer
        fi = None
    return {"commit": source_commit(), "date": datetime.date.today().isoformat(), "device": "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "flashinfer": fi,
            "variantgen": __version__}


def with_mask(spec: VariantSpec, text: str) -> VariantSpec:
    data = yaml.safe_load(Path(spec.path).read_text())
    data["mask"] = text
    return parse_spec(yaml.safe_dump(data, sort_keys=False), str(spec.path))


def request_args(spec: VariantSpec, qo: int, kv: int, seed: int = 0) -> dict[str, Any]:
    """Arguments for one request: the tests' random tensors, with realistic ones where the name says
    what they hold (8 packed documents, 0.5 % global tokens, three 1024-token image spans)."""
    batch = random_paged_batch([qo], [kv], num_qo_heads=1, num_kv_heads=1, head_dim=8, page_size=PAGE,
                               dtype=torch.float32, seed=seed)
    args = random_spec_args(spec, batch, seed=seed)
    g = torch.Generator().manual_seed(seed)
    if "doc_ids" in args:
        cuts = torch.zeros(kv, dtype=torch.int32)
        cuts[torch.randperm(kv - 1, generator=g)[:7] + 1] = 1
        args["doc_ids"] = torch.cumsum(cuts, 0).to(torch.int32)
    if "is_global" in args:
        args["is_global"] = (torch.rand(kv, generator=g) < 0.005).to(torch.int32)
    if "ranges" in args and args["ranges"].shape == (qo, 2):
        from variantgen.wrappers.spans import spans_to_ranges

        spans = [(s, min(kv - 1, s + 1023)) for s in (kv // 8, kv // 2, 3 * kv // 4)]
        args["ranges"] = spans_to_ranges([qo], [kv], [spans])
    if "prefix_len" in args:
        args["prefix_len"] = torch.tensor([min(kv, 1024)], dtype=torch.int32)
    return args


def page_live_keys(spec: VariantSpec, args: dict[str, Any], qo: int, kv: int, page: int = PAGE,
                   tile: int = TILE_ROWS) -> tuple[int, int]:
    """Sum over rows of the keys of the pages that hold a key the row sees (the mask evaluated on
    every element, a block of rows at a time): the least a page list can read; and the same with
    the pages of each ``tile`` rows' union (from the first row): the least a page list per query
    tile of the kernel can read."""
    env = row_env([0, qo], [kv], torch.device("cpu"))
    pages = -(-kv // page)
    per_row = per_tile = 0
    rows = tile * max(1, (1 << 22) // (kv * tile))
    kv_pos = torch.arange(kv, dtype=torch.int64).view(1, -1)
    zero = torch.zeros((), dtype=torch.int64)
    sizes = torch.full((pages,), page, dtype=torch.int64)
    sizes[-1] = kv - (pages - 1) * page
    for r0 in range(0, qo, rows):
        sl = slice(r0, min(qo, r0 + rows))
        n = sl.stop - sl.start
        block = {k: v[sl].view(-1, 1) for k, v in env.items() if k != "vg_kv_lens"}
        block |= {"kv_pos": kv_pos, "kv_row": kv_pos, "qo_head": zero, "kv_head": zero}
        m = Evaluator(spec, block, args).ev(spec.mask).to(torch.bool).expand(n, kv)
        padded = torch.zeros(n, pages * page, dtype=torch.bool)
        padded[:, :kv] = m
        live = padded.view(n, pages, page).any(2)
        per_row += int((live.to(torch.int64) * sizes).sum())
        for t0 in range(0, n, tile):
            t_rows = min(tile, n - t0)
            per_tile += t_rows * int((live[t0:t0 + t_rows].any(0).to(torch.int64) * sizes).sum())
    return per_row, per_tile


def measure(spec: VariantSpec, qo: int, kv: int) -> dict[str, Any]:
    tree = next((t for t in spec.tensors if t.name == "tree_bits"), None)
    if tree is not None:  # a draft tree verified after its context: as many queries as the bits hold nodes
        qo = min(qo, 32 * int(tree.shape[1]))
    args = request_args(spec, qo, kv)
    t = time.perf_counter()
    cost: Cost = batch_cost(spec, args, [qo], [kv], page_size=PAGE)
    out: dict[str, Any] = {"keys_read": cost.keys_read, "keys_visible": cost.keys_visible,
                           "read_per_visible": round(cost.ratio, 4), "planner": cost.planner,
                           "hull_rows": cost.hull_rows,
                           "by_class": {k: vars(v) for k, v in cost.by_class.items()}}
    if cost.planner == "off":
        out["planner_off"] = cost.reason
    if cost.hull_rows:  # a sparse key set: the page list's least is the page-granular live area
        live, tile_live = page_live_keys(spec, args, qo, kv)
        out["page_live_keys"] = live
        out["read_per_page_live"] = round(cost.keys_read / live, 4) if live else None
        out["tile_live_keys"] = tile_live  # (the same per 128-row query tile: what one tile's list can reach)
        out["read_per_tile_live"] = round(cost.keys_read / tile_live, 4) if tile_live else None
    out["qo_len"], out["kv_len"] = qo, kv
    out["cpu_s"] = round(time.perf_counter() - t, 3)
    return out


def verdict(m: dict[str, Any]) -> tuple[bool, str]:
    if m["planner"] == "off":
        return False, f"planner off ({m['planner_off']})"
    if m.get("page_live_keys") is not None:
        r = m["read_per_page_live"] or 0.0
        return r <= TARGET, f"{r:.2f}x the page-granular live area (a sparse key set)"
    r = m["read_per_visible"]
    return r <= TARGET, f"{r:.2f}x the visible keys"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="keys of the request (queries too, in prefill)")
    ap.add_argument("--chunk", type=int, default=2048, help="queries of the chunked-prefill request")
    ap.add_argument("--only", default="", help="comma list of mask names to run (default: all)")
    ap.add_argument("--out", default=None, help="JSON path (default: bench/results/<date>-cpu/planner-<commit>.json)")
    a = ap.parse_args()
    forms = yaml.safe_load(FORMS_FILE.read_text())
    only = {x for x in a.only.split(",") if x}
    scenarios = {"prefill": (a.tokens, a.tokens), "chunked_prefill": (a.chunk, a.tokens)}
    results = []
    for folder in MASK_DIRS:
        for path in sorted(folder.glob("*.yaml")):
            written = load_spec(path)
            if only and written.name not in only:
                continue
            texts = [(" ".join(written.mask_text.split()), "as written")]
            texts += [(str(t), f"form {i + 1}") for i, t in enumerate(forms.get(written.name, []))]
            entry: dict[str, Any] = {"mask": written.name, "file": str(path.relative_to(ROOT)),
                                     "shipped": folder.name == "specs", "forms": []}
            for text, label in texts:
                spec = written if label == "as written" else with_mask(written, text)
                form = {"form": label, "mask": text, "terms": len(analyze(spec).terms)}
                for name, (qo, kv) in scenarios.items():
                    m = measure(spec, qo, kv)
                    m["meets_target"], m["against"] = verdict(m)
                    form[name] = m
                entry["forms"].append(form)
                print(f"{written.name:22} {label:10} " + "  ".join(
                    f"{n}: {form[n]['read_per_visible']:.2f}x" + (" OFF" if form[n]["planner"] == "off" else "")
                    + (f" (page-live {form[n]['read_per_page_live']}x, tile-live {form[n]['read_per_tile_live']}x)"
                       if "page_live_keys" in form[n] else "")
                    for n in scenarios), flush=True)
            planned = [f["form"] for f in entry["forms"] if f["prefill"]["planner"] != "off"]
            off = [f["form"] for f in entry["forms"] if f["prefill"]["planner"] == "off"]
            entry["planner_off_where_a_rewrite_plans"] = off if planned else []
            results.append(entry)
    misses = [f"{e['mask']} ({f['form']}, {n}): {f[n]['against']}" for e in results for f in e["forms"]
              for n in scenarios if not f[n]["meets_target"]]
    env = environment()
    res = {"benchmark": "bench_planner", **env,
           "workload": {"scenarios": {k: {"qo_len": q, "kv_len": k2} for k, (q, k2) in scenarios.items()},
                        "page_size": PAGE, "target": TARGET,
                        "keys_read": "launch requests of the planner's row rules on the CPU (cost.batch_cost)"},
           "results": results,
           "summary": {"masks": len(results), "forms": sum(len(e["forms"]) for e in results),
                       "meeting_target": sum(f[n]["meets_target"] for e in results for f in e["forms"]
                                             for n in scenarios),
                       "measured": sum(len(e["forms"]) for e in results) * len(scenarios),
                       "misses": misses,
                       "planner_off_where_a_rewrite_plans": {e["mask"]: e["planner_off_where_a_rewrite_plans"]
                                                             for e in results
                                                             if e["planner_off_where_a_rewrite_plans"]}}}
    default = ROOT / "bench" / "results" / f"{env['date']}-cpu" / f"planner-{env['commit'][:7]}.json"
    out = Path(a.out) if a.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{res['summary']['meeting_target']} of {res['summary']['measured']} meet the target; wrote {out}")


if __name__ == "__main__":
    main()
