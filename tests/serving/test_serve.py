"""md.serve_plan against a real CPU forward: the cache it measures is the one the model writes."""

import pytest
import torch

import metadispatch as md
from tests.serving.test_kv import _CONFIGS as KV_CONFIGS
from tests.serving.test_kv import real_cache_bytes

transformers = pytest.importorskip("transformers")


def _real_cache_bytes(model, n):
    return sum(real_cache_bytes(model, n))


def _mistral_wide():
    cfg = KV_CONFIGS["mistral_sliding"]()
    cfg.sliding_window = 256  # past every length measured here: every layer still grows
    return cfg


_CONFIGS = {"llama": KV_CONFIGS["llama_gqa"], "mistral": _mistral_wide}


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
    # sequences of 128 tokens at once: each holds what a real forward's cache holds at 128 tokens
    assert plan.max_concurrency == int(usable // _real_cache_bytes(real, 128)) > 0
    assert plan.ttft > 0 and plan.tpot > 0 and plan.prefill_peak > 0
    assert "not counted" in str(plan)


def test_a_sliding_window_model_holds_a_sequence_of_any_length():
    cfg = KV_CONFIGS["mistral_sliding"]()
    cfg.sliding_window = 16
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    plan = md.serve_plan(cfg, gpu="l4", max_model_len=128, max_num_batched_tokens=64)
    usable = int(md.gpu_profile("l4").memory * 0.9) - plan.weights - plan.prefill_peak
    assert _real_cache_bytes(real, 128) == _real_cache_bytes(real, 40)  # the window caps it
    assert plan.max_concurrency == int(usable // _real_cache_bytes(real, 128))
    assert plan.longest == cfg.max_position_embeddings  # never the cache: the positions bound it
    assert {layer.kind for layer in plan.layout.layers} == {"sliding"} and "at most 16 tokens" in str(plan)


def test_decode_rows_per_batch():
    cfg = _CONFIGS["llama"]()
    plan = md.serve_plan(cfg, gpu="h100", max_model_len=64, max_num_batched_tokens=32, batches=(1, 8))
    one, eight = plan.decode
    assert (one.batch, eight.batch) == (1, 8) and plan.tpot == one.tpot
    assert eight.tpot >= one.tpot * (1 - 1e-9) and eight.tokens_per_s > one.tokens_per_s  # weights read once a step
    assert one.tokens_per_s == 1 / one.tpot and eight.fits
    assert "tokens/s" in str(plan)
