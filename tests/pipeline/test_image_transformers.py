"""A transformers ViT or DeiT image classifier split into pipeline stages (pipeline/families.py): the stages run
in order on real images give the model's logits and its own loss bit for bit, under SDPA and eager attention."""

import pytest
import torch

from metadispatch.pipeline.split import split
from tests.pipeline.in_order import assert_stages_give_the_models_output

transformers = pytest.importorskip("transformers")

SMALL = dict(
    image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4
)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["ViTForImageClassification", "DeiTForImageClassification"])
def test_stages_in_order_give_the_models_logits_and_loss(name, attention):
    config = getattr(transformers, name.split("For")[0] + "Config")(**SMALL, num_labels=5)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).eval()
    pixels, labels = torch.randn(3, 3, 32, 32), torch.tensor([0, 4, 2])
    cut = split(model)
    assert cut.blocks == 4 and cut.io is not None
    assert_stages_give_the_models_output(model, cut, pixels, labels)


def test_the_blocks_are_named_by_the_base_models_prefix():
    model = transformers.DeiTForImageClassification(transformers.DeiTConfig(**SMALL))
    assert split(model, "deit.layers").blocks == 4
    with pytest.raises(Exception, match=r"blocks layers: a DeiTForImageClassification is split at .*deit.layers"):
        split(model, "layers")
