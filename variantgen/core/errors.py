"""One error hierarchy for everything variantgen raises on purpose.

SpecError carries a source location (file:line:col) and, where one is obvious, a hint.
BuildError carries the compiler output, the log path and a command that reproduces it.
"""

from __future__ import annotations

from dataclasses import dataclass


class VariantgenError(Exception):
    """Base class of every error variantgen raises deliberately."""


@dataclass(frozen=True)
class Location:
    """A place in a spec file. ``line`` and ``col`` are 1-based; 0 means unknown."""

    file: str = "<string>"
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        if self.col <= 0:
            return f"{self.file}:{self.line}"
        return f"{self.file}:{self.line}:{self.col}"

    def shifted(self, line_offset: int, col: int) -> Location:
        return Location(self.file, self.line + line_offset, col)


EXCERPT_CHARS = 100  # a longer source line is shown around the caret only
MAX_TEXT_CHARS = 600  # a message or hint quoting more of a hostile file is cut in the middle
MAX_SPEC_ERRORS = 20  # per file; the rest are counted ("and N more")
MAX_ERRORS_CHARS = 12_000  # the errors of one file as printed, at most (the rest are counted)


def printable(text: str) -> str:
    """``text`` safe to print anywhere: lone surrogates (from a YAML escape such as "\\ud83d"
    or a file name that is not UTF-8) become escapes instead of failing the UTF-8 encoder."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def user_text(text: str, limit: int = 200) -> str:
    """Text from a spec file (a tensor's doc ...) as a message quotes it: one line, control
    characters, odd line breaks and lone surrogates written as escapes, cut in the middle past
    ``limit`` characters."""
    out = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return out if len(out) <= limit else f"{out[:limit - 40]} ... ({len(out)} characters) ... {out[-20:]}"


def _bounded(text: str) -> str:
    if len(text) <= MAX_TEXT_CHARS:
        return text
    return f"{text[:MAX_TEXT_CHARS - 100]} ... ({len(text)} characters) ... {text[-60:]}"


def _excerpt(line: str, caret: int) -> tuple[str, int]:
    """The source line as shown under a message, and the caret's 1-based column in it: one
    line, control characters as '?', at most EXCERPT_CHARS characters around the caret."""
    start = max(0, min(caret - 1 - EXCERPT_CHARS // 2, len(line) - EXCERPT_CHARS))
    end = start + EXCERPT_CHARS  # one character shown per character of the line: the caret lines up
    head, tail = ("..." if start else ""), ("..." if end < len(line) else "")
    shown = "".join(ch if ch.isprintable() else " " if ch == "\t" else "?" for ch in line[start:end])
    return head + shown + tail, caret - start + len(head)


class SpecError(VariantgenError):
    """A spec file (or expression inside it) is wrong.

    The message reads ``file:line:col: <field>: <what is wrong>`` followed by the
    offending source line with a caret and an optional hint.
    """

    def __init__(
        self,
        message: str,
        location: Location | None = None,
        *,
        field: str | None = None,
        source_line: str | None = None,
        hint: str | None = None,
        caret_col: int | None = None,
    ):
        self.message = message
        self.caret_col = caret_col
        self.location = location or Location()
        self.field = field
        self.source_line = source_line
        self.hint = hint
        super().__init__(self.render())

    def render(self, show_file: bool = True) -> str:
        """The message; ``show_file=False`` leaves the file out of the location (SpecErrors
        names it once above its list)."""
        loc = self.location
        if show_file:
            where = _bounded(str(loc))
        else:
            where = f"{loc.line}:{loc.col}" if loc.col > 0 else str(loc.line)
        head = f"{where}: "
        if self.field:
            head += f"{_bounded(self.field)}: "
        text = head + _bounded(self.message)
        caret = self.caret_col if self.caret_col is not None else self.location.col
        if self.source_line is not None and caret > 0:
            line, caret = _excerpt(self.source_line, caret)
            text += f"\n    {line}\n    {' ' * (caret - 1)}^"
        if self.hint:
            text += f"\n  hint: {_bounded(self.hint)}"
        return printable(text)


class SpecErrors(SpecError):
    """Several spec errors found in one pass (validate reports all of them, up to
    MAX_SPEC_ERRORS; ``more`` counts the ones left out)."""

    def __init__(self, errors: list[SpecError], more: int = 0):
        self.errors = list(errors)
        self.more = more
        first = self.errors[0]
        super().__init__(
            first.message,
            first.location,
            field=first.field,
            source_line=first.source_line,
            hint=first.hint,
            caret_col=first.caret_col,
        )

    def render(self, show_file: bool = True) -> str:  # type: ignore[override]
        """The file once (bounded: a 4 KB path used to be repeated per error), then each error
        indented under it as line:col: ...; at most MAX_ERRORS_CHARS in all, the rest counted."""
        errors = getattr(self, "errors", [])
        if not errors:
            return super().render(show_file)
        file = errors[0].location.file
        parts: list[str] = []
        size = 0
        shown = 0
        for e in errors:
            same = e.location.file == file and e.location.line > 0
            body = e.render(show_file=not same)
            if parts and size + len(body) > MAX_ERRORS_CHARS:
                break
            parts.append("  " + body.replace("\n", "\n  "))
            size += len(body)
            shown += 1
        more = getattr(self, "more", 0) + len(errors) - shown
        total = len(errors) + getattr(self, "more", 0)
        text = f"{printable(_bounded(file))}: {total} errors\n" + "\n".join(parts)
        if more:
            text += f"\n  ... and {more} more error(s)"
        return text


class BuildError(VariantgenError):
    """Compiling or linking a module failed."""

    def __init__(self, message: str, *, log_path: str | None = None, command: str | None = None,
                 output: str = "", first_error: str | None = None):
        self.log_path = log_path
        self.command = command
        self.output = output
        self.first_error = first_error or first_compiler_error(output)
        text = message
        if self.first_error:
            text += f"\n  first error: {self.first_error}"
        if log_path:
            text += f"\n  full log: {log_path}"
        if command:
            text += f"\n  reproduce with: {command}"
        super().__init__(text)


class ToolchainError(VariantgenError):
    """nvcc / CUDA_HOME / ninja missing or unusable."""


class CacheError(VariantgenError):
    """The module cache is unusable (not writable, corrupted beyond repair)."""


class JitDisabledError(VariantgenError):
    """JIT is disabled (or building not allowed) and the module is not in the cache.
    ``damaged``: why entries that would have been it are unusable (each names its path)."""

    def __init__(self, message: str, *, damaged: list[str] | None = None):
        super().__init__(message)
        self.damaged = list(damaged or ())


class BackendError(VariantgenError):
    """A backend cannot run here (e.g. the flex route on a torch without FlexAttention)."""


class LaunchError(VariantgenError, ValueError):
    """A wrapper call was given arguments the kernel cannot take (raised before launch)."""


# What the system said when a build ran out of something: the real cause behind a tool's generic
# failure line (a full disk at link time printed "ld: final link failed: No space left on device",
# then "collect2: error: ld returned 1 exit status", and only the latter was reported).
SYSTEM_FAILURES = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                   "Cannot allocate memory", "Too many open files", "File too large")


def system_failure(output: str) -> str | None:
    """The first line of build output naming one of SYSTEM_FAILURES, or None."""
    for line in output.splitlines():
        if any(cause in line for cause in SYSTEM_FAILURES):
            return line.strip()[:400]
    return None


def first_compiler_error(output: str) -> str | None:
    """The first line of compiler output that names a system failure (a full disk), else the
    first that looks like an error, for short reasons."""
    found = system_failure(output)
    if found:
        return found
    for line in output.splitlines():
        low = line.lower()
        if " error" in low or low.startswith("error") or "error:" in low or "fatal" in low:
            return line.strip()[:400]
    return None
