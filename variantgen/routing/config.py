"""A module's configuration: everything one compiled module is specialised on (spec, kind,
backend, head dims, dtypes, arch, mask modes), checked against the backend table."""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import table as plan_abi
from ..lang.values import VariantSpec
from .capabilities import KINDS, MODULE_BACKENDS, TABLE, Request, Site, canonical_arch

# FlashInfer's dtypes -> (C++ type, bytes)
DTYPES = {
    "bf16": ("nv_bfloat16", 2),
    "fp16": ("half", 2),
    "fp8_e4m3": ("__nv_fp8_e4m3", 1),
    "fp8_e5m2": ("__nv_fp8_e5m2", 1),
}
# run()'s mask-mode code and FlashInfer's enumerator, by name (the plan ABI's table)
MASK_MODES = {m.label: (int(m), m.literal) for m in plan_abi.MaskMode}
DEFAULT_MASK_MODES = tuple(MASK_MODES)  # what the wrappers launch: every mode
FA2_CTA_TILES_Q = (16, 64, 128)  # what FlashInfer's FA2 planner picks for head_dim_vo < 512


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
    mask_modes: tuple[str, ...] = DEFAULT_MASK_MODES
    kind: str = "prefill"

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(problems[0])

    def problems(self) -> list[str]:
        """Why this module cannot be generated (the capability table's reasons, then the mask
        modes'); [] when it can."""
        out = []
        if self.backend not in MODULE_BACKENDS:
            if self.kind not in KINDS:
                out.append(f"kind={self.kind!r}: expected one of {list(KINDS)}")
            out.append(f"backend={self.backend!r}: expected one of {list(MODULE_BACKENDS)}")
        else:
            request = Request(self.spec, self.kind, self.head_dim_qk, self.head_dim_vo, self.q_dtype, self.kv_dtype,
                              self.o_dtype, self.backend)
            out += TABLE[self.backend].problems(request, Site(arch=self.arch))
            if self.kind == "decode" and TABLE[self.backend].decode_on_prefill:
                out.append(f"kind='decode': backend {self.backend!r} has no decode module; its decode runs its "
                           "prefill module (kind='prefill')")
        unknown = [m for m in self.mask_modes if m not in MASK_MODES]
        if unknown or not self.mask_modes:
            out.append(f"mask_modes={self.mask_modes!r}: expected a non-empty subset of {list(MASK_MODES)}")
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
