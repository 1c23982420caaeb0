"""Finding the user's line of code behind an aten call.

Frames inside torch and metadispatch are skipped; the first frame left is
the user's.  Only the file's base name is kept so that printed traces do not
depend on where a project is checked out.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_frame"]

# The whole metadispatch package (this file is in its core/ subpackage).
_PACKAGE = os.path.dirname(os.path.dirname(__file__))
_SKIP = (os.path.dirname(torch.__file__) + os.sep, _PACKAGE + os.sep,
         os.path.dirname(os.__file__) + os.sep + "contextlib.py")


def user_frame(skip: tuple = ()) -> str | None:
    """``"model.py:12 in forward"`` for the innermost user frame, or None."""
    frame = sys._getframe(1)
    prefixes = _SKIP + tuple(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(prefixes) and not filename.startswith("<frozen"):
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None
