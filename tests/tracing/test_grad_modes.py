"""Grad mode, no-grad and inference mode: the trace holds the ops eager dispatches.

Under ``torch.inference_mode()`` composites (``linear``, SDPA) reach the
Python key whole; eager runs their bodies at the backend (Note [Composites
that reach the mode] in core/dispatch.py).  Each case is compared with a
``TorchDispatchMode`` log of the real run (ops, shapes, strides) and its
FLOPs with ``FlopCounterMode``'s, in all three modes (issue 28, item 3).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import metadispatch as md
from metadispatch.testing import eager_calls, trace_calls

MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}


class _Block(nn.Module):
    """A pre-norm transformer block: layer norm, SDPA, MLP."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class _Sdpa(nn.Module):
    def forward(self, q):
        return nn.functional.scaled_dot_product_attention(q, q, q)


def _cases():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 32).transpose(1, 2)  # SDPA on a transposed query: the CPU kernel keeps its layout
    return {
        "linear": (nn.Linear(128, 256), (torch.randn(2, 128),)),
        "sdpa": (_Sdpa(), (q,)),
        "transformer": (nn.Sequential(_Block(), _Block()), (torch.randn(2, 10, 32),)),
        "encoder_layer": (
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
            (torch.randn(2, 7, 32),),
        ),
    }


def _step(grad_mode):
    def step(model, *inputs):
        with MODES[grad_mode]():
            return model(*inputs)

    return step


@pytest.mark.parametrize("grad_mode", list(MODES))
@pytest.mark.parametrize("case", ["linear", "sdpa", "transformer", "encoder_layer"])
def test_grad_modes_trace_what_eager_dispatches(case, grad_mode):
    model, inputs = _cases()[case]
    step = _step(grad_mode)
    trace = md.trace(step, model, *inputs)
    assert trace_calls(trace) == eager_calls(step, model, *inputs)
    with FlopCounterMode(display=False) as counter:
        step(model, *inputs)
    assert md.flops(trace).total == counter.get_total_flops()
    r = md.replay(trace, (model, *inputs))
    assert r.ok, r
    assert torch.equal(r.output, step(model, *inputs))


def test_inference_mode_linear_counts_its_matmul():
    lin, (x,) = _cases()["linear"]
    trace = md.trace(_step("inference"), lin, x)
    assert md.flops(trace).total == 2 * 2 * 128 * 256


def test_grad_modes_random_source_under_inference_mode():
    # rand's output got bounds and the version they were drawn at; an
    # inference tensor has no version counter ("Inference tensors do not
    # track version counter"), so any random op under inference_mode inside
    # a MetaMode raised.
    def step(x):
        with torch.inference_mode():
            return (torch.rand(4) < 2.0).sum() + x.sum()

    eager = step(torch.ones(4))
    trace = md.trace(step, torch.ones(4))
    assert trace.output.shape == eager.shape
    with md.MetaMode(), torch.inference_mode():
        assert torch.nn.functional.dropout(torch.ones(8), 0.5, training=True).shape == (8,)
