"""torch.cuda under a logical-GPU MetaMode: the profile's answers in its thread only
(Note [The logical GPU answers per thread] in gpu/cuda_answers.py), and the
memory counters from the trace so far (Note [Memory counters from the trace
so far] in analysis/cuda_counters.py), checked against md.memory of the
same prefix of the trace."""

import copy
import threading

import pytest
import torch

import metadispatch as md

_MEMORY = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats")
_FUNCTIONS = (
    "is_available",
    "device_count",
    "get_device_name",
    "get_device_capability",
    "get_device_properties",
    "current_stream",
    "Stream",
    "Event",
    *_MEMORY,
)
_OTHERS = ("mem_get_info", "synchronize", "stream", "default_stream", "reset_peak_memory_stats")


def _torch_functions():
    return (
        {name: getattr(torch.cuda, name) for name in (*_FUNCTIONS, *_OTHERS)}
        | {"memory." + n: getattr(torch.cuda.memory, n) for n in (*_MEMORY, "reset_peak_memory_stats")}
        | {"nvtx." + n: getattr(torch.cuda.nvtx, n) for n in ("range_push", "range_pop", "mark")}
        | {"accelerator." + n: getattr(torch.accelerator, n) for n in ("current_stream", "device_count")}
    )


def _asked():
    """What code asking about the GPU sees: each answer (a stream's or event's
    type: each is a new object), or the error's type."""
    seen = {}
    for name in _FUNCTIONS:
        try:
            answer = getattr(torch.cuda, name)()
            seen[name] = type(answer) if name in ("Stream", "Event", "current_stream") else answer
        except Exception as e:  # torch's own answer on a host without the GPU
            seen[name] = type(e)
    return seen


@pytest.mark.parametrize("gpu", ["h100", "a100-40gb", "l4"])
def test_cuda_answers_are_the_profiles(gpu):
    profile = md.gpu_profile(gpu)
    with md.MetaMode(device="cuda", gpu=gpu):
        props = torch.cuda.get_device_properties(0)
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        assert torch.cuda.get_device_capability() == profile.compute_capability == (props.major, props.minor)
        assert torch.cuda.get_device_name() == props.name == profile.title
        assert props.total_memory == profile.memory and props.multi_processor_count == profile.sm_count
        assert torch.cuda.mem_get_info() == (profile.memory, profile.memory)
        torch.cuda.set_device(0)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.range_pop()


def test_cuda_answers_model_code_asking_for_the_gpu_traces():
    def step(x):
        major, _ = torch.cuda.get_device_capability()  # as transformers does before _grouped_mm
        return x * major

    trace = md.tracer(device="cuda", gpu="h100")(step, torch.randn(3))
    assert trace.calls[-1].args[1] == 9


def test_cuda_answers_nothing_outside_the_mode_and_after_an_exception():
    before, functions = _asked(), _torch_functions()
    with pytest.raises(ValueError):
        with md.MetaMode(device="cuda", gpu="h100"):
            with md.MetaMode(device="cuda", gpu="h100"):
                assert torch.cuda.is_available()
            assert torch.cuda.is_available()
            raise ValueError
    assert _torch_functions() == functions and _asked() == before


def test_cuda_answers_an_inner_mode_on_another_device_gets_torchs():
    before = _asked()
    with md.MetaMode(device="cuda", gpu="h100"):
        with md.MetaMode(device="cpu"):
            assert _asked() == before
        assert torch.cuda.is_available()


def test_cuda_answers_other_threads_get_torchs_and_their_own_profiles():
    before = _asked()
    entered, asked = threading.Barrier(3), threading.Barrier(3)
    seen = {}

    def in_mode(gpu):
        with md.MetaMode(device="cuda", gpu=gpu):
            entered.wait()
            seen[gpu] = torch.cuda.get_device_name()
            asked.wait()

    def outside():
        entered.wait()  # both modes are entered now
        seen["none"] = _asked()
        asked.wait()

    threads = [threading.Thread(target=in_mode, args=(g,)) for g in ("h100", "l4")] + [threading.Thread(target=outside)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"h100": md.gpu_profile("h100").title, "l4": md.gpu_profile("l4").title, "none": before}
    assert _asked() == before


def _snapshot(mode):
    """What a real GPU's counters say now, with the prefix of the trace they describe."""
    t = mode.trace
    return {
        "calls": len(t.calls),
        "deaths": dict(t.deaths),
        "leaves": dict(t.leaves),
        "allocated": torch.cuda.memory_allocated(),
        "peak": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "reserved_peak": torch.cuda.max_memory_reserved(),
        "stats": torch.cuda.memory_stats(),
        "free": torch.cuda.mem_get_info()[0],
    }


def _prefix(trace, seen):
    """The trace as it stood when ``seen`` was taken: its calls, and the deaths and leaves recorded by then."""
    p = copy.copy(trace)
    p.calls, p.deaths, p.leaves = trace.calls[: seen["calls"]], seen["deaths"], seen["leaves"]
    return p


def _train_step_with_questions():
    with md.MetaMode(device="cuda", gpu="h100") as mode:
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(32, 64, device="cuda")
        seen = {"built": _snapshot(mode)}
        loss = model(x).square().mean()
        seen["forward"] = _snapshot(mode)
        loss.backward()
        del loss
        seen["backward"] = _snapshot(mode)
        torch.cuda.reset_peak_memory_stats()
        seen["reset"] = _snapshot(mode)
        with torch.no_grad():
            model(x[:2])
        seen["small"] = _snapshot(mode)
        opt.step()
        opt.zero_grad()
        seen["step"] = _snapshot(mode)
    return mode.trace, seen


def test_cuda_answers_memory_counters_are_md_memory_of_the_trace_so_far():
    trace, seen = _train_step_with_questions()
    gpu = md.gpu_profile("h100")
    for when in ("built", "forward", "backward"):
        s = seen[when]
        m = md.memory(_prefix(trace, s), allocator="cuda", gpu=gpu, device="cuda")
        live = sum(info.allocated for info in m.memory.storages.values() if info.died is None)
        assert (s["allocated"], s["peak"]) == (live, m.memory.peak) == (live, m.peak), when
        assert (s["reserved"], s["reserved_peak"]) == (m.reserved_timeline[-1], m.reserved_peak), when
        assert s["free"] == gpu.memory - s["reserved"]
        assert s["stats"]["allocated_bytes.all.peak"] == s["peak"] and s["stats"]["num_ooms"] == 0
    assert seen["built"]["allocated"] < seen["forward"]["peak"] <= seen["backward"]["peak"]
    assert seen["backward"]["allocated"] < seen["backward"]["peak"]  # activations freed


def test_cuda_answers_max_memory_after_a_reset_is_the_peak_since():
    trace, seen = _train_step_with_questions()
    reset = seen["reset"]
    # torch starts the peak again from what is allocated at the reset
    assert (reset["peak"], reset["reserved_peak"]) == (reset["allocated"], reset["reserved"])
    for when in ("small", "step"):
        s = seen[when]
        # AdamW's step counters are host tensors, as on a GPU: not counted
        m = md.memory(_prefix(trace, s), allocator="cuda", gpu="h100", device="cuda")
        since = m.memory.timeline[reset["calls"] :]
        assert s["peak"] == max(reset["allocated"], s["allocated"], *since), when
        assert s["reserved_peak"] == max(reset["reserved"], *m.reserved_timeline[reset["calls"] :]), when
    # a small forward after the reset: below the backward's peak, which the reset forgot
    assert reset["allocated"] < seen["small"]["peak"] < seen["backward"]["peak"]


def _blocks(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the CUDA caching allocator's 512-byte blocks


def _offloaded_step():
    """A training step whose fp32 master weights, gradients' copies and AdamW
    state live on the host, as ZeRO-Offload keeps them: the GPU holds the
    parameters, the batch, the activations and the gradients."""
    with md.MetaMode(device="cuda", gpu="h100") as mode:
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).cuda()
        master = [p.detach().cpu().requires_grad_() for p in model.parameters()]
        opt = torch.optim.AdamW(master)
        x = torch.randn(64, 256, device="cuda")
        built = torch.cuda.memory_allocated()
        model(x).square().mean().backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.cpu()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)
        seen = {"built": built, "now": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}
        seen["stats"] = torch.cuda.memory_stats()
    return mode.trace, model, x, seen


def test_cuda_answers_memory_counters_count_the_gpus_storages_alone():
    # The CUDA allocator counts its own device's blocks: the host's master
    # weights, gradient copies and AdamW state are in the trace, not in
    # memory_allocated, max_memory_allocated or memory_stats.
    trace, model, x, seen = _offloaded_step()
    gpu = md.memory(trace, device="cuda")
    host = md.memory(trace, device="cpu")
    params = sum(_blocks(p.nbytes) for p in model.parameters())
    workspaces = sum(s.allocated for s in gpu.storages.values() if s.category == "workspaces")
    assert seen["built"] == params + _blocks(x.nbytes)
    # at the end: the built state, each parameter's gradient, the cuBLAS workspaces
    assert seen["now"] == seen["built"] + params + workspaces
    assert (seen["now"], seen["peak"]) == (gpu.timeline[-1], gpu.peak)
    assert seen["stats"]["allocated_bytes.all.peak"] == seen["peak"]
    # the host's bytes: master weights, their gradients and AdamW's two moments, at least
    assert host.timeline[-1] >= 4 * sum(p.nbytes for p in model.parameters())
    assert md.memory(trace).peak > seen["peak"]


def test_cuda_answers_asking_records_nothing():
    with md.MetaMode(device="cuda", gpu="h100") as mode:
        torch.ones(4, device="cuda").sum()
        n = len(mode.trace.calls)
        _snapshot(mode)
        torch.cuda.reset_max_memory_allocated()
        assert len(mode.trace.calls) == n


def _streams(x):
    s, done = torch.cuda.Stream(), torch.cuda.Event(enable_timing=True)
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2
    done.record(s)
    torch.cuda.current_stream().wait_event(done)
    done.synchronize()
    assert done.query() and start.elapsed_time(done) == 0.0  # a trace has no timing
    assert isinstance(s, torch.cuda.Stream) and isinstance(done, torch.cuda.Event)
    return y + 1


def test_cuda_answers_streams_and_events_order_nothing():
    x = torch.randn(8)
    with_streams = md.tracer(device="cuda", gpu="h100")(_streams, x)
    plain = md.tracer(device="cuda", gpu="h100")(lambda x: x * 2 + 1, x)
    assert [c.op for c in with_streams.calls] == [c.op for c in plain.calls]


def test_cuda_answers_another_threads_streams_and_counters_are_torchs():
    seen = {}

    def ask(key):
        try:
            stream = type(torch.cuda.Stream())
        except Exception as e:  # torch's own answer on a host without CUDA
            stream = type(e)
        seen[key] = (stream, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())

    ask("before")
    with md.MetaMode(device="cuda", gpu="h100"):
        x = torch.ones(1024, device="cuda")
        ask("inside")
        t = threading.Thread(target=ask, args=("other thread",))
        t.start()
        t.join()
        del x
    ask("after")
    assert seen["other thread"] == seen["before"] == seen["after"]
    assert seen["inside"] == (md.gpu.logical_cuda.Stream, 4096, 4096) != seen["before"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a world answers for a logical GPU only without a real one")
def test_cuda_answers_a_logical_world_answers_its_ranks_memory():
    with md.MetaMode(world_size=2) as mode:
        model = torch.nn.Linear(64, 64).cuda()
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        s = _snapshot(mode)
    m = md.memory(_prefix(mode.trace, s), allocator="cuda", gpu=md.gpu_profile(None))
    assert (s["peak"], s["reserved_peak"]) == (m.peak, m.reserved_peak) and s["peak"] > 0
    assert torch.cuda.max_memory_allocated() == 0  # torch's own again


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA generator answers for itself")
def test_cuda_answers_rng_state_on_a_logical_gpu_is_a_slot():
    # Note [A logical GPU's generator state]: saving and restoring the GPU's
    # state (fork_rng, a trainer's checkpoint) raised "Torch not compiled with
    # CUDA enabled" although is_available() said True; it is recorded as the
    # slots a real GPU's replay reads and writes.
    def step(x):
        with torch.random.fork_rng(devices=[0]):
            torch.nn.functional.dropout(x, 0.5)
        saved = torch.cuda.get_rng_state()
        torch.nn.functional.dropout(x, 0.5)
        torch.cuda.set_rng_state(saved)
        torch.cuda.set_rng_state_all(torch.cuda.get_rng_state_all())
        return x

    trace = md.tracer(device="cuda", gpu="h100")(step, torch.randn(8))
    cuda = [(e.action, e.slot) for e in trace.rng_events if e.stream == "cuda:0"]
    assert cuda == [("save", 1), ("load", 1), ("save", 2), ("load", 2), ("save", 3), ("load", 3)]
    with pytest.raises(Exception, match="CUDA|NVIDIA"):  # torch's own answer again outside the mode (CPU or CUDA build)
        torch.cuda.get_rng_state()


def test_autocast_on_a_logical_gpu_casts_as_cuda_does():
    # Note [Autocast on a logical GPU]: C++ autocast casts nothing on a
    # logical GPU's tensors (the trace was a float32 program, said
    # confidently); CUDA's policy is applied above autograd instead.
    def step(x, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return x @ w

    trace = md.tracer(device="cuda", gpu="h100")(step, torch.randn(4, 8), torch.randn(8, 8))
    assert [(c.op, c.output_metas[0].dtype) for c in trace.calls if c.op != "arg"] == [
        ("aten._to_copy.default", torch.bfloat16),
        ("aten._to_copy.default", torch.bfloat16),
        ("aten.mm.default", torch.bfloat16),
    ]
    # autocast("cuda") around work on a logical CPU changes nothing there, as on a real CPU
    trace = md.trace(step, torch.randn(4, 8), torch.randn(8, 8))
    assert [c.op for c in trace.calls] == ["aten.mm.default"] and trace.calls[0].output_metas[0].dtype == torch.float32

    # and autocast on a logical CPU still casts, as eager does
    def cpu_step(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return x @ w

    assert md.trace(cpu_step, torch.randn(4, 8), torch.randn(8, 8)).output_meta.dtype == torch.bfloat16


def test_cudnn_questions_are_answered_by_the_profile_inside_the_mode_only():
    real = torch.backends.cudnn.is_available(), torch.backends.cudnn.version()
    functions = torch.backends.cudnn.is_acceptable, torch.clear_autocast_cache
    with md.MetaMode(device="cuda", gpu="h100") as mode:
        assert torch.backends.cudnn.is_available()
        assert torch.backends.cudnn.version() == mode.device_profile.cudnn_version
        x = torch.empty(2, device="cuda")
        assert torch.backends.cudnn.is_acceptable(x) and not torch.backends.cudnn.is_acceptable(x.long())
        with torch.backends.cudnn.flags(enabled=False):
            assert not torch.backends.cudnn.is_acceptable(x)
    assert (torch.backends.cudnn.is_available(), torch.backends.cudnn.version()) == real
    assert (torch.backends.cudnn.is_acceptable, torch.clear_autocast_cache) == functions  # put back


def test_an_rnn_on_a_logical_gpu_does_not_warn_about_cudnn(recwarn):
    # flatten_parameters asks torch.backends.cudnn.is_acceptable: on a CPU-only
    # build it warned "compiled without cuDNN" at every call.
    lstm = torch.nn.LSTM(4, 8)
    md.tracer(device="cuda", gpu="h100")(lambda x: lstm(x)[0].sum(), torch.randn(5, 3, 4))
    assert not [w for w in recwarn if "cuDNN" in str(w.message)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_cuda_answers_a_host_without_cuda_stays_without_under_nvml_based_checks(monkeypatch):
    # Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK=1 on import; torch's is_available then asks
    # torch.cuda.device_count by its module global, which a logical GPU answers: the mode took
    # the host for a CUDA host and called torch's real RNG functions ("Found no NVIDIA driver").
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

    def step(x):
        saved = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
        return x

    trace = md.tracer(device="cuda", gpu="h100")(step, torch.randn(8))
    (save, load) = [(e.action, e.slot) for e in trace.rng_events if e.stream == "cuda:0"]
    assert save[0] == "save" and load == ("load", save[1])  # recorded as a slot, not run
