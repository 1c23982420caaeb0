"""Batch norm on a logical GPU runs cuDNN's kernel where a real GPU does.

Note [Batch norm on a logical GPU] in rules/batch_norm_cuda.py.  Two references:

* forward, on a CUDA build of torch (the 2.14 leg's wheel, which runs on
  CPU): FakeTensors on ``cuda`` carry CUDA's keys, so torch's own C++
  composite chooses the backend (``_select_batch_norm_backend``), and a
  ``TorchDispatchMode`` inside the FakeTensorMode logs what a GPU dispatches.
  A fake CUDA backward needs a CUDA context, so it is not run there.
* backward, on every build: torch's compiled autograd formula for
  ``cudnn_batch_norm`` run on plain meta tensors and logged -- the formula
  is device-independent C++ (``cudnn_batch_norm_backward`` in training after
  ``grad.contiguous(input.suggest_memory_format())``, the native backward in
  eval), so this is the sequence a GPU dispatches.

The choice's conditions, as Normalization.cpp states them, are checked on
both builds; on the CUDA build each is also held to the fake-CUDA oracle.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metadispatch as md
from metadispatch.testing import Call, _EagerLog, trace_calls

CUDNN, NATIVE = "aten.cudnn_batch_norm.default", "aten.native_batch_norm.default"
CL = torch.channels_last


def _fake_cuda_ok() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    bn = nn.BatchNorm1d(2)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            bn.to("cuda")(torch.ones(2, 2, 3).to("cuda"))
    except (RuntimeError, AssertionError):
        return False
    return True


needs_fake_cuda = pytest.mark.skipif(not _fake_cuda_ok(), reason="this torch build cannot make fake CUDA tensors")


def _bn(dim, features=3, dtype=torch.float32, train=True, **kwargs):
    m = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[dim](features, **kwargs)
    return m.to(dtype).train(train)


def _input(shape, dtype=torch.float32, channels_last=False):
    x = torch.randn(shape).to(dtype)
    return x.contiguous(memory_format=CL) if channels_last else x


def _forward(m, x):
    return m(x)


def _step(m, x):
    m(x).float().square().sum().backward()


def _cuda_calls(module, x):
    """What a GPU dispatches for ``module(x)`` (forward only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = copy.deepcopy(module)
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = m.to("cuda")
        x = x.to("cuda")
        with _EagerLog() as log:
            m(x)
    return log.calls


def _traced(fn, module, x, **kwargs):
    return trace_calls(md.tracer(device="cuda", **kwargs)(fn, copy.deepcopy(module), x))


def _ops(calls):
    return [c.op for c in calls]


# (module, input): each condition of _select_batch_norm_backend on its own
CONDITIONS = {
    "fp32_2d": (lambda: _bn(4), lambda: _input((2, 3, 4, 4)), CUDNN),
    "fp32_eval": (lambda: _bn(4, train=False), lambda: _input((2, 3, 4, 4)), CUDNN),
    "fp16_input_fp32_weight": (lambda: _bn(4), lambda: _input((2, 3, 4, 4), torch.float16), CUDNN),
    "fp16_model": (lambda: _bn(4, dtype=torch.float16), lambda: _input((2, 3, 4, 4), torch.float16), NATIVE),
    "bf16_input": (lambda: _bn(4), lambda: _input((2, 3, 4, 4), torch.bfloat16), NATIVE),
    "bf16_model": (lambda: _bn(4, dtype=torch.bfloat16), lambda: _input((2, 3, 4, 4), torch.bfloat16), NATIVE),
    "fp64": (lambda: _bn(4, dtype=torch.float64), lambda: _input((2, 3, 4, 4), torch.float64), CUDNN),
    "channels_last": (lambda: _bn(4), lambda: _input((2, 3, 4, 4), channels_last=True), CUDNN),
    "bn1d_3d_input": (lambda: _bn(3), lambda: _input((2, 3, 5)), CUDNN),
    "bn1d_2d_input": (lambda: _bn(2), lambda: _input((4, 3)), NATIVE),
    "bn3d": (lambda: _bn(5), lambda: _input((2, 3, 2, 3, 2)), CUDNN),
    "no_affine": (lambda: _bn(4, affine=False), lambda: _input((2, 3, 4, 4)), NATIVE),
    "no_running_stats_train": (lambda: _bn(4, track_running_stats=False), lambda: _input((2, 3, 4, 4)), CUDNN),
    "no_running_stats_eval": (
        lambda: _bn(4, train=False, track_running_stats=False),
        lambda: _input((2, 3, 4, 4)),
        CUDNN,  # no statistics: the module normalises with the batch's, training=True
    ),
    "small_eps": (lambda: _bn(4, eps=1e-7), lambda: _input((2, 3, 4, 4)), CUDNN),  # cuDNN 9: minimum 0.0
    "eval_eps_zero": (lambda: _bn(4, train=False, eps=0.0), lambda: _input((2, 3, 4, 4)), CUDNN),
    "eval_batch_65535": (lambda: _bn(4, 1, train=False), lambda: torch.randn(65535, 1, 1, 1), CUDNN),
    "eval_batch_65536": (lambda: _bn(4, 1, train=False), lambda: torch.randn(65536, 1, 1, 1), NATIVE),
}
# past the training batch limit and 32-bit indexing: too large to build as real
# inputs, so only through the mode's own factories (test_limits_of_size)


def _bn_op(calls):
    return next(op for op in _ops(calls) if "batch_norm" in op)


@pytest.mark.parametrize("name", list(CONDITIONS))
def test_backend_follows_torchs_rule(name):
    module, x, expected = CONDITIONS[name]
    assert _bn_op(_traced(_forward, module(), x())) == expected


@needs_fake_cuda
@pytest.mark.parametrize("name", list(CONDITIONS))
def test_forward_equals_fake_cuda(name):
    """Op for op, with every output's shape, dtype and strides, as a GPU dispatches."""
    module, make_x, expected = CONDITIONS[name]
    m, x = module(), make_x()
    real = _cuda_calls(m, x)
    assert _bn_op(real) == expected  # the table above is torch's own answer
    assert _traced(_forward, m, x) == real


INSTANCE = {
    "affine_1d": (lambda: nn.InstanceNorm1d(3, affine=True), (2, 3, 5), CUDNN),
    "affine_2d_fp16_input": (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, 4, 4), CUDNN),
    "plain_3d": (lambda: nn.InstanceNorm3d(3), (2, 3, 2, 3, 2), NATIVE),
    "running_stats_train": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (2, 3, 4, 4), CUDNN),
    "running_stats_eval": (
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True).eval(),
        (2, 3, 4, 4),
        CUDNN,
    ),
}


def _instance_case(name):
    module, shape, expected = INSTANCE[name]
    dtype = torch.float16 if "fp16" in name else torch.float32
    return module(), torch.randn(shape).to(dtype), expected


@pytest.mark.parametrize("name", list(INSTANCE))
def test_instance_norm_backend(name):
    """An affine instance norm is a cuDNN batch norm over (1, N*C, ...) on a GPU."""
    m, x, expected = _instance_case(name)
    traced = _traced(_forward, m, x)
    assert _bn_op(traced) == expected
    assert traced[_ops(traced).index(expected)].outputs[0][0] == (1, x.shape[0] * x.shape[1], *x.shape[2:])


@needs_fake_cuda
@pytest.mark.parametrize("name", list(INSTANCE))
def test_instance_norm_equals_fake_cuda(name):
    m, x, _ = _instance_case(name)
    assert _traced(_forward, m, x) == _cuda_calls(m, x)


def test_instance_norm_backward_runs_cudnns():
    m, x, _ = _instance_case("affine_2d_fp16_input")
    assert "aten.cudnn_batch_norm_backward.default" in _ops(_traced(_step, m, x))


@needs_fake_cuda
@pytest.mark.parametrize("train", [True, False])
def test_under_cuda_autocast_equals_fake_cuda(train):
    """Under autocast(float16) a convolution hands BatchNorm a float16 input
    with float32 parameters: cuDNN's mixed case."""
    from tests.gpu.test_autocast_cuda import _cuda_calls as autocast_calls
    from tests.gpu.test_autocast_cuda import _same, _traced_calls

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4))
    model.train(train)
    x = torch.randn(2, 3, 8, 8)
    real = autocast_calls(_forward, model, (x,), torch.float16)
    assert _ops(real).count(CUDNN) == 2
    _same(real, _traced_calls(_forward, model, (x,), torch.float16))


def test_cudnn_switch_and_the_cache():
    m, x = _bn(4), _input((2, 3, 4, 4))
    assert _bn_op(_traced(_forward, m, x)) == CUDNN  # warms the metadata cache ...
    with torch.backends.cudnn.flags(enabled=False):  # ... which must not answer for the other choice
        assert _bn_op(_traced(_forward, m, x)) == NATIVE
    assert _bn_op(_traced(_forward, m, x)) == CUDNN


@needs_fake_cuda
def test_cudnn_switch_equals_fake_cuda():
    m, x = _bn(4), _input((2, 3, 4, 4))
    with torch.backends.cudnn.flags(enabled=False):
        real = _cuda_calls(m, x)
        assert _bn_op(real) == NATIVE
        assert _traced(_forward, m, x) == real


def test_limits_of_size():
    """Training batches up to 880,801 and inputs under 2**31 - 1 elements go to cuDNN."""

    def bn(shape):
        def fn(m):
            return m(torch.empty(shape, device="cuda"))

        return _bn_op(trace_calls(md.tracer(device="cuda")(fn, nn.BatchNorm2d(shape[1]))))

    assert bn((880801, 1, 1, 1)) == CUDNN
    assert bn((880802, 1, 1, 1)) == NATIVE
    assert bn((2, 1, 2**30 - 1, 1)) == CUDNN
    assert bn((1, 1, 2**31 - 1, 1)) == NATIVE


def test_functional_and_torch_batch_norm():
    w, b, rm, rv = torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3)
    x = torch.randn(2, 3, 4)

    def functional(x, *stats):
        return F.batch_norm(x, stats[2], stats[3], stats[0], stats[1], training=True)

    def direct(x, *stats, eps):
        return torch.batch_norm(x, stats[0], stats[1], stats[2], stats[3], False, 0.1, eps, True)

    def ops(fn, **kw):
        return _ops(trace_calls(md.tracer(device="cuda")(lambda *a: fn(*a, **kw), x, w, b, rm, rv)))

    assert CUDNN in ops(functional)
    assert CUDNN in ops(direct, eps=0.0)
    # below cuDNN's minimum epsilon (0.0); F.batch_norm refuses it, torch.batch_norm does not
    assert ops(direct, eps=-1e-3) == ["aten.empty.memory_format", NATIVE]


def test_errors_are_torchs():
    m = _bn(4)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        md.tracer(device="cuda")(_forward, m, torch.randn(1, 3, 1, 1))
    with pytest.raises(ValueError, match="eps must be positive during training"):
        md.tracer(device="cuda")(_forward, _bn(4, eps=0.0), torch.randn(2, 3, 4, 4))
    with pytest.raises(RuntimeError, match="running_mean should contain 4 elements not 3"):
        md.tracer(device="cuda")(_forward, m, torch.randn(2, 4, 3, 3))


def _autograd_of_cudnn_bn(module, x):
    """torch's compiled autograd formula for cudnn_batch_norm, run on meta tensors and logged."""
    params = [p.detach().to("meta").requires_grad_() for p in (module.weight, module.bias)]
    stats = [s.to("meta") for s in (module.running_mean, module.running_var)]
    with _EagerLog() as log:
        x_c = x.to("meta").contiguous(memory_format=md._compat.suggest_memory_format(x))
        out = torch.ops.aten.cudnn_batch_norm(x_c, *params, *stats, module.training, 0.1, module.eps)
        out[0].float().square().sum().backward()
    return log.calls


def _from(calls, op):
    """The calls from ``op`` on, devices left out (the reference ran on meta)."""
    i = _ops(calls).index(op)
    return [Call(c.op, tuple(m[:4] for m in c.outputs)) for c in calls[i:]]


@pytest.mark.parametrize(
    ("train", "channels_last", "dtype"),
    [
        (True, False, torch.float32),
        (True, True, torch.float32),
        (False, True, torch.float32),
        (True, False, torch.float16),
    ],
)
def test_backward_is_torchs_formula(train, channels_last, dtype):
    m, x = _bn(4, train=train), _input((2, 3, 4, 4), dtype, channels_last)
    traced = _traced(_step, m, x)
    backward = "aten.cudnn_batch_norm_backward.default" if train else "aten.native_batch_norm_backward.default"
    assert backward in _ops(traced)
    assert _from(traced, CUDNN) == _from(_autograd_of_cudnn_bn(m, x), CUDNN)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("wants", ["weight,bias", "input,weight,bias", "input", "bias"])
def test_logical_cpu_records_what_the_cpu_dispatches(wants, channels_last):
    """A logical CPU keeps the native path, and its backward leaves the
    gradients nobody asked for undefined, as the CPU kernel does."""
    m, x = _bn(4), _input((2, 3, 4, 4), channels_last=channels_last)
    m.weight.requires_grad_("weight" in wants)
    m.bias.requires_grad_("bias" in wants)
    real, x_real = copy.deepcopy(m), x.clone().requires_grad_("input" in wants)  # fresh leaves: no .grad yet
    with _EagerLog() as log:
        _step(real, x_real)
    assert NATIVE in _ops(log.calls)
    x_traced = x.clone().requires_grad_("input" in wants)
    assert trace_calls(md.tracer(device="cpu")(_step, copy.deepcopy(m), x_traced)) == log.calls


def test_logical_cpu_instance_norm_unchanged():
    m, x, _ = _instance_case("running_stats_train")
    real = copy.deepcopy(m)
    with _EagerLog() as log:
        _step(real, x)
    assert trace_calls(md.tracer(device="cpu")(_step, copy.deepcopy(m), x)) == log.calls


def test_meta_tensors_without_a_mode():
    m = md.to_meta(_bn(4), device="cuda")
    with _EagerLog() as log:
        m(md.to_meta(torch.randn(2, 3, 4, 4), device="cuda"))
    assert CUDNN in _ops(log.calls)
