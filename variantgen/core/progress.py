"""What a module build shows while it runs (a first build is 10-120 s of compiling).

On a terminal: a progress bar per module (compile units done / total, elapsed time and an
estimate of the time left), fed by ninja's ``[done/total]`` lines. Elsewhere (a server's log,
CI): one INFO line when a build starts and one when it ends; a command that a user waits on
(``lines=True``: demo, precompile) writes a line per finished compile unit with the estimate.
precompile, demo, make_wrapper's JIT and the probe all build through build.build_module, which
reports here.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger("variantgen.build.builder")


def first_build_takes(kind: str) -> str:
    """A user-facing estimate of a cold build (2-16 cores; see README's build numbers)."""
    return "about 10 seconds" if kind == "planner" else "about a minute"


class BuildProgress:
    """One module build's report. ``bar``: None = a bar when stderr is a terminal; ``leave``:
    keep the finished bar on screen (precompile drops it and prints a summary line)."""

    def __init__(self, uri: str, units: int, kind: str, *, bar: bool | None = None, leave: bool = True,
                 lines: bool = False):
        self.uri = uri
        self.units = units
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        show = sys.stderr.isatty() if bar is None else bar
        self._bar: Any = None
        self._lines = lines and not show
        self._done = 0
        head = f"building {uri} ({units} compile units; a first build takes {first_build_takes(kind)})"
        if show:
            from tqdm import tqdm

            log.debug("%s", head)
            self._bar = tqdm(total=units, desc=_short(uri), unit="unit", file=sys.stderr, leave=leave,
                             bar_format="{desc}: {n_fmt}/{total_fmt} units |{bar}| {elapsed}, about {remaining} left",
                             dynamic_ncols=True)
        elif self._lines:
            print(head, file=sys.stderr, flush=True)
        else:
            log.info("%s", head)

    def update(self, done: int, total: int) -> None:
        """ninja finished ``done`` of ``total`` edges (the link is one of them)."""
        if self._lines and done > self._done:
            self._done = done
            print(f"  {_short(self.uri)}: {done}/{total} units, {progress_text(self.started, done, total)}",
                  file=sys.stderr, flush=True)
        if self._bar is None:
            return
        with self._lock:
            if total != self._bar.total:
                self._bar.total = total
            self._bar.update(max(0, done - self._bar.n))

    def close(self, ok: bool) -> None:
        seconds = time.perf_counter() - self.started
        if self._bar is not None:
            self._bar.close()
        if ok:
            (log.debug if self._bar is not None else log.info)("built %s in %.1fs", self.uri, seconds)
        else:
            log.warning("building %s failed after %.1fs", self.uri, seconds)


def progress_text(started: float, done: int, total: int, now: float | None = None) -> str:
    """'12s elapsed, about 30s left': the time left extrapolated from the units done so far
    (compile units take similar times; the link at the end is short)."""
    elapsed = (time.perf_counter() if now is None else now) - started
    if done <= 0 or done >= total:
        return f"{elapsed:.0f}s elapsed"
    return f"{elapsed:.0f}s elapsed, about {elapsed / done * (total - done):.0f}s left"


def _short(uri: str) -> str:
    """The readable part of a URI for a bar's label (the hash is in the log line)."""
    return uri.rsplit("_", 1)[0].removeprefix("vg_")
