"""md.verify_rule: a rule against the real kernel."""

import pytest
import torch

import metadispatch as md

aten = torch.ops.aten


@torch.library.custom_op("mdverifytest::rowsum", mutates_args=())
def rowsum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1, keepdim=True).expand(x.shape).contiguous()


@torch.library.custom_op("mdverifytest::first_col", mutates_args=())
def first_col(x: torch.Tensor) -> torch.Tensor:
    return x[:, :1].clone()


@pytest.fixture
def rule():
    """Register a rule for the test, remove it afterwards."""
    registered = []

    def register(op, fn):
        md.register_meta(op, override=True)(fn)
        registered.append(op)

    yield register
    for op in registered:
        md.unregister_meta(op)


def test_verify_rule_accepts_a_right_rule_on_a_custom_op(rule):
    rule("mdverifytest::rowsum", lambda x: torch.empty_like(x, memory_format=torch.contiguous_format))
    check = md.verify_rule("mdverifytest::rowsum")
    assert check.ok, str(check)
    assert check.stages == {"mdverifytest.rowsum.default": "user"} and check.tried == 2


def test_verify_rule_catches_wrong_strides_on_a_custom_op(rule):
    rule("mdverifytest::rowsum", lambda x: torch.empty_like(x))  # keeps a transposed layout
    check = md.verify_rule("mdverifytest::rowsum")
    assert not check.ok
    (d,) = check.disagreements
    assert d.sample == 1 and d.problems == ("strides (1, 3) != (4, 1)",)


def test_verify_rule_catches_wrong_dtype_and_offset(rule):
    rule("mdverifytest::first_col", lambda x: x.new_empty(x.shape[0], 2, dtype=torch.float64)[:, 1:])
    (d, _) = md.verify_rule("mdverifytest::first_col").disagreements
    assert d.problems == ("dtype torch.float64 != torch.float32", "strides (2, 1) != (1, 1)", "storage offset 1 != 0")


def test_verify_rule_catches_wrong_aliasing(rule):
    rule("mdverifytest::first_col", lambda x: x[:, :1])  # a view: the real op copies
    problems = md.verify_rule("mdverifytest::first_col").disagreements[0].problems
    assert problems == ("strides (4, 1) != (1, 1)", "aliasing (output -> input index) (0,) != (None,)")


def test_verify_rule_with_given_samples(rule):
    rule("mdverifytest::first_col", lambda x: x.new_empty(3, 1))  # right for 3 rows only
    good = md.verify_rule("mdverifytest::first_col", samples=[(torch.randn(3, 4),)])
    bad = md.verify_rule("mdverifytest::first_col", samples=[((torch.randn(5, 4),), {})])
    assert good.ok and not bad.ok
    assert bad.disagreements[0].problems == ("shape (3, 1) != (5, 1)",)


def test_verify_rule_reports_unusable_samples():
    check = md.verify_rule(aten.mm.default, samples=[(torch.randn(2, 3), torch.randn(2, 3))])
    assert not check.ok and check.unusable[0][2].startswith("the real kernel raised RuntimeError")


def test_verify_rule_builtin_rule_passes():
    assert md.verify_rule(aten.index.Tensor, samples=[(torch.randn(4, 3), [torch.tensor([0, 2])])]).ok


def test_verify_rule_truth_value_is_ok(rule):
    rule("mdverifytest::rowsum", lambda x: torch.empty_like(x))  # wrong strides on sample 1
    check = md.verify_rule("mdverifytest::rowsum")
    assert check.disagreements and bool(check) is False
    with pytest.raises(AssertionError, match="strides"):
        assert check, str(check)
    assert bool(md.verify_rule(aten.index.Tensor, samples=[(torch.randn(4, 3), [torch.tensor([0, 2])])]))
