"""Known values: constants carry their real value; user data never does."""

import pytest
import torch

import metadispatch as md
from metadispatch.values.known import DEFAULT_LIMIT, value_of


def _trace_value(fn, *args, mode=None):
    mode = mode or md.MetaMode()
    with mode:
        out = fn(*args)
    return out, mode.trace


def test_known_arange_item_answers_with_real_value():
    out, trace = _trace_value(lambda: (torch.arange(6) * 2).sum().item())
    assert out == 30
    assert trace[-1].format() == "30 = aten._local_scalar_dense.default($2)  # [real] <known value>"


def test_known_packed_sequence_check_as_in_transformers():
    def fn():
        pos = torch.arange(8).unsqueeze(0).expand(2, -1)
        diff = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
        mask = (diff != 1).cumsum(-1)
        return bool((mask[:, -1] == 0).all())

    out, _ = _trace_value(fn)
    assert out is True


def test_known_literal_and_nonzero():
    out, trace = _trace_value(lambda: torch.tensor([0, 3, 0, 5]).nonzero())
    assert out.shape == (2, 1)
    assert value_of(out).flatten().tolist() == [1, 3]
    assert trace[-1].note == "known value"


def test_known_tolist_returns_value():
    out, _ = _trace_value(lambda: torch.full((2,), 7).tolist())
    assert out == [7, 7]


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x,  # a user input
        lambda x: torch.randn(3),  # an RNG op
        lambda x: torch.empty(3),  # uninitialised memory
        lambda x: torch.zeros(3) + x,  # anything touched by user data
    ],
)
def test_known_never_for_inputs_random_or_garbage(make):
    user = torch.ones(3)
    with md.MetaMode() as mode:
        t = make(mode.from_tensor(user))
        assert value_of(t) is None
        with pytest.raises(md.DataDependentError):
            t.sum().item()


def test_known_view_invalidated_by_unknown_write():
    user = torch.ones(2)
    with md.MetaMode() as mode:
        x = mode.from_tensor(user)
        base = torch.zeros(4)
        view = base[:2]
        assert value_of(view) is not None
        view.copy_(x)  # the values written are not known
        assert value_of(base) is None and value_of(view) is None


def test_known_view_follows_known_in_place_write():
    with md.MetaMode():
        base = torch.zeros(4)
        base[1:3] = 5
    assert value_of(base).tolist() == [0, 5, 5, 0]  # a real tensor: read outside the mode


def test_known_limit_is_user_settable():
    with md.MetaMode(known_limit=4):
        assert value_of(torch.arange(4)) is not None
        assert value_of(torch.arange(5)) is None
    with md.MetaMode(known_limit=0):
        assert value_of(torch.arange(2)) is None


def test_known_values_never_write_user_tensors():
    real = torch.tensor([1.0, 2.0])
    with md.MetaMode() as mode:
        t = torch.tensor([1.0, 2.0])
        t.add_(1)
        mode.from_tensor(real).add_(1)
    assert value_of(t).tolist() == [2.0, 3.0]
    assert real.tolist() == [1.0, 2.0]


def test_known_factory_on_logical_cuda_keeps_its_device():
    with md.MetaMode(device="cuda"):
        t = torch.arange(3)
        assert t.device.type == "cuda"
        assert t.sum().item() == 3


def test_known_zeros_like_of_user_data_is_known():
    user = torch.randn(3)
    with md.MetaMode() as mode:
        t = torch.zeros_like(mode.from_tensor(user)) + 1
    assert value_of(t).tolist() == [1.0, 1.0, 1.0]


def _same_views(got, real):
    return [(tuple(t.shape), t.stride(), t.storage_offset()) for t in got] == [
        (tuple(t.shape), t.stride(), t.storage_offset()) for t in real
    ]


@pytest.mark.parametrize("device", [None, "cuda"])  # on a GPU, idx stays on the CPU, as tensor_split needs
@pytest.mark.parametrize("indices", [[1, 4], [2, 3], [0, 6, 6]])
def test_known_user_scope_index_tensor_splits_as_eager(indices, device):
    x, idx = torch.randn(3, 7), torch.tensor(indices)  # idx reaches the trace from this scope
    real = torch.tensor_split(x, idx, dim=1)
    t = md.tracer(device=device)(lambda x: torch.tensor_split(x, idx, dim=1), x)
    assert _same_views(t.output, real)
    # idx is stood in for above autograd (a known value the split reads); if
    # it reaches the trace at all, it is a constant with its value.
    consts = [leaf for leaf in t.leaves.values() if leaf.kind != "arg"]
    assert all(leaf.kind == "const" and leaf.value.tolist() == indices for leaf in consts)


def test_known_user_scope_masks_index_as_eager():
    # Two masks of one shape: the answer read from the first is not served
    # for the second (the cache never keeps an answer computed from a value).
    x = torch.randn(4, 3, 5)
    masks = [
        torch.tensor([True, False, True, True]),
        torch.tensor([False, False, True, False]),
        torch.tensor([[True, False, True]] * 4),
    ]

    def fn(x):
        return [x[masks[0]], x[masks[1]], x[masks[2]], x[:, masks[0][:3]]]

    t = md.trace(fn, x)
    assert [o.shape for o in t.output] == [o.shape for o in fn(x)] == [(3, 3, 5), (1, 3, 5), (8, 5), (4, 2, 5)]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1, 4], dtype=torch.float32, requires_grad=True),  # needs grad: data
        lambda: torch.arange(DEFAULT_LIMIT + 1),  # too large
    ],
)
def test_known_user_scope_tensors_that_stay_unknown(make):
    real = make()
    with md.MetaMode():
        with pytest.raises(md.DataDependentError):
            (real * 1).sum().item()


def test_known_trace_arguments_are_data_not_constants():
    # md.trace's arguments are what the trace is generic over: its ops may
    # not depend on their values, even where the example input has them.
    x, idx = torch.randn(3, 7), torch.tensor([1, 4])
    with pytest.raises(md.DataDependentError):
        md.trace(lambda x, idx: torch.tensor_split(x, idx, dim=1), x, idx)


_SIZES, _MASK, _IDX = (
    torch.tensor([2, 5]),
    torch.tensor([True, False, True, True, False, False, True]),
    torch.tensor([6, 0]),
)
# Uses of small real tensors from the user's scope (here: module globals) that
# need their values; each is answered from them, as without a mode.
_SCOPE_USES = {
    "split by tolist sizes": lambda x: torch.split(x, _SIZES.tolist(), 1),
    "numpy value": lambda x: x[:, : int(_SIZES.numpy()[0])],
    "int of an element": lambda x: x.narrow(1, int(_IDX[1]), int(_SIZES[1])),
    "masked_select": lambda x: torch.masked_select(x, _MASK),
    "boolean index": lambda x: x[:, _MASK],
    "index_select": lambda x: x.index_select(1, _IDX),
    "repeat_interleave": lambda x: torch.repeat_interleave(x[:2], _SIZES, dim=0),
    "tensor_split": lambda x: torch.tensor_split(x, _SIZES, dim=1),
    "nonzero": lambda x: x[:, _MASK.nonzero().squeeze(1)],
}


@pytest.mark.parametrize("name", sorted(_SCOPE_USES))
def test_known_user_scope_values_answer_as_eager(name):
    fn = _SCOPE_USES[name]
    x = torch.randn(4, 7)
    real = fn(x)
    t = md.trace(fn, x)
    outs = t.output if isinstance(real, (list, tuple)) else [t.output]
    reals = real if isinstance(real, (list, tuple)) else [real]
    assert [(tuple(o.shape), o.stride(), o.storage_offset(), o.dtype) for o in outs] == [
        (tuple(r.shape), r.stride(), r.storage_offset(), r.dtype) for r in reals
    ]


def test_known_bounds_decide_a_comparison_every_draw_answers_alike():
    # Note [Bounds that decide a comparison]: transformers' LayerDrop asks
    # torch.rand([]) < layerdrop in every training layer; with layerdrop 0
    # every draw says False, so the step traces, as eager runs it.
    def step(x, layerdrop):
        for _ in range(2):
            if torch.rand([]) < layerdrop:
                continue
            x = x * 2
        return x

    md.testing.assert_matches_eager(step, torch.randn(3), 0.0)
    assert md.testing.assert_matches_eager(lambda x: x + (torch.rand(4) >= 0).all(), torch.randn(4))


def test_known_bounds_that_do_not_decide_leave_the_comparison_data_dependent():
    with pytest.raises(md.DataDependentError, match="_local_scalar_dense"):
        md.trace(lambda x: x * 2 if torch.rand([]) < 0.5 else x, torch.randn(3))
    with pytest.raises(md.DataDependentError, match="_local_scalar_dense"):
        md.trace(lambda x: x * 2 if torch.rand([]) == 0.5 else x, torch.randn(3))


def test_known_a_module_built_on_the_meta_device_traces():
    # A meta tensor has no value to know: BatchNorm's counter buffer of a
    # module built under torch.device("meta") is stood in for without one
    # (copying it to the CPU raised "Cannot copy out of meta tensor").
    def step(m, x):
        m(x).sum().backward()

    with torch.device("meta"):
        on_meta = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    real = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    for device in (None, "cuda"):
        got = md.tracer(device=device)(step, on_meta, torch.randn(3, 4))
        want = md.tracer(device=device)(step, real, torch.randn(3, 4))
        assert [c.op for c in got] == [c.op for c in want]


@pytest.mark.parametrize(
    "step",
    [
        # a write through a view changes the drawn values
        lambda x: x * 2 if (_written(torch.rand(3)) < 2).all() else x,
        # arithmetic wraps integers and overflows floats: only a source decides
        lambda x: x * 2 if ((torch.randint(0, 10, (4,), dtype=torch.uint8) - 20) < 0).any() else x,
        lambda x: x * 2 if ((torch.rand(64, dtype=torch.float16) * 1e5) < 2e5).all() else x,
    ],
)
def test_known_bounds_decide_only_a_source_nothing_wrote(step):
    # Note [Bounds that decide a comparison]: each of these is answered
    # differently by eager than the bounds would say; the trace must refuse.
    with pytest.raises(md.DataDependentError, match="_local_scalar_dense"):
        md.trace(step, torch.randn(3))


def _written(x):
    x[:2].add_(5)
    return x


def test_known_a_decided_comparison_of_a_large_draw_allocates_nothing_large():
    # The known answer is a 0-dim value expanded; one over the known-value
    # limit is not kept (known.py), and the comparison stays a MetaTensor.
    trace = md.trace(lambda x: (torch.rand(4000, 4000) < 2).sum() + x, torch.randn(1))
    assert trace.calls[-1].op == "aten.add.Tensor"


# Note [An operand that decides the result]: a known operand that decides
# ``|``/``&`` makes the result known, whatever the unknown operand holds;
# the value is eager's for every draw of the unknown one.
@pytest.mark.parametrize(
    "make, decided",
    [
        (lambda x: torch.ones(3, dtype=torch.bool) | (x > 0), True),
        (lambda x: (x > 0) | torch.ones(1, dtype=torch.bool), True),
        (lambda x: torch.logical_or(torch.ones(3, dtype=torch.bool), x > 0), True),
        (lambda x: torch.ones(3, dtype=torch.long) & ~torch.ones(3, dtype=torch.bool), True),  # all known
        (lambda x: (x > 0).long() & torch.zeros(3, dtype=torch.long), True),
        (lambda x: torch.zeros(3, dtype=torch.bool) & (x > 0), True),
        (lambda x: torch.logical_and(x > 0, torch.zeros(3, dtype=torch.bool)), True),
        (lambda x: torch.zeros(3, dtype=torch.bool) | (x > 0), False),  # or with all False decides nothing
        (lambda x: torch.tensor([True, False, True]) & (x > 0), False),
        (lambda x: (x > 0).long() | torch.ones(3, dtype=torch.long), False),  # integer or: not decided by 1s
    ],
)
def test_known_an_operand_that_decides_or_and_and(make, decided):
    x = torch.randn(3)
    with md.MetaMode() as mode:
        out = make(mode.from_tensor(x))
    got = value_of(out)
    assert (got is not None) == decided
    if decided:
        for draw in (x, -x.abs(), x.abs() + 1):  # eager, whatever the unknown operand holds
            want = make(draw)
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_known_a_decided_operand_written_in_place_is_not_known():
    with md.MetaMode() as mode:
        x = mode.from_tensor(torch.randn(3))
        done = torch.ones(3, dtype=torch.bool)
        done |= x > 0  # in place: today's invalidation, never a guess
    assert value_of(done) is None


# -- a value lost to the limit: the error says so, known_limit= keeps it


def _cumsum_check(x):
    m = torch.ones(2, 64, 64)  # a constant of 8,192 elements, over the default limit
    if m.cumsum(1)[0, -1, 0].item() != 64:
        raise AssertionError
    return x * 2


def test_a_constant_over_the_limit_names_the_limit_and_known_limit_keeps_it():
    with pytest.raises(md.DataDependentError, match=r"8,192 elements, over known_limit=4,096.*known_limit=N"):
        md.trace(_cumsum_check, torch.ones(3))
    t = md.tracer(known_limit=8192)(_cumsum_check, torch.ones(3))
    assert [c.op for c in t.calls if c.op == "aten._local_scalar_dense.default"] == ["aten._local_scalar_dense.default"]
    with pytest.raises(md.DataDependentError, match="4,096"):
        md.tracer(known_limit=4096)(_cumsum_check, torch.ones(3))


@pytest.mark.parametrize(
    "program",
    [
        lambda x: (x > 0).sum().item(),  # the argument's values: data whatever the limit
        lambda x: (torch.rand(2, 64, 64) > 2).any().item(),  # random: data too
        lambda x: torch.empty(2, 64, 64).sum().item(),  # garbage
    ],
)
def test_a_read_of_data_asks_for_no_larger_limit(program):
    with pytest.raises(md.DataDependentError) as e:
        md.trace(program, torch.ones(10_000))
    assert "known_limit" not in str(e.value)


def test_known_limit_needs_no_mode_factory():
    with pytest.raises(md.MetaDispatchError, match="known_limit= with no mode_factory="):
        md.tracer(known_limit=10, mode_factory=md.MetaMode)


def test_detr_masks_trace_with_a_larger_known_limit_as_eager_runs_them():
    # transformers' DETR builds its pixel mask from torch.ones(batch, h, w) and checks it: 2 x 64 x 64 is over
    # the default limit, and the error named no way out; with the limit raised the forward is eager's, op for op
    transformers = pytest.importorskip("transformers")
    from tests.eager_ops import EagerOps

    backbone = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
    config = transformers.DetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=10,
    )  # fmt: skip
    model = transformers.DetrForObjectDetection(config).eval()
    x = torch.randn(2, 3, 64, 64)
    with pytest.raises(md.DataDependentError, match=r"8,192 elements, over known_limit=4,096"):
        md.trace(lambda m, x: m(pixel_values=x), model, x)
    t = md.tracer(known_limit=8192)(lambda m, x: m(pixel_values=x), model, x)
    with EagerOps() as log:
        model(pixel_values=x)
    assert [c.op for c in t.calls] == log.ops


def test_a_value_declared_from_python_under_the_mode_is_read_back():
    # world/pipeline.py declares the pipeline vote from a patched Python method, where MetaMode's
    # torch-function swap is active: copying the value turned it into a traced tensor (a segfault)
    from metadispatch.values import known

    one = torch.ones(1, dtype=torch.int32)
    with md.MetaMode() as mode:
        t = torch.zeros(1, dtype=torch.int32)
        known.declare(t, one, mode)
        assert t.item() == 1
        with pytest.raises(TypeError, match="a known value must be a real tensor"):
            known.know(t, torch.zeros(1), mode)


@pytest.mark.parametrize(
    "index",
    [
        (slice(None), [-1, 0]),  # transformers' padding warning: pad in ids[:, [-1, 0]]
        [1, 0, 1],
        (Ellipsis, [3, 2]),
        ([1, 0], [2, 3]),
        ([1, 0], 2),  # the select after the lists' lift
        ([1, 0], torch.tensor([0, 1])),  # a tensor after a list
    ],
)
def test_a_list_index_of_a_known_tensor_is_known_and_dispatches_as_eager(index):
    # C++ makes the list an index tensor on the MetaTensor's own device, meta: its value was lost
    from tests.eager_ops import EagerOps

    real = torch.arange(24).reshape(2, 12) * 3
    with EagerOps() as log:
        want = real[index]
    with md.MetaMode(device="cuda") as mode:
        ids = torch.tensor(real.tolist(), device="cuda")
        first, before = int(want.flatten()[0]), len(mode.trace.calls)
        got = ids[index]
        indexing = [c.op for c in mode.trace.calls[before:]]
        read = bool((got == first).any())  # read back, as the warning reads it
    assert read and value_of(got) is not None and torch.equal(value_of(got), want)
    assert indexing == log.ops


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_list_index_written_through_keeps_the_value_known_and_dispatches_as_eager(device):
    from tests.eager_ops import EagerOps

    def write(m):
        m[:, [0, 1]] = 5
        m[[0, 1]] += 1
        return m

    with EagerOps() as log:
        want = write(torch.zeros(2, 12, dtype=torch.long))
    with md.MetaMode(device=device) as mode:
        m = torch.zeros(2, 12, dtype=torch.long)
        before = len(mode.trace.calls)
        got = write(m)
        total = got.sum().item()  # read back: a DataDependentError on a logical GPU before
    assert total == int(want.sum()) and torch.equal(value_of(got).cpu(), want)
    assert [c.op for c in mode.trace.calls[before : before + len(log.ops) - 1]] == log.ops[1:]  # after the zeros


_T, _F = True, False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "index,shape",
    [
        ((0, [3, 2]), (3, 4)),  # C++ selects, then makes the index: the same order here
        ((None, [_T, _F, _T]), (3, 4)),
        ((slice(0, 2), [1, 0]), (3, 4)),
        ((slice(None, None, 1), [_T, _F, _T, _F]), (3, 4)),  # a step-1 full slice dispatches nothing
        ((0, [1, 2], slice(1, 3)), (2, 3, 4)),
        ((0, slice(None), [1, 0]), (2, 3, 4)),
        ((-1, [0, 0, 2]), (3, 4)),
        ((1, [1, 0], Ellipsis), (2, 3, 4)),
        ((0, None, [2]), (3, 4)),
    ],
)
def test_a_list_after_basic_indices_is_known_and_dispatches_as_eager(index, shape, device):
    from tests.eager_ops import EagerOps

    real = torch.arange(torch.Size(shape).numel()).reshape(shape)
    with EagerOps() as log:
        want = real[index]
    with md.MetaMode(device=device) as mode:
        x = torch.tensor(real.tolist(), device=device)
        before = len(mode.trace.calls)
        got = x[index]
    assert [c.op for c in mode.trace.calls[before:]] == log.ops
    assert value_of(got) is not None and torch.equal(value_of(got).cpu(), want)


def test_a_write_through_a_list_after_an_int_is_left_to_torch():
    # the write makes its value a tensor before C++ selects: converting the list first would reorder the calls
    with md.MetaMode(device="cuda"):
        m = torch.zeros(3, 4, device="cuda")
        m[0, [3, 2]] = 7
        assert m.shape == (3, 4)


def test_a_bool_list_index_is_a_known_mask():
    # a mask's count of True is the output's size: data-dependent while the mask's values were lost
    with md.MetaMode(device="cuda"):
        x = torch.ones(3, 2, device="cuda")
        assert x[[True, False, True]].shape == (2, 2)
        assert x[:, [False, True]].shape == (3, 1)
