"""metadispatch's own ops: Python functions whose effect a trace records as one call.

Note [Data-dependent initialisers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``nn.init.trunc_normal_`` draws normal samples and redraws those outside
``[a, b]`` until none are: how many draws it makes depends on the values,
so on a MetaTensor its ``mask.any()`` has no answer, and a trace of a fixed
number of draws would replay values eager never draws.  Under a MetaMode
the initialiser's body is therefore recorded as one call of
``metadispatch::trunc_normal_``, an op of ours whose real kernel *is* torch's
Python body: replaying it (``md.replay``, ``md.materialize``) makes exactly
the draws eager makes from the same generator state, so a module built with
seed *s* on meta materialises bit for bit as one built eagerly with seed *s*.
On meta it does nothing (it writes its argument in place; the schema says so,
which is how the trace, the memory analysis and replay's write protection
know).

The library is defined the first time it is needed -- a MetaMode meeting the
initialiser, or a trace file naming the op -- not at import, and stays
defined: its kernels only ever run on tensors passed to the op by name.
``values/initializers.py`` routes the initialiser to the op while a mode is
entered.
"""

from __future__ import annotations

import threading

import torch

from .. import _compat

__all__ = ["OWN_OPS", "ensure_defined", "trunc_normal_op"]

NAMESPACE = "metadispatch"
OWN_OPS = frozenset({"metadispatch::trunc_normal_"})  # what a trace file may name of ours
# The body replay runs: torch's own, as it was when metadispatch was imported
# (the mode replaces the module attribute while it is entered).
TRUNC_NORMAL_BODY = _compat.trunc_normal_body()
_LOCK = threading.Lock()
_LIBRARY: list = []  # the one Library, once defined (kept alive: dropping it undefines)


def _trunc_normal_kernel(tensor, mean, std, a, b, generator=None):
    TRUNC_NORMAL_BODY(tensor, mean, std, a, b, generator=generator)


def _define() -> None:
    if _LIBRARY:
        return
    lib = _compat.library(NAMESPACE, "FRAGMENT")
    lib.define(
        "trunc_normal_(Tensor(a!) tensor, float mean, float std, float a, float b, Generator? generator=None) -> ()",
        # Tagged as torch tags its own random ops, so that the mode treats it as
        # one: never computed for real on known values (which drew from the
        # real generator and moved every later draw), and its stream's state
        # tracked before it (Note [States that change unseen] in core/rngstate.py).
        tags=(torch.Tag.nondeterministic_seeded,),
    )
    # One kernel for every backend: on meta the body returns at once (it
    # checks tensor.is_meta), on CPU and CUDA it draws as eager does.
    lib.impl("trunc_normal_", _trunc_normal_kernel, "CompositeExplicitAutograd")
    _LIBRARY.append(lib)


def ensure_defined() -> None:
    """Define metadispatch's ops with torch's dispatcher (once per process)."""
    if not _LIBRARY:
        _compat.call_locked(_LOCK, _define)


def trunc_normal_op():
    ensure_defined()
    return torch.ops.metadispatch.trunc_normal_.default
