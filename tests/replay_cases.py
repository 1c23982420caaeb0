"""Tiny models and the functions traced over them, shared by the replay,
serialize and materialize tests.  Each case builds from a config (no
downloads) and runs forward and backward."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 64


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 3))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )


def batchnorm_first():
    """BatchNorm1d on the data: autograd asks its backward for no input gradient."""
    return nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 3))


def llama(attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=True,
            attn_implementation=attn,
        )
    )


def gpt2(attn="sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=attn,
        )
    )


def bert(attn="sdpa"):
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
            attn_implementation=attn,
        )
    )


def classify(model, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def language_model(model, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits


def _images():
    return torch.randn(2, 3, 8, 8), torch.tensor([1, 4])


def _tokens():
    return (torch.randint(0, VOCAB, (2, 8)),)


# name -> (build model, fn, inputs, bit-exact against eager?)
# SDPA runs its fused CPU kernel eagerly but its math path in a trace (the
# choice is made from the C++ device, which is meta while tracing), so SDPA
# models match within rtol only; "eager" attention runs the same kernels.
CASES = {
    "mlp": (mlp, classify, lambda: (torch.randn(4, 6), torch.tensor([0, 2, 1, 2])), True),
    "cnn_batchnorm": (cnn, classify, _images, True),
    "batchnorm1d_first": (batchnorm_first, classify, lambda: (torch.randn(4, 6), torch.tensor([0, 2, 1, 2])), True),
    "llama": (lambda: llama("eager"), language_model, _tokens, True),
    "llama_sdpa": (llama, language_model, _tokens, False),
    "gpt2": (gpt2, language_model, _tokens, True),
    "bert": (lambda: bert("eager"), language_model, _tokens, True),
}


def build(name: str, seed: int = 0):
    """(model in train mode, fn, inputs, exact) for case ``name``."""
    make, fn, inputs, exact = CASES[name]
    torch.manual_seed(seed)
    model = make().train()
    return model, fn, inputs(), exact
