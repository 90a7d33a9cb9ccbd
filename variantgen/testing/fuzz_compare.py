"""Comparing a fuzz case's output with the reference: tolerances per dtype, the verdicts, a
second run of the same plan (races), errors, and whether an error left the CUDA context unusable."""

from __future__ import annotations

import math
import re
import traceback
from dataclasses import dataclass

import torch

from .fuzz_tensors import SENTINEL
from .harness import nan_positions_differ

# ----------------------------------------------------------------------------- comparing

# dtype of the output -> (abs tolerance, rel tolerance per element, rel. error of the whole output).
# Kernels round P to the 16-bit dtype before P.V and round o (2^-9 relative for bf16, 2^-11 for fp16);
# these bounds leave a few times that, while a wrong row is off by O(0.1) or more.
TOLERANCES = {"bf16": (2e-2, 2e-2, 1e-2), "fp16": (5e-3, 5e-3, 3e-3)}
LSE_TOLERANCE = (2e-2, 1e-3)  # abs, rel (base-2 LSE, as the GPU tests compare it)

VERDICTS = {
    "pass": "matches the reference",
    "error": "plan() or run() raised",
    "unwritten": "output rows left as they were before the run",
    "nan": "NaN or inf in the output where the reference has none (or the reverse)",
    "mismatch": "output off the reference beyond the tolerance",
    "lse": "LSE off the reference (or its -inf pattern differs)",
    "rows_past_batch": "graph replay wrote rows past the batch",
    "nondeterministic": "a second run of the same plan gave other output (a race: rerun the case many times)",
}


@dataclass
class Verdict:
    """How a case went. ``kind``: a VERDICTS key (errors: 'error' and ``error_type``)."""

    kind: str
    message: str = ""
    max_abs_err: float = 0.0
    rel_err: float = 0.0
    bad_rows: int = 0
    rows: int = 0
    error_type: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "pass"

    @property
    def signature(self) -> str:
        """What a shrunk case must still show to count as the same failure."""
        return f"error:{self.error_type}" if self.kind == "error" else self.kind


def compare(out: torch.Tensor, ref: torch.Tensor, o_dtype: str, lse: torch.Tensor | None = None,
            ref_lse: torch.Tensor | None = None, rows_past_written: int = 0) -> Verdict:
    """Kernel output (written over SENTINEL) vs the reference; one host sync."""
    atol, rtol, rel_tol = TOLERANCES[o_dtype]
    o = out.float()
    rows = o.shape[0]
    if rows == 0:
        return Verdict("pass")
    flat = o.reshape(rows, -1)
    ref_flat = ref.reshape(rows, -1)
    unwritten = (flat == SENTINEL).all(dim=1)
    # NaN / inf where the reference has none, or none where it has one: a NaN in is NaN out
    nonfinite = nan_positions_differ(flat, ref_flat)
    both = torch.isfinite(flat) & torch.isfinite(ref_flat)
    err = torch.where(both, (flat - ref_flat).abs(), torch.zeros_like(flat))
    bad = (err > atol + rtol * ref_flat.abs()).any(dim=1) | nonfinite
    finite_err = err
    stats = torch.stack([unwritten.sum().float(), nonfinite.sum().float(), bad.sum().float(),
                         finite_err.max() if err.numel() else err.new_zeros(()),
                         # (floored for an all-zero reference: rows with no visible key)
                         err.norm() / torch.where(both, ref_flat, 0).norm().clamp_min(atol * math.sqrt(err.numel()))])
    lse_bad = None
    if lse is not None and ref_lse is not None:
        fin = torch.isfinite(ref_lse)
        pattern = (torch.isfinite(lse) != fin)
        off = ((lse - ref_lse).abs() > LSE_TOLERANCE[0] + LSE_TOLERANCE[1] * ref_lse.abs()) & fin
        lse_bad = (pattern | off).any(dim=1).sum().float().view(1)
        stats = torch.cat([stats, lse_bad])
    values = stats.tolist()
    n_unwritten, n_nonfinite, n_bad, max_err, rel = (int(values[0]), int(values[1]), int(values[2]), values[3],
                                                     values[4])
    v = Verdict("pass", max_abs_err=max_err, rel_err=rel if math.isfinite(rel) else math.inf, bad_rows=n_bad,
                rows=rows)
    if n_unwritten:
        v.kind, v.message = "unwritten", f"{n_unwritten} of {rows} rows not written"
    elif n_nonfinite:
        v.kind, v.message = "nan", f"{n_nonfinite} of {rows} rows have NaN/inf where the reference has none (or none " \
                                   "where it has)"
    elif n_bad or not rel <= rel_tol:
        v.kind = "mismatch"
        v.message = (f"{n_bad} of {rows} rows off (max abs err {max_err:.3g}, tolerance {atol:g} + {rtol:g}|ref|); "
                     f"rel. error {rel:.3g} (tolerance {rel_tol:g})")
    elif rows_past_written:
        v.kind, v.message = "rows_past_batch", f"{rows_past_written} rows past the batch written by the replay"
    elif lse_bad is not None and values[5]:
        v.kind, v.message = "lse", f"{int(values[5])} of {rows} rows have an LSE off the reference"
    return v


def compare_runs(first: torch.Tensor, second: torch.Tensor, verdict: Verdict) -> Verdict:
    """``verdict`` (a pass of ``first``) unless a second run of the same plan wrote other bits
    (NaN equal to NaN): then 'nondeterministic', with the rows that differ."""
    rows = first.shape[0]
    if rows == 0:
        return verdict
    a, b = first.reshape(rows, -1), second.reshape(rows, -1)
    differ = ((a != b) & ~(torch.isnan(a) & torch.isnan(b))).any(dim=1)
    n = int(differ.sum())
    if not n:
        return verdict
    where = differ.nonzero().flatten()[:8].tolist()
    return Verdict("nondeterministic", f"{n} of {rows} rows differ between two runs of one plan (rows {where}"
                   f"{', ...' if n > 8 else ''})", max_abs_err=verdict.max_abs_err, rel_err=verdict.rel_err,
                   bad_rows=n, rows=rows)


def error_verdict(e: BaseException, rows: int = 0) -> Verdict:
    tb = traceback.extract_tb(e.__traceback__)
    where = " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(tb[-3:]))
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return Verdict("error", f"{type(e).__name__}: {text[:400]} [at {where}]", rows=rows, error_type=type(e).__name__)


_CUDA_FATAL = re.compile(r"illegal memory access|unspecified launch failure|device-side assert|CUDA error|"
                         r"cudaError|an illegal instruction|misaligned address", re.IGNORECASE)


def is_fatal(v: Verdict) -> bool:
    """Whether an error left the CUDA context unusable (later cases cannot run in this process):
    a CUDA error after which a small op fails too (sticky: illegal address, launch failure,
    device assert), not one it recovers from (invalid argument, out of memory)."""
    if v.kind != "error" or not _CUDA_FATAL.search(v.message):
        return False
    if not torch.cuda.is_available():
        return True  # (the CPU fakes plant such errors; nothing to probe)
    try:
        torch.ones(1, device="cuda").add_(1).item()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True
    return False
