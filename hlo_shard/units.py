"""Figures as a reader reads them: seconds, bytes and counts in the unit that fits, shares
and deltas. Below every front end (reports, the CLI's summaries, the JAX integration), so
each writes a figure the same way.
"""

from __future__ import annotations

from collections.abc import Callable


def fmt_seconds(value: float) -> str:
    magnitude = abs(value)
    if 0 < magnitude < 1e-9:
        return "<1 ns"
    return _in_unit(value, (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))) or "0"


def fmt_bytes(value: float) -> str:
    return _in_unit(value, (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))) or \
        f"{value:.0f} B"


def fmt_count(value: float) -> str:
    return _in_unit(value, (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))) or \
        f"{value:.0f}"


def _in_unit(value: float, units: tuple[tuple[str, float], ...]) -> str:
    """``value`` in three significant digits of the largest of ``units`` (largest first)
    it reaches, "" below the smallest; where the digits round up to a thousand of one
    (1,031,000 bytes would read "1.01e+03 KiB"), in the next larger unit."""
    magnitude = abs(value)
    for k, (unit, scale) in enumerate(units):
        if magnitude >= scale:
            text = f"{value / scale:.3g}"
            if "e" in text and k > 0:
                unit, scale = units[k - 1]
                text = f"{value / scale:.3g}"
            return f"{text} {unit}"
    return ""


def fmt_share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "–"


def fmt_delta(before: float, after: float, fmt: Callable[[float], str]) -> tuple[str, str]:
    delta = after - before
    if abs(delta) <= 1e-6 * max(abs(before), abs(after)):
        delta = 0.0  # float noise of sums taken in another order
    sign = "+" if delta > 0 else "−" if delta < 0 else ""
    relative = f"{sign}{abs(100 * delta / before):.1f}%" if before else ("–" if not delta else "new")
    return f"{sign}{fmt(abs(delta))}" if delta else "0", relative
