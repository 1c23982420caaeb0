"""pipeline/families.py: the stages of an encoder (transformers
BertModel), torchvision's ResNet and ViT and timm's ViT, run one after
another on a real CPU, compute the model's own output (Note [Pipeline
stages of encoders and vision models]); the shapes found on the meta
device are those the real stages pass on; an encoder-decoder is refused,
named."""

import pytest
import torch

from metadispatch.errors import UnsupportedFeatureError
from metadispatch.pipeline.split import split


def _check(model, x, spans, expected):
    torch.manual_seed(0)
    model.eval()
    cut = split(model)
    assert cut.blocks == spans[-1][1]
    io = cut.io(spans, x)
    h = x
    with torch.no_grad():
        for (lo, hi), (given, made) in zip(spans, io):
            assert (given.shape, given.dtype) == (h.shape, h.dtype)
            h = cut.stage(lo, hi)(h)
            assert (made.shape, made.dtype, made.device.type) == (h.shape, h.dtype, "meta")
        torch.testing.assert_close(h, expected(model, x), rtol=0, atol=1e-5)
    # each stage holds only its own parameters: together, the model's, once
    held = [id(p) for lo, hi in spans for p in cut.stage(lo, hi).parameters()]
    assert sorted(held) == sorted(id(p) for p in model.parameters())


def test_pipeline_families_bert_stages_compute_its_hidden_states():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=70, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    ids = torch.randint(0, 70, (2, 16))
    _check(model, ids, [(0, 1), (1, 3), (3, 4)], lambda m, x: m(x).last_hidden_state)


def test_pipeline_families_resnet_stages_pass_feature_maps_of_each_shape():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    # cut inside layer2 and after layer3's first (downsampling) block: three shapes flow
    _check(model, x, [(0, 3), (3, 5), (5, 8)], lambda m, x: m(x))
    shapes = [tuple(o.shape) for _, o in split(model).io([(0, 3), (3, 5), (5, 8)], x)]
    assert shapes == [(2, 128, 8, 8), (2, 256, 4, 4), (2, 10)]


def test_pipeline_families_torchvision_vit_stages_compute_its_logits():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=4, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    _check(model, torch.randn(2, 3, 32, 32), [(0, 2), (2, 4)], lambda m, x: m(x))


def test_pipeline_families_timm_vit_stages_compute_its_logits():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=4, num_classes=10, reg_tokens=1
    )
    _check(model, torch.randn(2, 3, 32, 32), [(0, 1), (1, 3), (3, 4)], lambda m, x: m(x))


def test_pipeline_families_refuse_an_encoder_decoder_naming_it():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=70, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    with pytest.raises(UnsupportedFeatureError, match="cannot split a T5ForConditionalGeneration .* encoder-decoder"):
        split(transformers.T5ForConditionalGeneration(config))


def test_pipeline_families_refuse_other_blocks_than_the_familys():
    torchvision = pytest.importorskip("torchvision")
    with pytest.raises(UnsupportedFeatureError, match="split at its blocks in layer1..layer4"):
        split(torchvision.models.resnet18(), "layer2")
