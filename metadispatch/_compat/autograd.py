"""The autograd engine: backward and grad run below their torch-function check, sequence numbers, checkpoint recompute.

Part of ``metadispatch._compat`` (its docstring says why private torch APIs live here alone).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Mapping
from types import FrameType

import torch
import torch.utils.checkpoint

from .functions import push_function_mode, remove_function_mode


class _Outside(threading.local):
    depth = 0  # inside backward_outside_the_engine()


OUTSIDE_THE_ENGINE = _Outside()


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass, or while
    backward's own work runs outside it (:func:`backward_outside_the_engine`)."""
    return torch._C._current_graph_task_id() != -1 or OUTSIDE_THE_ENGINE.depth > 0


@contextlib.contextmanager
def backward_outside_the_engine():
    """Calls that finish a backward pass after the engine has returned are
    backward's: a pipeline stage's FSDP2 post-backward, its gradients'
    reduce-scatter and scaling (Note [A pipeline stage reduces its gradients
    after backward] in world/pipeline.py)."""
    OUTSIDE_THE_ENGINE.depth += 1
    try:
        yield
    finally:
        OUTSIDE_THE_ENGINE.depth -= 1


# ``in_backward()`` is ``graph_task_id() != -1 or OUTSIDE_THE_ENGINE.depth``;
# the recorder asks it of every call and reads both itself (one Python frame
# fewer).
graph_task_id = torch._C._current_graph_task_id


# Note [Checkpoint recompute]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.utils.checkpoint re-runs the forward during backward, with grad mode
# on (plain backward runs with it off unless ``create_graph``): reentrant
# checkpoint from ``CheckpointFunction.backward``, non-reentrant from a
# closure ``recompute_fn``.  Neither leaves a mark we could read cheaply, so
# for backward calls under grad mode we look for those frames.
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
_RECOMPUTE_FRAMES = ("backward", "recompute_fn")


def in_checkpoint_recompute() -> bool:
    """True while torch.utils.checkpoint recomputes a forward in backward."""
    if not torch.is_grad_enabled() or not in_backward():
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _RECOMPUTE_FRAMES and code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False


next_sequence_nr = torch._C._autograd._get_sequence_nr
current_autograd_node = torch._C._current_autograd_node


# Note [Backward under the function mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch pops a torch-function mode off the stack while its handler runs, so
# ``loss.backward()`` reaching the MetaMode's function mode ran the autograd
# engine with no function mode: the engine captures the thread's state when
# it starts, and code it calls back into -- a checkpointed block recomputing
# its forward -- saw none of the mode's composite overrides.  On a logical
# GPU the recomputed attention then took the math kernel where the forward
# took the profile's fused one, and torch.utils.checkpoint refused the
# differing saved tensors.  So backward is run as ``torch.autograd.backward``
# runs it, from below its torch-function check, with the mode back on the
# stack (``engine_backward``), and ``torch.autograd.grad`` likewise
# (``engine_grad``: a gradient penalty through a checkpointed block failed
# the same way).  The calls the engine dispatches take the mode
# off again while the MetaMode answers them (``MetaMode.__torch_dispatch__``):
# rules, known values and md.check's real runs call torch functions, which
# must not be swapped or overridden there, as in a forward.
def engine_backward(mode, tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None) -> None:
    """``torch.autograd.backward``'s body below its torch-function check, with
    ``mode`` on the function-mode stack for the engine's run."""
    inputs_tuple = () if inputs is None else _roots(inputs)
    if inputs is not None and not inputs_tuple:
        raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    _run_engine(mode, _roots(tensors), grad_tensors, retain_graph, create_graph, inputs_tuple, True, True)


def _roots(x) -> tuple:
    """A tensor or gradient edge as a 1-tuple, a sequence of them as a tuple."""
    return (x,) if isinstance(x, (torch.Tensor, torch.autograd.graph.GradientEdge)) else tuple(x)


def _run_engine(mode, roots: tuple, grad_tensors, retain_graph, create_graph, inputs: tuple, unreachable, accumulate):
    """The engine's run ``backward`` and ``grad`` share: the roots'
    gradients made as torch makes them, then ``mode`` on the function-mode
    stack for the run."""
    autograd = torch.autograd
    grads = autograd._make_grads(
        roots, autograd._tensor_or_tensors_to_tuple(grad_tensors, len(roots)), is_grads_batched=False
    )
    push_function_mode(mode)
    try:
        return autograd.graph._engine_run_backward(
            roots,
            grads,
            create_graph if retain_graph is None else retain_graph,
            create_graph,
            inputs,
            allow_unreachable=unreachable,
            accumulate_grad=accumulate,
        )
    finally:
        remove_function_mode(mode)


def engine_grad(
    mode,
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph=None,
    create_graph=False,
    only_inputs=True,
    allow_unused=None,
    is_grads_batched=False,
    materialize_grads=False,
):
    """``torch.autograd.grad``'s body below its torch-function check, with
    ``mode`` on the function-mode stack for the engine's run (Note [Backward
    under the function mode]).  Batched gradients (``is_grads_batched``) and
    the arguments torch warns about or refuses go to torch's own ``grad``."""
    autograd = torch.autograd
    if is_grads_batched or not only_inputs or (isinstance(inputs, Mapping) and type(inputs) is not dict):
        # vmap's machinery, a deprecation warning, a TypeError: torch's own.
        return autograd.grad(
            outputs,
            inputs,
            grad_outputs,
            retain_graph,
            create_graph,
            only_inputs,
            allow_unused,
            True,
            materialize_grads,
        )
    if materialize_grads and allow_unused is False:
        raise ValueError(
            "Expected allow_unused to be True or not passed when materialize_grads=True, but got: allow_unused=False."
        )
    if allow_unused is None:
        allow_unused = materialize_grads
    inputs_tuple = tuple(inputs.values()) if type(inputs) is dict else _roots(inputs)
    if not inputs_tuple:
        raise RuntimeError("`inputs` argument to `grad()` cannot be empty.")
    result = _run_engine(
        mode, _roots(outputs), grad_outputs, retain_graph, create_graph, inputs_tuple, allow_unused, False
    )
    if materialize_grads:
        if any(r is None and not isinstance(i, torch.Tensor) for r, i in zip(result, inputs_tuple)):
            raise RuntimeError("materialize_grads cannot be used when the given input is a GradientEdge")
        result = tuple(
            r if r is not None else torch.zeros_like(i, requires_grad=create_graph)
            for r, i in zip(result, inputs_tuple)
        )
    return dict(zip(inputs.keys(), result)) if type(inputs) is dict else result
