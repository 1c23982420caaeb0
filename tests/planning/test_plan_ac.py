"""md.plan_ac over budget sweeps: each plan re-traces to its peak, stays under its budget, and is monotone."""

import pytest
import torch

import metadispatch as md
from metadispatch.cli.llama import Llama, LlamaConfig


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


@pytest.mark.slow
@pytest.mark.parametrize("make", [llama, vit], ids=lambda f: f.__name__)
def test_plan_ac_sweep_re_traces_to_its_peak_under_budget_and_monotone(make):
    chain = md.plan_ac(make, budget=1 << 62).chain
    none, full = chain[0][1], chain[-1][1]
    assert len(chain) >= 3 and full < none  # checkpointing blocks lowers the peak, step by step
    budgets = [full - 4096] + [full + (none - full) * i // 10 for i in range(11)]
    plans = [md.plan_ac(make, budget=b) for b in budgets]
    for b, plan in zip(budgets, plans):
        model, step, args = make()
        md.apply_ac(model, plan)
        assert abs(md.memory(md.tracer()(step, *args)).peak - plan.peak) <= 1024  # the predicted peak is traced
        assert plan.fits == (plan.peak <= b) and (plan.fits or b < full)
        assert (plan.recompute > 0) == bool(plan.modules)
    peaks = [p.peak for p in plans]
    assert peaks[1:] == sorted(peaks[1:]) and peaks[0] == peaks[1] == full  # a lower budget: never a higher peak
    assert plans[-1].modules == () and plans[-1].recompute == 0  # the whole budget: no checkpointing


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
