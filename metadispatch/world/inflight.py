"""A logical world's functional collectives in flight: their buffers live until they are waited on.

Note [A collective's buffers live until its wait]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A real rank's functional collective (``_c10d_functional.all_gather_into_tensor``
and the rest) registers its Work against its output's storage, and the
Work holds the op's input and output -- gloo's and NCCL's alike -- until
``wait_tensor`` on that storage takes it out of the registry.  Eager code
gets the output wrapped in an ``AsyncCollectiveTensor``, which calls
``wait_tensor`` before the first op on it that is not a view (torch's own
test, ``_is_view_op``), or when the code calls ``.wait()``; a wrapper never
used is never waited on, and its buffers live to the end of the process.
So the input the program drops right after issuing the collective --
ring attention's concatenated K/V shards, which its all-gather sends while
the first block's attention runs -- is still allocated until the wait.

A logical world's collective is done when issued and its output is no
wrapper (rules/collectives.py), so nothing would wait and the input would
die with the program's last reference.  :class:`InFlight` holds the
storages of each such call's inputs and outputs instead (the outputs
alone where the op runs on a clone of its input: ``all_reduce``,
``broadcast``), keyed by its
outputs' storages, and lets them go when an op that would wait (anything
but a view) reads a tensor on one of those storages -- or when the world
is left, so a collective never waited on keeps its buffers to the trace's
end.  ``md.memory`` and ``md.LiveStorages`` see the storages' deaths where
the real run frees them.  An explicit ``.wait()`` followed by views waits
earlier on a real rank than here (ring attention's K/V gradients: waited,
then sliced): the buffers are let go one view later, and as a view
allocates nothing, the peak is the same.  The c10d ops (``dist.all_gather_into_tensor(...,
async_op=True)``) hand their tensors to the Work they return, whose future
holds the op's first argument until the program drops the Work
(rules/collectives.py).

Checked against real gloo runs: tests/world/test_context_parallel.py.
"""

from __future__ import annotations

import functools

import torch

from .. import _compat
from .._compat import pytree

__all__ = ["InFlight", "issues"]

_NAMESPACE = "_c10d_functional."
_NOT_COLLECTIVES = frozenset({"_c10d_functional.wait_tensor.default", "_c10d_functional._wrap_tensor_autograd.default"})
# What the eager wrapper's own op does with the raw output: it makes the wrapper, waits on nothing.
_NEVER_WAITS = frozenset({"_c10d_functional._wrap_tensor_autograd.default"})
# These clone their input (C++, ``Functional.cpp``) and run the in-place collective on the clone:
# the Work holds the output, not the input.
_ON_A_CLONE = frozenset(
    {
        "_c10d_functional.all_reduce.default",
        "_c10d_functional.all_reduce_coalesced.default",
        "_c10d_functional.broadcast.default",
    }
)


def issues(name: str) -> bool:
    """Whether the op named ``name`` (``ns.op.overload``) issues a functional collective."""
    return name.startswith(_NAMESPACE) and name not in _NOT_COLLECTIVES


@functools.cache
def _waits(func) -> bool:
    return str(func) not in _NEVER_WAITS and _compat.waits_on_use(func)


def _storages(x) -> list:
    return [t.untyped_storage() for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


class InFlight:
    """The functional collectives a rank has issued and not yet waited on
    (Note [A collective's buffers live until its wait])."""

    def __init__(self) -> None:
        self._held: dict = {}  # output storage key -> the storages its Work holds

    def __bool__(self) -> bool:
        return bool(self._held)

    def issue(self, name: str, args, kwargs, result) -> None:
        """The collective ``name`` was issued: its inputs and outputs stay allocated until it is waited on."""
        held = _storages(result) if name in _ON_A_CLONE else _storages((args, kwargs)) + _storages(result)
        for st in _storages(result):
            self._held.setdefault(_compat.storage_id(st), []).extend(held)

    def use(self, func, args, kwargs) -> None:
        """``func`` is about to run on ``args``: an op that waits lets go of what its tensors' collectives hold."""
        if not _waits(func):
            return
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._held.pop(_compat.storage_key(t), None)

    def clear(self) -> None:
        """The world is left: what was never waited on is let go (after the trace's last call)."""
        self._held.clear()
