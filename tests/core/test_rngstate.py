"""Recording RNG state reads and writes while tracing (core/rngstate.py).

Each case runs eagerly and replays from the same start state; the replayed
values must be eager's.  The patched torch functions must be torch's own
again after the mode, also when the traced code raises.
"""

from __future__ import annotations

import pytest
import torch

import metadispatch as md

_TORCH_FUNCTIONS = [
    (torch, "get_rng_state"),
    (torch, "set_rng_state"),
    (torch, "manual_seed"),
    (torch.random, "get_rng_state"),
    (torch.random, "set_rng_state"),
    (torch.random, "manual_seed"),
    (torch.cuda, "get_rng_state"),
    (torch.cuda, "set_rng_state"),
]


def _functions():
    return [getattr(mod, name) for mod, name in _TORCH_FUNCTIONS]


def _eager_and_replay(fn, x):
    trace = md.trace(fn, x)
    with torch.random.fork_rng():
        torch.set_rng_state(trace.rng_state)
        expected = fn(x)
    return trace, expected, md.replay(trace, (x,))


def _seeded(x):
    a = torch.nn.functional.dropout(x, 0.5)
    torch.manual_seed(123)
    return a + torch.rand(x.shape)


def _forked(x):
    with torch.random.fork_rng():
        a = torch.rand(x.shape)
    return a - torch.rand(x.shape)  # eager draws the same numbers twice: zero


def _saved_by_hand(x):
    state = torch.get_rng_state()
    a = torch.randn(x.shape)
    torch.set_rng_state(state)
    return a - torch.randn(x.shape)


@pytest.mark.parametrize("fn", [_seeded, _forked, _saved_by_hand])
def test_rngstate_replay_draws_what_eager_drew(fn):
    trace, expected, r = _eager_and_replay(fn, torch.ones(16))
    assert trace.rng_events, "nothing recorded"
    assert r.ok and torch.equal(r.output, expected)


def test_rngstate_a_state_from_before_the_trace_is_kept_as_bytes():
    before = torch.get_rng_state()
    trace, expected, r = _eager_and_replay(lambda x: (torch.set_rng_state(before), torch.rand(3))[1], torch.ones(1))
    (event,) = trace.rng_events
    assert event.action == "load" and torch.equal(event.state, before)
    assert r.ok and torch.equal(r.output, expected)


def test_rngstate_patches_are_torchs_after_the_mode_and_after_an_error():
    originals = _functions()
    md.trace(_saved_by_hand, torch.ones(2))
    assert _functions() == originals

    def fails(x):
        torch.get_rng_state()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        md.trace(fails, torch.ones(2))
    assert _functions() == originals


def test_rngstate_nested_modes_record_once():
    with md.MetaMode() as outer:
        with md.MetaMode():
            torch.get_rng_state()
        torch.get_rng_state()
    assert [e.action for e in outer.trace.rng_events] == ["save"]
    assert _functions()[0] is not None and torch.get_rng_state.__module__ == "torch.random"


def test_rngstate_other_threads_are_not_recorded():
    import threading

    seen = []
    with md.MetaMode() as mode:
        t = threading.Thread(target=lambda: seen.append(torch.get_rng_state()))
        t.start()
        t.join()
    assert seen and mode.trace.rng_events == []


def test_rngstate_tracing_leaves_the_generators_alone():
    g = torch.Generator().manual_seed(4)
    cpu, gen = torch.get_rng_state(), g.get_state()
    md.trace(lambda x: _seeded(x) + torch.randn(x.shape, generator=g), torch.ones(4))
    assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(g.get_state(), gen)


def test_rngstate_manual_seed_in_a_logical_world_is_recorded():
    # The world answered torch.cuda.is_initialized() True on a host without
    # CUDA, so seeding read CUDA generators that do not exist (IndexError).
    # A world's trace replays only in a real job: its events are compared
    # with a one-process trace's, whose replay is eager's (above).
    x = torch.ones(16)
    world, alone = md.tracer(world_size=2)(_seeded, x), md.trace(_seeded, x)
    with torch.random.fork_rng():
        torch.manual_seed(123)
        seeded = torch.get_rng_state()
    assert [(e.action, e.stream, e.at) for e in world.rng_events] == [
        (e.action, e.stream, e.at) for e in alone.rng_events
    ]
    assert any(e.action == "load" and torch.equal(e.state, seeded) for e in world.rng_events)
    assert not torch.cuda.is_initialized()


def test_rngstate_a_seeded_state_is_read_as_itself():
    # The bytes of the state torch.manual_seed set were read through the
    # mode's torch-function layer (the real tensor's stand-in) and, after a
    # few traces, matched a marker: replay then loaded another state.
    x = torch.ones(16)
    for _ in range(4):
        md.tracer(world_size=2)(_seeded, x)
        trace, expected, r = _eager_and_replay(_seeded, x)
        assert r.ok and torch.equal(r.output, expected)
