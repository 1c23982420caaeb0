"""Converter (tensor/convert.py): a real tensor's stand-in, memoised, holding nothing of the user's alive."""

import gc
import weakref

import pytest
import torch

from metadispatch.tensor.convert import Converter
from metadispatch.tensor.tensor import MetaTensor


def test_convert_keeps_the_real_tensors_metadata_and_storage_sharing():
    base = torch.randn(4, 6)
    view = base[1:, ::2]  # offset 6, strides (6, 2), on base's storage
    convert = Converter("cuda")
    meta_base, meta_view = convert(base), convert(view)
    for real, meta in ((base, meta_base), (view, meta_view)):
        assert isinstance(meta, MetaTensor) and meta.device == torch.device("cuda:0")
        assert (meta.shape, meta.stride(), meta.storage_offset(), meta.dtype) == (
            real.shape,
            real.stride(),
            real.storage_offset(),
            real.dtype,
        )
    # as the real tensors share one storage, so do their stand-ins
    assert base.untyped_storage()._cdata == view.untyped_storage()._cdata
    assert meta_base.untyped_storage()._cdata == meta_view.untyped_storage()._cdata
    assert meta_base.untyped_storage().nbytes() == base.untyped_storage().nbytes()
    assert convert(base) is meta_base and convert.has(view)


def test_convert_holds_the_real_tensor_weakly_and_never_writes_it():
    real = torch.arange(6.0).reshape(2, 3).requires_grad_()
    real.sequence_parallel = True  # what training code hangs on a parameter
    before = real.detach().clone()
    convert = Converter()
    meta = convert(real)
    assert meta.requires_grad and meta.sequence_parallel is True
    assert torch.equal(real.detach(), before) and real._version == 0
    gone = weakref.ref(real)
    del real
    gc.collect()
    assert gone() is None  # the converter kept it alive no longer than the user did
    assert not convert._memo


def test_convert_refuses_a_tensor_subclass_by_type():
    class Tagged(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="cannot convert a Tagged"):
        Converter()(torch.ones(2).as_subclass(Tagged))
