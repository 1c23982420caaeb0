"""MetaTensor reports what a real tensor would, and refuses to read data."""

import pytest
import torch

import metadispatch as md


def _meta_and_real(fn, *shapes, device="cpu"):
    real = [torch.randn(*s) for s in shapes]
    meta = [md.to_meta(r, device=device) for r in real]
    return fn(*meta), fn(*real)


def _same_metadata(m, r):
    assert isinstance(m, md.MetaTensor)
    assert m.shape == r.shape
    assert m.dtype == r.dtype
    assert m.stride() == r.stride()
    assert m.storage_offset() == r.storage_offset()
    assert m.layout == r.layout
    assert m.requires_grad == r.requires_grad


@pytest.mark.parametrize(
    "fn,shapes",
    [
        (lambda x: x.t(), [(3, 4)]),
        (lambda x: x[1:, ::2], [(4, 6)]),
        (lambda x, y: x @ y, [(3, 4), (4, 5)]),
        (lambda x: x.permute(2, 0, 1).contiguous(), [(2, 3, 4)]),
        (lambda x: x.expand(3, 4, 5), [(4, 1)]),
        (lambda x: torch.nn.functional.softmax(x, -1), [(2, 7)]),
        (lambda x: x.transpose(0, 1) + 1, [(3, 5)]),
        (lambda x: x.to(torch.float16).sum(0), [(3, 5)]),
    ],
)
def test_tensor_metadata_matches_real_cpu(fn, shapes):
    m, r = _meta_and_real(fn, *shapes)
    _same_metadata(m, r)
    assert m.device == torch.device("cpu")


def test_tensor_logical_cuda_device_on_cpu_only_host():
    x = md.to_meta(torch.ones(3, 4), device="cuda:1")
    y = (x @ x.T).relu()
    assert y.device == torch.device("cuda:1")
    assert y.is_cuda and not y.is_cpu and not y.is_meta
    assert y.get_device() == 1


def test_tensor_autograd_produces_meta_grads_on_logical_cuda():
    w = md.to_meta(torch.randn(4, 5, requires_grad=True), device="cuda")
    x = md.to_meta(torch.randn(3, 4), device="cuda")
    (x @ w).sum().backward()
    assert isinstance(w.grad, md.MetaTensor)
    assert w.grad.shape == (4, 5)
    assert w.grad.device == torch.device("cuda:0")


def test_tensor_inplace_returns_same_object():
    x = md.to_meta(torch.ones(2, 3))
    assert x.add_(1) is x
    assert x.mul_(x) is x
    x.unsqueeze_(0)  # metadata-changing in-place ops change the tensor itself
    assert x.shape == (1, 2, 3)


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.view(6),
        lambda x: x.t(),
        lambda x: x[0],
        lambda x: x.unsqueeze(0),
        lambda x: x.detach(),
    ],
)
def test_tensor_views_report_base_like_real(view):
    real = torch.ones(2, 3)
    x = md.to_meta(real)
    v, rv = view(x), view(real)
    assert v._is_view() == rv._is_view()
    assert (v._base is x) == (rv._base is real)


@pytest.mark.parametrize(
    "make",
    [
        lambda: md.to_meta(torch.ones(2, 3)),
        lambda: md.to_meta(torch.ones(())),
        lambda: md.to_meta(torch.ones(2, 3, requires_grad=True)) * 2,
        lambda: md.to_meta(torch.ones(4, 4)).t()[1:],
        lambda: torch.nn.Parameter(md.to_meta(torch.ones(2), device="cuda:3")),
    ],
)
def test_tensor_repr_never_fails(make):
    t = make()
    text = repr(t)
    assert text.startswith("MetaTensor(")
    assert str(t) == text and f"{t}" == text


@pytest.mark.parametrize(
    "read,op",
    [
        (lambda x: x.sum().item(), "_local_scalar_dense"),
        (lambda x: bool(x.sum()), "_local_scalar_dense"),
        (lambda x: float(x.sum()), "_local_scalar_dense"),
        (lambda x: int(x.sum()), "_local_scalar_dense"),
        (lambda x: x.tolist(), "tolist"),
        (lambda x: x.numpy(), "numpy"),
        (lambda x: x.nonzero(), "nonzero"),
        (lambda x: x.masked_select(x > 0), "masked_select"),
        (lambda x: torch.unique(x), "unique"),
        (lambda x: x[x > 0], "index.Tensor"),
    ],
)
def test_tensor_reading_data_raises_data_dependent_error(read, op):
    x = md.to_meta(torch.randn(3, 4))
    with pytest.raises(md.DataDependentError, match=op):
        read(x)


def test_tensor_integer_indexing_is_not_data_dependent():
    x = md.to_meta(torch.randn(5, 4))
    idx = md.to_meta(torch.tensor([0, 3]))
    assert x[idx].shape == (2, 4)


def test_tensor_data_setter_keeps_logical_device():
    p = torch.nn.Parameter(md.to_meta(torch.ones(2), device="cuda:0"))
    p.data = md.to_meta(torch.ones(3), device="cuda:2")
    assert p.device == torch.device("cuda:2") and p.shape == (3,)


def test_tensor_data_setter_across_backends_as_real():
    # torch refuses ``cpu_param.data = meta_tensor`` and allows CPU and CUDA
    # data to replace each other (both dense: FSDP2 moves its parameters so);
    # a logical-CPU MetaTensor has CPU's backend keys, a logical GPU's meta's
    # (Note [Data across logical devices]).
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        torch.nn.Parameter(torch.ones(2)).data = torch.ones(3, device="meta")
    p = torch.nn.Parameter(md.to_meta(torch.ones(2), device="cpu"))
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        p.data = md.to_meta(torch.ones(3), device="meta")
    p.data = md.to_meta(torch.ones(3), device="cuda:2")
    assert (
        isinstance(p, torch.nn.Parameter) and p.requires_grad and (p.device, p.shape) == (torch.device("cuda:2"), (3,))
    )
    p.data = md.to_meta(torch.ones(4), device="cpu")
    assert p.device == torch.device("cpu") and p.shape == (4,)


def test_tensor_to_same_device_returns_self_like_real():
    x = md.to_meta(torch.ones(2), device="cuda:0")
    assert x.to("cuda:0") is x
    assert x.to(torch.float32) is x
    y = x.to("cpu")
    assert y is not x and y.device == torch.device("cpu")


def test_tensor_to_other_takes_its_logical_device_and_dtype():
    x = md.to_meta(torch.ones(2), device="cpu")
    other = md.to_meta(torch.ones(1, dtype=torch.float64), device="cuda:1")
    with md.MetaMode():  # no CUDA here (Note [Logical CUDA without CUDA])
        y = x.to(other, non_blocking=True)
    assert y.device == torch.device("cuda:1") and y.dtype == torch.float64
    assert x.to(x) is x and x.to(x, copy=True) is not x


def test_tensor_type_names_the_logical_device_like_real():
    x = md.to_meta(torch.ones(2), device="cuda:1")
    assert x.type() == "torch.cuda.FloatTensor"
    assert md.to_meta(torch.ones(2, dtype=torch.float64)).type() == torch.ones(1, dtype=torch.float64).type()
    y = x.type("torch.cuda.HalfTensor")
    assert (y.dtype, y.device) == (torch.float16, torch.device("cuda:1"))
    z = md.to_meta(torch.ones(2)).type(torch.DoubleTensor)
    assert (z.dtype, z.device) == (torch.float64, torch.device("cpu"))
    assert x.type(x.type()) is x  # nothing to change: the same tensor, as for real ones


def test_tensor_to_cuda_outside_any_mode_on_a_cpu_only_host():
    x = md.to_meta(torch.ones(2))
    assert x.to("cuda").device == torch.device("cuda:0")
    assert x.cuda(1).device == torch.device("cuda:1")
    assert x.to("cuda", torch.half).dtype == torch.float16
    layer = md.to_meta(torch.nn.Linear(2, 2)).cuda()
    assert layer.weight.device == torch.device("cuda:0") and isinstance(layer.weight, torch.nn.Parameter)


def test_tensor_deepcopy_is_a_recorded_clone_keeping_parameters_and_ties():
    import copy

    with md.MetaMode(device="cuda") as mode:
        lin = torch.nn.Linear(3, 2)
        pair = torch.nn.ModuleList([lin, lin])  # the same module twice
        twin = copy.deepcopy(pair)
    assert twin[0] is twin[1] and twin[0].weight is not lin.weight
    assert isinstance(twin[0].weight, torch.nn.Parameter) and twin[0].weight.requires_grad
    assert twin[0].weight.device == torch.device("cuda", 0)
    assert [c.op for c in mode.trace].count("aten.clone.default") == 2  # weight, bias
    assert twin[0].weight._md.meta.id != lin.weight._md.meta.id  # its own record, not a copy


def test_tensor_deepcopy_outside_a_mode():
    import copy

    x = md.to_meta(torch.ones(2, 3), device="cuda:1")
    x.note = ["mine"]
    y = copy.deepcopy(x)
    assert isinstance(y, md.MetaTensor) and y.device == x.device and y.shape == x.shape
    assert y.note == ["mine"] and y.note is not x.note


# -- Note [Storage-level calls on a MetaTensor] --------------------------------


def _share(m, x):
    m.share_memory()  # torch.multiprocessing's recipe
    return m(x).sum()


def _pin(m, x):
    return m(x.pin_memory()).sum()


@pytest.mark.parametrize("step, call", [(_share, "Tensor.share_memory_"), (_pin, "Tensor.pin_memory")])
def test_tensor_storage_level_calls_in_a_step_are_typed_errors_naming_the_line(step, call):
    model, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(
        md.UnsupportedFeatureError, match=rf"{call[len('Tensor.') :]}\(\) on a f32\[.*MetaTensor: it moves"
    ) as e:
        md.trace(step, model, x)
    assert f"while running {call} at test_tensor.py:" in "\n".join(e.value.__notes__)
    assert not any(p.is_shared() for p in model.parameters())  # nothing was moved
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    report = md.check(step, model, x)
    assert isinstance(report.error, md.UnsupportedFeatureError) and report.stop.source.startswith("test_tensor.py:")


def test_tensor_share_memory_runs_eagerly_outside_a_mode():
    model = torch.nn.Linear(4, 2)
    _share(model, torch.randn(3, 4))
    assert all(p.is_shared() for p in model.parameters())


def test_tensor_rebuilt_by_its_type_is_the_parameter_it_stands_for():
    # accelerate's init_empty_weights rebuilds each parameter as
    # type(p)(data, **p.__dict__); under a mode type(p) is MetaTensor
    real = torch.nn.Parameter(torch.ones(2, 3), requires_grad=False)
    eager = type(real)(real.to("meta"), **real.__dict__)
    with md.MetaMode() as mode:
        p = torch.nn.Parameter(torch.ones(2, 3), requires_grad=False)
        before = len(mode.trace.calls)
        rebuilt = type(p)(p.to("meta"), **p.__dict__)
        made = [c.op for c in mode.trace.calls[before:]]
        reference = len(mode.trace.calls)
        torch.nn.Parameter(p.to("meta"), requires_grad=False)
    assert isinstance(rebuilt, md.MetaTensor) and isinstance(rebuilt, torch.nn.Parameter)
    assert (rebuilt.shape, rebuilt.dtype, rebuilt.requires_grad, rebuilt.device) == (
        eager.shape,
        eager.dtype,
        eager.requires_grad,
        eager.device,
    )
    assert rebuilt._md is not p._md and rebuilt._md.meta.id != p._md.meta.id  # its own record
    assert made == [c.op for c in mode.trace.calls[reference:]]  # what nn.Parameter records


def test_tensor_rebuilt_by_its_type_refuses_what_parameter_refuses():
    real = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'sequence_parallel'"):
        torch.nn.Parameter(real, sequence_parallel=True)
    with md.MetaMode():
        p = torch.nn.Parameter(torch.ones(2))
        with pytest.raises(TypeError, match="unexpected keyword argument 'sequence_parallel'"):
            type(p)(p, sequence_parallel=True)
    with pytest.raises(TypeError, match="from a MetaTensor.*got Tensor: use md.to_meta"):
        md.MetaTensor(torch.ones(2))
