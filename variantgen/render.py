"""Jinja templates -> the sources of one module.

A ``ModuleConfig`` (spec + head dims + dtypes + backend + arch + mask modes) fully
determines the rendered files; rendering is pure, so the cache key can hash its output.
Templates are loaded once per process, with StrictUndefined: a missing variable is an
error, never an empty string in generated C++.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from . import __version__, codegen, plan_abi
from .env import TEMPLATES_DIR, settings
from .errors import VariantgenError
from .spec import VariantSpec

# dtype name -> (C++ type, bytes)
DTYPES = {
    "bf16": ("nv_bfloat16", 2),
    "fp16": ("half", 2),
    "fp8_e4m3": ("__nv_fp8_e4m3", 1),
    "fp8_e5m2": ("__nv_fp8_e5m2", 1),
}
DTYPE_ALIASES = {
    "bfloat16": "bf16", "bf16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "fp16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "float8_e4m3fn": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8": "fp8_e4m3",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "fp8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2", "torch.float8_e5m2": "fp8_e5m2",
}
FA2_HEAD_DIMS = (64, 128, 256)
# What each kernel kind is and which (head_dim_qk, head_dim_vo) pairs its backends compile.
KINDS = {
    "prefill": "paged-KV prefill",
    "ragged": "ragged-KV prefill",
    "decode": "paged-KV decode (CUDA cores)",
}
BACKENDS = ("fa2", "fa3")
_EQUAL_DIMS = tuple((d, d) for d in FA2_HEAD_DIMS)
HEAD_DIMS: dict[tuple[str, str], tuple[tuple[int, int], ...]] = {
    ("fa2", "prefill"): _EQUAL_DIMS,
    ("fa2", "ragged"): _EQUAL_DIMS + ((192, 128),),  # 192/128: MLA-shaped prefill (DeepSeek)
    ("fa2", "decode"): _EQUAL_DIMS,
    ("fa3", "prefill"): _EQUAL_DIMS,
}
# run()'s mask-mode code and FlashInfer's enumerator, by name (the plan ABI's table)
MASK_MODES = {m.label: (int(m), m.literal) for m in plan_abi.MaskMode}
FA2_CTA_TILES_Q = (16, 64, 128)  # what FlashInfer's FA2 planner picks for head_dim_vo < 512


def canonical_dtype(value: object, arg: str) -> str:
    """'bf16' for torch.bfloat16, 'bfloat16', 'bf16' ...; ValueError naming ``arg`` otherwise."""
    key = str(value).strip().lower()
    if key in DTYPE_ALIASES:
        return DTYPE_ALIASES[key]
    raise ValueError(f"{arg}={value!r}: unsupported dtype; expected one of {sorted(DTYPES)}")


def canonical_arch(value: str) -> str:
    """'9.0a' / '90a' / 'sm_90a' -> '9.0a'."""
    raw = str(value).strip().lower().removeprefix("sm_").removeprefix("sm").removeprefix("compute_")
    suffix = raw[-1] if raw and raw[-1] in "af" else ""
    digits = raw[:-1] if suffix else raw
    if "." in digits:
        major, _, minor = digits.partition(".")
    elif digits.isdigit() and len(digits) >= 2:
        major, minor = digits[:-1], digits[-1]
    else:
        major, minor = "", ""
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"arch={value!r}: expected a compute capability such as 8.0, 9.0a or 10.0a")
    return f"{int(major)}.{int(minor)}{suffix}"


@dataclass(frozen=True)
class ModuleConfig:
    """Everything one compiled module is specialised on."""

    spec: VariantSpec
    head_dim_qk: int
    head_dim_vo: int
    q_dtype: str
    kv_dtype: str
    o_dtype: str
    arch: str
    backend: str = "fa2"
    mask_modes: tuple[str, ...] = ("none", "causal", "custom")
    kind: str = "prefill"

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(problems[0])

    @classmethod
    def problems_of(cls, **fields: Any) -> list[str]:
        """problems() of the config these fields (defaults for the rest) would make, all of
        them: construction stops at the first."""
        config = object.__new__(cls)  # skips __post_init__
        for f in dataclasses.fields(cls):
            object.__setattr__(config, f.name, fields.get(f.name, f.default))
        return config.problems()

    def problems(self) -> list[str]:
        out = []
        if self.kind not in KINDS:
            out.append(f"kind={self.kind!r}: expected one of {list(KINDS)}")
        if self.backend not in BACKENDS:
            out.append(f"backend={self.backend!r}: expected one of {list(BACKENDS)}")
        elif self.kind in KINDS and (self.backend, self.kind) not in HEAD_DIMS:
            have = sorted(k for b, k in HEAD_DIMS if b == self.backend)
            out.append(f"kind={self.kind!r}: backend {self.backend!r} generates only {have} modules")
        if self.backend in BACKENDS and self.backend not in self.spec.backends:
            out.append(f"backend={self.backend!r}: spec `{self.spec.name}` allows only {list(self.spec.backends)}")
        for name in ("q_dtype", "kv_dtype", "o_dtype"):
            if getattr(self, name) not in DTYPES:
                out.append(f"{name}={getattr(self, name)!r}: expected one of {sorted(DTYPES)}")
        if self.q_dtype.startswith("fp8"):
            out.append(f"q_dtype={self.q_dtype}: fp8 query is not supported by {self.backend} (its tensor-core "
                       "path needs 16-bit queries); use bf16 or fp16 queries with an fp8 KV cache")
        if self.o_dtype.startswith("fp8"):
            out.append(f"o_dtype={self.o_dtype}: fp8 output is not supported by {self.backend}")
        if self.backend == "fa3" and self.kv_dtype != self.q_dtype:
            out.append(f"kv_dtype={self.kv_dtype}: fa3 variant modules need kv_dtype == q_dtype "
                       f"({self.q_dtype}); use backend fa2 for an fp8 KV cache")
        if self.backend == "fa3" and self.o_dtype != self.q_dtype and not self.o_dtype.startswith("fp8"):
            # Only o in the query's dtype has run on the H200; other outputs go to fa2.
            out.append(f"o_dtype={self.o_dtype}: fa3 variant modules write o in the query dtype ({self.q_dtype}); "
                       "use backend fa2 for another output dtype")
        dims = HEAD_DIMS.get((self.backend, self.kind))
        if dims and (self.head_dim_qk, self.head_dim_vo) not in dims:
            pairs = ", ".join(f"{a}" if a == b else f"{a}/{b}" for a, b in dims)
            out.append(f"head_dim_qk={self.head_dim_qk}, head_dim_vo={self.head_dim_vo}: {self.backend} "
                       f"{self.kind} modules support head dims {pairs} (qk/vo where they differ)")
        unknown = [m for m in self.mask_modes if m not in MASK_MODES]
        if unknown or not self.mask_modes:
            out.append(f"mask_modes={self.mask_modes!r}: expected a non-empty subset of {list(MASK_MODES)}")
        try:
            arch = canonical_arch(self.arch)
            major = int(arch.split(".")[0])
            if major < 8:
                out.append(f"arch={self.arch}: {self.backend} needs sm80 or newer")
            if self.backend == "fa3" and arch != "9.0a":
                out.append(f"arch={self.arch}: fa3 modules run on sm90 (Hopper) only, compiled for 9.0a")
        except ValueError as e:
            out.append(str(e))
        return out

    @property
    def arch_tag(self) -> str:
        """'9.0a' -> '90a' (used in names and -gencode)."""
        return canonical_arch(self.arch).replace(".", "")

    @property
    def uri_prefix(self) -> str:
        return (
            f"vg_{self.spec.name}_{self.backend}_{self.kind}_q{self.q_dtype}_kv{self.kv_dtype}_o{self.o_dtype}"
            f"_hd{self.head_dim_qk}x{self.head_dim_vo}_sm{self.arch_tag}"
        )

    def render(self) -> RenderedModule:
        return render_module(self)

    def describe(self) -> dict[str, object]:
        return {
            "spec": self.spec.name,
            "spec_file": self.spec.path,
            "backend": self.backend,
            "kind": self.kind,
            "head_dim_qk": self.head_dim_qk,
            "head_dim_vo": self.head_dim_vo,
            "q_dtype": self.q_dtype,
            "kv_dtype": self.kv_dtype,
            "o_dtype": self.o_dtype,
            "arch": canonical_arch(self.arch),
            "mask_modes": list(self.mask_modes),
        }


def choose_backend(spec: VariantSpec, *, kind: str, head_dim_qk: int, head_dim_vo: int, q_dtype: str,
                   kv_dtype: str, o_dtype: str, arch: str) -> str:
    """The backend make_wrapper uses when none is given. Pure: depends only on its arguments.

    fa3 where an fa3 module is valid: paged prefill on sm90 with 16-bit KV of the query's
    dtype, head dims 64/128/256, a spec that allows it. On the H200 it measured faster than
    fa2 for both routes (bench/results/2026-11-29-h200/prefill-fa3-5ec28f3.json, mm_prefix,
    8 x 8192: planned 9.40 vs 13.39 ms, direct 54.3 vs 81.2 ms). Everything else: fa2 (decode,
    ragged, fp8 KV caches, 192/128, other GPUs)."""
    fa3_problems = ModuleConfig.problems_of(spec=spec, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
                                            q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype, arch=arch,
                                            backend="fa3", kind=kind)
    return "fa2" if fa3_problems else "fa3"


def cuda_graph_problem(kind: str) -> str:
    """Why CUDA-graph mode cannot serve a wrapper of ``kind`` ("": it can) - the one rule
    make_wrapper(graph=...) and probe(cuda_graph=True) share. Paged prefill (fa2 and fa3: the
    backend is chosen as without graph mode, choose_backend's) and decode plan fixed launches
    (graph.py); ragged allocates its metadata per plan()."""
    if kind in ("prefill", "decode"):
        return ""
    return (f"CUDA-graph mode is for kind 'prefill' and 'decode' (got {kind!r}); ragged wrappers allocate their "
            "metadata per plan()")


@dataclass(frozen=True)
class KernelArg:
    name: str
    cpp_type: str
    comment: str


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

    def source_digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + self.files[name].encode() + b"\0")
        return h.hexdigest()


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


# What a backend's modules use ("planner": the interval planner's row kernel, variantgen/rowplan.py).
# plan/: the launch builder, static C++ compiled into the planner module and every paged-prefill module
TEMPLATE_DIRS = {"fa2": ("common", "fa2", "plan"), "fa3": ("common", "fa3", "plan"),
                 "planner": ("common", "planner", "plan")}
PLAN_HEADERS = ("plan_module.h", "launches.h", "fa3_worklist.h", "gather.cuh")  # templates/plan/, as they are


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


def template_digest(backend: str = "fa2") -> str:
    return _template_digest(str(template_root()), backend)


def plan_sources() -> dict[str, str]:
    """The launch builder's sources (templates/plan/) and the plan ABI's header, as a module's
    files: what the planner module and every paged-prefill module compile their plans with."""
    files = {plan_abi.HEADER_NAME: plan_abi.header_text()}
    files.update((name, static_source(f"plan/{name}")) for name in PLAN_HEADERS)
    return files


_LOCAL_DEFS = {
    # builtin -> (C++ definition, builtins it depends on)
    "q_local": ("const int32_t q_local = int32_t(qo_idx < qo_len ? qo_idx : qo_len - 1);"
                "  // padding lanes: clamp before any per-token load", ()),
    "kv_local": ("const int32_t kv_local = int32_t(kv_idx < kv_len ? kv_idx : kv_len - 1);", ()),
    "q_pos": ("const int32_t q_pos = q_pos_base + q_local;", ("q_local",)),
    # The request's query index, not the launch request's (the planner splits requests).
    "q_idx": ("const int32_t q_idx = q_pos - (req_kv_len - req_qo_len);", ("q_pos",)),
    "kv_pos": ("const int32_t kv_pos = kv_pos_base + kv_local;", ("kv_local",)),
    "q_row": ("const int32_t q_row = q_row_base + q_local;", ("q_local",)),
    "kv_row": ("const int32_t kv_row = kv_row_base + kv_pos;", ("kv_pos",)),
    "q_kv_row": ("const int32_t q_kv_row = kv_row_base + q_pos;", ("q_pos",)),
    "qo_head": ("const int32_t qo_head = int32_t(qo_head_idx);", ()),
    "kv_head": ("const int32_t kv_head = int32_t(kv_head_idx);", ()),
}
_MEMBER_BUILTINS = {"request", "qo_len", "kv_len"}  # read from variant members


def _locals(builtins: frozenset[str], indent: str = "    ") -> str:
    need: list[str] = []

    def add(name: str) -> None:
        if name in need:
            return
        for dep in _LOCAL_DEFS[name][1]:
            add(dep)
        need.append(name)

    for b in sorted(builtins):
        if b not in _MEMBER_BUILTINS:
            add(b)
    return "\n".join(indent + _LOCAL_DEFS[n][0] for n in need)


def _sink_locals(builtins: frozenset[str], target: codegen.Target, indent: str, *, kv_head_idx: bool) -> str:
    """The locals a sink hook needs: its query head from ``qo_head_idx``, and its key/value head
    from ``kv_head_idx`` where the hook has one (fa3's constructor) or from the group size (fa2's
    m/d update and output transform get only the query head)."""
    lines = []
    if "qo_head" in builtins:
        lines.append(_LOCAL_DEFS["qo_head"][0])
    if "kv_head" in builtins:
        lines.append(_LOCAL_DEFS["kv_head"][0] if kv_head_idx else
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
                   ("fa2", "ragged"): codegen.FA2_RAGGED, ("fa3", "prefill"): codegen.FA3}


def _variant_context(config: ModuleConfig) -> tuple[dict, tuple[KernelArg, ...], tuple[KernelArg, ...]]:
    """What every backend's variant template needs: the spec's mask/logits as C++, its args."""
    spec = config.spec
    target = CODEGEN_TARGETS[(config.backend, config.kind)]
    mask = codegen.emit_mask(spec, target)
    logits = codegen.emit_logits(spec, target=target)
    sink = codegen.emit_sink(spec, target)
    tensor_args, scalar_args = kernel_args(spec)
    scalar_local = {"int": "int32_t", "float": "float", "bool": "bool"}
    ctx = {
        "vg_version": __version__,
        "spec": spec,
        "uri": config.uri_prefix,  # the full URI (with hash) is only known after rendering
        "kind": config.kind,
        "kind_text": KINDS[config.kind],
        "struct_name": struct_name(spec),
        "mask_comment": codegen.describe(spec.mask),
        "mask_code": mask.code,
        "mask_locals": _locals(mask.builtins),
        "logits": logits is not None,
        "logits_comment": codegen.describe(spec.logits) if spec.logits is not None else "",
        "logits_code": logits.code if logits else "",
        "logits_locals": _locals(logits.builtins) if logits else "",
        # a hook that evaluates both (fa3's masked transform)
        "masked_locals": _locals(mask.builtins | (logits.builtins if logits else frozenset())),
        # the learned sink: a float per query head and request (fa2: in its m/d update or, for
        # decode, its output transform; fa3: in the constructor, one head per work tile)
        "sink": sink is not None,
        "sink_comment": codegen.describe(spec.sink) if spec.sink is not None else "",
        "sink_code": sink.code if sink else "",
        "sink_locals": (_sink_locals(sink.builtins, target, " " * (8 if config.kind == "decode" else 6),
                                     kv_head_idx=config.backend == "fa3") if sink else ""),
        "scalars": [
            {"name": s.name, "dtype": s.dtype, "local_type": scalar_local[s.dtype]} for s in spec.scalars
        ],
        "tensor_params": tensor_args,
        "scalar_params": scalar_args,
        "dtype_q": DTYPES[config.q_dtype][0],
        "dtype_kv": DTYPES[config.kv_dtype][0],
        "dtype_o": DTYPES[config.o_dtype][0],
        "head_dim_qk": config.head_dim_qk,
        "head_dim_vo": config.head_dim_vo,
        "mask_modes": [{"name": m, "literal": MASK_MODES[m][1]} for m in config.mask_modes],
    }
    return ctx, tensor_args, scalar_args


# A renderer turns the context into (files, compile units, FlashInfer host sources).
Renderer = Callable[[ModuleConfig, dict, jinja2.Environment], tuple[dict[str, str], list[str], tuple[str, ...]]]


def _render_fa2_per_tile(ctx: dict, env: jinja2.Environment, *, config_template: str, binding_template: str,
                         kernel_template: str, unit_prefix: str, host_source: str, plan: bool = False):
    """The FA2 prefill kinds: variant, config and binding, plus one kernel unit per mask mode
    and CTA tile (what FlashInfer's FA2 planner may pick), and FlashInfer's host code; ``plan``:
    the launch builder's unit too."""
    files = {
        "variant.cuh": env.get_template("fa2/variant.cuh.jinja").render(ctx),
        "batch_prefill_config.inc": env.get_template(config_template).render(ctx),
        "binding.cu": env.get_template(binding_template).render(ctx),
    }
    units = ["binding.cu"]
    if plan:  # the launch builder (paged prefill: plan() builds its launches with it)
        files.update(plan_sources(), **{"plan.cu": static_source("plan/plan.cu")})
        units.append("plan.cu")
    kernel = env.get_template(kernel_template)
    for mode in ctx["mask_modes"]:
        for cta in FA2_CTA_TILES_Q:
            name = f"{unit_prefix}_{mode['name']}_cta{cta}.cu"
            files[name] = kernel.render(ctx, mode=mode, cta_tile_q=cta)
            units.append(name)
    return files, units, (host_source,)


def _render_fa2_prefill(config: ModuleConfig, ctx: dict, env: jinja2.Environment):
    return _render_fa2_per_tile(ctx, env, config_template="fa2/config.inc.jinja",
                                binding_template="fa2/binding.cu.jinja", kernel_template="fa2/paged_kernel.cu.jinja",
                                unit_prefix="paged_kernel", host_source="batch_prefill_paged.cu", plan=True)


def _render_fa2_decode(config: ModuleConfig, ctx: dict, env: jinja2.Environment):
    """FlashInfer's FA2 (CUDA-core) batch decode: one kernel unit (every GQA group size),
    its host code (batch_decode.cu) compiled against our config, our plan + run binding."""
    files = {
        "variant.cuh": env.get_template("fa2/variant.cuh.jinja").render(ctx),
        "batch_decode_config.inc": env.get_template("fa2/decode_config.inc.jinja").render(ctx),
        "binding.cu": env.get_template("fa2/decode_binding.cu.jinja").render(ctx),
        "decode_kernel.cu": env.get_template("fa2/decode_kernel.cu.jinja").render(ctx),
    }
    return files, ["binding.cu", "decode_kernel.cu"], ("batch_decode.cu",)


FA2_DISPATCHED_CTA_TILES_Q = (16, 32, 64, 128)  # what FlashInfer's DISPATCH_CTA_TILE_Q can name


def _render_fa2_ragged(config: ModuleConfig, ctx: dict, env: jinja2.Environment):
    """FlashInfer's FA2 ragged-KV prefill: one kernel unit per mask mode and CTA tile, its
    host code (batch_prefill.cu) compiled against our config, our plan + ragged_run binding."""
    ctx = dict(ctx, cta_tiles=list(FA2_CTA_TILES_Q), all_cta_tiles=list(FA2_DISPATCHED_CTA_TILES_Q))
    return _render_fa2_per_tile(ctx, env, config_template="fa2/ragged_config.inc.jinja",
                                binding_template="fa2/ragged_binding.cu.jinja",
                                kernel_template="fa2/ragged_kernel.cu.jinja", unit_prefix="ragged_kernel",
                                host_source="batch_prefill.cu")


def _fa3_launches(ctx: dict) -> list[dict]:
    """The kernel instantiations of an fa3 module, by run()'s mask-mode code: 'none' and
    'causal' run the plain variant (causal with and without a left window); 'custom' is a
    non-causal launch of the masked variant (FA3 has no kCustom)."""
    plain, masked = ctx["struct_name"], ctx["struct_name"] + "Masked"
    out = []
    for mode in ctx["mask_modes"]:
        name = mode["name"]
        if name == "none":
            out.append(dict(name="none", code=0, mask_literal="MaskMode::kNone", window="false", variant=plain))
        elif name == "causal":
            out.append(dict(name="causal", code=1, mask_literal="MaskMode::kCausal", window="false", variant=plain))
            out.append(dict(name="causal_window", code=1, mask_literal="MaskMode::kCausal", window="true",
                            variant=plain))
        else:
            out.append(dict(name="custom", code=2, mask_literal="MaskMode::kNone", window="false", variant=masked))
    for launch in out:
        launch["comment"] = (f"{launch['mask_literal']}, LEFT_SLIDING_WINDOW={launch['window']}, "
                             f"variant {launch['variant']}")
    return out


CUTLASS_TYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t",
                 "fp8_e4m3": "cutlass::float_e4m3_t", "fp8_e5m2": "cutlass::float_e5m2_t"}


def _render_fa3_prefill(config: ModuleConfig, ctx: dict, env: jinja2.Environment):
    launches = _fa3_launches(ctx)
    ctx = dict(ctx, cutlass_q=CUTLASS_TYPES[config.q_dtype], cutlass_kv=CUTLASS_TYPES[config.kv_dtype],
               cutlass_o=CUTLASS_TYPES[config.o_dtype])
    files = {
        "variant.cuh": env.get_template("fa3/variant.cuh.jinja").render(ctx),
        "cutlass_prelude.cuh": static_source("fa3/cutlass_prelude.cuh"),
        "batch_prefill_sm90_config.inc": env.get_template("fa3/config.inc.jinja").render(ctx),
        "binding.cu": env.get_template("fa3/binding.cu.jinja").render(ctx, launches=launches),
        **plan_sources(),
        "plan.cu": static_source("plan/plan.cu"),
    }
    units = ["binding.cu", "plan.cu"]
    kernel = env.get_template("fa3/paged_kernel.cu.jinja")
    for launch in launches:
        name = f"paged_kernel_{launch['name']}.cu"
        files[name] = kernel.render(ctx, launch=launch)
        units.append(name)
    return files, units, ()  # the host code is our own binding


RENDERERS: dict[tuple[str, str], Renderer] = {
    ("fa2", "prefill"): _render_fa2_prefill,
    ("fa3", "prefill"): _render_fa3_prefill,
    ("fa2", "decode"): _render_fa2_decode,
    ("fa2", "ragged"): _render_fa2_ragged,
}


def render_module(config: ModuleConfig) -> RenderedModule:
    ctx, tensor_args, scalar_args = _variant_context(config)
    renderer = RENDERERS.get((config.backend, config.kind))
    if renderer is None:
        raise ValueError(f"backend={config.backend!r}, kind={config.kind!r}: not generated yet")
    files, units, host_sources = renderer(config, ctx, environment())
    files = {plan_abi.HEADER_NAME: plan_abi.header_text(), **files}  # every config includes it
    return RenderedModule(
        config=config,
        files=files,
        compile_units=tuple(units),
        tensor_args=tensor_args,
        scalar_args=scalar_args,
        template_digest=template_digest(config.backend),
        host_sources=host_sources,
    )
