"""Checking JSON documents (manifests, hardware profiles) field by field.

Every value is checked for its type and range where it is read, and a bad one is one
:class:`~hlo_shard.errors.HloShardError` that names the document and the field's
place in it (``manifest m.json: parameters[0].shard.length: expected a whole number,
got 4.9``): no traceback, no silent truncation of ``4.9`` to 4, no ``[]`` taken for
"absent".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from hlo_shard.errors import HloShardError
from hlo_shard.source import read_bytes

#: "No default": the field is required.
REQUIRED = object()


def load_json(path: str | Path, kind: str) -> Any:
    """The JSON ``kind`` (manifest, profile) in ``path`` (size-bounded, UTF-8), or a
    located error."""
    origin = f"{kind} {path}"
    data = read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise HloShardError(f"{origin}: not UTF-8 text (byte 0x{data[err.start]:02x} at "
                            f"line {line})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise HloShardError(f"{origin}: not a JSON {kind}, not valid JSON at line "
                            f"{err.lineno}, column {err.colno}: {err.msg}") from None
    except RecursionError:
        raise HloShardError(f"{origin}: JSON nests too deeply") from None


def _describe(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) \
        else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True, slots=True)
class At:
    """A place in a document: ``origin`` (which document) and ``path`` in it."""

    origin: str
    path: str = ""

    def key(self, name: str) -> At:
        return At(self.origin, f"{self.path}.{name}" if self.path else name)

    def index(self, number: int) -> At:
        return At(self.origin, f"{self.path}[{number}]")

    def fail(self, message: str) -> NoReturn:
        where = f"{self.origin}: {self.path}" if self.path else self.origin
        raise HloShardError(f"{where}: {message}")

    # Fields of an object ------------------------------------------------------------
    def read(self, obj: dict, name: str, check: Callable[..., Any], *args: Any,
             default: Any = REQUIRED, **kwargs: Any) -> Any:
        """``obj[name]`` checked at its place by ``check`` (an ``At`` method such as
        :meth:`integer`, given ``args``/``kwargs``); ``default`` (unchecked) when the
        field is absent, which is an error when there is none."""
        if name not in obj:
            if default is REQUIRED:
                self.fail(f"missing field {name!r}")
            return default
        return check(self.key(name), obj[name], *args, **kwargs)

    # Values ---------------------------------------------------------------------------
    def object(self, value: Any) -> dict:
        if not isinstance(value, dict):
            self.fail(f"expected an object, got {_describe(value)}")
        return value

    def array(self, value: Any, non_empty: bool = False) -> list:
        if not isinstance(value, list):
            self.fail(f"expected a list, got {_describe(value)}")
        if non_empty and not value:
            self.fail("expected a non-empty list (leave the field out instead)")
        return value

    def integer(self, value: Any, low: int | None = None, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"expected a whole number, got {_describe(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = (f"at least {low}" if high is None else f"at most {high}" if low is None
                      else f"between {low} and {high}")
            self.fail(f"expected a whole number {bounds}, got {_describe(value)}")
        return value

    def number(self, value: Any, positive: bool = False, low: float | None = None) -> float:
        """A finite JSON number (``1e12`` or ``1000``; never ``"1e12"``, true, NaN)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            self.fail(f"expected a finite number, got {_describe(value)}")
        if positive and not value > 0:
            self.fail(f"expected a positive number, got {_describe(value)}")
        if low is not None and value < low:
            self.fail(f"expected a number of at least {low:g}, got {_describe(value)}")
        return float(value)

    def string(self, value: Any, choices: Sequence[str] | None = None) -> str:
        if not isinstance(value, str):
            self.fail(f"expected a string, got {_describe(value)}")
        if choices is not None and value not in choices:
            self.fail(f"expected one of {', '.join(choices)}, got {_describe(value)}")
        return value

    def boolean(self, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(f"expected true or false, got {_describe(value)}")
        return value

    def integers(self, value: Any, low: int | None = None) -> tuple[int, ...]:
        return tuple(self.index(i).integer(v, low) for i, v in enumerate(self.array(value)))
