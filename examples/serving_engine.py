"""How a vLLM-style serving engine picks an attention backend per layer group.

A hybrid model has several layer groups (head size, KV-cache dtype). For each, the engine
asks variantgen.probe() whether the multimodal-prefix spec can run here, and only then
advertises the spec backend and builds its wrapper; otherwise it demotes the group to a
plain causal backend and logs why. Runs anywhere: on a CPU box every group is demoted.
"""

import logging
from dataclasses import dataclass

import torch

import variantgen
from variantgen.testing import random_paged_batch

SPEC = "mm_prefix"  # a shipped spec, by name (a path to your own spec file works the same)
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
log = logging.getLogger("engine")


@dataclass
class LayerGroup:
    name: str
    head_size: int
    kv_dtype: str  # KV-cache dtype of this group's layers
    q_dtype: str = "bf16"


class Engine:
    def __init__(self, groups: list[LayerGroup]):
        self.wrappers = {}  # group name -> variantgen wrapper, only for groups that passed the probe
        for g in groups:
            # on the GPU it serves from: truthy only when the spec runs there now
            r = variantgen.probe(SPEC, head_dim_qk=g.head_size, q_dtype=g.q_dtype, kv_dtype=g.kv_dtype, device="cuda")
            if r:
                # fa3 on sm90 where valid, else fa2; flex where JIT is off and neither module is precompiled
                backend = r.details["backend"]
                log.info("group %s: advertising mm_prefix backend (%s %s, from %s)", g.name, backend, r.uri,
                         r.source)
                ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
                self.wrappers[g.name] = variantgen.make_wrapper(
                    SPEC, ws, head_dim_qk=g.head_size, q_dtype=g.q_dtype, kv_dtype=g.kv_dtype, backend=backend)
            else:
                log.warning("group %s (head %d, kv %s): demoted to plain causal: %s",
                            g.name, g.head_size, g.kv_dtype, r.reason)

    def dispatch(self, batch: dict) -> str:
        wrapper = self.wrappers.get(batch["group"].name)
        if batch["mm_spans"] and wrapper is not None:
            # The spans go to plan() too: the interval planner reads them to skip known tiles.
            wrapper.plan(*batch["paged"].plan_args(), ranges=batch["ranges"])
            wrapper.run(batch["paged"].q, (batch["paged"].k_cache, batch["paged"].v_cache), ranges=batch["ranges"])
            return f"mm_prefix kernel, {len(batch['mm_spans'])} bidirectional span(s)"
        # A real engine calls its stock causal prefill here (FlashInfer's paged wrapper).
        return "plain causal prefill"


def make_batch(group: LayerGroup, tokens: int, spans: list, gpu: bool) -> dict:
    batch = {"group": group, "mm_spans": spans}
    if gpu:  # real tensors only where a kernel can run
        paged = random_paged_batch([tokens], [tokens], num_qo_heads=8, num_kv_heads=2, head_dim=group.head_size,
                                   page_size=16, dtype=TORCH[group.q_dtype], kv_dtype=TORCH[group.kv_dtype],
                                   device="cuda")
        # the engine's image spans (absolute key positions) as the spec's per-query `ranges`
        batch.update(paged=paged, ranges=variantgen.spans_to_ranges([tokens], [tokens], [spans], device="cuda"))
    return batch


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    groups = [LayerGroup("global", 256, "bf16"), LayerGroup("local", 128, "fp8_e4m3"), LayerGroup("odd", 80, "bf16")]
    engine = Engine(groups)
    gpu = torch.cuda.is_available()
    for spans in ([], [(10, 265)]):
        for g in groups:
            print(f"{g.name:6} {len(spans)} span(s) -> {engine.dispatch(make_batch(g, 300, spans, gpu))}")
