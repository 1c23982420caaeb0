"""Checks of the index-like values a loaded trace hands kernels that follow them, one per op family.

Registered with index_checks.py (Note [Checking values before the call]):
each derives what the kernel will index from the call's other arguments --
the plane ``self`` gives ``max_pool2d``'s indices, ``num_weights`` an
embedding's, the data's length a segment's lengths, ``log_probs``' classes
a CTC loss's targets -- and raises :class:`~.index_checks.Refusal` naming
the argument and the value.  The ops are those classed ``checked`` in
trust/positions.py's table of values; their kernels were caught following
such values by the guard-page allocator of the tests.
"""

from __future__ import annotations

import math

import torch

from .index_checks import Refusal, check, dims_arg, expect_shape, int_arg, non_decreasing, tensor_arg, within

__all__: list = []


# -- pooling: indices into the plane of ``self``


def _pool_indices(a: dict, spatial: int) -> None:
    grad, inp, idx = tensor_arg(a, "grad_output"), tensor_arg(a, "self"), int_arg(a, "indices")
    if idx is None or inp.dim() < spatial or grad.dim() != inp.dim():
        raise Refusal("self", f"has {inp.dim()} dimensions, grad_output {grad.dim()}; they must agree")
    expect_shape(a, "indices", grad.shape, " (grad_output's)")
    if grad.shape[:-spatial] != inp.shape[:-spatial]:
        raise Refusal("grad_output", f"has planes {list(grad.shape[:-spatial])}, self {list(inp.shape[:-spatial])}")
    plane = math.prod(inp.shape[-spatial:])
    within(a, "indices", 0, plane, f" (the {'x'.join(map(str, inp.shape[-spatial:]))} plane of self)")


@check("aten::max_pool2d_with_indices_backward", "aten::adaptive_max_pool2d_backward")
def _pool2d(a: dict) -> None:
    _pool_indices(a, 2)


@check("aten::max_pool3d_with_indices_backward", "aten::adaptive_max_pool3d_backward")
def _pool3d(a: dict) -> None:
    _pool_indices(a, 3)


@check("aten::fractional_max_pool2d", "aten::fractional_max_pool3d")
def _fractional(a: dict) -> None:
    inp, s = tensor_arg(a, "self"), tensor_arg(a, "random_samples")
    k = len(a["output_size"])
    batch = tuple(inp.shape[:-k]) if inp.dim() == k + 2 else (1, *inp.shape[:-k])
    expect_shape(a, "random_samples", (*batch, k), " (a sample per plane and dimension)")
    if not s.dtype.is_floating_point:
        raise Refusal("random_samples", f"holds {s.dtype} values; samples are floats in [0, 1)")
    if s.numel() and not bool(((s >= 0) & (s < 1)).all()):
        raise Refusal("random_samples", "holds a value outside [0, 1) (or NaN)")


# -- embeddings: indices into the table, offsets into the indices


def _bags(a: dict, num_weights: int, bags: int | None) -> int:
    """Checks the indices, offsets and offset2bag of an embedding bag; returns the number of indices."""
    indices = dims_arg(a, "indices", 1)
    n = indices.shape[0]
    within(a, "indices", 0, num_weights, f" (the {num_weights} rows of the table)")
    offsets = a.get("offsets")
    if offsets is not None:
        offsets = dims_arg(a, "offsets", 1)
        within(a, "offsets", 0, n + 1, f" (the {n} indices)")
        non_decreasing(a, "offsets", offsets)
        if bags is None:
            bags = offsets.shape[0] - bool(a.get("include_last_offset"))
        if n and offsets.numel() and int((offsets <= n - 1).sum()) > bags:
            raise Refusal("offsets", f"starts more bags than the {bags} the call holds")
    o2b = a.get("offset2bag")
    if o2b is not None and o2b.numel():
        expect_shape(a, "offset2bag", (n,), " (a bag per index)")
        within(a, "offset2bag", 0, max(bags or 0, 0), f" (the {bags} bags)")
    psw = a.get("per_sample_weights")
    if psw is not None:
        expect_shape(a, "per_sample_weights", indices.shape, " (a weight per index)")
    mode = a.get("mode", 0)
    if mode not in (0, 1, 2):
        raise Refusal("mode", f"is {mode}; it is 0 (sum), 1 (mean) or 2 (max)")
    pad = a.get("padding_idx")
    if pad is not None and not -1 <= pad < num_weights:
        raise Refusal("padding_idx", f"is {pad}, outside [-1, {num_weights})")
    return n


@check("aten::_embedding_bag", "aten::_embedding_bag_forward_only", "aten::embedding_bag")
def _embedding_bag(a: dict) -> None:
    weight = dims_arg(a, "weight", 2)
    if a.get("offsets") is None:
        raise Refusal("offsets", "is missing")
    _bags(a, weight.shape[0], None)


def _bag_backward(a: dict, need_offset2bag: bool) -> None:
    grad = dims_arg(a, "grad", 2)
    bags, num_weights = grad.shape[0], int(a["num_weights"])
    if a.get("sparse"):
        raise Refusal("sparse", "is true: the gradient would be a sparse tensor")
    n = _bags(a, num_weights, bags)
    o2b = a.get("offset2bag")
    if need_offset2bag and n and (o2b is None or o2b.numel() != n):
        raise Refusal("offset2bag", f"has {0 if o2b is None else o2b.numel()} entries for {n} indices")
    expect_shape(a, "bag_size", (bags,), " (a size per bag)")
    within(a, "bag_size", 0, n + 1, f" (the {n} indices)")
    if a.get("mode") == 2:
        expect_shape(a, "maximum_indices", grad.shape, " (grad's)")
        within(a, "maximum_indices", -1, num_weights, f" (the {num_weights} rows of the table)")


@check("aten::_embedding_bag_backward")
def _embedding_bag_backward(a: dict) -> None:
    _bag_backward(a, need_offset2bag=False)  # the op builds offset2bag from offsets when it is empty


@check("aten::_embedding_bag_dense_backward")
def _embedding_bag_dense_backward(a: dict) -> None:
    _bag_backward(a, need_offset2bag=True)


@check("aten::_embedding_bag_per_sample_weights_backward")
def _per_sample_weights_backward(a: dict) -> None:
    grad, weight = dims_arg(a, "grad", 2), dims_arg(a, "weight", 2)
    if grad.shape[1] != weight.shape[1]:
        raise Refusal("grad", f"has {grad.shape[1]} features, the table {weight.shape[1]}")
    _bags(a, weight.shape[0], grad.shape[0])


@check("aten::embedding_dense_backward", "aten::embedding_backward")
def _embedding_backward(a: dict) -> None:
    n = int(a["num_weights"])
    within(a, "indices", 0, n, f" (num_weights={n})")
    grad = tensor_arg(a, "grad_output" if "grad_output" in a else "grad")
    indices = tensor_arg(a, "indices")
    if grad.dim() < 1 or grad.numel() != indices.numel() * grad.shape[-1]:
        raise Refusal("indices", f"has {indices.numel()} entries for a gradient of shape {list(grad.shape)}")
    if a.get("sparse"):
        raise Refusal("sparse", "is true: the gradient would be a sparse tensor")


# -- segments, packed sequences


def _segments(a: dict, data: torch.Tensor) -> int:
    """Checks lengths or offsets against ``data``; returns the number of segments."""
    axis = a.get("axis", 0)
    if not -data.dim() <= axis < max(data.dim(), 1):
        raise Refusal("axis", f"is {axis}, outside the {data.dim()} dimensions of data")
    axis %= max(data.dim(), 1)
    if a.get("indices") is not None:
        raise Refusal("indices", "is given; only lengths or offsets are")
    size = data.shape[axis]
    lengths, offsets = a.get("lengths"), a.get("offsets")
    if (lengths is None) == (offsets is None):
        raise Refusal("lengths", "and offsets: exactly one of them is given")
    name, t = ("lengths", lengths) if lengths is not None else ("offsets", offsets)
    t = dims_arg(a, name, axis + 1)
    if tuple(t.shape[:-1]) != tuple(data.shape[:axis]):
        raise Refusal(name, f"has shape {list(t.shape)}, which does not lead with data's {list(data.shape[:axis])}")
    if name == "lengths":
        within(a, "lengths", 0, size + 1, f" (data's {size} along axis {axis})")
        if t.numel() and bool((t.sum(-1) != size).any()):
            raise Refusal("lengths", f"does not sum to data's {size} along axis {axis}")
        return t.shape[-1]
    within(a, "offsets", 0, size + 1, f" (data's {size} along axis {axis})")
    non_decreasing(a, "offsets", t)
    return t.shape[-1] - 1


@check("aten::segment_reduce")
def _segment_reduce(a: dict) -> None:
    _segments(a, tensor_arg(a, "data"))


@check("aten::_segment_reduce_backward")
def _segment_reduce_backward(a: dict) -> None:
    data = tensor_arg(a, "data")
    segments = _segments(a, data)
    axis = a.get("axis", 0) % max(data.dim(), 1)
    want = (*data.shape[:axis], segments, *data.shape[axis + 1 :])
    expect_shape(a, "grad", want, " (a value per segment)")
    expect_shape(a, "output", want, " (a value per segment)")


def _batch_sizes(a: dict, total: int) -> torch.Tensor:
    sizes = dims_arg(a, "batch_sizes", 1)
    within(a, "batch_sizes", 1, 1 << 62)
    if sizes.shape[0] > 1 and bool((sizes[1:] > sizes[:-1]).any()):
        raise Refusal("batch_sizes", "increases somewhere; a packed sequence's batch sizes never do")
    if sizes.numel() and int(sizes.sum()) != total:
        raise Refusal("batch_sizes", f"sums to {int(sizes.sum())}, but the packed data has {total} rows")
    return sizes


@check("aten::_pad_packed_sequence")
def _pad_packed(a: dict) -> None:
    data = tensor_arg(a, "data")
    _batch_sizes(a, data.shape[0] if data.dim() else 0)


@check("aten::_pack_padded_sequence_backward")
def _pack_padded_backward(a: dict) -> None:
    grad, size = tensor_arg(a, "grad"), list(a["input_size"])
    sizes = _batch_sizes(a, grad.shape[0] if grad.dim() else 0)
    steps, batch = (size[1], size[0]) if a.get("batch_first") else (size[0], size[1]) if len(size) > 1 else (0, 0)
    if sizes.shape[0] > steps or (sizes.numel() and int(sizes[0]) > batch):
        raise Refusal("batch_sizes", f"holds {sizes.shape[0]} steps of up to {int(sizes.max())}, for input {size}")
    if list(grad.shape[1:]) != size[2:]:
        raise Refusal("grad", f"has rows {list(grad.shape[1:])}, the input {size[2:]}")


# -- losses: targets into the classes


def _nll_target(a: dict, class_dim: int) -> None:
    inp, target = tensor_arg(a, "self"), int_arg(a, "target")
    if target is None or inp.dim() <= class_dim:
        raise Refusal("self", f"has {inp.dim()} dimensions")
    classes = inp.shape[class_dim]
    spatial = list(inp.shape[:class_dim]) + list(inp.shape[class_dim + 1 :])
    expect_shape(a, "target", spatial, " (a class per input row)")
    ignore = a.get("ignore_index", -100)
    t = target[target != ignore] if target.numel() else target
    within({"target": t}, "target", 0, classes, f" ({classes} classes; ignore_index={ignore})")
    weight = a.get("weight")
    if weight is not None and weight.numel() != classes:
        raise Refusal("weight", f"has {weight.numel()} entries for {classes} classes")


@check("aten::nll_loss_backward")
def _nll_backward(a: dict) -> None:
    _nll_target(a, 0 if tensor_arg(a, "self").dim() == 1 else 1)


@check("aten::nll_loss2d_backward")
def _nll2d_backward(a: dict) -> None:
    _nll_target(a, 1)


@check("aten::_ctc_loss", "aten::_ctc_loss_backward", "aten::ctc_loss")
def _ctc(a: dict) -> None:
    log_probs, targets = tensor_arg(a, "log_probs"), int_arg(a, "targets")
    if targets is None:
        raise Refusal("targets", "is missing")
    lengths = a["target_lengths"]
    lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    if targets.dim() == 2:
        if len(lengths) != targets.shape[0]:
            raise Refusal("target_lengths", f"has {len(lengths)} entries for {targets.shape[0]} targets")
        used = [targets[i, : max(0, min(n, targets.shape[1]))] for i, n in enumerate(lengths)]
        targets = torch.cat(used) if used else targets.new_empty(0)
    elif targets.dim() == 1:
        targets = targets[: max(0, sum(lengths))]
    else:
        raise Refusal("targets", f"has {targets.dim()} dimensions; targets are 1 or 2")
    classes = log_probs.shape[-1]
    within({"targets": targets}, "targets", 0, classes, f" (log_probs' {classes} classes)")


# -- dimensions, scales, modes


def _dim_list(a: dict, name: str, ndim: int) -> list:
    dims = list(a.get(name) or ())
    wrapped = []
    for d in dims:
        if not -ndim <= d < ndim:
            raise Refusal(name, f"holds {d}, outside the {ndim} dimensions of self")
        wrapped.append(d % ndim)
    if len(set(wrapped)) != len(wrapped):
        raise Refusal(name, f"repeats a dimension: {dims}")
    return wrapped


@check("aten::_fft_c2c", "aten::_fft_r2c", "prims::fft_c2c", "prims::fft_r2c")
def _fft(a: dict) -> None:
    _dim_list(a, "dim", tensor_arg(a, "self").dim())
    if a.get("normalization", 0) not in (0, 1, 2):
        raise Refusal("normalization", f"is {a['normalization']}; it is 0, 1 or 2")


@check("aten::_fft_c2r", "prims::fft_c2r")
def _fft_c2r(a: dict) -> None:
    inp = tensor_arg(a, "self")
    dims = _dim_list(a, "dim", inp.dim())
    _fft(a)
    last = a["last_dim_size"]
    if dims and not 1 <= last // 2 + 1 <= inp.shape[dims[-1]]:
        raise Refusal("last_dim_size", f"is {last}, but self holds {inp.shape[dims[-1]]} along dimension {dims[-1]}")


def _aa_scales(a: dict, inp_hw, out_hw) -> None:
    if a.get("align_corners"):
        return
    for name, n_in, n_out in zip(("scales_h", "scales_w"), inp_hw, out_hw):
        s = a.get(name)
        if s is not None and not (s > 0 and math.isfinite(s) and int(n_in * s) == n_out):
            raise Refusal(name, f"is {s}, which does not scale {n_in} to {n_out}")


@check("aten::_upsample_bilinear2d_aa", "aten::_upsample_bicubic2d_aa", "aten::_upsample_lanczos2d_aa")
def _upsample_aa(a: dict) -> None:
    if "self" in a:  # the .vec form computes its own sizes from its scale factors
        _aa_scales(a, tensor_arg(a, "self").shape[-2:], list(a["output_size"]))


@check(
    "aten::_upsample_bilinear2d_aa_backward",
    "aten::_upsample_bicubic2d_aa_backward",
    "aten::_upsample_lanczos2d_aa_backward",
)
def _upsample_aa_backward(a: dict) -> None:
    size, out = list(a["input_size"]), list(a["output_size"])
    if len(size) != 4 or len(out) != 2:
        raise Refusal("input_size", f"is {size}; it is [N, C, H, W]")
    expect_shape(a, "grad_output", [*size[:2], *out], " (the output's)")
    _aa_scales(a, size[2:], out)


@check("aten::grid_sampler", "aten::grid_sampler_2d", "aten::grid_sampler_3d", "aten::_grid_sampler_2d_cpu_fallback")
def _grid_sampler(a: dict) -> None:
    for name in ("interpolation_mode", "padding_mode"):
        if a.get(name) not in (0, 1, 2):
            raise Refusal(name, f"is {a.get(name)}; it is 0, 1 or 2")


# -- masked indexing, grouped products


def _masked_indices(a: dict) -> None:
    base, mask = tensor_arg(a, "self"), tensor_arg(a, "mask")
    indices = list(a.get("indices") or ())
    if len(indices) > base.dim():
        raise Refusal("indices", f"indexes {len(indices)} dimensions of a {base.dim()}-dimensional tensor")
    for k, given in enumerate(indices):
        idx = int_arg({"indices": given}, "indices")
        if idx is None:
            continue
        size = base.shape[k]
        try:
            bad = (idx < -size) | (idx >= size)
            hit = torch.broadcast_tensors(bad, mask)
        except RuntimeError:
            raise Refusal("indices", f"entry {k} does not broadcast with mask") from None
        if bool((hit[0] & hit[1]).any()):
            raise Refusal("indices", f"entry {k} holds a value outside [{-size}, {size}) where mask is true")


@check("aten::_unsafe_masked_index", "aten::_unsafe_masked_index_put_accumulate")
def _unsafe_masked(a: dict) -> None:
    _masked_indices(a)


@check("aten::_grouped_mm")
def _grouped_mm(a: dict) -> None:
    offs = int_arg(a, "offs")
    if offs is None:
        return
    offs = dims_arg(a, "offs", 1)
    # What the offsets split: the shared dimension of two matrices (a weight's
    # gradient in an MoE backward), the rows of a 2-d self, the columns of a 2-d mat2.
    mat_a, mat_b = tensor_arg(a, "self"), tensor_arg(a, "mat2")
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        n, what = mat_a.shape[1], "columns of self"
    elif mat_a.dim() == 2:
        n, what = mat_a.shape[0], "rows of self"
    else:
        n, what = mat_b.shape[-1], "columns of mat2"
    within(a, "offs", 0, n + 1, f" (the {n} {what} it splits)")
    non_decreasing(a, "offs", offs)


# -- integer division: the most negative integer over -1 traps


def _most_negative(t) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dtype in (torch.int32, torch.int64)
        and bool((t == torch.iinfo(t.dtype).min).any())
    )


def _minus_one(t) -> bool:
    if isinstance(t, torch.Tensor):
        return not (t.dtype.is_floating_point or t.dtype.is_complex) and bool((t == -1).any())
    return t == -1


@check(
    "aten::div.Tensor_mode",
    "aten::div.Scalar_mode",
    "aten::div.out_mode",
    "aten::div.Scalar_mode_out",
    "aten::div_.Tensor_mode",
    "aten::div_.Scalar_mode",
    "aten::divide.Tensor_mode",
    "aten::divide.Scalar_mode",
    "aten::divide.out_mode",
    "aten::divide_.Tensor_mode",
    "aten::divide_.Scalar_mode",
)
def _trunc_division(a: dict) -> None:
    if a.get("rounding_mode") == "trunc":
        _division(a)


@check("prims::div")
def _division(a: dict) -> None:
    if _most_negative(a.get("self")) and _minus_one(a.get("other")):
        raise Refusal("self", "holds the most negative integer and other holds -1: the division traps")


@check("aten::lcm", "aten::lcm_")
def _lcm(a: dict) -> None:
    for name in ("self", "other"):
        if _most_negative(a.get(name)):
            raise Refusal(name, "holds the most negative integer, whose lcm traps")


# -- attention backward on the GPU: no sequence offsets outside nested tensors


@check(
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_scaled_dot_product_fused_attention_overrideable_backward",
)
def _no_sequence_offsets(a: dict) -> None:
    for name in ("cum_seq_q", "cum_seq_k"):
        t = a.get(name)
        if isinstance(t, torch.Tensor) and t.numel():
            raise Refusal(name, "holds sequence offsets, which only nested tensors have")
