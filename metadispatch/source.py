"""Finding the user's line of code behind an aten call.

Frames inside torch and metadispatch are skipped; the first frame left is
the user's.  Only the file's base name is kept so that printed traces do not
depend on where a project is checked out.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

__all__ = ["user_frame", "traceback_frame"]

# The whole metadispatch package (this file is at its top).
_PACKAGE = os.path.dirname(__file__)
_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    _PACKAGE + os.sep,
    os.path.dirname(os.__file__) + os.sep + "contextlib.py",
)


def user_frame(skip: tuple = ()) -> str | None:
    """``"model.py:12 in forward"`` for the innermost user frame, or None."""
    frame: FrameType | None = sys._getframe(1)
    prefixes = _SKIP + tuple(skip)
    while frame is not None:
        if _is_user(frame.f_code.co_filename, prefixes):
            return _describe(frame.f_code, frame.f_lineno)
        frame = frame.f_back
    return None


def traceback_frame(tb) -> str | None:
    """``"model.py:12 in forward"`` for the innermost user frame of a traceback, or None."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if _is_user(code.co_filename, _SKIP):
            found = _describe(code, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _is_user(filename: str, prefixes: tuple) -> bool:
    return not filename.startswith(prefixes) and not filename.startswith("<frozen")


def _describe(code, line: int) -> str:
    return f"{os.path.basename(code.co_filename)}:{line} in {code.co_name}"
