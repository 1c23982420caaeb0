"""What a configuration cut from a shared md.plan build keeps of its own (planning/programs.py): its declared
assumptions (Note [Each configuration's own assumptions]) and, between steps, its blocks' own forwards."""

import functools

import pytest
import torch

from metadispatch.planning import programs
from metadispatch.planning.ac import blocks
from metadispatch.planning.table import KEYS

transformers = pytest.importorskip("transformers")

from tests.planning.test_plan import GPUS, SEQ, make_model, make_moe  # noqa: E402


def config(**kw) -> dict:
    c = dict(zip(KEYS, (2, 1, 1, "none", 1, 1, "foreach", False, 1, 2)))  # shard 2, ep 2
    return {**c, **kw}


def _declared(trace) -> list:
    return [
        (a.index - trace.marks["step"] if a.index >= trace.marks["built"] else a.index, a.op, a.value)
        for a in trace.assumptions
    ]


def test_plan_each_configuration_of_a_shared_build_lists_only_its_own_routing_assumptions():
    cs = [config(micro_batch=1, accum=2), config(micro_batch=2, accum=1)]
    shared = programs.trace_programs(make_moe, cs, GPUS, "h100", SEQ, programs.default_step, None)
    for c, cut in zip(cs, shared):
        alone = programs.trace_programs(make_moe, [c], GPUS, "h100", SEQ, programs.default_step, None)[0]
        assert _declared(cut) == _declared(alone), c
        # each routing count read in the step is this micro-batch's: micro_batch x seq x top-2 picks
        assert any(a.op == "aten.histc.default" for a in cut.assumptions)
        step = [a for a in cut.assumptions if a.index >= cut.marks["step"] and a.op == "Tensor.tolist"]
        sent = [eval(a.value) for a in step][0]  # the first read: the tokens' send splits over ep 2
        assert sum(sent) == c["micro_batch"] * SEQ * 2, (c, sent)


def _hooked(module, calls: list):
    """An instance-level forward around the class's, as accelerate's ``add_hook_to_module`` sets one."""
    inner = module.forward

    def forward(*args, **kwargs):
        calls.append(module)
        return inner(*args, **kwargs)

    module.forward = functools.wraps(inner)(forward)
    return module.forward


def test_plan_ac_off_between_steps_restores_a_blocks_own_instance_forward():
    model = make_model()
    names = blocks(model)
    calls: list = []
    own = _hooked(model.get_submodule(names[0]), calls)
    ids = torch.randint(0, 128, (1, SEQ))
    for on in (True, False, True, False):
        programs._set_ac(model, names, on)
        first = model.get_submodule(names[0])
        assert (first.__dict__["forward"] is own) is not on  # off: exactly the hooked forward
        assert ("forward" in model.get_submodule(names[1]).__dict__) is on  # off: none of its own, as before
        calls.clear()
        model(ids, labels=ids).loss.backward()
        assert calls == [first] * (2 if on else 1)  # checkpointed: the hook runs again in the recompute
