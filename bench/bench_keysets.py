"""GPU benchmark of sparse key sets read through page lists (variantgen/planning/keysets.py).

Workload (issue 41's): 8 requests x 8192 tokens of prefill, 32/8 heads, head dim 128, bf16, page
16. Per backend, in one process with CUDA events (median of --iters runs of run() after warm-up):

* ``global_window`` (bench/masks/: a bidirectional window of 256 keys each side plus global tokens,
  0.5 % of the keys, seen by every row and seeing every key) with its custom runs reading their
  page lists, and the same plan over each run's hull (``_hull``: Planner.key_set_lists off);
  against ``bidirectional_window`` with the same window, the mask without global tokens (the
  issue's bar: global tokens + window at most 1.3x the plain window);
* ``fixed_sparse`` (block 128, the last 8 keys of every earlier block), lists and hull, against
  ``causal`` scaled by the two masks' visible keys (the issue's bar for the collection: within
  1.15x of causal's time per visible key);
* ``bigbird`` (blocks of 64: a window of 3 blocks, 2 global blocks, random key blocks picked per
  query block, each of 32 with probability 0.1), lists and hull, against causal likewise.

Also the plans' keys read per visible key (the CPU figure, cost.plan_cost), plan()'s host time
(the mask's first plan() in the process and the same batch planned again) and the largest
difference of the lists' output from the hull's. Writes bench/results/keysets-<date>-<gpu>.json
(or --out). Modules are loaded from VARIANTGEN_CACHE_DIR
(--list-modules prints the precompile commands). Run on the GPU machine:

    python bench/bench_keysets.py --list-modules
    python bench/bench_keysets.py --backends fa3
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.planning.cost import plan_cost  # noqa: E402
from variantgen.testing import harness  # noqa: E402

WORKLOAD = dict(batch=8, tokens=8192, qo_heads=32, kv_heads=8, head_dim=128, page_size=16, window=256,
                global_share=0.005, block=128, summary=8, bigbird_block=64, random_share=0.1)
FILES = {"global_window": ROOT / "bench" / "masks" / "global_window.yaml",
         "bidirectional_window": ROOT / "bench" / "masks" / "bidirectional_window.yaml",
         "fixed_sparse": ROOT / "bench" / "masks" / "fixed_sparse.yaml",
         "bigbird": ROOT / "bench" / "masks" / "bigbird.yaml",
         "causal": ROOT / "specs" / "causal.yaml"}


def list_modules() -> str:
    return "\n".join(f"python -m variantgen.tools.cli precompile {path.relative_to(ROOT)} --head-dim "
                     f"{WORKLOAD['head_dim']} --dtype bf16 --backend {be} --kind prefill --arch 9.0a -j 8"
                     for path in FILES.values() for be in ("fa3", "fa2"))


def bench_backend(backend: str, iters: int, res: dict) -> None:
    wl = WORKLOAD
    n = wl["tokens"]
    batch = harness.random_paged_batch([n] * wl["batch"], [n] * wl["batch"], num_qo_heads=wl["qo_heads"],
                               num_kv_heads=wl["kv_heads"], head_dim=wl["head_dim"], page_size=wl["page_size"],
                               dtype=torch.bfloat16, device="cuda", seed=1)
    g = torch.Generator().manual_seed(0)
    is_global = (torch.rand(n * wl["batch"], generator=g) < wl["global_share"]).to(torch.int32).cuda()
    words = ((torch.rand(64, 32, generator=g) < wl["random_share"]).long() << torch.arange(32)).sum(1)
    random_blocks = (words - (words >= 2**31).long() * 2**32).to(torch.int32).cuda()  # (the bits as int32)
    bigbird = {"random_blocks": random_blocks, "block": wl["bigbird_block"]}
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    window = {"window": wl["window"]}
    cases = {"bidirectional_window": ("bidirectional_window", window, True),
             "global_window": ("global_window", window | {"is_global": is_global}, True),
             "global_window_hull": ("global_window", window | {"is_global": is_global}, False),
             "causal": ("causal", {}, True),
             "fixed_sparse": ("fixed_sparse", {"block": wl["block"], "c": wl["summary"]}, True),
             "fixed_sparse_hull": ("fixed_sparse", {"block": wl["block"], "c": wl["summary"]}, False),
             "bigbird": ("bigbird", bigbird, True),
             "bigbird_hull": ("bigbird", bigbird, False)}
    outs, visible = {}, {}
    for name, (spec_name, args, lists) in cases.items():
        key = f"{name}_{backend}"
        spec = variantgen.load_spec(FILES[spec_name])
        try:
            w = variantgen.make_wrapper(spec, ws, head_dim_qk=wl["head_dim"], q_dtype="bf16", kv_dtype="bf16",
                                        backend=backend)
        except Exception as e:  # (a module not built where JIT is off: that row is missing, said so)
            res["notes"][f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        w.planner.key_set_lists = lists
        for when in ("plan_ms", "plan_again_ms"):  # the first plan() of the mask, then the same batch again
            t = time.perf_counter()
            plan = w.plan(*batch.plan_args(), skip_tiles=True, **args)
            torch.cuda.synchronize()
            res["notes"][f"{key}_{when}"] = round((time.perf_counter() - t) * 1e3, 2)
        res["notes"][f"{key}_plan"] = repr(plan)
        cost = plan_cost(plan, spec, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
        res["notes"][f"{key}_keys_read_per_visible"] = round(cost.keys_read / max(cost.keys_visible, 1), 3)
        visible[name] = cost.keys_visible
        kv = (batch.k_cache, batch.v_cache)
        outs[name] = w.run(batch.q, kv, **args).float()
        call = lambda w=w, args=args, kv=kv: w.run(batch.q, kv, **args)  # noqa: E731
        res["ms"][key] = round(harness.cuda_median_ms(call, iters), 3)
        print(f"{key:34s} {res['ms'][key]:8.3f} ms  (keys read / visible "
              f"{res['notes'][f'{key}_keys_read_per_visible']})", flush=True)
    ms = {k: res["ms"][f"{k}_{backend}"] for k in cases if f"{k}_{backend}" in res["ms"]}
    for name in ("global_window", "global_window_hull"):
        if name in ms and "bidirectional_window" in ms:
            ratio = ms[name] / ms["bidirectional_window"]
            res["notes"][f"{name}_{backend}_over_bidirectional_window"] = round(ratio, 3)
    for name in ("fixed_sparse", "fixed_sparse_hull", "global_window", "bigbird", "bigbird_hull"):
        if name in ms and "causal" in ms:
            per_key = ms["causal"] / visible["causal"]
            res["notes"][f"{name}_{backend}_over_causal_per_visible_key"] = round(ms[name] / (per_key * visible[name]),
                                                                                  3)
    for name in ("global_window", "fixed_sparse", "bigbird"):
        if name in outs and f"{name}_hull" in outs:
            diff = (outs[name] - outs[f"{name}_hull"]).abs().max().item()
            res["notes"][f"{name}_{backend}_lists_vs_hull_max_abs_diff"] = round(diff, 5)


def main(argv: list[str] | None = None) -> int:
    args = harness.gpu_bench_args(__doc__, list_modules, argv)
    if args is None:
        return 0
    res: dict = {**harness.run_environment(), "workload": WORKLOAD, "ms": {}, "notes": {}}
    for backend in args.backends:
        harness.noted(res, backend, lambda backend=backend: bench_backend(backend, args.iters, res))
    print(f"results: {harness.write_result('keysets', res, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
