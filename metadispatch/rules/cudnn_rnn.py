"""RNNs on a logical GPU: the cuDNN kernel a real GPU runs, ``_cudnn_rnn``.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` call ``_VF.lstm``/``gru``/``rnn_tanh``/
``rnn_relu``, C++ composites that send a CUDA input to cuDNN (``use_cudnn`` in
aten/src/ATen/native/RNN.cpp) and anything else to the generic per-step cell
decomposition.  A logical GPU's tensors are meta tensors to C++, so the
composite would take the generic path; under a MetaMode a Python version of
the cuDNN branch (``_cudnn_impl`` in aten/src/ATen/native/cudnn/RNN.cpp,
``cudnn_branch.py``) is called instead (Note [Composite overrides]), and the
rules below answer the ops it records the way cuDNN's kernels shape their
outputs.

Note [cuDNN RNNs on a logical GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Ported, with the C++ each piece follows (pytorch/pytorch's cudnn/RNN.cpp at
commit 00fc08aa, and an RNN.cpp newer than 2.14: it holds a MIOpen RNN
probe whose message neither installed binary has; the 2.13 and 2.14
sources could not be fetched whole here.  Older copies of RNN.cpp call
``cudnn_is_acceptable`` alone, before bfloat16 RNNs; both installed
binaries hold ``supportsBFloat16RNNWithCuDNN``, so both have ``use_cudnn``):

- the choice (``use_cudnn``, RNN.cpp; ``cudnn_is_acceptable``,
  TypeProperties.cpp; ``supportsBFloat16RNNWithCuDNN``, CUDAHooks.cpp): a
  CUDA input with elements, ``torch.backends.cudnn.enabled``, and float16,
  float32, float64, or bfloat16 where the profile's SM is 8.0 or newer and
  its cuDNN 9.13 or newer.  Otherwise the generic path stays, as on a GPU.
  torch 2.14.1's ``cudnn_is_acceptable`` was checked on FakeTensors (it no
  longer looks at the dtype); torch 2.13.0's CPU build cannot be asked, and
  its binary holds the same ``supportsBFloat16RNNWithCuDNN``, so it is
  assumed the same.  The cuDNN version it compares is the one the wheel was
  built with; the profile's (``cudnn_version``, the wheel's required
  runtime) stands in for it.  Packed sequences take cuDNN too
  (``lstm.data``), with the batch sizes as a list, read from the known value
  of ``batch_sizes`` (Note [Packed sequences] in values/composites.py).  The
  choice is made above the dispatch, at each call of the composite, and the
  rules below read no global switch, so no cached answer depends on it
  (toggling ``torch.backends.cudnn.enabled`` between traces in one process
  changes the trace: tests/gpu/test_cudnn_rnn.py);
- ``_cudnn_rnn``'s outputs (``_cudnn_rnn`` in cudnn/RNN.cpp): the output is
  made sequence-first and transposed for ``batch_first``, so its strides are
  ``(O, B*O, 1)`` there -- torch's meta kernel says contiguous, which no GPU
  gives; ``hy``, ``cy`` (``[0]`` without a cell state), the reserve (u8), and
  the flat weight buffer;
- ``_cudnn_rnn_backward`` (``_cudnn_rnn_backward_input``/``_weight``): ``dx``
  laid out as the output, ``dhx``/``dcx`` contiguous, and the weight
  gradients as views into one buffer the size of the weights' when the
  module has biases, else fresh tensors (``_copyParams``);
- dropout between layers in training (``get_dropout_state``): the first
  such call in a trace records ``_cudnn_init_dropout_state``, and every
  cuDNN RNN call after it on that trace is handed that state, as the
  process-wide cache does (MetaTensors used without a mode get none: no
  trace holds it).

What is not exact, and why:

- **sizes only cuDNN knows.**  The reserve (``cudnnGetRNNTempSpaceSizes``,
  which holds what backward needs: the gates of every step), the dropout
  state (``cudnnDropoutGetStatesSize``) and the kernels' workspaces are
  asked of cuDNN at run time.  The reserve is recorded as torch's meta kernel
  records it (``u8[0]``), the dropout state likewise, and workspaces are not
  placed; ``md.memory`` therefore counts these calls low, and says so when
  printed (``Memory.unsized``).  The flat weight buffer's length is the sum
  of the weights and of both biases of every layer (cuDNN's descriptor always
  has two biases, so a module without biases has zeros there), assuming
  cuDNN pads nothing between them.  The weight gradients are views of one
  buffer laid out as cuDNN's weight space is: every matrix (layer by layer,
  direction by direction, ``w_ih`` then ``w_hh``), then every bias in the
  same order -- the offsets a real H100 gave a 2-layer LSTM's and a
  bidirectional GRU's gradients (tools/gpu_conformance.py); where a
  projection's ``w_hr`` goes was not measured (after its layer's ``w_hh``
  here);
- **weights are never flat.**  A real module on a GPU keeps its weights in
  one buffer (``flatten_parameters`` calls ``_cudnn_rnn_flatten_weight``
  when it is built or moved); metadispatch's MetaTensors are separate
  tensors (a MetaTensor's ``data_ptr()`` is 0, so ``flatten_parameters``
  sees them as aliased and does nothing), so every call takes the path a
  GPU takes for a module whose weights are not flat: ``_cudnn_rnn`` copies
  them into a fresh buffer, kept for backward (one copy of the weights per
  call more than a flattened module holds), and torch's warning about it is
  not raised;
- a real run's composite also probes the weights' storage
  (``try_get_weight_buf``: ``empty([0])``, ``set_(storage)``) and draws the
  dropout seed (``empty``, ``random_``, ``item``) with calls of their own;
  neither is recorded (the probe allocates nothing; the seed is data), and
  the state is recorded as made from seed 0.

``_cudnn_rnn`` has no FLOP formula in torch (FlopCounterMode counts it as
0); ``md.flops`` lists it under "no formula".
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule

aten = torch.ops.aten

# cudnnRNNMode_t
RNN_RELU, RNN_TANH, LSTM, GRU = 0, 1, 2, 3
_GATES = {RNN_RELU: 1, RNN_TANH: 1, LSTM: 4, GRU: 3}


def _layers(mode, input_size, hidden_size, proj_size, num_layers, bidirectional):
    """Each pseudo-layer's (w_ih, w_hh, b_ih, b_hh, w_hr) element counts, in cuDNN's order."""
    gates, out = _GATES[mode] * hidden_size, proj_size or hidden_size
    dirs = 2 if bidirectional else 1
    for layer in range(num_layers):
        width = input_size if layer == 0 else out * dirs
        for _ in range(dirs):
            yield gates * width, gates * out, gates, gates, proj_size * hidden_size


def weight_count(mode, input_size, hidden_size, proj_size, num_layers, bidirectional) -> int:
    """Elements of cuDNN's flat weight buffer (Note [cuDNN RNNs on a logical GPU]: packed, two biases)."""
    return sum(sum(p) for p in _layers(mode, input_size, hidden_size, proj_size, num_layers, bidirectional))


def _seq_first(shape, batch_first, packed):
    return (shape[1], shape[0], *shape[2:]) if batch_first and not packed else tuple(shape)


def _like_cudnn(shape, t, batch_first, packed, dtype=None):
    """Made sequence-first and transposed back for ``batch_first``, as cuDNN's kernels make it."""
    out = t.new_empty(_seq_first(shape, batch_first, packed), dtype=dtype)
    return out.transpose(0, 1) if batch_first and not packed else out


def _sizes(input, hx, hidden_size, proj_size, num_layers, bidirectional, batch_first, batch_sizes):
    packed = len(batch_sizes) != 0
    steps_batch = _seq_first(input.shape[:2], batch_first, packed)
    batch = batch_sizes[0] if packed else steps_batch[1]
    stack = num_layers * (2 if bidirectional else 1)
    out = (proj_size or hidden_size) * (2 if bidirectional else 1)
    output = (input.shape[0], out) if packed else (*input.shape[:2], out)
    return output, (stack, batch, proj_size or hidden_size), (stack, batch, hidden_size)


def _check_attributes(input, params, hiddens) -> None:
    """``check_attributes(..., check_dtype=true)`` in aten/src/ATen/native/RNN.h."""
    for name, tensors in (("hidden", hiddens), ("parameter", params)):
        for t in tensors:
            if t is not None and t.device != input.device:
                raise RuntimeError(
                    f"Input and {name} tensors are not at the same device, found input tensor at "
                    f"{input.device} and {name} tensor at {t.device}"
                )
            if t is not None and t.dtype != input.dtype:
                raise RuntimeError(
                    f"Input and {name} tensors are not the same dtype, found input tensor with "
                    f"{input.dtype} and {name} tensor with {t.dtype}"
                )


@builtin_rule(aten._cudnn_rnn.default)
def cudnn_rnn(
    input,
    weight,
    weight_stride0,
    weight_buf,
    hx,
    cx,
    mode,
    hidden_size,
    proj_size,
    num_layers,
    batch_first,
    dropout,
    train,
    bidirectional,
    batch_sizes,
    dropout_state,
):
    """``_cudnn_rnn`` in cudnn/RNN.cpp: (output, hy, cy, reserve, weight_buf)."""
    torch._check(mode in _GATES, lambda: f"_cudnn_rnn: unrecognized cuDNN RNN mode {mode}")
    _check_attributes(input, weight, (hx, cx))
    torch._check(mode == LSTM or cx is None, lambda: "rnn: illegal defined cx for non-LSTM RNN")
    torch._check(hx.is_contiguous(), lambda: "rnn: hx is not contiguous")
    packed = len(batch_sizes) != 0
    output_size, hidden, cell = _sizes(
        input, hx, hidden_size, proj_size, num_layers, bidirectional, batch_first, batch_sizes
    )
    if cx is not None:
        torch._check(tuple(cx.shape) == cell, lambda: f"Expected cell size {list(cell)}, got {list(cx.shape)}")
    output = _like_cudnn(output_size, input, batch_first, packed)
    hy = hx.new_empty(hidden)
    cy = cx.new_empty(cell) if cx is not None else hx.new_empty((0,))
    reserve = input.new_empty((0,), dtype=torch.uint8)  # its size is cuDNN's (the Note)
    if weight_buf is None:  # the weights are copied into a buffer of cuDNN's layout
        count = weight_count(mode, input.shape[-1], hidden_size, proj_size, num_layers, bidirectional)
        weight_buf = input.new_empty((count,))
    return output, hy, cy, reserve, weight_buf


def _weight_grads(weight, weight_stride0, weight_buf, has_proj):
    """``_cudnn_rnn_backward_weight``'s gradients: views into one buffer when the
    module has biases (``_viewParams``), else fresh tensors (``_copyParams``)."""
    per_layer = 5 if has_proj else 4  # get_parameters always includes both biases
    if per_layer != weight_stride0:
        return [torch.empty_like(w, memory_format=torch.contiguous_format) for w in weight]
    dw = torch.zeros_like(weight_buf)
    # cuDNN's weight space: every matrix, layer by layer and direction by
    # direction, then every bias in the same order (the Note)
    order = [i for i, w in enumerate(weight) if w.dim() > 1] + [i for i, w in enumerate(weight) if w.dim() <= 1]
    offsets, offset = {}, 0
    for i in order:
        offsets[i] = offset
        offset += weight[i].numel()
    return [dw.as_strided(w.shape, _contiguous_strides(w.shape), offsets[i]) for i, w in enumerate(weight)]


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@builtin_rule(aten._cudnn_rnn_backward.default)
def cudnn_rnn_backward(
    input,
    weight,
    weight_stride0,
    weight_buf,
    hx,
    cx,
    output,
    grad_output,
    grad_hy,
    grad_cy,
    mode,
    hidden_size,
    proj_size,
    num_layers,
    batch_first,
    dropout,
    train,
    bidirectional,
    batch_sizes,
    dropout_state,
    reserve,
    output_mask,
):
    """``_cudnn_rnn_backward`` in cudnn/RNN.cpp: (dx, dhx, dcx, dw)."""
    if grad_output is None and grad_hy is None and grad_cy is None:
        return None, None, None, [None] * len(weight)
    torch._check(bool(train), lambda: "cudnn RNN backward can only be called in training mode")
    packed = len(batch_sizes) != 0
    _, hidden, cell = _sizes(input, hx, hidden_size, proj_size, num_layers, bidirectional, batch_first, batch_sizes)
    dx = _like_cudnn(tuple(input.shape), input, batch_first, packed)  # computed always: it updates the reserve
    dhx = hx.new_empty(hidden)
    dcx = cx.new_empty(cell) if cx is not None else None
    dw = _weight_grads(weight, weight_stride0, weight_buf, proj_size != 0) if output_mask[3] else []
    return dx, dhx, dcx, dw


@builtin_rule(aten._cudnn_rnn_flatten_weight.default)
def cudnn_rnn_flatten_weight(
    weight_arr, weight_stride0, input_size, mode, hidden_size, proj_size, num_layers, batch_first, bidirectional
):
    """The flat buffer, as torch's C++ meta kernel (``_cudnn_rnn_flatten_weight_meta``)
    answers it -- without asking cuDNN for its length (the Note) and, like
    that kernel, without moving the weights into it."""
    torch._check(len(weight_arr) > 0, lambda: "empty weight list")
    torch._check(mode in _GATES, lambda: f"_cudnn_rnn_flatten_weight: unrecognized cuDNN RNN mode {mode}")
    count = weight_count(mode, input_size, hidden_size, proj_size, num_layers, bidirectional)
    return weight_arr[0].new_zeros((count,))


@builtin_rule(aten._cudnn_init_dropout_state.default)
def cudnn_init_dropout_state(dropout, train, dropout_seed, *, dtype=None, layout=None, device=None, pin_memory=None):
    """cuDNN's dropout state: its size is ``cudnnDropoutGetStatesSize``'s (the Note)."""
    return torch.empty((0,), dtype=dtype or torch.uint8, device=device)
