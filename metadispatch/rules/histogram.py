"""Histograms: no meta kernel, but output shapes follow from the bin counts.

``histogram`` and the ops behind ``torch.histogramdd`` give a histogram with
one entry per bin and ``bins + 1`` edges per dimension; the values, not the
shapes, depend on the data (``range=None`` takes the edges from the input's
min and max).  The kernels exist on CPU only, so other logical devices keep
the router's answer: no kernel (``UnsupportedOpError``).
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule

aten = torch.ops.aten


def _check(x, weight, name, n_dims=None):
    torch._check(
        x.dtype in (torch.float32, torch.float64),
        lambda: f"torch.{name}: input tensor and bins tensors should have the same floating-point dtype, got {x.dtype}",
    )
    if n_dims is not None:
        torch._check(
            x.dim() >= 1 and x.shape[-1] == n_dims,
            lambda: f"torch.{name}: expected input to have {n_dims} innermost dimensions, got shape {tuple(x.shape)}",
        )
    if weight is not None:
        want = x.shape if n_dims is None else x.shape[:-1]
        torch._check(
            weight.shape == want and weight.dtype == x.dtype,
            lambda: f"torch.{name}: weight should have the same shape and dtype as input",
        )


def _counts(bins, name):
    torch._check(all(b > 0 for b in bins), lambda: f"torch.{name}: bins must be > 0, got {bins}")
    return list(bins)


@builtin_rule(aten.histogram.bin_ct)
def histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False, fallback):
    if x.device.type != "cpu":
        return fallback(x, bins, range=range, weight=weight, density=density)
    _check(x, weight, "histogram")
    (b,) = _counts([bins], "histogram")
    return x.new_empty((b,)), x.new_empty((b + 1,))


@builtin_rule(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, *, weight=None, density=False, fallback):
    if x.device.type != "cpu":
        return fallback(x, bins, weight=weight, density=density)
    _check(x, weight, "histogram")
    torch._check(
        bins.dim() == 1 and bins.numel() >= 1 and bins.dtype == x.dtype,
        lambda: "torch.histogram: bins should be a 1-d tensor of at least one edge",
    )
    return x.new_empty((bins.numel() - 1,)), x.new_empty((bins.numel(),))


@builtin_rule(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False, fallback):
    if x.device.type != "cpu":
        return fallback(x, bins, range=range, weight=weight, density=density)
    _check(x, weight, "histogramdd", len(bins))
    return [x.new_empty((b + 1,)) for b in _counts(bins, "histogramdd")]


@builtin_rule(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False, fallback):
    if x.device.type != "cpu":
        return fallback(x, bins, range=range, weight=weight, density=density)
    _check(x, weight, "histogramdd", len(bins))
    return x.new_empty(_counts(bins, "histogramdd"))


@builtin_rule(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False, fallback):
    if x.device.type != "cpu":
        return fallback(x, bins, weight=weight, density=density)
    _check(x, weight, "histogramdd", len(bins))
    torch._check(
        all(b.dim() == 1 and b.numel() >= 1 and b.dtype == x.dtype for b in bins),
        lambda: "torch.histogramdd: bins should be 1-d tensors of at least one edge",
    )
    return x.new_empty([b.numel() - 1 for b in bins])
