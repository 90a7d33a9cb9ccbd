"""`variantgen check`: run a spec on a random batch through a backend that can run here and
compare it with the derived float32 reference (reference.reference_attention).

Where a GPU is visible the batch lives on it and any backend can be asked for; on a CPU
machine the flex route (torch's FlexAttention) runs the same comparison, so a new spec can be
checked before a GPU is at hand. A FlashInfer backend asked for where none can run is refused
with the reason and the backend that would run instead.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import VariantgenError
from ..lang.values import VariantSpec
from ..routing.capabilities import CLI_NAMES, Request

log = logging.getLogger("variantgen.check")


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: ``ok`` is a relative error within the tolerance and finite outputs."""

    spec: str
    route: str  # "module <uri>" or "the flex route on cpu"
    rows_q: int
    rows_kv: int
    max_abs_err: float
    rel_err: float
    tol: float
    ok: bool

    def line(self, batch_size: int, num_qo_heads: int, num_kv_heads: int) -> str:
        return (f"{self.spec}: batch {batch_size}, q {self.rows_q} rows, kv {self.rows_kv} rows, "
                f"heads {num_qo_heads}/{num_kv_heads}: max abs err {self.max_abs_err:.3e}, rel err {self.rel_err:.3e} "
                f"(tolerance {self.tol:g}) -> {'ok' if self.ok else 'MISMATCH'}")


def random_lengths(batch_size: int, qo_len: int, kv_len: int, seed: int) -> tuple[list[int], list[int]]:
    """Per-request query and key lengths: 1..qo_len queries, the keys at least as many."""
    rng = random.Random(seed)
    qo = [rng.randint(1, qo_len) for _ in range(batch_size)]
    kv = [q + rng.randint(0, max(kv_len - q, 0)) for q in qo]
    return qo, kv


def check_device(backend: str | None) -> torch.device:
    """Where the check runs: the current GPU, or the CPU for the flex route. VariantgenError when
    a FlashInfer backend is asked for and no GPU is visible (its modules run on a GPU only)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if backend in (None, "flex"):
        return torch.device("cpu")
    raise VariantgenError(f"--backend {backend}: {backend} modules run on a CUDA GPU and none is visible here; "
                          "--backend flex (or auto) runs the check on the CPU through torch's FlexAttention")


def run_check(variant: VariantSpec, *, head_dim: int, dtype: str, kv_dtype: str | None, o_dtype: str | None,
              backend: str | None, batch_size: int, qo_len: int, kv_len: int, num_qo_heads: int, num_kv_heads: int,
              page_size: int, planner: bool, seed: int, tol: float, cache: Any = None,
              echo: Callable[[str], None] = log.info) -> CheckResult:
    """Build or load ``variant``'s module (or take the flex route), run a random paged batch and
    compare with the reference. ``echo`` gets the progress lines."""
    from ..api.factory import make_wrapper
    from ..wrappers.base import TORCH_DTYPES
    from ..wrappers.batches import random_paged_batch, random_spec_args
    from ..wrappers.reference import reference_attention

    device = check_device(backend)
    request = Request.of(variant, head_dim_qk=head_dim, q_dtype=dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                         names=CLI_NAMES)
    workspace = torch.empty(128 << 20 if device.type == "cuda" else 1 << 20, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        echo("no CUDA GPU here: checking through the flex route on the CPU (torch compiles FlexAttention on the "
             "first run: a few seconds)")
    t0 = time.perf_counter()
    wrapper = make_wrapper(variant, workspace, head_dim_qk=head_dim, q_dtype=request.q_dtype,
                           kv_dtype=request.kv_dtype, o_dtype=request.o_dtype, backend=backend, cache=cache)
    route = f"module {wrapper.uri}" if wrapper.uri else f"the {wrapper.config.backend} route on {device.type}"
    echo(f"{route} ready in {time.perf_counter() - t0:.1f}s")
    qo_lens, kv_lens = random_lengths(batch_size, qo_len, max(kv_len, qo_len), seed)
    batch = random_paged_batch(qo_lens, kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, page_size=page_size, dtype=TORCH_DTYPES[request.q_dtype],
                               kv_dtype=TORCH_DTYPES[request.kv_dtype], device=device, seed=seed)
    args = random_spec_args(variant, batch, seed=seed)
    if planner:
        wrapper.plan(*batch.plan_args(), skip_tiles=True, **args)
    else:
        wrapper.plan(*batch.plan_args(), skip_tiles=False)
    out = wrapper.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ref = reference_attention(variant, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    diff = (out.float() - ref).abs()
    rel = float(diff.norm() / ref.norm().clamp_min(1e-12))
    ok = rel <= tol and bool(torch.isfinite(out.float()).all())
    return CheckResult(variant.name, route, sum(qo_lens), sum(kv_lens), float(diff.max()), rel, tol, ok)
