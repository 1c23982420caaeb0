"""accelerate: a model built under ``init_empty_weights`` traces as the same model built eagerly.

accelerate is installed in CI's torch 2.14.1 leg only; elsewhere these skip.
"""

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

import metadispatch as md  # noqa: E402


def _build():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def _step(model):
    def step(x):
        model(x).sum().backward()

    return step


def _figures(t):
    return [(c.op, [(o.shape, o.dtype) for o in c.outputs if hasattr(o, "shape")]) for c in t.calls]


def test_init_empty_weights_model_traces_like_an_eager_one():
    with accelerate.init_empty_weights():
        empty = _build()
    assert all(p.device.type == "meta" for p in empty.parameters())
    x = torch.randn(8, 16)
    t = md.tracer(device="cuda")(_step(empty), x)
    ref = md.tracer(device="cuda")(_step(_build()), x)
    assert _figures(t) == _figures(ref)
    assert md.memory(t).peak == md.memory(ref).peak
    # left as it was: on meta, no gradients
    assert all(p.device.type == "meta" and p.grad is None for p in empty.parameters())


def test_init_empty_weights_model_under_metamode_matches_eager_shapes():
    with accelerate.init_empty_weights():
        empty = _build()
    x = torch.randn(8, 16)
    eager = _build()
    out_real = eager(x)
    out_real.sum().backward()
    with md.MetaMode():
        out = empty(x)
        out.sum().backward()
        grads = [(p.grad.shape, p.grad.dtype) for p in empty.parameters()]
    assert (out.shape, out.dtype) == (out_real.shape, out_real.dtype)
    assert grads == [(p.grad.shape, p.grad.dtype) for p in eager.parameters()]
    assert all(p.grad is None for p in empty.parameters())


class _Scaled(nn.Module):
    """Parameters, and a non-persistent buffer no checkpoint holds."""

    def __init__(self):
        super().__init__()
        self.net = _build()
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 16), persistent=False)

    def forward(self, x):
        return self.net(x * self.scale)


def _both(order: str, build=_Scaled):
    """A model built under MetaMode and init_empty_weights, entered in ``order``."""
    if order == "metamode_outside":
        with md.MetaMode(), accelerate.init_empty_weights():
            return build()
    with accelerate.init_empty_weights(), md.MetaMode():
        return build()


ORDERS = ["metamode_outside", "accelerate_outside"]


@pytest.mark.parametrize("order", ORDERS)
def test_init_empty_weights_with_metamode_builds_what_accelerate_builds(order):
    model = _both(order)
    with accelerate.init_empty_weights():
        eager = _Scaled()
    got = [
        (n, t.shape, t.dtype, t.device, t.requires_grad, isinstance(t, nn.Parameter))
        for n, t in model.state_dict(keep_vars=True).items()
    ]
    want = [
        (n, t.shape, t.dtype, t.device, t.requires_grad, isinstance(t, nn.Parameter))
        for n, t in eager.state_dict(keep_vars=True).items()
    ]
    assert got == want and all(isinstance(p, md.MetaTensor) for p in model.parameters())
    assert model.scale.device == eager.scale.device == torch.device("cpu")  # buffers are built, as accelerate does


@pytest.mark.parametrize("order", ORDERS)
def test_init_empty_weights_with_metamode_traces_like_eager(order):
    model = _both(order)
    x = torch.randn(8, 16)
    t = md.tracer()(_step(model), x)
    with accelerate.init_empty_weights():
        empty = _Scaled()
    for ref in (md.tracer()(_step(empty), x), md.tracer()(_step(_Scaled()), x)):
        assert _figures(t) == _figures(ref)
        assert md.memory(t).peak == md.memory(ref).peak
    assert all(p.grad is None for p in model.parameters())  # given back as it was


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("traced_first", [False, True])
def test_init_empty_weights_with_metamode_materializes_from_a_checkpoint(order, traced_first, tmp_path):
    torch.manual_seed(0)
    eager = _Scaled()
    path = tmp_path / "model.pt"
    torch.save(eager.state_dict(), path)
    model = _both(order)
    if traced_first:  # plan the step, then load
        md.tracer()(_step(model), torch.randn(8, 16))
    md.materialize(model, checkpoint=path)
    loaded = _Scaled()
    loaded.load_state_dict(torch.load(path, weights_only=True))
    for (n, a), (_, b) in zip(
        model.state_dict(keep_vars=True).items(), loaded.state_dict(keep_vars=True).items(), strict=True
    ):
        assert type(a) is type(b) and a.requires_grad == b.requires_grad and torch.equal(a, b), n
    assert torch.equal(model.scale, loaded.scale)  # replayed from the construction trace
    assert str(md.audit(model)) == "ok"
    x = torch.randn(8, 16)
    assert torch.equal(model(x), loaded(x))


def test_init_empty_weights_with_metamode_refuses_materialize_without_a_checkpoint():
    # accelerate moved the parameters to meta: eager has no values for them either
    model = _both("metamode_outside")
    with pytest.raises(md.MetaDispatchError, match="net.0.weight.*meta.*checkpoint=PATH"):
        md.materialize(model)
    assert all(isinstance(p, md.MetaTensor) for p in model.parameters())


def test_materialize_refuses_an_init_empty_weights_model():
    # accelerate throws the initialisers' values away: only a checkpoint can fill it
    with accelerate.init_empty_weights():
        model = _build()
    with pytest.raises(md.MetaDispatchError, match="lie on 'meta'.*checkpoint=PATH"):
        md.materialize(model)


# -- accelerate estimate-memory against metadispatch trace --hf (docs/integrations.md)

transformers = pytest.importorskip("transformers")

from accelerate.commands.estimate import estimate_training_usage  # noqa: E402
from accelerate.utils import calculate_maximum_sizes, convert_bytes  # noqa: E402

from metadispatch.analysis.memory import allocated_bytes  # noqa: E402
from metadispatch.cli import targets  # noqa: E402
from metadispatch.cli.steps import with_optimizer  # noqa: E402

SMALL = {
    "llama": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
    },
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128},
    "bert": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
    },
}


def _accelerate_estimate(arch, overrides):
    """What ``accelerate estimate-memory`` computes, offline: its ``create_empty_model``
    without the Hub (the same AutoModel, float32, under init_empty_weights), then
    ``calculate_maximum_sizes`` and ``estimate_training_usage``."""
    config = targets.hf_config(arch, overrides)
    with accelerate.init_empty_weights():
        base = transformers.AutoModel.from_config(config, torch_dtype=torch.float32)
    total, _ = calculate_maximum_sizes(base)
    return base, total, estimate_training_usage(total, "float32")


def _md_trace(arch, overrides):
    """What ``metadispatch trace --hf ARCH --config ... --gpu h100`` traces: the
    causal LM, AdamW, step 2 of 2 on a logical H100."""
    t = targets.hf_target(arch, overrides, device="cuda")
    trace = md.tracer(device="cuda", gpu="h100", warmup=1)(with_optimizer(t.step, "adamw"), t.model, *t.inputs)
    return t.model, md.memory(trace)


def _named(model, kinds=("parameters", "buffers")):
    """name -> tensor, each storage once (tied weights under their first name)."""
    out, seen = {}, set()
    for kind in kinds:
        for name, t in getattr(model, f"named_{kind}")():
            if id(t) not in seen:
                seen.add(id(t))
                out[name.removeprefix(f"{model.base_model_prefix}.")] = t
    return out


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_accelerate_total_size_is_the_weights_md_counts_with_the_head_difference(arch):
    base, total, _ = _accelerate_estimate(arch, SMALL[arch])
    causal, mem = _md_trace(arch, SMALL[arch])
    weights = _named(causal, ("parameters",))
    # md's weights: each parameter storage once, as the caching allocator rounds it
    assert mem.by_category["params"] == sum(
        allocated_bytes(_nbytes([t]), torch.device("cuda")) for t in weights.values()
    )
    # accelerate's: the base model's parameters and buffers (non-persistent ones too), unrounded
    accel = _named(base)
    assert total == _nbytes(accel.values())
    # what the docs give as the difference: the causal LM's head, less what the base model has that it lacks
    only_md, only_accel = weights.keys() - accel.keys(), accel.keys() - weights.keys()
    assert _nbytes(weights.values()) - total == _nbytes(weights[k] for k in only_md) - _nbytes(
        accel[k] for k in only_accel
    )
    expected_heads = {
        "llama": {"lm_head.weight"},
        "gpt2": set(),
        "bert": {
            "cls.predictions.bias",
            "cls.predictions.transform.dense.weight",
            "cls.predictions.transform.dense.bias",
            "cls.predictions.transform.LayerNorm.weight",
            "cls.predictions.transform.LayerNorm.bias",
        },
    }
    assert only_md == expected_heads[arch]
    assert {k for k in only_accel if k in dict(base.named_parameters())} == (
        {"pooler.dense.weight", "pooler.dense.bias"} if arch == "bert" else set()
    )


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_accelerates_adam_rule_is_md_weights_grads_and_state_without_the_step_peak(arch):
    _, total, usage = _accelerate_estimate(arch, SMALL[arch])
    assert max(usage.values()) == usage["step"] == 4 * total  # "Training using Adam", float32
    causal, mem = _md_trace(arch, SMALL[arch])
    # at the optimizer's foreach sqrt, where a full-size model peaks (docs/integrations.md's table)
    (at,) = [i for i, c in enumerate(mem.trace.calls) if c.op == "aten._foreach_sqrt.default"]
    cat = {c: line[at] for c, line in mem.by_category_timeline.items()}
    params = cat["params"]
    assert params == mem.by_category["params"] and cat["grads"] == params
    # exp_avg and exp_avg_sq on the GPU, a 4-byte step count per parameter on the CPU
    n = len(_named(causal, ("parameters",)))
    assert cat["optimizer state"] == 2 * params + 4 * n
    # sqrt(exp_avg_sq) for every parameter at once: a temporary as large as the weights, which 4x leaves out
    assert cat["optimizer"] == params
    assert mem.timeline[at] == sum(cat.values())


DOC_ROWS = {"llama": "LLaMA-7B", "gpt2": "GPT-2 (124M)", "bert": "BERT-base"}


def _doc_row(arch) -> str:
    """The row of docs/integrations.md's table for ``arch``'s default config, as the code computes it."""
    from metadispatch.ir.text import fmt_bytes

    _, total, usage = _accelerate_estimate(arch, {})
    _, mem = _md_trace(arch, {})
    c = mem.by_category
    fit = md.fits(mem.trace, "h100")
    cells = [convert_bytes(total), convert_bytes(max(usage.values()))]
    cells += [fmt_bytes(c[k]) for k in ("params", "grads", "optimizer state", "optimizer", "activations", "workspaces")]
    cells += [fmt_bytes(mem.peak), fmt_bytes(fit.reserved_peak) + ("" if fit.fits else " (does not fit)")]
    return f"| {DOC_ROWS[arch]} (`--hf {arch}`) | " + " | ".join(cells) + " |"


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(DOC_ROWS))
def test_docs_table_of_accelerate_against_md_is_what_the_code_computes(arch):
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    assert _doc_row(arch) in page.splitlines()


@pytest.mark.parametrize("order", ORDERS)
def test_init_empty_weights_with_metamode_materializes_a_transformers_llama(order, tmp_path):
    config = targets.hf_config("llama", SMALL["llama"])
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    eager.save_pretrained(tmp_path)  # model.safetensors
    model = _both(order, lambda: transformers.LlamaForCausalLM(config))
    assert str(md.checkpoint.check(model, tmp_path)) == "ok"
    md.materialize(model, checkpoint=tmp_path)
    assert str(md.audit(model)) == "ok"
    assert torch.equal(model.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)  # replayed, in no checkpoint
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(model(ids).logits, eager(ids).logits)
