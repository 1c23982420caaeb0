"""MetaMode: factories, conversion of real tensors, cleanup on exit."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.modules.module as nn_module
from torch.overrides import handle_torch_function, has_torch_function_unary
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import metadispatch as md


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _global_hook_counts():
    return (
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(nn_module._global_backward_hooks),
        len(nn_module._global_backward_pre_hooks),
    )


@pytest.mark.parametrize(
    "make,device",
    [
        (lambda: torch.empty(3), "cpu"),
        (lambda: torch.zeros(2, 3, device="cuda:1"), "cuda:1"),
        (lambda: torch.arange(5, device="cuda"), "cuda:0"),
        (lambda: torch.randn(2, 2, dtype=torch.float64), "cpu"),
        (lambda: torch.tensor([1.0, 2.0], device="cuda"), "cuda:0"),
        (lambda: torch.full((2,), 7, dtype=torch.int32), "cpu"),
    ],
)
def test_mode_factories_return_meta_tensors_where_asked(make, device):
    with md.MetaMode():
        t = make()
    real = make() if "cuda" not in device else None
    assert isinstance(t, md.MetaTensor)
    assert t.device == torch.device(device)
    if real is not None:
        assert (t.shape, t.dtype, t.stride()) == (real.shape, real.dtype, real.stride())


_FACTORY_CALLS = [
    lambda: torch.ones(2),
    lambda: torch.ones(2, device="cpu"),
    lambda: torch.empty(3, device=torch.device("cpu")),
    lambda: torch.zeros(2, 3, dtype=torch.int64, device="cpu"),
    lambda: torch.arange(4, device="cpu"),
    lambda: torch.arange(4),
    lambda: torch.full((2,), 7.0, device="cpu"),
    lambda: torch.randn(2, device="cpu"),
    lambda: torch.tensor([1, 2], device="cpu"),
    lambda: torch.tensor([1, 2]),
    lambda: torch.as_tensor([1.0], device="cpu"),
    lambda: torch.empty(3, device="meta"),
    lambda: torch.zeros(2, 3, device="meta"),
    lambda: torch.tensor([1.0, 2.0], device="meta"),
]


@pytest.mark.parametrize("make", _FACTORY_CALLS)
def test_mode_device_is_the_default_device_of_factories(make):
    # torch's own default device (torch.utils._device.DeviceContext, here on
    # meta): a factory that names a device keeps it, one that names none
    # takes the default.  The mode's device is the default.
    # A factory is told from the other by the default changing under it.
    with torch.device("meta"):
        eager = make()
    with torch.device("cpu"):
        named = make().device == eager.device
    with md.MetaMode(device="cuda:2") as mode:
        t = make()
    expected = eager.device if named else torch.device("cuda:2")
    assert t.device == expected
    assert (t.shape, t.dtype) == (eager.shape, eager.dtype)
    assert mode.trace.calls[-1].outputs[0].device == expected


def test_mode_device_cpu_factory_on_a_logical_gpu_is_a_host_tensor():
    with md.MetaMode(device="cuda") as mode:
        w = torch.ones(4, 4)
        idx = torch.arange(4, device="cpu")
        y = w[idx.to(w.device)]
    assert (w.device, idx.device, y.device) == (torch.device("cuda:0"), torch.device("cpu"), torch.device("cuda:0"))
    assert [c.op for c in mode.trace.calls] == [
        "aten.ones.default",
        "aten.arange.default",
        "aten._to_copy.default",  # the host-to-device copy a GPU run dispatches
        "aten.index.Tensor",
    ]


def test_mode_nested_torch_device_context():
    with md.MetaMode():
        with torch.device("cuda:1"):
            a = torch.ones(2)
            with torch.device("cpu"):
                b = torch.ones(2)
    assert a.device == torch.device("cuda:1") and b.device == torch.device("cpu")


def test_mode_real_tensors_are_converted_once_and_never_modified():
    real = torch.ones(3)
    before, version = real.clone(), real._version
    with md.MetaMode() as mode:
        out = real.add_(1)  # the in-place op runs on the stand-in, and returns it
        again = real * 2
    stand_in = mode.from_tensor(real)
    assert isinstance(stand_in, md.MetaTensor) and out is stand_in
    # Data and version counter untouched: the stand-in is swapped in above
    # autograd, so ADInplaceOrView bumps its counter, not the real one's.
    assert torch.equal(real, before) and real._version == version
    assert [c.inputs[0].id for c in mode.trace] == [stand_in._md.meta.id] * 2
    leaves = list(mode.trace.leaves.values())
    assert len(leaves) == 1 and leaves[0].kind == "const"
    assert isinstance(again, md.MetaTensor) and again.shape == (3,)


def test_mode_from_tensor_keeps_views_sharing_storage():
    base = torch.zeros(4, 4)
    mode = md.MetaMode()
    a, b = mode.from_tensor(base[1]), mode.from_tensor(base[:, 2])
    assert a.untyped_storage()._cdata == b.untyped_storage()._cdata
    assert (b.storage_offset(), b.stride()) == (2, (4,))
    assert mode.from_tensor(base[1]) is not a  # a different view object is its own tensor


def test_mode_module_construction_allocates_nothing():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig()  # the defaults are LLaMA-7B sized: 6.7e9 parameters
    before = _rss()
    with md.MetaMode(device="cuda"):
        model = LlamaForCausalLM(cfg)
    grown = _rss() - before
    n = sum(p.numel() for p in model.parameters())
    assert n > 6e9
    assert all(isinstance(p, md.MetaTensor) and p.is_cuda for p in model.parameters())
    assert grown < 200 * 2**20, f"RSS grew by {grown / 2**20:.0f} MB"


def test_mode_exception_leaves_no_mode_or_hooks_behind():
    hooks = _global_hook_counts()
    lazy_init = torch.cuda._lazy_init
    lift = torch._C._only_lift_cpu_tensors()
    with pytest.raises(ZeroDivisionError):
        with md.MetaMode():
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
            assert _global_hook_counts() != hooks  # module tracking is installed...
            raise ZeroDivisionError
    assert _get_current_dispatch_mode_stack() == []  # ...and removed again
    assert _global_hook_counts() == hooks
    assert torch.cuda._lazy_init is lazy_init
    assert torch._C._only_lift_cpu_tensors() == lift


def test_mode_trace_exception_restores_the_users_module():
    model = torch.nn.Linear(3, 3)
    params = dict(model.named_parameters())
    hooks = _global_hook_counts()

    def boom(x):
        model(x)
        raise KeyError("inside")

    with pytest.raises(KeyError):
        md.trace(boom, torch.ones(1, 3))
    assert dict(model.named_parameters()) == params
    assert not any(isinstance(p, md.MetaTensor) for p in model.parameters())
    assert _global_hook_counts() == hooks and _get_current_dispatch_mode_stack() == []


def test_mode_stack_option_records_user_source_line():
    with md.MetaMode(stack=True) as mode:
        torch.ones(2).relu()  # the line recorded
    sources = [c.source for c in mode.trace]
    assert all(
        s.startswith("test_mode.py:") and s.endswith("in test_mode_stack_option_records_user_source_line")
        for s in sources
    )
    assert len(set(sources)) == 1


@pytest.mark.slow
def test_mode_importing_changes_nothing_global():

    code = (
        "import torch, torch.nn.modules.module as m\n"
        "from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as s\n"
        "before = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks), torch.cuda._lazy_init)\n"
        "import metadispatch\n"
        "after = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks), torch.cuda._lazy_init)\n"
        "assert before == after and s() == [], (before, after)\n"
        # and it loads only the rules and what they need: the rest on first
        # use (Note [Public names load on first use] in metadispatch/__init__.py)
        "import sys\n"
        "later = ('analysis', 'debug', 'execution', 'testing', 'tracing', 'cli')\n"
        "loaded = [n for n in sys.modules if n.split('.')[:2][-1] in later and n.startswith('metadispatch.')]\n"
        "assert loaded == [], loaded\n"
        "assert metadispatch.flops is sys.modules['metadispatch.analysis.flops'].flops\n"
        # ~20 ms of torch's, imported when a logical world is entered (Note [A rule for an op defined on import])
        "assert 'torch.distributed._functional_collectives' not in sys.modules\n"
        # heavy modules torch itself does not import: none of them on import (issue 30)
        "heavy = ('torch._dynamo', 'sympy', 'torch.fx.experimental.symbolic_shapes', 'torch.distributed.tensor',\n"
        "         'torch._inductor', 'transformers')\n"
        "assert [h for h in heavy if h in sys.modules] == [], [h for h in heavy if h in sys.modules]\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(md.__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


_FUNCTIONAL_COLLECTIVE = """
import sys, torch, metadispatch as md
assert "torch.distributed._functional_collectives" not in sys.modules
def step(x):
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
trace = md.tracer(device="cpu", world_size=2)(step, torch.ones(4))
print([c.format() for c in trace.calls if "_wrap_tensor_autograd" in c.op])
"""


def test_mode_functional_collectives_rule_waits_for_its_op_to_be_defined():
    # import metadispatch no longer imports torch.distributed._functional_collectives
    # to register the rule for the op it defines: a logical world imports it and
    # registers the rule, and the wrapped output is its input, not a copy
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(md.__file__))))
    run = subprocess.run([sys.executable, "-c", _FUNCTIONAL_COLLECTIVE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "['$2: f32[4] = _c10d_functional._wrap_tensor_autograd.default($2)']"


def test_mode_defers_full_collections_only_while_entered():
    import gc

    before = gc.get_threshold()
    with md.MetaMode():
        inside = gc.get_threshold()  # Note [Garbage collection during tracing]
        assert inside[0] == max(before[0], 10_000) and inside[1] == before[1] and inside[2] > 10**6
    assert gc.get_threshold() == before
    with pytest.raises(ValueError):
        with md.MetaMode():
            raise ValueError
    assert gc.get_threshold() == before
    try:
        gc.set_threshold(0, before[1], before[2])  # automatic collection off: it stays off inside
        with md.MetaMode():
            assert gc.get_threshold()[0] == 0
        gc.set_threshold(*before)
        with md.MetaMode():
            gc.set_threshold(500, 5, 5)  # a threshold the user sets inside is theirs
        assert gc.get_threshold() == (500, 5, 5)
    finally:
        gc.set_threshold(*before)


def test_mode_entries_in_a_loop_leave_no_garbage_behind():
    # A fresh interpreter: how soon the collector runs depends on the heap.
    code = (
        "import gc, torch, metadispatch as md\n"
        "def once():\n"
        "    with md.MetaMode():\n"
        "        torch.ones(2) + 1\n"
        "for _ in range(3000):\n"  # no gc.collect(): the collector's schedule must keep up
        "    once()\n"
        "alive = sum(isinstance(o, md.Trace) for o in gc.get_objects())\n"
        "assert alive < 300, f'{alive} traces of finished modes still in the heap'\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(md.__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# Note [torch.save inside a traced step] (mode/unseen.py)


def _checkpointing_step(path):
    def step(m, x):
        y = m(x).sum()
        torch.save({"model": m.state_dict(), "step": 3}, path)
        return y

    return step


def test_mode_torch_save_of_a_metatensor_is_refused_at_its_line_and_writes_nothing(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"old": torch.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(md.UnsupportedFeatureError, match=r"torch\.save\('.*ckpt\.pt'\): the object holds a MetaTensor"):
        md.trace(_checkpointing_step(path), torch.nn.Linear(3, 2), torch.randn(4, 3))
    assert path.read_bytes() == before  # eager's save would have replaced it; a trace has no data to
    assert torch.save is torch.serialization.save and torch.save.__module__ == "torch.serialization"


def test_mode_torch_save_without_tensors_saves_as_eager(tmp_path):
    def step(x):
        torch.save({"step": 3, "lr": 0.1}, tmp_path / "state.pt")
        return x * 2

    md.trace(step, torch.ones(2))
    traced = torch.load(tmp_path / "state.pt")
    step(torch.ones(2))
    assert traced == torch.load(tmp_path / "state.pt") == {"step": 3, "lr": 0.1}


def test_mode_torch_save_of_a_real_tensor_the_step_may_have_changed_is_refused():
    held = torch.zeros(3)

    def step(x):
        held.add_(x)  # acts on the stand-in: eager would save ones
        torch.save(held, os.devnull)
        return x

    with pytest.raises(md.UnsupportedFeatureError, match=r"a real tensor \(torch.float32 \[3\]\) whose value"):
        md.trace(step, torch.ones(3))
    assert torch.equal(held, torch.zeros(3))


# Note [Lazy modules built inside a MetaMode] (mode/unseen.py)


def test_mode_lazy_module_built_inside_is_refused_naming_it_and_the_line():
    with pytest.raises(md.UnsupportedFeatureError, match=r"nn\.LazyConv2d: .* or use nn\.Conv2d") as info:
        with md.MetaMode():
            torch.nn.LazyConv2d(4, 3)
    assert any("test_mode.py" in n for n in info.value.__notes__)
    assert torch.nn.parameter.is_lazy(torch.nn.LazyConv2d(4, 3).weight)  # torch's own again after the mode


def test_mode_lazy_module_built_before_materialises_inside_and_stays_lazy():
    # the mode's own stand-in for it is made with torch's constructor (Note [Lazy modules under a trace])
    lazy = torch.nn.LazyLinear(3)
    with md.MetaMode():
        y = lazy(torch.randn(2, 4))
        assert (y.shape, lazy.weight.shape) == (torch.Size([2, 3]), torch.Size([3, 4]))
    assert torch.nn.parameter.is_lazy(lazy.weight)


def test_mode_torch_save_and_lazy_modules_in_another_thread_are_torchs(tmp_path):
    # the wrappers are process-wide while a mode is entered; a thread without one gets torch's own
    import threading

    done = []

    def other():
        torch.save({"w": torch.ones(2)}, tmp_path / "other.pt")
        done.append(torch.nn.parameter.is_lazy(torch.nn.LazyLinear(2).weight))

    with md.MetaMode():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert done == [True] and torch.equal(torch.load(tmp_path / "other.pt")["w"], torch.ones(2))


def _body_factory(x):
    # torch's protocol for a Python function (F.*): a function mode gets
    # the call whole, and the body's factory names no device.
    if has_torch_function_unary(x):
        return handle_torch_function(_body_factory, (x,), x)
    return x.sum() + torch.ones(()).sum(), torch.zeros(2), torch.arange(3, dtype=torch.float32)


def test_mode_factories_in_a_torch_python_body_are_on_the_host_as_under_default_device():
    # Note [A factory's named device]: under torch.set_default_device a
    # Python function's body meets no function mode; its factories make
    # CPU tensors.  On a logical GPU the swap sees inside such a body.
    with torch.device("meta"):
        eager = _body_factory(torch.ones(2, device="meta"))
    with md.MetaMode(device="cuda") as mode:
        x = torch.ones(2)
        traced = _body_factory(x)
    assert [t.device.type for t in eager] == ["meta", "cpu", "cpu"]
    assert [t.device for t in traced] == [torch.device("cuda:0"), torch.device("cpu"), torch.device("cpu")]
    assert [(t.shape, t.dtype) for t in traced] == [(t.shape, t.dtype) for t in eager]
    assert "aten.zeros.default" in [c.op for c in mode.trace.calls]
    assert [t.device for t in md.tracer(device="cuda")(_body_factory, torch.ones(2)).output] == [
        t.device for t in traced
    ]


def test_mode_factory_naming_another_gpu_the_logical_machine_lacks_is_refused():
    for name, make in [("zeros", torch.zeros), ("tensor", torch.tensor), ("as_tensor", torch.as_tensor)]:
        with md.MetaMode(device="cuda"), pytest.raises(md.UnsupportedFeatureError, match=rf"torch.{name}\(.*cuda:1"):
            make([2], device="cuda:1")
    with md.MetaMode(device="cuda"):
        assert torch.zeros(2, device="cuda:0").device == torch.device("cuda:0")
    with md.MetaMode():  # no logical machine: every index is a logical device
        assert torch.zeros(2, device="cuda:1").device == torch.device("cuda:1")


def test_mode_a_rank_naming_its_local_gpu_gets_the_ranks_own_device():
    """torchrun's everyday ``cuda:{local_rank}``: on a logical world each rank's GPU is the mode's one, as before
    the one-GPU refusal above (which would refuse every rank but 0)."""
    with md.MetaMode(device="cuda", world_size=8, rank=3):
        made = [torch.zeros(2, device="cuda:3"), torch.tensor([1.0], device="cuda:3"), torch.arange(3, device="cuda:5")]
        assert [t.device for t in made] == [torch.device("cuda:0")] * 3
        assert (made[0] + made[1]).device == torch.device("cuda:0")


_VIEWS = [lambda b: b[2:], lambda b: b[2:].view(2, 3), lambda b: b.narrow(0, 1, 3), lambda b: b.view(2, 4)[1]]


def test_mode_a_pinned_buffers_views_refuse_their_address_as_the_buffer_does():
    # Note [A pinned buffer's address]: a view's address is the buffer's
    # plus its offset, as eager's; the buffer's is refused, so is a view's,
    # naming the factory and the view's offset.
    real = torch.empty(8)
    eager = [v(real).data_ptr() - real.data_ptr() for v in _VIEWS]
    with md.MetaMode(device="cuda"):
        plain = torch.empty(8)
        assert [v(plain).data_ptr() - plain.data_ptr() for v in _VIEWS] == eager
        buf = torch.empty(8, pin_memory=True)
        for view in [lambda b: b, *_VIEWS]:
            v = view(buf)
            offset = "" if v is buf else f"a view at offset {v.storage_offset()} of "
            with pytest.raises(md.UnsupportedFeatureError, match=rf"data_ptr\(\) of {offset}a torch.empty"):
                v.data_ptr()


def test_mode_a_factory_naming_cuda_without_index_on_another_logical_gpu_is_the_modes():
    """On a host without CUDA the logical machine of ``MetaMode(device="cuda:2")`` is that one GPU: ``"cuda"``
    is it (as before the index checks; it was cuda:0 and ``x + torch.arange(2, device="cuda")`` raised), and
    ``cuda:0`` is refused as ``cuda:1`` is (it was kept: a machine holding cuda:0 and cuda:2, not cuda:1)."""
    if torch.cuda.is_available():
        pytest.skip("the logical machine is the host's")
    with md.MetaMode(device="cuda:2"):
        x = torch.ones(2)
        made = [torch.arange(2, device="cuda"), torch.tensor([1.0, 2.0], device="cuda"), torch.zeros(2, device="cuda")]
        assert [t.device for t in made] == [torch.device("cuda:2")] * 3
        assert (x + made[0]).device == torch.device("cuda:2")
        for index in (0, 1):
            with pytest.raises(md.UnsupportedFeatureError, match=rf"cuda:{index}'.*has 1 CUDA device\(s\), 'cuda:2'"):
                torch.zeros(2, device=f"cuda:{index}")


_LIKE_CALLS = [
    lambda x, d: torch.empty_like(x, device=d),
    lambda x, d: torch.zeros_like(x, device=d),
    lambda x, d: torch.ones_like(x, device=d),
    lambda x, d: torch.full_like(x, 7.0, device=d),
    lambda x, d: torch.rand_like(x, device=d),
    lambda x, d: torch.randn_like(x, device=d),
    lambda x, d: torch.randint_like(x, 5, device=d),
    lambda x, d: x.new_empty((2, 3), device=d),
    lambda x, d: x.new_zeros(4, device=d),
    lambda x, d: x.new_ones(4, device=d),
    lambda x, d: x.new_full((2,), 1.5, device=d),
    lambda x, d: x.new_tensor([1.0, 2.0], device=d),
    lambda x, d: x.new_empty_strided((2, 3), (1, 2), device=d),
]


@pytest.mark.parametrize("make", _LIKE_CALLS)
@pytest.mark.parametrize("named", ["meta", torch.device("meta"), "cpu", None])
def test_mode_like_and_new_factories_keep_the_device_they_name(make, named):
    # torch.empty_like(t, device="meta") named from Python is a meta tensor
    # in eager; under the mode it came out on the mode's GPU (the core reads a
    # meta-optioned op with tensor inputs as C++'s own options).  And
    # x.new_tensor(data) is torch.tensor(data) with x's dtype and device.
    eager = make(torch.ones(2, 3), named)
    with md.MetaMode(device="cuda") as mode:
        x = torch.ones(2, 3)
        t = make(x, named)
        after = torch.zeros_like(x)  # the next call without a device is on the GPU again
    expected = torch.device("cuda:0") if named is None else eager.device
    assert type(t) is type(x)  # x.new_tensor(data) was a plain meta tensor no trace recorded
    assert t.device == expected
    assert (t.shape, t.dtype, t.stride()) == (eager.shape, eager.dtype, eager.stride())
    assert mode.trace.calls[-2].outputs[0].device == expected
    assert after.device == torch.device("cuda:0")
