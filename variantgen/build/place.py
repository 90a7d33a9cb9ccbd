"""Where a module's compilers run: never in a folder whose path a shell would expand.

nvcc runs its sub-tools (cudafe++, cicc, the host compiler) through a shell of its own and puts
paths into those command lines in double quotes, which leave ``$VAR``, ``$(...)`` and backticks
live. Relative paths are not enough: nvcc passes the *real* absolute path of every source
(``--orig_src_path_name "<cwd>/src/x.cu"``, the working folder resolved through any link) and of
its temporary files (``$TMPDIR``). A cache under ``/srv/c $(touch PWNED)`` therefore ran the
payload on every build, and one under ``/home/$HOME`` failed to build.

So the compilers run in a folder whose real path is plain (letters, digits, a few punctuation
marks, spaces): the staging folder itself when the cache path is plain - the usual case, where
nothing changes - and otherwise a private temporary folder (``mkdtemp`` under a plain temporary
root) that receives the sources and the ninja file and gives back the module file. A link to the
staging folder would not do: nvcc resolves it. The build's log, pid record and failure record stay
in the staging folder (Python writes them; no shell sees those paths). ``TMPDIR`` is pointed at a
plain folder too when the inherited one is not plain. The shared objects' store is reached through
a relative link (``objects-store``) in the build folder, so its path - which may even hold a line
break, which a ninja file cannot - never appears in build.ninja or on a command line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..core.errors import CacheError
from ..core.safe_read import read_text_bounded
from .cache import path_error

log = logging.getLogger("variantgen.build")

STORE_LINK = "objects-store"  # in the build folder: the shared objects' store (objects.py)
BUILD_DIR_RECORD = "build-dir"  # in the staging folder: the temporary folder its compilers run in
PREFIX = "variantgen-build-"
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _./+,@%=:~-")
_INPUTS = ("src", "build.ninja")  # what a build folder needs besides the *.object.json descriptions


def is_plain(path: str | os.PathLike) -> bool:
    """Whether no shell expands or splits anything in ``path`` once it is in double quotes (what
    nvcc does with paths): only letters, digits, spaces and ``_./+,@%=:~-``; non-ASCII letters too."""
    return all(c in _PLAIN or (c.isalnum() and not c.isascii()) for c in str(path))


def plain_temp_root() -> Path:
    """A temporary root with a plain real path: TMPDIR's (tempfile's choice), else /tmp. CacheError
    if neither is plain and usable."""
    for candidate in (tempfile.gettempdir(), "/tmp"):
        real = os.path.realpath(candidate)
        if is_plain(real) and os.path.isdir(real) and os.access(real, os.W_OK | os.X_OK):
            return Path(real)
    raise CacheError(f"the build needs a temporary folder whose path holds no shell characters ($, `, quotes, "
                     f"line breaks...); TMPDIR={tempfile.gettempdir()!r} and /tmp are not usable: set TMPDIR to one")


def build_env(env: dict[str, str], where: Path) -> dict[str, str]:
    """``env`` with TMPDIR plain (nvcc's temporary files are named on its shell's command lines)."""
    tmp = env.get("TMPDIR") or tempfile.gettempdir()
    if is_plain(os.path.realpath(tmp)):
        return env
    private = where / "tmp"
    private.mkdir(exist_ok=True)
    return dict(env, TMPDIR=str(private))


@contextlib.contextmanager
def compile_dir(staging: Path, store: Path) -> Iterator[Path]:
    """The folder the build runs in (see the module's doc): ``staging`` itself if its real path is
    plain, else a temporary copy of its inputs, removed on the way out. Either way it has the
    ``objects-store`` link to ``store``. Call ``bring_back`` for the module file."""
    _link(staging / STORE_LINK, store)
    real = os.path.realpath(staging)
    if is_plain(real):
        yield staging
        return
    root = plain_temp_root()
    try:
        where = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    except OSError as e:
        raise path_error(e, root, "create a build folder in") from None
    try:
        # recorded first: a killed build's folder is removed by the next build of the module (forget)
        (staging / BUILD_DIR_RECORD).write_text(str(where))
        log.debug("building in %s: the cache path %s holds characters nvcc's shell would expand", where, staging)
        for name in _INPUTS:
            source = staging / name
            if source.is_dir():
                shutil.copytree(source, where / name)
            elif source.exists():
                shutil.copyfile(source, where / name)
        for describe in staging.glob("*.object.json"):
            shutil.copyfile(describe, where / describe.name)
        _link(where / STORE_LINK, store)
        yield where
    except OSError as e:
        raise path_error(e, e.filename or where, "prepare the build folder") from None
    finally:
        shutil.rmtree(where, ignore_errors=True)
        with contextlib.suppress(OSError):
            (staging / BUILD_DIR_RECORD).unlink()


def reproduce_command(kept: Path, env: str = "") -> str:
    """A shell command that re-runs the build kept in ``kept`` with the variable assignments
    ``env`` ("NAME=value "): ninja in that folder, or, where nvcc's shell would expand the folder's
    path, in a plain-named copy of it (the command says where)."""
    folder = shlex.quote(str(kept))
    if is_plain(os.path.realpath(kept)):
        return f"{env}ninja -C {folder} -f build.ninja"
    root = shlex.quote(str(plain_temp_root()))
    return (f'd=$(mktemp -d {root}/{PREFIX}XXXXXXXX) && cp -R {folder}/. "$d" && mkdir -p "$d/tmp" && '
            f'echo "variantgen: build folder $d" && {env}TMPDIR="$d/tmp" ninja -C "$d" -f build.ninja')


def bring_back(where: Path, staging: Path, name: str) -> None:
    """Copy the built file ``name`` from the build folder into the staging folder (nothing to do
    when they are the same)."""
    if where == staging or not (where / name).is_file():
        return
    try:
        shutil.copyfile(where / name, staging / name)
    except OSError as e:
        raise path_error(e, staging / name, "write") from None


def forget(staging: Path) -> None:
    """Remove the temporary build folder a killed build of ``staging`` left (its compilers ended
    first: ninja.end_recorded)."""
    with contextlib.suppress(OSError, ValueError):
        where = Path(read_text_bounded(staging / BUILD_DIR_RECORD).strip())
        # only what compile_dir made: a folder of ours directly under a temporary root
        if where.name.startswith(PREFIX) and where.parent == plain_temp_root() and not where.is_symlink():
            shutil.rmtree(where, ignore_errors=True)
    with contextlib.suppress(OSError):
        (staging / BUILD_DIR_RECORD).unlink()


def _link(link: Path, target: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    try:
        target.mkdir(parents=True, exist_ok=True)  # a dangling link: `mkdir -p` through it fails
        link.symlink_to(target)
    except OSError as e:
        raise path_error(e, link, "create") from None
