"""Plain tables: aligned console text (text_table) and markdown (markdown_table), with markdown's escaping
(markdown_text). What goes in them is _report.py's and _show.py's (and the benchmarks')."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

WIDTH = 120  # columns a printed table keeps to (text_table wraps its last column to fit)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        return f"{value:.4g}"
    return str(value)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, width: int = WIDTH) -> str:
    """A plain aligned table; numbers right-aligned; a last column of text that would run past `width` columns
    is wrapped onto continuation lines under itself."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows) for i in range(len(headers))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if headers and not numeric[-1] and indent + widths[-1] > width:
        widths[-1] = max(len(headers[-1]), width - indent, 20)

    def line(values: Sequence[str]) -> list[str]:
        *rest, last = values
        parts = [last] if numeric[-1] else (textwrap.wrap(last, widths[-1], break_on_hyphens=False) or [""])
        first = "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip([*rest, parts[0]], widths, numeric))
        return [first.rstrip()] + [(" " * indent + p).rstrip() for p in parts[1:]]

    out = line(headers) + line(["-" * w for w in widths])
    for r in cells:
        out += line(r)
    return "\n".join(out)


# A recorded name or value (a policy's measured block, a candidate's error) is text, never markdown or HTML: `<`, `>` and
# `&` as entities, backticks (a code span) and `|` (a table's next cell) and `\` (which would escape what follows) escaped
_MARKDOWN = str.maketrans({"\\": "\\\\", "`": "\\`", "|": "\\|", "<": "&lt;", ">": "&gt;", "&": "&amp;"})


def markdown_text(text: str) -> str:
    """`text` shown as itself in markdown: no HTML, no code span, no table cell ends inside it."""
    return text.translate(_MARKDOWN)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; every cell escaped (markdown_text), its line breaks as spaces (a break would end the row)."""

    def cell(value: object) -> str:
        return " ".join(markdown_text(_cell(value)).splitlines())

    out = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(out)
