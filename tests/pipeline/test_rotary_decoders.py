"""Phi, GPT-NeoX, GPT-J, Falcon, OPT, BLOOM and GPT-Neo split into pipeline stages (pipeline/decoders.py): the stages run in order on
real data compute the model's own logits and loss bit for bit, under SDPA and eager attention (eager reads the
mask the stage builds); a Falcon with ALiBi and a forward the stage does not rest on are refused."""

import pytest
import torch

from metadispatch.errors import UnsupportedFeatureError
from metadispatch.pipeline import decoders
from metadispatch.pipeline.split import split
from tests.pipeline.in_order import assert_stages_give_the_models_output

transformers = pytest.importorskip("transformers")


_SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=32)


def _configs():
    t = transformers
    return {
        "PhiForCausalLM": t.PhiConfig(**_SMALL, intermediate_size=64, partial_rotary_factor=0.5, embd_pdrop=0.0),
        "GPTNeoXForCausalLM": t.GPTNeoXConfig(**_SMALL, intermediate_size=64, rotary_pct=0.5),
        "GPTJForCausalLM": t.GPTJConfig(vocab_size=97, n_embd=32, n_layer=4, n_head=4, rotary_dim=4, n_positions=32),
        "FalconForCausalLM": t.FalconConfig(**_SMALL),
        "FalconForCausalLM-new": t.FalconConfig(**_SMALL, num_kv_heads=2, new_decoder_architecture=True),
        "BloomForCausalLM": t.BloomConfig(vocab_size=97, hidden_size=32, n_layer=4, n_head=4),
        # global and local blocks, the local window shorter than the sequence
        "GPTNeoForCausalLM": t.GPTNeoConfig(
            vocab_size=97,
            hidden_size=32,
            num_layers=4,
            num_heads=4,
            attention_types=[[["global", "local"], 2]],
            window_size=4,
            max_position_embeddings=32,
        ),
        "OPTForCausalLM": t.OPTConfig(**_SMALL, ffn_dim=64, word_embed_proj_dim=32),
        # OPT-350m's shape: projected embeddings, the norm after each block and no final one
        "OPTForCausalLM-350m": t.OPTConfig(**_SMALL, ffn_dim=64, word_embed_proj_dim=16, do_layer_norm_before=False),
    }


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(_configs()))
def test_stages_in_order_compute_the_models_logits_and_loss(name, attention):
    if name.startswith(("Bloom", "GPTNeo")) and attention == "sdpa":
        pytest.skip("transformers' BLOOM and GPT-Neo have eager attention only")
    config = _configs()[name]
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = getattr(transformers, name.split("-")[0])(config).eval()
    ids = torch.randint(0, 97, (2, 16))
    labels = torch.randint(0, 97, (2, 16))
    cut = split(model)
    assert (cut.blocks, cut.hidden, cut.vocab) == (4, 32, 97)
    assert_stages_give_the_models_output(model, cut, ids, labels)


def test_a_stage_holds_only_its_own_parameters():
    model = transformers.GPTNeoXForCausalLM(_configs()["GPTNeoXForCausalLM"])
    cut = split(model, "gpt_neox.layers")
    middle = {id(p) for p in cut.stage(1, 3).parameters()}
    assert middle == {id(p) for b in model.gpt_neox.layers[1:3] for p in b.parameters()}
    assert {id(p) for p in model.lm_head.parameters()} <= {id(p) for p in cut.stage(3, 4).parameters()}


def test_falcon_with_alibi_is_refused():
    config = transformers.FalconConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True
    )
    with pytest.raises(UnsupportedFeatureError, match="FalconForCausalLM with alibi=True"):
        split(transformers.FalconForCausalLM(config))


def test_a_forward_the_stage_does_not_rest_on_is_refused(monkeypatch):
    # a release whose base forward lost a line the stage copies: refused, naming the line
    model = transformers.PhiForCausalLM(_configs()["PhiForCausalLM"])
    row = decoders.DECODERS["PhiForCausalLM"]._replace(norm="norm")
    monkeypatch.setitem(decoders.DECODERS, "PhiForCausalLM", row)
    with pytest.raises(UnsupportedFeatureError, match=r"no longer has 'self.norm\(hidden_states\)'"):
        split(model)
