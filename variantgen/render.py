"""Jinja templates -> the sources of one module.

A ``ModuleConfig`` (spec + head dims + dtypes + backend + arch + mask modes) fully
determines the rendered files; rendering is pure, so the cache key can hash its output.
Templates are loaded once per process, with StrictUndefined: a missing variable is an
error, never an empty string in generated C++.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from . import __version__, codegen
from .env import settings
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
MASK_MODES = {"none": (0, "MaskMode::kNone"), "causal": (1, "MaskMode::kCausal"), "custom": (2, "MaskMode::kCustom")}
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

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(problems[0])

    def problems(self) -> list[str]:
        out = []
        if self.backend != "fa2":
            out.append(f"backend={self.backend!r}: only 'fa2' modules are generated; "
                       "sm90 runs fa2 modules (see README: backends)")
        if self.backend not in self.spec.backends:
            out.append(f"backend={self.backend!r}: spec `{self.spec.name}` allows only {list(self.spec.backends)}")
        for name in ("q_dtype", "kv_dtype", "o_dtype"):
            if getattr(self, name) not in DTYPES:
                out.append(f"{name}={getattr(self, name)!r}: expected one of {sorted(DTYPES)}")
        if self.q_dtype.startswith("fp8"):
            out.append(f"q_dtype={self.q_dtype}: fp8 query is not supported by fa2 (its tensor-core path "
                       "needs 16-bit queries); use bf16 or fp16 queries with an fp8 KV cache")
        if self.o_dtype.startswith("fp8"):
            out.append(f"o_dtype={self.o_dtype}: fp8 output is not supported by fa2")
        if self.head_dim_qk not in FA2_HEAD_DIMS or self.head_dim_vo != self.head_dim_qk:
            out.append(f"head_dim_qk={self.head_dim_qk}, head_dim_vo={self.head_dim_vo}: fa2 variant modules "
                       f"support equal head dims in {list(FA2_HEAD_DIMS)}")
        unknown = [m for m in self.mask_modes if m not in MASK_MODES]
        if unknown or not self.mask_modes:
            out.append(f"mask_modes={self.mask_modes!r}: expected a non-empty subset of {list(MASK_MODES)}")
        try:
            arch = canonical_arch(self.arch)
            if int(arch.split(".")[0]) < 8:
                out.append(f"arch={self.arch}: fa2 needs sm80 or newer")
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
            f"vg_{self.spec.name}_{self.backend}_prefill_q{self.q_dtype}_kv{self.kv_dtype}_o{self.o_dtype}"
            f"_hd{self.head_dim_qk}x{self.head_dim_vo}_sm{self.arch_tag}"
        )

    def describe(self) -> dict[str, object]:
        return {
            "spec": self.spec.name,
            "spec_file": self.spec.path,
            "backend": self.backend,
            "kind": "prefill_paged",
            "head_dim_qk": self.head_dim_qk,
            "head_dim_vo": self.head_dim_vo,
            "q_dtype": self.q_dtype,
            "kv_dtype": self.kv_dtype,
            "o_dtype": self.o_dtype,
            "arch": canonical_arch(self.arch),
            "mask_modes": list(self.mask_modes),
        }


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
    clamped_tensors: tuple[str, ...] = field(default=())

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


def environment() -> jinja2.Environment:
    return _environment(str(settings().template_dir))


def template_files(backend: str = "fa2") -> list[Path]:
    root = settings().template_dir / backend
    return sorted(p for p in root.glob("*.jinja") if p.is_file())


@functools.lru_cache(maxsize=8)
def _template_digest(template_dir: str, backend: str) -> str:
    h = hashlib.sha256()
    for p in sorted((Path(template_dir) / backend).glob("*.jinja")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def template_digest(backend: str = "fa2") -> str:
    return _template_digest(str(settings().template_dir), backend)


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


def struct_name(spec: VariantSpec) -> str:
    return "VG_" + "".join(part.capitalize() for part in spec.name.split("_"))


def kernel_args(spec: VariantSpec, clamped: frozenset[str] | set[str] = frozenset()) -> tuple[
        tuple[KernelArg, ...], tuple[KernelArg, ...]]:
    """run()'s extra arguments in ABI order: spec tensors, vg_meta; spec scalars, internals."""
    tensors = [KernelArg(t.name, t.cpp_type, f"spec tensor {list(t.shape)}") for t in spec.tensors]
    tensors.append(KernelArg("vg_meta", "int32_t", "per launch request metadata [n, VG_META_STRIDE]"))
    scalar_types = {"int": "int64_t", "float": "double", "bool": "bool"}
    scalars = [KernelArg(s.name, scalar_types[s.dtype], f"spec scalar ({s.dtype})") for s in spec.scalars]
    scalars.append(KernelArg("sm_scale", "double", "softmax scale, q/k scales folded in"))
    if spec.qkv_scales:
        scalars.append(KernelArg("v_scale", "double", "value scale, applied to the output"))
    for t in sorted(clamped):
        scalars.append(KernelArg(codegen.rows_scalar_name(t), "int64_t", f"rows of `{t}` (index clamping)"))
    return tuple(tensors), tuple(scalars)


def render_module(config: ModuleConfig) -> RenderedModule:
    spec = config.spec
    mask = codegen.emit_mask(spec)
    logits = codegen.emit_logits(spec)
    clamped = set(mask.clamped_tensors) | (set(logits.clamped_tensors) if logits else set())
    tensor_args, scalar_args = kernel_args(spec, clamped)
    scalar_local = {"int": "int32_t", "float": "float", "bool": "bool"}
    uri_hint = config.uri_prefix  # the full URI (with hash) is only known after rendering
    ctx = {
        "vg_version": __version__,
        "spec": spec,
        "spec_file": codegen.comment_text(Path(spec.path).name),
        "uri": uri_hint,
        "struct_name": struct_name(spec),
        "mask_comment": codegen.describe(spec.mask),
        "mask_code": mask.code,
        "mask_locals": _locals(mask.builtins),
        "logits": logits is not None,
        "logits_comment": codegen.describe(spec.logits) if spec.logits is not None else "",
        "logits_code": logits.code if logits else "",
        "logits_locals": _locals(logits.builtins) if logits else "",
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
    env = environment()
    files = {
        "variant.cuh": env.get_template("fa2/variant.cuh.jinja").render(ctx),
        "batch_prefill_config.inc": env.get_template("fa2/config.inc.jinja").render(ctx),
        "binding.cu": env.get_template("fa2/binding.cu.jinja").render(ctx),
    }
    units = ["binding.cu"]
    kernel = env.get_template("fa2/paged_kernel.cu.jinja")
    for mode in ctx["mask_modes"]:
        for cta in FA2_CTA_TILES_Q:
            name = f"paged_kernel_{mode['name']}_cta{cta}.cu"
            files[name] = kernel.render(ctx, mode=mode, cta_tile_q=cta)
            units.append(name)
    return RenderedModule(
        config=config,
        files=files,
        compile_units=tuple(units),
        tensor_args=tensor_args,
        scalar_args=scalar_args,
        template_digest=template_digest(config.backend),
        clamped_tensors=tuple(sorted(clamped)),
    )
