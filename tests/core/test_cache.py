"""The metadata cache never serves a wrong answer."""

import pytest
import torch

import metadispatch as md

aten = torch.ops.aten


def _trace(fn, *args, cache=True, device=None):
    return md.tracer(mode_factory=lambda: md.MetaMode(device=device, cache=cache))(fn, *args)


def test_cache_on_and_off_give_identical_traces_for_a_real_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    model = transformers.LlamaForCausalLM(cfg)

    def step(ids):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits

    ids = torch.randint(0, 100, (2, 7))
    cached, plain = _trace(step, ids, cache=True), _trace(step, ids, cache=False)
    assert str(cached) == str(plain)
    assert [c.rule for c in cached] == [c.rule for c in plain]


def test_cache_hits_on_repeated_layers():
    layer = torch.nn.Linear(8, 8)
    mode = md.MetaMode()
    # An input that needs grad, as the layers' outputs do: requires_grad is
    # part of the key (decompositions branch on it).
    md.tracer(mode_factory=lambda: mode)(lambda x: layer(layer(layer(x))), torch.ones(2, 8, requires_grad=True))
    assert mode.cache.hits >= 4 and mode.cache.misses <= 4


def test_cache_key_includes_registered_rules():
    x = torch.ones(3, 4)
    mode = md.MetaMode()
    with mode:
        before = torch.relu(x)

        @md.register_meta(aten.relu.default)
        def relu_meta(x):
            return torch.empty_strided(x.shape, (1, x.shape[0]), dtype=x.dtype, device=x.device)

        try:
            after = torch.relu(x)
        finally:
            md.unregister_meta(aten.relu.default)
        again = torch.relu(x)
    assert before.stride() == again.stride() == (4, 1)
    assert after.stride() == (1, 3)
    assert [c.rule for c in mode.trace] == ["meta", "user", "meta"]


def test_cache_key_includes_logical_device():
    seen = []

    @md.register_meta(aten.relu.default)
    def relu_meta(x):
        seen.append(x.device.type)
        # A device-specific answer: column-major on cuda only.
        stride = (1, x.shape[0]) if x.device.type == "cuda" else (x.shape[1], 1)
        return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)

    try:
        with md.MetaMode():  # empty, not ones: calls on known values are never cached
            a = torch.relu(torch.empty(3, 4))
            b = torch.relu(torch.empty(3, 4, device="cuda"))
            c = torch.relu(torch.empty(3, 4))
    finally:
        md.unregister_meta(aten.relu.default)
    assert (a.stride(), b.stride(), c.stride()) == ((4, 1), (1, 3), (4, 1))
    assert (a.device.type, b.device.type, c.device.type) == ("cpu", "cuda", "cpu")
    assert seen == ["cpu", "cuda"]  # the third call was a hit


def test_cache_views_alias_their_own_input():
    def fn(x, y):
        return x[1], y[1]

    t = _trace(fn, torch.zeros(3, 4), torch.zeros(3, 4))
    a, b = t.output
    x_leaf, y_leaf = sorted(t.leaves.values(), key=lambda leaf: leaf.name)
    assert t[0].outputs[0].storage == x_leaf.meta.storage
    assert t[1].outputs[0].storage == y_leaf.meta.storage
    assert a.untyped_storage()._cdata != b.untyped_storage()._cdata
    assert a.storage_offset() == b.storage_offset() == 4 and b._base is not None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda x: x.unsqueeze_(0),
        lambda x: x.t_(),
        lambda x: x.resize_(x.numel() + 1),
    ],
)
def test_cache_metadata_mutations_are_never_served(mutate):
    def fn(x):
        mutate(x)
        mutate(x)
        return x

    real = torch.zeros(2, 3)
    expected = fn(real.clone())
    t = _trace(fn, real)
    assert t.output.shape == expected.shape and t.output.stride() == expected.stride()


def test_cache_data_dependent_ops_still_raise():
    real = torch.ones(4)
    with md.MetaMode() as mode:
        x = mode.from_tensor(real)  # user data: no known value
        for _ in range(2):
            with pytest.raises(md.DataDependentError):
                x.nonzero()


def test_cache_rng_ops_are_recorded_every_time():
    with md.MetaMode() as mode:
        a = torch.randn(3)
        b = torch.randn(3)
    assert a is not b and [c.op for c in mode.trace] == ["aten.randn.default"] * 2
    assert mode.trace[0].outputs[0].id != mode.trace[1].outputs[0].id


def test_cache_inplace_returns_the_argument():
    with md.MetaMode():
        x, y = torch.zeros(3), torch.zeros(3)
        assert x.add_(1) is x
        assert y.add_(1) is y


def _layers(x):
    lin = torch.nn.Linear(8, 8)
    return lin(lin(x)).relu()


def test_cache_is_shared_by_modes():
    md.core.cache.clear()
    first, second = md.MetaMode(), md.MetaMode()
    md.tracer(mode_factory=lambda: first)(_layers, torch.ones(2, 8))
    md.tracer(mode_factory=lambda: second)(_layers, torch.ones(2, 8))
    assert first.cache.misses > 0
    assert second.cache.misses == 0 and second.cache.hits > 0
    assert str(second.trace) == str(first.trace)


def test_cache_shared_entries_are_keyed_on_the_modes_device():
    @md.register_meta(aten.relu.default)
    def relu_meta(x):  # a device-specific answer: column-major on cuda only
        stride = (1, x.shape[0]) if x.device.type == "cuda" else (x.shape[1], 1)
        return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)

    try:
        with md.MetaMode():
            on_cpu = torch.relu(torch.ones(3, 4))
        with md.MetaMode(device="cuda"):
            on_cuda = torch.relu(torch.ones(3, 4))
    finally:
        md.unregister_meta(aten.relu.default)
    assert (on_cpu.stride(), on_cuda.stride()) == ((4, 1), (1, 3))


def test_cache_drops_its_oldest_entries_beyond_the_limit(monkeypatch):
    md.core.cache.clear()
    monkeypatch.setattr(md.core.cache, "LIMIT", 3)
    with md.MetaMode():
        for n in range(6):
            torch.zeros(n)  # one key per size
    sizes = [key[3] for key in md.core.cache._SHARED]
    assert sizes == [(tuple, (n,)) for n in (3, 4, 5)]  # an int is its own key part
    md.core.cache.clear()
    assert not md.core.cache._SHARED


def test_cache_autocast_and_plain_steps_share_the_cache():
    # Each step traced with the other's answers in the shared cache, in
    # both orders, must still be what a real CPU run dispatches.
    lin = torch.nn.Linear(8, 8)

    def step(autocast):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = lin(x).relu() @ lin.weight
            y.float().sum().backward()

        return run

    for order in ((True, False), (False, True)):
        md.core.cache.clear()
        for autocast in order:
            lin.zero_grad(set_to_none=True)  # the real run writes .grad
            md.testing.assert_matches_eager(step(autocast), torch.randn(4, 8))


def test_cache_dispatch_sees_autocast_off():
    # Why autocast is not in the key (Note [What the key must hold]).
    seen = []

    @md.register_meta(aten.neg.default)
    def neg(x):
        seen.append(torch.is_autocast_enabled("cpu"))
        return torch.empty_like(x)

    try:
        with md.MetaMode(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cpu")
            torch.ones(2).neg()
    finally:
        md.unregister_meta(aten.neg.default)
    assert seen == [False]
