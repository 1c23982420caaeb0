"""torch's Python code that runs for real inside a MetaMode: a DataLoader's bookkeeping, torch.load.

Note [A DataLoader inside a traced step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A step that iterates a ``DataLoader`` (``for x, y in loader:``; every
``Trainer.fit``) runs the loader's bookkeeping before the first batch: its
iterator draws a base seed, ``torch.empty((), dtype=torch.int64).random_(
generator=loader.generator).item()``, and a shuffling ``RandomSampler``
draws a seed and a ``randperm`` whose ``.tolist()`` orders the epoch.  Under
a mode those are MetaTensors, and the first ``.item()`` raised
DataDependentError -- no epoch could be traced.  These numbers are not the
step's computation but the order in which the dataset is read, and eager
reads it in the order the generator's state decides; so while a MetaMode is
entered in a thread, the iterator's ``__init__``, ``_reset`` and
``_next_index`` (where the sampler runs, lazily) run for real on the CPU,
with no mode seeing them: the sampler yields eager's indices, from eager's
generator states, and ``fetch`` (the dataset's ``__getitem__`` and the
collate function) runs under the mode as the step's own code, so each batch
is built by the ops eager dispatches for it.  The generators drawn from are
kept (``MetaMode.keep_generator``) and put back when the mode exits, as every
generator a trace reads is (docs/untouched.md); inside the step the draw has advanced
them as in eager, and the next random op records the state it finds (Note
[States that change unseen] in core/rngstate.py), so replay draws eager's
numbers after the loader too.  The rows each batch reads are then constants
of the trace: eager, from another generator state, reads others.  So each
batch a sampler other than ``SequentialSampler`` drew lists one
:class:`Assumption` in ``trace.assumptions`` (its rows, the sampler, the
user's line); the loader's own ops -- the seed's ``empty``, ``random_`` and
``_local_scalar_dense``, each ``randperm`` -- are not in the trace, nor their
bytes (docs/model-conformance.md, ``nn.dataloader_epoch``).  Worker
processes (``num_workers > 0``) are not modelled: their iterator raises
before starting any.

Note [torch.load inside a MetaMode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A checkpoint's bytes are data the user has, not values a step computes, and
eager's ``torch.load`` gives real tensors holding them.  Under a mode torch's
unpickler built each tensor as ``empty().set_(storage)`` -- MetaTensors on a
storage the mode had made ``meta`` -- so the checkpoint's values were lost,
and ``md.materialize`` of a module loaded from them failed on the recorded
``aten.set_`` of a meta storage.  While a MetaMode is entered in a thread,
``torch.load`` (and ``torch.serialization.load``) runs for real, no mode
seeing it: it returns the real tensors eager returns, which the step then
uses as it would any real tensor from its scope (Note [Known values]) --
but for their size: the trace keeps their values however large
(``Recorder.keep_values``), as the data the model is built from.
``module.load_state_dict(torch.load(f))`` inside the mode records the copies
from them, and ``md.materialize`` gives the checkpoint's values;
``assign=True`` puts the real tensors in the module.  ``map_location``
The same holds for ``safetensors.torch.load_file`` and ``load`` (where
safetensors was imported before the mode; ``safe_open``, which transformers
binds at its import, is not reached).  ``"cuda"`` on a host without CUDA (a logical GPU's checkpoint) loads onto
the CPU: a real tensor reaching the mode stands in on the mode's device, so
the step sees the checkpoint on its logical GPU; a dict or a function as
``map_location`` is torch's to apply.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import SequentialSampler, dataloader

from .. import _compat
from .._compat import pytree
from ..errors import UnsupportedFeatureError, mark_call
from ..gpu import cuda_answers
from ..ir.assumptions import Assumption
from ..source import user_frame

__all__ = ["PATCHES", "WIRING", "FROM_BYTES", "DRAWN_FOR_REAL", "reads_bytes", "from_bytes"]

# How the basis of a DataLoader's rows begins: values run for real, not made up (md.check's report)
DRAWN_FOR_REAL = "drawn for real"

_TORCH: dict = {}  # torch's functions as they were when installed


class _Wiring:
    """``active()``: the MetaMode entered on this thread, or None (set by mode.py)."""

    active = staticmethod(lambda: None)


WIRING = _Wiring()


def _for_real(name: str):
    def run(it, *args, **kwargs):
        mode = WIRING.active()
        if mode is None:
            return _TORCH[name](it, *args, **kwargs)
        loader = args[0] if args else None
        sampler = getattr(loader, "_index_sampler", None) or getattr(it, "_index_sampler", None)
        for owner in (loader, sampler, getattr(sampler, "sampler", None)):
            g = getattr(owner, "generator", None)
            if isinstance(g, torch.Generator):
                mode.keep_generator(g)
        mode.keep_generator(torch.default_generator)  # a sampler without a generator seeds from it
        with _compat.no_torch_function(), _compat.no_python_dispatch():
            out = _TORCH[name](it, *args, **kwargs)
        if name == "_next_index" and mode.record:
            _list_rows(mode, sampler, out)
        return out

    return run


def _list_rows(mode, sampler, rows) -> None:
    """A batch's rows, drawn for real by a sampler that is not sequential: one
    assumption of the trace (Note [A DataLoader inside a traced step])."""
    inner = getattr(sampler, "sampler", sampler)  # a BatchSampler's sampler
    if isinstance(inner, SequentialSampler):
        return  # the dataset's own order: nothing was drawn
    shown = _plain(rows)
    value = f"rows {shown if not isinstance(shown, list) or len(shown) <= 16 else [*shown[:16], '...']}"
    basis = f"{DRAWN_FOR_REAL} by the DataLoader's {type(inner).__name__} from its generator's state: the order read"
    trace = mode.trace
    trace.assumptions.append(Assumption(len(trace.calls), "DataLoader._next_index", "", user_frame(), value, basis))


def _plain(rows):
    """A sampler's rows as ints: a sampler may yield tensors of indices (``randperm`` slices), real
    ones, which formatted under the mode would be shown as MetaTensors, not as the rows read."""
    with _compat.no_torch_function(), _compat.no_python_dispatch():
        if isinstance(rows, torch.Tensor):
            return rows.tolist()
        if isinstance(rows, (list, tuple)):
            return [r.tolist() if isinstance(r, torch.Tensor) else r for r in rows]
        return rows


def _load(f, map_location=None, *args, **kwargs):
    mode = WIRING.active()
    if mode is None:
        return _TORCH["load"](f, map_location, *args, **kwargs)
    if _names_cuda(map_location) and not cuda_answers.host_has_cuda():
        map_location = "cpu"  # a logical GPU's tensors: real on the CPU, on the GPU to the mode
    return _kept(mode, _TORCH["load"], f, map_location, *args, **kwargs)


def _safetensors(key: str):
    """safetensors' ``load_file(filename, device)`` and ``load(data)``, the same way."""

    def load(*args, **kwargs):
        mode = WIRING.active()
        below = _TORCH[f"safetensors.{key}"]
        if mode is None:
            return below(*args, **kwargs)
        if key == "load_file":
            device = kwargs.get("device", args[1] if len(args) > 1 else "cpu")
            if _names_cuda(device) and not cuda_answers.host_has_cuda():
                args, kwargs = args[:1], {**kwargs, "device": "cpu"}
        return _kept(mode, below, *args, **kwargs)

    return load


def _kept(mode, load, *args, **kwargs):
    """``load`` run for real; the trace keeps the values of the tensors it returns."""
    with _compat.no_torch_function(), _compat.no_python_dispatch():
        loaded = load(*args, **kwargs)
    if mode.record:  # whatever their size: the data the model is built from
        mode._recorder.keep_values(t for t in pytree.tree_leaves(loaded) if isinstance(t, torch.Tensor))
    return loaded


# Note [Tensors made from bytes inside a MetaMode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A checkpoint reader that is not ``torch.load`` -- safetensors' ``safe_open``
# (transformers' ``from_pretrained``), which code binds at its import where no
# patch reaches it -- makes each tensor with ``torch.asarray`` (or
# ``torch.frombuffer``) of the file's bytes: a storage or a buffer.  The mode
# cannot make a MetaTensor of bytes ("could not determine the shape of object
# type 'torch.storage.UntypedStorage'"), and the bytes are data the user
# has, like a checkpoint's: the call is made for real (on the CPU where the
# host lacks the CUDA it names), and the trace keeps the values.
FROM_BYTES: set = {torch.asarray, torch.frombuffer}


def reads_bytes(func, args) -> bool:
    """Whether ``func(args...)`` makes a tensor of bytes (Note [Tensors made from bytes inside a MetaMode])."""
    if func not in FROM_BYTES or not args:
        return False
    data = args[0]
    return isinstance(data, (torch.UntypedStorage, torch.TypedStorage, bytes, bytearray, memoryview))


def from_bytes(mode, func, args, kwargs):
    if _names_cuda(kwargs.get("device")) and not cuda_answers.host_has_cuda():
        kwargs = {**kwargs, "device": "cpu"}
    return _kept(mode, func, *args, **kwargs)


def _names_cuda(map_location) -> bool:
    if isinstance(map_location, int):
        return True  # a CUDA ordinal
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location).type == "cuda"
    return False


def _workers(it, loader, *args, **kwargs):
    if WIRING.active() is None:
        return _TORCH["workers"](it, loader, *args, **kwargs)
    error = UnsupportedFeatureError(
        f"DataLoader(num_workers={loader.num_workers}) inside a MetaMode: worker processes would load the "
        "dataset outside the trace (Note [A DataLoader inside a traced step]). Use num_workers=0 while tracing"
    )
    mark_call(error, "DataLoader.__iter__", user_frame())
    it._shutdown = True  # nothing started: the iterator's __del__ has nothing to shut down
    raise error


def _patch(key: str, fn):
    def make(below):
        _TORCH[key] = below
        return fn

    return make


def _safetensors_torch():
    return sys.modules.get("safetensors.torch")  # None: never imported, nothing to patch


_BASE = dataloader._BaseDataLoaderIter
# (owner, attribute, make, why): the ledger's rows (mode/ledger.py).
PATCHES = [
    (
        _BASE,
        "__init__",
        _patch("__init__", _for_real("__init__")),
        "a DataLoader iterator's seed, drawn for real (Note [A DataLoader inside a traced step])",
    ),
    (_BASE, "_reset", _patch("_reset", _for_real("_reset")), "its sampler restarted, for real"),
    (
        _BASE,
        "_next_index",
        _patch("_next_index", _for_real("_next_index")),
        "the sampler's next indices, for real",
    ),
    (torch, "load", _patch("load", _load), "torch.load, run for real (Note [torch.load inside a MetaMode])"),
    (torch.serialization, "load", _patch("load", _load), "torch.serialization.load, the same"),
    *[
        # keyed apart from torch.load: safetensors' load(data) replaced torch's original in _TORCH,
        # and torch.load inside a mode called it (tests/mode/test_load_state_dict.py)
        (
            _safetensors_torch,
            name,
            _patch(f"safetensors.{name}", _safetensors(name)),
            f"safetensors.torch.{name}, the same",
        )
        for name in ("load_file", "load")
    ],
    (
        dataloader._MultiProcessingDataLoaderIter,
        "__init__",
        _patch("workers", _workers),
        "worker processes, refused in the mode",
    ),
]
