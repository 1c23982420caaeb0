"""Every built-in rule against the real CPU kernel (differential tests).

Each entry of ``SAMPLES`` names a built-in rule's op and inputs covering its
branches; ``md.verify_rule`` runs the op on the real tensors and on
MetaTensors and compares shape, dtype, strides, storage offset and aliasing.
A new rule in ``metadispatch/rules/`` needs an entry here (the last test
enforces it).
"""

import subprocess
import sys

import pytest
import torch

import metadispatch as md
from metadispatch.core import registry
from metadispatch.spec.schema import op_name

aten = torch.ops.aten


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _bn(dtype, training):
    c = 4
    return (
        _x(3, c, 5, dtype=dtype),
        _x(c, dtype=dtype),
        _x(c, dtype=dtype),
        torch.zeros(c, dtype=dtype),
        torch.ones(c, dtype=dtype),
        training,
        0.1,
        1e-5,
    )


def _unpool(*shape, memory_format=torch.contiguous_format):
    x = _x(*shape).to(memory_format=memory_format)
    y, i = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    return (y, i, list(shape[-2:]))


# A 4-d tensor contiguous, channels-last, or permuted (neither).
_FORMATS = ("contiguous", "channels_last", "permuted")


def _laid_out(fmt):
    if fmt == "permuted":
        return _x(5, 2, 4, 3).permute(1, 2, 0, 3)
    layout = torch.channels_last if fmt == "channels_last" else torch.contiguous_format
    return _x(2, 4, 5, 3).contiguous(memory_format=layout)


def _gn_backward(x, grad, mask=(True, True, True)):
    """native_group_norm_backward's arguments for input ``x`` and output gradient ``grad``, 2 groups.

    The statistics come from a contiguous copy: torch 2.13's forward refuses
    a transposed 3-d input that its backward takes."""
    n, c, hxw, w = x.shape[0], x.shape[1], x[0, 0].numel(), _x(x.shape[1])
    _, mean, rstd = aten.native_group_norm(x.contiguous(), w, None, n, c, hxw, 2, 1e-5)
    return (grad, x, mean, rstd, w, n, c, hxw, 2, list(mask))


def _ln_backward(x, grad, mask):
    """native_layer_norm_backward's arguments, normalising the last dimension of ``x``."""
    w, b = _x(x.shape[-1]), _x(x.shape[-1])
    _, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    return (grad, x, [x.shape[-1]], mean, rstd, w, b, list(mask))


def _norm_backward(kind, x_fmt, grad_fmt, training, mask=(True, True, True)):
    x, grad, w = _laid_out(x_fmt), _laid_out(grad_fmt), _x(4)
    if kind == "group":
        return _gn_backward(x, grad, mask)
    rm, rv = torch.zeros(4), torch.ones(4)
    _, mean, invstd = aten.native_batch_norm(x, w, None, rm, rv, training, 0.1, 1e-5)
    return (grad, x, w, rm, rv, mean, invstd, training, 1e-5, list(mask))


_DT = (torch.float32, torch.bfloat16, torch.float16)
_CL = torch.channels_last


def _offs(*ends):
    return torch.tensor(ends, dtype=torch.int32)


def _c(*shape):
    return torch.randn(*shape, dtype=torch.complex64)


def _bag(mode, dtype=torch.float32, last=False, padding_idx=-1):
    weight, indices = _x(10, 3, dtype=dtype), torch.tensor([1, 2, 4, 5, 4, 9])
    offsets = torch.tensor([0, 2, 4, 6] if last else [0, 2, 4])
    return (weight, indices, offsets, False, mode, False, None, last, padding_idx)


# Note [Embedding-bag storages]: the CPU kernel's auxiliary outputs, by mode,
# fast path (bfloat16 is on it), include_last_offset and padding_idx
_BAGS = [
    _bag(m, d, last, pad)
    for m in (0, 1, 2)
    for d in (torch.float32, torch.bfloat16)
    for last in (False, True)
    for pad in (-1, 1)
]


def _conv(shape, fmt, weight_fmt=torch.contiguous_format, transposed=False, groups=1):
    x = _x(*shape).contiguous(memory_format=fmt)
    k = len(shape) - 2
    cin = shape[1]
    w_shape = (cin, 4 // groups) if transposed else (4, cin // groups)
    w = _x(*w_shape, *([3] * k)).contiguous(memory_format=weight_fmt)
    return (x, w, None, [1] * k, [0] * k, [1] * k, transposed, [0] * k, groups)


_CONV = [
    _conv((2, 4, 7, 7), f, wf) for f in (torch.contiguous_format, _CL) for wf in (torch.contiguous_format, _CL)
] + [
    _conv((2, 4, 5, 5, 5), torch.channels_last_3d),
    _conv((2, 4, 9), torch.contiguous_format),
    _conv((2, 4, 7, 7), _CL, transposed=True),
    _conv((2, 4, 7, 7), _CL, groups=4),
]


def _conv_backward(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = aten.convolution.default(x, w, None, stride, padding, dilation, transposed, output_padding, groups)
    return (
        torch.randn_like(out),
        x,
        w,
        [w.shape[1] if transposed else w.shape[0]],
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        [True, True, True],
    )


SAMPLES = {
    # rules/attention.py: a CPU device gets torch's own choice (logical CUDA: tests/gpu/test_sdpa_choice.py)
    aten._fused_sdp_choice.default: [(_x(2, 4, 8, 16, dtype=d),) * 3 for d in _DT]
    + [(_x(4, 8, 16),) * 3, (_x(2, 4, 8, 16),) * 3 + (None, 0.5)],
    # rules/convolution.py: the memory format C++'s backend choice gives
    aten.convolution.default: _CONV,
    aten._convolution.default: [c + (False, False, True, True) for c in _CONV],
    aten.convolution_backward.default: [_conv_backward(*c) for c in _CONV],
    aten.native_layer_norm.default: [(_x(3, 4, 5, dtype=d), [5], _x(5, dtype=d), None, 1e-5) for d in _DT]
    + [(_x(3, 4, 5, dtype=d), [5], _x(5), _x(5), 1e-5) for d in _DT[1:]],  # mixed: autocast
    # channels-last 4-d and 5-d (torch 2.14's meta says contiguous), a permuted
    # input that is neither (contiguous), and a 3-d one
    aten.native_group_norm.default: [
        (x, _x(4), _x(4), 2, 4, x[0, 0].numel(), 2, 1e-5)
        for x in (
            _x(2, 4, 3, 3).to(memory_format=torch.channels_last),
            _x(2, 4, 1, 3).to(memory_format=torch.channels_last),
            _x(2, 4, 2, 3, 3).to(memory_format=torch.channels_last_3d),
            _x(2, 3, 3, 4).permute(0, 3, 1, 2),
            _x(2, 4, 5),
        )
    ],
    aten.native_batch_norm.default: [_bn(d, t) for d in _DT for t in (True, False)],
    aten._native_batch_norm_legit.default: [_bn(d, t) for d in _DT for t in (True, False)],
    aten._native_batch_norm_legit_functional.default: [_bn(d, True) for d in _DT],
    # (eval mode without running stats crashes the real CPU kernel)
    aten._native_batch_norm_legit.no_stats: [_bn(d, True)[:3] + (True, 0.1, 1e-5) for d in _DT],
    aten._batch_norm_with_update.default: [_bn(d, True)[:5] + (0.1, 1e-5) for d in _DT]
    + [(_x(3, 4, 5, dtype=d),) + _bn(torch.float32, True)[1:5] + (0.1, 1e-5) for d in _DT[1:]],
    # Note [Norm gradients follow the input]: the input's layout, not the gradient's
    aten.native_batch_norm_backward.default: [
        _norm_backward("batch", xf, gf, t) for xf in _FORMATS for gf in _FORMATS for t in (True, False)
    ]
    # Note [Batch-norm gradients the mask leaves out]: undefined where the mask is off
    + [
        _norm_backward("batch", _FORMATS[0], _FORMATS[0], t, mask)
        for t in (True, False)
        for mask in ([False, True, True], [True, False, False], [False, False, False])
    ],
    aten.native_group_norm_backward.default: [
        _norm_backward("group", xf, gf, True, mask)
        for xf in _FORMATS[:2]  # the CPU kernel refuses an input in neither layout
        for gf in _FORMATS
        for mask in ([True, True, True], [True, False, False])
    ]
    # a transposed 3-d input (a diffusers attention block's group norm; torch
    # 2.14's CPU kernel takes it) and a contiguous one, each gradient laid out
    # alike or not (the 4-d pairings are in the grid above)
    + [
        _gn_backward(x, g)
        for x, g in (
            (_x(2, 5, 4).mT, _x(2, 5, 4).mT),
            (_x(2, 5, 4).mT, _x(2, 4, 5)),
            (_x(2, 4, 5), _x(2, 5, 4).mT),
        )
    ],
    # Note [Layer-norm gradients are contiguous]: whatever the gradient's layout (Swin's permuted one)
    aten.native_layer_norm_backward.default: [
        _ln_backward(_laid_out(xf), _laid_out(gf), mask)
        for xf in _FORMATS
        for gf in _FORMATS
        for mask in ([True, True, True], [True, False, False], [False, True, True])
    ],
    # rules/activations.py: the CPU kernel's full buffer (a GPU's is empty: test_logical_gpu_composites.py)
    aten.log_sigmoid_forward.default: [(_x(3, 4),), (_x(4, 3).t(),), (_x(5, dtype=torch.float64),)],
    # rules/grouped_mm.py: the CPU kernel's dtypes, and its output padded to 16 bytes
    aten._grouped_mm.default: [
        (_x(6, 8, dtype=d), _x(2, 8, n, dtype=d), _offs(3, 6)) for d in _DT for n in (4, 8, 12, 16)
    ]
    + [
        (_x(6, 8), _x(2, 8, 8).mT, _offs(3, 6)),
        (_x(2, 6, 8), _x(2, 8, 8)),
        (_x(2, 6, 8, dtype=torch.bfloat16), _x(2, 8, 12, dtype=torch.bfloat16)),
        (_x(2, 6, 8), _x(8, 12), _offs(4, 8)),
        (_x(6, 8), _x(8, 12), _offs(4, 8)),
        (_x(6, 8)[:, :6], _x(2, 6, 8), _offs(3, 6)),
        (_x(8, 8).t(), _x(2, 8, 8), _offs(3, 6)),
    ],
    # Note [Device-hinted meta kernels] (rules/device_hinted.py)
    aten._fft_c2c.default: [(_c(5, 6, 7), [0, 2], 0, True), (_c(5, 6, 7).mT, [2], 1, False)],
    aten._fft_r2c.default: [
        (_x(5, 6, 7), [0, 1, 2], 0, True),
        (_x(5, 6, 7), [0, 2], 0, False),
        (_x(5, 6, 7).transpose(0, 2), [1], 2, True),
    ],
    aten._fft_c2r.default: [(_c(5, 6, 4), [0, 2], 0, 7), (_c(5, 6, 4), [1], 0, 11)],
    aten._linalg_svd.default: [
        (_x(3, 5),),
        (_x(2, 5, 3), True),
        (_x(0, 3), True),
        (_x(4, 4), False, False),
        (_c(3, 2),),
    ],
    aten.linalg_eig.default: [(_x(5, 5),), (_x(2, 3, 3, dtype=torch.float64),), (_c(4, 4),)],
    aten.nonzero_static.default: [((torch.tensor([[1.0, 0.0], [0.0, 2.0]]),), {"size": s}) for s in (1, 2, 5)],
    aten._embedding_bag.default: _BAGS,
    aten._embedding_bag_forward_only.default: _BAGS,
    aten.pixel_shuffle.default: [(_x(1, 8, 3, 3), 2), (_x(2, 8, 3, 3).to(memory_format=_CL), 2)],
    aten.reflection_pad2d.default: [
        (_x(1, 2, 4, 4), [1, 1, 2, 2]),
        (_x(2, 3, 4, 4).to(memory_format=_CL), [1, 2, 0, 1]),
    ],
    aten.replication_pad2d.default: [
        (_x(1, 2, 4, 4), [1, 1, 2, 2]),
        (_x(2, 3, 4, 4).to(memory_format=_CL), [1, 2, 0, 1]),
    ],
    aten.histc.default: [(_x(10), 5, 0.0, 1.0), (_x(3, 4, dtype=torch.float64), 7)],
    # Note [Reduced losses keep the loss's storage]: each reduction, broadcasting, promotion
    aten.mse_loss.default: [(_x(6, 4), _x(6, 4), r) for r in (0, 1, 2)]
    + [(_x(6, 4), _x(4), 1), (_x(1, 4), _x(6, 4, dtype=torch.float64), 2)],
    aten.smooth_l1_loss.default: [(_x(6, 4), _x(6, 4), r, b) for r in (0, 1, 2) for b in (0.0, 1.0)],
    aten.binary_cross_entropy.default: [
        (_x(6, 4).sigmoid(), _x(6, 4).sigmoid(), w, r) for w in (None, _x(4).abs()) for r in (0, 1)
    ],
    aten.soft_margin_loss.default: [(_x(6, 4), _x(6, 4).sign(), r) for r in (0, 1, 2)],
    aten.max_unpool2d.default: [
        _unpool(2, 3, 4, 4),
        _unpool(2, 3, 4, 6, memory_format=_CL),
        _unpool(3, 4, 4),
        _unpool(1, 2, 2, 4, memory_format=_CL),
    ],
    aten.geqrf.default: [(_x(5, 3),), (_x(2, 3, 5, dtype=torch.float64),), (_c(4, 4),)],
    aten.histogram.bin_ct: [
        ((_x(10),), {"bins": 4}),
        ((_x(3, 4), 5), {"range": [0.0, 1.0], "weight": _x(3, 4), "density": True}),
    ],
    aten.histogram.bins_tensor: [
        (_x(10), torch.tensor([0.0, 1.0, 3.0])),
        ((_x(2, 5), torch.tensor([0.0, 1.0])), {"weight": _x(2, 5)}),
    ],
    aten._histogramdd_bin_edges.default: [
        (_x(6, 3), [2, 3, 4]),
        ((_x(6, 2), [2, 1]), {"range": [0.0, 1.0, -1.0, 1.0]}),
    ],
    aten._histogramdd_from_bin_cts.default: [(_x(6, 3), [2, 3, 4]), ((_x(2, 6, 2), [2, 1]), {"weight": _x(2, 6)})],
    aten._histogramdd_from_bin_tensors.default: [
        (_x(6, 2), [torch.tensor([0.0, 1.0]), torch.tensor([-1.0, 0.0, 2.0])])
    ],
    aten.index.Tensor: [
        (_x(4, 3), [torch.tensor([0, 2])]),
        (_x(4, 3, 5), [None, torch.tensor([[0, 1], [2, 0]])]),
        (_x(4, 3, 5).transpose(0, 2), [torch.tensor([1]), None, torch.tensor([0])]),
        (_x(4, 3), [torch.tensor([-4, 3])]),
    ],
    # rules/data_dependent.py: known indices checked (Note [Known indices out of range])
    aten.index_select.default: [(_x(4, 3), 0, torch.tensor([0, 3, 1])), (_x(4, 3).t(), -1, torch.tensor([2]))],
    aten.embedding.default: [(_x(5, 3), torch.tensor([[0, 4], [2, 2]])), (_x(5, 3), torch.tensor([1, 0]), 0)],
    # rules/scaled_mm.py: a CPU keeps torch's meta answer (a logical GPU's SM: test_scaled_mm_refused_below_sm89)
    aten._scaled_mm.default: [
        (_x(16, 32, dtype=torch.float8_e4m3fn), _x(16, 32, dtype=torch.float8_e4m3fn).t(), _x(()), _x(())),
        (
            (_x(16, 32, dtype=torch.float8_e4m3fn), _x(16, 32, dtype=torch.float8_e4m3fn).t(), _x(()), _x(())),
            {"out_dtype": torch.bfloat16},
        ),
    ],
    # rules/random_fill.py: write self, return it (Note [Random fills without dynamo])
    aten.normal_.default: [(_x(3, 4, dtype=d), 1.0, 0.5) for d in _DT] + [(_x(4, 3).mT,), (_c(2, 3),)],
    aten.cauchy_.default: [(_x(3, 4, dtype=d),) for d in _DT] + [(_x(4, 3).mT, 1.0, 2.0)],
    aten.exponential_.default: [(_x(3, 4, dtype=d), 2.0) for d in _DT],
    aten.geometric_.default: [(_x(3, 4, dtype=d), 0.3) for d in _DT + (torch.int64, torch.uint8)],
    aten.log_normal_.default: [(_x(3, 4, dtype=d),) for d in _DT] + [(_x(4, 3).mT, 0.0, 1.0)],
}

# Arguments and dtypes each real in-place random fill refuses.
_REFUSED_FILLS = [
    (aten.normal_.default, (-1.0,), torch.float32),
    (aten.normal_.default, (), torch.int64),
    (aten.cauchy_.default, (0.0, 0.0), torch.float32),
    (aten.cauchy_.default, (), torch.complex64),
    (aten.exponential_.default, (0.0,), torch.float32),
    (aten.exponential_.default, (), torch.int32),
    (aten.geometric_.default, (1.0,), torch.float32),
    (aten.geometric_.default, (0.5,), torch.bool),
    (aten.log_normal_.default, (1.0, 0.0), torch.float32),
    (aten.log_normal_.default, (), torch.uint8),
]


@pytest.mark.parametrize("op", list(SAMPLES), ids=op_name)
def test_rules_builtin_matches_real_cpu_kernel(op):
    check = md.verify_rule(op, samples=SAMPLES[op])
    assert check.stages[op_name(op)] == "builtin"
    assert check.ok, str(check)


def test_rules_device_hinted_answers_for_the_logical_device():
    # torch's meta function for _linalg_svd knows CPU LAPACK returns Vh
    # column-major and cuSOLVER row-major; each logical device gets its own.
    a = torch.randn(2, 5, 3)
    vh = {d: torch.linalg.svd(md.to_meta(a, device=d), full_matrices=False)[2].stride() for d in ("cpu", "cuda")}
    assert vh["cpu"] == torch.linalg.svd(a, full_matrices=False)[2].stride() == (9, 1, 3)
    assert vh["cuda"] == (9, 3, 1)


def test_rules_index_boolean_mask_is_data_dependent():
    x = md.to_meta(torch.randn(4))
    with pytest.raises(md.DataDependentError, match="boolean-mask"):
        x[md.to_meta(torch.ones(4, dtype=torch.bool))]


@pytest.mark.parametrize(
    "op, args, dtype", _REFUSED_FILLS, ids=lambda v: op_name(v) if isinstance(v, torch._ops.OpOverload) else str(v)
)
def test_rules_random_fill_refuses_what_the_cpu_kernel_refuses(op, args, dtype):
    if op is aten.normal_.default and args:
        args = (0.0,) + args  # mean, std
    with pytest.raises((RuntimeError, NotImplementedError)):
        op(torch.zeros(3, dtype=dtype), *args)
    with pytest.raises(RuntimeError):
        op(md.to_meta(torch.zeros(3, dtype=dtype)), *args)


# What the real CPU _grouped_mm refuses, and so must the rule.
_REFUSED_GROUPED_MM = {
    "unaligned_stride": (_x(6, 8), _x(2, 8, 6), _offs(3, 6)),
    "out_dtype": (_x(6, 8, dtype=torch.bfloat16), _x(2, 8, 8, dtype=torch.bfloat16), _offs(3, 6), None, torch.float32),
    "offsets_int64": (_x(6, 8), _x(2, 8, 8), torch.tensor([3, 6])),
    "no_offsets": (_x(6, 8), _x(2, 8, 8)),
    "offsets_with_3d": (_x(2, 6, 8), _x(2, 8, 8), _offs(3, 6)),
    "mixed_dtypes": (_x(6, 8), _x(2, 8, 8, dtype=torch.bfloat16), _offs(3, 6)),
    "float64": (_x(6, 8, dtype=torch.float64), _x(2, 8, 8, dtype=torch.float64), _offs(3, 6)),
    "bias": (_x(6, 8), _x(2, 8, 8), _offs(3, 6), _x(2, 8)),
    "contraction": (_x(6, 8), _x(2, 4, 8), _offs(3, 6)),
    "group_count": (_x(6, 8), _x(2, 8, 8), _offs(3, 4, 6)),
    "expanded": (_x(1, 1).expand(6, 8), _x(2, 8, 8), _offs(3, 6)),
}


@pytest.mark.parametrize("case", sorted(_REFUSED_GROUPED_MM))
def test_rules_grouped_mm_refuses_what_the_cpu_kernel_refuses(case):
    args = _REFUSED_GROUPED_MM[case]
    with pytest.raises(RuntimeError) as real:
        aten._grouped_mm(*args)
    with pytest.raises(RuntimeError) as meta:
        aten._grouped_mm(*[md.to_meta(a) if isinstance(a, torch.Tensor) else a for a in args])
    # the same message, up to how C++ and Python spell dtypes and sizes
    assert str(real.value).split("got")[0] in str(meta.value)


# Collectives need a process group to run for real: tests/world/test_distributed.py
# checks their rules against real gloo runs (and wait_tensor against torch's).
_NEEDS_A_WORLD = ("c10d", "_c10d_functional")


# Rules that answer from a known value only: verify_rule's inputs are data.
_NEEDS_A_VALUE = {
    aten.masked_select.default,
    # answered from known lengths; tests/rules/test_packed_sequence.py against eager
    aten._pack_padded_sequence.default,
}

# cuDNN's kernels, which no CPU runs (and no GPU was lent): tests/gpu/test_cudnn_rnn.py
# checks them against torch's meta kernel and the eager CPU module's shapes.
_NEEDS_CUDNN = {
    aten._cudnn_rnn.default,
    aten._cudnn_rnn_backward.default,
    aten._cudnn_rnn_flatten_weight.default,
    aten._cudnn_init_dropout_state.default,
}


@pytest.mark.parametrize(
    "x, mask",
    [
        (_x(4, 3), torch.tensor([True, False, True])),
        (_x(3), torch.tensor([[True, False, True], [False, False, True]])),
        (_x(2, 1, 3).mT, torch.tensor([[True], [False], [True]])),
    ],
)
def test_rules_masked_select_with_a_known_mask_matches_real(x, mask):
    real = torch.masked_select(x, mask)
    with md.MetaMode() as mode:
        ours = torch.masked_select(mode.from_tensor(x), mode.from_scope(mask))  # the mask: a known value
    assert (ours.shape, ours.stride(), ours.dtype, ours.device) == (real.shape, real.stride(), real.dtype, real.device)


# CUDA-only kernels whose outputs a real GPU showed: tests/test_real_gpu.py
# compares them with one where CUDA exists; the test below holds the rest of
# their outputs to torch's meta kernel.
_ON_A_GPU = {aten._scaled_dot_product_efficient_attention.default, aten._efficient_attention_forward.default}
# Pinning needs an accelerator, which this host lacks: tests/rules/test_pinned.py.
_ON_A_GPU |= {aten._pin_memory.default, aten.is_pinned.default}


def test_rules_efficient_attention_seed_and_offset_are_cpu_scalars_on_a_logical_gpu():
    # Note [Efficient attention's seed and offset]: the rest is torch's meta answer.
    q = torch.empty(2, 4, 16, 8, device="meta")
    meta = aten._scaled_dot_product_efficient_attention.default(q, q, q, None, True)
    with md.MetaMode(device="cuda"):
        ours = aten._scaled_dot_product_efficient_attention.default(*(torch.empty(2, 4, 16, 8),) * 3, None, True)
    assert [(o.shape, o.dtype, o.stride()) for o in ours] == [(o.shape, o.dtype, o.stride()) for o in meta]
    assert [o.device.type for o in ours] == ["cuda", "cuda", "cpu", "cpu"]


def test_rules_every_builtin_rule_has_a_differential_test():
    have = set(SAMPLES) | _NEEDS_A_VALUE | _NEEDS_CUDNN | _ON_A_GPU
    assert {op for op in registry._BUILTIN if op.namespace not in _NEEDS_A_WORLD} <= have


def test_rules_histogram_has_no_kernel_off_cpu():
    # The real histogram kernels exist on CPU only.
    with pytest.raises(md.UnsupportedOpError):
        torch.histogram(md.to_meta(torch.randn(8), device="cuda"), bins=4)


def test_rules_random_fill_building_a_model_does_not_import_dynamo():
    # Note [Random fills without dynamo]: nn.init's normal_ under MetaMode
    # used to import torch._dynamo (about 1.5 s) through torch's reference.
    code = (
        "import sys, torch, metadispatch as md\n"
        "with md.MetaMode(device='cuda'):\n"
        "    torch.nn.Embedding(10, 8); torch.empty(4).geometric_(0.5)\n"
        "    torch.empty(4).exponential_(); torch.empty(4).log_normal_(); torch.empty(4).cauchy_()\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("gpu, allowed", [("a100-80gb", False), ("a100-40gb", False), ("l4", True), ("h100", True)])
def test_scaled_mm_refused_below_sm89(gpu, allowed):
    # rules/scaled_mm.py: CUDA's _scaled_mm_allowed_device, by the profile's SM.
    a, b = _x(16, 32, dtype=torch.float8_e4m3fn), _x(16, 32, dtype=torch.float8_e4m3fn).t()
    scale = torch.tensor(1.0)

    def step(a, b):
        return torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)

    if allowed:
        t = md.tracer(device="cuda", gpu=gpu)(step, a, b)
        assert t.calls[-1].output_metas[0].dtype == torch.bfloat16
    else:
        with pytest.raises(RuntimeError, match="only supported on CUDA devices with compute capability >= 9.0 or 8.9"):
            md.tracer(device="cuda", gpu=gpu)(step, a, b)
