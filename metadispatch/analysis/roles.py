"""What each storage of a training step is for, read from the step's own calls.

``md.memory`` names a storage by the phase that made it (``activations``,
``temporaries``, ``optimizer``), which says nothing about a model built
inside the trace -- its parameters were made by calls like any activation --
nor about FSDP's buffers.  The step itself says more, and this module reads
it (Note [Roles from the step's calls]).  A pure function of a trace.
"""

from __future__ import annotations

from ..ir.cut import state_phase
from ..ir.records import tensor_metas
from ..ir.trace import Trace
from ..spec.schema import arg_value, facts
from ..world.fsdp_storage import RESIZE_OP

__all__ = ["roles", "ROLES"]

ROLES = ("params", "unsharded params", "all-gather buffers", "reduce-scatter buffers", "grads", "optimizer state")

# FSDP2's own ops (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
_COPY_IN = "fsdp.all_gather_copy_in.default"
_COPY_OUT = "fsdp.split_with_sizes_copy.default"
_CHUNK_CAT = "fsdp.chunk_cat.default"


def roles(trace: Trace, died: dict) -> dict:
    """Storage number -> role, for the storages whose role the calls show.

    Note [Roles from the step's calls]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    In order of precedence:

    - ``unsharded params``: storages FSDP2 frees and re-allocates by
      resizing (Note [FSDP frees by resizing storage]), which
      ``split_with_sizes_copy`` fills from the all-gather output;
    - ``all-gather buffers``: what ``all_gather_copy_in`` returns (the
      copy-in input is a view of the all-gather output: one storage);
    - ``reduce-scatter buffers``: what ``chunk_cat`` writes, the
      reduce-scatter's input;
    - ``params``: storages made in forward (a model built in the trace is
      made there) that an optimizer call writes in place (the optimizer
      updates its parameters; its state is made inside ``step``), and the
      sharded parameters ``all_gather_copy_in`` reads that outlive the
      trace (a mixed-precision cast it reads instead dies);
    - ``grads``: storages made in backward that an optimizer call reads or
      writes (a fused AdamW's schema marks its gradients written) --
      FSDP2's reduce-scatter output, of which the sharded gradients are
      views, or a plain ``.grad``;
    - ``optimizer state``: what the optimizer makes from nothing -- a
      factory or ``*_like`` fill, as AdamW's ``exp_avg`` -- and the
      constants it first uses and writes (a step count made with
      ``torch.tensor``); what it computes (``sqrt``, ``div``) is scratch
      and stays ``optimizer``.  Whether a storage outlives the step cannot
      say it: a trace ends with the step, and everything dies with it.

    ``died`` maps a storage to the call before which it died (None: it
    outlives the trace).  A trace without an optimizer step shows no
    ``grads``, and its parameters only through FSDP's all-gathers.
    """
    out: dict = {}
    written: set = set()
    read: set = set()
    used: set = set()  # storages some call has read so far
    first_step = None
    consts: set = set()  # constants the optimizer is first to use
    for i, call in enumerate(trace.calls):
        if call.phase == "optimizer":
            first_step = i if first_step is None else first_step
            mine = _optimizer_call(trace, call, out, used, consts)
            written |= mine
            read |= {m.storage for m in call.inputs} - mine
        elif call.op == RESIZE_OP:
            out[call.args[0].storage] = "unsharded params"
        elif call.op == _COPY_OUT:
            out.update((m.storage, "unsharded params") for m in tensor_metas(call.kwargs.get("out")))
        elif call.op == _COPY_IN:
            out.update((m.storage, "all-gather buffers") for m in call.output_metas)
            for m in tensor_metas(call.args[0]):
                if died.get(m.storage) is None:
                    out.setdefault(m.storage, "params")
        elif call.op == _CHUNK_CAT:
            out.update((m.storage, "reduce-scatter buffers") for m in tensor_metas(call.kwargs.get("out")))
        used.update(m.storage for m in call.inputs)
    out.update((s, "optimizer state") for s in consts & written)
    if first_step is not None:
        born = _births(trace, first_step)
        for s in written:
            if born.get(s) == "forward":
                out.setdefault(s, "params")
        for s in read | written:
            if born.get(s) == "backward":
                out.setdefault(s, "grads")
    return out


def _optimizer_call(trace: Trace, call, out: dict, used: set, consts: set) -> set:
    """The storages an optimizer call writes; the state it makes goes in ``out``,
    the constants it is first to use in ``consts``."""
    f = facts(call.func)
    mine = {m.storage for arg in f.writes for m in tensor_metas(arg_value(call, arg))}
    if f.is_factory or call.op.split(".")[1].endswith("_like"):
        out.update((m.storage, "optimizer state") for m in call.output_metas)
    for m in call.inputs:
        leaf = trace.leaves.get(m.id)
        if leaf is not None and leaf.kind == "const" and m.storage not in used:
            consts.add(m.storage)
    return mine


def _births(trace: Trace, end: int) -> dict:
    """Storage -> the phase of the call that made it, for the calls before ``end``
    (a leaf's: ``"before"``, as those have their own kinds; but a ``state`` leaf,
    made before the trace's first call, by its maker's phase: ir/cut.py)."""
    born: dict = {}
    for leaf in trace.leaves.values():
        # A leaf's storage was made before the trace: a view of it that a
        # call returns is no birth.  GPT-2's Conv1D reads its weight whole in
        # forward, and the first view of it is backward's ``weight.t()``:
        # taken as born there, the weight was counted as a gradient.
        born[leaf.meta.storage] = state_phase(leaf) or "before"
    for call in trace.calls[:end]:
        for m in call.output_metas:
            born.setdefault(m.storage, call.phase)
    return born
