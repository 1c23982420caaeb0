"""C++ composites overridden while a MetaMode is entered (Note [Composite overrides])."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import metadispatch as md
from tests.eager_ops import EagerOps


def _plain_meta_split():
    x = torch.empty(4, 6, device="meta")
    return torch.tensor_split(x, torch.tensor([1, 3], device="meta"), 1)


def test_composites_tensor_split_unknown_indices_are_data_dependent():
    x, idx = torch.randn(4, 6), torch.tensor([1, 3])
    with md.MetaMode() as mode:
        with pytest.raises(md.DataDependentError, match="tensor_split"):
            torch.tensor_split(mode.from_tensor(x), mode.from_tensor(idx), 1)


@pytest.mark.parametrize("indices", [[1, 3], [0, 5, 2], 3])
def test_composites_tensor_split_known_indices_match_real(indices):
    x = torch.randn(4, 6)
    real = torch.tensor_split(x, torch.tensor(indices), 1)
    with md.MetaMode():
        got = torch.tensor_split(x, torch.tensor(indices), 1)  # a literal: known value
    assert [(t.shape, t.stride(), t.storage_offset()) for t in got] == [
        (t.shape, t.stride(), t.storage_offset()) for t in real
    ]


def test_composites_override_applies_only_inside_the_mode_also_after_an_exception():
    with pytest.raises(ValueError):
        with md.MetaMode():
            with md.MetaMode():
                x = torch.empty(3, 7)
                assert [t.shape[1] for t in torch.tensor_split(x, torch.tensor([1, 4]), 1)] == [1, 3, 3]
            raise ValueError
    with pytest.raises(RuntimeError, match="on meta"):
        _plain_meta_split()


# Each composite override (Note [Composite overrides]), on MetaTensors made
# by md.to_meta: (function, real arguments; the MetaTensor ones are converted)
_OVERRIDDEN = {
    "tensor_split_unknown_indices": (
        lambda x, i: torch.tensor_split(x, i, 1),
        (torch.randn(4, 6), torch.tensor([1, 3])),
    ),
    "tensor_split_method": (lambda x, i: x.tensor_split(i, dim=1), (torch.randn(4, 6), torch.tensor([1, 3]))),
    "matrix_rank_empty": (torch.linalg.matrix_rank, (torch.zeros(3, 0, 0, dtype=torch.complex128),)),
    "matrix_rank": (torch.linalg.matrix_rank, (torch.randn(3, 4, 4),)),
    "tensor_split_scalar_indices": (lambda x, i: torch.tensor_split(x, i, 1), (torch.randn(4, 6), torch.tensor(2))),
    # (a packed LSTM is not here: md.to_meta's lengths have no known value, so
    # _pack_padded_sequence is data-dependent: Note [Packing with known lengths])
}


def _outcome(fn, args):
    try:
        out = fn(*args)
    except Exception as e:
        return type(e).__name__
    return [(type(t).__name__, t.device, *_layout(t)) for t in (out if isinstance(out, (tuple, list)) else [out])]


@pytest.mark.parametrize("case", sorted(_OVERRIDDEN))
def test_composites_without_a_mode_answer_as_inside_one(case):
    # Note [Composite overrides without a mode]: no plain meta tensor, no
    # "data is not allocated" from the C++ body
    fn, args = _OVERRIDDEN[case]
    torch.manual_seed(0)
    alone = _outcome(fn, [md.to_meta(a) for a in args])
    torch.manual_seed(0)
    with md.MetaMode():
        inside = _outcome(fn, [md.to_meta(a) for a in args])
    assert alone == inside
    assert alone in ("DataDependentError", [("MetaTensor", *o[1:]) for o in _outcome(fn, args)])


# -- scaled_dot_product_attention on a logical CPU (Note [SDPA backend choice]) -----


def _t(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


B, H, L, S, E = 2, 4, 5, 7, 8
_BOOL_MASK = torch.rand(L, S) > 0.3
_SDPA_CASES = {
    "plain": ((_t(B, H, L, E), _t(B, H, S, E), _t(B, H, S, E)), {}),
    "causal_scale": ((_t(B, H, L, E), _t(B, H, S, E), _t(B, H, S, E)), dict(is_causal=True, scale=0.3)),
    "bool_mask_2d": ((_t(B, H, L, E), _t(B, H, S, E), _t(B, H, S, E), _BOOL_MASK), {}),
    "float_mask_4d": ((_t(B, H, L, E), _t(B, H, S, E), _t(B, H, S, E), _t(B, 1, L, S, grad=False)), {}),
    "gqa": ((_t(B, H, L, E), _t(B, 2, S, E), _t(B, 2, S, E)), dict(enable_gqa=True)),
    "float64": ((_t(B, H, L, E, dtype=torch.float64),) * 3, {}),
    "bfloat16": ((_t(B, H, L, E, dtype=torch.bfloat16),) * 3, {}),
    # math on a real CPU too
    "three_dim": ((_t(B, L, E), _t(B, S, E), _t(B, S, E)), {}),
    "value_head_dim": ((_t(B, H, L, E), _t(B, H, S, E), _t(B, H, S, 3)), {}),
    "strided_last_dim": ((_t(B, H, E, L).transpose(-1, -2), _t(B, H, S, E), _t(B, H, S, E)), {}),
    "mask_requires_grad": ((_t(B, H, L, E), _t(B, H, S, E), _t(B, H, S, E), _t(L, S)), {}),
    "mask_3d": ((_t(B, H, L, E), _t(B, H, S, E), _t(B, H, S, E), _t(1, L, S, grad=False)), {}),
    "heads_differ_without_gqa": ((_t(B, H, L, E), _t(B, H, S, E), _t(B, 1, S, E)), {}),
}


def _sdpa_step(*args, **kwargs):
    out = F.scaled_dot_product_attention(*args, **kwargs)
    inputs = [a for a in args if a.requires_grad]
    return (out, *torch.autograd.grad(out.float().sum(), inputs))


def _layout(t):
    return tuple(t.shape), t.stride(), t.dtype, t.device


@pytest.mark.parametrize("case", sorted(_SDPA_CASES))
def test_composites_sdpa_on_logical_cpu_matches_real_ops(case):
    args, kwargs = _SDPA_CASES[case]
    with EagerOps() as real:
        expected = _sdpa_step(*args, **kwargs)
    t = md.trace(_sdpa_step, *args, **kwargs)
    assert [c.op for c in t.calls] == real.ops
    assert [_layout(o) for o in t.output] == [_layout(o) for o in expected]


def test_composites_sdpa_flash_disabled_takes_math_like_real():
    args, kwargs = _SDPA_CASES["plain"]
    with sdpa_kernel(SDPBackend.MATH):
        with EagerOps() as real:
            _sdpa_step(*args, **kwargs)
        t = md.trace(_sdpa_step, *args, **kwargs)
    assert "aten._safe_softmax.default" in real.ops
    assert [c.op for c in t.calls] == real.ops


def test_composites_sdpa_on_logical_cuda_keeps_the_composite():
    args, kwargs = _SDPA_CASES["plain"]
    t = md.tracer(device="cuda")(_sdpa_step, *args, **kwargs)
    assert not any("flash" in c.op for c in t.calls)


def test_composites_sdpa_llama_traces_cpu_flash_and_replays():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 8))
    t = md.trace(lambda ids: model(input_ids=ids).logits, ids)
    ops = {c.op for c in t.calls}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops
    assert "aten._safe_softmax.default" not in ops
    r = md.replay(t, (ids,), module=model)
    assert r.ok, r.mismatches
    torch.testing.assert_close(r.output, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_composites_sdpa_on_logical_cuda_without_a_mode_chooses_as_inside_one():
    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    with md.MetaMode(device="cuda") as mode:  # the default profile, as without a mode
        F.scaled_dot_product_attention(*(mode.from_tensor(q),) * 3)
    with EagerOps() as log:  # sees each op before MetaTensor answers it
        alone = F.scaled_dot_product_attention(*(md.to_meta(q, device="cuda"),) * 3)
    assert isinstance(alone, md.MetaTensor) and alone.device == torch.device("cuda", 0)
    assert log.ops == [c.op for c in mode.trace.calls]
    assert "aten._scaled_dot_product_cudnn_attention.default" in log.ops
