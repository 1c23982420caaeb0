"""The exceptions metadispatch raises.

One base class, :class:`MetaDispatchError`, so callers can catch everything we
raise in one clause; each subclass also derives from the builtin exception a
user of plain torch would expect (``NotImplementedError`` for a missing
kernel, ``RuntimeError`` for reading data, ``ValueError`` for a bad file).
"""

from __future__ import annotations

__all__ = [
    "MetaDispatchError",
    "UnsupportedOpError",
    "DataDependentError",
    "TraceFormatError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "UnsupportedFeatureError",
    "MaterializeLimitError",
    "DoesNotFitError",
    "mark_call",
    "raised_in",
    "explain_meta_refusal",
    "ReplayError",
    "ReplayInputError",
    "BudgetExceededError",
]


class MetaDispatchError(Exception):
    """Base class of every error metadispatch raises on purpose."""


class UnsupportedOpError(MetaDispatchError, NotImplementedError):
    """No stage of the router could produce output metadata for an op.

    ``op`` is the overload's name, ``inputs`` a short description of the
    tensor arguments; the message says how to register a rule.
    """

    def __init__(self, message: str, *, op: str = "", inputs: str = "") -> None:
        super().__init__(message)
        self.op = op
        self.inputs = inputs


class DataDependentError(MetaDispatchError, RuntimeError):
    """An op needs the values of a tensor, which a MetaTensor does not hold."""

    def __init__(self, message: str, *, op: str = "") -> None:
        super().__init__(message)
        self.op = op


class TraceFormatError(MetaDispatchError, ValueError):
    """A saved trace is unreadable, from an unknown version, or inconsistent."""


class CheckpointFormatError(MetaDispatchError, ValueError):
    """A checkpoint file (safetensors, a ``torch.save`` zip, a shard index) is unreadable or inconsistent.

    ``path`` is the file, ``entry`` the tensor name or record at fault
    (empty when the fault is in the file as a whole).
    """

    def __init__(self, message: str, *, path: str = "", entry: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.entry = entry


class CheckpointMismatchError(MetaDispatchError, ValueError):
    """A checkpoint does not fit the model it is loaded into; ``findings`` says how (``md.checkpoint.check``)."""

    def __init__(self, message: str, *, findings: object = None) -> None:
        super().__init__(message)
        self.findings = findings


class UnsupportedFeatureError(MetaDispatchError, NotImplementedError):
    """A feature MetaMode deliberately does not offer.

    The message names the feature and what to use instead; the table of
    differences is in docs/fake-tensor-mode.md, what a logical world
    refuses (pipeline and context parallelism) in docs/distributed.md.
    """


class DoesNotFitError(MetaDispatchError, RuntimeError):
    """A traced step does not fit on the GPU it was checked for.

    ``fit`` is the ``md.fits`` answer, which names the first op past the
    memory and what the peak holds.
    """

    def __init__(self, message: str, *, fit=None) -> None:
        super().__init__(message)
        self.fit = fit


class MaterializeLimitError(MetaDispatchError, MemoryError):
    """``md.check`` refused to run an op for real: its inputs exceed the limit."""

    def __init__(self, message: str, *, need: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.need = need
        self.limit = limit


def mark_call(error: BaseException, op: str, where: str | None) -> None:
    """Note on ``error`` the innermost aten call it came out of, once.

    The note reads ``metadispatch: while running OP at WHERE`` in the
    traceback; :func:`raised_in` gives ``(op, where)`` back to ``md.check``.
    """
    if getattr(error, "_md_call", None) is not None:
        return
    error._md_call = (op, where)  # type: ignore[attr-defined]
    if where:
        error.add_note(f"metadispatch: while running {op} at {where}")


def explain_meta_refusal(error: BaseException, op: str, devices: list) -> None:
    """Note on a meta kernel's refusal that names ``meta`` whose ``meta`` it is.

    A meta kernel checking where an index tensor lives (``pack_padded_sequence``
    wants its ``lengths`` on the CPU) sees metadispatch's meta storage and
    says "got 1D meta Long tensor": the user's tensor was not on ``meta``.
    """
    if "meta" not in str(error).lower() or isinstance(error, MetaDispatchError):
        return
    error.add_note(
        f"metadispatch: {op}'s meta kernel refused this call; the 'meta' it names is metadispatch's "
        f"stand-in storage, not your tensors' device ({', '.join(devices) or 'none'}). md.check runs "
        "such a call on the real kernel."
    )


def raised_in(error: BaseException) -> tuple:
    """``(op, where)`` of the aten call ``error`` came out of, or ``(None, None)``."""
    return getattr(error, "_md_call", None) or (None, None)


class ReplayError(MetaDispatchError, RuntimeError):
    """Replay refused a trace, or a call of it failed on the real kernel.

    ``call`` is the position of the call in the trace (None when the refusal
    is about the trace as a whole); the message names it and its op.  A
    kernel's own exception is the ``__cause__``.
    """

    def __init__(self, message: str, *, call: int | None = None) -> None:
        super().__init__(message)
        self.call = call


class ReplayInputError(ReplayError, ValueError):
    """A tensor handed to replay does not match the leaf the trace recorded."""


class BudgetExceededError(ReplayError):
    """Replaying the trace would allocate more bytes or run more FLOPs than allowed.

    ``what`` is ``"bytes"`` or ``"flops"``, ``need`` the running total at
    call ``call`` (the first to cross), ``limit`` the budget.
    """

    def __init__(self, message: str, *, call: int, what: str, need: int, limit: int) -> None:
        super().__init__(message, call=call)
        self.what = what
        self.need = need
        self.limit = limit
