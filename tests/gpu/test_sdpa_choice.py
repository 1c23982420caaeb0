"""SDPA on a logical CUDA device records the kernel a GPU of the mode's profile runs
(Note [SDPA backend choice]); the golden table is tests/sdpa_golden.py."""

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import metadispatch as md
from tests.sdpa_golden import CASES, PROFILES

_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
_OPS = {
    "flash": "aten._scaled_dot_product_flash_attention.default",
    "efficient": "aten._scaled_dot_product_efficient_attention.default",
    "cudnn": "aten._scaled_dot_product_cudnn_attention.default",
}


def _tensor(shape, dtype, grad, offset=0, transposed=False):
    if transposed:
        return torch.empty(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2).requires_grad_(grad)
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + offset, dtype=dtype)[offset:].view(shape).requires_grad_(grad)


@contextlib.contextmanager
def _deterministic(how):
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        if how is not None:
            torch.use_deterministic_algorithms(True, warn_only=how == "warn")
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def attention(c) -> None:
    """The case's SDPA call, its tensors made by whatever mode or device context is active."""
    q = _tensor(c["q"], c["dtype"], c["grad"], c["offset"], c["transposed"])
    k = _tensor(c["k"], c["dtype"], c["grad"], c["offset"], c["transposed"])
    mask = None
    if c["mask"] is not None:
        kind, shape = c["mask"]
        mask = torch.ones(shape, dtype=torch.bool) if kind == "bool" else torch.zeros(shape, dtype=c["dtype"])
    F.scaled_dot_product_attention(
        q, k, k, attn_mask=mask, dropout_p=c["dropout"], is_causal=c["causal"], enable_gqa=c["gqa"]
    )


def _recorded_backend(c) -> str:
    flags = [_BACKENDS[b] for b in c["flags"]] if c["flags"] else list(_BACKENDS.values())
    with (
        md.MetaMode(device="cuda", gpu=c["gpu"]) as mode,
        sdpa_kernel(flags, set_priority=c["priority"]),
        _deterministic(c["deterministic"]),
    ):
        attention(c)
    ops = {call.op for call in mode.trace.calls}
    fused = [name for name, op in _OPS.items() if op in ops]
    assert len(fused) <= 1, fused
    return fused[0] if fused else "math"


def _case_id(c) -> str:
    return f"{c['group']}-{c['gpu']}-{str(c['dtype'])[6:]}-{'x'.join(map(str, c['q']))}"


def test_sdpa_golden_table_has_at_least_200_cases_over_every_profile():
    assert len(CASES) >= 200
    assert {c["gpu"] for c in CASES} == set(PROFILES)


@pytest.mark.parametrize("c", CASES, ids=[_case_id(c) for c in CASES])
def test_sdpa_records_the_backend_the_source_chooses(c):
    assert _recorded_backend(c) == c["expected"]


def test_sdpa_default_cuda_profile_is_recorded_and_saved(tmp_path):
    with md.MetaMode(device="cuda") as mode:
        q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16)
        F.scaled_dot_product_attention(q, q, q)
    assert mode.trace.gpu == md.gpu_profile().name == "h100"
    assert any(c.op == _OPS["cudnn"] for c in mode.trace.calls)
    mode.trace.save(tmp_path / "t.json")
    assert md.Trace.load(tmp_path / "t.json").gpu == "h100"


def test_sdpa_profile_is_part_of_the_cache_key():
    def ops(gpu):
        with md.MetaMode(device="cuda", gpu=gpu) as mode:
            q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16)
            F.scaled_dot_product_attention(q, q, q)
        return [c.op for c in mode.trace.calls]

    assert _OPS["cudnn"] in ops("h100") and _OPS["flash"] in ops("a100-80gb") and _OPS["cudnn"] in ops("h100")


def test_sdpa_user_profile_with_old_cudnn_takes_flash():
    # check_prefer_cudnn_attention: cuDNN goes first only with cuDNN newer than 9.15.
    old = dataclasses.replace(md.gpu_profile("h100"), name="h100-old-cudnn", cudnn_version=91000)
    with md.MetaMode(device="cuda", gpu=old) as mode:
        q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16)
        F.scaled_dot_product_attention(q, q, q)
    assert any(c.op == _OPS["flash"] for c in mode.trace.calls)


def test_sdpa_fused_sdp_choice_op_answers_for_the_profile():
    with md.MetaMode(device="cuda", gpu="a100-80gb"):
        q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16)
        assert torch.ops.aten._fused_sdp_choice(q, q, q) == int(SDPBackend.FLASH_ATTENTION)
        assert torch.ops.aten._fused_sdp_choice(q.float(), q.float(), q.float()) == int(SDPBackend.EFFICIENT_ATTENTION)


def test_sdpa_all_backends_disabled_raises_as_torch():
    with md.MetaMode(device="cuda"), sdpa_kernel([SDPBackend.OVERRIDEABLE]):
        q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="No viable backend"):
            F.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("gpu", ["h100", "a100-80gb"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_sdpa_fused_output_and_grads_match_math_metadata(gpu, mask):
    """The fused path's output and gradients have the metadata eager's math path gives."""

    def run(backends, device):
        with md.MetaMode(device=device, gpu=gpu if device == "cuda" else None), sdpa_kernel(backends):
            q = torch.empty(2, 4, 32, 40, dtype=torch.float16, requires_grad=True)
            m = (
                None
                if mask is None
                else (
                    torch.ones(32, 32, dtype=torch.bool)
                    if mask == "bool"
                    else torch.zeros(2, 1, 32, 32, dtype=torch.float16)
                )
            )
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
            out.sum().backward()
            return out.shape, out.dtype, q.grad.shape, q.grad.dtype

    assert run(list(_BACKENDS.values()), "cuda") == run([SDPBackend.MATH], "cpu")


def test_sdpa_transformers_llama_on_h100_records_cudnn_and_peaks_below_math():
    from metadispatch.cli import targets

    small = {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 1000,
    }
    hf = targets.hf_target("llama", small, "cuda", True, 1, 512, torch.bfloat16)

    def peak(backends):
        for p in hf.model.parameters():
            p.grad = None
        with sdpa_kernel(backends):
            t = md.tracer(device="cuda", gpu="h100")(hf.step, hf.model, *hf.inputs)
        return md.memory(t).peak, {c.op for c in t.calls}

    fused, ops = peak(list(_BACKENDS.values()))
    math, math_ops = peak([SDPBackend.MATH])
    assert _OPS["cudnn"] in ops and "aten._scaled_dot_product_cudnn_attention_backward.default" in ops
    assert not any(op in math_ops for op in _OPS.values())
    assert fused < math


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_sdpa_checkpoint_recompute_takes_the_forward_kernel(reentrant):
    # Note [Backward under the function mode]: the recomputed forward ran
    # without the mode's SDPA override, took the math kernel, and
    # torch.utils.checkpoint refused the differing saved tensors.
    from torch.utils.checkpoint import checkpoint

    def block(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def step(q):
        checkpoint(block, q, use_reentrant=reentrant).sum().backward()

    _assert_recompute_takes_the_forward_kernel(step)


def _assert_recompute_takes_the_forward_kernel(step):
    q = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    trace = md.tracer(device="cuda", gpu="h100")(step, q)
    attention = [c.op for c in trace.calls if "attention" in c.op or c.op == "aten.bmm.default"]
    fused = attention[0]
    assert fused.startswith("aten._scaled_dot_product_") and "math" not in fused
    # forward, its recomputation in backward, then the fused backward op
    assert attention == [fused, fused, fused.replace(".default", "_backward.default")]
    return trace, q


def test_sdpa_checkpoint_recompute_under_autograd_grad_takes_the_forward_kernel():
    # The same for torch.autograd.grad (a gradient penalty, a meta-learning
    # step): its engine ran without the mode too (CheckpointError, 9 saved
    # tensors against 7).
    from torch.utils.checkpoint import checkpoint

    def block(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def step(q):
        (g,) = torch.autograd.grad(checkpoint(block, q, use_reentrant=False).sum(), q)
        return g

    trace, q = _assert_recompute_takes_the_forward_kernel(step)
    assert trace.output_meta.shape == q.shape and trace.output_meta.device.type == "cuda"


@pytest.mark.parametrize("how", ["tuple", "dict", "materialize", "create_graph"])
def test_autograd_grad_under_a_mode_answers_as_eager(how):
    # torch.autograd.grad runs through the mode's own copy of its body
    # (_compat.engine_grad): each way of calling it gives eager's answer.
    lin, x = torch.nn.Linear(4, 3), torch.randn(2, 4, requires_grad=True)
    unused = torch.zeros(5, requires_grad=True)

    def step(lin, x, unused):
        y = lin(x).square().sum()
        if how == "tuple":
            return torch.autograd.grad(y, (x, lin.weight))
        if how == "dict":
            return torch.autograd.grad(y, {"x": x, "w": lin.weight})
        if how == "materialize":
            return torch.autograd.grad(y, (x, unused), materialize_grads=True)
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return torch.autograd.grad(g.sum(), lin.weight)

    eager = step(lin, x, unused)
    trace = md.trace(step, lin, x, unused)
    got = trace.output_meta
    if how == "dict":
        assert list(got) == list(eager)
        got, eager = list(got.values()), list(eager.values())
    assert [(m.shape, m.dtype, m.stride) for m in got] == [(e.shape, e.dtype, e.stride()) for e in eager]
    assert md.replay(trace, (lin, x, unused)).ok


_MATH_CASES = [
    (dtype, mask, gqa, scale)
    for dtype in (torch.float32, torch.bfloat16)
    for mask in (None, "float", "bool", "causal")
    for gqa in (False, True)
    for scale in (None, 0.3, -0.3)
]


@pytest.mark.parametrize("dtype, mask, gqa, scale", _MATH_CASES)
def test_sdpa_math_port_dispatches_what_the_cpp_math_body_does(dtype, mask, gqa, scale):
    # Note [The math backend's dropout on a GPU]: the port, with the generic
    # dropout a CPU runs, against the C++ body's eager CPU calls, forward and
    # backward, op for op with every output's metadata.
    from metadispatch.rules.attention_math import math_attention
    from metadispatch.testing import eager_calls

    causal = mask == "causal"
    q = torch.randn(2, 4, 6, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2 if gqa else 4, 6 if causal else 5, 8, dtype=dtype, requires_grad=True)
    m = None
    if mask == "float":  # a mask that needs a gradient: T5's position bias
        m = torch.randn(2, 1, 6, k.shape[2], dtype=dtype, requires_grad=True)
    elif mask == "bool":
        m = torch.rand(6, k.shape[2]) > 0.3

    def cpp(q, k, m):
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(
                q, k, k, attn_mask=m, dropout_p=0.2, is_causal=causal, scale=scale, enable_gqa=gqa
            ).float().sum().backward()

    def port(q, k, m):
        generic = lambda a, p: torch.dropout(a, p, True)  # noqa: E731
        math_attention(q, k, k, m, 0.2, causal, scale, gqa, generic)[0].float().sum().backward()

    def fresh(t):
        return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)

    assert eager_calls(port, fresh(q), fresh(k), fresh(m)) == eager_calls(cpp, q, k, m)


def test_sdpa_math_backend_dropout_on_a_logical_gpu_is_native_dropout():
    # T5's attention in training on an H100 with torch 2.11 (whose efficient
    # kernel took no gradient for its bias) ran the math backend, its dropout
    # as native_dropout; the backend is asked for here.
    def step(q, bias):
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, q, q, attn_mask=bias, dropout_p=0.1).sum().backward()

    q = torch.randn(2, 4, 12, 8, requires_grad=True)
    bias = torch.randn(1, 4, 12, 12, requires_grad=True)
    ops = [c.op for c in md.tracer(device="cuda", gpu="h100")(step, q, bias).calls]
    assert "aten._safe_softmax.default" in ops and ops.count("aten.native_dropout.default") == 1
    assert "aten.bernoulli_.float" not in ops
