"""The specs shipped with variantgen, and the one resolver of a spec argument.

Every entry point that takes a spec (make_wrapper, probe, the command line's SPEC
arguments) accepts a VariantSpec, a path to a spec file, or the name of a shipped spec
such as ``"mm_prefix"``. The shipped specs are package data: variantgen/specs/ in an
installed wheel, specs/ in a checkout (variantgen.core.env.SPECS_DIR).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from pathlib import Path

from ..core.env import SPECS_DIR
from ..core.errors import Location, SpecError
from .spec import load_spec as load_spec_file
from .values import VariantSpec

log = logging.getLogger("variantgen.lang.library")

SpecLike = VariantSpec | str | os.PathLike
"""What a spec argument may be: a parsed spec, a spec file's path, or a shipped spec's name."""

# Former names of shipped specs -> their names now (still resolved, with a warning).
RENAMED = {"attention_sink": "streaming_sink"}  # StreamingLLM's sinks, apart from learned sinks


@functools.lru_cache(maxsize=1)
def _shipped() -> tuple[tuple[str, Path], ...]:
    return tuple((p.stem, p) for p in sorted(SPECS_DIR.glob("*.yaml")))


def shipped_specs() -> dict[str, Path]:
    """The specs shipped with variantgen: name -> spec file, in name order. Each name is also
    the spec's ``name`` (and so its modules' URI prefix)."""
    return dict(_shipped())


def _unknown_name(text: str, names: list[str]) -> SpecError:
    close = difflib.get_close_matches(text.lower(), names, n=1, cutoff=0.6)
    hint = f"did you mean `{close[0]}`?" if close else "pass the path of a spec file, e.g. ./my_mask.yaml"
    shipped = ", ".join(names) or "none: this installation has no specs folder"
    return SpecError(f"not a spec file, nor the name of a shipped spec ({shipped})", Location(text), hint=hint)


def resolve_spec(spec: SpecLike) -> VariantSpec:
    """The VariantSpec a spec argument stands for.

    A VariantSpec is returned as it is; a path-like object is a spec file; a string is a spec
    file when such a file exists, else the name of a shipped spec. A string that is neither
    raises SpecError listing the shipped names (with "did you mean" for a near miss); one that
    looks like a path (has a folder or a .yaml suffix) gets load_spec's error for that path.
    """
    if isinstance(spec, VariantSpec):
        return spec
    if isinstance(spec, os.PathLike):
        return load_spec_file(spec)
    if not isinstance(spec, str):
        raise TypeError(f"spec: expected a VariantSpec, a spec file path or a shipped spec name, "
                        f"got {type(spec).__name__}")
    if not spec.strip():
        raise SpecError("empty spec argument: expected a spec file path or a shipped spec name", Location("<spec>"))
    path = Path(spec)
    if _exists(path, Path.is_file):
        return load_spec_file(path)
    shipped = dict(_shipped())
    if spec in shipped:
        return load_spec_file(shipped[spec])
    if spec in RENAMED and RENAMED[spec] in shipped:
        log.warning("spec `%s` is now called `%s` (StreamingLLM sinks, the first tokens kept visible; learned "
                    "sink logits are `attention_sink_learned`): resolving it to that spec", spec, RENAMED[spec])
        return load_spec_file(shipped[RENAMED[spec]])
    looks_like_path = os.sep in spec or (os.altsep or os.sep) in spec or path.suffix in (".yaml", ".yml")
    if not looks_like_path and not _exists(path, Path.exists):
        raise _unknown_name(spec, list(shipped))
    if not _exists(path, Path.exists) and path.stem in shipped:
        raise SpecError("spec file not found", Location(spec),
                        hint=f"variantgen ships a spec named `{path.stem}`: pass that name to use it")
    return load_spec_file(path)  # its errors name the path: not found, a folder, unreadable, not UTF-8


def load_spec(path: str | os.PathLike) -> VariantSpec:
    """Read and validate a spec file, or a shipped spec by its name (``load_spec("document")``),
    as every entry point that takes a spec does (resolve_spec). SpecError (SpecErrors for
    several) naming the file; TypeError for a ``path`` that is not a str or os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_spec: path: expected a spec file path (str or os.PathLike) or a shipped spec name, "
                        f"got {type(path).__name__}")
    return resolve_spec(path)


def _exists(path: Path, test) -> bool:
    """``test(path)`` (is_file / exists), False where the name cannot be a path here (too long:
    ENAMETOOLONG, which pathlib raises instead of answering)."""
    try:
        return test(path)
    except (OSError, ValueError):
        return False
