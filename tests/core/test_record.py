"""The recorder (core/record.py): a call, once recorded, is never changed."""

import pytest
import torch

import metadispatch as md


def test_record_requires_grad_correction_puts_a_new_call_in_place_of_the_recorded_one():
    # Autograd sets requires_grad on addmm's output after __torch_dispatch__
    # returns, so the record made there says False; the next use corrects the
    # trace.  The call handed out before must stay what it was.
    torch.manual_seed(0)
    real = torch.nn.Linear(3, 2)(torch.ones(4, 3))
    for _ in range(2):  # the second time through the cache-hit path
        with md.MetaMode() as mode:
            lin = torch.nn.Linear(3, 2)
            y = lin(torch.ones(4, 3))
            index = len(mode.trace.calls) - 1
            recorded = mode.trace.calls[index]
            outputs = recorded.outputs
            assert recorded.op == "aten.addmm.default"
            y.relu()
        corrected = mode.trace.calls[index]
        assert recorded.outputs is outputs
        assert recorded.outputs[0].requires_grad is False
        assert corrected is not recorded
        assert corrected.outputs[0].requires_grad is real.requires_grad is True
        assert corrected.outputs[0]._replace(requires_grad=False) == recorded.outputs[0]
        assert (corrected.index, corrected.op, corrected.args, corrected.module) == (
            recorded.index,
            recorded.op,
            recorded.args,
            recorded.module,
        )


def test_opcall_replace_copies_and_refuses_an_unknown_field():
    with md.MetaMode() as mode:
        torch.ones(2) * 2
    call = mode.trace.calls[-1]
    noted = call.replace(note="seen")
    assert (noted.note, call.note) == ("seen", None)
    assert noted.format() == call.format() + "  # <seen>"
    with pytest.raises(TypeError, match="no field colour"):
        call.replace(colour="red")


def test_meta_of_outside_a_call_reads_the_tensor_below_its_torch_function(monkeypatch):
    # md.trace reads its leaves and grads after the step, with torch function
    # on: each getter was a MetaTensor.__torch_function__ call.  The record
    # must still be what the tensor says (a leaf's first read, a
    # requires_grad that changed since its producer).
    from metadispatch.tensor import tensor as tensor_module

    with md.MetaMode() as mode:
        x = torch.ones(4, 3)
        y = (x * 2).t()
    with md.MetaMode():
        w = torch.nn.Parameter(torch.zeros(2, 5))  # another trace's: a leaf of this one on its first read
    rec = mode._recorder
    y.requires_grad_(True)
    seen = []
    wired = tensor_module.WIRING.function
    monkeypatch.setattr(tensor_module.WIRING, "function", lambda *a: seen.append(a[0]) or wired(*a))
    assert torch._C._is_torch_function_enabled()
    expected = [(tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in (y, w)]
    assert seen  # reading a MetaTensor here goes through its torch function
    seen.clear()
    metas = [rec.meta_of(t) for t in (y, w)]
    assert seen == []  # the recorder's reads do not
    assert [(m.shape, m.stride, m.dtype, m.requires_grad) for m in metas] == expected
    assert metas[0].requires_grad is True and metas[1].id in mode.trace.leaves


@pytest.mark.parametrize("how", ["storage", "tensor"])
def test_set_moves_the_record_to_the_storage_it_now_uses(how):
    # ``a.set_(...)`` puts ``a`` on another storage (FSDP1's flat parameter,
    # torch.nn.utils.parametrize).  Its record kept the old storage while a
    # view of it was numbered on the new one: the trace said two storages
    # where eager has one.
    def step(a, b):
        if how == "storage":
            a.set_(b.untyped_storage(), 0, (4,), (1,))
        else:
            a.set_(b)
        return a.view(2, -1).add(1), a.untyped_storage()._cdata == b.untyped_storage()._cdata

    a, b = torch.zeros(4), torch.zeros(8)
    eager_same = step(a.clone(), b.clone())[1]
    assert eager_same
    for _ in range(2):  # the second with the cache warm
        trace = md.trace(step, torch.zeros(4), torch.zeros(8))
        set_call = next(c for c in trace.calls if c.op.startswith("aten.set_"))
        view = next(c for c in trace.calls if c.op == "aten.view.default")
        (after,) = set_call.output_metas
        assert view.inputs[0] == after
        assert view.output_metas[0].storage == after.storage
        assert trace.storage_bytes[after.storage] == 32  # b's storage, eight floats
        if how == "tensor":
            assert after.storage == set_call.inputs[1].storage
