"""The attention backend of a serving engine, built on variantgen: the example to copy.

What an engine does, in order:

1. Startup, per layer group (head size, KV dtype, page size): probe whether the spec's FlashInfer
   module runs here *with JIT off* (a server never compiles; precompile on a build box). Advertise
   it only when the probe says yes; otherwise log the probe's reason and fall back to the flex
   route (torch FlexAttention: CPU boxes, head sizes no module is built for), with its reason.
2. Per batch: the spec's tensor arguments from the batch's real inputs (image spans -> `ranges`),
   one plan() per group shared by every layer of the forward pass, run() per layer with that
   layer's q and KV cache. Prefill batches (kind "prefill") and decode batches (kind "decode").
3. Decode under a CUDA graph where a module runs (graph=GraphCapacity): capture once, then
   plan() + replay every step. Skipped, with the reason, on the flex route.
4. The first layer of each group checked against variantgen's dense reference; exit 1 on mismatch.

    python examples/serving_engine.py [--device auto|cuda|cpu] [--spec mm_prefix] [--decode-steps 3]

On a CPU box every group takes the flex route (seconds in all). On an H200 whose cache holds the
modules (build box: `variantgen precompile mm_prefix --head-dim 64,128 --dtype bf16 --kv-dtype
bf16,fp8_e4m3 --kind prefill,decode --arch 9.0a`, then copy cache/ over) the "global" group runs
fa3 prefill and decode (its prefill module) under a CUDA graph, "local" (fp8 KV) fa2, "odd" (head 80)
Flex.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from itertools import accumulate

import torch

import variantgen
from variantgen.wrappers.reference import reference_attention

log = logging.getLogger("engine")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
TOLERANCE = {"bf16": 2.0 ** -7 * 4, "fp16": 2.0 ** -10 * 4}  # relative error: a few units of the query dtype


@dataclass
class LayerGroup:
    """Layers with one attention shape: one KV-cache layout and page table, so one plan per batch."""

    name: str
    layers: list[int]
    head_size: int
    kv_dtype: str
    page_size: int
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    q_dtype: str = "bf16"


@dataclass
class Request:
    prompt_len: int
    image_spans: list[tuple[int, int]]  # inclusive token positions of each image, from the processor


# A hybrid model as a vLLM-style KV-cache manager sees it: layers interleaved across groups. "odd"
# has a head size no FlashInfer module is built for, so it takes the flex route even on a GPU.
MODEL = [LayerGroup("global", [2, 5], 128, "bf16", 16), LayerGroup("local", [0, 1, 3, 4], 64, "fp8_e4m3", 32),
         LayerGroup("odd", [6], 80, "bf16", 16)]
REQUESTS = [Request(40, []), Request(70, [(5, 36)]), Request(50, [(2, 17), (20, 35)])]


class PagedKVCache:
    """DEMO DATA: one group's paged KV cache (K and V per layer, NHD pages) and its page table.
    A real engine's cache manager owns this, and each layer writes its projected K/V into the slots."""

    def __init__(self, g: LayerGroup, num_pages: int, device: torch.device, gen: torch.Generator):
        self.g, self.device, self.gen, self.num_pages = g, device, gen, num_pages
        shape = (num_pages, g.page_size, g.num_kv_heads, g.head_size)
        self.k = {n: torch.zeros(shape, dtype=DTYPES[g.kv_dtype], device=device) for n in g.layers}
        self.v = {n: torch.zeros_like(self.k[n]) for n in g.layers}
        self.free = torch.randperm(num_pages, generator=gen).tolist()  # scattered pages, as after churn
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def reserve(self, rid: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for ``n`` more tokens of request ``rid``: their (page, offset) slots."""
        start, ps = self.lens.get(rid, 0), self.g.page_size
        self.lens[rid] = start + n
        pages = self.pages.setdefault(rid, [])
        while len(pages) * ps < start + n:
            pages.append(self.free.pop())
        pos = range(start, start + n)
        return (torch.tensor([pages[p // ps] for p in pos], device=self.device),
                torch.tensor([p % ps for p in pos], device=self.device))

    def write(self, layer: int, slots: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Demo K/V for the new tokens (a real layer writes its k/v projections here)."""
        shape = (slots[0].numel(), self.g.num_kv_heads, self.g.head_size)
        for cache in (self.k[layer], self.v[layer]):
            new = torch.randn(shape, generator=self.gen).to(cache.dtype).to(self.device)
            if cache.element_size() == 1:  # fp8: write the bytes (index_put_ need not have fp8 kernels)
                cache, new = cache.view(torch.uint8), new.view(torch.uint8)
            cache[slots] = new

    def page_table(self, rids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """plan()'s kv_indptr, kv_indices, last_page_len, on the host: plan() reads them there
        without a device sync, and refuses a bad page entry before any launch."""
        indptr, indices, last = [0], [], []
        for r in rids:
            indices += self.pages[r]
            indptr.append(len(indices))
            last.append((self.lens[r] - 1) % self.g.page_size + 1)
        return tuple(torch.tensor(x, dtype=torch.int32) for x in (indptr, indices, last))


def spec_args(spec: variantgen.VariantSpec, qo_lens: list[int], kv_lens: list[int], spans: list[list],
              device: torch.device) -> dict[str, torch.Tensor]:
    """The spec's tensor arguments from the batch's inputs. This engine knows image spans, i.e.
    `ranges` (main() refuses specs that need other tensors). Queries sit at positions
    kv_len - qo_len ... kv_len - 1, so a decoded text token gets (-1, -1): causal only."""
    return {t.name: variantgen.spans_to_ranges(qo_lens, kv_lens, spans, device=device) for t in spec.tensors}


@dataclass
class GroupBackend:
    """One group's attention: its routes (decided at startup), wrappers and KV cache."""

    g: LayerGroup
    cache: PagedKVCache
    routes: dict[str, str] = field(default_factory=dict)  # kind -> "fa3" / "fa2" / "flex"
    wrappers: dict[str, object] = field(default_factory=dict)
    graph_off: str = ""  # why decode does not run under a CUDA graph ("" = it does)
    decode_graphs: dict[int, DecodeGraph] = field(default_factory=dict)  # by batch size


def pick_route(spec, g: LayerGroup, kind: str, device: torch.device, allow_jit: bool) -> str:
    """The backend for (group, kind): a FlashInfer module only when the probe says it runs here,
    else the flex route the probe chose instead (its reasons for passing over the modules logged)."""
    cfg = dict(head_dim_qk=g.head_size, q_dtype=g.q_dtype, kv_dtype=g.kv_dtype, page_size=g.page_size, kind=kind)
    what = f"group {g.name} (head {g.head_size}, kv {g.kv_dtype}, page {g.page_size}) {kind}"
    if device.type == "cpu" and torch.cuda.is_available():  # a forced CPU run on a GPU box
        r = variantgen.probe(spec, **cfg, backend="flex", device=device)
        passed_over = "--device cpu: FlashInfer modules run on CUDA devices"
    else:  # build=False: look in the cache only (as VARIANTGEN_DISABLE_JIT=1 does), never compile here
        r = variantgen.probe(spec, **cfg, build=allow_jit, device=device if device.type == "cuda" else None)
        if r and r.details["backend"] != "flex":
            log.info("%s: advertising %s on %s (%s, %s)", what, spec.name, r.details["backend"], r.uri, r.source)
            for key in ("note", "row_planner"):  # e.g. fa2 because fa3 is not precompiled; planner off
                if r.details.get(key):
                    log.info("%s: %s: %s", what, key, r.details[key])
            return r.details["backend"]
        # backend=None settles on flex only where no module can run: the probe says why per backend
        not_chosen = r.details.get("not_chosen", {}) if r else {}
        passed_over = "; ".join(f"{b}: {why}" for b, why in not_chosen.items() if b != "flex") or r.reason
    if not r:
        sys.exit(f"{what}: no backend runs here: {r.reason}")
    log.warning("%s: FlashInfer module demoted: %s", what, passed_over)
    log.info("%s: falling back to the flex route (FlexAttention on %s; %s)", what, r.details["device"],
             r.details["checked"])
    return "flex"


def workspace(backend: str, device: torch.device) -> torch.Tensor:
    # Each wrapper gets its own workspace (its plan lives there); Flex needs none.
    return torch.empty(0 if backend == "flex" else 128 << 20, dtype=torch.uint8, device=device)


class DecodeGraph:
    """One group's decode attention, every layer, captured in one CUDA graph for one batch size.
    An engine keeps one per captured size (1, 2, 4, 8, ...) and pads a batch with dummy requests:
    CUDA-core decode in graph mode plans exactly max_batch_size requests. What the graph reads
    are static buffers; plan() (outside the graph) rewrites the wrapper's launch buffers in place."""

    def __init__(self, spec, gb: GroupBackend, batch: int, device: torch.device, allow_jit: bool):
        g, route = gb.g, gb.routes["decode"]
        cap = variantgen.GraphCapacity(max_batch_size=batch, max_total_q=batch, max_kv_pages=gb.cache.num_pages)
        self.w = variantgen.make_wrapper(spec, workspace(route, device), head_dim_qk=g.head_size, q_dtype=g.q_dtype,
                                         kv_dtype=g.kv_dtype, backend=route, kind="decode", graph=cap, build=allow_jit)
        self.gb, self.graph = gb, None
        self.q = {n: torch.zeros(batch, g.num_qo_heads, g.head_size, dtype=DTYPES[g.q_dtype], device=device)
                  for n in g.layers}  # in a captured model the q projection writes here
        self.out = {n: torch.empty_like(self.q[n]) for n in g.layers}
        self.args: dict[str, torch.Tensor] = {}

    def plan(self, table, args: dict[str, torch.Tensor]) -> None:
        g = self.gb.g
        for name, t in args.items():  # spec tensors as static buffers too (a scalar would be baked in)
            self.args.setdefault(name, torch.empty_like(t)).copy_(t)
        self.w.plan(*table, g.num_qo_heads, g.num_kv_heads, g.page_size, **self.args)
        if self.graph is None:  # the first plan: warm up outside the capture, then capture every layer
            self.run_layers()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.run_layers()
            log.info("group %s decode: captured %d layers' run() in one CUDA graph (batch %d)", g.name,
                     len(g.layers), self.q[g.layers[0]].shape[0])

    def run_layers(self) -> None:
        cache = self.gb.cache
        for n in self.gb.g.layers:
            self.w.run(self.q[n], (cache.k[n], cache.v[n]), out=self.out[n], **self.args)


class Engine:
    def __init__(self, spec, device: torch.device, use_graph: bool, allow_jit: bool, seed: int):
        self.spec, self.device, self.allow_jit = spec, device, allow_jit
        self.gen = torch.Generator().manual_seed(seed)
        self.groups: list[GroupBackend] = []
        for g in MODEL:
            gb = GroupBackend(g, PagedKVCache(g, 64, device, self.gen))
            gb.routes = {kind: pick_route(spec, g, kind, device, allow_jit) for kind in ("prefill", "decode")}
            # The probe answers for graph mode too (the flex route says why it has none).
            gb.graph_off = "--no-graph" if not use_graph else variantgen.probe(
                spec, head_dim_qk=g.head_size, q_dtype=g.q_dtype, kv_dtype=g.kv_dtype, page_size=g.page_size,
                kind="decode", backend=gb.routes["decode"], cuda_graph=True, build=allow_jit, device=device).reason
            if gb.graph_off:
                log.info("group %s decode: CUDA graphs off: %s", g.name, gb.graph_off)
            # (graph-mode decode wrappers are made per captured batch size: DecodeGraph)
            for kind in ("prefill", "decode") if gb.graph_off else ("prefill",):
                gb.wrappers[kind] = variantgen.make_wrapper(
                    spec, workspace(gb.routes[kind], device), head_dim_qk=g.head_size, q_dtype=g.q_dtype,
                    kv_dtype=g.kv_dtype, backend=gb.routes[kind], kind=kind, build=allow_jit)
            self.groups.append(gb)
        self.layer_group = {n: gb for gb in self.groups for n in gb.g.layers}
        self.checks: list[tuple[str, float, bool]] = []

    def forward(self, kind: str, rids: list[int], qo_lens: list[int], label: str) -> None:
        # 1. Before the first layer: each group's batch metadata and its one plan() for all its layers.
        batch = {}
        for gb in self.groups:
            g, cache = gb.g, gb.cache
            slots = [cache.reserve(r, n) for r, n in zip(rids, qo_lens)]  # the scheduler's slot allocation
            slots = (torch.cat([s[0] for s in slots]), torch.cat([s[1] for s in slots]))
            table = cache.page_table(rids)
            args = spec_args(self.spec, qo_lens, [cache.lens[r] for r in rids],
                             [REQUESTS[r].image_spans for r in rids], self.device)
            qo_indptr = torch.tensor(list(accumulate(qo_lens, initial=0)), dtype=torch.int32)
            graph = None
            if kind == "decode" and not gb.graph_off:
                graph = gb.decode_graphs.get(len(rids))
                if graph is None:
                    graph = gb.decode_graphs[len(rids)] = DecodeGraph(self.spec, gb, len(rids), self.device,
                                                                      self.allow_jit)
                graph.plan(table, args)
            else:  # the spec tensors go to plan() too: the interval planner cuts the launches from them
                head = (qo_indptr, *table) if kind == "prefill" else table
                gb.wrappers[kind].plan(*head, g.num_qo_heads, g.num_kv_heads, g.page_size, **args)
            batch[g.name] = (slots, table, args, qo_indptr, graph)

        # 2. The layers in model order, each on its group's plan with its own q and KV cache.
        qs, outs = {}, {}
        for n in sorted(self.layer_group):
            gb = self.layer_group[n]
            g, cache = gb.g, gb.cache
            slots, table, args, qo_indptr, graph = batch[g.name]
            cache.write(n, slots)  # demo data: the layer's k/v projections, written into its cache
            qs[n] = torch.randn(sum(qo_lens), g.num_qo_heads, g.head_size, generator=self.gen).to(
                DTYPES[g.q_dtype]).to(self.device)  # demo data: the layer's q projection
            if graph is not None:
                graph.q[n].copy_(qs[n])  # the group's graph runs this layer (below)
            else:
                outs[n] = gb.wrappers[kind].run(qs[n], (cache.k[n], cache.v[n]), **args)
        for gb in self.groups:  # a captured model replays one graph for the whole forward instead
            graph = batch[gb.g.name][-1]
            if graph is not None:
                graph.graph.replay()
                outs.update(graph.out)

        # 3. The first layer of each group against the dense reference.
        for gb in self.groups:
            n, (_, table, args, qo_indptr, _) = gb.g.layers[0], batch[gb.g.name]
            ref_qo = qo_indptr if kind == "prefill" else torch.arange(len(rids) + 1, dtype=torch.int32)
            ref = reference_attention(self.spec, qs[n], (gb.cache.k[n], gb.cache.v[n]), ref_qo, *table, args)
            out = outs[n].float()
            err = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            ok = bool(torch.isfinite(out).all()) and err < TOLERANCE[gb.g.q_dtype]
            self.checks.append((f"{label:13} group {gb.g.name:6} layer {n} ({gb.routes[kind]})", err, ok))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--spec", default="mm_prefix", help="a shipped spec's name or a spec file (default: mm_prefix)")
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--no-graph", action="store_true", help="run decode eagerly on the module route too")
    p.add_argument("--allow-jit", action="store_true", help="build missing modules here (dev boxes; minutes)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    try:
        spec = variantgen.resolve_spec(a.spec)
    except variantgen.SpecError as e:
        p.error(str(e))
    unknown = [t.name for t in spec.tensors if t.name != "ranges"]
    if unknown:  # e.g. doc_ids, slopes: an engine passes what its model and batches provide
        print(f"spec {spec.name} needs tensor(s) {unknown}; this engine provides `ranges` (image spans) only",
              file=sys.stderr)
        return 2

    engine = Engine(spec, device, not a.no_graph, a.allow_jit, a.seed)
    rids = list(range(len(REQUESTS)))
    prompt = [r.prompt_len for r in REQUESTS]
    engine.forward("prefill", rids, prompt, "prefill")  # whole prompts: qo_len = kv_len
    for step in range(a.decode_steps):
        engine.forward("decode", rids, [1] * len(rids), f"decode step {step}")

    print(f"== {spec.name} on {device}: {len(MODEL)} layer groups, {len(REQUESTS)} requests, "
          f"prefill + {a.decode_steps} decode steps ==")
    for gb in engine.groups:
        graphs = "on" if not gb.graph_off else f"off ({gb.graph_off.splitlines()[0]})"
        print(f"group {gb.g.name:6} layers {gb.g.layers}: prefill {gb.routes['prefill']}, decode "
              f"{gb.routes['decode']}, CUDA graphs {graphs}")
    bad = [c for c in engine.checks if not c[2]]
    for label, err, ok in engine.checks:
        print(f"reference check {label}: rel. error {err:.1e} {'ok' if ok else 'MISMATCH'}")
    print(f"{len(engine.checks) - len(bad)} of {len(engine.checks)} reference checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
