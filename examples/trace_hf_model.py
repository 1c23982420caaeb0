"""Trace a Hugging Face LLaMA built from a config, forward and backward, "on cuda".

No weights are downloaded and no memory is allocated for them: the model is
built under MetaMode, so this runs on a laptop without a GPU.
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import metadispatch as md

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
config = LlamaConfig(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=layers,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
)
with md.MetaMode(device="cuda"):
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(0, config.vocab_size, (1, 128))


def train_step(input_ids):
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.logits


trace = md.trace(train_step, input_ids)
print(trace.summary(top=10))
attn = [c for c in trace if c.module == "model.layers.0.self_attn.q_proj" and c.phase == "forward"]
print("\nmodel.layers.0.self_attn.q_proj, forward:")
print("\n".join(c.format() for c in attn))
