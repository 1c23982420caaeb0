"""What every command shows on the terminal and how it says it failed.

The progress line (``Progress``: on a terminal only, once building,
tracing, checking, reading or replaying takes more than a second), the
wrapper that turns an exception into a failure to run saying what was being
done (``stage``, ``Failure``: exit 3 in ``main``), and printing with control
characters escaped at the terminal's width.  Usage errors are
``targets.UsageError`` (exit 2).
"""

from __future__ import annotations

import shutil
import sys
import threading

from ..ir.text import printable
from .targets import UsageError

__all__ = ["Progress", "Failure", "stage", "out", "width"]


class Progress:
    """``label: N calls`` redrawn on stderr while a model builds or a trace
    grows; on a terminal only, and only after the first second."""

    DELAY = 1.0

    def __init__(self, label: str, count=None, stream=None) -> None:
        self.label, self.count = label, count
        self.stream = stream or sys.stderr
        self.on = self.stream.isatty()
        self._stop = threading.Event()
        self._shown = False

    def __enter__(self):
        if self.on:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        if self._stop.wait(self.DELAY):
            return
        while True:
            text = self.label + (f": {self.count()} calls" if self.count is not None else "...")
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
            self._shown = True
            if self._stop.wait(0.1):
                return

    def __exit__(self, *exc) -> None:
        if self.on:
            self._stop.set()
            self._thread.join()
            if self._shown:
                self.stream.write("\r\033[K")
                self.stream.flush()


class Failure(Exception):
    """A failure to run (exit 3): what was being done, and the exception."""

    def __init__(self, doing: str, error: BaseException) -> None:
        super().__init__(doing)
        self.doing, self.error = doing, error


class stage:
    """Turn any exception but a usage error into a :class:`Failure` saying what was being done."""

    def __init__(self, doing: str) -> None:
        self.doing = doing

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, (UsageError, Failure, KeyboardInterrupt)) or not isinstance(exc, Exception):
            return False
        raise Failure(self.doing, exc) from exc


def out(text) -> None:
    """Print ``text`` with control characters escaped: a trace file's strings
    (module names) may hold terminal escape codes."""
    print(printable(str(text), keep="\n"))


def width() -> int:
    return shutil.get_terminal_size((100, 24)).columns
