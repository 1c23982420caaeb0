"""md.kv_layout against a real CPU forward: every layer kind's bytes equal the cache the model allocates."""

import pytest
import torch

import metadispatch as md
from metadispatch.serving.kv import _tensors, decoded_cache

transformers = pytest.importorskip("transformers")

_SMALL = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 512}

# Each a layer kind a config formula gets wrong (Note [KV layout from three prompt lengths]).
_CONFIGS = {
    "llama_gqa": lambda: transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **_SMALL
    ),
    "mistral_sliding": lambda: transformers.MistralConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, sliding_window=12, **_SMALL
    ),
    "gemma2_interleaved": lambda: transformers.Gemma2Config(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12, **_SMALL
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        **_SMALL,
    ),
    "deepseek_v3_mla": lambda: transformers.DeepseekV3Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **_SMALL,
    ),
    "jamba_state_space": lambda: transformers.JambaConfig(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=2,
        num_experts_per_tok=1,
        expert_layer_period=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=8,
        mamba_expand=2,
        **_SMALL,
    ),
}


def _real(cfg):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def real_cache_bytes(model, n) -> list[int]:
    """Per cache layer, the bytes of the storages a real CPU prefill of ``n - 1`` tokens and a decode step
    leave in its cache."""
    with torch.inference_mode():
        cache = decoded_cache(model, torch.randint(0, model.config.vocab_size, (1, n)))
    seen: set = set()
    out = []
    for layer in cache.layers:
        total = 0
        for t in _tensors(layer):
            if (p := t.untyped_storage().data_ptr()) not in seen:
                seen.add(p)
                total += t.untyped_storage().nbytes()
        out.append(total)
    return out


def _built_under_mode(cfg):
    with md.MetaMode(device="cuda", gpu="h100"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_every_layer_holds_what_the_real_forward_allocates(name):
    cfg = _CONFIGS[name]()
    real = _real(cfg)
    layout = md.kv_layout(_built_under_mode(cfg), "h100")
    assert len(layout.layers) == len(real.config.layer_types if hasattr(real.config, "layer_types") else layout.layers)
    # lengths the layout was not measured at, below and past every window
    for n in (3, 11, 13, 50):  # n tokens in the cache: n - 1 prefilled, one decoded
        real_bytes = real_cache_bytes(real, n)
        assert [layer.bytes_at(n) for layer in layout.layers] == real_bytes, n
    assert layout.bytes_at(50) == sum(real_cache_bytes(real, 50))


def test_kinds_are_named_from_what_the_layers_do():
    kinds = {
        name: {layer.kind for layer in md.kv_layout(_built_under_mode(_CONFIGS[name]()), "h100").layers}
        for name in ("llama_gqa", "mistral_sliding", "gemma2_interleaved", "deepseek_v3_mla", "jamba_state_space")
    }
    assert kinds == {
        "llama_gqa": {"full"},
        "mistral_sliding": {"sliding"},
        "gemma2_interleaved": {"sliding", "full"},
        "deepseek_v3_mla": {"full MLA"},
        "jamba_state_space": {"state", "full"},
    }
    sliding = md.kv_layout(_built_under_mode(_CONFIGS["mistral_sliding"]()), "h100").layers[0]
    assert sliding.cap == 12  # the window: what transformers' sliding layer holds once decoding
    assert sliding.bytes_at(10_000) == sliding.bytes_at(12) > sliding.bytes_at(11)


def test_longest_is_the_last_length_that_fits():
    layout = md.kv_layout(_built_under_mode(_CONFIGS["gemma2_interleaved"]()), "h100")
    budget = layout.bytes_at(100) + 1
    n = layout.longest(budget, limit=10_000)
    assert layout.bytes_at(n) <= budget < layout.bytes_at(n + 1) and n == 100
    assert layout.longest(budget, limit=40) == 40
    assert layout.longest(layout.bytes_at(0) - 1, limit=10) == 0


@pytest.mark.parametrize("lengths", [(8, 4), (1, 4), (4, 20), (4.0, 8)])
def test_lengths_that_cannot_measure_the_layout_are_refused(lengths):
    model = _built_under_mode(_CONFIGS["mistral_sliding"]())  # window 12
    with pytest.raises(md.MetaDispatchError, match="kv_layout: lengths="):
        md.kv_layout(model, "h100", lengths)
