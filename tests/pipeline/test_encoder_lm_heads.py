"""An encoder under an LM head split into pipeline stages (pipeline/families.py ``LM_HEADS``): the stages run in
order compute the model's own logits and loss, bit for bit, on real data -- for a causal and a masked head, an
encoder and a decoder config (``is_decoder``: a causal mask)."""

import pytest
import torch

from metadispatch.pipeline.split import split

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # eager attention reads the mask the stage builds
@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize("name", ["BertLMHeadModel", "BertForMaskedLM", "RobertaForCausalLM", "RobertaForMaskedLM"])
def test_stages_in_order_compute_the_models_logits_and_loss(name, decoder, attention):
    if decoder and "Masked" in name:
        pytest.skip("a masked LM is no decoder (transformers warns)")
    config_class = transformers.BertConfig if name.startswith("Bert") else transformers.RobertaConfig
    config = config_class(**SMALL, is_decoder=decoder, max_position_embeddings=40, attn_implementation=attention)
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).eval()
    ids = torch.randint(3, 97, (2, 16))
    labels = torch.randint(0, 97, (2, 16))
    labels[0, :3] = -100
    cut = split(model)
    assert cut.blocks == 4
    with torch.no_grad():
        want = model(ids, labels=labels)
        h = ids
        for lo, hi in ((0, 1), (1, 3), (3, 4)):
            h = cut.stage(lo, hi)(h)
        assert torch.equal(h, want.logits)
        assert torch.equal(cut.loss(h, labels), want.loss)


def test_the_blocks_are_named_by_the_base_models_prefix():
    model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**SMALL))
    assert split(model, "roberta.encoder.layer").blocks == 4
    with pytest.raises(Exception, match=r"blocks encoder.layer: a RobertaForMaskedLM is split at .*roberta.encoder"):
        split(model, "encoder.layer")

