"""C++ composites overridden while a MetaMode is entered (Note [Composite overrides])."""

import pytest
import torch

import metadispatch as md
from metadispatch import composites


def _plain_meta_split():
    x = torch.empty(4, 6, device="meta")
    return torch.tensor_split(x, torch.tensor([1, 3], device="meta"), 1)


def test_composites_tensor_split_unknown_indices_are_data_dependent():
    x, idx = torch.randn(4, 6), torch.tensor([1, 3])
    with md.MetaMode() as mode:
        with pytest.raises(md.DataDependentError, match="tensor_split"):
            torch.tensor_split(mode.from_tensor(x), mode.from_tensor(idx), 1)


@pytest.mark.parametrize("indices", [[1, 3], [0, 5, 2], 3])
def test_composites_tensor_split_known_indices_match_real(indices):
    x = torch.randn(4, 6)
    real = torch.tensor_split(x, torch.tensor(indices), 1)
    with md.MetaMode():
        got = torch.tensor_split(x, torch.tensor(indices), 1)  # a literal: known value
    assert [(t.shape, t.stride(), t.storage_offset()) for t in got] == \
           [(t.shape, t.stride(), t.storage_offset()) for t in real]


def test_composites_override_removed_on_exit_also_on_exception():
    with pytest.raises(ValueError):
        with md.MetaMode():
            with md.MetaMode():
                assert composites._STATE["count"] == 2
            raise ValueError
    assert composites._STATE["count"] == 0 and composites._STATE["lib"] is None
    with pytest.raises(RuntimeError, match="on meta"):
        _plain_meta_split()
