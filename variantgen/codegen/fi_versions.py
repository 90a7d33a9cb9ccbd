"""The FlashInfer versions variantgen builds against, and what differs between them.

Engines pin their own flashinfer-python, so a module is built against whichever one is
installed (build.flashinfer_info; the module key names its version). The headers and host
sources variantgen's templates include or adapt were compared between the versions below;
where they differ, the difference is decided here, from the installed version, and rendered
into every module as ``fi_facts.h`` (``header_text``) - the templates test its macros, never
guess from FlashInfer's own headers.

Checked (FlashInfer's include/ and csrc/ files the fa2 / fa3 templates use):
  * 0.7.2.post1 -> 0.7.4: ``PrefillPlan`` (attention/scheduler.cuh) takes a new
    ``bool fixed_uniform_q_len`` after ``uniform_q_len`` (false keeps 0.7.2's schedule); the fa2
    prefill kernels (attention/prefill.cuh: ``BatchPrefillWith{Paged,Ragged}KVCacheDispatched``)
    take a new template argument ``bool USE_TOKEN_HEAD_SF`` after the mask mode (per-token,
    per-head KV scale factors; false for variantgen's modules) and FlashInfer's host sources
    (csrc/batch_prefill*.cu) read a ``USE_TOKEN_HEAD_SF`` constant from the config; decode.cuh,
    page.cuh, pos_enc.cuh and math.cuh changed internally but not in what the templates name;
    variant_helper.cuh, mask.cuh, the params
    headers and every sm90 header (attention/hopper/, the variant ABI, ``CollectiveEpilogue``)
    are byte-identical.
  * The sm90 epilogue's barrier (hopper/epilogue.cuh: consumers *arrive* at EpilogueBarrier, then
    *sync* on it before the copy-out; see templates/fa3/epilogue_barrier.cuh) is the same in
    0.7.2.post1 and 0.7.4, so both need the fixed store. A version newer than the newest checked
    keeps it too until its header has been read: the fix costs one barrier, a stale row costs a
    wrong answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.errors import ToolchainError

OLDEST = "0.7.2.post1"
"""The oldest flashinfer-python variantgen builds against (the one it was written on)."""
NEWEST_CHECKED = "0.7.4"
"""The newest flashinfer-python whose headers were compared with the templates (see above)."""
CHECKED = (OLDEST, NEWEST_CHECKED)
"""The versions CPU CI builds fa2 and fa3 modules against (tests/cpu/test_build_nvcc.py)."""

# A PEP 440 version as FlashInfer publishes them (0.7.2.post1, 0.7.5rc1, 0.7.6.dev3+cu130): parsed
# here rather than with `packaging`, which is not one of variantgen's dependencies.
_VERSION = re.compile(r"(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?(?:\.dev(\d+))?(?:\+[\w.]+)?")
_PRE_RANK = {"dev": 0, "a": 1, "b": 2, "rc": 3, None: 4}  # a release sorts after its pre-releases


def version_key(text: str) -> tuple:
    """A sortable key of version ``text``; ValueError where it is not a version."""
    m = _VERSION.fullmatch(text.strip())
    if m is None:
        raise ValueError(text)
    release, pre, pre_n, post, dev = m.groups()
    parts = tuple(int(x) for x in release.split("."))
    parts += (0,) * (4 - len(parts))
    stage = pre if pre else ("dev" if dev is not None and post is None else None)
    return parts, _PRE_RANK[stage], int(pre_n or dev or 0) if stage else 0, int(post or -1)


_PLAN_FIXED_UNIFORM_Q_LEN_SINCE = version_key("0.7.4")  # PrefillPlan's fixed_uniform_q_len argument
_TOKEN_HEAD_SF_SINCE = version_key("0.7.4")  # the fa2 prefill kernels' USE_TOKEN_HEAD_SF template argument
# The newest version known to have the arrive-then-sync epilogue barrier; None: no version has
# been seen with it fixed, so every version gets the fixed store.
_EPILOGUE_BARRIER_FIXED_IN: tuple | None = None


class UnsupportedFlashInfer(ToolchainError):
    """The installed flashinfer-python is outside the range variantgen builds against."""


@dataclass(frozen=True)
class FlashInferFacts:
    """What the templates must know about one FlashInfer version."""

    version: str
    plan_fixed_uniform_q_len: bool
    """PrefillPlan takes ``fixed_uniform_q_len`` (0.7.4 on)."""
    kernel_token_head_sf: bool
    """The fa2 prefill kernels take ``USE_TOKEN_HEAD_SF`` after the mask mode (0.7.4 on)."""
    fa3_epilogue_fix: bool
    """The sm90 epilogue's output store needs variantgen's barrier fix (every version so far)."""
    checked: bool
    """Whether this version's headers were compared with the templates (else: newer than
    NEWEST_CHECKED, built on the newest checked version's facts)."""


def _parse(version: str) -> tuple:
    try:
        return version_key(version)
    except ValueError:
        raise UnsupportedFlashInfer(f"flashinfer-python {version!r}: not a version number") from None


def facts(version: str) -> FlashInferFacts:
    """The facts of flashinfer-python ``version``; UnsupportedFlashInfer below OLDEST."""
    v = _parse(version)
    if v < version_key(OLDEST):
        raise UnsupportedFlashInfer(
            f"flashinfer-python {version} is installed; variantgen builds against {OLDEST} or newer "
            f"(checked: {', '.join(CHECKED)}): pip install 'flashinfer-python>={OLDEST}'")
    return FlashInferFacts(
        version=str(version),
        plan_fixed_uniform_q_len=v >= _PLAN_FIXED_UNIFORM_Q_LEN_SINCE,
        kernel_token_head_sf=v >= _TOKEN_HEAD_SF_SINCE,
        fa3_epilogue_fix=_EPILOGUE_BARRIER_FIXED_IN is None or v < _EPILOGUE_BARRIER_FIXED_IN,
        checked=v <= version_key(NEWEST_CHECKED),
    )


def package_versions() -> tuple[str, str]:
    """(flashinfer, tvm-ffi) versions from package metadata: no import, so a cache lookup on
    a serving host stays cheap. PackageNotFoundError if either is missing. The one place the
    installed versions are read: the module key, the rendered facts, probe and doctor ask it."""
    from importlib.metadata import version

    return version("flashinfer-python"), version("apache-tvm-ffi")


def installed_facts() -> FlashInferFacts:
    """The facts of the installed flashinfer-python (from its metadata; no import)."""
    return facts(package_versions()[0])


HEADER_NAME = "fi_facts.h"


def template_context(f: FlashInferFacts) -> dict[str, object]:
    """What the Jinja templates insert where a FlashInfer signature differs by version (fields of
    context.RenderContext)."""
    return {
        # the fa2 prefill kernels' template arguments after the mask mode: an argument / a parameter
        "fi_sf_arg": "/*USE_TOKEN_HEAD_SF=*/false, " if f.kernel_token_head_sf else "",
        "fi_sf_param": "bool USE_TOKEN_HEAD_SF, " if f.kernel_token_head_sf else "",
    }


def header_text(f: FlashInferFacts) -> str:
    """The module header the templates read the version's facts from."""
    return "\n".join([
        f"// The FlashInfer version this module is built against: {f.version}"
        + ("" if f.checked else f" (newer than {NEWEST_CHECKED}, the newest checked: built on its facts)"),
        "// Decided by variantgen/codegen/fi_versions.py from the installed version; do not edit.",
        "#pragma once",
        f"#define VG_FI_PLAN_FIXED_UNIFORM_Q_LEN {int(f.plan_fixed_uniform_q_len)}",
        f"#define VG_FI_KERNEL_TOKEN_HEAD_SF {int(f.kernel_token_head_sf)}",
        f"#define VG_FI_FA3_EPILOGUE_FIX {int(f.fa3_epilogue_fix)}",
        "",
    ])
