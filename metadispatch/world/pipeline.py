"""Pipeline parallelism (``torch.distributed.pipelining``) on one rank of a logical world.

Note [A pipeline stage's vote]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank of a pipeline runs its own stage: it receives activations from the
stage before (``recv``), runs its micro-batches forward and backward as its
schedule orders them, and sends its outputs and input gradients on
(``send``).  Both are traced as what they are: a ``send`` reads its tensor,
a ``recv`` writes into a buffer of the shape the stage was declared with;
no value crosses, as in every collective of a logical world.

One exchange does carry a value the traced rank must read: before the
first step the stages vote (``_warmup_forward_vote``: each multiplies a
one-element tensor by 1 when its metadata was declared, ``input_args`` and
``output_args``, and passes it on; ``_warmup_backward_result`` sends the
product back) and every rank reads the product (``.item()``) to choose
between declared and inferred metadata.  The traced rank cannot read what
another rank sent; the world's assumption, named here and in
docs/distributed.md, is that every stage is declared as this one is: its
sends and receives are traced as the real run issues them, and the tensor
it reads the result from (the one the real run received) is declared to
hold 1, which the trace lists among its assumptions ("pipeline vote").
No tensor of the world's own is made for it: the step's calls are the
real run's, op for op (tests/world/test_pipeline_families_gloo.py,
against a TorchDispatchMode log of a real 2-process gloo run).  A stage without declared metadata would infer it
by sending Python objects between ranks (``send_object_list``), whose
contents one rank cannot know: it is refused, naming what to declare.

Limits: ``PipelineStage`` only (a traced ``pipeline()`` split's stage infers
its metadata); ``torch.distributed.pipelining`` must be imported before the
mode is entered (importing it costs seconds, so a world does not).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref

import torch

from .. import _compat
from ..errors import UnsupportedFeatureError
from ..ir.assumptions import Assumption
from ..source import user_frame
from ..tensor.tensor import MetaTensor
from ..values import known

__all__ = ["PATCHES"]


def _backward_result(below, stage, received_result=None):
    result = below(stage, received_result)  # the sends and receives, as the real run issues them
    if _compat.pipeline_needs_dynamic(stage, stage.has_backward):  # its own vote: 0
        raise UnsupportedFeatureError(
            f"pipeline stage {stage.stage_index}: its shapes are inferred by exchanging Python objects "
            "between ranks, which one traced rank cannot read; declare them: "
            "PipelineStage(..., input_args=..., output_args=...) (Note [A pipeline stage's vote])"
        )
    # Every stage declared as this one: the product of the votes is 1, declared on the tensor the real run
    # returns (no tensor of our own: the trace's calls are the real run's), and its read listed as assumed.
    mode = _compat.get_infra_mode(_compat.mode_key)
    if isinstance(result, MetaTensor) and mode is not None:
        with _compat.no_torch_function(), _compat.no_python_dispatch():  # a real tensor: the mode's own value
            one = torch.ones(1, dtype=torch.int32)
        known.declare(result, one, mode, limit=1)  # whatever the mode's known_limit
        basis = "every stage's metadata declared as this one's (Note [A pipeline stage's vote])"
        entry = Assumption(len(mode.trace.calls), "pipeline vote", "", user_frame(), "1", basis)
        mode.trace.assumptions.append(entry)
        return result
    return torch.ones(1, dtype=torch.int32, device=stage.device)


def _warmup(below, schedule, stages, has_backward: bool, p2p_done: bool):
    # Where torch would skip the vote over the fake backend (2.14), run it as
    # the real job does: its messages are part of the rank's trace.
    if not _compat.pipeline_vote(list(stages), has_backward):
        below(schedule, stages, has_backward, p2p_done)


def _reduce_grad(below, stage, *args, **kwargs):
    """Note [A pipeline stage reduces its gradients after backward]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    After a stage's last backward a schedule calls ``perform_reduce_grad``
    itself: for an FSDP2 stage, FSDP's post-backward (the gradients'
    reduce-scatter, which makes the sharded gradients) and then the
    gradients' scaling, outside the autograd engine.  Its calls are
    backward's all the same -- a plain FSDP2 step makes them inside the
    engine -- so they are recorded as backward, and ``md.memory`` finds
    the sharded gradients where a real run holds them (``grads``, not
    activations made in forward).
    """
    with _compat.backward_outside_the_engine():
        return below(stage, *args, **kwargs)


# Note [A pipeline's gradient messages are backward's]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A schedule sends a stage's input gradients and receives its output
# gradients outside the autograd engine, between backward chunks, so they
# would be recorded as forward's.  The messages a stage makes for its
# gradients (``get_bwd_send_ops``, ``get_bwd_recv_ops``) are marked, and a
# batch of them is issued as backward's; a batch mixing both (1F1B's
# steady state) is issued in runs of one kind, in its order, as the real
# run issues them one by one off CUDA (on CUDA a real run coalesces the
# mixed batch into one launch).
_GRADIENT_MESSAGES: weakref.WeakSet = weakref.WeakSet()


def _gradient_ops(below, stage, *args, **kwargs):
    ops = below(stage, *args, **kwargs)
    _GRADIENT_MESSAGES.update(ops)
    return ops


def _batch_p2p(below, p2p_ops, desc=None):
    works: list = []
    for backward, run in itertools.groupby(p2p_ops, key=_GRADIENT_MESSAGES.__contains__):
        with _compat.backward_outside_the_engine() if backward else contextlib.nullcontext():
            works += below(list(run), desc)
    return works


def _method(replacement, below):
    def method(self, *args, **kwargs):
        return replacement(below, self, *args, **kwargs)

    return method


# (owner, attribute, make, why): the ledger's rows (mode/ledger.py), with world.py's.
PATCHES = [
    *(
        (
            _compat.pipeline_stage_class,
            name,
            lambda below: _method(_gradient_ops, below),
            "a stage's gradient messages (Note [A pipeline's gradient messages are backward's])",
        )
        for name in ("get_bwd_send_ops", "get_bwd_recv_ops")
    ),
    (
        _compat.pipeline_schedules_module,
        "_batch_p2p",
        lambda below: functools.partial(_batch_p2p, below),
        "a schedule's gradient messages are backward's (Note [A pipeline's gradient messages are backward's])",
    ),
    (
        _compat.pipeline_stage_class,
        "perform_reduce_grad",
        lambda below: _method(_reduce_grad, below),
        "a stage's gradient reduction is backward's (Note [A pipeline stage reduces its gradients after backward])",
    ),
    (
        _compat.pipeline_schedule_class,
        "_warmup_p2p",
        lambda below: _method(_warmup, below),
        "a schedule's warm-up: the stages vote as in a real run (Note [A pipeline stage's vote])",
    ),
    (
        _compat.pipeline_stage_class,
        "_warmup_backward_result",
        lambda below: _method(_backward_result, below),
        "the pipeline's vote: every stage declared as this one (Note [A pipeline stage's vote])",
    ),
]
