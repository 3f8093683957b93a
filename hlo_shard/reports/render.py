"""A :class:`~hlo_shard.reports.document.Document` as text, Markdown, self-contained
HTML (figures as inline PNG, drawn with matplotlib, the ``plot`` extra) or PNG; and a
report's data as JSON. Every format shows the same numbers: they come from one document.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Sequence
from typing import Any

from hlo_shard.reports.document import PLOT_HINT, Document, Figure, PlotUnavailable

def _table_line(cells: Sequence[str], widths: list[int]) -> str:
    """One row: the first column left-aligned, the figures right-aligned."""
    return ("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths)))).rstrip()


def render_text(doc: Document) -> str:
    out = [doc.title, doc.subtitle, ""]
    for table in doc.tables:
        out.append(table.title)
        widths = [max(len(str(c)), *(len(r[i]) for r in table.rows)) if table.rows else len(c)
                  for i, c in enumerate(table.columns)]
        out.append(_table_line(table.columns, widths))
        out.extend(_table_line(row, widths) for row in table.rows)
        if table.note:
            out.append(f"  ({table.note})")
        out.append("")
    out.extend(f"note: {n}" for n in doc.notes)
    return "\n".join(out).rstrip() + "\n"


def render_markdown(doc: Document) -> str:
    out = [f"# {doc.title}", "", doc.subtitle, ""]
    for table in doc.tables:
        out += [f"## {table.title}", ""]
        out.append("| " + " | ".join(table.columns) + " |")
        out.append("|" + "|".join(["---"] + ["---:"] * (len(table.columns) - 1)) + "|")
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table.rows]
        if table.note:
            out += ["", f"_{table.note}_"]
        out.append("")
    out += [f"- {n}" for n in doc.notes]
    return "\n".join(out).rstrip() + "\n"


def render_html(doc: Document) -> str:
    """A self-contained page: inline CSS, figures as base64 PNG."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>", "<html><head><meta charset='utf-8'>", f"<title>{esc(doc.title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}"
        "td,th{border-bottom:1px solid #ddd;padding:.2em .8em;text-align:right}"
        "td:first-child,th:first-child{text-align:left}th{background:#f4f4f4}"
        "img{max-width:100%}.note{color:#666}</style></head><body>",
        f"<h1>{esc(doc.title)}</h1>", f"<p>{esc(doc.subtitle)}</p>",
    ]
    for figure in doc.figures:
        parts.append(f"<h2>{esc(figure.title)}</h2>")
        try:
            png = base64.b64encode(figure_png(figure)).decode("ascii")
            parts.append(f"<img alt='{esc(figure.title)}' src='data:image/png;base64,{png}'>")
        except PlotUnavailable as err:
            parts.append(f"<p class='note'>{esc(str(err))}</p>")
    for table in doc.tables:
        parts.append(f"<h2>{esc(table.title)}</h2><table><tr>"
                     + "".join(f"<th>{esc(c)}</th>" for c in table.columns) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
                  for row in table.rows]
        parts.append("</table>")
        if table.note:
            parts.append(f"<p class='note'>{esc(table.note)}</p>")
    parts += [f"<p class='note'>{esc(n)}</p>" for n in doc.notes]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or a clear error."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(PLOT_HINT) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def figure_png(figure: Figure) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    try:
        figure.draw(ax)
        ax.set_title(figure.title)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", bbox_inches="tight")
        return buffer.getvalue()
    finally:
        plt.close(fig)


def to_json_text(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=float) + "\n"
