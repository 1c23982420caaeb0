"""A ``torch.compile``d module is traced as the eager program it compiles
(Note [Compiled code runs eagerly under a mode] in _compat/process.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import metadispatch as md

dynamo = pytest.importorskip("torch._dynamo")
eval_frame = pytest.importorskip("torch._dynamo.eval_frame")
if not hasattr(eval_frame, "_set_stance"):
    pytest.skip("this torch has no compiler stance", allow_module_level=True)


def _step(model, x):
    y = model(x)
    y.sum().backward()
    return y


def _calls(trace) -> list:
    """Each call's op, arguments and outputs as printed, and phase (module
    names differ: the compiled module's start with ``_orig_mod``)."""
    return [(c.op, c.args, c.kwargs, c.outputs, c.phase) for c in trace.calls]


def test_compiled_module_traces_as_its_eager_program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(3, 4)
    frames = dynamo.utils.counters["frames"]["total"]
    traced = md.trace(_step, compiled, x)
    assert dynamo.utils.counters["frames"]["total"] == frames  # dynamo compiled nothing
    eager = md.trace(_step, model, x)
    assert _calls(traced) == _calls(eager)
    assert not [c for c in traced.calls if c.note == "untraced view"]
    assert sorted(traced.grads) == sorted(f"_orig_mod.{n}" for n in eager.grads)
    assert eval_frame._stance.stance == "default"
    assert model[0].weight.grad is None  # the user's module untouched


def test_stance_is_put_back_on_exit_and_on_exceptions():
    before = eval_frame._stance
    with md.MetaMode():
        assert eval_frame._stance.stance == "force_eager"
        with md.MetaMode():
            assert eval_frame._stance.stance == "force_eager"
        assert eval_frame._stance.stance == "force_eager"  # the outer mode still holds it
    assert eval_frame._stance is before
    with pytest.raises(ValueError):
        with md.MetaMode():
            raise ValueError
    assert eval_frame._stance is before


def test_a_stance_the_user_chose_is_theirs_again_after_the_mode():
    with torch.compiler.set_stance("eager_on_recompile"):
        chosen = eval_frame._stance
        with md.MetaMode():
            assert eval_frame._stance.stance == "force_eager"
        assert eval_frame._stance is chosen
