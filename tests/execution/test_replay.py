"""md.replay against eager execution: outputs, gradients, buffers, RNG,
made-up leaves, untouched inputs, and mismatches from wrong rules."""

from __future__ import annotations

import copy
import doctest
import sys

import pytest
import torch
from torch import nn

import metadispatch as md
from metadispatch.binding.leaves import index_bounds
from tests.replay_cases import CASES, VOCAB, build

cuda = pytest.mark.cuda  # skipped without a CUDA device (conftest.py)


def _eager(model, fn, inputs, state, device="cpu"):
    """fn run for real on a copy of ``model`` from CPU generator ``state``: (output, grads, buffers)."""
    model = copy.deepcopy(model).to(device)
    with torch.random.fork_rng():
        torch.set_rng_state(state)
        out = fn(model, *[x.to(device) for x in inputs])
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out, grads, dict(model.named_buffers())


def _assert_match(actual, expected, exact: bool):
    if exact:
        assert torch.equal(actual, expected), (actual - expected).abs().max()
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def traced():
    """Case name -> (model, fn, inputs, exact, trace), each traced once."""
    cache = {}

    def get(name):
        if name not in cache:
            model, fn, inputs, exact = build(name)
            cache[name] = (model, fn, inputs, exact, md.trace(fn, model, *inputs))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_replay_output_matches_eager(traced, name):
    model, fn, inputs, exact, t = traced(name)
    r = md.replay(t, (model, *inputs))
    out, _, _ = _eager(model, fn, inputs, t.rng_state)
    assert r.ok, r.mismatches
    _assert_match(r.output, out, exact)


@pytest.mark.parametrize("name", list(CASES))
def test_replay_grads_match_eager(traced, name):
    model, fn, inputs, exact, t = traced(name)
    r = md.replay(t, (model, *inputs))
    _, grads, _ = _eager(model, fn, inputs, t.rng_state)
    assert sorted(r.grads) == sorted(n for n, g in grads.items() if g is not None)
    for n, g in r.grads.items():
        _assert_match(g, grads[n], exact)


def test_replay_batchnorm_running_stats_match_eager(traced):
    model, fn, inputs, _, t = traced("cnn_batchnorm")
    r = md.replay(t, (model, *inputs))
    _, _, buffers = _eager(model, fn, inputs, t.rng_state)
    assert sorted(r.buffers) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    for n, b in r.buffers.items():
        assert torch.equal(b, buffers[n]), n


@pytest.mark.parametrize("name", ["mlp", "cnn_batchnorm", "llama"])
def test_replay_logical_cuda_trace_on_cpu(name):
    model, fn, inputs, exact = build(name)
    # With cuDNN a GPU runs cudnn_batch_norm, which has no CPU kernel (test below).
    with torch.backends.cudnn.flags(enabled=name != "cnn_batchnorm"):
        t = md.tracer(device="cuda")(fn, model, *inputs)
    assert t[0].output_metas[0].device.type == "cuda"
    # Dropout draws from CUDA's generator in eager: on CPU that stream is made up.
    r = md.replay(t, (model, *inputs), device="cpu", seed=3)
    assert not r.mismatches
    assert [m.name for m in r.made_up] == (["cuda:0 generator"] if name == "mlp" else [])
    assert r.ok == (name != "mlp")
    assert r.output.device.type == "cpu"
    if name != "mlp":
        _assert_match(r.output, _eager(model, fn, inputs, t.rng_state)[0], exact)


def test_replay_on_cpu_refuses_a_gpu_only_kernel():
    model, fn, inputs, _ = build("cnn_batchnorm")
    t = md.tracer(device="cuda")(fn, model, *inputs)
    with pytest.raises(md.ReplayError, match="aten.cudnn_batch_norm.default has no cpu kernel"):
        md.replay(t, (model, *inputs), device="cpu")


@cuda
@pytest.mark.parametrize("name", ["mlp", "cnn_batchnorm", "llama"])
def test_replay_on_cuda_matches_eager_cuda(name):
    model, fn, inputs, _ = build(name)
    t = md.tracer(device="cuda")(fn, model, *inputs)
    r = md.replay(t, (model, *inputs), device="cuda", allow_made_up=True)
    out, grads, _ = _eager(model, fn, inputs, t.rng_state, device="cuda")
    assert r.ok, r.mismatches
    if name == "mlp":  # dropout: no real CUDA generator state was recorded on a meta trace
        return
    torch.testing.assert_close(r.output, out, rtol=1e-5, atol=1e-5)
    for n, g in r.grads.items():
        torch.testing.assert_close(g, grads[n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_replay_made_up_token_ids_index_in_range(traced, name):
    *_, t = traced(name)
    ids = next(m for m, leaf in t.leaves.items() if leaf.name == "args[1]")
    assert index_bounds(t)[ids] == VOCAB
    r = md.replay(t, seed=1)  # no inputs, no weights: everything made up
    assert not r.mismatches and not r.ok
    assert {m.name for m in r.made_up} >= {"arg args[1]"}
    assert torch.isfinite(r.output).all()


def test_replay_made_up_leaves_are_seeded(traced):
    *_, t = traced("llama")
    a, b, c = (md.replay(t, seed=s).output for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_replay_made_up_leaves_do_not_shift_rng():
    fn = lambda x: torch.nn.functional.dropout(x, 0.5)  # noqa: E731
    t = md.trace(fn, torch.ones(64))
    r = md.replay(t, seed=4)  # x is made up from its own generator
    with torch.random.fork_rng():
        torch.set_rng_state(t.rng_state)
        expected = fn(torch.ones(64))
    assert torch.equal(r.output == 0, expected == 0)


def _rng_ops(x):
    noise = torch.randn(3, 4)
    y = torch.empty(3, 4).normal_(2.0, 0.5)
    return torch.nn.functional.dropout(x + noise + y, 0.3) + torch.rand(4)


def test_replay_rng_ops_draw_from_the_recorded_state():
    x = torch.ones(3, 4)
    torch.manual_seed(11)
    t = md.trace(_rng_ops, x)
    expected = _rng_ops(x)  # eager from the same generator state the trace began with
    assert torch.equal(md.replay(t, (x,), seed=5).output, expected)


def test_replay_restores_the_callers_rng():
    t = md.trace(lambda: torch.randn(3))
    torch.manual_seed(5)
    md.replay(t, seed=9)
    after = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(2))


def _in_place(model, x):
    x[0].add_(1)  # a view of an argument, written in place
    out = model(x.view(2, 3, 8, 8)).sum()
    out.backward()
    return out


def test_replay_leaves_inputs_and_module_unchanged():
    model, _, (x, _), _ = build("cnn_batchnorm")
    x = x.reshape(-1)  # x[0] is then one element of the flat input
    before_x, before_state = x.clone(), copy.deepcopy(model.state_dict())
    t = md.trace(_in_place, model, x)
    r = md.replay(t, (model, x))
    assert torch.equal(x, before_x)
    assert all(torch.equal(v, before_state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(r.output, _eager(model, _in_place, (x.clone(),), t.rng_state)[0])


@pytest.mark.parametrize("wrong", ["shape", "stride"])
def test_replay_wrong_user_rule_is_a_mismatch(wrong):
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU())

    @md.register_meta(torch.ops.aten.relu.default, override=True)
    def bad_relu(x):
        if wrong == "shape":
            return x.new_empty(x.shape[0], x.shape[1] + 1)
        return x.new_empty(x.shape[1], x.shape[0]).t()

    try:
        t = md.trace(lambda m, x: m(x), model, torch.randn(3, 4))
    finally:
        md.unregister_meta(torch.ops.aten.relu.default)
    r = md.replay(t, (model, torch.randn(3, 4)))
    assert not r.ok
    (m,) = r.mismatches
    assert (m.op, m.module, m.rule) == ("aten.relu.default", "1", "user")
    assert wrong in m.fields
    assert "aten.relu.default in 1 [user]" in str(m)


def test_replay_refuses_inside_metamode():
    t = md.trace(lambda x: x + 1, torch.ones(2))
    with md.MetaMode(), pytest.raises(RuntimeError, match="dispatch mode"):
        md.replay(t)


def test_replay_rejects_inputs_of_another_shape():
    t = md.trace(lambda x: x + 1, torch.ones(2))
    with pytest.raises(ValueError, match="arg args\\[0\\]"):
        md.replay(t, (torch.ones(3),))


def test_repro_snippet_runs_the_call(capsys):
    t = md.trace(lambda x: x.t() @ x, torch.ones(3, 2))
    snippet = t[1].repro()
    assert "torch.ops.aten.mm.default(t1, t0)" in snippet
    exec(snippet, {})
    assert capsys.readouterr().out == "output 0: ok ((2, 2), torch.float32, (2, 1), 0)\n"


def test_repro_snippet_shows_a_wrong_rule(capsys):
    md.register_meta(torch.ops.aten.relu.default, override=True)(lambda x: x.new_empty(x.shape[1], x.shape[0]).t())
    try:
        t = md.trace(torch.relu, torch.ones(2, 3))
    finally:
        md.unregister_meta(torch.ops.aten.relu.default)
    exec(t[0].repro(), {})
    assert (
        "recorded ((2, 3), torch.float32, (1, 2), 0), real ((2, 3), torch.float32, (3, 1), 0)"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "module", ["execution.replay", "binding.leaves", "ir.repro", "ir.serialize", "ir.decode", "execution.materialize"]
)
def test_replay_docstring_examples_run(module):
    __import__(f"metadispatch.{module}")
    result = doctest.testmod(sys.modules[f"metadispatch.{module}"], optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_replay_optimizer_step_runs_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x = torch.randn(5, 3)

    def step(model, x):
        model(x).pow(2).sum().backward()
        torch.optim.AdamW(model.parameters(), fused=True).step()  # after backward: stand-ins

    t = md.trace(step, model, x)
    assert any(c.phase == "optimizer" and c.op == "aten._fused_adamw_.default" for c in t)
    # the optimizer's record_function range is recorded, and replay skips it
    assert [c.op for c in t if c.op.startswith("profiler.")] == [
        "profiler._record_function_enter_new.default",
        "profiler._record_function_exit._RecordFunction",
    ]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    r = md.replay(t, (model, x))
    assert r.ok, r
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # given module untouched
    t.save(tmp_path / "opt.json")
    assert str(md.Trace.load(tmp_path / "opt.json")) == str(t)


@pytest.mark.parametrize(
    "make, shape",
    [(lambda: nn.LazyLinear(3), (2, 4)), (lambda: nn.LazyConv1d(3, 2), (2, 4, 5))],
    ids=["linear", "conv1d"],
)
def test_replay_lazy_module_materialised_in_the_step_matches_eager(make, shape):
    # Note [Lazy modules in replay]: the first forward's materialisation is
    # recorded as construction; the module given to replay is still lazy.
    torch.manual_seed(0)
    model, x = make(), torch.randn(*shape)
    t = md.trace(_lazy_step, model, x)
    assert nn.parameter.is_lazy(model.weight)  # md.trace leaves the user's module as it was
    out, grads, _ = _eager(model, _lazy_step, (x,), t.rng_state)
    r = md.replay(t, (model, x))
    assert r.ok, r.mismatches
    assert torch.equal(r.output, out)
    assert sorted(r.grads) == ["bias", "weight"]
    assert all(torch.equal(r.grads[n], grads[n]) for n in r.grads)


def _lazy_step(m, x):
    y = m(x)
    y.square().sum().backward()
    return y


# torch.autograd.grad(..., is_grads_batched=True) goes to torch's own grad (vmap
# over the engine) from _compat.engine_grad: traced op for op as eager runs it,
# replayed to eager's values, counted as the real run holds it.


def _jacobian_then_second_order(m, x):
    y = m(x.requires_grad_())  # [2, 3]
    (j,) = torch.autograd.grad(
        y, x, torch.eye(3).unsqueeze(1).expand(3, 2, 3), is_grads_batched=True, create_graph=True
    )
    j.square().sum().backward()
    return j


def _per_output_weight_grads(m, x):
    return torch.autograd.grad(m(x).sum(0), list(m.parameters()), torch.eye(3), is_grads_batched=True)


@pytest.mark.parametrize("step", [_jacobian_then_second_order, _per_output_weight_grads], ids=lambda f: f.__name__)
def test_replay_batched_grads_match_eager(step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    x = torch.randn(2, 4)
    md.testing.assert_matches_eager(step, copy.deepcopy(model), x.clone())  # ops and metadata, in order
    t = md.trace(step, model, x.clone())
    out, grads, _ = _eager(model, step, (x.clone(),), t.rng_state)
    r = md.replay(t, (model, x.clone()))
    assert r.ok, r.mismatches
    expected = out if isinstance(out, tuple) else (out,)
    assert all(torch.equal(a, b) for a, b in zip(r.output if isinstance(r.output, tuple) else (r.output,), expected))
    assert all(torch.equal(r.grads[n], grads[n]) for n in r.grads)
    xr, real = x.clone(), copy.deepcopy(model)
    with md.LiveStorages(real, xr) as live:
        step(real, xr)
    assert md.memory(t, workspaces=False).peak == live.peak
