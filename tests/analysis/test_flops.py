"""md.flops against torch's FlopCounterMode on the same models."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import metadispatch as md
from tests.models import MODELS, train_step


def _reference(model, inputs):
    with FlopCounterMode(display=False) as counter:
        train_step(model, *inputs)
    model.zero_grad(set_to_none=True)
    return counter


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flops_total_equals_flop_counter_mode(name):
    model, inputs = MODELS[name]()
    f = md.flops(md.trace(train_step, model, *inputs))
    assert f.total > 0
    assert f.total == _reference(model, inputs).get_total_flops()


@pytest.mark.parametrize("name", ["mlp", "hf_llama"])
def test_flops_by_module_equals_flop_counter_mode_in_forward(name):
    # In backward FlopCounterMode credits every module in ModuleTracker's
    # (approximate) parents set, so only forward is compared per module.
    model, inputs = MODELS[name]()
    t = md.trace(model, *inputs)
    f = md.flops(t)
    with FlopCounterMode(display=False) as counter:
        model(*inputs)
    theirs = {k.partition(".")[2]: sum(v.values()) for k, v in counter.get_flop_counts().items() if k != "Global"}
    # Ours also sums containers that never run themselves (a ModuleList).
    ours = {k: v for k, v in f.by_module.items() if v and k in t.modules}
    assert ours == {k: v for k, v in theirs.items() if v}


def test_flops_by_phase_and_op_add_up():
    model, inputs = MODELS["mlp"]()
    f = md.flops(md.trace(train_step, model, *inputs))
    assert sum(f.by_phase.values()) == sum(f.by_op.values()) == f.total == f.by_module[""]
    assert f.by_phase["backward"] == 2 * f.by_phase["forward"] - 2 * 8 * 16 * 32  # no grad for x


def test_flops_uncounted_lists_ops_without_formula():
    t = md.trace(lambda a, b: (a @ b).relu().sum(), torch.ones(4, 8), torch.ones(8, 2))
    f = md.flops(t)
    assert f.total == 2 * 4 * 8 * 2
    assert dict(f.uncounted) == {"aten.relu.default": 1, "aten.sum.default": 1}
    assert f.per_call == [128, None, None]
    assert "no formula: 2 ops, 2 calls" in str(f)


@torch.library.custom_op("mdtest::scaled_mm", mutates_args=())
def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return (a @ b) * scale


@scaled_mm.register_fake
def _(a, b, scale):
    return a.new_empty(a.shape[0], b.shape[1])


def _scaled_mm_flops(a_shape, b_shape, scale, *, out_shape=None, **kwargs):
    return 2 * a_shape[0] * a_shape[1] * b_shape[1] + out_shape.numel()


def test_flops_custom_op_formula_registered_through_metadispatch():
    a, b = torch.ones(4, 8), torch.ones(8, 3)
    op = torch.ops.mdtest.scaled_mm
    t = md.trace(lambda a, b: op(a, b, 0.5), a, b)
    assert md.flops(t).uncounted == {"mdtest.scaled_mm.default": 1}
    md.register_flops(op)(_scaled_mm_flops)
    try:
        with pytest.raises(ValueError, match="already registered"):
            md.register_flops(op)(_scaled_mm_flops)
        assert md.flops(t).total == 2 * 4 * 8 * 3 + 12
        with FlopCounterMode(display=False, custom_mapping={op: _scaled_mm_flops}) as counter:
            op(a, b, 0.5)
        assert md.flops(t).total == counter.get_total_flops()
    finally:
        md.unregister_flops(op)


def test_flops_prints_a_table():
    f = md.flops(md.trace(lambda a: a @ a, torch.ones(10, 10)))
    assert str(f).splitlines()[:4] == [
        "2K FLOPs (forward 2K)",
        "",
        "op               FLOPs   share",
        "---------------  -----  ------",
    ]
