"""The GPU fuzzer's module factory on the CPU (variantgen.testing.fuzz_run.Modules over the fake kernels).

``FakeModules`` makes the same wrappers make_wrapper would (VariantWrapper, DecodeWrapper on
CUDA or tensor cores, RaggedWrapper, graph mode with a GraphCapacity), each on a fake module
of tests/fakes/_fake_kernel.py / _fake_ragged.py / _fake_decode.py instead of a compiled one,
and the prefill ones with the fake row kernel (FakeRowPlanner) as their planner module.
``capture`` returns the run itself: "replaying" a graph on the CPU runs it again, on the same
static buffers. A test plants a bug by passing its own fake class for a module kind, and a
missing module by naming it in ``missing``.
bench/fuzz_gpu.py --fake uses it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from _fake_decode import FakeDecodeModule
from _fake_kernel import FakeFa3Module, FakeModule, FakeRowPlanner
from _fake_ragged import FakeFa3RaggedModule, FakeRaggedModule

from variantgen.build.builder import BuildResult
from variantgen.build.cache import Entry
from variantgen.codegen import render
from variantgen.testing.fuzz_cases import ModuleKey, Target, shipped_spec
from variantgen.wrappers.decode import DecodeWrapper
from variantgen.wrappers.paged import VariantWrapper
from variantgen.wrappers.ragged import RaggedWrapper


class FakeModules:
    """Wrappers on fake modules. ``fakes``: fake class per (backend, module kind) to use instead of
    the defaults; ``missing``: (backend, module kind, ModuleKey) reported as not precompiled."""

    def __init__(self, fakes: dict[tuple[str, str], type] | None = None,
                 missing: Iterable[tuple[str, str, ModuleKey]] = (), row_planner: bool = True):
        self.device = torch.device("cpu")
        self.fakes = {("fa2", "prefill"): FakeModule, ("fa3", "prefill"): FakeFa3Module,
                      ("fa2", "decode"): FakeDecodeModule, ("fa2", "ragged"): FakeRaggedModule,
                      ("fa3", "ragged"): FakeFa3RaggedModule, **(fakes or {})}
        self._missing = set(missing)
        self.row_planner = row_planner
        self.made: list[Any] = []  # every fake module made, in order

    def missing(self, target: Target, module: ModuleKey) -> str | None:
        if (target.backend, target.module_kind, module) in self._missing:
            return f"module {module.label()} {target.backend} {target.module_kind} is not precompiled (test)"
        return None

    def wrapper(self, target: Target, module: ModuleKey, graph: Any = None) -> Any:
        spec = shipped_spec(module.spec)
        config = render.ModuleConfig(spec, module.head_dim_qk, module.head_dim_vo, module.q_dtype, module.kv_dtype,
                                     module.q_dtype, "9.0a", target.backend, kind=target.module_kind)
        rendered = render.render_module(config)
        manifest = {"scalar_args": [a.name for a in rendered.scalar_args], "module_sha256": "x", "module_file": "x.so"}
        fake = self.fakes[(target.backend, target.module_kind)](spec)
        self.made.append(fake)
        build = BuildResult(entry=Entry(Path("/nonexistent"), config.uri_prefix + "_fake", manifest), key=None,
                            built=False, seconds=0.0)
        workspace = torch.empty(1 << 20, dtype=torch.uint8)
        extra = {"graph": graph} if graph is not None else {}
        cls = {"prefill": VariantWrapper, "decode": DecodeWrapper, "ragged": RaggedWrapper}[target.kind]
        w = cls(spec, config, fake, build, workspace, **extra)
        if self.row_planner and target.module_kind in ("prefill", "decode"):
            w.set_row_planner(FakeRowPlanner(spec))
        return w

    def capture(self, run: Callable[[], Any]) -> Callable[[], Any]:
        return run
