"""CUDA's autocast policy, applied above autograd for a logical GPU.

Note [Autocast on a logical GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's autocast is C++ above autograd (``AutocastCUDA``): for each aten op
on its lists it casts the op's CUDA tensors (to the autocast dtype, to
float32, to the widest of them, or by setting the op's ``dtype``) and runs
the op with autocast off for its body.  It casts only tensors whose C++
device is CUDA, and a logical GPU's MetaTensor is a meta tensor to C++
(Note [Logical device] in tensor.py: a CUDA key set on a host without CUDA
aborts in autograd's device guard), so C++ casts nothing for it and the trace
was the float32 program a GPU does not run.

So the policy is applied here, in the MetaMode's torch-function mode, which
sits above autograd as C++ autocast does: the casts are ordinary ``.to``
calls that autograd records (``_to_copy`` forward, its backward casting the
gradient back), with the fp32-weight cache C++ keeps (``cached_cast``).
The lists and rules are ported from ``aten/src/ATen/autocast_mode.{h,cpp}``
(``POLICIES``); a test holds them to the ops the installed torch registers
at ``AutocastCUDA``, and the 2.14 leg compares whole forwards with what C++
autocast does to FakeTensors on CUDA.

A torch function sees only the outermost call, while C++ autocast sees every
aten op, including those inside composites.  Two kinds of composite remain:

- torch's Python functions (``F.normalize``, ``Tensor.__matmul__``,
  ``torch.norm``) are seen inside (inside.py), so the calls they make come
  back here one by one;
- C++ composites not on the lists (``CompositeImplicitAutograd``): their
  bodies call aten ops we never see above autograd.  Those known to call
  no listed op (``INERT_COMPOSITES``, each checked against C++ autocast on
  the 2.14 leg) run as they are; a few common ones are ported
  (``_PORTED``); any other is refused with ``UnsupportedFeatureError``
  rather than traced with casts missing.

The cast cache lives while autocast does: where a logical GPU answers
``torch.cuda`` in the thread (cuda_answers.py), ``torch.clear_autocast_cache``
-- which the outermost ``torch.autocast`` calls on exit -- empties it too;
otherwise the first torch function the thread calls with CUDA autocast off
does, and the MetaMode's exit.

Limits: the casts of a C++ call's arguments are made right to left, as GCC
evaluates them; calls with ``out=`` are not cast (C++ registers no out
overload); an op called through ``torch.ops`` is no torch function, so it
is not cast here where C++ autocast would cast it (the built-in LLaMA casts
for its flash kernel itself: cli/llama.py); autocast on other logical
devices (xpu, mps) is refused (mode.py).
"""

from __future__ import annotations

import functools
import threading
import types
import weakref

import torch

from .. import _compat
from ..errors import UnsupportedFeatureError, mark_call
from ..source import user_frame
from ..tensor.tensor import MetaTensor
from . import inside

__all__ = ["applies", "prepare", "has_cache", "clear_cache", "POLICIES", "INERT_COMPOSITES", "registered_names"]

_LOWER = "lower_precision_fp"
_FP32 = "fp32"
_SET_OPT_DTYPE = "fp32_set_opt_dtype"
_APPEND_DTYPE = "fp32_append_dtype"
_PROMOTE = "promote"
_BANNED = "banned"

# aten op name -> cast policy, from autocast_mode.h's AT_FORALL_* lists and
# autocast_mode.cpp's CUDA registrations.  Overloads are not told apart:
# every listed name's registered overloads are its out-of-place ones, and
# calls with ``out=`` (never registered) are left alone.
POLICIES: dict[str, str] = {
    **dict.fromkeys(
        "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d "
        "convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm "
        "chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
        "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention "
        "cudnn_convolution cudnn_convolution_transpose _cudnn_rnn".split(),
        _LOWER,
    ),
    **dict.fromkeys(
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus "
        "layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity "
        "poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss "
        "smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss "
        "triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm "
        "logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d "
        "upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
        "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa rms_norm "
        "linalg_matrix_sqrth".split(),
        _FP32,
    ),
    **dict.fromkeys(
        "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum".split(),
        _SET_OPT_DTYPE,
    ),
    "norm": _APPEND_DTYPE,
    **dict.fromkeys(
        "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split(),
        _PROMOTE,
    ),
    "binary_cross_entropy": _BANNED,
}
# The ops whose optional dtype may come positionally (``softmax.int(self,
# dim, ScalarType? dtype=None)``); every other listed dtype is keyword-only.
_POSITIONAL_DTYPE = {"softmax": 2, "log_softmax": 2}

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)

# C++ composites (CompositeImplicitAutograd) not on the lists whose bodies
# call no listed op: with autocast on they run as with it off.  Each is
# checked against C++ autocast on FakeTensors (tests/gpu/test_autocast_cuda.py).
INERT_COMPOSITES = frozenset(
    """
    size stride dim numel is_floating_point is_complex is_nonzero is_same_size is_signed result_type
    to type_as view_as expand_as reshape reshape_as flatten unflatten chunk split tensor_split
    split_with_sizes unsafe_chunk unsafe_split contiguous squeeze unsqueeze movedim moveaxis swapaxes
    swapdims transpose t numpy_T matrix_H mT mH adjoint dropout feature_dropout alpha_dropout
    feature_alpha_dropout where broadcast_tensors broadcast_to meshgrid repeat_interleave
    index_select narrow select slice take_along_dim gather diagonal diag_embed triu tril outer
    ger pad constant_pad_nd relu6 hardtanh silu gelu glu mish hardswish hardsigmoid
    leaky_relu elu selu celu rrelu threshold softsign tanhshrink logsigmoid masked_fill masked_select
    full_like zeros_like ones_like empty_like rand_like randn_like randint_like new_zeros new_ones new_full
    new_empty clone detach item float double half bfloat16 long int short bool char byte cpu cuda
    dropout_ feature_dropout_ alpha_dropout_ feature_alpha_dropout_
    requires_grad_ retain_grad embedding_bag adaptive_avg_pool3d adaptive_max_pool2d adaptive_max_pool3d
    embedding one_hot flip roll rot90 std var std_mean var_mean mean nanmean amax amin max min
    argmax argmin all any isfinite isinf isnan isclose allclose equal sort argsort topk stack hstack
    vstack dstack cat concat concatenate batch_norm instance_norm adaptive_avg_pool1d adaptive_avg_pool2d
    adaptive_max_pool1d avg_pool1d max_pool1d max_pool2d max_pool3d max_pool1d_with_indices
    pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle sigmoid tanh relu
    clamp clamp_min clamp_max clip diff
    """.split()
)


class _State(threading.local):
    def __init__(self):
        self.cache: dict[int, tuple] = {}  # id(fp32 leaf) -> (weakref to it, its cast)


_STATE = _State()
_aten = torch.ops.aten


def applies(args, kwargs) -> bool:
    """Whether CUDA autocast is on and a logical-GPU MetaTensor is among the
    arguments (the C++ autocast kernel runs only for CUDA tensors)."""
    if not torch.is_autocast_enabled("cuda"):
        if _STATE.cache:
            _STATE.cache.clear()
        return False
    return any(_on_logical_gpu(a) for a in _leaves(args)) or any(_on_logical_gpu(a) for a in _leaves(kwargs.values()))


def has_cache() -> bool:
    return bool(_STATE.cache)


def clear_cache() -> None:
    _STATE.cache.clear()


def _leaves(values):
    for a in values:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _on_logical_gpu(a) -> bool:
    return isinstance(a, MetaTensor) and a._md.device.type == "cuda"


@functools.cache
def registered_names() -> frozenset[str]:
    """The aten op names the installed torch registers at ``AutocastCUDA``."""
    return _compat.aten_names_with_kernel("AutocastCUDA")


def prepare(func, args, kwargs):
    """``(func, args, kwargs, see_inside)`` for a call under CUDA autocast
    with a logical-GPU tensor: the arguments cast as C++ autocast casts them;
    ``see_inside`` when ``func`` is torch's Python to run with the mode
    pushed again (Note [Autocast on a logical GPU])."""
    if isinstance(func, types.FunctionType) and not inside.reentered(func, args):
        return inside.see_inside(func, args), args, kwargs, True
    name = getattr(func, "__name__", "")
    policy = POLICIES.get(name) if name in registered_names() else None
    if policy is None:
        ported = _PORTED.get(name)
        if ported is not None:
            return ported, args, kwargs, True
        if name not in INERT_COMPOSITES and _is_composite(name):
            _refuse(name)
        return func, args, kwargs, False
    if "out" in kwargs:
        return func, args, kwargs, False
    with _compat.no_torch_function_subclass():
        args, kwargs = _apply(name, policy, args, kwargs)
    return func, args, kwargs, False


def _apply(name: str, policy: str, args, kwargs):
    lower = torch.get_autocast_dtype("cuda")
    if policy == _LOWER:
        return _cast_all(lower, args, kwargs)
    if policy == _FP32:
        return _cast_all(torch.float32, args, kwargs)
    if policy == _PROMOTE:
        to = lower
        for a in _leaves((*args, *kwargs.values())):
            if _is_eligible(a):
                if to == torch.float32 or a.dtype == torch.float32:
                    to = torch.float32
                elif not (to == lower and a.dtype == lower):
                    raise RuntimeError(f"{name}: Unexpected floating ScalarType in at::autocast::prioritize")
        return _cast_all(to, args, kwargs)
    if policy == _BANNED:
        raise RuntimeError(_BANNED_MESSAGE)
    first = args[0] if args else kwargs.get("input", kwargs.get("self"))
    position = _POSITIONAL_DTYPE.get(name)
    given = kwargs.get("dtype") is not None or (
        position is not None and len(args) > position and args[position] is not None
    )
    if given:
        return args, kwargs
    if policy == _SET_OPT_DTYPE:
        if not _is_eligible(first):
            return args, kwargs
        to = torch.float32
    else:  # _APPEND_DTYPE: norm's overloads without a dtype redispatch with one
        to = torch.float32 if _is_eligible(first) else first.dtype
    if position is not None and len(args) > position:
        return (*args[:position], to, *args[position + 1 :]), kwargs
    return args, {**kwargs, "dtype": to}


def _is_eligible(a) -> bool:
    """C++'s ``is_eligible``: a (logical) CUDA floating tensor, not float64."""
    return _on_logical_gpu(a) and a.dtype.is_floating_point and a.dtype != torch.float64


def _cast_all(to: torch.dtype, args, kwargs):
    cache = _STATE.cache if torch.is_autocast_cache_enabled() else None
    lower = torch.get_autocast_dtype("cuda")

    def cast(a):
        if isinstance(a, (list, tuple)) and any(isinstance(x, MetaTensor) for x in a):
            return type(a)(cast(x) for x in a)
        if not _is_eligible(a) or a.dtype == to:
            return a
        if (
            cache is not None
            and to == lower
            and a.dtype == torch.float32
            and a.requires_grad
            and a.is_leaf
            and not a._is_view()
        ):
            hit = cache.get(id(a))
            if hit is not None and hit[0]() is a:
                return hit[1]
            out = a.to(to)
            cache[id(a)] = (weakref.ref(a), out)
            return out
        return a.to(to)

    # C++ evaluates ``(*F)(cached_cast(args)...)`` right to left (GCC's
    # order for a call's arguments): the bias is cast before the input.
    kwargs = dict(reversed([(k, cast(v)) for k, v in reversed(kwargs.items())]))
    return tuple(reversed([cast(a) for a in reversed(args)])), kwargs


def _is_composite(name: str) -> bool:
    """Whether an aten op of this name has a ``CompositeImplicitAutograd``
    overload: a body above autograd that calls other aten ops."""
    return name in _composite_names()


@functools.cache
def _composite_names() -> frozenset[str]:
    return _compat.aten_names_with_kernel("CompositeImplicitAutograd")


def _refuse(name: str) -> None:
    error = UnsupportedFeatureError(
        f"{name}: under torch.autocast('cuda') on a logical GPU, this C++ composite is not modelled "
        "(Note [Autocast on a logical GPU], docs/logical-cuda.md): its body calls aten ops that C++ "
        "autocast would cast and metadispatch does not see above autograd, so the trace could leave "
        "out casts the GPU makes. Trace this step without autocast, or report the function"
    )
    mark_call(error, name, user_frame())
    raise error


# -- C++ composites off the lists, ported


def _cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """``cross_entropy_loss``'s C++ body (LossNLL.cpp) for class-index targets
    without smoothing: ``log_softmax`` in the input's own dtype (an explicit
    dtype, which autocast keeps), then ``nll_loss_nd``."""
    if label_smoothing > 0.0 or target.dtype.is_floating_point:
        _refuse("cross_entropy_loss")
    class_dim = 0 if input.dim() == 1 else 1
    return _compat.nn_functions.nll_loss_nd(
        torch.log_softmax(input, class_dim, input.dtype), target, weight, reduction, ignore_index
    )


def _nll_loss_nd(input, target, weight=None, reduction=1, ignore_index=-100):
    """``nll_loss_nd``'s C++ body: ``nll_loss`` for 1-d and 2-d inputs,
    ``nll_loss2d`` for 4-d ones (both float32 under autocast); other ranks
    reshape first, not ported."""
    if input.dim() in (1, 2):
        return _compat.nn_functions.nll_loss(input, target, weight, reduction, ignore_index)
    if input.dim() == 4:
        return _compat.nn_functions.nll_loss2d(input, target, weight, reduction, ignore_index)
    _refuse("nll_loss_nd")


def _weight_norm(v, g, dim=0):
    """``_weight_norm``'s C++ body (WeightNorm.cpp): the fused kernel, which
    autocast leaves alone, unless a half tensor or an inner ``dim`` sends it
    to ``v * (g / norm_except_dim(v, 2, dim))`` (``norm`` under autocast's
    float32: not ported)."""
    v, g = v.contiguous(), g.contiguous()
    if torch.float16 in (v.dtype, g.dtype) or dim not in (0, v.dim() - 1):
        _refuse("_weight_norm")
    return _compat.weight_norm_interface(v, g, dim)[0]


def _square(self):
    return torch.pow(self, 2)  # ``square``'s C++ body: pow is float32 under autocast


_PORTED = {
    "cross_entropy_loss": _cross_entropy_loss,
    "nll_loss_nd": _nll_loss_nd,
    "square": _square,
    "_weight_norm": _weight_norm,
}
