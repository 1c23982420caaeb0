"""Plain text: the one table renderer every printed table in the package uses,
and the escaping of strings from a trace file before they reach a terminal.

Deterministic and free of addresses, so tables can be golden-tested.
"""

from __future__ import annotations

__all__ = ["render", "fmt_bytes", "printable", "clip"]


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
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    if width is not None:
        while len(widths) > 1 and 8 + sum(widths[1:]) + 2 * (len(widths) - 1) > width:
            widths.pop()
        rest = sum(widths[1:]) + 2 * (len(widths) - 1)
        widths[0] = max(8, min(widths[0], width - rest))

    def line(cells):
        cells = cells[: len(widths)]
        out = []
        for c, w, a in zip(cells, widths, align):
            c = c if len(c) <= w else c[: w - 1] + "~"
            out.append(f"{c:<{w}}" if a == "<" else f"{c:>{w}}")
        return "  ".join(out).rstrip()

    return ["", line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.5KiB``; ``1000 * 2**20`` -> ``1000MiB``."""
    for div, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= div:
            text = f"{n / div:.3g}"
            # 1000 to 1023 of a unit: .3g writes "1e+03"
            return (f"{n / div:.0f}" if "e" in text else text) + suffix
    return f"{int(n)}B"


def printable(text: str, keep: str = "") -> str:
    r"""``text`` with every non-printable character escaped (``\x1b``, ``\n``).

    Strings from a trace file (module names, notes) can hold terminal escape
    codes or newlines; anything printed to a terminal or pasted into a
    comment passes through here.  Characters in ``keep`` are left alone.

    >>> print(printable("fc1" + chr(27) + "[2J" + chr(10) + "import os"))
    fc1\x1b[2J\nimport os
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def clip(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters, ending in ``...`` where it was cut.

    A trace file names each string once and refers to it from every call, so
    a string printed in full on every line would make a small file print to
    gigabytes; printed forms clip what they repeat.

    >>> clip("model.layers.0.mlp", 12)
    'model.lay...'
    """
    return text if len(text) <= n else text[: n - 3] + "..."
