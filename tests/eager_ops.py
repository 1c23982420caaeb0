"""The aten ops an eager run dispatches, the reference a trace's calls are compared with."""

from torch.utils._python_dispatch import TorchDispatchMode


class EagerOps(TorchDispatchMode):
    """Logs each op a real run dispatches (``str(func)``, as ``Call.op`` prints it) in ``ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
