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

    def render(self) -> str:
        head = f"{self.location}: "
        if self.field:
            head += f"{self.field}: "
        text = head + self.message
        caret = self.caret_col if self.caret_col is not None else self.location.col
        if self.source_line is not None and caret > 0:
            text += f"\n    {self.source_line}\n    {' ' * (caret - 1)}^"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class SpecErrors(SpecError):
    """Several spec errors found in one pass (validate reports all of them)."""

    def __init__(self, errors: list[SpecError]):
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(
            first.message,
            first.location,
            field=first.field,
            source_line=first.source_line,
            hint=first.hint,
            caret_col=first.caret_col,
        )

    def render(self) -> str:  # type: ignore[override]
        return "\n".join(e.render() for e in getattr(self, "errors", [])) or super().render()


class BuildError(VariantgenError):
    """Compiling or linking a module failed."""

    def __init__(self, message: str, *, log_path: str | None = None, command: str | None = None,
                 output: str = ""):
        self.log_path = log_path
        self.command = command
        self.output = output
        self.first_error = first_compiler_error(output)
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
    """JIT is disabled and the module is not in the cache."""


class BackendError(VariantgenError):
    """A backend cannot run here (e.g. the flex route on a torch without FlexAttention)."""


class LaunchError(VariantgenError, ValueError):
    """A wrapper call was given arguments the kernel cannot take (raised before launch)."""


def first_compiler_error(output: str) -> str | None:
    """The first line of compiler output that looks like an error, for short reasons."""
    for line in output.splitlines():
        low = line.lower()
        if " error" in low or low.startswith("error") or "error:" in low or "fatal" in low:
            return line.strip()[:400]
    return None
