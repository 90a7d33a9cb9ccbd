"""templates/ -> the sources of one module.

A ``ModuleConfig`` (spec + head dims + dtypes + backend + arch + mask modes) fully
determines the rendered files; rendering is pure, so the cache key can hash its output.

FlashInfer's habit: static C++ lives in real ``.cuh`` / ``.cu`` files of templates/common, fa2
and fa3 (the expression helpers, FlashInfer's kernel parameters, the plan functions, the
bindings that name no spec), copied into a module's sources as they are; Jinja renders only what
depends on the spec and the config - the variant, the config (dtypes, head dims, the spec's
arguments, the mask-mode dispatch) and one instantiation per mask mode and CTA tile (fa2 paged
prefill: per run() code - its exact launches' units compile no spec mask). Units that
name nothing of the spec - the fa3 plain kernels of a spec without a logits transform or sink,
the launch builder's plan.cu - are marked shared (SharedUnit): build.py compiles each once per
cache (objects.py). The template digest covers every file of a backend's folders. Which
combinations a backend generates is the capability table's business (capabilities.py); the C++
of the spec's expressions is codegen.py's. Templates are loaded once per process, with
StrictUndefined: a missing variable is an error, never an empty string in generated C++. What
they are rendered with is a typed dataclass (context.py's RenderContext, render_context), the
tests check the templates' variables against its fields.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import jinja2

from .._version import __version__
from ..abi import table as plan_abi
from ..abi.table import MaskMode
from ..core.env import TEMPLATES_DIR, settings
from ..core.errors import VariantgenError
from ..lang import nodes
from ..lang.reads import page_list_atoms
from ..lang.values import VariantSpec
from ..routing.capabilities import KINDS, canonical_arch
from ..routing.config import DEFAULT_MASK_MODES, DTYPES, FA2_CTA_TILES_Q, MASK_MODES, ModuleConfig  # noqa: F401 (re-exported)
from . import expressions as codegen
from . import fi_versions, kv_tile
from .context import (
    STANDALONE,
    UNIT_CONTEXTS,
    Fa2KernelUnit,
    Fa3Binding,
    Fa3KernelUnit,
    Fa3PlainKernel,
    KernelArg,
    RenderContext,
    shallow,
)


@dataclass(frozen=True)
class SharedUnit:
    """A compile unit whose text names nothing of the spec (objects.py): its object is compiled
    once per cache under ``prefix`` + a hash of its inputs and linked into every module that
    has the same unit."""

    file: str  # the unit among the module's compile units
    prefix: str  # the object's readable name, e.g. vg_fa3_plain_paged_causal_qbf16_..._sm90a


@dataclass(frozen=True)
class RenderedModule:
    config: ModuleConfig
    files: dict[str, str]  # generated file name -> text
    compile_units: tuple[str, ...]  # generated .cu files to compile
    tensor_args: tuple[KernelArg, ...]  # run() extra tensors, in ABI order
    scalar_args: tuple[KernelArg, ...]  # run() extra scalars, in ABI order
    template_digest: str
    # FlashInfer csrc files compiled into the module (its host code for this kind)
    host_sources: tuple[str, ...] = ("batch_prefill_paged.cu",)
    # compile units shared with other modules (compiled once per cache, objects.py)
    shared_units: tuple[SharedUnit, ...] = ()

    def source_digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + self.files[name].encode() + b"\0")
        return h.hexdigest()

    def includes(self, unit: str) -> list[str]:
        """The module files ``unit`` includes, directly or through them (quoted includes that
        name a module file), sorted."""
        seen, todo = set(), [unit]
        while todo:
            for name in _QUOTED_INCLUDE.findall(self.files[todo.pop()]):
                if name in self.files and name not in seen:
                    seen.add(name)
                    todo.append(name)
        return sorted(seen)

    def unit_digest(self, unit: str) -> str:
        """sha256 over a compile unit and every module file it includes: what its object is made
        of, besides FlashInfer's headers, the flags and the toolchain (a shared unit's key)."""
        h = hashlib.sha256()
        for name in (unit, *self.includes(unit)):
            h.update(name.encode() + b"\0" + self.files[name].encode() + b"\0")
        return h.hexdigest()


_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


@functools.lru_cache(maxsize=4)
def _environment(template_dir: str) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(template_dir),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_root() -> Path:
    """The template folder in use (VARIANTGEN_TEMPLATE_DIR or the package's); an error that
    names it when it is not a template tree, before Jinja or the digest reads from it."""
    root = settings().template_dir
    missing = [d for d in sorted({d for dirs in TEMPLATE_DIRS.values() for d in dirs}) if not (root / d).is_dir()]
    if missing:
        where = (f"VARIANTGEN_TEMPLATE_DIR={root}" if root != TEMPLATES_DIR
                 else f"{root} (this variantgen installation lacks its templates: reinstall the package)")
        raise VariantgenError(f"template folder {where}: expected the subfolders {', '.join(missing)}")
    return root


def environment() -> jinja2.Environment:
    return _environment(str(template_root()))


# What a backend's modules use ("planner": the interval planner's row kernel, variantgen/planning/rowplan.py).
# plan/: the launch builder, static C++ compiled into the planner module and every paged-prefill module
TEMPLATE_DIRS = {"fa2": ("common", "fa2", "plan"), "fa3": ("common", "fa3", "plan"),
                 "planner": ("common", "planner", "plan")}
# templates/plan/, as they are
PLAN_HEADERS = ("plan_module.h", "launches.h", "fa3_worklist.h", "gather.cuh", "read_indices.cuh",
                "merge_pieces.cuh", "row_classes.h")


def template_files(backend: str = "fa2") -> list[Path]:
    """The templates and static sources a backend's modules are made of."""
    root = template_root()
    return sorted(p for d in TEMPLATE_DIRS[backend] for p in (root / d).iterdir() if p.is_file())


@functools.lru_cache(maxsize=8)
def _template_digest(template_dir: str, backend: str) -> str:
    h = hashlib.sha256()
    for d in TEMPLATE_DIRS[backend]:
        for p in sorted(q for q in (Path(template_dir) / d).iterdir() if q.is_file()):
            h.update(f"{d}/{p.name}".encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def static_source(name: str) -> str:
    """A static C++ file of the template tree (copied into a module's sources as it is)."""
    return (template_root() / name).read_text()


def _static(*names: str, **renamed: str) -> dict[str, str]:
    """Static sources as module files: under their own file name, or (``renamed``) under
    another (``binding_cu="fa2/paged_binding.cu"`` is the module's binding.cu)."""
    files = {name.rsplit("/", 1)[-1]: static_source(name) for name in names}
    files.update({key.replace("_", "."): static_source(name) for key, name in renamed.items()})
    return files


def template_digest(backend: str = "fa2") -> str:
    return _template_digest(str(template_root()), backend)


def plan_sources() -> dict[str, str]:
    """The launch builder's sources (templates/plan/) and the plan ABI's header, as a module's
    files: what the planner module and every paged-prefill module compile their plans with."""
    files = {plan_abi.HEADER_NAME: plan_abi.header_text()}
    files.update((name, static_source(f"plan/{name}")) for name in PLAN_HEADERS)
    return files


def _sink_locals(builtins: frozenset[str], target: codegen.Target, indent: str, *, kv_head_idx: bool) -> str:
    """The locals a sink hook needs: its query head from ``qo_head_idx``, and its key/value head
    from ``kv_head_idx`` where the hook has one (fa3's constructor) or from the group size (fa2's
    m/d update and output transform get only the query head)."""
    lines = []
    if "qo_head" in builtins:
        lines.append(codegen.LOCAL_DEFS["qo_head"][0])
    if "kv_head" in builtins:
        lines.append(codegen.LOCAL_DEFS["kv_head"][0] if kv_head_idx else
                     f"const int32_t kv_head = int32_t(qo_head_idx) / ({target.num_qo_heads} / "
                     f"{target.num_kv_heads});")
    return "\n".join(indent + line for line in lines)


def struct_name(spec: VariantSpec) -> str:
    return "VG_" + "".join(part.capitalize() for part in spec.name.split("_"))


def kernel_args(spec: VariantSpec) -> tuple[tuple[KernelArg, ...], tuple[KernelArg, ...]]:
    """run()'s extra arguments in ABI order: spec tensors, vg_meta; spec scalars, internals."""
    tensors = [KernelArg(t.name, t.cpp_type, f"spec tensor {list(t.shape)}") for t in spec.tensors]
    tensors.append(KernelArg("vg_meta", "int32_t", "per launch request metadata [n, VG_META_STRIDE]"))
    scalar_types = {"int": "int64_t", "float": "double", "bool": "bool"}
    scalars = [KernelArg(s.name, scalar_types[s.dtype], f"spec scalar ({s.dtype})") for s in spec.scalars]
    scalars.append(KernelArg("sm_scale", "double", "softmax scale, q/k scales folded in"))
    if spec.qkv_scales:
        scalars.append(KernelArg("v_scale", "double", "value scale, applied to the output"))
    return tuple(tensors), tuple(scalars)


# How each backend's hooks reach their arguments (see codegen.Target).
CODEGEN_TARGETS = {("fa2", "prefill"): codegen.FA2_PAGED, ("fa2", "decode"): codegen.FA2_PAGED,
                   ("fa2", "ragged"): codegen.FA2_RAGGED, ("fa3", "prefill"): codegen.FA3,
                   ("fa3", "ragged"): codegen.FA3}


def _logits_scales(logits: codegen.LogitsCode, params: str) -> str:
    """The variant constructor's lines that set the transform's score scale, the softmax's scale
    and the transform's launch-uniform members (after the scalars they read)."""
    lines = ["    // The transform reads the scaled score; the softmax then exponentiates its result. Launch-uniform",
             "    // factors of the transform are folded into the two scales, once per CTA (logits_fold.py):"]
    lines += [f"    //   {note}" for note in logits.folded] or ["    //   none here"]
    lines.append(f"    sm_scale = float({params}.sm_scale){logits.score_scale};")
    lines.append(f"    sm_scale_log2 = {logits.softmax_scale + ' * ' if logits.softmax_scale else ''}math::log2e;")
    lines += [f"    {name} = {value};" for _, name, value in logits.hoisted]
    return "\n".join(lines)


def render_context(config: ModuleConfig, facts: fi_versions.FlashInferFacts | None = None) -> RenderContext:
    """What every backend's templates need (context.py): the spec's mask/logits/sink as C++, its
    args, the module's dtypes, head dims and mask modes, and ``facts``' (the installed FlashInfer's
    by default) version-dependent bits. The backends' renderers add their own fields."""
    spec = config.spec
    target = CODEGEN_TARGETS[(config.backend, config.kind)]
    mask = codegen.emit_mask(spec, target)
    logits = codegen.emit_logits_folded(spec, target=target)
    sink = codegen.emit_sink(spec, target)
    tensor_args, scalar_args = kernel_args(spec)
    scalar_local = {"int": "int32_t", "float": "float", "bool": "bool"}
    return RenderContext(
        vg_version=__version__,
        spec=spec,
        uri=config.uri_prefix,
        kind=config.kind,
        kind_text=KINDS[config.kind],
        struct_name=struct_name(spec),
        mask_text=codegen.comment_lines(spec.mask_text),
        mask_canonical=codegen.comment_lines(nodes.to_source(spec.mask)),
        mask_code=mask.broken(),
        mask_locals=codegen.hook_locals(mask.builtins, target=target),
        mask_divisors=mask.divisors,
        logits=logits is not None,
        logits_text=codegen.comment_lines(spec.logits_text or "") if logits else [],
        logits_code=logits.code if logits else "",
        logits_hoisted=logits.hoisted if logits else (),
        logits_scales=_logits_scales(logits, "args" if config.backend == "fa3" else "params") if logits else "",
        logits_locals=codegen.hook_locals(logits.builtins, target=target) if logits else "",
        mask_only_locals=codegen.hook_locals(mask.builtins, "      ", frozenset(
            codegen.local_names(logits.builtins) if logits else ()), target=target),
        sink=sink is not None,
        sink_comment=codegen.describe(spec.sink) if spec.sink is not None else "",
        sink_code=sink.code if sink else "",
        sink_locals=(_sink_locals(sink.builtins, target, " " * (8 if config.kind == "decode" else 6),
                                  kv_head_idx=config.backend == "fa3") if sink else ""),
        scalars=[{"name": s.name, "dtype": s.dtype, "local_type": scalar_local[s.dtype]} for s in spec.scalars],
        tensor_params=tensor_args,
        scalar_params=scalar_args,
        dtype_q=DTYPES[config.q_dtype][0],
        dtype_kv=DTYPES[config.kv_dtype][0],
        dtype_o=DTYPES[config.o_dtype][0],
        head_dim_qk=config.head_dim_qk,
        head_dim_vo=config.head_dim_vo,
        mask_modes=[{"name": m, "literal": MASK_MODES[m][1]} for m in config.mask_modes],
        **fi_versions.template_context(facts or flashinfer_facts()),
    )


def render_template(env: jinja2.Environment, name: str, ctx: RenderContext,
                    unit: Fa2KernelUnit | Fa3KernelUnit | Fa3Binding | None = None) -> str:
    """Module template ``name`` rendered with the module's context and, for the templates of
    context.UNIT_CONTEXTS, one unit's variables (``unit``, of the dataclass it names there)."""
    expected = STANDALONE.get(name) or UNIT_CONTEXTS.get(name) or type(None)
    if name in STANDALONE or type(unit) is not expected:
        raise TypeError(f"{name}: rendered with {type(unit).__name__}, expected {expected.__name__}")
    return env.get_template(name).render(ctx.variables(), **(shallow(unit) if unit is not None else {}))


class RenderedSources(NamedTuple):
    """What a backend's renderer makes of the context (render_module adds the shared headers)."""

    files: dict[str, str]  # file name -> text
    compile_units: list[str]  # the files nvcc compiles into the module
    host_sources: tuple[str, ...] = ()  # FlashInfer's own host sources compiled beside them
    shared_units: tuple[SharedUnit, ...] = ()  # units whose objects are shared between modules (objects.py)


# A renderer turns the context into the module's sources.
Renderer = Callable[[ModuleConfig, RenderContext, jinja2.Environment], RenderedSources]


# Every fa2 module's static sources (templates/common and templates/fa2).
FA2_STATIC = ("common/vg_helpers.cuh", "fa2/config_prelude.cuh", "fa2/kernel_params.cuh")


def fa2_kernel_modes(ctx: RenderContext, tail: bool) -> list[dict[str, str]]:
    """The run() codes an fa2 prefill module compiles, each as (name, its C++ case label, its
    FlashInfer mask mode, the variant it instantiates). Modes none and causal run the variant
    without the spec's mask (``<struct>Exact``): their launches are exact - paged prefill's
    (plan.py's Launch.exact) by the launch builder, ragged prefill's by ragged.launch_mask_mode,
    which picks them only for a mask that is exactly the mode. Custom runs the masked variant, and
    so does ``tail`` (paged prefill): fa2's tail launch, mode causal under a code of its own; and
    there, for a mask the planner may read through page lists (lang/reads.py), custom launch
    requests over page lists: the listed variant under a code of its own (LISTED_RUN_CODE)."""
    masked = ctx.struct_name
    modes = []
    for m in ctx.mask_modes:
        plain = m["name"] != plan_abi.MaskMode.CUSTOM.label
        modes.append(dict(m, case=m["literal"], variant=f"{masked}Exact" if plain else masked))
        if tail and m["name"] == plan_abi.MaskMode.CAUSAL.label:
            modes.append(dict(m, name="causal_tail", case="static_cast<MaskMode>(vg_abi::kFa2TailRunCode)",
                              variant=masked))
        if tail and not plain and page_list_atoms(ctx.spec.mask):
            modes.append(dict(m, name="custom_listed", case="static_cast<MaskMode>(vg_abi::kListedRunCode)",
                              variant=f"{masked}Listed"))
    return modes


def _render_fa2_per_tile(config: ModuleConfig, ctx: RenderContext, env: jinja2.Environment, *, config_template: str,
                         binding: str, kernel_template: str, unit_prefix: str, host_source: str,
                         plan: bool = False):
    """The FA2 prefill kinds: variant and config rendered, the static sources and the binding
    (``binding``: its template, or its static source), plus the kernel units of every run() code
    (fa2_kernel_modes) and CTA tile (what FlashInfer's FA2 planner may pick; fa2_kernel_units),
    and FlashInfer's host code; ``plan``: the launch builder's unit too, and the tail launch's."""
    ctx = replace(ctx, kernel_modes=fa2_kernel_modes(ctx, tail=plan))
    files = {
        "variant.cuh": render_template(env, "fa2/variant.cuh.jinja", ctx),
        "batch_prefill_config.inc": render_template(env, config_template, ctx),
        **_static(*FA2_STATIC, "fa2/prefill_plan.cuh"),
        "binding.cu": (render_template(env, binding, ctx) if binding.endswith(".jinja") else
                       static_source(binding)),
    }
    units = ["binding.cu"]
    if plan:  # the launch builder (paged prefill: plan() builds its launches with it)
        files.update(plan_sources(), **{"plan.cu": static_source("plan/plan.cu")})
        units.append("plan.cu")
    kernel_units = fa2_kernel_units(config, ctx.kernel_modes)
    for cta, num_mma_kv, modes in kernel_units:
        name = f"{unit_prefix}_cta{cta}.cu" if num_mma_kv else f"{unit_prefix}_{modes[0]['name']}_cta{cta}.cu"
        files[name] = render_template(env, kernel_template, ctx, Fa2KernelUnit(modes, cta, num_mma_kv))
        units.append(name)
    if any(num_mma_kv for _, num_mma_kv, _ in kernel_units):
        files.update(_static("fa2/pinned_kv_tile.cuh"))
    return RenderedSources(files, units, (host_source,))


def fa2_kernel_units(config: ModuleConfig, modes: list[dict[str, str]]
                     ) -> list[tuple[int, int | None, list[dict[str, str]]]]:
    """The kernel units of an fa2 prefill module, as (CTA tile, its pinned KV tile or None, the
    run() codes it instantiates). Where the module's arch fixes FlashInfer's KV tile
    (kv_tile.py), a unit holds one kernel per code, so every code of a CTA tile goes into one
    unit: a unit's build is mostly parsing FlashInfer's headers, which it then does once for all
    of them. Otherwise FlashInfer's dispatch instantiates four KV tiles per code, and each code
    gets a unit of its own (the units build in parallel)."""
    out = []
    for cta in FA2_CTA_TILES_Q:
        pinned = kv_tile.fa2_num_mma_kv(cta, config.head_dim_qk, config.head_dim_vo, DTYPES[config.q_dtype][1],
                                        DTYPES[config.kv_dtype][1], canonical_arch(config.arch))
        out += [(cta, pinned, modes)] if pinned else [(cta, None, [mode]) for mode in modes]
    return out


def _plan_unit(config: ModuleConfig) -> SharedUnit:
    """The launch builder's unit (templates/plan/plan.cu): static, and the same in every paged-prefill
    module of a backend, so compiled once per cache."""
    return SharedUnit("plan.cu", f"vg_{config.backend}_plan_sm{config.arch_tag}")


def _render_fa2_prefill(config: ModuleConfig, ctx: RenderContext, env: jinja2.Environment):
    files, units, hosts, _ = _render_fa2_per_tile(
        config, ctx, env, config_template="fa2/config.inc.jinja", binding="fa2/paged_binding.cu",
        kernel_template="fa2/paged_kernel.cu.jinja", unit_prefix="paged_kernel", host_source="batch_prefill_paged.cu",
        plan=True)
    return RenderedSources(files, units, hosts, (_plan_unit(config),))


def _render_fa2_decode(config: ModuleConfig, ctx: RenderContext, env: jinja2.Environment):
    """FlashInfer's FA2 (CUDA-core) batch decode: one kernel unit (every GQA group size, the spec's
    variant and the exact one), its host code (batch_decode.cu) compiled against our config, and
    again for the exact variant (decode_exact_host.cu: run_exact), our plan + run binding."""
    files = {
        "variant.cuh": render_template(env, "fa2/variant.cuh.jinja", ctx),
        "batch_decode_config.inc": render_template(env, "fa2/decode_config.inc.jinja", ctx),
        **_static(*FA2_STATIC, "plan/read_indices.cuh", "fa2/decode_exact_host.cu",
                  binding_cu="fa2/decode_binding.cu"),
        "decode_kernel.cu": render_template(env, "fa2/decode_kernel.cu.jinja", ctx),
    }
    return RenderedSources(files, ["binding.cu", "decode_kernel.cu", "decode_exact_host.cu"], ("batch_decode.cu",))


FA2_DISPATCHED_CTA_TILES_Q = (16, 32, 64, 128)  # what FlashInfer's DISPATCH_CTA_TILE_Q can name


def _render_fa2_ragged(config: ModuleConfig, ctx: RenderContext, env: jinja2.Environment):
    """FlashInfer's FA2 ragged-KV prefill: the kernel units of every mask mode and CTA tile, its
    host code (batch_prefill.cu) compiled against our config, our plan + ragged_run binding."""
    ctx = replace(ctx, cta_tiles=list(FA2_CTA_TILES_Q), all_cta_tiles=list(FA2_DISPATCHED_CTA_TILES_Q))
    return _render_fa2_per_tile(config, ctx, env, config_template="fa2/ragged_config.inc.jinja",
                                binding="fa2/ragged_binding.cu.jinja",
                                kernel_template="fa2/ragged_kernel.cu.jinja", unit_prefix="ragged_kernel",
                                host_source="batch_prefill.cu")


def plain_is_shared(spec: VariantSpec) -> bool:
    """Whether the spec's plain launches ('none', 'causal') compute plain attention - no logits
    transform or sink; a value scale is the plain kernel's argument -, so that fa3 modules run
    them on the shared plain kernel units (templates/fa3/plain_variant.cuh) instead of units of
    their own."""
    return spec.logits is None and spec.sink is None


PLAIN_VARIANT = "vg::Fa3PlainVariant<false>"


def _fa3_launches(ctx: RenderContext, *, ragged: bool = False) -> list[dict[str, object]]:
    """The kernel instantiations of an fa3 module, by run()'s mask-mode code: 'none' and
    'causal' run the plain variant (causal with and without a left window; a ragged launch has
    no window); 'custom' is a non-causal launch of the masked variant (FA3 has no kCustom), and
    'custom_listed' (paged, a mask the planner may list: lang/reads.py) of the listed variant.
    ``call``: the binding's launch helper for it (run.cuh, ragged_run.cuh); ``shared``: a plain
    launch of the shared plain kernel (plain_is_shared)."""
    spec = ctx.spec
    plain = PLAIN_VARIANT if plain_is_shared(spec) else ctx.struct_name
    masked = ctx.struct_name + "Masked"
    out = []
    for mode in ctx.mask_modes:
        name = mode["name"]
        # run()'s code is the plan ABI's MaskMode; FA3 has no kCustom, so CUSTOM launches the masked
        # variant with the kernel's kNone
        if name == "none":
            out.append(dict(name="none", code=int(MaskMode.NONE), mask_literal="MaskMode::kNone", window="false",
                            variant=plain))
        elif name == "causal":
            for window in ("false", "true"):
                out.append(dict(name="causal" if window == "false" else "causal_window", code=int(MaskMode.CAUSAL),
                                mask_literal="MaskMode::kCausal", window=window, variant=plain))
        else:
            out.append(dict(name="custom", code=int(MaskMode.CUSTOM), mask_literal="MaskMode::kNone",
                            window="false", variant=masked))
            if not ragged and page_list_atoms(spec.mask):  # custom launch requests over page lists
                out.append(dict(name="custom_listed", code=plan_abi.LISTED_RUN_CODE, mask_literal="MaskMode::kNone",
                                window="false", variant=ctx.struct_name + "Listed"))
    for launch in out:
        launch["causal"] = launch["code"] == int(MaskMode.CAUSAL)  # the binding picks by window_left within it
    if ragged:
        out = [la for la in out if la["name"] != "causal_window"]
    for launch in out:
        launch["shared"] = launch["variant"] == PLAIN_VARIANT
        # the shared kernel's value scale: run()'s v_scale where the spec has q/k/v scales
        launch["call_args"] = ("vg_arg_v_scale, " if spec.qkv_scales else "1.0, ") if launch["shared"] else ""
        if ragged:
            launch["call"] = (f"LaunchRaggedPlain<{launch['mask_literal']}>" if launch["shared"] else
                              f"LaunchRagged<{launch['mask_literal']}, {launch['variant']}>")
        else:
            launch["call"] = (f"LaunchPlain<{launch['mask_literal']}, {launch['window']}>" if launch["shared"] else
                              f"Launch<{launch['mask_literal']}, {launch['window']}, {launch['variant']}>")
        launch["comment"] = (f"{launch['mask_literal']}, LEFT_SLIDING_WINDOW={launch['window']}, "
                             f"variant {launch['variant']}")
    return out


CUTLASS_TYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t",
                 "fp8_e4m3": "cutlass::float_e4m3_t", "fp8_e5m2": "cutlass::float_e5m2_t"}


def _fa3_context(config: ModuleConfig, ctx: RenderContext) -> RenderContext:
    return replace(ctx, cutlass_q=CUTLASS_TYPES[config.q_dtype], cutlass_kv=CUTLASS_TYPES[config.kv_dtype],
                   cutlass_o=CUTLASS_TYPES[config.o_dtype], plain_shared=plain_is_shared(ctx.spec))


FA3_STATIC = ("common/vg_helpers.cuh", "fa3/cutlass_prelude.cuh", "fa3/kernel_params.cuh",
              "fa3/fill_params.cuh", "fa3/epilogue_barrier.cuh", "fa3/plain_variant.cuh")


def _fa3_kernel_units(config: ModuleConfig, ctx: RenderContext, env: jinja2.Environment,
                      launches: list[dict[str, object]], *,
                      ragged: bool) -> tuple[dict[str, str], list[SharedUnit]]:
    """One unit per launch: the spec's variant rendered into the kind's kernel template, or, for
    a shared plain launch, the plain kernel template from the head dims, dtypes and launch alone
    (no spec in its context, so its text is the same in every module)."""
    prefix = "ragged_kernel" if ragged else "paged_kernel"
    plain = env.get_template("fa3/plain_kernel.cu.jinja")
    files, shared = {}, []
    for launch in launches:
        name = f"{prefix}_{launch['name']}.cu"
        if launch["shared"]:
            files[name] = plain.render(shallow(Fa3PlainKernel(
                vg_version=__version__, ragged=ragged, launch=launch, head_dim_qk=config.head_dim_qk,
                head_dim_vo=config.head_dim_vo, dtype_q=ctx.dtype_q, dtype_kv=ctx.dtype_kv, dtype_o=ctx.dtype_o,
                cutlass_q=CUTLASS_TYPES[config.q_dtype], cutlass_kv=CUTLASS_TYPES[config.kv_dtype],
                cutlass_o=CUTLASS_TYPES[config.o_dtype])))
            shared.append(SharedUnit(name, f"vg_fa3_plain_{'ragged' if ragged else 'paged'}_{launch['name']}"
                                           f"_q{config.q_dtype}_kv{config.kv_dtype}_o{config.o_dtype}"
                                           f"_hd{config.head_dim_qk}x{config.head_dim_vo}_sm{config.arch_tag}"))
        else:
            files[name] = render_template(env, f"fa3/{prefix}.cu.jinja", ctx, Fa3KernelUnit(launch))
    return files, shared


def _render_fa3_prefill(config: ModuleConfig, ctx: RenderContext, env: jinja2.Environment):
    launches = _fa3_launches(ctx)
    ctx = _fa3_context(config, ctx)
    files = {
        "variant.cuh": render_template(env, "fa3/variant.cuh.jinja", ctx),
        "batch_prefill_sm90_config.inc": render_template(env, "fa3/config.inc.jinja", ctx),
        **_static(*FA3_STATIC, "fa3/run.cuh"),
        "binding.cu": render_template(env, "fa3/binding.cu.jinja", ctx, Fa3Binding(launches)),
        **plan_sources(),
        "plan.cu": static_source("plan/plan.cu"),
    }
    kernels, shared = _fa3_kernel_units(config, ctx, env, launches, ragged=False)
    files.update(kernels)
    # host code: our binding, no FlashInfer host source
    return RenderedSources(files, ["binding.cu", "plan.cu", *kernels], (), (_plan_unit(config), *shared))


def _render_fa3_ragged(config: ModuleConfig, ctx: RenderContext, env: jinja2.Environment):
    """FlashInfer's sm90 ragged-KV prefill: one kernel unit per mask mode (a ragged launch has no
    left window), our plan (the paged modules' fa3 work list) and ragged_run binding."""
    launches = _fa3_launches(ctx, ragged=True)
    ctx = _fa3_context(config, ctx)
    files = {
        "variant.cuh": render_template(env, "fa3/variant.cuh.jinja", ctx),
        "batch_prefill_sm90_config.inc": render_template(env, "fa3/config.inc.jinja", ctx),
        **_static(*FA3_STATIC, "fa3/ragged_run.cuh", "plan/fa3_worklist.h"),
        "binding.cu": render_template(env, "fa3/ragged_binding.cu.jinja", ctx, Fa3Binding(launches)),
    }
    kernels, shared = _fa3_kernel_units(config, ctx, env, launches, ragged=True)
    files.update(kernels)
    return RenderedSources(files, ["binding.cu", *kernels], (), tuple(shared))


RENDERERS: dict[tuple[str, str], Renderer] = {
    ("fa2", "prefill"): _render_fa2_prefill,
    ("fa3", "prefill"): _render_fa3_prefill,
    ("fa2", "decode"): _render_fa2_decode,
    ("fa2", "ragged"): _render_fa2_ragged,
    ("fa3", "ragged"): _render_fa3_ragged,
}


def flashinfer_facts() -> fi_versions.FlashInferFacts:
    """The installed FlashInfer's facts (fi_versions). Where none is installed (`variantgen render`
    on a machine that only previews the code) the sources are rendered for the newest checked
    version, which their fi_facts.h says; a build needs FlashInfer and refuses before this."""
    from importlib.metadata import PackageNotFoundError

    try:
        return fi_versions.installed_facts()
    except PackageNotFoundError:
        return fi_versions.facts(fi_versions.NEWEST_CHECKED)


def render_module(config: ModuleConfig) -> RenderedModule:
    renderer = RENDERERS.get((config.backend, config.kind))
    if renderer is None:
        raise ValueError(f"backend={config.backend!r}, kind={config.kind!r}: not generated yet")
    facts = flashinfer_facts()
    ctx = render_context(config, facts)
    files, units, host_sources, shared = renderer(config, ctx, environment())
    # every config includes the plan ABI; the FlashInfer version's facts go to the sources that differ by version
    files = {plan_abi.HEADER_NAME: plan_abi.header_text(), fi_versions.HEADER_NAME: fi_versions.header_text(facts),
             **files}
    return RenderedModule(
        config=config,
        files=files,
        compile_units=tuple(units),
        tensor_args=ctx.tensor_params,
        scalar_args=ctx.scalar_params,
        template_digest=template_digest(config.backend),
        host_sources=host_sources,
        shared_units=shared,
    )
