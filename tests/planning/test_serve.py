"""md.serve_plan against a real CPU forward: the cache it measures is the one the model writes."""

import pytest
import torch

import metadispatch as md

transformers = pytest.importorskip("transformers")


def _real_cache_bytes(model, n):
    with torch.inference_mode():
        out = model(torch.randint(0, model.config.vocab_size, (1, n)), use_cache=True)
    seen = {}
    for layer in out.past_key_values.layers:
        for t in (layer.keys, layer.values):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


_CONFIGS = {
    # GQA: 2 kv heads of 4
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
    ),
    "mistral": lambda: transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=128,
        max_position_embeddings=512,
        sliding_window=256,
    ),
}


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_serve_plan_kv_and_weights_are_the_real_models(name):
    cfg = _CONFIGS[name]()
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    per_token = (_real_cache_bytes(real, 40) - _real_cache_bytes(real, 24)) / 16
    weights = sum(p.numel() * p.element_size() for p in real.parameters())
    weights += sum(b.numel() * b.element_size() for b in real.buffers())

    plan = md.serve_plan(cfg, gpu="l4", max_model_len=128, max_num_batched_tokens=64)
    assert plan.kv_per_token == per_token > 0
    assert plan.weights == weights
    usable = int(md.gpu_profile("l4").memory * 0.9) - plan.weights - plan.prefill_peak
    assert plan.kv_tokens == int(usable // plan.kv_per_token)
    assert plan.blocks == plan.kv_tokens // 16
    per_sequence = 128 + plan.kv_fixed / plan.kv_per_token  # tokens of cache one max_model_len sequence takes
    assert plan.max_concurrency == int(plan.kv_tokens // per_sequence) > 0
    assert plan.ttft > 0 and plan.tpot > 0 and plan.prefill_peak > 0
    assert "not counted" in str(plan)


def test_serve_plan_tp_divides_weights_and_kv():
    cfg = _CONFIGS["llama"]()
    one, two = (md.serve_plan(cfg, gpu="h100", tp=tp, max_model_len=64, max_num_batched_tokens=32) for tp in (1, 2))
    assert two.weights == one.weights // 2 and two.kv_per_token == one.kv_per_token / 2
    assert any("split evenly" in a for a in two.assumptions)
