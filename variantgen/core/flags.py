"""The one check of the bool arguments of plan(), run(), make_wrapper() and probe().

True or False (a few also None: the default decides), never any truthy value: 0 or "false"
would read as the opposite of what it says. No torch here: probe() uses it too.
"""

from __future__ import annotations

from typing import Any

from .errors import LaunchError

OPTIONAL_FLAGS = frozenset({"skip_tiles", "enable_pdl", "check_plan"})  # None: the default decides


def flag_problem(name: str, value: Any) -> str:
    """Why ``value`` is not a value of the flag ``name`` ("" where it is)."""
    if isinstance(value, bool) or (value is None and name in OPTIONAL_FLAGS):
        return ""
    want = "True, False or None" if name in OPTIONAL_FLAGS else "True or False"
    return f"`{name}`={value!r}: expected {want}"


def check_flags(where: str, **flags: Any) -> None:
    """LaunchError for the first of ``flags`` that is not a bool (or None where allowed)."""
    for name, value in flags.items():
        problem = flag_problem(name, value)
        if problem:
            raise LaunchError(f"{where}: {problem}")
