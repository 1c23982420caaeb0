"""md.materialize against eager construction with the same seed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import metadispatch as md
from tests.replay_cases import bert, cnn, gpt2, llama, mlp

BUILDERS = {
    "linear": lambda: nn.Linear(5, 3),
    "mlp": mlp,
    "cnn_batchnorm": cnn,
    "embedding": lambda: nn.Embedding(10, 4, padding_idx=0),
    "transformer_layer": lambda: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
    # deep-copies its layer: the copies must be clones in the construction trace
    "transformer_encoder": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 3, enable_nested_tensor=False
    ),
    "llama": llama,
    "gpt2": gpt2,
    "bert": bert,
}


def _pair(name, seed=5):
    """(materialised module, eagerly built module), both from ``seed``."""
    torch.manual_seed(seed)
    with md.MetaMode():
        meta = BUILDERS[name]()
    torch.manual_seed(seed)
    eager = BUILDERS[name]()
    return md.materialize(meta), eager


def _state(module):
    """Every parameter and buffer, persistent or not, under each of its names."""
    return list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_materialize_equals_eager_construction(name):
    meta, eager = _pair(name)
    got, expected = _state(meta), _state(eager)
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (n, a), (_, b) in zip(got, expected):
        assert type(a) is type(b) and a.requires_grad == b.requires_grad, n
        assert torch.equal(a, b), n


def test_materialize_fills_non_persistent_buffers():
    meta, eager = _pair("llama")
    persistent = meta.state_dict().keys()
    assert "model.rotary_emb.inv_freq" not in persistent
    assert torch.equal(meta.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_materialize_keeps_tied_weights_tied(name):
    meta, _ = _pair(name)
    assert meta.get_output_embeddings().weight is meta.get_input_embeddings().weight


def test_materialize_leaves_no_meta_tensors():
    meta, _ = _pair("cnn_batchnorm")
    assert not any(isinstance(t, md.MetaTensor) for _, t in _state(meta))
    loss = meta(torch.randn(2, 3, 8, 8)).sum()
    loss.backward()  # a real, trainable module
    assert all(p.grad is not None for p in meta.parameters())


def test_materialize_refuses_modules_without_construction():
    with pytest.raises(md.MetaDispatchError, match="weight was not built under a recording"):
        md.materialize(md.to_meta(nn.Linear(2, 2)))


def test_materialize_does_not_disturb_the_callers_rng():
    with md.MetaMode():
        lin = nn.Linear(3, 3)
    torch.manual_seed(1)
    md.materialize(lin)
    after = torch.rand(2)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(2))


class _Caches(nn.Module):
    """Tensors on plain attributes, in containers, beside a parameter: all built at construction."""

    Pair = __import__("collections").namedtuple("Pair", "cos sin")

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        pos = torch.arange(8.0)
        self.table = torch.outer(pos, torch.rand(4))
        self.listed = [torch.randn(2), {"mask": torch.ones(3, 3).tril().bool()}]
        self.pair = self.Pair(pos.cos(), pos.sin())
        self.plain_tuple = (torch.randn(5), 7)


def test_materialize_replaces_tensors_on_plain_attributes_and_in_containers():
    torch.manual_seed(3)
    with md.MetaMode():
        meta = _Caches()
    torch.manual_seed(3)
    eager = _Caches()
    md.materialize(meta)
    assert type(meta.pair) is _Caches.Pair and meta.plain_tuple[1] == 7
    got = md.testing.snapshot(meta, rng=False)
    assert got.metas == [] and len(got.entries) == len(md.testing.snapshot(eager, rng=False).entries)
    for a, b in [
        (meta.table, eager.table),
        (meta.listed[0], eager.listed[0]),
        (meta.listed[1]["mask"], eager.listed[1]["mask"]),
        (meta.pair.cos, eager.pair.cos),
        (meta.plain_tuple[0], eager.plain_tuple[0]),
    ]:
        assert type(a) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)


class _CopiesIn(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("table", table.clone())


def test_materialize_refuses_data_the_trace_did_not_keep_and_changes_nothing():
    big = torch.randn(5000)  # above the default const_limit of 4096 elements
    with md.MetaMode():
        meta = _CopiesIn(big)
    with pytest.raises(md.MetaDispatchError, match=r"table .*\$\d+: f32\[5000\].*const_limit"):
        md.materialize(meta)
    # all or nothing: not even the parameters were replaced
    assert isinstance(meta.lin.weight, md.MetaTensor) and isinstance(meta.table, md.MetaTensor)


def test_materialize_copies_in_data_kept_under_a_raised_const_limit():
    big = torch.randn(5000)
    torch.manual_seed(0)
    with md.MetaMode(const_limit=10_000):
        meta = _CopiesIn(big)
    md.materialize(meta)
    torch.manual_seed(0)
    eager = _CopiesIn(big)
    assert torch.equal(meta.table, big) and torch.equal(meta.lin.weight, eager.lin.weight)


class _Holder:
    def __init__(self, t):
        self.t = t


def test_materialize_names_tensors_it_cannot_replace():
    with md.MetaMode():
        meta = nn.Linear(2, 2)
        meta.holder = _Holder(torch.zeros(3))
    with pytest.raises(md.MetaDispatchError, match=r"cannot replace them .*holder\.t"):
        md.materialize(meta)
    assert isinstance(meta.weight, md.MetaTensor)


# -- data-dependent initialisers (Note [Data-dependent initialisers] in spec/ownops.py)


class _Truncated(nn.Module):
    def __init__(self, generator=None):
        super().__init__()
        self.wide = nn.Parameter(torch.empty(64, 32))  # [a, b] holds most samples: redraw loop
        nn.init.trunc_normal_(self.wide, std=0.5, a=-0.6, b=0.6, generator=generator)
        self.narrow = nn.Parameter(torch.empty(40, 8))  # a narrow window: the uniform/accept path
        nn.init.trunc_normal_(self.narrow, mean=1.0, std=2.0, a=0.9, b=1.0, generator=generator)
        self.lin = nn.Linear(32, 8)


@pytest.mark.parametrize("explicit_generator", [False, True])
def test_materialize_trunc_normal_equals_eager(explicit_generator):
    def build():
        gen = torch.Generator().manual_seed(11) if explicit_generator else None
        return _Truncated(gen)

    torch.manual_seed(2)
    with md.MetaMode() as mode:
        meta = build()
    assert [c.op for c in mode.trace.calls].count("metadispatch.trunc_normal_.default") == 2
    md.materialize(meta)
    torch.manual_seed(2)
    eager = build()
    for (n, a), (_, b) in zip(_state(meta), _state(eager)):
        assert torch.equal(a, b), n


def test_trunc_normal_is_routed_only_while_a_mode_is_entered():
    original = torch.nn.init._no_grad_trunc_normal_
    with pytest.raises(ValueError):
        with md.MetaMode():
            assert torch.nn.init._no_grad_trunc_normal_ is not original
            raise ValueError
    assert torch.nn.init._no_grad_trunc_normal_ is original
    torch.manual_seed(0)
    expected = nn.init.trunc_normal_(torch.empty(100), std=0.3, a=-0.2, b=0.2)
    with md.MetaMode():  # a real tensor in another thread meanwhile gets torch's draws
        import threading

        got = []
        t = threading.Thread(
            target=lambda: (
                torch.manual_seed(0),
                got.append(nn.init.trunc_normal_(torch.empty(100), std=0.3, a=-0.2, b=0.2)),
            )
        )
        t.start()
        t.join()
    assert torch.equal(got[0], expected)


def test_trunc_normal_trace_saves_loads_and_replays(tmp_path):
    def init():
        w = torch.empty(30, 30)
        nn.init.trunc_normal_(w, std=0.1)
        return w * 2

    torch.manual_seed(0)
    t = md.trace(init)
    path = tmp_path / "init.json"
    t.save(path)
    loaded = md.Trace.load(path)
    assert str(loaded) == str(t) and "metadispatch.trunc_normal_.default" in str(t)
    r = md.replay(loaded)
    assert r.ok, r
    torch.manual_seed(0)
    assert torch.equal(r.output, init())


def test_materialize_hf_vit_initialised_with_trunc_normal_equals_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8
    )
    torch.manual_seed(7)
    with md.MetaMode():
        meta = transformers.ViTModel(cfg)
    md.materialize(meta)
    torch.manual_seed(7)
    eager = transformers.ViTModel(cfg)
    for (n, a), (_, b) in zip(_state(meta), _state(eager)):
        assert torch.equal(a, b), n


def _assert_same_state(meta, eager):
    for (n, a), (_, b) in zip(_state(meta), _state(eager), strict=True):
        assert type(a) is type(b) and torch.equal(a, b), n


def _real_model(dropout: float = 0.0):
    """A real model, its SGD step on real data, and a copy for the eager run."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(dropout), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)

    def stepper(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step():
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()

        return step

    return model, stepper


@pytest.mark.parametrize("name", ["mlp", "cnn_batchnorm", "transformer_layer"])
def test_materialize_takes_only_the_construction_from_a_mode_that_also_ran_a_step(name):
    # A real model's training step runs in the same mode before and after the
    # module is built: materialising replays the calls that built it, and
    # gives what eager construction gives with the same seed.
    model, stepper = _real_model()
    eager_model = copy.deepcopy(model)
    torch.manual_seed(3)
    with md.MetaMode():
        step = stepper(model)
        step()
        meta = BUILDERS[name]()
        step()
    md.materialize(meta)
    torch.manual_seed(3)
    eager_step = stepper(eager_model)
    eager_step()
    eager = BUILDERS[name]()
    eager_step()
    _assert_same_state(meta, eager)


def test_materialize_after_random_draws_that_follow_the_construction():
    # Dropout after the module was built draws nothing the module needs.
    model, stepper = _real_model(dropout=0.5)
    torch.manual_seed(4)
    with md.MetaMode():
        meta = BUILDERS["mlp"]()
        stepper(model)()
    md.materialize(meta)
    torch.manual_seed(4)
    eager = BUILDERS["mlp"]()
    _assert_same_state(meta, eager)


def test_materialize_refuses_when_other_work_drew_random_numbers_before_the_construction():
    # Note [Slicing keeps eager's random numbers]: eager's dropout moved the
    # generator the initialisers then drew from; replaying the construction
    # alone would draw other numbers.
    model, stepper = _real_model(dropout=0.5)
    with md.MetaMode():
        stepper(model)()
        meta = BUILDERS["mlp"]()
    with pytest.raises(
        md.MetaDispatchError, match=r"#\d+ aten\.\w*(bernoulli|dropout)\w*\.\w+ in 1 .*cpu generator before"
    ):
        md.materialize(meta)
    assert all(isinstance(t, md.MetaTensor) for t in meta.state_dict().values())  # nothing replaced


def test_materialize_after_random_draws_when_the_seed_was_set_in_between():
    model, stepper = _real_model(dropout=0.5)
    torch.manual_seed(5)
    with md.MetaMode():
        stepper(model)()
        torch.manual_seed(6)  # the construction draws from here, whatever came before
        meta = BUILDERS["mlp"]()
    md.materialize(meta)
    torch.manual_seed(6)
    eager = BUILDERS["mlp"]()
    _assert_same_state(meta, eager)


def test_materialize_refuses_a_module_trained_in_the_mode_on_data_the_trace_did_not_keep():
    # Its weights now depend on the step's input, larger than const_limit:
    # the slice reaches it, and materialize refuses, naming it.
    x = torch.randn(1000, 5)
    with md.MetaMode():
        meta = BUILDERS["linear"]()
        opt = torch.optim.SGD(meta.parameters(), lr=0.1)
        meta(x).sum().backward()
        opt.step()
    with pytest.raises(md.MetaDispatchError, match=r"weight .*\$\d+: f32\[1000, 5\] const"):
        md.materialize(meta)


def test_materialize_follows_writes_through_views_after_other_work():
    def build_and_edit(step):
        lin = nn.Linear(5, 3)
        step()
        with torch.no_grad():
            lin.weight[:2].mul_(0.5)  # a write through a view, after the real step
            lin.bias.copy_(lin.weight.t()[1:4].sum(0))  # from another of its tensors
        return lin

    model, stepper = _real_model()
    eager_model = copy.deepcopy(model)
    torch.manual_seed(7)
    with md.MetaMode():
        meta = build_and_edit(stepper(model))
    md.materialize(meta)
    torch.manual_seed(7)
    eager = build_and_edit(stepper(eager_model))
    _assert_same_state(meta, eager)


# Initialisers in every order: a random init before ``trunc_normal_`` on a
# tensor with known values (``torch.zeros``, as Swin's bias tables) used to
# run the initialiser for real while tracing, moving the real generator and
# so every later draw (issue 28, item 1).
_INITS = {
    "normal": lambda t: nn.init.normal_(t, std=0.5),
    "uniform": lambda t: nn.init.uniform_(t, -0.1, 0.1),
    "trunc_normal": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "trunc_normal_narrow": lambda t: nn.init.trunc_normal_(t, std=1.0, a=-0.1, b=0.1),  # the rejection branch
    "kaiming": lambda t: nn.init.kaiming_normal_(t),
    "xavier": lambda t: nn.init.xavier_uniform_(t),
    "orthogonal": lambda t: nn.init.orthogonal_(t),
    "sparse": lambda t: nn.init.sparse_(t, 0.5),
}
_ORDERS = [
    ["normal", "trunc_normal", "uniform", "trunc_normal_narrow", "kaiming"],
    ["trunc_normal", "orthogonal", "trunc_normal", "xavier", "sparse"],
    ["uniform", "kaiming", "trunc_normal_narrow", "orthogonal", "trunc_normal", "normal"],
    ["sparse", "trunc_normal", "trunc_normal", "normal", "orthogonal"],
]


class _Inits(nn.Module):
    def __init__(self, order, start):
        super().__init__()
        self.layers = nn.ModuleList()
        for name in order:
            layer = nn.Linear(6, 5)  # its own kaiming_uniform_ draws in between
            layer.weight = nn.Parameter(start((5, 6)))
            _INITS[name](layer.weight)
            self.layers.append(layer)


@pytest.mark.parametrize("start", [torch.zeros, torch.empty], ids=["zeros", "empty"])
@pytest.mark.parametrize("order", _ORDERS, ids=["-".join(o) for o in _ORDERS])
def test_materialize_equals_eager_whatever_the_order_of_initialisers(order, start):
    torch.manual_seed(3)
    with md.MetaMode():
        meta = _Inits(order, start)
    md.materialize(meta)
    torch.manual_seed(3)
    _assert_same_state(meta, _Inits(order, start))


def _swin_t():
    return pytest.importorskip("torchvision").models.swin_t()


def _efficientnet_b0():
    return pytest.importorskip("torchvision").models.efficientnet_b0()


def _swinv2():
    return pytest.importorskip("timm").create_model("swinv2_cr_tiny_ns_224", pretrained=False, num_classes=10)


def _hf_swin():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
    )
    return transformers.SwinForImageClassification(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "build",
    [_swin_t, _efficientnet_b0, _swinv2, _hf_swin],
    ids=["tv.swin_t", "tv.efficientnet_b0", "timm.swinv2", "hf.swin"],
)
def test_materialize_zoo_models_initialised_in_mixed_orders_equal_eager(build):
    torch.manual_seed(1)
    with md.MetaMode():
        meta = build()
    md.materialize(meta)
    torch.manual_seed(1)
    _assert_same_state(meta, build())


@pytest.mark.parametrize("build", ["torch_meta_device", "to_empty_on_meta"])
def test_materialize_refuses_plain_meta_tensors_instead_of_leaving_them(build):
    # Built on torch's meta device (as accelerate's init_empty_weights does): no construction
    # was recorded, so nothing says their values; returning them on meta would be silent.
    if build == "torch_meta_device":
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    else:
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to_empty(device="meta")
    with pytest.raises(md.MetaDispatchError, match=r"0.weight, 0.bias, 1.weight.* lie on 'meta'"):
        md.materialize(model)
    assert model[0].weight.is_meta  # refused before anything changed


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_materialize_after_md_trace_of_a_step_equals_eager(name):
    # Note [A MetaTensor from an earlier mode keeps its record]: planning a
    # step with md.tracer, then loading, is the order people use
    torch.manual_seed(5)
    with md.MetaMode():
        meta = BUILDERS[name]()
    x = torch.randint(0, 32, (2, 8)) if name == "llama" else torch.randn(4, 6)

    def step(x):
        out = meta(x)
        (out.logits if name == "llama" else out).sum().backward()

    md.tracer()(step, x)
    assert all(p.grad is None for p in meta.parameters())  # given back as it was
    md.materialize(meta)
    torch.manual_seed(5)
    _assert_same_state(meta, BUILDERS[name]())
