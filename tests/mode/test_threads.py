"""Two threads tracing at once do not see each other's calls.

Module hooks (attribution, stand-ins) are process-global and filter by
thread; the logical-CUDA patch is process-global and counted.
"""

import threading

import pytest
import torch
from torch import nn

import metadispatch as md

ROUNDS = 8


def _run_threads(*workers):
    errors = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        return run

    threads = [threading.Thread(target=guard(w)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]


def test_threads_mode_traces_are_independent():
    barrier = threading.Barrier(2)
    seen = {"relu": set(), "sigmoid": set()}

    def worker(act, width, device):
        def run():
            barrier.wait()
            for _ in range(ROUNDS):
                model = nn.Sequential(nn.Linear(width, width), act())
                with md.MetaMode(device=device) as mode:
                    model(torch.ones(2, width, device=device)).sum().backward()
                seen[act.__name__.lower()].add(
                    frozenset((c.op, c.module, str(o.device), o.shape) for c in mode.trace for o in c.output_metas)
                )

        return run

    _run_threads(worker(nn.ReLU, 3, "cuda"), worker(nn.Sigmoid, 5, "cpu"))
    (relu,), (sigmoid,) = seen["relu"], seen["sigmoid"]  # every round traced the same
    assert "aten.relu.default" in {op for op, *_ in relu}
    assert not {op for op, *_ in relu} & {"aten.sigmoid.default", "aten.sigmoid_backward.default"}
    assert {dev for _, _, dev, _ in relu} == {"cuda:0"}
    assert {dev for _, _, dev, _ in sigmoid} == {"cpu"}
    assert {shape for *_, shape in sigmoid} <= {(2, 5), (5, 5), (5,), (5, 2), (2, 1), (1, 5), ()}


def test_threads_md_trace_attributes_own_modules():
    barrier = threading.Barrier(2)
    results = {}

    def worker(name, model, shape):
        def run():
            barrier.wait()
            results[name] = {str(md.trace(model, torch.ones(*shape))) for _ in range(ROUNDS)}

        return run

    a = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    b = nn.Sequential(nn.Linear(5, 2), nn.Tanh(), nn.Linear(2, 2))
    _run_threads(worker("a", a, (2, 3)), worker("b", b, (4, 5)))
    assert results == {"a": {str(md.trace(a, torch.ones(2, 3)))}, "b": {str(md.trace(b, torch.ones(4, 5)))}}


def test_threads_logical_cuda_survives_other_threads_exit():
    # First in, first out: the exit of the mode entered first must not take
    # away what the other thread's mode needs for logical CUDA (the FAKE mode
    # slot is per thread; Note [Logical CUDA without CUDA]).
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    devices = []
    lazy_init = torch.cuda._lazy_init

    def first():
        with md.MetaMode(device="cuda"):
            first_in.set()
            second_in.wait()
        first_out.set()

    def second():
        first_in.wait()
        with md.MetaMode():
            second_in.set()
            first_out.wait()
            devices.append(torch.ones(2, device="cuda").device)
            devices.append(torch.arange(3, device="cuda:1").device)
            devices.append(torch.tensor([1.0], device="cuda").device)

    _run_threads(first, second)
    assert devices == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0)]
    assert torch.cuda._lazy_init is lazy_init  # nothing global was patched


def test_threads_share_the_metadata_cache_while_it_evicts(monkeypatch):
    # A tiny limit makes every miss evict while the other thread stores.
    monkeypatch.setattr(md.core.cache, "LIMIT", 4)
    barrier = threading.Barrier(2)
    shapes = {}

    def worker(name, offset):
        def run():
            barrier.wait()
            with md.MetaMode():
                shapes[name] = [tuple((torch.ones(n + offset, 3) @ torch.ones(3, n)).shape) for n in range(1, 40)]

        return run

    _run_threads(worker("a", 0), worker("b", 100))
    assert shapes["a"] == [(n, n) for n in range(1, 40)]
    assert shapes["b"] == [(n + 100, n) for n in range(1, 40)]
    assert len(md.core.cache._SHARED) <= 4


def _shared_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).pow(2).mean().backward()  # real state: moments, a step count
    opt.step()
    opt.zero_grad()
    return model, opt


def _eager(model, x):
    out = model(x)
    return (out, *torch.autograd.grad(out.pow(2).mean(), list(model.parameters())))


@pytest.mark.parametrize("options", [{}, {"device": "cuda"}, {"device": "cuda", "world_size": 2}], ids=str)
def test_threads_eager_in_another_thread_sees_the_real_model(options):
    """Note [Other threads see the real model]: while one thread traces a
    training step of a model (forward, backward, AdamW), another running the
    same model eagerly 1,000 times gets, every time, what a single-threaded
    eager run gets; the real parameters gain no ``.grad``, their versions
    and the optimizer's state do not move, and torch's process-wide answers
    (``torch.cuda``, ``torch.distributed``) are the host's in that thread."""
    model, opt = _shared_model()
    x = torch.randn(8, 16)
    expected = _eager(model, x)
    params = list(model.parameters())
    versions = [p._version for p in params]
    state = [(s, k, v, v.clone()) for s in opt.state.values() for k, v in s.items()]
    host = (torch.cuda.is_available(), torch.distributed.is_initialized())
    done = threading.Event()
    traced = []

    def step(x):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if "world_size" in options:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
        opt.step()

    def tracing():
        while not done.is_set():
            traced.append(md.tracer(**options)(step, torch.randn(8, 16)))
            del traced[:-1]

    def eager():
        try:
            for _ in range(1000):
                got = _eager(model, x)
                assert all(type(g) is torch.Tensor and torch.equal(g, e) for g, e in zip(got, expected))
                assert (torch.cuda.is_available(), torch.distributed.is_initialized()) == host
                assert all(p.grad is None for p in params)
        finally:
            done.set()

    _run_threads(tracing, eager)
    assert traced and any(c.phase == "optimizer" for c in traced[-1])
    assert [p._version for p in params] == versions and all(p.grad is None for p in params)
    assert all(s[k] is v and torch.equal(v, saved) for s, k, v, saved in state)
    assert all(type(v) is torch.Tensor for s in opt.state.values() for v in s.values())
