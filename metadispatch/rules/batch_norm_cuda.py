"""Batch and instance norm on a logical CUDA device: cuDNN's kernel where a real GPU takes it.

Note [Batch norm on a logical GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``F.batch_norm`` calls ``torch.batch_norm``, a C++ composite
(``batch_norm`` -> ``_batch_norm_impl_index`` in Normalization.cpp) that
asks ``_select_batch_norm_backend`` which kernel runs.  That function reads
``input.is_cuda()``, which is false for a logical GPU's tensors (meta in
C++, Note [Logical device]), so the composite took the native path
(``empty`` reserve + ``native_batch_norm``) where a real GPU calls
``cudnn_batch_norm``.  Under a MetaMode, and for MetaTensors without one,
``torch.batch_norm`` on a CUDA MetaTensor is answered by :func:`batch_norm`
below (Note [Composite overrides]): a port of the two C++ functions, the
backend chosen by :func:`uses_cudnn`, a port of ``_select_batch_norm_backend``
(torch 2.13 and 2.14 have the same body).  cuDNN is chosen when
``torch.backends.cudnn.enabled`` (the global flag; the composite's own
``cudnn_enabled`` argument is unused), neither input nor weight is bfloat16,
a float16 input comes with a float32 weight, weight and bias are defined,
both running statistics are defined (or neither, in training), the input
has at least 3 dimensions, at most 880,801 samples in training or 65,535 in
eval, fewer than 2**31 - 1 elements, and ``eps`` is at least cuDNN's
``CUDNN_BN_MIN_EPSILON`` -- 0.0 in the cuDNN torch ships (``F.batch_norm`` itself
refuses a negative ``eps``), so this only matters for direct calls with a
negative one.  Every condition is pinned against a FakeTensorMode on a CUDA
build of torch in tests/gpu/test_logical_cuda_batch_norm.py.  MIOpen (ROCm) is
not modelled: the profiles are NVIDIA GPUs.

The cuDNN branch makes the input contiguous in its suggested memory format
and the parameters contiguous, as the C++ does, then calls
``cudnn_batch_norm``; torch's autograd formula for it (compiled into every
build) records ``cudnn_batch_norm_backward`` in training -- after making the
incoming gradient contiguous in the input's format -- and
``native_batch_norm_backward`` in eval (cuDNN has no eval backward).  All
other calls run the C++ composite itself, so the native path, its checks and
its error messages are unchanged.

What is exact: the op sequence, and the outputs' shapes, dtypes and strides
as cuDNN's kernel allocates them (output in the input's suggested layout,
saved statistics in the weight's dtype, empty ones in eval).  What is not:
the reserve buffer.  Its size is ``cudnnGetBatchNormalizationTrainingExReserveSpaceSize``
at run time, which torch's meta kernel (and so FakeTensor) answers with 0
bytes, as this does; cuDNN's workspace is allocated inside the kernel, not
by a dispatched op, and is in no trace.  ``_batch_norm_with_update`` (export
and compile graphs; eager never dispatches it) chooses the same backend
inside its CUDA kernel, one op either way; its metadata stays torch's meta
answer, which differs from cuDNN's only for inputs not dense in any layout.

``instance_norm`` (``F.instance_norm``, ``nn.InstanceNorm*d``) is a batch norm
over ``(1, N * C, ...)`` that C++ calls directly, out of the mode's reach, so
its body is ported too (:func:`instance_norm`): an affine instance norm runs
``cudnn_batch_norm`` on a GPU, a plain one the native kernel.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..tensor.tensor import MetaTensor
from ..values import composites

aten = torch.ops.aten

# ``CUDNN_BN_MIN_EPSILON``, what ``getCUDAHooks().batchnormMinEpsilonCuDNN()``
# returns: 0.0 in the cuDNN torch's wheels ship (torch 2.14.1+cu130's C++
# picks cuDNN for eps = 1e-7 and, in eval, 0.0: the fake-CUDA tests); early
# cuDNN releases had 1e-5.
CUDNN_BN_MIN_EPSILON = 0.0
_TRAIN_BATCH, _EVAL_BATCH = 880801, 65535  # the C++'s "spatial" limits
_INT32_MAX = 2**31 - 1

_batch_norm, _instance_norm = torch.batch_norm, torch.instance_norm


def uses_cudnn(input, weight, bias, running_mean, running_var, training: bool, eps: float) -> bool:
    """``_select_batch_norm_backend`` == ``Cudnn`` for a CUDA input (Note [Batch norm on a logical GPU])."""
    if weight is None or bias is None:
        return False
    stats_ok = (running_mean is not None and running_var is not None) or (
        running_mean is None and running_var is None and training
    )
    return (
        torch.backends.cudnn.enabled  # ctx.userEnabledCuDNN(), the global flag
        and torch.bfloat16 not in (input.dtype, weight.dtype)
        and (input.dtype != torch.float16 or weight.dtype == torch.float32)
        and stats_ok
        and input.dim() >= 3
        and input.shape[0] <= (_TRAIN_BATCH if training else _EVAL_BATCH)
        and eps >= CUDNN_BN_MIN_EPSILON
        and input.numel() < _INT32_MAX
    )


def _checks_pass(input, weight, bias, running_mean, running_var, training: bool) -> bool:
    """What ``_batch_norm_impl_index`` checks before choosing; a call that
    fails one runs the C++, which raises its own error."""
    features = input.shape[1] if input.dim() > 1 else None
    if input.numel() == 0 or features is None:
        return False
    if not training and (running_mean is None or running_var is None):
        return False
    return all(t is None or t.numel() == features for t in (weight, bias, running_mean, running_var))


def batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """``batch_norm`` / ``_batch_norm_impl_index`` (Normalization.cpp) for a CUDA input."""
    if _checks_pass(input, weight, bias, running_mean, running_var, training) and uses_cudnn(
        input, weight, bias, running_mean, running_var, training, eps
    ):
        input_c = input.contiguous(memory_format=_compat.suggest_memory_format(input))
        stats = [t.contiguous() if t is not None else None for t in (running_mean, running_var)]
        out = aten.cudnn_batch_norm.default(
            input_c, weight.contiguous(), bias.contiguous(), *stats, training, momentum, eps
        )
        return out[0]
    with _compat.no_torch_function_subclass():
        return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)


def functional_batch_norm(
    input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5
):
    """``F.batch_norm``'s body (the same in torch 2.13 and 2.14), calling :func:`batch_norm`.

    ``nn.BatchNorm*d`` calls ``F.batch_norm``, whose torch function a mode
    sees first; the ``torch.batch_norm`` it calls inside is out of the mode's
    reach, so the Python body is run here."""
    if training:
        size = input.size()  # _verify_batch_size
        values = size[0]
        for extent in size[2:]:
            values *= extent
        if values == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")
    if training and eps <= 0.0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    if eps < 0.0:
        raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
    return batch_norm(
        input, weight, bias, running_mean, running_var, training, momentum, eps, torch.backends.cudnn.enabled
    )


def instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled):
    """``instance_norm`` (Normalization.cpp): a batch norm over ``(1, N * C, ...)``,
    through :func:`batch_norm`, so its backend is chosen as there (an affine
    instance norm runs ``cudnn_batch_norm`` on a GPU)."""
    torch._check(
        use_input_stats or (running_mean is not None and running_var is not None),
        lambda: "Expected running_mean and running_var to be defined when use_input_stats is false",
    )
    b, c = input.shape[0], input.shape[1]

    def repeated(t):  # repeat_if_defined
        return t.repeat(b) if t is not None else None

    weight_, bias_, mean_, var_ = (repeated(t) for t in (weight, bias, running_mean, running_var))
    reshaped = input.contiguous().view(1, b * c, *input.shape[2:])
    out = batch_norm(reshaped, weight_, bias_, mean_, var_, use_input_stats, momentum, eps, cudnn_enabled)
    # The per-instance statistics averaged back into the running ones, through
    # an alias ("they are const but we want to modify their data"); torch 2.13
    # and 2.14 do it only when the input's statistics were used (their CPU and
    # fake-CUDA runs dispatch no copy in eval).
    for stat, stat_ in ((running_mean, mean_), (running_var, var_)):
        if stat is not None and use_input_stats:
            aten.alias.default(stat).copy_(stat_.view(b, c).mean(0, False))
    return out.view(input.shape)


def functional_instance_norm(
    input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True, momentum=0.1, eps=1e-5
):
    """``F.instance_norm``'s body (the same in torch 2.13 and 2.14), calling :func:`instance_norm`."""
    if use_input_stats:
        size = input.size()  # _verify_spatial_size
        values = 1
        for extent in size[2:]:
            values *= extent
        if values == 1:
            raise ValueError(f"Expected more than 1 spatial element when training, got input size {size}")
    return instance_norm(
        input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, torch.backends.cudnn.enabled
    )


def _on_logical_cuda(args, kwargs) -> bool:
    first = args[0] if args else kwargs.get("input")
    return isinstance(first, MetaTensor) and first.device.type == "cuda"


composites.register_override(
    _batch_norm, batch_norm, lambda args, kwargs: not kwargs and _on_logical_cuda(args, kwargs)
)
composites.register_override(torch.nn.functional.batch_norm, functional_batch_norm, _on_logical_cuda)
composites.register_override(
    _instance_norm, instance_norm, lambda args, kwargs: not kwargs and _on_logical_cuda(args, kwargs)
)
composites.register_override(torch.nn.functional.instance_norm, functional_instance_norm, _on_logical_cuda)
