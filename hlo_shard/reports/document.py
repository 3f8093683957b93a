"""What a report is made of: tables and figures (a :class:`Document`), built once and
rendered in every format by :mod:`hlo_shard.reports.render` (cells are written in the
units of :mod:`hlo_shard.units`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hlo_shard.errors import HloShardError

PLOT_HINT = "plots need matplotlib: pip install 'hlo-shard[plot]'"


class PlotUnavailable(HloShardError):
    """matplotlib is not installed."""


# ------------------------------------------------------------------------ document


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class Figure:
    title: str
    #: Draws the figure with matplotlib's pyplot; called only when rendering HTML/PNG.
    draw: Callable[[object], None]


@dataclass
class Document:
    title: str
    subtitle: str
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
