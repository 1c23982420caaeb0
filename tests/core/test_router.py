"""The router: user rule -> built-in rule -> native meta -> decomposition -> error."""

import pytest
import torch

import metadispatch as md

aten = torch.ops.aten

_lib = torch.library.Library("mdtest_router", "DEF")
_lib.define("noimpl(Tensor x) -> Tensor")
_lib.impl("noimpl", lambda x: x * 2, "CPU")
_lib.define("ruled(Tensor x, int n) -> Tensor")
_lib.impl("ruled", lambda x, n: x.repeat(n, 1), "CPU")


@torch.library.custom_op("mdtest_router::with_fake", mutates_args=())
def with_fake(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


@with_fake.register_fake
def _(x):
    return x.new_empty(x.shape[1:])


@pytest.fixture
def cleanup():
    registered = []
    yield registered
    for op in registered:
        md.unregister_meta(op)


def test_router_native_meta_kernel_answers_aten_ops():
    t = md.trace(lambda a, b: a @ b, torch.ones(2, 3), torch.ones(3, 4))
    assert [(c.op, c.rule) for c in t] == [("aten.mm.default", "meta")]


def test_router_user_rule_overrides_native_kernel(cleanup):
    @md.register_meta(aten.relu.default)
    def relu_meta(x):
        # A column-major result, which the native kernel would never give.
        return torch.empty_strided(x.shape, (1, x.shape[0]), dtype=x.dtype, device=x.device)

    cleanup.append(aten.relu.default)
    t = md.trace(torch.relu, torch.ones(3, 4))
    assert t[0].rule == "user"
    assert t[0].outputs[0].stride == (1, 3)
    assert t.output.stride() == (1, 3)


def test_router_builtin_rule_is_recorded_as_builtin():
    t = md.trace(lambda x, i: x[i], torch.ones(5, 2), torch.tensor([1, 3]))
    assert [c.rule for c in t if c.op == "aten.index.Tensor"] == ["builtin"]


def test_router_custom_op_without_rule_raises_unsupported():
    x = torch.ones(2, 3)
    with pytest.raises(md.UnsupportedOpError) as info:
        md.trace(lambda x: torch.ops.mdtest_router.noimpl(x), x)
    err = info.value
    assert isinstance(err, NotImplementedError)
    assert err.op == "mdtest_router.noimpl.default"
    text = str(err)
    assert "f32[2, 3]@cpu" in text
    assert '@metadispatch.register_meta("mdtest_router::noimpl")' in text


def test_router_custom_op_with_user_rule_records_one_call(cleanup):
    @md.register_meta("mdtest_router::ruled")
    def ruled_meta(x, n):
        tmp = x + 1  # work inside a rule is not recorded as separate calls
        return tmp.new_empty(x.shape[0] * n, x.shape[1])

    cleanup.append("mdtest_router::ruled")
    t = md.tracer(device="cuda")(lambda x: torch.ops.mdtest_router.ruled(x, 3), torch.ones(2, 5))
    assert [(c.op, c.rule) for c in t] == [("mdtest_router.ruled.default", "user")]
    assert t.output.shape == (6, 5)
    assert t.output.device == torch.device("cuda:0")
    real = torch.ops.mdtest_router.ruled(torch.ones(2, 5), 3)
    assert t.output.shape == real.shape and t.output.stride() == real.stride()


def test_router_custom_op_with_register_fake_uses_native_meta():
    t = md.trace(lambda x: with_fake(x), torch.ones(4, 3))
    assert (t[0].op, t[0].rule) == ("mdtest_router.with_fake.default", "meta")
    assert t.output.shape == (3,)


def test_router_registering_twice_raises_unless_override(cleanup):
    def rule(x):
        return torch.empty_like(x)

    md.register_meta("mdtest_router::noimpl")(rule)
    cleanup.append("mdtest_router::noimpl")
    with pytest.raises(RuntimeError, match="already registered"):
        md.register_meta("mdtest_router::noimpl")(rule)
    assert md.register_meta("mdtest_router::noimpl", override=True)(rule) is rule


def test_router_packet_registers_every_overload(cleanup):
    seen = []

    @md.register_meta(aten.add)
    def add_meta(*args, fallback, **kwargs):
        seen.append(len(args))
        return fallback(*args, **kwargs)

    cleanup.append(aten.add)
    t = md.trace(lambda x: (x + x) + 1, torch.ones(2))
    assert [c.op for c in t] == ["aten.add.Tensor", "aten.add.Tensor"]
    assert all(c.rule == "user" for c in t)
    assert seen == [2, 2]  # a Python scalar stays a scalar argument
    with pytest.raises(RuntimeError, match="aten.add.Scalar"):
        md.register_meta(aten.add.Scalar)(add_meta)


def test_router_bad_registration_target_is_a_clear_error():
    with pytest.raises(ValueError, match="no_such_op"):
        md.register_meta("mdtest_router::no_such_op")
    with pytest.raises(TypeError, match="OpOverload"):
        md.register_meta(42)


def test_router_kernel_errors_keep_their_type():
    with pytest.raises(RuntimeError) as info:
        md.trace(lambda a, b: a @ b, torch.ones(2, 3), torch.ones(2, 3))
    assert "aten.mm.default" in "".join(info.value.__notes__)
    with pytest.raises(RuntimeError):
        torch.ones(2, 3) @ torch.ones(2, 3)  # the real kernel agrees


def test_router_device_mismatch_is_a_runtime_error():
    a = md.to_meta(torch.ones(2, 2), device="cuda")
    b = md.to_meta(torch.ones(2, 2), device="cpu")
    with pytest.raises(RuntimeError, match="same device"):
        a + b
    assert (a + md.to_meta(torch.tensor(1.0))).device == torch.device("cuda:0")  # cpu scalars mix
