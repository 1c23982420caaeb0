"""Two threads tracing at once do not see each other's calls.

Module hooks (attribution, stand-ins) are process-global and filter by
thread; the logical-CUDA patch is process-global and counted.
"""

import threading

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
