"""Collectives: what torch's meta kernels get wrong about them.

``_c10d_functional.wait_tensor`` returns its input, the same tensor (it
waits for the collective that produced it), while torch's meta kernel
returns a new one -- a storage-level memory model built on it would count
every functional collective's output twice.  ``_wrap_tensor_autograd``
(torch >= 2.13: how a functional collective hands its output to autograd)
returns its input wrapped in an ``AsyncCollectiveTensor``, a wrapper with
no data of its own that keeps the collective's output alive as long as it
lives; its fake kernel returns a new tensor, which would free the output
at once and count a copy.  In the trace it is its input, as ``wait_tensor``.

The c10d ops (``torch.distributed``'s eager API, FSDP, DDP) write into the
tensors they are given and return them with a Work.  torch's meta kernels
(``torch/distributed/_meta_registrations.py``) return a Work whose future
holds nothing, and DDP's reducer reads its gradients back from that future
(``comm.cpp``: "expected the hook result is either a Tensor or a
TensorList").  These rules return a finished Work whose future holds the
tensors, as a real one does once the collective is done.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from .. import _compat
from ..core.registry import builtin_rule
from ..errors import UnsupportedFeatureError
from ..spec.schema import schema_of
from ..world import world

_FUNCTIONAL_COLLECTIVES = "torch.distributed._functional_collectives"

__all__ = ["wait_tensor", "wrap_tensor_autograd"]


@builtin_rule(torch.ops._c10d_functional.wait_tensor.default)
def wait_tensor(tensor):
    return tensor


def wrap_tensor_autograd(tensor):
    """Note [A rule for an op defined on import]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``_c10d_functional._wrap_tensor_autograd`` is a custom op that
    ``torch.distributed._functional_collectives`` defines when imported
    (~20 ms ``import metadispatch`` no longer pays).  So its rule goes in
    when the module is there: at this import if it is already, else when a
    logical world is entered, which imports it (world/world.py's WIRING).
    A functional collective in a mode without a world (a real process
    group, the module imported after metadispatch) meets torch's fake
    kernel instead, which copies.
    """
    return tensor


def _register_wrap() -> None:
    op = torch.ops._c10d_functional._wrap_tensor_autograd.default
    with contextlib.suppress(RuntimeError):  # registered already
        builtin_rule(op)(wrap_tensor_autograd)


if _FUNCTIONAL_COLLECTIVES in sys.modules:
    _register_wrap()
world.WIRING.collectives_defined = _register_wrap


def _done(tensors: list):
    """A finished Work (boxed, as c10d ops return it) whose future holds ``tensors``."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensors)
    return _compat.work_from_future(future).boxed()


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for y in x for t in _tensors(y)] if isinstance(x, (list, tuple)) else []


def _register(name: str) -> None:
    packet = getattr(torch.ops.c10d, name)
    returns = len(schema_of(packet.default).returns)

    def rule(*args, **kwargs):
        _refuse_what_gloo_refuses(name, args)
        work = _done(_tensors(args[0]))
        return (args[0], work) if returns == 2 else work

    rule.__name__ = name
    builtin_rule(packet.default)(rule)


def _refuse_what_gloo_refuses(name: str, args) -> None:
    """gloo, a CPU tensor's backend, has no ``ReduceOp.PREMUL_SUM`` (FSDP2 reduces with it when a gradient
    divide factor other than its shard group's size is set: ``set_gradient_divide_factor``); NCCL has.  So a logical CPU world refuses it as the
    real job fails, with gloo's words (a real 2-process run is the test's reference)."""
    tensors = _tensors(args[0])
    if not tensors or tensors[0].device.type != "cpu":
        return
    for a in args:
        if isinstance(a, torch.ScriptObject) and world.describe(a) == world.REDUCE_OP.format("PREMUL_SUM"):
            raise UnsupportedFeatureError(
                f"c10d.{name} with ReduceOp.PREMUL_SUM on the CPU: gloo refuses it ('Cannot use "
                "ReduceOp.PREMUL_SUM with Gloo'), so the real job fails here (FSDP2 reduces with it when "
                "set_gradient_divide_factor is given a factor other than its shard group's size; "
                "set_force_sum_reduction_for_comms(True) divides apart); trace on a logical GPU (device='cuda': "
                "NCCL has it)"
            )


# The c10d ops that return a Work (``monitored_barrier_`` returns nothing).
for _name in (
    "broadcast_",
    "allreduce_",
    "allreduce_coalesced_",
    "allgather_",
    "_allgather_base_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "reduce_",
    "gather_",
    "scatter_",
    "alltoall_",
    "alltoall_base_",
    "barrier",
):
    if hasattr(torch.ops.c10d, _name):
        _register(_name)


@builtin_rule(torch.ops.c10d.send.default)
@builtin_rule(torch.ops.c10d.recv_.default)
def point_to_point(tensors, process_group, peer, tag):
    """A send reads its tensors, a receive writes into its buffers (declared
    by the receiver: their shapes are its own); a finished Work, as for the
    collectives (Note [A pipeline stage's vote] in world/pipeline.py).

    gloo, a CPU tensor's backend, refuses a send or receive of a tensor that
    is not contiguous ("input tensor has to be contiguous"; a transposed view,
    a slice across rows); NCCL only warns.  So a logical CPU world refuses
    it as the real job would fail (tests/world/test_distributed.py).
    """
    for t in tensors:
        if t.device.type == "cpu" and not t.is_contiguous():
            raise UnsupportedFeatureError(
                f"torch.distributed send/recv of a non-contiguous tensor (shape {tuple(t.shape)}, stride "
                f"{t.stride()}) on the CPU: gloo refuses it ('input tensor has to be contiguous'), so the real "
                "job fails here; send t.contiguous(), receive into a contiguous buffer"
            )
    return _done(list(tensors))


@builtin_rule(torch.ops.c10d.recv_any_source_.default)
def recv_any_source(*args, **kwargs):
    """Refused: which rank a message comes from is decided at run time."""
    raise UnsupportedFeatureError(
        "recv from any source is not traced in a logical world: which rank sends is decided at run time; "
        "name the source (see docs/distributed.md)"
    )
