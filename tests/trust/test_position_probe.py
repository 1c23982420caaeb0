"""tools/position_probe.py finds a kernel that follows a value outside its memory, and passes one that checks."""

from __future__ import annotations

import pytest
import torch

from tests import guarded
from tools import position_probe

A = torch.ops.aten


@pytest.mark.slow  # child processes importing torch under the guard allocator
def test_position_probe_reports_max_pool_backward_and_not_index_select():
    guarded.require()
    x = torch.randn(1, 2, 4, 4)
    out, idx = A.max_pool2d_with_indices(x, [2, 2], [2, 2])
    calls = {
        "aten.max_pool2d_with_indices_backward.default": [
            ((torch.ones_like(out), x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx), {})
        ],
        "aten.index_select.default": [((x, 2, torch.tensor([0, 3])), {})],
    }
    found = position_probe.probe(calls, values=True, shapes=False)
    assert [op for op, _, _ in found] == ["aten.max_pool2d_with_indices_backward.default"]
