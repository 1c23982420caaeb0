"""Trace one training step of a small MLP and print every op it runs."""

import torch
from torch import nn

import metadispatch as md

model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train_step(x, target):
    loss = nn.functional.cross_entropy(model(x), target)
    loss.backward()
    return loss


trace = md.trace(train_step, torch.randn(8, 16), torch.randint(0, 4, (8,)))
print(trace)
print()
print(trace.summary())
assert all(p.grad is None for p in model.parameters())  # the real model is untouched
