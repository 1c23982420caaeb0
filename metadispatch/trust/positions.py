"""Which ops follow their inputs' values as memory positions: the memory class of every op a file may name.

Note [Values that become positions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The op filter (ir/decode.py) looks at schemas and the fences (trust/fences.py)
at output views; neither sees the *values* a call hands its kernel.  Some CPU
kernels index memory by those values without looking: ``max_pool2d``'s
backward writes ``grad_input[indices[i]]`` for whatever the indices say,
``embedding_dense_backward`` counts ``counts[indices[i]]++``,
``_pad_packed_sequence`` trusts its batch sizes, ``_fft_c2c`` its dimensions,
the anti-aliased upsamplers their scales; trunc division of the most
negative integer by -1 traps.  A file makes such values in a constant, an
``aten.full``, an ``arange`` -- anywhere.

So every op a loaded trace may run has a class, :func:`position`, default
deny:

- ``data``: its tensors' values are computed on, never followed as
  positions (elementwise ops by ``torch.Tag.pointwise``, reductions, copies,
  views, factories, products, convolutions, norms: ``spec/position_data.py``);
  integer scalars it uses as sizes or positions its kernel checks (dims,
  ``select``'s index, ``as_strided``'s offset: the view fence checks views);
- ``kernel``: its CPU kernel bounds-checks the named arguments itself,
  raising torch's error (``gather``, ``index``, ``nll_loss``'s target, ...);
  ``tests/trust/test_positions_kernels.py`` proves it for each, on this torch,
  with extreme values under a guard-page allocator;
- ``checked``: replay checks the named arguments just before the call
  (``trust/value_checks.py``: indices inside the plane they index,
  offsets non-decreasing, lengths summing to the data, samples in [0, 1),
  dimensions in range, derived from the op's other arguments) and refuses the
  call with a ``ReplayError`` naming the argument and the value;
- ``refused``: a loaded trace may not run it (sparse, nested, quantized and
  oneDNN-opaque tensors, whose indices and layouts kernels follow
  unchecked; packed weights, which kernels reinterpret as structures;
  GPU kernels that take sequence offsets; engine state);
- ``caller``: outside what a file may name unasked (ir/decode.py): it loads
  only when the caller names it in ``allow_ops``, vouching for it.

An op with no class (one a newer torch adds) is refused in a loaded trace
whenever a tensor it is handed holds integers or booleans -- the only way a
value becomes a position -- and ``tests/trust/test_positions.py`` fails, so that
it is classified before a release.  Classes are per packet
(``aten::embedding_bag``), or per overload where overloads differ
(``aten::div.Tensor_mode``).  A trace built in this process is trusted as
code is: none of this applies to it (Note [Fences]).
"""

from __future__ import annotations

import functools
import re
from types import MappingProxyType
from typing import NamedTuple

import torch

from ..ir.decode import refusal
from ..spec.ownops import OWN_OPS
from ..spec.position_data import DATA_FAMILIES
from ..spec.schema import schema_of

__all__ = [
    "Position",
    "position",
    "DATA",
    "KERNEL",
    "CHECKED",
    "REFUSED",
    "CALLER",
    "CHECKED_OPS",
    "KERNEL_OPS",
    "index_inputs",
]

DATA, KERNEL, CHECKED, REFUSED, CALLER = "data", "kernel", "checked", "refused", "caller"


class Position(NamedTuple):
    """An op's memory class: its kind, the index-like arguments (schema names) and why."""

    kind: str
    args: tuple
    why: str


def _entries(kind: str, table: dict) -> dict:
    return {name: Position(kind, tuple(args.split()), why) for name, (args, why) in table.items()}


# Ops whose CPU kernel checks the named arguments (tests/trust/test_positions_kernels.py).
_KERNEL = {
    "aten::gather": ("index", "raises 'index out of bounds'"),
    "aten::gather_backward": ("index", "scatters by index with scatter_add's checks"),
    "aten::scatter": ("index", "raises 'index out of bounds'"),
    "aten::scatter_": ("index", "raises 'index out of bounds'"),
    "aten::scatter_add": ("index", "raises 'index out of bounds'"),
    "aten::scatter_add_": ("index", "raises 'index out of bounds'"),
    "aten::scatter_reduce": ("index", "raises 'index out of bounds'"),
    "aten::scatter_reduce_": ("index", "raises 'index out of bounds'"),
    "aten::index_select": ("index", "raises 'index out of range in self'"),
    "aten::index_select_backward": ("index", "adds by index with index_add's checks"),
    "aten::index_add": ("index", "raises 'index out of bounds'"),
    "aten::index_add_": ("index", "raises 'index out of bounds'"),
    "aten::index_copy": ("index", "raises 'index out of bounds'"),
    "aten::index_copy_": ("index", "raises 'index out of bounds'"),
    "aten::index_fill": ("index", "raises 'index out of range'"),
    "aten::index_fill_": ("index", "raises 'index out of range'"),
    "aten::index_reduce": ("index", "raises 'index out of bounds'"),
    "aten::index_reduce_": ("index", "raises 'index out of bounds'"),
    "aten::index": ("indices", "raises 'index is out of bounds for dimension'"),
    "aten::index_put": ("indices", "raises 'index is out of bounds for dimension'"),
    "aten::index_put_": ("indices", "raises 'index is out of bounds for dimension'"),
    "aten::_index_put_impl": ("indices", "checks even with unsafe=True on the CPU"),
    "aten::_index_put_impl_": ("indices", "checks even with unsafe=True on the CPU"),
    "aten::_unsafe_index": ("indices", "is index on the CPU, with its checks"),
    "aten::_unsafe_index_put": ("indices", "is index_put on the CPU, with its checks"),
    "aten::take": ("index", "raises 'out of range'"),
    "aten::take_along_dim": ("indices", "wraps indices into range (modulo the size) on the CPU"),
    "aten::put": ("index", "raises 'out of range'"),
    "aten::put_": ("index", "raises 'out of range'"),
    "aten::embedding": ("indices", "raises 'index out of range in self'"),
    "aten::embedding_renorm": ("indices", "selects rows with select's checks"),
    "aten::embedding_renorm_": ("indices", "selects rows with select's checks"),
    "aten::max_unpool2d": ("indices", "raises 'Found an invalid max index'"),
    "aten::max_unpool3d": ("indices", "raises 'Found an invalid max index'"),
    "aten::nll_loss": ("target", "raises 'Target is out of bounds'"),
    "aten::nll_loss_forward": ("target", "raises 'Target is out of bounds'"),
    "aten::nll_loss2d": ("target", "raises 'Target is out of bounds'"),
    "aten::nll_loss2d_forward": ("target", "raises 'Target is out of bounds'"),
    "aten::nll_loss_nd": ("target", "is nll_loss or nll_loss2d, with their checks"),
    "aten::cross_entropy_loss": ("target", "is log_softmax and nll_loss, with its checks"),
    "aten::multi_margin_loss": ("target", "raises 'target out of range'"),
    "aten::multi_margin_loss_backward": ("target", "raises 'target out of range'"),
    "aten::multilabel_margin_loss": ("target", "raises 'target is out of range'"),
    "aten::multilabel_margin_loss_forward": ("target", "raises 'target is out of range'"),
    "aten::multilabel_margin_loss_backward": ("target", "raises 'target is out of range'"),
    "aten::searchsorted": ("sorter", "raises 'sorter index out of range'"),
    "aten::one_hot": ("self", "raises 'Class values must be smaller than num_classes'"),
    "aten::bincount": ("self", "sizes its output from the largest value and refuses negative ones"),
    "aten::repeat_interleave": ("repeats", "refuses negative repeats and sizes its output from their sum"),
    "aten::value_selecting_reduction_backward": ("indices", "scatters by index with scatter's checks"),
    "aten::cummaxmin_backward": ("indices", "scatters by index with scatter_add's checks"),
    "aten::masked_scatter": ("mask", "raises when the mask selects more elements than source holds"),
    "aten::masked_scatter_": ("mask", "raises when the mask selects more elements than source holds"),
    "aten::masked_scatter_backward": ("mask", "is masked_select of a zero-padded gradient, with its checks"),
    "aten::tensor_split": ("tensor_indices_or_sections", "slices at the given positions, clamped to the size"),
    "aten::narrow": ("start", "raises 'start out of range'"),
    "aten::_pack_padded_sequence": ("lengths", "raises unless lengths are positive, sorted and within the input"),
    "aten::lu_solve": ("LU_pivots", "raises 'Pivots given to lu_solve must all be'"),
    "aten::linalg_lu_solve": ("pivots", "raises 'Pivots given to lu_solve must all be'"),
    "aten::linalg_ldl_solve": ("pivots", "raises 'Pivots given to ldl_solve must all satisfy'"),
    "aten::lstm": ("batch_sizes", "slices each step with narrow's checks"),
    "aten::gru": ("batch_sizes", "slices each step with narrow's checks"),
    "aten::rnn_tanh": ("batch_sizes", "slices each step with narrow's checks"),
    "aten::rnn_relu": ("batch_sizes", "slices each step with narrow's checks"),
}

# Ops replay checks just before the call (trust/value_checks.py registers one per entry).
_CHECKED = {
    "aten::max_pool2d_with_indices_backward": ("indices", "writes grad_input[indices] unchecked"),
    "aten::max_pool3d_with_indices_backward": ("indices", "writes grad_input[indices] unchecked"),
    "aten::adaptive_max_pool2d_backward": ("indices", "writes grad_input[indices] unchecked"),
    "aten::adaptive_max_pool3d_backward": ("indices", "writes grad_input[indices] unchecked"),
    "aten::embedding_dense_backward": ("indices", "counts indices unchecked with scale_grad_by_freq"),
    "aten::embedding_backward": ("indices", "is embedding_dense_backward"),
    "aten::_embedding_bag": ("indices offsets", "follows offsets unchecked"),
    "aten::_embedding_bag_forward_only": ("indices offsets", "follows offsets unchecked"),
    "aten::embedding_bag": ("indices offsets", "is _embedding_bag"),
    "aten::_embedding_bag_backward": (
        "indices offsets offset2bag bag_size maximum_indices",
        "follows every index-like argument unchecked",
    ),
    "aten::_embedding_bag_dense_backward": (
        "indices offset2bag bag_size maximum_indices",
        "follows every index-like argument unchecked",
    ),
    "aten::_embedding_bag_per_sample_weights_backward": (
        "indices offsets offset2bag",
        "follows every index-like argument unchecked",
    ),
    "aten::segment_reduce": ("lengths offsets", "follows lengths and offsets unchecked with unsafe=True"),
    "aten::_segment_reduce_backward": ("lengths offsets", "follows lengths and offsets unchecked"),
    "aten::_unsafe_masked_index": ("indices", "reads where indices say under the mask"),
    "aten::_unsafe_masked_index_put_accumulate": ("indices", "writes where indices say under the mask"),
    "aten::_pad_packed_sequence": ("batch_sizes", "trusts its batch sizes (negative ones corrupt the heap)"),
    "aten::_pack_padded_sequence_backward": ("batch_sizes", "trusts its batch sizes"),
    "aten::nll_loss_backward": ("target", "writes grad_input[target] unchecked"),
    "aten::nll_loss2d_backward": ("target", "writes grad_input[target] unchecked"),
    "aten::_ctc_loss": ("targets", "reads log_probs at each target unchecked"),
    "aten::_ctc_loss_backward": ("targets", "reads log_probs at each target unchecked"),
    "aten::ctc_loss": ("targets", "is _ctc_loss"),
    "aten::_fft_c2c": ("dim", "transforms the dimensions it is given unchecked"),
    "aten::_fft_r2c": ("dim", "transforms the dimensions it is given unchecked"),
    "aten::_fft_c2r": ("dim", "transforms the dimensions it is given unchecked"),
    "prims::fft_c2c": ("dim", "is _fft_c2c"),
    "prims::fft_r2c": ("dim", "is _fft_r2c"),
    "prims::fft_c2r": ("dim", "is _fft_c2r"),
    "aten::_upsample_bilinear2d_aa": ("scales_h scales_w", "sizes its filters from scales unchecked"),
    "aten::_upsample_bilinear2d_aa_backward": ("scales_h scales_w", "sizes its filters from scales unchecked"),
    "aten::_upsample_bicubic2d_aa": ("scales_h scales_w", "sizes its filters from scales unchecked"),
    "aten::_upsample_bicubic2d_aa_backward": ("scales_h scales_w", "sizes its filters from scales unchecked"),
    "aten::_upsample_lanczos2d_aa": ("scales_h scales_w", "sizes its filters from scales unchecked"),
    "aten::_upsample_lanczos2d_aa_backward": ("scales_h scales_w", "sizes its filters from scales unchecked"),
    "aten::fractional_max_pool2d": ("random_samples", "turns samples outside [0, 1) into positions"),
    "aten::fractional_max_pool3d": ("random_samples", "turns samples outside [0, 1) into positions"),
    "aten::grid_sampler": ("interpolation_mode padding_mode", "switches on the modes unchecked"),
    "aten::grid_sampler_2d": ("interpolation_mode padding_mode", "switches on the modes unchecked"),
    "aten::grid_sampler_3d": ("interpolation_mode padding_mode", "switches on the modes unchecked"),
    "aten::_grid_sampler_2d_cpu_fallback": ("interpolation_mode padding_mode", "switches on the modes unchecked"),
    "aten::_grouped_mm": ("offs", "splits its operands at offs unchecked"),
    # Integer division of the most negative integer by -1 traps (SIGFPE): the process dies.
    "aten::div.Tensor_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::div.Scalar_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::div.out_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::div.Scalar_mode_out": ("self other", "traps on the most negative integer divided by -1"),
    "aten::div_.Tensor_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::div_.Scalar_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::divide.Tensor_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::divide.Scalar_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::divide.out_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::divide_.Tensor_mode": ("self other", "traps on the most negative integer divided by -1"),
    "aten::divide_.Scalar_mode": ("self other", "traps on the most negative integer divided by -1"),
    "prims::div": ("self other", "traps on the most negative integer divided by -1"),
    "aten::lcm": ("self other", "traps on the most negative integer"),
    "aten::lcm_": ("self other", "traps on the most negative integer"),
    "aten::_scaled_dot_product_flash_attention_backward": ("cum_seq_q cum_seq_k", "follows sequence offsets"),
    "aten::_scaled_dot_product_cudnn_attention_backward": ("cum_seq_q cum_seq_k", "follows sequence offsets"),
    "aten::_scaled_dot_product_fused_attention_overrideable_backward": (
        "cum_seq_q cum_seq_k",
        "follows sequence offsets",
    ),
}

_BY_CHANNEL = "reads a statistic or weight per channel of the input, whatever its size"
_BY_ROW = "reads a statistic per row and a weight per feature, whatever their sizes"
_BY_FORWARD = "reads its gradient by the forward's output shape, worked out from the other arguments"
# Ops whose kernels read one argument by another's shape (trust/shape_checks.py, Note [Shapes kernels
# trust]): classed checked too, their index-like arguments being the ones read.
_SHAPES = {
    **{
        f"aten::{name}": ("weight bias running_mean running_var", _BY_CHANNEL)
        for name in (
            "native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training "
            "_native_batch_norm_legit_functional _batch_norm_with_update _batch_norm_with_update_functional "
            "_batch_norm_no_update batch_norm _batch_norm_impl_index instance_norm cudnn_batch_norm"
        ).split()
    },
    **{
        f"aten::{name}": ("weight running_mean running_var save_mean", _BY_CHANNEL)
        for name in (
            "native_batch_norm_backward batch_norm_backward _batch_norm_impl_index_backward cudnn_batch_norm_backward"
        ).split()
    },
    "aten::batch_norm_update_stats": ("running_mean running_var", _BY_CHANNEL),
    "aten::batch_norm_elemt": ("weight bias mean invstd", _BY_CHANNEL),
    "aten::native_layer_norm": ("weight bias", _BY_ROW),
    "aten::native_layer_norm_backward": ("weight mean rstd", _BY_ROW),
    "aten::_fused_rms_norm": ("weight", _BY_ROW),
    "aten::_fused_rms_norm_backward": ("weight rstd", _BY_ROW),
    "aten::native_group_norm": ("weight", _BY_CHANNEL),
    "aten::native_group_norm_backward": ("weight mean rstd", _BY_CHANNEL),
    "aten::_weight_norm_interface": ("g", "reads a norm per slice of v, whatever g's size"),
    "aten::_weight_norm_interface_backward": ("saved_g saved_norms", "reads a norm per slice of v, unchecked"),
    **{
        f"aten::{name}": ("grad_output", "reads its gradient by output's shape")
        for name in "_softmax_backward_data _log_softmax_backward_data _masked_softmax_backward".split()
    },
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": ("logsumexp out", "reads them by query's shape"),
    **{
        f"aten::{name}": ("grad_output", _BY_FORWARD)
        for name in (
            "avg_pool2d_backward avg_pool3d_backward max_pool2d_backward _adaptive_avg_pool2d_backward "
            "_adaptive_avg_pool3d_backward adaptive_avg_pool3d_backward replication_pad1d_backward "
            "replication_pad2d_backward replication_pad3d_backward reflection_pad1d_backward "
            "reflection_pad2d_backward reflection_pad3d_backward"
        ).split()
    },
    "aten::fractional_max_pool2d_backward": ("grad_output indices", _BY_FORWARD + " (indices it checks)"),
    "aten::fractional_max_pool3d_backward": ("grad_output indices", _BY_FORWARD + " (indices it checks)"),
    **{
        f"aten::{name}": ("grad_output interpolation_mode padding_mode", _BY_FORWARD + ", and switches on the modes")
        for name in "grid_sampler_2d_backward grid_sampler_3d_backward _grid_sampler_2d_cpu_fallback_backward".split()
    },
    "aten::unfold_backward": ("grad_in", "writes its windows by input_sizes, whatever grad_in's shape"),
    "aten::_pdist_backward": ("pdist", "reads a distance (and its gradient) per pair of rows of self, unchecked"),
    "aten::_cdist_backward": ("cdist", "reads a distance (and its gradient) per pair of rows of x1 and x2, unchecked"),
    "aten::lu_unpack": ("LU_pivots", "reads a pivot per row of LU_data (it checks their values, not their number)"),
    "aten::mkldnn_rnn_layer": ("weight0 weight1 hx_", "reads its weights and states by hidden_size, unchecked"),
    "aten::mkldnn_rnn_layer_backward": (
        "weight1 weight2 workspace",
        "reads its weights, states and oneDNN's workspace by hidden_size, unchecked",
    ),
}

# Ops a loaded trace may not run, named one by one.
_REFUSED = {
    "aten::_sobol_engine_draw": ("sobolstate", "indexes its direction numbers by dimension unchecked"),
    "aten::_sobol_engine_ff_": ("sobolstate", "indexes its direction numbers by dimension unchecked"),
    "aten::_sobol_engine_initialize_state_": ("self", "indexes its direction numbers by dimension unchecked"),
    "aten::_sobol_engine_scramble_": ("ltm", "indexes its direction numbers by dimension unchecked"),
    "aten::_flash_attention_forward": ("cum_seq_q", "follows sequence offsets on the GPU unchecked"),
    "aten::_flash_attention_forward_no_dropout_inplace": ("cum_seq_q", "follows sequence offsets unchecked"),
    "aten::_flash_attention_backward": ("cum_seq_q", "follows sequence offsets on the GPU unchecked"),
    "aten::_efficient_attention_forward": ("cu_seqlens_q", "follows sequence offsets on the GPU unchecked"),
    "aten::_efficient_attention_backward": ("cu_seqlens_q", "follows sequence offsets on the GPU unchecked"),
    "aten::_cudnn_attention_forward": ("cum_seq_q", "follows sequence offsets on the GPU unchecked"),
    "aten::_cudnn_attention_backward": ("cum_seq_q", "follows sequence offsets on the GPU unchecked"),
    "aten::_cudnn_ctc_loss": ("targets", "reads targets on the GPU unchecked"),
    "aten::_scaled_grouped_mm": ("offs", "splits its operands at offs on the GPU unchecked"),
    "aten::_scaled_grouped_mm_v2": ("offs", "splits its operands at offs on the GPU unchecked"),
    "aten::_add_batch_dim": ("level", "names functorch interpreter state by level"),
    "aten::_remove_batch_dim": ("level", "names functorch interpreter state by level"),
    "aten::_make_dual": ("level", "names forward-AD state by level"),
    "aten::_make_dual_copy": ("level", "names forward-AD state by level"),
    "aten::_unpack_dual": ("level", "names forward-AD state by level"),
    "aten::_fw_primal": ("level", "names forward-AD state by level"),
    "aten::_fw_primal_copy": ("level", "names forward-AD state by level"),
    "aten::_efficientzerotensor": ("size", "makes a ZeroTensor, which no trace records"),
    "aten::_saturate_weight_to_fp16": ("weight", "prepares fbgemm's packed weights"),
    "aten::_rowwise_prune": ("mask", "makes compressed indices for sparse kernels"),
    "aten::_spdiags": ("offsets", "makes a sparse tensor"),
    "aten::_spsolve": ("A", "reads a sparse tensor's indices"),
    "aten::hspmm": ("mat1", "reads a sparse tensor's indices"),
    "aten::sspaddmm": ("mat1", "reads a sparse tensor's indices"),
    "aten::smm": ("self", "reads a sparse tensor's indices"),
    "aten::to_padded_tensor": ("self", "reads a nested tensor's offsets"),
    "aten::_fused_moving_avg_obs_fq_helper": ("self", "quantizes (fake quantization state)"),
    "aten::_fused_moving_avg_obs_fq_helper_functional": ("self", "quantizes (fake quantization state)"),
    "aten::fused_moving_avg_obs_fake_quant": ("self", "quantizes (fake quantization state)"),
    "aten::_choose_qparams_per_tensor": ("self", "quantizes"),
    "aten::choose_qparams_optimized": ("input", "quantizes"),
    "aten::_dyn_quant_matmul_4bit": ("packed_weights", "reinterprets packed weights"),
    "aten::_dyn_quant_pack_4bit_weight": ("weights", "packs weights for a kernel that reinterprets them"),
    "aten::_mixed_dtypes_linear": ("weight", "reinterprets packed weights"),
}

# Families refused whole: (pattern on the op's name without namespace, why).
_REFUSED_FAMILIES = [
    (
        re.compile(r"_?sparse|.*_sparse|_to_sparse|to_sparse|.*coalesce|_nnz|_dim[IV]$|dense_dim|_?values(_copy)?$"),
        "belongs to sparse tensors, whose indices kernels follow unchecked",
    ),
    (
        re.compile(r"_?(c?col|c?row|crow)_indices|_?indices(_copy)?$|_convert_indices_from|_?to_dense"),
        "belongs to sparse tensors, whose indices kernels follow unchecked",
    ),
    (
        re.compile(r"_?nested|.*jagged|_padded_dense"),
        "belongs to nested tensors, whose offsets kernels follow unchecked",
    ),
    (
        re.compile(
            r".*quantiz|.*fake_quant|q_(scale|zero_point|per_channel)|qscheme|int_repr|dequantize|_empty_.*quantized"
        ),
        "belongs to quantized tensors, whose layout kernels trust",
    ),
    (re.compile(r"_?mkldnn_(?!rnn_layer)|to_mkldnn"), "belongs to oneDNN's opaque tensors, whose layout kernels trust"),
    (
        re.compile(r"fbgemm_|.*prepack|.*_packed|.*int4pack|.*int8pack|_cslt_"),
        "reinterprets packed weights as structures",
    ),
    (re.compile(r"miopen_|.*_mps|mps_"), "runs on a device replay does not support (MIOpen, MPS)"),
]


_TABLE = {
    **_entries(KERNEL, _KERNEL),
    **_entries(CHECKED, _CHECKED),
    **_entries(CHECKED, _SHAPES),
    **_entries(REFUSED, _REFUSED),
}
CHECKED_OPS = frozenset(_CHECKED) | frozenset(_SHAPES)  # names with a check (trust/index_checks.CHECKS)
KERNEL_OPS = MappingProxyType(_entries(KERNEL, _KERNEL))  # name -> Position: the ops the kernel proofs cover


def index_inputs(func) -> tuple:
    """The Tensor-typed arguments of ``func`` it reads (not ``out=``), by name."""
    return tuple(
        a.name
        for a in schema_of(func).arguments
        if "Tensor" in str(a.type) and not (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    )


@functools.cache
def position(func) -> Position | None:
    """``func``'s memory class (Note [Values that become positions]), or None: unclassified."""
    name = func.name()
    ns, _, short = name.partition("::")
    if refusal(func) is not None or (ns not in ("aten", "prims") and name not in OWN_OPS):
        return Position(CALLER, (), "a file names it only where the caller allows it (allow_ops)")
    if name in OWN_OPS:
        return Position(DATA, (), "metadispatch's own initialiser: it fills its argument")
    packet = schema_of(func).name
    entry = _TABLE.get(name) or _TABLE.get(packet)
    if entry is not None:
        return entry
    base = short.partition(".")[0]
    for pattern, why in _REFUSED_FAMILIES:
        if pattern.match(base):
            return Position(REFUSED, index_inputs(func)[:1], why)
    if torch.Tag.pointwise in func.tags:
        return Position(DATA, (), "elementwise (torch.Tag.pointwise)")
    if not index_inputs(func):
        return Position(DATA, (), "it reads no tensor: a factory, sized by the budget")
    if base.startswith("_foreach_"):
        return Position(DATA, (), "elementwise over lists of tensors")
    family = DATA_FAMILIES.get(f"{ns}::{base}") or DATA_FAMILIES.get(f"{ns}::{base.rstrip('_')}")
    return None if family is None else Position(DATA, (), family)
