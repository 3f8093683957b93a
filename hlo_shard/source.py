"""Reading input files: bounded in size, undecodable bytes a located error."""

from __future__ import annotations

from pathlib import Path

from hlo_shard.errors import HloParseError, HloShardError
from hlo_shard.limits import INPUT_BYTES

_CHUNK = 1 << 20


def read_bytes(path: str | Path) -> bytes:
    """The whole file, refused past :data:`hlo_shard.limits.INPUT_BYTES` (read in
    chunks, so ``/dev/zero`` or an endless pipe stops at the limit, not at the OOM
    killer)."""
    limit = INPUT_BYTES.value()
    chunks: list[bytes] = []
    total = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            total += len(chunk)
            if limit is not None and total > limit:
                raise HloShardError(f"{path}: input is larger than the limit of {limit} "
                                    f"bytes; raise it with {INPUT_BYTES.how_to_raise()}")
            chunks.append(chunk)
    return b"".join(chunks)


def read_text(path: str | Path) -> str:
    """Read an input file as UTF-8; undecodable bytes are an error at their line:col."""
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise HloParseError("input is not UTF-8 text", line, column, path=str(path)) from None
