"""md.check past everything that needs data or a real kernel, with honest made-up values."""

import pytest
import torch
from torch import nn

import metadispatch as md
from tests.models import tiny_mixtral


def _choice(k):
    # torchvision's GeneralizedRCNNTransform.torch_choice
    index = int(torch.empty(1).uniform_(0.0, float(len(k))).item())
    return k[index]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_check_uniform_index_stays_in_range(n):
    sizes = tuple(range(10, 10 + n))
    report = md.check(lambda x: x * _choice(sizes), torch.randn(3))
    assert report.error is None, str(report)
    (a,) = report.assumptions
    assert a.op == "aten._local_scalar_dense.default" and 0 <= float(a.value) < n
    assert f"uniform_(0.0, {float(n)})" in a.basis and "in _choice" in a.source
    assert f"assumed {a.value}" in report.trace.calls[a.index].note
    assert "Made-up values" in str(report)


def test_check_value_policy_gives_a_site_its_value():
    line = _choice.__code__.co_firstlineno + 2
    report = md.checker(values={f"test_check_fallback.py:{line}": 2.5})(
        lambda x: x * _choice((10, 20, 30)), torch.randn(3)
    )
    (a,) = report.assumptions
    assert (a.value, a.basis) == ("2.5", f"given by values['test_check_fallback.py:{line}']")
    assert report.trace.output_meta.shape == (3,)


def test_check_value_policy_by_op_gives_outputs():
    given = torch.tensor([[0], [2]])
    report = md.checker(values={"aten.nonzero.default": given})(lambda x: (x > 0).nonzero(), torch.randn(4))
    assert report.trace.calls[-1].output_metas[0].shape == (2, 1)
    assert report.assumptions[0].basis == "given by values['aten.nonzero.default']"


def _out_of_range(x):
    i = int(x.abs().sum().item() * 100)
    return (1, 2, 3)[i]


def test_check_stop_names_the_assumption_that_led_there():
    report = md.check(_out_of_range, torch.randn(4))
    assert isinstance(report.error, IndexError)
    stop = report.stop
    assert stop.op is None and stop.module == "" and stop.source.endswith("in _out_of_range")
    assert stop.after is report.assumptions[-1] and "abs" in stop.after.basis
    text = str(report)
    line = _out_of_range.__code__.co_firstlineno + 2
    assert (
        f"Stopped: IndexError: tuple index out of range (module <top>, at test_check_fallback.py:{line} "
        "in _out_of_range)"
    ) in text
    assert "after a made-up value: call #" in text and "aten._local_scalar_dense.default" in text


class Bad(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 2)

    def forward(self, x):
        return self.inner(x)


def test_check_stop_names_op_module_and_line():
    report = md.check(nn.Sequential(Bad()), torch.randn(4, 5))  # 5 != 3 features
    with pytest.raises(RuntimeError) as real:
        Bad()(torch.randn(4, 5))
    assert type(report.error) is type(real.value) and not report.assumptions
    stop = report.stop
    assert stop.module == "0.inner" and stop.op.startswith("aten.") and "meta" not in str(report.error)
    assert f"(in {stop.op}, module 0.inner, at " in str(report)


# A custom op whose fake impl refuses meta tensors with a plain RuntimeError, as torchvision's nms does.
@torch.library.custom_op("mdfallbacktest::keep_positive", mutates_args=())
def keep_positive(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0].clone()


@keep_positive.register_fake
def _(x):
    raise RuntimeError("keep_positive has a data-dependent output shape; meta tensors are not supported")


def test_check_fake_impl_asking_for_dynamic_size_is_data_dependent():
    report = md.check(lambda x: torch.ops.mdfallbacktest.keep_positive(x).sum(), torch.randn(6))
    assert report.error is None
    (issue,) = report.data_dependent
    assert issue.op == "mdfallbacktest.keep_positive.default"
    (a,) = report.assumptions
    assert a.basis.startswith("made-up f32[6]: (standard normal") and a.value == issue.outputs[0]
    assert issue.outputs[0] in {f"f32[{n}]" for n in range(7)}


# A custom op whose fake impl refuses what the real kernel accepts (as torch's
# _pack_padded_sequence did before it had a rule: Note [Packing with known lengths]).
@torch.library.custom_op("mdfallbacktest::cpu_only", mutates_args=())
def cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@cpu_only.register_fake
def _(x):
    raise RuntimeError(f"'x' argument should be a CPU tensor, but got {x.device} {x.dtype} tensor")


def test_check_meta_kernel_refusal_is_answered_by_the_real_kernel():
    x = torch.randn(5, 3)
    real = cpu_only(x)
    with pytest.raises(RuntimeError) as meta:
        cpu_only(x.to("meta"))
    report = md.check(lambda x: torch.ops.mdfallbacktest.cpu_only(x), x)
    assert report.error is None
    (issue,) = report.meta_refused
    assert issue.op == "mdfallbacktest.cpu_only.default" and issue.reason == str(meta.value).splitlines()[0]
    assert report.trace.output_meta.shape == real.shape
    assert "refused what the real kernel accepts" in str(report) and not report.ok


def test_check_packed_sequences_run_through_lstm_and_back():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8, batch_first=True)

    def packed(x, lengths):
        p = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = lstm(p)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)

    # The user's lengths keep their values: the packed batch sizes are eager's.
    x, lengths = torch.randn(3, 5, 4), torch.tensor([2, 4, 3])
    report = md.check(packed, x, lengths)
    assert report.error is None, str(report)
    out, out_lengths = packed(x, lengths)
    assert out.shape == (3, 4, 8)  # padded to the longest length, not to 5
    assert report.trace.output_meta[0].shape == out.shape and report.trace.output_meta[1].shape == out_lengths.shape
    assert not report.meta_refused  # the lengths are known: Note [Packing with known lengths]
    assert not report.assumptions  # nothing index-like was made up
    assert torch.equal(lengths, torch.tensor([2, 4, 3]))  # the user's tensor untouched


def test_check_packed_sequence_with_user_lengths_never_blames_meta():
    def packed(x, lengths):
        return nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False).data

    report = md.check(packed, torch.randn(3, 5, 4), torch.tensor([5, 3, 2]))
    assert report.error is None and "got 1D meta" not in str(report.stop or "")


def test_check_transformers_moe_default_path():
    model = tiny_mixtral()
    ids = torch.randint(0, 100, (1, 8))
    report = md.check(lambda i: model(input_ids=i).logits, ids)
    assert report.error is None, str(report)
    assert report.trace.output_meta.shape == model(input_ids=ids).logits.shape
    # _grouped_mm in float32: the CPU kernel's rule answers it (rules/grouped_mm.py), nothing is run for real
    assert report.ok and not report.meta_refused and not report.assumptions


def test_check_torchvision_detection_training_step():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=(96, 128), max_size=160
    )
    model.train()
    images = [torch.rand(3, 96, 128)]
    targets = [
        {"boxes": torch.tensor([[10.0, 10.0, 50.0, 60.0], [20.0, 30.0, 90.0, 80.0]]), "labels": torch.tensor([1, 2])}
    ]
    report = md.checker(recheck_calls=False)(lambda i, t: sum(model(i, t).values()).backward(), images, targets)
    assert report.error is None, str(report)
    ops = {i.op for i in report.data_dependent}
    assert {"torchvision.nms.default", "aten.nonzero.default", "aten._local_scalar_dense.default"} <= ops
    choice = next(a for a in report.assumptions if "torch_choice" in (a.source or ""))
    assert 0 <= float(choice.value) < 2 and "uniform_(0.0, 2.0)" in choice.basis
    assert any(c.phase == "backward" for c in report.trace)


def _shapes_mismatch(x):
    return x @ torch.randn(3, 3)


def _grouped_mm_mismatch(x):
    return torch._grouped_mm(x, torch.randn(2, 15, 8), offs=torch.tensor([16, 32], dtype=torch.int32))


@pytest.mark.parametrize("fn", [_shapes_mismatch, _grouped_mm_mismatch])
def test_check_real_refusal_stops_with_what_eager_says(fn):
    # Both meta kernels refuse (the second for fp32, which the real kernel
    # accepts); the real kernel refuses too, and its message is eager's.
    x = torch.randn(32, 16)
    with pytest.raises(RuntimeError) as eager:
        fn(x)
    report = md.check(fn, x)
    assert type(report.error) is RuntimeError and str(report.error) == str(eager.value)
    assert report.stop.after is None  # float data made up for a shape error is no assumption
    assert f"Stopped: RuntimeError: {str(eager.value).splitlines()[0]} (in aten." in str(report)


def test_check_made_up_integers_bounded_below_only():
    # abs() bounds a value below only: made-up counts stay finite and >= 0.
    def repeat(x):
        return torch.repeat_interleave(x, (x.abs() * 3).long()).sum()

    report = md.check(repeat, torch.randn(4))
    assert report.error is None, str(report)
    (a,) = report.assumptions
    assert a.op == "aten.repeat_interleave.Tensor" and "a value in [0, inf] from abs mul 3" in a.basis
    assert a.value in {f"i64[{n}]" for n in range(100)}


def _first_positive(x):
    flags = (x > 0).long().tolist()
    return (10, 20, 30, 40)[flags.index(1)] if 1 in flags else 0


def test_check_tolist_reads_a_made_up_value_as_an_assumption():
    report = md.check(_first_positive, torch.randn(4))
    assert report.error is None, str(report)
    (a,) = report.assumptions
    assert (a.op, a.value, a.basis) == ("Tensor.tolist", "[1, 1, 1, 1]", "made-up i64[4]: (all 1)")
    assert a.source.endswith("in _first_positive") and "Tensor.tolist" in str(report)
    made = report.trace.calls[a.index - 1]  # the cast to long whose values were read
    assert made.op == "aten._to_copy.default" and "Tensor.tolist assumed [1, 1, 1, 1]" in made.note
    given = md.checker(values={"Tensor.tolist": [0, 0, 1, 0]})(_first_positive, torch.randn(4))
    assert given.trace.output == 30 and given.assumptions[0].basis == "given by values['Tensor.tolist']"


@pytest.mark.parametrize("n", [1, 2, 5])
def test_check_multinomial_index_stays_in_range(n):
    choices = tuple(range(n))
    report = md.check(lambda w: choices[int(torch.multinomial(w, 1).item())], torch.ones(n))
    assert report.error is None, str(report)
    assert 0 <= int(report.assumptions[0].value) < n and "multinomial" in report.assumptions[0].basis


def test_check_equal_shows_the_made_up_answer():
    report = md.check(lambda x: torch.equal(x, x.clone()), torch.randn(4))
    (a,) = report.assumptions
    assert a.op == "aten.equal.default" and a.value in ("True", "False") and str(report.trace.output) == a.value


def test_check_packed_sequence_on_logical_cuda_keeps_batch_sizes_on_cpu():
    lstm = nn.LSTM(4, 8, batch_first=True)

    def packed(x, lengths):
        lstm.cuda()
        p = nn.utils.rnn.pack_padded_sequence(x.cuda(), lengths, batch_first=True, enforce_sorted=False)
        return lstm(p)[0].batch_sizes

    report = md.checker("cuda", recheck_calls=False)(packed, torch.randn(3, 5, 4), torch.tensor([5, 3, 2]))
    assert report.error is None, str(report)
    assert report.trace.output_meta.device == torch.device("cpu")  # as PackedSequence requires


def test_check_knows_integer_inputs_not_float_ones_nor_module_buffers():
    def step(model, ids, x):
        return int(ids.sum()), int(model.counts.sum()), float(x.sum()), int(model.steps)

    model = nn.Module()
    model.register_buffer("counts", torch.tensor([3, 4]))
    model.register_buffer("steps", torch.tensor(9))  # a counter (Note [Counters in buffers])
    ids, x = torch.tensor([2, 0, 5]), torch.randn(3)
    report = md.check(step, model, ids, x)
    assert report.error is None, str(report)
    assert report.trace.output[0] == 7  # the user's ids, read for real
    read = [(report.trace.calls[a.index].inputs[0].dtype, a.value) for a in report.assumptions]
    assert [dtype for dtype, _ in read] == [torch.int64, torch.float32]  # the buffer and x: made up
    assert report.trace.output[1] == int(read[0][1])
    assert report.trace.output[3] == 9  # the counter, read for real


def test_check_report_is_not_ok_after_a_made_up_read():
    # tolist() is no op: only the assumption says the run read a made-up value.
    report = md.check(_first_positive, torch.randn(4))
    assert not report.data_dependent and len(report.made_up) == 1 and not report.ok
    assert "0 mismatches, 1 made-up value>" in repr(report)
    given = md.checker(values={"Tensor.tolist": [0, 0, 1, 0]})(_first_positive, torch.randn(4))
    assert given.ok and not given.made_up


def test_check_value_policy_reports_keys_that_named_no_site():
    report = md.checker(values={"no_such_file.py:3": 1, "aten.nonzero.default": torch.tensor([[1]])})(
        lambda x: (x > 0).nonzero(), torch.randn(4)
    )
    assert report.unused_values == ("no_such_file.py:3",)
    assert "values= keys that named no site (a typo, or a line that never ran): 'no_such_file.py:3'" in str(report)


def test_check_value_policy_refuses_what_cannot_stand_for_the_op():
    with pytest.raises(TypeError, match="a key names a site"):
        md.checker(values={12: 1})(lambda x: x, torch.randn(4))
    report = md.checker(values={"aten.nonzero.default": [0, 2]})(lambda x: (x > 0).nonzero(), torch.randn(4))
    assert isinstance(report.error, TypeError)
    assert "values['aten.nonzero.default']: aten.nonzero.default returns tensors" in str(report.error)
    line = _choice.__code__.co_firstlineno + 2
    report = md.checker(values={f"test_check_fallback.py:{line}": "two"})(lambda x: x * _choice((1, 2)), torch.ones(1))
    assert "reads a number; give a number, got str" in str(report.error)


def test_trace_meta_refusal_says_the_meta_is_ours_not_the_users_tensor():
    with pytest.raises(RuntimeError, match="got meta torch.float32") as e:  # the fake impl, word for word
        md.trace(lambda x: torch.ops.mdfallbacktest.cpu_only(x), torch.randn(3, 5))
    (note,) = [n for n in e.value.__notes__ if "meta kernel refused" in n]
    assert "not your tensors' device (cpu)" in note and "md.check runs such a call on the real kernel" in note
