"""``md.LiveStorages``: ``md.memory``'s accounting, observed on a real run.

Each storage counts once, from the first op that shows it to its death, at
its size as the caching allocator would round it; storage resizes FSDP2
makes are seen (Note [FSDP frees by resizing storage] in
world/fsdp_storage.py).  Comparing its ``peak`` and ``timeline`` with
:func:`metadispatch.memory` of a trace of the same code is how the memory
model is tested.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch

from .. import _compat
from .._compat import pytree
from ..mode import patches
from ..tensor.tensor import is_wrapper_subclass
from .memory import allocated_bytes

__all__ = ["LiveStorages"]

_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class LiveStorages(_compat.TorchDispatchMode):
    """The same accounting on a real run: each storage once, first sight to death.

    ``track`` what exists before the run (modules, tensors), then run under
    the mode; ``peak`` and ``timeline`` (after each op) compare with
    :func:`memory` of a trace of the same code.  Untracked tensors count from
    first sight, unless ``count_untracked=False`` (distributed runs: Note
    [Storages made out of sight]).

    >>> import torch, metadispatch as md
    >>> x = torch.ones(256)
    >>> with md.LiveStorages(x) as live:
    ...     y = (x * 2).view(-1).sum()
    >>> live.peak, live.timeline
    (2052, [2048, 2048, 2052])
    """

    def __init__(self, *tracked, count_untracked: bool = True) -> None:
        super().__init__()
        self.count_untracked = count_untracked
        self._ignored: set = set()  # storage keys never counted (count_untracked=False)
        self.live = 0
        self.peak = 0
        self.timeline: list = []
        self._refs: dict = {}  # storage key -> weakref with a callback
        self._sizes: dict = {}  # storage key -> bytes counted for it now
        self._undo: list = []
        self.track(*tracked)

    def track(self, *objs) -> None:
        """Count these tensors (or modules' parameters and buffers) as live now."""
        for o in objs:
            if isinstance(o, torch.nn.Module):
                self.track(*o.parameters(), *o.buffers())
            elif not isinstance(o, torch.Tensor):
                continue  # None, numbers: a model's inputs hold them beside tensors
            elif is_wrapper_subclass(o):  # a DTensor: its local tensor holds the storage
                self.track(*(getattr(o, name) for name in o.__tensor_flatten__()[0]))  # type: ignore[attr-defined]
            else:
                self._see(o)
        self.peak = max(self.peak, self.live)

    def _ignore_if_new(self, t: torch.Tensor) -> None:
        """Note [Storages made out of sight]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        With ``count_untracked=False`` a storage first met as an op's input
        -- neither tracked nor made by an op seen before -- was made out of
        sight and is never counted.  On a distributed run that is a
        collective backend's scratch: gloo's reduce-scatter copies its whole
        input and splits the copy on the caller's thread after the op
        returns, memory a trace does not model and NCCL does not take from
        the caching allocator.  Constants ``torch.tensor`` makes (seen first
        by ``lift_fresh``) are the program's and still count.
        """
        if _compat.is_fake(t) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = _compat.storage_id(st)
        if key not in self._refs and key not in self._ignored:
            self._ignored.add(key)
            weakref.finalize(st, self._ignored.discard, key)

    def _see(self, t: torch.Tensor) -> None:
        if _compat.is_fake(t) or t.device.type == "meta":  # DTensor's sharding propagation, shape inference
            return
        if is_wrapper_subclass(t):  # Note [A wrapper an op returns holds no storage]
            for name in t.__tensor_flatten__()[0]:  # type: ignore[attr-defined]
                self._see(getattr(t, name))
            return
        st = t.untyped_storage()
        key = _compat.storage_id(st)
        if key in self._refs or key in self._ignored:
            return
        n = self._sizes[key] = allocated_bytes(st.nbytes(), t.device)
        self._refs[key] = weakref.ref(st, partial(self._freed, key))
        self.live += n

    # Note [A wrapper an op returns holds no storage]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A plain op can return a wrapper subclass: ``_c10d_functional.
    # _wrap_tensor_autograd`` returns its input wrapped in an
    # ``AsyncCollectiveTensor``.  The wrapper's storage reports the bytes of
    # its shape but has no data (``_make_wrapper_subclass``); its inner
    # tensors hold the memory, so they are what is counted -- counting the
    # wrapper too made each functional collective's output twice (the 3-D
    # pipeline's last stage, 4 x 320 B over the trace, test_distributed_3d).

    def _freed(self, key, _ref) -> None:
        self._refs.pop(key, None)
        self.live -= self._sizes.pop(key, 0)

    def _resized(self, t: torch.Tensor) -> None:
        key = _compat.storage_key(t)
        if key in self._refs:
            n = allocated_bytes(t.untyped_storage().nbytes(), t.device)
            self.live += n - self._sizes[key]
            self._sizes[key] = n

    def __enter__(self):
        try:
            patches.claim_fsdp_storage(self._undo)  # Note [FSDP frees by resizing storage]
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        while self._undo:
            # fmt: off
            self._undo[-1](); self._undo.pop()  # noqa: E702 (Note [Interrupts in mode entry and exit])
            # fmt: on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(is_wrapper_subclass(t) for t in inputs):
            # The subclass's own dispatch runs next, with this mode still
            # active, and its calls on local tensors come back here (Note
            # [Wrapper subclasses dispatch first] in core/dispatch.py).
            return NotImplemented
        if not self.count_untracked and func is not _LIFT_FRESH:
            for t in inputs:
                self._ignore_if_new(t)
        out = func(*args, **(kwargs or {}))
        for t in inputs + [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]:
            self._see(t)
        if func is _compat.resize_storage_bytes:
            self._resized(args[0])
        self.peak = max(self.peak, self.live)
        self.timeline.append(self.live)
        return out
