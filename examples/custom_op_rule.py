"""An op with no meta kernel, and the rule that teaches metadispatch its shapes."""

import torch

import metadispatch as md

lib = torch.library.Library("example", "DEF")
lib.define("pairwise_dist(Tensor x, Tensor y) -> Tensor")
lib.impl("pairwise_dist", lambda x, y: torch.cdist(x, y), "CPU")

x, y = torch.randn(5, 3), torch.randn(7, 3)
try:
    md.trace(torch.ops.example.pairwise_dist, x, y)
except md.UnsupportedOpError as e:
    print(e)


@md.register_meta("example::pairwise_dist")
def pairwise_dist_meta(x, y):
    return x.new_empty(x.shape[0], y.shape[0])


trace = md.trace(torch.ops.example.pairwise_dist, x, y)
print()
print(trace)
assert trace.output.shape == torch.ops.example.pairwise_dist(x, y).shape
