"""Plain-text tables: the one renderer every printed table in the package uses.

Deterministic and free of addresses, so tables can be golden-tested.
"""

from __future__ import annotations

__all__ = ["render", "fmt_bytes"]


def render(headers: tuple, rows: list, align: str = "", width: int | None = None) -> list[str]:
    """Rows of strings as aligned lines, a blank line and a rule first.

    ``align`` has one ``<`` or ``>`` per column (default: first left, rest
    right).  With ``width``, the first column is cut (ending in ``~``), down
    to 8 characters, and then columns dropped from the right, so that no
    line is longer.

    >>> print("\\n".join(render(("op", "calls"), [("aten.mm.default", "12")])))
    <BLANKLINE>
    op               calls
    ---------------  -----
    aten.mm.default     12
    """
    align = align or "<" + ">" * (len(headers) - 1)
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    if width is not None:
        while len(widths) > 1 and 8 + sum(widths[1:]) + 2 * (len(widths) - 1) > width:
            widths.pop()
        rest = sum(widths[1:]) + 2 * (len(widths) - 1)
        widths[0] = max(8, min(widths[0], width - rest))

    def line(cells):
        cells = cells[:len(widths)]
        out = []
        for c, w, a in zip(cells, widths, align):
            c = c if len(c) <= w else c[:w - 1] + "~"
            out.append(f"{c:<{w}}" if a == "<" else f"{c:>{w}}")
        return "  ".join(out).rstrip()

    return ["", line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.5KiB``."""
    for div, suffix in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{int(n)}B"
