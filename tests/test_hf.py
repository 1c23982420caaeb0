"""Real models from transformers, built from configs (no download)."""

import pytest
import torch

import metadispatch as md

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(cfg)


def _snapshot(model):
    return (
        {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        {k: id(v) for k, v in model.state_dict(keep_vars=True).items()},
        {n: id(b) for n, b in model.named_buffers()},
    )


def test_hf_llama_forward_backward_on_logical_cuda():
    model = _tiny_llama()
    ids = torch.randint(0, 100, (2, 8))

    def step(ids):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits

    t = md.tracer(device="cuda")(step, ids)
    assert t.output.shape == (2, 8, 100) and t.output.device == torch.device("cuda:0")
    forward = [c for c in t if c.phase == "forward"]
    backward = [c for c in t if c.phase == "backward"]
    assert forward and backward
    attributed = sum(1 for c in forward if c.module) / len(forward)
    assert attributed > 0.9, attributed
    assert any(c.module == "model.layers.0.self_attn.q_proj" for c in forward)
    assert any(c.module.startswith("model.layers.1.mlp") for c in backward)
    assert set(t.grads) == {n for n, _ in model.named_parameters()}
    assert all(m.device == torch.device("cuda:0") for m in t.grads.values())
    assert t.modules["model.layers.0.self_attn"] == "LlamaAttention"


def test_hf_llama_real_model_untouched_by_tracing():
    model = _tiny_llama()
    model.train()
    values, identities, buffers = _snapshot(model)

    def step(ids):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()

    md.trace(step, torch.randint(0, 100, (1, 6)))
    after_values, after_ids, after_buffers = _snapshot(model)
    assert after_ids == identities and after_buffers == buffers
    assert all(torch.equal(values[k], after_values[k]) for k in values)
    assert all(p.grad is None for p in model.parameters())
    assert not any(isinstance(t, md.MetaTensor) for t in model.state_dict(keep_vars=True).values())


def test_hf_batchnorm_buffers_untouched_in_train_mode():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    model.train()
    values, identities, _ = _snapshot(model)
    md.trace(lambda x: model(x).sum().backward(), torch.randn(2, 3, 8, 8))
    after_values, after_ids, _ = _snapshot(model)
    assert after_ids == identities
    assert all(torch.equal(values[k], after_values[k]) for k in values)
    assert int(model[1].num_batches_tracked) == 0
