"""``torch.autocast("cuda")`` on a logical GPU casts as CUDA does (issue 15, item 2).

The reference is torch's own C++ autocast: on a CUDA build (the 2.14 leg's
wheel, which runs on CPU), FakeTensors on ``cuda`` carry the CUDA keys, so
C++ ``AutocastCUDA`` casts them, and a ``TorchDispatchMode`` inside the
FakeTensorMode logs what a GPU would dispatch.  Forward passes only: a fake
CUDA backward needs a CUDA context.  A CPU-only build (2.13) cannot make fake
CUDA tensors; there the policy table is still held to the ops torch
registers, and behaviour to torch's documented rules.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metadispatch as md
from metadispatch.gpu import autocast
from metadispatch.testing import trace_calls
from tests import models
from tests.fake_cuda import CudaLog


def _fake_cuda_ok() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    lin = nn.Linear(2, 2)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            lin.to("cuda")(torch.ones(1, 2).to("cuda"))
    except (RuntimeError, AssertionError):
        return False
    return True


needs_fake_cuda = pytest.mark.skipif(not _fake_cuda_ok(), reason="this torch build cannot make fake CUDA tensors")


def _math_attention():
    # A FakeTensor on a host without a GPU cannot ask the device which fused
    # attention kernel it has, and takes the math one; the profiles' choices
    # are pinned by tests/test_sdp_choice.py.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _cuda_calls(fn, module, inputs, dtype):
    """What C++ autocast makes a GPU dispatch for ``fn(module, *inputs)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = copy.deepcopy(module)
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = m.to("cuda")
        xs = [x.to("cuda") for x in inputs]
        # torch.autocast("cuda") turns itself off on a host without a GPU:
        # the switches it sets, set directly.
        before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        torch.autocast_increment_nesting()
        try:
            with CudaLog() as log, _math_attention():
                fn(m, *xs)
        finally:
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled("cuda", before[0])
            torch.set_autocast_dtype("cuda", before[1])
    return log.calls


def _traced_calls(fn, module, inputs, dtype):
    def step(m, *xs):
        with torch.autocast("cuda", dtype=dtype), _math_attention():
            fn(m, *xs)

    return trace_calls(md.tracer(device="cuda")(step, module, *inputs))


def _lifted(calls):
    # A FakeTensorMode lifts a constant (``torch.tensor([])``) without
    # passing ``lift_fresh`` to the modes inside it.
    return [c for c in calls if c.op != "aten.lift_fresh.default"]


def _same(real, traced):
    # Shapes, dtypes and op order; strides of a logical GPU are pinned elsewhere.
    def key(calls):
        return [(c.op, tuple((m[0], m[1]) for m in c.outputs)) for c in calls]

    a, b = key(_lifted(real)), key(_lifted(traced))
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == y, f"call #{i}: CUDA {x}\n  traced {y}"
    assert len(a) == len(b), f"CUDA dispatches {len(a)} calls, the trace {len(b)}"


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x, y):
        h = F.gelu(self.norm(self.a(x)))
        return F.cross_entropy(self.b(h) + self.b(h), y)  # b's weight cast once (the cache)


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn, self.g = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.GroupNorm(2, 8)

    def forward(self, x):
        h = F.interpolate(F.relu(self.bn(self.c(x))), scale_factor=2)
        return F.adaptive_avg_pool2d(self.g(h), 1).flatten(1).softmax(-1)


class _Functions(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = x @ self.w
        n = F.normalize(h) + torch.norm(h, dim=1, keepdim=True) + h.norm(2, 1, keepdim=True)
        s = n.pow(2).sum(-1) + h.square().mean() + torch.rsqrt(h.abs() + 1).sum() + h.exp().log1p().sum()
        e = torch.einsum("ij,jk->ik", h, self.w).sum() + torch.cdist(h, h).sum() + torch.cat([h, x.float()], 0)[:2]
        return (
            s,
            e,
            torch.addcmul(h, h.half().float(), x),
            F.log_softmax(h, -1),
            h.softmax(-1, torch.float32),
            torch.rms_norm(h, [8]),
        )


def _attention(m, x):
    return m(x, x, x, need_weights=False)


CASES = {
    "mlp_cross_entropy": (lambda m, x, y: m(x, y), _Mlp(), lambda: (torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))),
    "conv_bn_interpolate": (lambda m, x: m(x), _Conv(), lambda: (torch.randn(2, 3, 8, 8),)),
    "functions": (lambda m, x: m(x), _Functions(), lambda: (torch.randn(4, 8),)),
    "multihead_attention": (_attention, nn.MultiheadAttention(8, 2, batch_first=True), lambda: (torch.randn(2, 5, 8),)),
    "transformer_layer": (
        lambda m, x: m(x),
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        lambda: (torch.randn(2, 5, 16),),
    ),
}


@needs_fake_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_forward_is_what_cuda_autocast_dispatches(name, dtype):
    fn, module, inputs = CASES[name]
    xs = inputs()
    _same(_cuda_calls(fn, module, xs, dtype), _traced_calls(fn, module, xs, dtype))


_HF = {"llama": models.hf_llama, "gpt2": models.hf_gpt2, "bert": models.hf_bert}


@needs_fake_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_autocast_forward_of_transformers_models_is_what_cuda_autocast_dispatches(name, dtype):
    model, inputs = _HF[name]()

    def fn(m, ids):
        return m(ids)

    model.eval()
    _same(_cuda_calls(fn, model, inputs, dtype), _traced_calls(fn, model, inputs, dtype))


@needs_fake_cuda
def test_autocast_forward_of_a_torchvision_resnet_is_what_cuda_autocast_dispatches():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    _same(
        _cuda_calls(lambda m, x: m(x), model, (x,), torch.bfloat16),
        _traced_calls(lambda m, x: m(x), model, (x,), torch.bfloat16),
    )


def _swin():
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.swin_t(num_classes=10).eval(), (torch.randn(1, 3, 64, 64),)


def _timm_vit():
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10).eval(), (
        torch.randn(1, 3, 224, 224),
    )


def _unet():
    pytest.importorskip("diffusers")
    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    import model_conformance  # the conformance table's UNet2D

    return model_conformance.CONFIGS["diffusers.unet"].build()


@needs_fake_cuda
@pytest.mark.slow
@pytest.mark.parametrize(
    "build", [_swin, _timm_vit, _unet], ids=["torchvision.swin_t", "timm.vit_tiny", "diffusers.unet2d"]
)
def test_autocast_forward_of_vision_models_is_what_cuda_autocast_dispatches(build):
    # Swin writes Python numbers into its attention mask (Note [A Python
    # number written into a GPU tensor]).
    model, inputs = build()

    def fn(m, *xs):
        return m(*xs)

    _same(_cuda_calls(fn, model, inputs, torch.bfloat16), _traced_calls(fn, model, inputs, torch.bfloat16))


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_autocast_training_step_of_transformers_models_runs_on_a_logical_gpu(name):
    model, inputs = _HF[name]()
    opt = torch.optim.AdamW(model.parameters())

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()

    t = md.tracer(device="cuda")(step, *inputs)
    matmuls = [c for c in t.calls if c.op in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")]
    assert matmuls and all(c.output_metas[0].dtype == torch.bfloat16 for c in matmuls)
    assert all(g.dtype == torch.float32 for g in t.grads.values())
    assert all(p.grad is None for p in model.parameters())


def test_policy_table_covers_every_op_torch_registers_for_cuda_autocast():
    # A torch release that adds an op to autocast's lists fails here first.
    assert autocast.registered_names() - set(autocast.POLICIES) == set()
    assert len(autocast.registered_names()) > 100


def test_autocast_step_casts_and_backward_casts_back():
    model = _Mlp()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()

    t = md.tracer(device="cuda")(step, x, y)
    ops = [(c.op, c.output_metas[0].dtype) for c in t.calls if c.output_metas]
    addmm = [d for op, d in ops if op == "aten.addmm.default"]
    assert addmm and all(d == torch.bfloat16 for d in addmm)
    assert ("aten.native_layer_norm.default", torch.float32) in ops
    # Cast to bf16 in the forward: x, a's weight and bias, the f32 activation
    # into b (twice: not a leaf, so not cached), and b's weight and bias once
    # (fp32 leaves that require grad are cached while autocast is on).
    forward = [
        c
        for c in t.calls
        if c.op == "aten._to_copy.default" and c.kwargs.get("dtype") == torch.bfloat16 and c.phase == "forward"
    ]
    assert len(forward) == 7
    assert {n: g.dtype for n, g in t.grads.items()} == {n: torch.float32 for n, _ in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())


def test_cast_cache_lives_while_autocast_does():
    lin = nn.Linear(4, 4)

    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lin(x)
            lin(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lin(x)

    t = md.tracer(device="cuda")(step, torch.randn(2, 4))
    weight_casts = [c for c in t.calls if c.op == "aten._to_copy.default" and c.output_metas[0].shape == (4, 4)]
    assert len(weight_casts) == 2


def test_autocast_off_and_logical_cpu_are_unchanged():
    lin = nn.Linear(4, 4)

    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
            return lin(x)

    t = md.tracer(device="cuda")(step, torch.randn(2, 4))
    assert all(c.op != "aten._to_copy.default" for c in t.calls)

    def cpu_step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return lin(x)

    t = md.trace(cpu_step, torch.randn(2, 4))  # CUDA autocast does nothing to CPU tensors
    assert all(c.op != "aten._to_copy.default" for c in t.calls)


def test_unmodelled_composite_under_autocast_is_refused_with_the_users_line():
    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.pairwise_distance(x, x)  # a C++ composite that calls norm

    with pytest.raises(md.UnsupportedFeatureError, match=r"pairwise_distance: under torch.autocast\('cuda'\)") as e:
        md.tracer(device="cuda")(step, torch.randn(2, 4))
    assert "test_autocast_cuda.py" in "".join(getattr(e.value, "__notes__", []))  # the user's line


def test_banned_binary_cross_entropy_raises_as_on_cuda():
    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.binary_cross_entropy(torch.sigmoid(x), torch.ones_like(x))

    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        md.tracer(device="cuda")(step, torch.randn(2, 4))


def test_nothing_is_left_behind_after_an_error_inside_autocast():
    lin = nn.Linear(4, 4)

    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lin(x)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        md.tracer(device="cuda")(step, torch.randn(2, 4))
    assert not autocast.has_cache()
    assert not torch.is_autocast_enabled("cuda")
    assert torch._C._len_torch_function_stack() == 0


def _inert_cases():
    from torch.testing._internal.common_methods_invocations import op_db

    by_name = {}
    for info in op_db:
        name = info.name.split(".")[-1]
        if name in autocast.INERT_COMPOSITES and name not in by_name:
            by_name[name] = info
    return by_name


@needs_fake_cuda
@pytest.mark.slow
def test_inert_composites_are_ones_cuda_autocast_leaves_alone():
    # INERT_COMPOSITES run as they are under autocast: C++ autocast must
    # dispatch exactly the same ops for them with autocast on and off.
    from torch._subclasses.fake_tensor import FakeTensorMode

    checked = 0
    for name, info in sorted(_inert_cases().items()):
        for dtype in (torch.float32, torch.bfloat16):
            if dtype not in info.supported_dtypes("cuda"):
                continue
            for sample in list(info.sample_inputs("cpu", dtype))[:3]:
                logs = []
                for on in (False, True):
                    with FakeTensorMode(allow_non_fake_inputs=True):
                        s = sample.transform(lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t)
                        torch.set_autocast_enabled("cuda", on)
                        try:
                            with CudaLog() as log:
                                info.op(s.input, *s.args, **s.kwargs)
                        except Exception:
                            log.calls = None
                        finally:
                            torch.set_autocast_enabled("cuda", False)
                    logs.append(log.calls)
                assert logs[0] == logs[1], f"{name} ({dtype}): autocast changes what CUDA dispatches"
                checked += 1
    assert checked > 100


def test_grad_scaler_step_under_check_assumes_finite_gradients_and_steps_the_optimizer():
    # Note [GradScaler's found_inf] (values/assume.py): a made-up "found inf" skipped the
    # optimizer step, and with it the optimizer state a GPU holds.
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())

    def step(x, y):
        scaler = torch.amp.GradScaler("cuda")  # made inside: outside, on a host without CUDA, it disables itself
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    report = md.checker("cuda")(step, torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
    assert report.error is None, str(report)
    ops = [c.op for c in report.trace.calls]
    assert "aten._amp_foreach_non_finite_check_and_unscale_.default" in ops
    assert "aten._amp_update_scale_.default" in ops
    stepped = [c for c in report.trace.calls if c.phase == "optimizer" and c.op.startswith("aten._foreach_addcdiv")]
    assert stepped, "the optimizer did not step"
    # the one assumption: declared at the unscale-and-check, with the user's line, and listed in the trace
    (assumed,) = report.assumptions
    assert assumed.op == "aten._amp_foreach_non_finite_check_and_unscale_.default"
    assert (assumed.value, assumed.basis) == (
        "found_inf = 0",
        "no inf/nan found in the unscaled gradients: GradScaler takes the optimizer step",
    )
    assert assumed.source.startswith("test_autocast_cuda.py:") and assumed.source.endswith(" in step")
    assert report.trace.calls[assumed.index].op == assumed.op and report.trace.assumptions == [assumed]
    read = report.trace.calls[assumed.index + 1]
    assert (read.op, read.outputs[0]) == ("aten._local_scalar_dense.default", 0.0)  # the .item() reads it
    assert not opt.state  # the user's optimizer is untouched


def test_autocast_policy_edges_follow_cudas_rules():
    lin = nn.Linear(4, 4)

    def casts(t):
        return [c.output_metas[0].dtype for c in t.calls if c.op == "aten._to_copy.default"]

    def nested(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a = lin(x)
            with torch.autocast("cuda", enabled=False):
                b = lin(x)  # float32 inside a disabled region, as on CUDA
        return a, b

    t = md.tracer(device="cuda")(nested, torch.randn(2, 4))
    mms = [c.output_metas[0].dtype for c in t.calls if c.op == "aten.addmm.default"]
    assert mms == [torch.bfloat16, torch.float32]

    def uncached(x):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            lin(x)
            lin(x)  # without the cache the weight is cast at each use

    assert len(casts(md.tracer(device="cuda")(uncached, torch.randn(2, 4)))) == 6

    def float64(x):
        with torch.autocast("cuda", dtype=torch.float16):
            return x @ x.t(), (x @ x.t()).softmax(-1)  # doubles are never cast, softmax keeps float64

    t = md.tracer(device="cuda")(float64, torch.randn(3, 3, dtype=torch.float64))
    assert casts(t) == [] and {c.output_metas[0].dtype for c in t.calls if c.output_metas} == {torch.float64}

    def with_out(x, out):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return torch.mm(x, x, out=out)  # an out= overload is not autocast's

    t = md.tracer(device="cuda")(with_out, torch.randn(3, 3), torch.empty(3, 3))
    assert casts(t) == [] and t.calls[-1].output_metas[0].dtype == torch.float32
