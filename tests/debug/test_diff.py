import doctest
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import metadispatch as md
from metadispatch.debug.diff import canonical


class _Seq(nn.Module):
    def __init__(self, act=nn.ReLU, hidden=8):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, hidden), act(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.layers(x)


class _Explicit(nn.Module):
    """The same computation as _Seq, written out by hand with other names."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 2)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def test_diff_equivalent_traces_is_empty():
    x = torch.ones(3, 4)
    assert md.diff(md.trace(_Seq(), x), md.trace(_Explicit(), x)) == ""


def test_diff_data_flow_change_shows():
    x = torch.ones(3)
    d = md.diff(md.trace(lambda x: x.relu() + x, x), md.trace(lambda x: x.relu() + x.relu(), x))
    assert d.splitlines()[5:] == [
        "-$2: f32[3] = aten.add.Tensor($1, $0)",
        "+$3: f32[3] = aten.relu.default($0)",
        "+$2: f32[3] = aten.add.Tensor($1, $3)",
    ]


def test_diff_renumbers_ids_by_first_appearance():
    assert md.diff("$5: f32[2] = aten.relu.default($3)", "$0: f32[2] = aten.relu.default($7)") == ""


def test_diff_shows_changed_shapes_as_unified_diff():
    x = torch.ones(3, 4)
    d = md.diff(md.trace(_Seq(hidden=8), x), md.trace(_Seq(hidden=6), x))
    assert d.startswith("--- a\n+++ b\n@@")
    assert "-$4: f32[3, 8] = aten.addmm.default($2, $3, $1)" in d
    assert "+$4: f32[3, 6] = aten.addmm.default($2, $3, $1)" in d
    assert "\n $3: f32[3, 4] = arg\n" in d  # unchanged lines keep their ids


def test_diff_modules_and_names_only_when_asked():
    x = torch.ones(3, 4)
    a, b = md.trace(_Seq(), x), md.trace(_Explicit(), x)
    assert "# layers.0" in md.diff(a, b, modules=True)
    assert "param layers.0.weight" in md.diff(a, b, names=True)


def test_diff_canonical_drops_default_keywords_and_stage():
    t = md.trace(lambda x: torch.ones_like(x), torch.ones(2))
    (line,) = [ln for ln in canonical(t) if "ones_like" in ln]
    assert line == "$1: f32[2] = aten.ones_like.default($0)"


def test_diff_canonical_masks_addresses_and_paths():
    (line,) = canonical("$1: f32[2] = my.op($4, '<obj at 0x7f3a2b1c>', '/home/ci/src/model.py')")
    assert line == "$0: f32[2] = my.op($1, '<obj at 0x?>', 'model.py')"


def test_assert_same_ops_passes_for_equivalent_models():
    md.testing.assert_same_ops(_Seq(), _Explicit(), torch.ones(3, 4))


def test_assert_same_ops_fails_with_readable_diff_for_changed_model():
    with pytest.raises(AssertionError) as info:
        md.testing.assert_same_ops(_Seq(), _Seq(act=nn.GELU), torch.ones(3, 4), device="cuda")
    message = str(info.value)
    assert message.splitlines()[0] == "the two functions run different ops:"
    assert message.splitlines()[1:] == [
        "--- a",
        "+++ b",
        "@@ -3,8 +3,7 @@",
        " $2: f32[8]@cuda:0 = param",
        " $3: f32[3, 4]@cuda:0 = arg",
        " $4: f32[3, 8]@cuda:0 = aten.addmm.default($2, $3, $1)",
        "-$5: f32[3, 8]@cuda:0 = aten.relu.default($4)",
        "-$6: f32[3, 8]@cuda:0 = aten.detach.default($5)",
        "+$5: f32[3, 8]@cuda:0 = aten.gelu.default($4)",
        " $7: f32[2, 8]@cuda:0 = param",
        " $8: f32[8, 2]{1, 8}@cuda:0 = aten.t.default($7)",
        " $9: f32[2]@cuda:0 = param",
    ]


@pytest.mark.parametrize("module", ["metadispatch.debug.diff", "metadispatch.testing", "metadispatch.mode.fakecompat"])
def test_diff_docstring_examples_run(module):
    result = doctest.testmod(sys.modules[module], optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
