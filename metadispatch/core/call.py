"""The one object that carries an aten call through the engine.

Note [A call's way through the engine]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``dispatch`` makes a :class:`Call` once it has converted the arguments
(real tensors to MetaTensors) and resolved the outputs' logical device;
from there every stage -- the cache, the router, a rule's fallback, the
known-value and md.check answers -- reads the call's fields instead of
taking ten parameters.  The fields are not rebound after construction; a
stage that needs the call with other arguments (a rule's ``fallback``)
makes a new one with :meth:`Call.again`.
"""

from __future__ import annotations

__all__ = ["Call"]


class Call:
    __slots__ = ("func", "f", "args", "kwargs", "kargs", "kkwargs", "device", "mode", "tensors", "encoded")

    def __init__(self, func, f, args, kwargs, kargs, kkwargs, device, mode, tensors, encoded) -> None:
        self.func = func  # the OpOverload
        self.f = f  # its OpFacts (spec/schema.py)
        self.args = args  # as recorded: MetaTensors, device arguments made explicit
        self.kwargs = kwargs
        self.kargs = kargs  # as a meta kernel gets them: device arguments on meta
        self.kkwargs = kkwargs
        self.device = device  # the outputs' logical device
        self.mode = mode  # the MetaMode, or None (a MetaTensor outside any mode)
        self.tensors = tensors  # the tensor arguments, in dispatch order
        self.encoded = encoded  # (args, kwargs) as TensorMeta records when recording, else None

    def again(self, args, kwargs) -> Call:
        """The same op on other arguments, given to the kernel as they are (a rule's ``fallback``)."""
        return Call(self.func, self.f, args, kwargs, args, kwargs, self.device, self.mode, self.tensors, None)

    def __repr__(self) -> str:
        return f"Call({self.f.name} on {self.device})"
