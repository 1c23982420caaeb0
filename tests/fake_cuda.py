"""The fake-CUDA oracle's log: what C++ makes a GPU dispatch, seen through FakeTensorMode.

A FakeTensorMode builds ``torch.tensor(data, device="cuda")`` on the CPU and
moves it with a ``_to_copy`` (``only_lift_cpu_tensors``); a real GPU copies
the data below the dispatcher and dispatches no such call (an H100's log:
Note [A literal made on a device] in values/literals.py).  :class:`CudaLog`
logs as ``md.testing.eager_calls`` does and leaves out the copies made while
a literal is built, so the log is what the GPU dispatches.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from metadispatch.testing import _EagerLog

_LITERALS = {torch.tensor, torch.as_tensor}
_COPY = torch.ops.aten._to_copy.default


class CudaLog(_EagerLog):
    def __init__(self) -> None:
        super().__init__()
        self.building = 0
        self._literals = _Literals(self)

    def __enter__(self):
        self._literals.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._literals.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _COPY and self.building:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Literals(TorchFunctionMode):
    def __init__(self, log: CudaLog) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _LITERALS:
            return func(*args, **(kwargs or {}))
        self.log.building += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.log.building -= 1
