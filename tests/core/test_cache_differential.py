"""The metadata cache never changes a trace: op_db samples and the suite's models.

Each is traced with ``md.trace`` under ten configurations -- logical cpu;
cuda with three GPU profiles; another float dtype; ``no_grad``;
``inference_mode``; autocast on cpu and on cuda; oneDNN off -- each three
ways: cache
off; cache on, in a fresh cache; cache on, interleaved in a shuffled (seeded)
order with all the other configurations and a non-recording run.  Each
configuration's traces must be identical (``str(trace)``, every call's
``TensorMeta``, the leaves, outputs and gradients).  A sample here (a few
seconds); the full op_db run is
``python tools/opdb_conformance.py --cache-diff -j 2``.
"""

import pytest
import torch

from tools.opdb_conformance import FAIL, model_cache_diff, op_db, op_id, run_cache_diff

_BY_ID = {op_id(o): o for o in op_db()}
# One or two ops of each kind whose answer could depend on what the key
# holds: composites that build tensors from their inputs' options (Note [Meta
# from options]), known values, devices and profiles (attention), memory
# formats (conv), aliasing and views, conj bits, type promotion.
_SAMPLE = [
    "corrcoef",
    "cov",
    "tensor_split",
    "nn.functional.normalize",
    "trapezoid",
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.conv2d",
    "nn.functional.layer_norm",
    "nn.functional.cross_entropy",
    "index_put",
    "__getitem__",
    "masked_select",
    "as_strided",
    "unbind",
    "conj",
    "view_as_real",
    "add",
    "addmm",
    "cumsum",
    "arange",
]
_DTYPES = {torch.float32, torch.int64, torch.bool, torch.complex64}


@pytest.mark.parametrize("name", _SAMPLE)
def test_cache_differential_opdb_sample(name):
    result = run_cache_diff(_BY_ID[name], _DTYPES, max_samples=2, rounds=1, per_dtype=1)
    counts = result["counts"]["cache"]
    assert sum(counts.values()) > 0, "no usable sample"
    assert counts.get(FAIL, 0) == 0, result["failures"]["cache"]


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_cache_differential_model_training_step(name):
    # The others: python tools/opdb_conformance.py --cache-diff --models
    assert model_cache_diff(name, rounds=1) is None
