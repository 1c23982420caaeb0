"""pipeline/split.py on transformers decoders built as LLaMA is: the
stages, run one after another on a real CPU, compute the model's own
logits (Note [Splitting a model into pipeline stages]); one whose forward
scales its embeddings (Granite) is refused."""

import pytest
import torch

from metadispatch.errors import UnsupportedFeatureError
from metadispatch.pipeline.split import split

transformers = pytest.importorskip("transformers")

_SIZES = dict(
    vocab_size=70,
    hidden_size=32,
    intermediate_size=54,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
)
# Sliding windows shorter than the sequence: a block given the wrong mask gives other logits.
_FAMILIES = {
    "Qwen2ForCausalLM": transformers.Qwen2Config(
        **_SIZES, use_sliding_window=True, sliding_window=4, max_window_layers=2
    ),  # two full-attention blocks, then two sliding-window ones
    "MistralForCausalLM": transformers.MistralConfig(**_SIZES, sliding_window=4),
    "Qwen3ForCausalLM": transformers.Qwen3Config(**_SIZES, head_dim=8),
    # MoE blocks: refused before, their heads' output_router_logits read as a second assignment to logits
    "MixtralForCausalLM": transformers.MixtralConfig(  # grouped_mm: rows of a multiple of 16 bytes
        **{**_SIZES, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2
    ),
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig(
        **_SIZES, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    ),
}


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_pipeline_split_stages_compute_the_models_logits(family):
    torch.manual_seed(0)
    config = _FAMILIES[family]
    config._attn_implementation = "sdpa"
    model = getattr(transformers, family)(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    cut = split(model)
    assert (cut.blocks, cut.hidden, cut.vocab) == (4, 32, 70)
    h = ids
    with torch.no_grad():
        for lo, hi in ((0, 1), (1, 3), (3, 4)):
            h = cut.stage(lo, hi)(h)
        torch.testing.assert_close(h, model(ids).logits, rtol=0, atol=1e-6)


def test_pipeline_split_refuses_a_decoder_that_scales_its_embeddings():
    model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**_SIZES, embedding_multiplier=12.0))
    with pytest.raises(UnsupportedFeatureError, match="cannot split a GraniteForCausalLM"):
        split(model)


@pytest.mark.parametrize(
    "family,config",
    [
        ("CohereForCausalLM", lambda: transformers.CohereConfig(**_SIZES, logit_scale=0.0625)),
    ],
)
def test_pipeline_split_refuses_a_decoder_whose_head_rescales_its_logits(family, config):
    # LLaMA's base model, but the head's forward scales lm_head's logits after it
    # (Cohere: logit_scale): a last stage ending in lm_head would compute other logits
    model = getattr(transformers, family)(config())
    with pytest.raises(UnsupportedFeatureError, match=f"cannot split a {family}"):
        split(model)


def test_pipeline_split_refuses_a_moe_whose_loss_adds_its_routers_auxiliary_loss():
    # output_router_logits: the model's loss adds the load-balancing loss of every block's router, which a
    # last stage's causal-LM loss would leave out
    config = transformers.MixtralConfig(**_SIZES, num_local_experts=4, output_router_logits=True)
    with pytest.raises(UnsupportedFeatureError, match="cannot split a MixtralForCausalLM"):
        split(transformers.MixtralForCausalLM(config))
