"""Per-call times of a replay: what ``md.replay(..., timing=True)`` measures.

Note [Timing replayed calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The generated program (``program.py``) ends every call with a check callback
(``same`` or ``chk``).  Timing wraps those callbacks: each reads the clock
when its call has returned -- after ``torch.cuda.synchronize()`` on a GPU, so
the kernel has finished -- and again after its own check, so checking costs
no call any time.  A call's time is from the previous reading to its own:
its launch and its kernel, plus the program's bookkeeping around it (grad
mode switches, generator states, ``del``), which eager pays too.  Calls run
one at a time, as ``md.runtime`` estimates them; the synchronisation removes
the overlap of host and device a real eager step has, so the measured step
is a little slower than an unsynchronised one.  The first call of a kernel
pays its one-time costs (cuBLAS handles, cuDNN plans): replay twice and take
the second for calibration (``md.calibrate``).
"""

from __future__ import annotations

import time

import torch

__all__ = ["Clock"]


class Clock:
    """Reads the time after each call of a replay, for ``calls`` trace calls."""

    def __init__(self, device: torch.device, calls: int) -> None:
        self._sync = torch.cuda.synchronize if device.type == "cuda" else _nothing
        self.times = [0.0] * calls
        self._last = 0.0

    def start(self) -> None:
        self._sync()
        self._last = time.perf_counter()

    def wrap(self, check, index):
        """``check(n, results)`` timed; ``index(n)`` is the trace index of program call ``n``."""

        def timed(n, results):
            self._sync()
            self.times[index(n)] = time.perf_counter() - self._last
            if check is not None:
                check(n, results)
            self._last = time.perf_counter()

        return timed


def _nothing() -> None:
    pass
