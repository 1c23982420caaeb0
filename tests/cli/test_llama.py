"""A transformers LLaMA-style model, use_cache=False, forward and backward on plain md.trace.

transformers checks for packed sequences with ``(mask[:, -1] == 0).all()`` on
position ids built from ``arange``; on plain meta tensors that is a
data-dependent error.  Known values answer it.
"""

import pytest
import torch

import metadispatch as md

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_llama_use_cache_false_forward_backward_traces_with_known_values():
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 8))

    def step(ids):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    trace = md.trace(step, ids)
    known = [c for c in trace if c.note == "known value"]
    assert known and known[0].op == "aten._local_scalar_dense.default"
    assert any(c.phase == "backward" for c in trace)
    assert set(trace.grads) == {n for n, _ in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())
