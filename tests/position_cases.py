"""A legitimate call of every op replay checks before running (trust/value_checks.py, shape_checks.py),
and the values or shapes a hostile file would hand it instead.

Each :class:`Case` builds real CPU arguments the way a traced model makes them
(indices from the forward op, statistics from the norm), and names its bad
variants: ``(argument, value)``, where a value is a tensor or number to put
in that argument's place, or a function of the legitimate arguments (by
name) returning it.  tests/trust/test_index_checks.py replays each through a saved
and loaded trace (legitimate: bit for bit eager's; bad: a typed refusal
naming the argument), and tests/hostile_indices.py writes them into the
hostile corpus.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

A, P = torch.ops.aten, torch.ops.prims
T = torch.tensor
_BIG = 1 << 40


class Case(NamedTuple):
    op: Any  # the OpOverload called
    build: Any  # () -> (args, kwargs) of a legitimate call
    bad: tuple  # (argument, value or fn(arguments by name) -> value[, the argument the refusal names])
    outputs: int | None = None  # how many outputs to compare with eager (None: all)
    grad: bool = False  # eager runs with grad enabled (as replay runs a forward)


def _seeded(fn):
    def build(*args, **kwargs):
        torch.manual_seed(0)
        return fn(*args, **kwargs)

    return build


def _idx(value):
    """Indices of the legitimate call with their last element set to ``value``."""

    def change(a, name):
        t = a[name].clone()
        t.view(-1)[-1] = value
        return t

    return change


def _set(name, value):
    return (name, lambda a, name=name: _idx(value)(a, name))


@_seeded
def _max_pool2d():
    x = torch.randn(1, 2, 4, 4)
    out, idx = A.max_pool2d_with_indices(x, [2, 2], [2, 2])
    return (torch.ones_like(out), x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx), {}


@_seeded
def _max_pool3d():
    x = torch.randn(1, 2, 4, 4, 4)
    out, idx = A.max_pool3d_with_indices(x, [2, 2, 2], [2, 2, 2])
    return (torch.ones_like(out), x, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False, idx), {}


@_seeded
def _adaptive2d():
    x = torch.randn(1, 2, 5, 5)
    out, idx = A.adaptive_max_pool2d(x, [2, 2])
    return (torch.ones_like(out), x, idx), {}


@_seeded
def _adaptive3d():
    x = torch.randn(1, 2, 3, 5, 5)
    out, idx = A.adaptive_max_pool3d(x, [2, 2, 2])
    return (torch.ones_like(out), x, idx), {}


@_seeded
def _fractional2d():
    return (torch.randn(1, 2, 9, 9), [2, 2], [4, 4], torch.rand(1, 2, 2)), {}


@_seeded
def _fractional3d():
    return (torch.randn(1, 2, 7, 7, 7), [2, 2, 2], [3, 3, 3], torch.rand(1, 2, 3)), {}


_BAG_INDICES = T([1, 2, 4, 5, 4, 3, 2, 9])
_BAG_OFFSETS = T([0, 4])


@_seeded
def _bag(mode=0, psw=False, last=False):
    weight = torch.randn(10, 3)
    offsets = T([0, 4, 8]) if last else _BAG_OFFSETS
    w = torch.rand(8) if psw else None
    return (weight, _BAG_INDICES, offsets, False, mode, False, w, last, -1), {}


def _bag_forward(mode, psw=False):
    (weight, indices, offsets, *_rest), _ = _bag(mode, psw)
    w = torch.rand(8) if psw else None
    out, o2b, bag_size, max_idx = A._embedding_bag(weight, indices, offsets, False, mode, False, w)
    return weight, indices, offsets, o2b, bag_size, max_idx, w, torch.ones_like(out)


def _bag_backward(mode):
    def build():
        weight, indices, offsets, o2b, bag_size, max_idx, _, grad = _bag_forward(mode)
        return (grad, indices, offsets, o2b, bag_size, max_idx, 10, False, mode, False, None, -1), {}

    return build


def _bag_dense_backward():
    weight, indices, offsets, o2b, bag_size, max_idx, _, grad = _bag_forward(1)
    return (grad, indices, o2b, bag_size, max_idx, 10, False, 1, None, -1), {}


def _bag_psw_backward():
    weight, indices, offsets, o2b, _, _, _, grad = _bag_forward(0, psw=True)
    return (grad, weight, indices, offsets, o2b, 0, -1), {}


@_seeded
def _embedding_dense_backward():
    return (torch.randn(4, 3), T([0, 1, 2, 1]), 5, -1, True), {}


@_seeded
def _segment(offsets=False):
    data = torch.randn(5)
    kw = {"offsets": T([0, 1, 3, 5])} if offsets else {"lengths": T([1, 2, 2])}
    return (data, "sum"), {**kw, "unsafe": True}


@_seeded
def _segment_backward():
    data = torch.randn(5)
    out = A.segment_reduce(data, "sum", lengths=T([1, 2, 2]))
    return (torch.ones_like(out), out, data, "sum"), {"lengths": T([1, 2, 2])}


@_seeded
def _pad_packed():
    return (torch.randn(7, 3), T([3, 2, 1, 1]), False, 0.0, 4), {}


@_seeded
def _pack_padded_backward():
    return (torch.randn(7, 3), [4, 3, 3], T([3, 2, 1, 1]), False), {}


@_seeded
def _nll_backward():
    x = torch.randn(4, 5).log_softmax(1)
    return (torch.ones(()), x, T([0, 1, 4, 2]), None, 1, -100, T(4.0)), {}


@_seeded
def _nll2d_backward():
    x = torch.randn(2, 3, 2, 2).log_softmax(1)
    return (torch.ones(()), x, torch.randint(0, 3, (2, 2, 2)), None, 1, -100, T(8.0)), {}


@_seeded
def _ctc():
    lp = torch.randn(6, 2, 5).log_softmax(2)
    return (lp, T([[1, 2, 2], [1, 3, 4]]), [6, 6], [3, 3], 0, False), {}


@_seeded
def _ctc_public():
    lp = torch.randn(6, 2, 5).log_softmax(2)
    return (lp, T([[1, 2, 2], [1, 3, 4]]), [6, 6], [3, 3]), {}


@_seeded
def _ctc_backward():
    (lp, targets, il, tl, blank, zi), _ = _ctc()
    nll, alpha = A._ctc_loss(lp, targets, il, tl, blank, zi)
    return (torch.ones(2), lp, targets, il, tl, nll, alpha, 0, False), {}


@_seeded
def _fft(kind="c2c"):
    if kind == "c2c":
        return (torch.randn(3, 4, dtype=torch.complex64), [1], 0, True), {}
    if kind == "r2c":
        return (torch.randn(3, 4), [1], 0, True), {}
    return (torch.randn(3, 3, dtype=torch.complex64), [1], 0, 4), {}


@_seeded
def _prims_fft():
    return (torch.randn(3, 4, dtype=torch.complex64),), {"dim": [1], "forward": True}


@_seeded
def _aa():
    return (torch.randn(1, 1, 4, 4), [8, 8], False, 2.0, 2.0), {}


@_seeded
def _aa_backward():
    return (torch.randn(1, 1, 8, 8), [8, 8], [1, 1, 4, 4], False, 2.0, 2.0), {}


@_seeded
def _grid():
    return (torch.randn(1, 1, 4, 4), torch.rand(1, 3, 3, 2) * 2 - 1, 0, 0, False), {}


@_seeded
def _grid_backward():
    (x, grid, *_), _ = _grid()
    return (torch.randn(1, 1, 3, 3), x, grid, 0, 0, False, [True, True]), {}


def _masked(put=False):
    x, mask, idx = torch.arange(16.0), T([True, True, False, True]), T([0, 1, 1000, 2])
    return ((x, mask, [idx], torch.ones(4)) if put else (x, mask, [idx], 0.0)), {}


@_seeded
def _grouped_mm():
    return (torch.randn(8, 4), torch.randn(2, 4, 4), T([3, 8], dtype=torch.int32)), {}


def _division(scalar=False):
    a = T([6, 5, -7])
    return ((a, -1) if scalar else (a, T([-1, 2, 3]))), {"rounding_mode": "trunc"}


_MIN = torch.iinfo(torch.int64).min


@_seeded
def _batch_norm():
    return (torch.randn(2, 3, 4), torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3), True, 0.1, 1e-5), {}


@_seeded
def _batch_norm_backward():
    (x, w, b, rm, rv, *_), _ = _batch_norm()
    _, mean, invstd = A.native_batch_norm(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5)
    return (torch.randn_like(x), x, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True]), {}


@_seeded
def _layer_norm():
    return (torch.randn(4, 8), [8], torch.ones(8), torch.zeros(8), 1e-5), {}


@_seeded
def _layer_norm_backward():
    (x, shape, w, b, eps), _ = _layer_norm()
    _, mean, rstd = A.native_layer_norm(x, shape, w, b, eps)
    return (torch.randn_like(x), x, shape, mean, rstd, w, b, [True, True, True]), {}


@_seeded
def _group_norm():
    return (torch.randn(2, 4, 3), torch.ones(4), torch.zeros(4), 2, 4, 3, 2, 1e-5), {}


@_seeded
def _weight_norm():
    return (torch.randn(4, 3), torch.randn(4, 1), 0), {}


@_seeded
def _weight_norm_backward():
    (v, g, dim), _ = _weight_norm()
    _, norms = A._weight_norm_interface(v, g, dim)
    return (torch.randn(4, 3), v, g, norms, 0), {}


@_seeded
def _log_softmax_backward():
    out = torch.randn(4, 8).log_softmax(1)
    return (torch.randn(4, 8), out, 1, torch.float32), {}


@_seeded
def _sdpa_cpu_backward():
    q = torch.randn(1, 2, 4, 8)
    o, lse = A._scaled_dot_product_flash_attention_for_cpu(q, q, q)
    return (torch.randn_like(o), q, q, q, o, lse, 0.0, False), {}


@_seeded
def _avg_pool_backward():
    return (torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), [2, 2], [2, 2], [0, 0], False, True, None), {}


@_seeded
def _adaptive_avg_backward():
    return (torch.randn(1, 2, 2, 2), torch.randn(1, 2, 4, 4)), {}


@_seeded
def _adaptive_avg3d_backward():
    return (torch.randn(1, 2, 2, 2, 2), torch.randn(1, 2, 4, 4, 4)), {}


@_seeded
def _fractional_backward():
    (x, k, size, samples), _ = _fractional2d()
    out, idx = A.fractional_max_pool2d(x, k, size, samples)
    return (torch.randn_like(out), x, k, size, idx), {}


def _pad_backward(d: int):
    @_seeded
    def build():
        return (torch.randn(1, 1, *[6] * d), torch.randn(1, 1, *[4] * d), [1] * (2 * d)), {}

    return build


@_seeded
def _unfold_backward():
    return (torch.randn(7, 2), [8], 0, 2, 1), {}


@_seeded
def _pdist_backward():
    x = torch.randn(5, 3)
    return (torch.randn(10), x, 2.0, torch.pdist(x)), {}


@_seeded
def _cdist_backward():
    x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
    return (torch.randn(5, 4), x1, x2, 2.0, torch.cdist(x1, x2)), {}


@_seeded
def _lu_unpack():
    lu, piv = torch.linalg.lu_factor(torch.randn(4, 4))
    return (lu, piv), {}


_H = 8


@_seeded
def _rnn_layer():
    x, w0, w1 = torch.randn(5, 3, 4), torch.randn(4 * _H, 4), torch.randn(4 * _H, _H)
    b0, b1, h = torch.randn(4 * _H), torch.randn(4 * _H), torch.zeros(3, _H)
    return (x, w0, w1, b0, b1, h, h.clone(), False, [], 2, _H, 1, True, False, False, True), {}


def _rnn_layer_backward():
    args, _ = _rnn_layer()
    with torch.enable_grad():
        out, hy, cy, ws = A.mkldnn_rnn_layer(*args)
    x, w0, w1, b0, b1, h, c = args[:7]
    return (x, w0, w1, b0, b1, h, c, out, hy, cy, torch.ones_like(out), None, None, False, 2, _H, 1, True, True,
            False, [], False, ws), {}  # fmt: skip


def _shrink(name, shape):
    return (name, lambda a, name=name: a[name].reshape(-1)[: torch.Size(shape).numel()].reshape(shape).clone())


CASES = [
    Case(A.max_pool2d_with_indices_backward.default, _max_pool2d, (_set("indices", 16), _set("indices", -_BIG))),
    Case(A.max_pool3d_with_indices_backward.default, _max_pool3d,
         (_set("indices", 64), ("self", torch.randn(1, 1, 4, 4, 4), "grad_output"))),
    Case(A.adaptive_max_pool2d_backward.default, _adaptive2d,
         (_set("indices", 25), ("self", torch.randn(1, 2, 2, 2), "indices"))),
    Case(A.adaptive_max_pool3d_backward.default, _adaptive3d, (_set("indices", _BIG),)),
    Case(A.fractional_max_pool2d.default, _fractional2d,
         (("random_samples", torch.full((1, 2, 2), 1.0)), ("random_samples", torch.full((1, 2, 2), float("nan"))),
          ("random_samples", torch.rand(1, 1, 2)))),
    Case(A.fractional_max_pool3d.default, _fractional3d, (("random_samples", torch.full((1, 2, 3), -1e30)),)),
    Case(A._embedding_bag.default, _bag,
         (("offsets", T([0, 9])), ("offsets", T([0, -1000])), ("offsets", T([4, 0])), _set("indices", 10))),
    Case(A._embedding_bag_forward_only.default, lambda: _bag(last=True), (("offsets", T([0, 4, 6])),)),
    Case(A.embedding_bag.default, lambda: (_bag()[0][:8], {}), (("offsets", T([0, 1000])),)),
    Case(A._embedding_bag_backward.default, _bag_backward(1),
         (_set("indices", 1000), _set("offset2bag", 5), _set("bag_size", 1000), ("num_weights", 3, "indices"))),
    Case(A._embedding_bag_backward.default, _bag_backward(2), (_set("maximum_indices", 10),)),
    Case(A._embedding_bag_dense_backward.default, _bag_dense_backward,
         (("offset2bag", T([], dtype=torch.int64)), _set("offset2bag", 7), _set("indices", -1))),
    Case(A._embedding_bag_per_sample_weights_backward.default, _bag_psw_backward,
         (_set("indices", 1000), ("grad", torch.ones(2, 2)), ("offsets", T([0, 1000])))),
    Case(A.embedding_dense_backward.default, _embedding_dense_backward,
         (_set("indices", 5), _set("indices", -1), ("num_weights", 2, "indices"))),
    Case(A.embedding_backward.default, lambda: ((*_embedding_dense_backward()[0], False), {}), (_set("indices", _BIG),)),
    Case(A.segment_reduce.default, _segment,
         (("lengths", T([1, 2, 3])), ("lengths", T([-1, 3, 3])), ("lengths", T([1, 2, _BIG])))),
    Case(A.segment_reduce.default, lambda: _segment(offsets=True),
         (("offsets", T([0, 1, 3, 1000])), ("offsets", T([0, 3, 1, 5])))),
    Case(A._segment_reduce_backward.default, _segment_backward, (("lengths", T([1, 2, 1000])), ("grad", torch.ones(2)))),
    Case(A._pad_packed_sequence.default, _pad_packed,
         (("batch_sizes", T([3, 2, 1, -1])), ("batch_sizes", T([1, 2, 3, 1])), ("batch_sizes", T([3, 2, 1, 1000])))),
    Case(A._pack_padded_sequence_backward.default, _pack_padded_backward,
         (("batch_sizes", T([3, 2, 3, -1])), ("batch_sizes", T([5, 1, 1])))),
    Case(A.nll_loss_backward.default, _nll_backward, (_set("target", 5), _set("target", -1), ("weight", torch.ones(3)))),
    Case(A.nll_loss2d_backward.default, _nll2d_backward, (_set("target", 3),)),
    Case(A._ctc_loss.default, _ctc, (_set("targets", 5), _set("targets", -_BIG))),
    Case(A.ctc_loss.IntList, _ctc_public, (_set("targets", 1000),)),
    Case(A._ctc_loss_backward.default, _ctc_backward, (_set("targets", 1000),)),
    Case(A._fft_c2c.default, _fft, (("dim", [5]), ("dim", [1, 1]), ("normalization", 7))),
    Case(A._fft_r2c.default, lambda: _fft("r2c"), (("dim", [_BIG]),)),
    Case(A._fft_c2r.default, lambda: _fft("c2r"), (("last_dim_size", 1000), ("dim", [2]))),
    Case(P.fft_c2c.default, _prims_fft, (("dim", [-3]),)),
    Case(A._upsample_bilinear2d_aa.default, _aa, (("scales_h", 0.1), ("scales_w", 1e-5))),
    Case(A._upsample_bicubic2d_aa.default, _aa, (("scales_h", 0.1),)),
    Case(A._upsample_bilinear2d_aa_backward.default, _aa_backward,
         (("scales_w", 0.1), ("grad_output", torch.randn(1, 1, 4, 4)))),
    Case(A.grid_sampler_2d.default, _grid, (("interpolation_mode", 7), ("padding_mode", -1))),
    Case(A.grid_sampler_2d_backward.default, _grid_backward,
         (("grad_output", torch.randn(1, 1, 1, 1)), ("interpolation_mode", 9))),
    Case(A._unsafe_masked_index.default, _masked,
         (("indices", [T([0, 1, 2, 1000])]), ("mask", T([True] * 4), "indices"))),
    Case(A._unsafe_masked_index_put_accumulate.default, lambda: _masked(put=True),
         (("mask", T([True] * 4), "indices"),)),
    Case(A._grouped_mm.default, _grouped_mm,
         (("offs", T([3, 1000], dtype=torch.int32)), ("offs", T([5, 3], dtype=torch.int32)))),
    Case(A.div.Tensor_mode, _division, (("self", T([_MIN, 5, -7])),)),
    Case(A.div.Scalar_mode, lambda: _division(scalar=True), (("self", T([6, _MIN, 1])),)),
    Case(A.divide.Tensor_mode, _division, (("self", T([_MIN, 5, -7])),)),
    Case(P.div.default, lambda: ((T([6, 5, -7]), T([-1, 2, 3])), {}), (("self", T([_MIN, 5, -7])),)),
    Case(A.lcm.default, lambda: ((T([4, 6]), T([6, 4])), {}), (("self", T([_MIN, 2])), ("other", T([3, _MIN])))),
    Case(A.native_batch_norm.default, _batch_norm, (("weight", torch.ones(1)), ("running_mean", torch.zeros(2)))),
    Case(A.native_batch_norm_backward.default, _batch_norm_backward, (_shrink("save_mean", (1,)),)),
    Case(A.native_layer_norm.default, _layer_norm, (("weight", torch.ones(1)),)),
    Case(A.native_layer_norm_backward.default, _layer_norm_backward, (_shrink("mean", (1, 1)), _shrink("rstd", (2, 1)))),
    Case(A.native_group_norm.default, _group_norm, (("weight", torch.ones(2)),)),
    Case(A._weight_norm_interface.default, _weight_norm, (("g", torch.ones(1, 1)),)),
    Case(A._weight_norm_interface_backward.default, _weight_norm_backward, (_shrink("saved_norms", (1, 1)),)),
    Case(A._log_softmax_backward_data.default, _log_softmax_backward, ((*_shrink("output", (1, 8)), "grad_output"),)),
    Case(A._scaled_dot_product_flash_attention_for_cpu_backward.default, _sdpa_cpu_backward,
         (_shrink("logsumexp", (1, 2, 1)),)),
    Case(A.avg_pool2d_backward.default, _avg_pool_backward, (("grad_output", torch.randn(2, 1, 2, 2)),)),
    Case(A._adaptive_avg_pool2d_backward.default, _adaptive_avg_backward,
         (("self", torch.randn(1, 1, 4, 4), "grad_output"),)),
    Case(A._adaptive_avg_pool3d_backward.default, _adaptive_avg3d_backward,
         (("self", torch.randn(1, 1, 4, 4, 4), "grad_output"),)),
    Case(A.fractional_max_pool2d_backward.default, _fractional_backward, (("grad_output", torch.randn(1, 2, 4, 1)),)),
    *(
        Case(getattr(A, f"{kind}_pad{d}d_backward").default, _pad_backward(d),
             (("grad_output", torch.randn(1, 1, *[6] * (d - 1), 1)),))
        for kind in ("replication", "reflection")
        for d in (1, 2, 3)
    ),
    Case(A.unfold_backward.default, _unfold_backward, (("grad_in", torch.randn(1000, 2)),)),
    Case(A._pdist_backward.default, _pdist_backward,
         (_shrink("pdist", (2,)), (A._pdist_backward.default._schema.arguments[0].name, torch.randn(2)))),
    Case(A._cdist_backward.default, _cdist_backward,
         (_shrink("cdist", (2, 2)), (A._cdist_backward.default._schema.arguments[0].name, torch.randn(2, 2)))),
    Case(A.lu_unpack.default, _lu_unpack, (_shrink("LU_pivots", (1,)),)),
    # oneDNN's forward returns its workspace only with grad enabled, as replay runs a forward
    Case(A.mkldnn_rnn_layer.default, _rnn_layer, (("hidden_size", 64, "weight0"), ("hx_", torch.zeros(3, 4))),
         outputs=3, grad=True),
    Case(A.mkldnn_rnn_layer_backward.default, _rnn_layer_backward,
         (_shrink("workspace", (100,)), ("hidden_size", 16, "weight1"))),
]  # fmt: skip

# Ops no CPU replay can run (GPU kernels, composites of nested tensors): their checks are called directly.
DIRECT = [
    Case(
        A._scaled_dot_product_flash_attention_backward.default,
        lambda: ((*(torch.randn(1, 2, 4, 8) for _ in range(5)), torch.randn(1, 2, 4), T([]), T([]), 4, 4, 0.0,
                  False, T(0), T(0)), {}),
        (("cum_seq_q", T([0, 2, 4])),),
    ),
    Case(A.max_pool2d_backward.default,
         lambda: ((torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False), {}),
         (("grad_output", torch.randn(1, 1, 3, 2)),)),
]  # fmt: skip
