"""Running ninja for one module build: escaping, progress, the log, and ending it.

* Paths in a ninja file need ninja's escapes (``$ `` for a space, ``$:`` for a colon, ``$$``
  for a dollar) in build lines, and shell quoting plus ``$$`` in command variables: a cache
  under ``/data/my cache`` or ``/srv/$USER`` must build like any other.
* ninja dies with its builder: it is started through a tiny exec wrapper that asks the kernel
  for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``, Linux), and ninja answers SIGTERM by
  sending it to the process group of every command it runs - which holds the compiler and the
  sub-tools it started. A pdeathsig on ninja alone would not be enough with SIGKILL (ninja could
  not pass it on); SIGTERM lets ninja do the passing. So ``kill -9`` of a builder no longer
  leaves ninja and its compilers running (one of them holding a shared object's lock) until a
  later build of the module. A compiler that ignores SIGTERM is still ended by that later build
  (the pid record below). The wrapper, not ``preexec_fn``: builds run in worker threads, where
  running Python code between fork and exec is unsafe. (The kernel ties the signal to the thread
  that started ninja; run() waits for ninja in that very thread, so it outlives the build.)
* ninja runs in its own session (process group), so a terminal's Ctrl-C reaches only us:
  on an error, an interrupt or the build timeout we end ninja and every compiler below it
  (ninja gives each command its own process group, so the group of ninja alone is not
  enough: the tree is read from /proc first); after ninja failed or was killed, whatever is
  left in its session. Builds in worker threads (precompile) are ended through ABORT. The
  pid is recorded in the staging folder, so that the next build of the module ends the
  compilers of a builder that was killed.
* ninja's ``[done/total]`` status lines are read as they come, for the progress bar; every
  line goes to ``build.log`` as it arrives (a long build's log can be followed live).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ToolchainError
from ..core.safe_read import read_text_bounded

log = logging.getLogger("variantgen.build.builder")
STATUS = "[%f/%t] "  # NINJA_STATUS: finished / total edges
_STATUS_RE = re.compile(r"^\[(\d+)/(\d+)\] ")
PID_FILE = "ninja.pid"
GRACE_S = 3.0  # SIGTERM first (ninja forwards it to its commands), SIGKILL after this


def escape_path(path: str | os.PathLike) -> str:
    """A path as ninja reads it in a build line."""
    text = _no_newline(str(path))
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def shell_args(args: Sequence[str | os.PathLike]) -> str:
    """Command-line arguments as the value of a ninja variable used in a command: quoted for
    the shell that runs the command, with ninja's ``$$`` for a literal dollar."""
    return " ".join(shlex.quote(_no_newline(str(a))) for a in args).replace("$", "$$")


def _no_newline(text: str) -> str:
    if "\n" in text or "\r" in text:
        raise ValueError(f"path or argument {text!r} contains a line break, which a ninja file cannot hold")
    return text


@dataclass(frozen=True)
class NinjaRun:
    returncode: int
    output: str  # everything ninja and the compilers printed, in order
    seconds: float
    timed_out: bool = False
    log_problem: str = ""  # why build.log is incomplete (a full disk), or ""


def run(cmd: Sequence[str], *, cwd: Path, env: dict[str, str], log_path: Path, timeout: float | None,
        on_status: Callable[[int, int], None] | None = None, record_dir: Path | None = None) -> NinjaRun:
    """Run ninja ``cmd`` in ``cwd`` (the build folder); stream its output into ``log_path``
    and ``on_status(done, total)``; ninja's pid is recorded in ``record_dir`` (the staging folder,
    default ``cwd``: end_recorded). Ends the whole process tree if this returns by an exception
    (KeyboardInterrupt, BuildAborted included) or the timeout; what is left of ninja's session if
    ninja exits non-zero."""
    t0 = time.perf_counter()
    lines: list[str] = []
    log_problem = ""
    try:
        log_file = open(log_path, "w")  # closed by the reader thread
    except OSError as e:
        log_file, log_problem = None, f"cannot write {log_path}: {e.strerror or e}"
    try:
        proc = subprocess.Popen(_dies_with_us(cmd), cwd=cwd, env=dict(env, NINJA_STATUS=STATUS), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace",
                                bufsize=1, start_new_session=True)
    except OSError as e:
        if log_file is not None:
            log_file.close()
        raise ToolchainError(f"cannot run {cmd[0]}: {e.strerror or e}") from None
    record = (record_dir or cwd) / PID_FILE
    try:
        record.write_text(json.dumps({"pid": proc.pid, "start": _start_ticks(proc.pid), "host": socket.gethostname()}))
    except OSError:
        pass  # only lets a later build end this one's compilers if we are killed

    def read() -> None:
        nonlocal log_file, log_problem
        report = on_status
        assert proc.stdout is not None
        for line in proc.stdout:  # drained to the end, whatever happens: ninja blocks on a full pipe
            lines.append(line)
            if log_file is not None:
                try:
                    log_file.write(line)
                    log_file.flush()
                except OSError as e:  # keep the output in memory (BuildError carries it)
                    log_problem = f"cannot write {log_path}: {e.strerror or e}"
                    with contextlib.suppress(OSError):
                        log_file.close()
                    log_file = None
            m = _STATUS_RE.match(line)
            if m and report is not None:
                try:
                    report(int(m.group(1)), int(m.group(2)))
                except Exception:  # noqa: BLE001 - a broken progress display must not stop the build
                    log.debug("progress report failed; no more updates", exc_info=True)
                    report = None
        if log_file is not None:
            with contextlib.suppress(OSError):
                log_file.close()

    reader = threading.Thread(target=read, name="variantgen-ninja-output", daemon=True)
    reader.start()
    timed_out = False
    try:
        timed_out = _wait(proc, timeout)
        if timed_out:
            end_tree(proc.pid)
            proc.wait()
        elif proc.returncode != 0:
            # ninja failed or was killed (kill -9 leaves its compilers and shared_compile
            # helpers running, now children of init): end what is left of its session
            end_session(proc.pid)
    except BaseException:
        end_tree(proc.pid)
        proc.wait()
        raise
    finally:
        reader.join(timeout=30)
        try:
            record.unlink()
        except OSError:
            pass
    return NinjaRun(proc.returncode, "".join(lines), time.perf_counter() - t0, timed_out, log_problem)


# argv: the builder's pid, then the command. Exits (never runs the command) if the builder died
# before the request took effect; prctl's failure (not Linux) leaves the command to run as before.
_PDEATHSIG_EXEC = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _dies_with_us(cmd: Sequence[str]) -> list[str]:
    """``cmd`` (its first item a path) started through the wrapper that ends it with our process
    (see the module's doc); as it is where there is no Python to run the wrapper or no prctl."""
    exe = str(cmd[0])
    if os.sep in exe:  # what Popen would say, before the wrapper runs (its exec fails later, less clearly)
        if not os.path.exists(exe):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), exe)
        if os.path.isdir(exe) or not os.access(exe, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), exe)
    python = sys.executable
    if not python or not sys.platform.startswith("linux"):
        return list(cmd)
    return [python, "-I", "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid()), *cmd]


ABORT = threading.Event()
"""Set: every build running in this process ends its ninja tree and raises BuildAborted (an
interrupted `variantgen precompile`, whose builds run in worker threads that no signal reaches)."""
_POLL_S = 0.2


class BuildAborted(KeyboardInterrupt):
    """A build ended because ABORT was set (Ctrl-C or SIGTERM of the command running it)."""


def check_abort() -> None:
    """BuildAborted once ABORT is set (a build waiting for a lock asks between tries)."""
    if ABORT.is_set():
        raise BuildAborted("build interrupted")


def _wait(proc: subprocess.Popen, timeout: float | None) -> bool:
    """Wait for ``proc``; True if ``timeout`` passed first. BuildAborted once ABORT is set."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if ABORT.is_set():
            raise BuildAborted("build interrupted")
        step = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        if step <= 0:
            return True
        try:
            proc.wait(timeout=step)
            return False
        except subprocess.TimeoutExpired:
            continue


def end_recorded(staging: Path) -> bool:
    """End the ninja tree recorded in an old staging folder, if it still runs on this host
    (its builder was killed). True if one was ended."""
    try:
        data = json.loads(read_text_bounded(staging / PID_FILE))
        pid, start, host = int(data["pid"]), data.get("start"), str(data["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or start is None:
        return False
    fields = _stat_fields(pid)
    now = int(fields[19]) if fields is not None else None
    if now is None or (now == start and fields[0] == "Z"):
        # ninja is gone, or a zombie nobody reaps (it ends on its builder's death, without waiting
        # for a compiler that ignores SIGTERM); what it started keeps its session. The kernel does
        # not reuse a pid while a process still has it as its session id, so these are ninja's.
        left = [p for p, fields in _processes() if int(fields[3]) == pid]
        if left:
            _terminate(left)
        return bool(left)
    if now != start:
        return False  # the pid now belongs to another process
    end_tree(pid)
    return True


def end_tree(pid: int) -> None:
    """SIGTERM ``pid`` (a session leader we started) and its descendants, SIGKILL what is left
    after GRACE_S."""
    _terminate([pid, *_descendants(pid)])


def end_session(sid: int) -> None:
    """End every process left in session ``sid`` (ninja's, after ninja exited: the commands it
    started keep its session when their parent is gone), SIGTERM then SIGKILL after GRACE_S."""
    _terminate([pid for pid, fields in _processes() if int(fields[3]) == sid and pid != sid])


def _terminate(pids: list[int]) -> None:
    """SIGTERM ``pids``, then SIGKILL those still alive after GRACE_S."""
    for p in pids:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for p in pids:
        if _alive(p):
            _signal(p, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    state = _stat_fields(pid)
    return state is not None and state[0] != "Z"  # a zombie has exited (its parent reaps it)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, ppid, ... (None if there is no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None  # field 22 of stat: start time


def _processes() -> list[tuple[int, list[str]]]:
    """(pid, stat fields) of every process now."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                out.append((int(entry.name), fields))
    return out


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, fields in _processes():
        children.setdefault(int(fields[1]), []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
