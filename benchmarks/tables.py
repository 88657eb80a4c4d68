"""Plain-text tables for the benchmarks' printed results."""

from __future__ import annotations


def table(head: list[str], rows: list[list[str]]) -> str:
    """``head`` and ``rows`` as left-aligned columns two spaces apart, a dashed rule under the
    head. Every row has ``len(head)`` cells (strings)."""
    cells = [head, *rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
