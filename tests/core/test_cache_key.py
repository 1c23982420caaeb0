"""The metadata cache's key holds everything that can change an answer.

Each test fills the shared cache with one call, then makes a call that
differs from it in one thing the key must hold, and expects exactly the
answer the same call gets with the cache off (and, where torch has one, the
answer of the real kernel).  Rules that read global state are written here on
purpose: the key must make even those safe.
"""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import metadispatch as md

aten = torch.ops.aten


def _describe(x):
    """What a caller can see of a call's outputs: metadata, devices, storages."""
    flat = x if isinstance(x, (list, tuple)) else (x,)
    storages = [t.untyped_storage()._cdata for t in flat]
    return [
        (
            tuple(t.shape),
            t.stride(),
            t.storage_offset(),
            t.dtype,
            t.device,
            t.untyped_storage().nbytes(),
            storages.index(s),
        )
        for t, s in zip(flat, storages)
    ]


def _served(fill, call, around=contextlib.nullcontext, device=None):
    """``call()``'s outputs with the cache off, and after ``fill()`` filled it."""
    md.core.cache.clear()
    with md.MetaMode(device=device, cache=False), around():
        expected = _describe(call())
    with md.MetaMode(device=device):
        fill()
    with md.MetaMode(device=device), around():
        got = _describe(call())
    return got, expected


@pytest.fixture
def lib():
    lib = torch.library.Library("md_cache_key", "FRAGMENT")
    yield lib
    lib._destroy()


@contextlib.contextmanager
def _rule(op, fn):
    md.register_meta(op)(fn)
    try:
        yield
    finally:
        md.unregister_meta(op)


def _contiguous_unless(flag):
    """A relu rule answering column-major when ``flag(x)`` holds."""

    def relu_meta(x):
        stride = (1, x.shape[0]) if flag(x) else (x.shape[1], 1)
        return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)

    return relu_meta


@contextlib.contextmanager
def _default_dtype(dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def _relu():
    return torch.relu(torch.empty(3, 4))


def test_cache_corrcoef_after_a_cuda_mode_stays_on_cpu():
    with md.MetaMode(device="cuda"):
        torch.corrcoef(torch.randn(3, 5))
    t = md.trace(lambda x: torch.corrcoef(x), torch.randn(3, 5))
    real = torch.corrcoef(torch.randn(3, 5))
    out = t.output_meta
    assert (out.shape, out.dtype, out.device) == (tuple(real.shape), real.dtype, real.device)
    assert all(m.device.type == "cpu" for c in t for m in c.outputs if isinstance(m, md.TensorMeta))


class _Devices(TorchDispatchMode):
    """The output device of every op FakeTensorMode answers (torch's own choice)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.log.append((str(func), out.device))
        return out


def test_cache_options_factory_follows_its_composite_not_the_call_before():
    # cov's C++ body builds ``scalar_tensor(n, input.options())``: on the
    # input's device, whatever ran before (the trace's last call is on cpu).
    def step(x):
        y = torch.randn(3, 5, device="cuda")
        x + 1
        return torch.corrcoef(y)

    x = torch.randn(3)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        fx = fake.from_tensor(x)
        with _Devices() as real, contextlib.suppress(Exception):  # FakeTensorMode stops at aten.equal
            step(fx)
    ours = [(c.op, c.outputs[0].device) for c in md.trace(step, x) if isinstance(c.outputs[0], md.TensorMeta)]
    assert [d for op, d in ours if op == "aten.scalar_tensor.default"][0] == torch.device("cuda", 0)
    assert ours[: len(real.log)] == real.log


def test_cache_hit_and_miss_leave_options_factories_the_same_device(lib):
    # A rule's nested calls run on a miss only; a factory C++ builds from
    # options() after it must not find the device they left.
    lib.define("nested(Tensor x) -> Tensor")

    def nested_meta(x):
        out = torch.empty_like(x)
        torch.ones(2, device="cpu").add(1)  # nested calls on cpu tensors, last
        return out

    def step():
        y = torch.ops.md_cache_key.nested(torch.empty(3, device="cuda"))
        return y, aten.scalar_tensor.default(2.0, device="meta")  # as ``at::scalar_tensor(v, y.options())``

    md.core.cache.clear()
    with _rule("md_cache_key::nested", nested_meta):
        devices = [
            md.tracer(mode_factory=lambda c=c: md.MetaMode(cache=c))(step).output_meta[1].device for c in (0, 1, 1)
        ]
    assert devices == [torch.device("cuda", 0)] * 3


@pytest.mark.parametrize("record", [True, False])
def test_cache_keeps_conj_and_neg_bits(record):
    def bits(x, c):
        n, k = torch._neg_view(x), c.conj()
        return [n.is_neg(), n.view(3).is_neg(), n[1:].is_neg(), n.clone().is_neg()] + [
            k.is_conj(),
            k.view(3).is_conj(),
            k[1:].is_conj(),
            k.clone().is_conj(),
            k.conj().is_conj(),  # a view of a conj view, without the bit
            k.view(1, 3).mH.mH.is_conj(),
        ]

    x, c = torch.randn(3), torch.randn(3, dtype=torch.cfloat)
    real = bits(x, c)
    md.core.cache.clear()
    for _ in range(2):  # the second time from the cache the first filled
        with md.MetaMode(record=record) as mode:
            assert bits(mode.from_tensor(x), mode.from_tensor(c)) == real


@pytest.mark.parametrize("fill, ask", [(True, False), (False, True)])
def test_cache_key_holds_the_conv_backend_switches(fill, ask):
    # With oneDNN off, CPU runs a channels-last 3-d convolution on the slow
    # kernel, whose output is contiguous; with it on, channels-last.
    x = torch.randn(2, 4, 6, 6, 6).to(memory_format=torch.channels_last_3d)
    w = torch.randn(8, 4, 3, 3, 3)
    with torch.backends.mkldnn.flags(enabled=ask):
        real = torch.nn.functional.conv3d(x, w)

    def call():
        return torch.nn.functional.conv3d(torch.empty_like(x), torch.empty_like(w))

    def fill_with_the_other_switch():
        with torch.backends.mkldnn.flags(enabled=fill):
            call()

    got, expected = _served(fill_with_the_other_switch, call, around=lambda: torch.backends.mkldnn.flags(enabled=ask))
    assert got == expected and got[0][1] == real.stride()


def test_cache_key_holds_the_default_dtype():
    fp64 = lambda: _default_dtype(torch.float64)  # noqa: E731
    got, expected = _served(lambda: torch.empty(3), lambda: torch.empty(3), around=fp64)
    with fp64():
        real = torch.empty(3)
    assert got == expected and got[0][3] == real.dtype == torch.float64


def test_cache_key_holds_grad_mode():
    with _rule(aten.relu.default, _contiguous_unless(lambda x: torch.is_grad_enabled())):
        got, expected = _served(_relu, _relu, around=torch.no_grad)
    assert got == expected and got[0][1] == (4, 1)


def test_cache_key_holds_the_autocast_state():
    def mm():
        x = torch.empty(3, 4)
        return torch.mm(x, x.T)

    # Filled outside autocast, asked inside it: the answer must be the one
    # the cache-off mode gives (autocast on MetaTensors is issue 15's; once
    # it casts, the entry filled in float32 must not be served).
    got, expected = _served(mm, mm, around=lambda: torch.autocast("cpu"))
    assert got == expected


def test_cache_key_holds_requires_grad():
    def call(requires_grad):
        return torch.relu(torch.empty(3, 4, requires_grad=requires_grad)).detach()

    with _rule(aten.relu.default, _contiguous_unless(lambda x: x.requires_grad)):
        got, expected = _served(lambda: call(False), lambda: call(True))
    assert got == expected and got[0][1] == (1, 3)


def test_cache_key_holds_the_sdp_backend_switches():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 8, 16)
    with sdpa_kernel(SDPBackend.MATH):
        real = aten._fused_sdp_choice(q, q, q)
    md.core.cache.clear()
    with md.MetaMode() as mode:
        m = mode.from_tensor(q)
        aten._fused_sdp_choice(m, m, m)  # fills the cache with the default switches
        with sdpa_kernel(SDPBackend.MATH):
            got = aten._fused_sdp_choice(m, m, m)
    assert got == real != aten._fused_sdp_choice(q, q, q)


def test_cache_key_holds_the_aliasing_of_inputs(lib):
    lib.define("second(Tensor x, Tensor y) -> Tensor")

    def second_meta(x, y):
        return y.view(y.shape)  # a view of its second input

    def call(shared):
        base = torch.empty(2, 3)
        return torch.ops.md_cache_key.second(base, base if shared else torch.empty(2, 3)), base

    with _rule("md_cache_key::second", second_meta):
        got, expected = _served(lambda: call(True), lambda: call(False))
    assert got == expected and got[0][-1] != got[1][-1]  # not a view of the first input


def test_cache_outputs_keep_the_device_their_rule_gave(lib):
    lib.define("with_seed(Tensor x) -> (Tensor, Tensor)")

    def with_seed_meta(x):
        return torch.empty_like(x), torch.empty((), dtype=torch.int64, device="cpu")

    def call():
        return torch.ops.md_cache_key.with_seed(torch.empty(3, device="cuda"))

    with _rule("md_cache_key::with_seed", with_seed_meta):
        got, expected = _served(call, call)
    assert got == expected and [d[4].type for d in got] == ["cuda", "cpu"]


def test_cache_fresh_outputs_keep_their_storage_size_and_sharing(lib):
    lib.define("pair(Tensor x) -> (Tensor, Tensor)")

    def pair_meta(x):
        big = x.new_empty(100)
        return big[:10], big[10:20]  # one storage, larger than either

    def call():
        return torch.ops.md_cache_key.pair(torch.empty(3))

    with _rule("md_cache_key::pair", pair_meta):
        got, expected = _served(call, call)
    assert got == expected and got[0][-2:] == (400, 0) and got[1][-2:] == (400, 0)


def test_cache_never_serves_an_answer_read_from_a_known_value(lib):
    lib.define("first_n(Tensor x, Tensor n) -> Tensor")

    def first_n_meta(x, n):
        return x.new_empty(int(n))  # reads the value: known for constants

    with _rule("md_cache_key::first_n", first_n_meta):
        got, expected = _served(
            lambda: torch.ops.md_cache_key.first_n(torch.empty(5), torch.tensor([2])),
            lambda: torch.ops.md_cache_key.first_n(torch.empty(5), torch.tensor([3])),
        )
    assert got == expected and got[0][0] == (3,)


def test_cache_key_holds_the_known_value_limit(lib):
    lib.define("first_n(Tensor x, Tensor n) -> Tensor")

    def first_n_meta(x, n):
        return x.new_empty(int(n))

    def call():
        return torch.ops.md_cache_key.first_n(torch.empty(5), torch.tensor([2]))

    md.core.cache.clear()
    with _rule("md_cache_key::first_n", first_n_meta):
        with md.MetaMode():
            assert call().shape == (2,)
        with md.MetaMode(known_limit=0), pytest.raises(md.DataDependentError):
            call()
