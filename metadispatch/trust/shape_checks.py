"""Shape checks replay runs before a loaded trace's calls whose kernels trust their arguments' shapes.

Note [Shapes kernels trust]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Values are not the only thing a CPU kernel follows unchecked: many read one
argument by another's size.  ``native_batch_norm`` reads ``C`` entries of
``weight`` for an input of ``C`` channels, whatever ``weight`` holds; a
backward kernel reads its gradient by the forward's output size it works
out from ``self``; ``_pdist_backward`` reads ``n (n - 1) / 2`` distances.
A file can pair any shapes, and the meta kernels the budget runs first
(budget.py) accept them too -- on meta nothing is read.  Each check here
states the shape relation the kernel assumes and refuses a call that breaks
it, through the same registry and fence as the value checks
(value_checks.py; Note [Checking values before the call] in index_checks.py); its ops are
classed ``checked`` in trust/positions.py.  They were found with
``tools/position_probe.py``, which runs op_db's calls with each tensor
argument shrunk, under the guard-page allocator of the hostile tests: an op
it does not reach is not known to be safe this way (docs/trace-format.md,
"Not promised").
"""

from __future__ import annotations

import math

import torch

from .index_checks import Refusal, check, expect_shape, tensor_arg

__all__: list = []

_META = torch.device("meta")


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)


def _numel(a: dict, names, n: int, what: str) -> None:
    for name in names:
        t = a.get(name)
        if isinstance(t, torch.Tensor) and t.numel() != n:
            raise Refusal(name, f"has {t.numel()} elements where {n} are expected ({what})")


# -- norms: per-channel and per-row statistics


_CHANNEL = (
    "weight",
    "bias",
    "running_mean",
    "running_var",
    "save_mean",
    "save_invstd",
    "save_var",
    "save_var_transform",
    "mean",
    "invstd",
)


@check(
    "aten::native_batch_norm",
    "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training",
    "aten::_native_batch_norm_legit_functional",
    "aten::_batch_norm_with_update",
    "aten::_batch_norm_with_update_functional",
    "aten::_batch_norm_no_update",
    "aten::batch_norm",
    "aten::_batch_norm_impl_index",
    "aten::batch_norm_update_stats",
    "aten::batch_norm_elemt",
    "aten::instance_norm",
    "aten::native_batch_norm_backward",
    "aten::batch_norm_backward",
    "aten::_batch_norm_impl_index_backward",
    "aten::cudnn_batch_norm",
    "aten::cudnn_batch_norm_backward",
)
def _batch_norm(a: dict) -> None:
    inp = tensor_arg(a, "input")
    if inp.dim() < 2:
        raise Refusal("input", f"has {inp.dim()} dimensions; a batch norm's input has at least 2")
    channels = inp.shape[1]
    _numel(a, _CHANNEL, channels, f"one per channel of input {list(inp.shape)}")
    for name in ("grad_out", "grad_output"):
        expect_shape(a, name, inp.shape, " (input's)")


@check(
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::_fused_rms_norm",
    "aten::_fused_rms_norm_backward",
)
def _layer_norm(a: dict) -> None:
    inp, normalized = tensor_arg(a, "input"), list(a["normalized_shape"])
    k = len(normalized)
    if k == 0 or inp.dim() < k or list(inp.shape[-k:]) != normalized:
        raise Refusal("normalized_shape", f"is {normalized}, which input {list(inp.shape)} does not end with")
    rows, features = math.prod(inp.shape[:-k]), math.prod(normalized)
    _numel(a, ("weight", "bias"), features, f"one per feature of {normalized}")
    _numel(a, ("mean", "rstd"), rows, f"one per row of input {list(inp.shape)}")
    expect_shape(a, "grad_out", inp.shape, " (input's)")


@check("aten::native_group_norm", "aten::native_group_norm_backward")
def _group_norm(a: dict) -> None:
    inp, n, c, hxw, group = tensor_arg(a, "input"), a["N"], a["C"], a["HxW"], a["group"]
    if inp.numel() != n * c * hxw or group <= 0 or c % group:
        raise Refusal("input", f"has {inp.numel()} elements for N={n}, C={c}, HxW={hxw}, group={group}")
    _numel(a, ("weight", "bias"), c, "one per channel")
    _numel(a, ("mean", "rstd"), n * group, "one per group of each sample")
    expect_shape(a, "grad_out", inp.shape, " (input's)")


@check("aten::_weight_norm_interface", "aten::_weight_norm_interface_backward")
def _weight_norm(a: dict) -> None:
    v = tensor_arg(a, "v" if "v" in a else "saved_v")
    dim = a.get("dim", 0)
    n = v.shape[dim] if -v.dim() <= dim < v.dim() and dim != -1 else 1
    _numel(a, ("g", "saved_g", "saved_norms"), n, f"one per slice of v along dim {dim}")
    expect_shape(a, "grad_w", v.shape, " (v's)")


@check("aten::_softmax_backward_data", "aten::_log_softmax_backward_data", "aten::_masked_softmax_backward")
def _softmax_backward(a: dict) -> None:
    expect_shape(a, "grad_output", tensor_arg(a, "output").shape, " (output's)")


@check("aten::_scaled_dot_product_flash_attention_for_cpu_backward")
def _sdpa_cpu_backward(a: dict) -> None:
    q, k, v = tensor_arg(a, "query"), tensor_arg(a, "key"), tensor_arg(a, "value")
    if (
        q.dim() != 4
        or k.dim() != 4
        or k.shape[0] != q.shape[0]
        or k.shape[-1] != q.shape[-1]
        or q.shape[1] % max(k.shape[1], 1)
    ):
        raise Refusal("key", f"has shape {list(k.shape)}, which does not pair with query {list(q.shape)}")
    expect_shape(a, "value", (*k.shape[:-1], v.shape[-1]), " (key's batch, heads and length)")
    expect_shape(a, "out", (*q.shape[:-1], v.shape[-1]), " (query's rows, value's width)")
    expect_shape(a, "grad_out", (*q.shape[:-1], v.shape[-1]), " (out's)")
    expect_shape(a, "logsumexp", q.shape[:-1], " (one per query row)")


# -- backward of pooling, padding, sampling and unfolding: the forward's output shape


def _forward_shape(op, a: dict, *args) -> tuple:
    try:
        return tuple(op(_meta(tensor_arg(a, "self")), *args).shape)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise Refusal("self", f"does not fit the forward op's parameters ({str(e).splitlines()[0][:120]})") from None


_A = torch.ops.aten


@check("aten::avg_pool2d_backward", "aten::avg_pool3d_backward")
def _avg_pool_backward(a: dict) -> None:
    op = _A.avg_pool2d.default if len(a["kernel_size"]) == 2 else _A.avg_pool3d.default
    args = (a["kernel_size"], a["stride"], a["padding"], a["ceil_mode"], a["count_include_pad"], a["divisor_override"])
    expect_shape(a, "grad_output", _forward_shape(op, a, *args), " (the forward's output)")


@check("aten::max_pool2d_backward")
def _max_pool_backward(a: dict) -> None:
    args = (a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"])
    expect_shape(a, "grad_output", _forward_shape(_A.max_pool2d.default, a, *args), " (the forward's output)")


def _adaptive_backward(k: int):
    def check_planes(a: dict) -> None:
        grad, inp = tensor_arg(a, "grad_output"), tensor_arg(a, "self")
        if grad.dim() != inp.dim() or grad.dim() < k or grad.shape[:-k] != inp.shape[:-k]:
            raise Refusal("grad_output", f"has shape {list(grad.shape)}, which does not fit self {list(inp.shape)}")

    return check_planes


check("aten::_adaptive_avg_pool2d_backward")(_adaptive_backward(2))
check("aten::_adaptive_avg_pool3d_backward", "aten::adaptive_avg_pool3d_backward")(_adaptive_backward(3))


@check("aten::fractional_max_pool2d_backward", "aten::fractional_max_pool3d_backward")
def _fractional_backward(a: dict) -> None:
    inp, out = tensor_arg(a, "self"), list(a["output_size"])
    want = (*inp.shape[: inp.dim() - len(out)], *out)
    expect_shape(a, "grad_output", want, " (the forward's output)")
    expect_shape(a, "indices", want, " (the forward's output)")


def _pad_backward(forward):
    def check_padded(a: dict) -> None:
        expect_shape(a, "grad_output", _forward_shape(forward, a, a["padding"]), " (the forward's output)")

    return check_padded


for _kind in ("replication", "reflection"):
    for _d in (1, 2, 3):
        check(f"aten::{_kind}_pad{_d}d_backward")(_pad_backward(getattr(_A, f"{_kind}_pad{_d}d").default))


@check(
    "aten::grid_sampler_2d_backward", "aten::grid_sampler_3d_backward", "aten::_grid_sampler_2d_cpu_fallback_backward"
)
def _grid_backward(a: dict) -> None:
    inp, grid = tensor_arg(a, "input"), tensor_arg(a, "grid")
    if grid.dim() != inp.dim() or grid.shape[0] != inp.shape[0]:
        raise Refusal("grid", f"has shape {list(grid.shape)}, which does not fit input {list(inp.shape)}")
    expect_shape(a, "grad_output", (*inp.shape[:2], *grid.shape[1:-1]), " (the forward's output)")
    if a.get("interpolation_mode") not in (0, 1, 2) or a.get("padding_mode") not in (0, 1, 2):
        raise Refusal("interpolation_mode", "or padding_mode is not 0, 1 or 2")


@check("aten::unfold_backward")
def _unfold_backward(a: dict) -> None:
    try:
        want = torch.empty(list(a["input_sizes"]), device=_META).unfold(a["dim"], a["size"], a["step"]).shape
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise Refusal("input_sizes", f"does not unfold by these parameters ({str(e).splitlines()[0][:120]})") from None
    expect_shape(a, "grad_in", want, " (the unfolded input's)")


# -- distances, pivots


@check("aten::_pdist_backward")
def _pdist_backward(a: dict) -> None:
    x = tensor_arg(a, "self")
    if x.dim() != 2:
        raise Refusal("self", f"has {x.dim()} dimensions; pdist's input has 2")
    n = x.shape[0] * (x.shape[0] - 1) // 2
    for name in ("pdist", "grad", "grad_output"):  # torch 2.14 renamed grad to grad_output
        expect_shape(a, name, (n,), " (a distance per pair of rows)")


@check("aten::_cdist_backward")
def _cdist_backward(a: dict) -> None:
    x1, x2 = tensor_arg(a, "x1"), tensor_arg(a, "x2")
    if x1.dim() < 2 or x1.dim() != x2.dim() or x1.shape[:-2] != x2.shape[:-2] or x1.shape[-1] != x2.shape[-1]:
        raise Refusal("x2", f"has shape {list(x2.shape)}, which does not pair with x1 {list(x1.shape)}")
    want = (*x1.shape[:-1], x2.shape[-2])
    for name in ("cdist", "grad", "grad_output"):  # torch 2.14 renamed grad to grad_output
        expect_shape(a, name, want, " (a distance per pair of rows)")


@check("aten::lu_unpack")
def _lu_unpack(a: dict) -> None:
    lu = tensor_arg(a, "LU_data")
    if lu.dim() < 2:
        raise Refusal("LU_data", f"has {lu.dim()} dimensions; an LU factorisation has at least 2")
    expect_shape(a, "LU_pivots", (*lu.shape[:-2], min(lu.shape[-2:])), " (a pivot per row of the factorisation)")


# -- oneDNN's LSTM layer: weights, states and workspace by hidden_size


_LSTM = 2  # the only mode oneDNN's layer runs (torch's RNN modes: 0 relu, 1 tanh, 2 LSTM, 3 GRU)


def _rnn_shapes(a: dict, weights: tuple) -> tuple:
    inp, hidden = tensor_arg(a, "input"), a["hidden_size"]
    if a.get("mode") != _LSTM:
        raise Refusal("mode", f"is {a.get('mode')}; oneDNN's layer runs LSTMs (mode 2) only")
    if inp.dim() != 3 or hidden <= 0 or list(a.get("batch_sizes") or ()):
        raise Refusal("input", f"has shape {list(inp.shape)} (with hidden_size={hidden}); it is 3-d and unpacked")
    steps, batch = inp.shape[0], inp.shape[1]  # the layer gets (steps, batch, features) whatever batch_first says
    w_in, w_hidden, b_in, b_hidden = weights
    expect_shape(a, w_in, (4 * hidden, inp.shape[2]), f" (4 x hidden_size={hidden} by the input's width)")
    expect_shape(a, w_hidden, (4 * hidden, hidden), f" (4 x hidden_size={hidden} by hidden_size)")
    if a.get("has_biases"):
        _numel(a, (b_in, b_hidden), 4 * hidden, f"4 x hidden_size={hidden}")
    return steps, batch, hidden


@check("aten::mkldnn_rnn_layer")
def _rnn_layer(a: dict) -> None:
    _, batch, hidden = _rnn_shapes(a, ("weight0", "weight1", "weight2", "weight3"))
    for name in ("hx_", "cx_"):
        expect_shape(a, name, (batch, hidden), f" (batch by hidden_size={hidden})")


_WORKSPACES: dict = {}  # the forward's arguments -> bytes of the workspace it returns


@check("aten::mkldnn_rnn_layer_backward")
def _rnn_layer_backward(a: dict) -> None:
    steps, batch, hidden = _rnn_shapes(a, ("weight1", "weight2", "weight3", "weight4"))
    out = (steps, batch, hidden)
    for name in ("output", "grad_output"):
        expect_shape(a, name, out, " (the layer's output)")
    for name in ("hx_", "cx_tmp", "hy_", "cy_", "grad_hy", "grad_cy"):
        expect_shape(a, name, (batch, hidden), f" (batch by hidden_size={hidden})")
    need = _workspace_bytes(a)
    ws = tensor_arg(a, "workspace")
    if ws.numel() * ws.element_size() < need or not ws.is_contiguous():
        raise Refusal("workspace", f"holds {ws.numel() * ws.element_size()} bytes; the layer's backward reads {need}")


def _workspace_bytes(a: dict) -> int:
    """Bytes of the workspace oneDNN's forward returns for these shapes: measured once per shape, by
    running the forward on zeros (oneDNN sizes it; no formula outside oneDNN says how), with grad
    enabled, the only way it returns one (Note [Grad mode in replay] in execution/program.py)."""
    inp = tensor_arg(a, "input")
    key = (tuple(inp.shape), inp.dtype, a["hidden_size"], a["num_layers"], a["bidirectional"], a["batch_first"])
    if key not in _WORKSPACES:
        w1, w2 = tensor_arg(a, "weight1"), tensor_arg(a, "weight2")
        hx = tensor_arg(a, "hx_")
        zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype)  # noqa: E731
        with torch.enable_grad():
            *_, ws = torch.ops.aten.mkldnn_rnn_layer.default(
                zeros(inp), zeros(w1), zeros(w2), torch.zeros(4 * a["hidden_size"], dtype=w1.dtype),
                torch.zeros(4 * a["hidden_size"], dtype=w1.dtype), zeros(hx), zeros(hx), False, [], _LSTM,
                a["hidden_size"], a["num_layers"], True, a["bidirectional"], a["batch_first"], True,
            )  # fmt: skip
        _WORKSPACES[key] = ws.numel() * ws.element_size()
    return _WORKSPACES[key]
