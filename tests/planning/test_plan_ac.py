"""md.plan_ac over budget sweeps: each plan re-traces to its peak, stays under its budget, and is monotone."""

import pytest
import torch

import metadispatch as md
from metadispatch.cli.llama import Llama, LlamaConfig
from metadispatch.planning.ac import SAVE_MATMULS_AND_ATTENTION


def llama():
    config = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, hidden_dim=128)
    model = Llama(config)
    ids = torch.randint(0, 256, (4, 64))
    return model, lambda x: model(x, x).backward(), (ids,)


def vit():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=4
    )
    model = transformers.ViTForImageClassification(config)
    return model, lambda x: model(pixel_values=x).logits.float().pow(2).mean().backward(), (torch.randn(4, 3, 32, 32),)


def hf_llama():
    transformers = pytest.importorskip("transformers")
    # use_cache=False: a KV cache filled in forward would differ in the recompute (torch refuses it, mode or not)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4
    )
    config.num_key_value_heads, config.use_cache = 2, False
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (4, 64))
    return model, lambda x: model(input_ids=x, labels=x).loss.backward(), (ids,)


def _sweep(make, selective):
    """Plans for 12 budgets from below full checkpointing to none, each checked by re-tracing it applied."""
    search = md.plan_ac(make, budget=1 << 62, selective=selective)
    none, full = search.chain[0][1], search.chain[-1][1]
    assert len(search.chain) >= 3 and full < none  # checkpointing blocks lowers the peak, step by step
    budgets = [full - 4096] + [full + (none - full) * i // 10 for i in range(11)]
    plans = [search.at(b) for b in budgets]  # one search for the sweep
    alone = md.plan_ac(make, budget=budgets[4], selective=selective)  # as a search of its own gives it
    assert (alone.modules, alone.save, alone.peak) == (plans[4].modules, plans[4].save, plans[4].peak)
    for b, plan in zip(budgets, plans):
        model, step, args = make()
        md.apply_ac(model, plan)
        assert abs(md.memory(md.tracer()(step, *args)).peak - plan.peak) <= 1024  # the predicted peak is traced
        assert plan.fits == (plan.peak <= b) and (plan.fits or b < full)
    peaks = [p.peak for p in plans]
    assert peaks[1:] == sorted(peaks[1:]) and peaks[0] == peaks[1] == full  # a lower budget: never a higher peak
    assert plans[-1].modules == () and plans[-1].recompute == 0  # the whole budget: no checkpointing
    return budgets, plans


@pytest.mark.slow
@pytest.mark.parametrize("make", [llama, vit], ids=lambda f: f.__name__)
def test_plan_ac_sweep_re_traces_to_its_peak_under_budget_and_monotone(make):
    for plan in _sweep(make, selective=False)[1]:
        assert (plan.recompute > 0) == bool(plan.modules) and not plan.save


@pytest.mark.slow
@pytest.mark.parametrize("make", [hf_llama, vit], ids=lambda f: f.__name__)
def test_plan_ac_selective_sweep_recomputes_no_more_than_whole_blocks(make):
    budgets, plans = _sweep(make, selective=True)
    whole = [md.plan_ac(make, budget=1 << 62).at(b) for b in budgets]
    assert all(s.recompute <= w.recompute for s, w in zip(plans, whole) if w.fits)
    assert any(s.recompute < w.recompute for s, w in zip(plans, whole) if w.fits)  # saving matmuls pays
    assert any(p.save and p.recompute == 0 and p.peak < plans[-1].peak for p in plans)  # pointwise ops only: 0 FLOPs
    assert any("(selective, saving matmuls and attention)" in str(p) for p in plans)


@pytest.mark.skipif(not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"), reason="torch < 2.4")
def test_selective_checkpointing_under_the_mode_peaks_as_the_real_run():
    # torch's selective checkpointing runs its own TorchDispatchMode above MetaMode (Note [Selective
    # checkpointing under the mode]): the trace must keep what it saves, and not re-run it in backward
    pytest.importorskip("transformers")
    names = [f"model.layers.{i}" for i in range(4)]
    torch.manual_seed(0)
    plain_model, plain_step, args = hf_llama()
    plain = md.tracer()(plain_step, *args)
    for save in (SAVE_MATMULS_AND_ATTENTION, ()):
        torch.manual_seed(0)
        model, step, args = hf_llama()
        md.apply_ac(model, dict.fromkeys(names, save))
        trace = md.tracer()(step, *args)
        with md.LiveStorages(model, *args) as live:
            step(*args)
        assert md.memory(trace, workspaces=False).peak == live.peak  # what LiveStorages sees: storages
        mms = [sum(c.op == "aten.mm.default" for c in t.calls if c.phase == "backward") for t in (trace, plain)]
        if save:  # the saved matmuls are handed back, not run again
            assert mms[0] == mms[1] and md.flops(trace).total == md.flops(plain).total
        else:
            assert mms[0] > mms[1] and md.flops(trace).total > md.flops(plain).total


def test_apply_ac_refuses_what_is_not_an_op():
    model, _, _ = llama()
    with pytest.raises(md.MetaDispatchError, match="42 is not an op"):
        md.apply_ac(model, {"layers.0": [42]})
    with pytest.raises(md.MetaDispatchError, match="selective="):
        md.plan_ac(llama, budget=1, selective="aten.mm")


def test_apply_ac_keeps_names_and_state_dict():
    model, step, args = llama()
    keys = list(model.state_dict())
    md.apply_ac(model, ["layers.0", "layers.1"])
    assert list(model.state_dict()) == keys
    _, fresh_step, _ = llama()
    plain = md.tracer()(fresh_step, *args)
    extra = md.flops(md.tracer()(step, *args)).total - md.flops(plain).total
    blocks = [c for c in plain.calls if c.phase == "forward" and c.module.startswith(("layers.0", "layers.1"))]
    # the blocks' forwards run again, up to what backward needs (checkpoint's early stop)
    assert 0 < extra <= md.flops(_only(plain, blocks)).total


def _only(trace, calls):
    """A trace of some of ``trace``'s calls (FLOPs are per call)."""
    out = md.Trace()
    out.calls = calls
    return out


def test_remove_ac_is_public_and_undoes_apply_ac():
    """md.remove_ac takes what md.apply_ac took (names, a dict, an ACPlan) and gives each module back its own
    forward: the trace is the un-checkpointed one again, FLOPs and ops, and an instance forward survives."""
    _, plain_step, args = llama()
    plain = md.tracer()(plain_step, *args)
    for how in (["layers.0", "layers.1"], {"layers.0": ["aten.mm"], "layers.1": ()}):
        model, step, _ = llama()
        sentinel = model.layers[1].forward
        model.layers[1].forward = sentinel  # an instance forward, as accelerate's hooks set
        assert md.remove_ac(md.apply_ac(model, how), how) is model
        assert "forward" not in vars(model.layers[0]) and model.layers[1].forward is sentinel
        again = md.tracer()(step, *args)
        assert [c.op for c in again.calls] == [c.op for c in plain.calls]
        assert md.flops(again).total == md.flops(plain).total
    model, step, _ = llama()
    plan = md.ACPlan(("layers.1",), 0, 0, {"layers.1": ("aten.mm",)}, 0, budget=0, chain=[])
    md.apply_ac(model, plan)
    assert "forward" in vars(model.layers[1])
    md.remove_ac(model, plan)
    assert "forward" not in vars(model.layers[1])
    assert [c.op for c in md.tracer()(step, *args).calls] == [c.op for c in plain.calls]
