"""Every built-in rule against the real CPU kernel (differential tests).

Each entry of ``SAMPLES`` names a built-in rule's op and inputs covering its
branches; ``md.verify_rule`` runs the op on the real tensors and on
MetaTensors and compares shape, dtype, strides, storage offset and aliasing.
A new rule in ``metadispatch/rules/`` needs an entry here (the last test
enforces it).
"""

import pytest
import torch

import metadispatch as md
from metadispatch import registry
from metadispatch.schema import op_name

aten = torch.ops.aten


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


SAMPLES = {
    aten.index.Tensor: [
        (_x(4, 3), [torch.tensor([0, 2])]),
        (_x(4, 3, 5), [None, torch.tensor([[0, 1], [2, 0]])]),
        (_x(4, 3, 5).transpose(0, 2), [torch.tensor([1]), None, torch.tensor([0])]),
    ],
}


@pytest.mark.parametrize("op", list(SAMPLES), ids=op_name)
def test_rules_builtin_matches_real_cpu_kernel(op):
    check = md.verify_rule(op, samples=SAMPLES[op])
    assert check.stages[op_name(op)] == "builtin"
    assert check.ok, str(check)


def test_rules_index_boolean_mask_is_data_dependent():
    x = md.to_meta(torch.randn(4))
    with pytest.raises(md.DataDependentError, match="boolean-mask"):
        x[md.to_meta(torch.ones(4, dtype=torch.bool))]


def test_rules_every_builtin_rule_has_a_differential_test():
    assert set(registry._BUILTIN) <= set(SAMPLES)
