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


def _bn(dtype, training):
    c = 4
    return (_x(3, c, 5, dtype=dtype), _x(c, dtype=dtype), _x(c, dtype=dtype),
            torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype), training, 0.1, 1e-5)


_DT = (torch.float32, torch.bfloat16, torch.float16)

SAMPLES = {
    aten.native_layer_norm.default: [(_x(3, 4, 5, dtype=d), [5], _x(5, dtype=d), None, 1e-5)
                                     for d in _DT],
    aten.native_batch_norm.default: [_bn(d, t) for d in _DT for t in (True, False)],
    aten._native_batch_norm_legit.default: [_bn(d, t) for d in _DT for t in (True, False)],
    aten._native_batch_norm_legit_functional.default: [_bn(d, True) for d in _DT],
    # (eval mode without running stats crashes the real CPU kernel)
    aten._native_batch_norm_legit.no_stats: [_bn(d, True)[:3] + (True, 0.1, 1e-5) for d in _DT],
    aten._batch_norm_with_update.default: [_bn(d, True)[:5] + (0.1, 1e-5) for d in _DT],
    aten.nonzero_static.default: [((torch.tensor([[1.0, 0.0], [0.0, 2.0]]),), {"size": s})
                                  for s in (1, 2, 5)],
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
