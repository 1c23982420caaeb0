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


def test_check_meta_kernel_refusal_is_answered_by_the_real_kernel():
    x, lengths = torch.randn(5, 3, 4), torch.tensor([1, 1, 1])  # made-up lengths are 1s: compare with those
    real = torch._pack_padded_sequence(x, lengths, False)
    with pytest.raises(RuntimeError) as meta:  # torch's meta kernel wants the lengths on the CPU
        torch._pack_padded_sequence(x.to("meta"), lengths.to("meta"), False)
    report = md.check(lambda x, n: torch._pack_padded_sequence(x, n, False), x, lengths)
    assert report.error is None
    (issue,) = report.meta_refused
    assert issue.op == "aten._pack_padded_sequence.default" and issue.reason == str(meta.value).splitlines()[0]
    assert [m.shape for m in report.trace.output_meta] == [r.shape for r in real]
    assert "refused what the real kernel accepts" in str(report) and not report.ok


def test_check_packed_sequences_run_through_lstm_and_back():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8, batch_first=True)

    def packed(x, lengths):
        p = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = lstm(p)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)

    x, lengths = torch.randn(3, 5, 4), torch.tensor([1, 1, 1])  # made-up lengths are 1s: compare with those
    report = md.check(packed, x, lengths)
    assert report.error is None, str(report)
    out, out_lengths = packed(x, lengths)
    assert report.trace.output_meta[0].shape == out.shape and report.trace.output_meta[1].shape == out_lengths.shape
    assert [i.op for i in report.meta_refused] == ["aten._pack_padded_sequence.default"]
    assert "meta" not in str(report.error or "")
    assert any("i64[3]: (all 1)" in a.basis for a in report.assumptions)


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
