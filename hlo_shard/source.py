"""Reading HLO text files: one place that turns undecodable bytes into a located error."""

from __future__ import annotations

from pathlib import Path

from hlo_shard.errors import HloParseError


def read_text(path: str | Path) -> str:
    """Read an input file as UTF-8; undecodable bytes are an error at their line:col."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise HloParseError("input is not UTF-8 text", line, column, path=str(path)) from None
