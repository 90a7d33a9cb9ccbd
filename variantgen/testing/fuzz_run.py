"""Running fuzz cases: where wrappers come from (Modules: the module cache on the GPU, fakes on
the CPU), plan() and run() as a case asks, CUDA-graph sessions, and CaseRunner, which turns a
case into a verdict."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .fuzz_cases import TARGET_BY_NAME, Batch, FuzzCase, ModuleKey, Target, shipped_spec
from .fuzz_compare import Verdict, compare, compare_runs, error_verdict
from .fuzz_tensors import SENTINEL, TORCH_DTYPES, CaseTensors, compared_rows, make_tensors, reference

# ----------------------------------------------------------------------------- running a case


class Modules(Protocol):
    """Where a runner's wrappers come from: the module cache on the GPU (CacheModules), fake
    modules on the CPU (tests/fakes/_fake_modules.py)."""

    device: torch.device

    def missing(self, target: Target, module: ModuleKey) -> str | None:
        """Why ``module`` cannot run here now (not precompiled, ...), or None. Never builds."""

    def wrapper(self, target: Target, module: ModuleKey, graph: Any = None) -> Any:
        """A new wrapper of ``target`` on ``module`` (``graph``: a GraphCapacity)."""

    def capture(self, run: Callable[[], Any]) -> Callable[[], Any]:
        """``run`` captured (a CUDA graph on the GPU); calling the result replays it."""


@dataclass
class Outcome:
    """What one run produced, for comparisons beyond the reference (FlashInfer's kernel)."""

    tensors: CaseTensors
    out: torch.Tensor
    ref: torch.Tensor


@dataclass
class RunResult:
    verdict: Verdict
    outcome: Outcome | None = None


def _row_planner(w: Any) -> Any:
    return getattr(w, "row_planner", None)  # (ragged wrappers plan without one)


def _plan(w: Any, case: FuzzCase, t: CaseTensors, args: dict[str, Any]) -> None:
    """plan() as ``case.plan`` asks: planner (key trimming) off, with the spec's planner module,
    or asked for without it (the module set aside for this plan: plan() plans off)."""
    target = TARGET_BY_NAME[case.target]
    planned = case.plan != "off"
    plan_kw: dict[str, Any] = dict(args) if planned else {}
    sizes = (case.num_qo_heads, case.num_kv_heads, case.page_size)
    module = _row_planner(w)
    if case.plan == "nomodule":
        w.set_row_planner(None, "fuzz: no planner module")
    try:
        if target.kind == "ragged":
            w.plan(t.qo_indptr, t.kv_indptr, *sizes[:2], disable_split_kv=case.disable_split_kv)
        elif target.kind == "decode":
            per = case.batch.qo_lens[0]
            multi = {"q_len_per_request": per} if per > 1 else {}
            w.plan(t.kv_indptr, t.kv_indices, t.last_page_len, *sizes, skip_tiles=planned, **multi, **plan_kw)
        else:
            w.plan(t.qo_indptr, t.kv_indptr, t.kv_indices, t.last_page_len, *sizes, skip_tiles=planned,
                   disable_split_kv=case.disable_split_kv, **plan_kw)
    finally:
        if case.plan == "nomodule":
            w.set_row_planner(module)


def _run(w: Any, case: FuzzCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         args: dict[str, Any]) -> Any:
    q_scale, k_scale, v_scale = case.scales
    kw = dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, return_lse=case.return_lse, **args)
    if TARGET_BY_NAME[case.target].kind == "ragged":
        return w.run(q, k, v, **kw)
    return w.run(q, (k, v), **kw)


def _split(result: Any, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (result[0], result[1]) if return_lse else (result, None)


class GraphSession:
    """A graph-mode wrapper with the static buffers a serving engine would capture with, captured
    once on ``case.graph.capture``; ``replay`` plans another batch into it and replays."""

    def __init__(self, runner: CaseRunner, case: FuzzCase):
        from ..planning.graph import GraphCapacity

        assert case.graph is not None
        self.case = case
        target, m, g = TARGET_BY_NAME[case.target], case.module, case.graph
        self.target = target
        dev = runner.modules.device
        cap = GraphCapacity(max_batch_size=g.max_batch_size, max_total_q=g.max_total_q, max_kv_pages=g.max_kv_pages,
                            max_qo_len=g.max_qo_len)
        self.w = runner.modules.wrapper(target, m, cap)
        if case.plan == "nomodule":
            self.w.set_row_planner(None, "fuzz: no planner module")
        hq, hkv, ps = case.num_qo_heads, case.num_kv_heads, case.page_size
        qdt, kvdt = TORCH_DTYPES[m.q_dtype], TORCH_DTYPES[m.kv_dtype]
        rows = g.max_total_q
        self.q = torch.zeros(rows, hq, m.head_dim_qk, dtype=qdt, device=dev)
        self.out = torch.zeros(rows, hq, m.head_dim_vo, dtype=qdt, device=dev)
        self.k = torch.zeros(g.max_kv_pages, ps, hkv, m.head_dim_qk, dtype=kvdt, device=dev)
        self.v = torch.zeros(g.max_kv_pages, ps, hkv, m.head_dim_vo, dtype=kvdt, device=dev)
        dims = {"total_q": rows, "total_kv": g.max_kv_pages * ps, "batch": g.max_batch_size, "num_qo_heads": hq,
                "num_kv_heads": hkv}
        spec = shipped_spec(m.spec)
        self.static = {t.name: torch.zeros([dims[d] if isinstance(d, str) else d for d in t.shape],
                                           dtype=torch.int32 if t.dtype == "int32" else torch.float32, device=dev)
                       for t in spec.tensors}
        # The CUDA-core decode wrapper takes spec tensors of the batch's exact shape only: views of
        # the static buffers from their start, so the captured pointers stay right (a replay reads
        # no shape; the shipped specs clamp no index to a tensor's extent). The prefill wrapper
        # behind the other graph targets takes the capacity-sized buffers themselves.
        self.exact_views = target.kind == "decode" and not target.tensor_cores
        t = self.load(g.capture)
        _plan(self.w, case, t, self.args)
        self.out.fill_(SENTINEL)

        def run() -> Any:  # the arguments of the batch loaded last (the fakes' "replay" runs this again)
            return _run(self.w, case, self.q, self.k, self.v, self.out, self.args)

        run()  # warm-up outside the capture
        self.replay_fn = runner.modules.capture(run)

    def load(self, batch: Batch) -> CaseTensors:
        """Copy a batch into the static buffers (poison past it); sets the arguments run() sees."""
        t = make_tensors(self.case, batch, self.q.device)
        tq, pool = t.q.shape[0], t.k.shape[0]
        self.q[:tq] = t.q
        self.q[tq:] = float("nan")  # a kernel that reads past the batch must not write what it read
        self.k[:pool], self.v[:pool] = t.k, t.v
        args = dict(self.case.scalars)
        for name, buf in self.static.items():
            value = t.args[name]
            buf.fill_(-1)
            view = buf[tuple(slice(0, n) for n in value.shape)]
            view.copy_(value)
            args[name] = view if self.exact_views else buf
        self.args = args
        return t

    def replay(self, case: FuzzCase) -> tuple[CaseTensors, torch.Tensor, torch.Tensor | None, int, torch.Tensor]:
        """(tensors, out rows of the batch, lse or None, rows past the batch written, the out rows
        of a second replay of the same plan)."""
        t = self.load(case.batch)
        _plan(self.w, case, t, self.args)
        self.out.fill_(SENTINEL)
        out_all, lse_all = _split(self.replay_fn(), case.return_lse)
        tq = t.q.shape[0]
        past = int((self.out[tq:].float() != SENTINEL).flatten(1).any(dim=1).sum())
        out, lse = self.out[:tq].clone(), (lse_all[:tq].clone() if lse_all is not None else None)
        self.out.fill_(SENTINEL)
        self.replay_fn()
        return t, out, lse, past, self.out[:tq].clone()


class CaseRunner:
    """Runs cases through wrappers of ``modules`` (one per target and module, kept; graph sessions
    kept per capture, the least recently used dropped past ``max_sessions``)."""

    def __init__(self, modules: Modules, *, max_sessions: int = 8):
        self.modules = modules
        self.max_sessions = max_sessions
        self._wrappers: dict[tuple[str, ModuleKey], Any] = {}
        self._sessions: OrderedDict[tuple, GraphSession] = OrderedDict()

    def wrapper(self, target: Target, module: ModuleKey) -> Any:
        key = (target.name, module)
        if key not in self._wrappers:
            self._wrappers[key] = self.modules.wrapper(target, module)
        return self._wrappers[key]

    def plan_paths(self, target: Target, module: ModuleKey) -> tuple[str, ...]:
        """The target's plan paths this module can take ('module' needs the spec's planner module)."""
        if "module" not in target.plans:
            return target.plans
        has_module = _row_planner(self.wrapper(target, module)) is not None
        return tuple(p for p in target.plans if p != "module" or has_module)

    @staticmethod
    def session_key(case: FuzzCase) -> tuple:
        """What identifies a graph session: everything of the case but its replayed batch."""
        return tuple(getattr(case, f.name) for f in dataclasses.fields(case) if f.name != "batch")

    def sessions(self) -> list[FuzzCase]:
        """The first case of each live graph session (draw_case(session=...) replays in one)."""
        return [s.case for s in self._sessions.values()]

    def _session(self, case: FuzzCase) -> GraphSession:
        key = self.session_key(case)
        if key in self._sessions:
            self._sessions.move_to_end(key)
            return self._sessions[key]
        session = GraphSession(self, case)
        self._sessions[key] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session

    def run(self, case: FuzzCase) -> RunResult:
        """Plan and run ``case`` (graph targets: replay it), compare with the reference. Exceptions
        become 'error' verdicts."""
        target = TARGET_BY_NAME[case.target]
        rows = sum(case.batch.qo_lens)
        try:
            if target.graph:
                t, out, lse, past, again = self._session(case).replay(case)
            else:
                w = self.wrapper(target, case.module)
                t = make_tensors(case, case.batch, self.modules.device)
                _plan(w, case, t, t.args)
                shape = (t.q.shape[0], case.num_qo_heads, case.module.head_dim_vo)
                dtype = TORCH_DTYPES[case.module.q_dtype]
                buf = torch.full(shape, SENTINEL, dtype=dtype, device=self.modules.device)
                out, lse = _split(_run(w, case, t.q, t.k, t.v, buf, t.args), case.return_lse)
                # the same plan run again: a race shows as a difference far more often than as an error
                again = torch.full(shape, SENTINEL, dtype=dtype, device=self.modules.device)
                _run(w, case, t.q, t.k, t.v, again, t.args)
                past = 0
            ref, ref_lse = reference(case, t)
            keep = compared_rows(case)
            if keep is not None:  # (an isolation case: the poisoned request's rows are not compared)
                keep = keep.to(out.device)
                out, ref, again = out[keep], ref[keep], again[keep]
                lse, ref_lse = (lse[keep], ref_lse[keep]) if lse is not None else (None, ref_lse)
            verdict = compare(out, ref, case.module.q_dtype, lse, ref_lse if lse is not None else None, past)
            if verdict.ok:
                verdict = compare_runs(out, again, verdict)
        except Exception as e:  # noqa: BLE001 - a raising case is a finding, reported with its message
            return RunResult(error_verdict(e, rows))
        return RunResult(verdict, Outcome(t, out, ref))



@dataclass
class CacheModules:
    """Wrappers over the module cache (make_wrapper); ``build``: build what is missing (the GPU
    tests do), else a missing module is reported by ``missing`` and never built."""

    workspace: torch.Tensor
    build: bool = False
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.device = self.workspace.device

    def _config(self, target: Target, module: ModuleKey) -> Any:
        from ..api.factory import device_arch
        from ..codegen.render import DEFAULT_MASK_MODES, ModuleConfig

        return ModuleConfig(shipped_spec(module.spec), module.head_dim_qk, module.head_dim_vo, module.q_dtype,
                            module.kv_dtype, module.q_dtype, device_arch(self.device), target.backend,
                            DEFAULT_MASK_MODES, target.module_kind)

    def missing(self, target: Target, module: ModuleKey) -> str | None:
        from ..build.builder import build_module, default_cache
        from ..core.errors import VariantgenError

        try:
            build_module(self._config(target, module), default_cache(), allow_build=False)
        except (VariantgenError, ValueError) as e:
            return str(e).splitlines()[0]
        return None

    def wrapper(self, target: Target, module: ModuleKey, graph: Any = None) -> Any:
        from ..api.factory import make_wrapper

        return make_wrapper(shipped_spec(module.spec), self.workspace, head_dim_qk=module.head_dim_qk,
                            head_dim_vo=module.head_dim_vo, q_dtype=module.q_dtype, kv_dtype=module.kv_dtype,
                            backend=target.backend, kind=target.kind, use_tensor_cores=target.tensor_cores,
                            build=self.build, graph=graph)

    def capture(self, run: Callable[[], Any]) -> Callable[[], Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = run()

        def replay() -> Any:
            graph.replay()
            torch.cuda.synchronize()
            return result

        return replay


def assert_case_passes(case: FuzzCase, workspace: torch.Tensor) -> None:
    """Run ``case`` on the GPU (building its module if needed) and fail with what went wrong."""
    verdict = CaseRunner(CacheModules(workspace, build=True)).run(case).verdict
    assert verdict.ok, f"{case.label()}: {verdict.kind}: {verdict.message}"
