"""User-facing errors. Every command turns these into a one-line message and exit 2."""

from __future__ import annotations


class HloShardError(Exception):
    """Base class: an error the user can act on (bad input, bad flags)."""


class HloParseError(HloShardError):
    """Syntax or structural error in HLO text, with its position.

    ``str(err)`` is the one-line ``path:line:col: error: message``; :meth:`render`
    adds the offending line and a caret under the column.
    """

    def __init__(self, message: str, line: int, column: int, source_line: str = "",
                 path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column
        self.source_line = source_line
        self.path = path

    def __str__(self) -> str:
        return f"{self.path or '<input>'}:{self.line}:{self.column}: error: {self.message}"

    def render(self) -> str:
        if not self.source_line:
            return str(self)
        shown = self.source_line if len(self.source_line) <= 200 else self._window()
        caret_col = self.column - 1 if len(self.source_line) <= 200 else min(self.column - 1, 80)
        return f"{self}\n{shown}\n{' ' * caret_col}^"

    def _window(self) -> str:
        start = max(0, self.column - 1 - 80)
        return self.source_line[start:start + 160]


class HloRuntimeError(HloShardError):
    """XLA rejected, crashed on, or timed out on a module."""
