"""Small models shared by the analysis tests; each returns (model, inputs, step)."""

import torch
from torch import nn


def train_step(model, *inputs):
    out = model(*inputs)
    loss = out if out.dim() == 0 else out.float().pow(2).mean()
    loss.backward()
    return loss


def mlp():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, (torch.randn(8, 16),)


def convnet():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3),
        nn.Flatten(),
        nn.Linear(16 * 2 * 2, 10),
    )
    return model, (torch.randn(2, 3, 8, 8),)


def llama():
    from metadispatch.cli.llama import Llama, LlamaConfig

    return Llama(LlamaConfig.tiny()), (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))


def _hf(make):
    transformers = __import__("pytest").importorskip("transformers")
    model = make(transformers)
    ids = torch.randint(0, 100, (2, 12))

    class LM(nn.Module):  # returns the loss, so train_step applies
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, ids):
            return self.lm(input_ids=ids, labels=ids).loss

    return LM(), (ids,)


def hf_llama():
    return _hf(
        lambda t: t.LlamaForCausalLM(
            t.LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=100,
                tie_word_embeddings=True,
                attn_implementation="eager",
            )
        )
    )


def hf_gpt2():
    return _hf(
        lambda t: t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32))
    )


def hf_bert():
    return _hf(
        lambda t: t.BertForMaskedLM(
            t.BertConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=100,
                max_position_embeddings=32,
            )
        )
    )


def tiny_mixtral():
    """A one-layer Mixtral on transformers' default MoE path (``torch._grouped_mm``)."""
    transformers = __import__("pytest").importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "mixtral",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


MODELS = {"mlp": mlp, "convnet": convnet, "llama": llama, "hf_llama": hf_llama, "hf_gpt2": hf_gpt2}


def tied_llama(tie=True, **sizes):
    """A transformers LLaMA, tiny unless ``sizes`` say otherwise, its head tied to its embedding."""
    transformers = __import__("pytest").importorskip("transformers")
    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    config = transformers.LlamaConfig(**(shape | sizes), tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config)
