"""User-facing errors. Every command turns these into a one-line message and exit 2."""

from __future__ import annotations


class HloShardError(Exception):
    """Base class: an error the user can act on (bad input, bad flags)."""


class HloParseError(HloShardError):
    """Syntax or structural error in HLO text, with its position: ``str(err)`` is the
    one line ``path:line:col: error: message``."""

    def __init__(self, message: str, line: int, column: int,
                 path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column
        self.path = path

    def __str__(self) -> str:
        return f"{self.path or '<input>'}:{self.line}:{self.column}: error: {self.message}"


class HloRuntimeError(HloShardError):
    """XLA rejected, crashed on, or timed out on a module."""
