"""md.tracer(warmup=N) and md.mark against real CPU runs: the steady-state step and the step after a build."""

import pytest
import torch
from torch import nn

import metadispatch as md
from metadispatch.debug.check import guessing_mode
from tests.models import MODELS, train_step


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


def resnet():
    stem = (nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    head = (nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    return nn.Sequential(*stem, _Block(8), _Block(8), *head), (torch.randn(2, 3, 8, 8),)


MAKERS = {"llama": MODELS["llama"], "gpt2": MODELS["hf_gpt2"], "resnet": resnet}
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adafactor": lambda ps: torch.optim.Adafactor(ps),  # reads param.norm().item(): guessed
}


def _predicted_and_real(make, optimizer, warmup: int) -> tuple:
    model, inputs = make()
    opt = OPTIMIZERS[optimizer](model.parameters())

    def step(*xs):
        train_step(model, *xs)
        opt.step()
        opt.zero_grad()

    trace = md.tracer(warmup=warmup, mode_factory=guessing_mode)(step, *inputs)
    assert trace.warmup == warmup and not opt.state  # the user's optimizer is left as it was
    predicted = md.memory(trace, workspaces=False).peak  # what LiveStorages sees: storages
    for _ in range(warmup):
        step(*inputs)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in model.parameters()]
    with md.LiveStorages(model, *inputs, *state, *grads) as live:
        step(*inputs)
    return predicted, live.peak


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("warmup", [0, 1])
def test_steady_state_peak_equals_the_real_steps_live_storages(name, optimizer, warmup):
    predicted, real = _predicted_and_real(MAKERS[name], optimizer, warmup)
    assert abs(predicted - real) <= 1024


def test_steady_state_carries_the_optimizers_state_from_the_start():
    model, inputs = MODELS["mlp"]()
    opt = torch.optim.AdamW(model.parameters())

    def step(x):
        train_step(model, x)
        opt.step()
        opt.zero_grad()

    first, second = md.memory(md.tracer()(step, *inputs)), md.memory(md.tracer(warmup=1)(step, *inputs))
    params = sum(p.numel() * 4 for p in model.parameters())
    assert second.timeline[0] - first.timeline[0] == 2 * params  # exp_avg, exp_avg_sq
    assert second.by_category["optimizer state"] >= 2 * params
    assert "Step 2, the steady state" in str(second) and "Step 1, no warmup" in str(first)


def test_steady_state_trace_keeps_what_warmup_left_as_state_leaves():
    model, inputs = MODELS["mlp"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x):
        train_step(model, x)
        opt.step()
        opt.zero_grad()

    t = md.tracer(warmup=1)(step, *inputs)
    state = [leaf for leaf in t.leaves.values() if leaf.kind == "state"]
    momenta = [leaf for leaf in state if leaf.name.startswith("optimizer")]
    assert len(momenta) == len(list(model.parameters()))  # one momentum buffer each, made by step 1
    assert [c.index for c in t.calls] == list(range(len(t.calls)))


def test_memory_since_a_mark_leaves_the_build_out_of_the_activations():
    def step(x):
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))  # built in the trace
        md.mark("built")
        model(x).sum().backward()

    t = md.tracer()(step, torch.ones(4, 64))
    whole, after = md.memory(t, workspaces=False), md.memory(t, since="built", workspaces=False)
    params = (64 * 256 + 256 + 256 * 64 + 64) * 4
    assert whole.by_category["activations"] >= params  # the build counted as the forward's
    assert after.by_category["activations"] < params
    assert after.peak == whole.peak  # nothing dies: the same bytes, named for what they are
    with pytest.raises(md.MetaDispatchError, match="'built'"):
        md.memory(t, since="nope")


def test_mark_outside_a_trace_does_nothing():
    assert md.mark("x") == "x"


def test_steady_state_trace_saves_and_loads_its_step(tmp_path):
    model, inputs = MODELS["mlp"]()
    opt = torch.optim.AdamW(model.parameters())

    def step(x):
        train_step(model, x)
        md.mark("forward")
        opt.step()
        opt.zero_grad()

    t = md.tracer(warmup=1)(step, *inputs)
    t.save(tmp_path / "t.json")
    back = md.Trace.load(tmp_path / "t.json")
    assert (back.warmup, back.marks) == (1, t.marks) and t.marks["forward"] > 0
    assert md.memory(back).timeline == md.memory(t).timeline
    assert md.memory(back, since="forward").peak == md.memory(t, since="forward").peak


def test_steady_state_replay_reads_the_step_count_the_warmup_left(tmp_path):
    # Note [Known state across a cut]: AdamW's step count, made in the first
    # step as a constant (torch.tensor(0.0)) and counted up, is read with
    # .item() by the traced second step; replay bound the constant's first
    # value and said "value 2.0 when traced, 1.0 now" on every parameter.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())

    def step(x):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    x = torch.randn(4, 8)
    trace = md.tracer(warmup=1)(step, x)
    counts = [leaf.value for leaf in trace.leaves.values() if leaf.value is not None and leaf.meta.shape == ()]
    assert counts and all(float(v) == 1.0 for v in counts)  # one step taken before the cut
    path = tmp_path / "t.json.gz"
    trace.save(path)
    for t in (trace, md.Trace.load(path)):
        assert md.replay(t, (x,), module=model).mismatches == []


def test_steady_state_lists_a_guessing_modes_made_up_values_for_the_warmup_and_the_step():
    # Adafactor reads param.norm().item(): each read made up is one assumption
    # in the trace md.tracer returns, its index that of the read in the step,
    # the warmup's kept at call 0 (the state the step starts from follows them)
    model, inputs = MODELS["mlp"]()
    opt = torch.optim.Adafactor(model.parameters())

    def step(x):
        train_step(model, x)
        opt.step()
        opt.zero_grad()

    one = md.tracer(mode_factory=guessing_mode)(step, *inputs)
    two = md.tracer(warmup=1, mode_factory=guessing_mode)(step, *inputs)
    n = len(one.assumptions)
    assert n >= len(list(model.parameters())) and len(two.assumptions) == 2 * n
    assert all(one.calls[a.index].op == a.op == "aten._local_scalar_dense.default" for a in one.assumptions)
    warm, taken = two.assumptions[:n], two.assumptions[n:]
    assert [a.index for a in warm] == [0] * n and all("before the cut, at call #" in a.basis for a in warm)
    assert [(a.op, a.value) for a in taken] == [(a.op, a.value) for a in one.assumptions]
    assert all(two.calls[a.index].op == a.op for a in taken)


def test_warmup_keeps_a_guessing_modes_made_up_values_and_drops_a_declared_policys():
    # Note [Warm-up assumptions: declared ones go, made-up ones stay] in values/assume.py:
    # the same read, once made up by a guessing mode and once given by assume='s values=
    def step(x):
        return x * 2 if bool((x > 0).all()) else x

    x = torch.randn(3)
    site = "aten._local_scalar_dense.default"
    policy = md.GenerateAssumptions(values={site: True})
    guessed = md.tracer(warmup=1, mode_factory=guessing_mode)(step, x)
    declared = md.tracer(warmup=1, assume=policy)(step, x)
    assert [a.op for a in declared.assumptions] == [site]  # the step's own read; the warm-up's went
    warm, own = guessed.assumptions
    assert (warm.op, own.op) == (site, site) and warm.index == 0 and "before the cut, at call #" in warm.basis
    assert declared.assumptions[0].index == own.index and "before the cut" not in declared.assumptions[0].basis


def _resized(inputs: tuple, batch: int) -> tuple:
    return tuple(x.repeat(batch, *[1] * (x.dim() - 1))[:batch] for x in inputs)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_steps_after_one_warmup_are_the_direct_traces_of_each(name):
    # Note [One warm-up, several steps]: batches 3 and 4 of one model after one warm-up at 3,
    # each cut out, against each traced alone (a warm-up of its own): the same calls and figures
    model, inputs = MAKERS[name]()
    opt = torch.optim.AdamW(model.parameters())

    def step(*xs):
        train_step(model, *xs)
        opt.step()
        opt.zero_grad()

    run = md.tracer(device="cuda", gpu="l4", warmup=1)
    batches = [_resized(inputs, b) for b in (3, 4)]
    shared = run.steps(step, [(xs, {}) for xs in batches])
    for one, xs in zip(shared, batches):
        alone = run(step, *xs)
        assert [c.op for c in one.calls] == [c.op for c in alone.calls] and one.warmup == alone.warmup == 1
        a, b = md.memory(one), md.memory(alone)
        assert (a.peak, a.timeline, a.by_category) == (b.peak, b.timeline, b.by_category)
        assert md.fits(one, "l4").reserved_peak == md.fits(alone, "l4").reserved_peak
        assert sorted(leaf.kind for leaf in one.leaves.values()) == sorted(leaf.kind for leaf in alone.leaves.values())
    assert not opt.state  # the user's optimizer is left as it was


def test_steps_on_views_of_one_buffer_keep_the_buffer_each_step_reads():
    # batches as slices of one dataset tensor (data[:8], data[:9]): the other call's argument is
    # no leaf of a step's trace, but its storage is this step's own; it was counted dead at the
    # step's start (2 MiB peak, not the 18 MiB a trace of the step alone holds)
    data = torch.randn(64, 2**16)  # 16 MiB

    def step(x):
        return (x * 2).sum()

    run = md.tracer(device="cuda", warmup=1)
    shared = run.steps(step, [((data[:8],), {}), ((data[:9],), {})])
    for one, b in zip(shared, (8, 9)):
        a, alone = md.memory(one), md.memory(run(step, data[:b]))
        assert (a.peak, a.timeline) == (alone.peak, alone.timeline)
