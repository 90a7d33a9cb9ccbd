"""The interval planner's row pass as a generated CUDA kernel (templates/planner/).

The interval planner classifies every query row of a batch (its key interval, then its launch
class: rowrules.py has the rules in torch ops, a few hundred small ops - 3-7 ms of dispatch at
64k query rows on the H200). Here the same rules, specialised to one spec's interval terms,
are rendered into one kernel (plus a sortedness pass for sorted-id terms such as documents),
with the launch builder (templates/plan/) beside it: the planner module's ``plan_batch`` is a
whole plan() in one call (planner.py). It is compiled and cached like any module, under its
own URI ``vg_<spec>_planner_sm<arch>_<hash>``: it depends on the spec's intervals and the arch
only, so every head dim, dtype and backend of a spec shares one. plan() uses it on CUDA when
make_wrapper could build or find it; without it (CPU, or JIT disabled without a precompiled
planner: logged) plan() plans planner-off and its Plan says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, NamedTuple

import torch

from .._version import __version__
from ..abi.table import ROW_BLOCK, SEG_FIELDS, RecField
from ..build.builder import build_module, load_module
from ..build.cache import Cache
from ..codegen import expressions as codegen
from ..codegen.render import KernelArg, RenderedModule, canonical_arch, environment, plan_sources, template_digest
from ..core.errors import JitDisabledError
from ..core.staging import HostStaging
from ..lang.values import VariantSpec
from .intervals import IntervalForm, analyze, args_read

log = logging.getLogger("variantgen.planning.rowplan")

SCALAR_TYPES = {"int": ("int64_t", "int32_t"), "float": ("double", "float"), "bool": ("bool", "bool")}


@dataclass(frozen=True)
class PlannerConfig:
    """One planner module: a spec's interval terms for one arch."""

    spec: VariantSpec
    arch: str
    kind: str = "planner"

    @property
    def arch_tag(self) -> str:
        return canonical_arch(self.arch).replace(".", "")

    @property
    def uri_prefix(self) -> str:
        return f"vg_{self.spec.name}_planner_sm{self.arch_tag}"

    def render(self) -> RenderedModule:
        return render_planner(self)

    def describe(self) -> dict[str, object]:
        return {"spec": self.spec.name, "spec_file": self.spec.path, "kind": self.kind,
                "arch": canonical_arch(self.arch)}


def planner_configs(configs: list[Any]) -> list[PlannerConfig]:
    """The planner modules a set of kernel modules needs: one per (spec, arch) with a paged
    prefill or CUDA-core decode module and usable intervals (what precompile adds to its matrix)."""
    out: dict[str, PlannerConfig] = {}
    for cfg in configs:
        if cfg.kind in ("prefill", "decode") and analyze(cfg.spec).planner_ready:
            planner = PlannerConfig(cfg.spec, cfg.arch)
            out.setdefault(f"{planner.uri_prefix}:{cfg.spec.digest}", planner)
    return list(out.values())


def sorted_id_tensors(form: IntervalForm) -> list[str]:
    """The [total_kv] tensors of sorted-id terms (each gets a per-request sortedness pass)."""
    return sorted({name for t in form.terms for name, _ in t.sorted_eqs})


def planner_inputs(spec: VariantSpec, form: IntervalForm) -> tuple[list[str], list[str]]:
    """(tensors, scalars) the interval terms read, in spec order: plan_rows' extra arguments."""
    read = args_read(form, spec)
    return [t.name for t in spec.tensors if t.name in read], [s.name for s in spec.scalars if s.name in read]


def render_planner(config: PlannerConfig) -> RenderedModule:
    spec = config.spec
    form = analyze(spec)
    if not form.planner_ready:
        raise ValueError(f"spec `{spec.name}` has no usable key intervals ({form.reason}): no planner module")
    tensor_names, scalar_names = planner_inputs(spec, form)
    by_name = {t.name: t for t in spec.tensors}

    def cpp(node) -> str:
        return codegen.emit_row_expr(spec, node).code

    terms = []
    for t in form.terms:
        terms.append({
            "comment": codegen.comment_text(t.describe()),
            "exact": t.exact,
            "conds": [cpp(c) for c in t.conds],
            "lows": [cpp(x) for x in t.lows],
            "highs": [cpp(x) for x in t.highs],
            "chunks": [{"c": cpp(c), "r": cpp(r)} for c, r in t.chunks],
            "sorted_eqs": [{"tensor": name, "cpp_type": by_name[name].cpp_type, "value": cpp(v)}
                           for name, v in t.sorted_eqs],
        })
    sorted_tensors = sorted_id_tensors(form)
    scalars = {s.name: s for s in spec.scalars}
    ctx = {
        "vg_version": __version__,
        "uri": config.uri_prefix,
        "spec": spec,
        "mask_comment": codegen.describe(spec.mask),
        "terms": terms,
        "tensors": [{"name": n, "cpp_type": by_name[n].cpp_type, "shape": list(by_name[n].shape),
                     "rows_name": f"vg_rows_{n}"} for n in tensor_names],
        "sorted_tensors": sorted_tensors,
        "scalars": [{"name": n, "param_type": SCALAR_TYPES[scalars[n].dtype][0],
                     "local_type": SCALAR_TYPES[scalars[n].dtype][1]} for n in scalar_names],
    }
    text = environment().get_template("planner/planner.cu.jinja").render(ctx)
    return RenderedModule(
        config=config,  # type: ignore[arg-type]  # build.py reads uri_prefix, arch, describe(), spec
        files={**plan_sources(), "planner.cu": text},
        compile_units=("planner.cu",),
        tensor_args=tuple(KernelArg(n, by_name[n].cpp_type, "spec tensor") for n in tensor_names),
        scalar_args=tuple(KernelArg(n, SCALAR_TYPES[scalars[n].dtype][0], "spec scalar") for n in scalar_names),
        template_digest=template_digest("planner"),
        host_sources=(),
    )


def load_planner(spec: VariantSpec, arch: str, cache: Cache, *, allow_build: bool = True,
                 jobs: int | None = None) -> tuple[Any | None, str]:
    """(module, "") when the spec's planner module is built or cached, else (None, why).
    Only a disabled JIT without a cached planner gives None; build failures raise."""
    if not analyze(spec).planner_ready:
        return None, "the spec has no usable key intervals"
    config = PlannerConfig(spec, arch)
    try:
        result = build_module(config, cache, jobs=jobs, allow_build=allow_build)
    except JitDisabledError as e:
        log.warning("plans of `%s` run planner-off (one custom launch per request, the mask on every element; "
                    "slower kernels): %s", spec.name, e)
        return None, str(e)
    return load_module(result.entry), ""


class RowPass(NamedTuple):
    """The row kernel's outputs on the device (kept across plans by the caller)."""

    rec: torch.Tensor  # int64 [len(RecField), total_q]
    counts: torch.Tensor  # int32 [ceil(total_q / ROW_BLOCK)]: launch requests starting per block
    seg: torch.Tensor  # int64 [1 + SEG_FIELDS * capacity]: their count, then the compacted requests
    page_size: int


def plan_rows(module: Any, spec: VariantSpec, form: IntervalForm, args: dict[str, Any], qo_indptr: list[int],
              kv_lens: list[int], page_size: int, device: torch.device, staging: HostStaging | None = None,
              segment_capacity: int = 1024, buffers: dict[str, torch.Tensor] | None = None) -> RowPass:
    """Run the row pass over a batch (plan() runs it inside plan_batch; this is its entry for
    tests and tools). rec: what rowrules.classify_rows gives (``starts`` as 0/1; a custom run's
    first row holds the run's hull); seg: the launch requests compacted (read_segments).
    ``buffers``: the caller's dict to keep the outputs and scratch in from one call to the next."""
    batch = len(kv_lens)
    starts_host = torch.tensor([qo_indptr, list(accumulate(kv_lens, initial=0))], dtype=torch.int64)
    total_q = qo_indptr[-1]
    tensor_names, scalar_names, defaults, sorted_count = call_layout(spec, form)
    kept = row_buffers(buffers if buffers is not None else {}, batch, total_q, sorted_count, segment_capacity,
                       device)
    rows = RowPass(rec=kept.rec[:len(RecField) * total_q].view(len(RecField), total_q),
                   counts=kept.counts[:max(1, -(-total_q // ROW_BLOCK))],
                   seg=kept.seg[:1 + SEG_FIELDS * max(1, segment_capacity)], page_size=page_size)
    if staging is not None and buffers is not None:
        staging.queued()  # the starts' copy, out of a kept page-locked buffer
    module.plan_rows(rows.rec, starts_host, kept.starts_page_locked, kept.starts, kept.scratch, rows.counts, rows.seg,
                     *(args[n] for n in tensor_names), *(args.get(n, defaults[n]) for n in scalar_names), page_size)
    return rows


class RowBuffers(NamedTuple):
    """The row pass's buffers, kept across plans (each at least as large as the batch needs)."""

    starts_page_locked: torch.Tensor  # int64 host, page-locked: the request starts on their way up
    starts: torch.Tensor  # int64 device: qo_indptr, then each request's first key row
    rec: torch.Tensor  # int64 device, len(RecField) * total_q
    counts: torch.Tensor  # int32 device, a count per ROW_BLOCK rows
    scratch: torch.Tensor  # uint8 device: per-request sortedness flags of sorted-id tensors
    seg: torch.Tensor  # int64 device, 1 + SEG_FIELDS * segment_capacity


def row_buffers(kept: dict[str, torch.Tensor], batch: int, total_q: int, sorted_count: int,
                segment_capacity: int, device: torch.device) -> RowBuffers:
    """The row pass's buffers for a batch, from ``kept`` (plan_rows' and plan_batch's)."""
    host = torch.device("cpu")
    return RowBuffers(
        starts_page_locked=kept_buffer(kept, "starts_page_locked", 2 * (batch + 1), torch.int64, host, device),
        starts=kept_buffer(kept, "starts", 2 * (batch + 1), torch.int64, device),
        rec=kept_buffer(kept, "rec", len(RecField) * total_q, torch.int64, device),
        counts=kept_buffer(kept, "counts", max(1, -(-total_q // ROW_BLOCK)), torch.int32, device),
        scratch=kept_buffer(kept, "scratch", max(1, sorted_count * batch), torch.uint8, device),
        seg=kept_buffer(kept, "seg", 1 + SEG_FIELDS * max(1, segment_capacity), torch.int64, device))


def kept_buffer(kept: dict[str, torch.Tensor], name: str, numel: int, dtype: torch.dtype, where: torch.device,
                device: torch.device | None = None) -> torch.Tensor:
    """``kept[name]``, a buffer of at least ``numel`` on ``where`` (grown, never shrunk: batch
    sizes vary). Host buffers are page-locked when ``device`` (the one they feed) is CUDA."""
    buf = kept.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != where:
        size = max(numel, 2 * buf.numel() if buf is not None else 0)
        pinned = where.type == "cpu" and device is not None and device.type == "cuda"
        buf = kept[name] = torch.empty(size, dtype=dtype, device=where, pin_memory=pinned)
    return buf


_LAYOUTS: dict[tuple[int, int], tuple] = {}


def call_layout(spec: VariantSpec, form: IntervalForm) -> tuple[list[str], list[str], dict[str, Any], int]:
    """plan_rows' argument layout for a spec and its intervals: (tensor names, scalar names,
    scalar defaults, sorted-id tensors). Kept per (spec, form) object: plan() asks every time."""
    key = (id(spec), id(form))
    hit = _LAYOUTS.get(key)
    if hit is None or hit[0] is not spec or hit[1] is not form:
        tensor_names, scalar_names = planner_inputs(spec, form)
        hit = (spec, form, tensor_names, scalar_names, {s.name: s.default for s in spec.scalars},
               len(sorted_id_tensors(form)))
        _LAYOUTS[key] = hit
    return hit[2:]


def read_segments(module: Any, rows: RowPass, expect: int | None = None) -> torch.Tensor:
    """The launch requests plan_rows compacted, on the host: int64 [count, SEG_FIELDS]
    (rowrules.segments' rows). One small device-to-host copy of the first ``expect`` of them
    (default: all the buffer holds); a second copy if there are more, and a second pass with
    room for all if ``seg`` was too small."""
    seg = rows.seg
    room = (seg.numel() - 1) // SEG_FIELDS
    head = min(room, expect) if expect else room
    host = seg[:1 + SEG_FIELDS * head].cpu()
    count = int(host[0])
    if count > room:
        seg = torch.empty(1 + SEG_FIELDS * count, dtype=torch.int64, device=seg.device)
        module.compact_segments(rows.rec, rows.counts, seg, rows.page_size)
        host = seg.cpu()
    elif count > head:
        host = seg[:1 + SEG_FIELDS * count].cpu()
    return host[1:1 + SEG_FIELDS * count].view(count, SEG_FIELDS)
