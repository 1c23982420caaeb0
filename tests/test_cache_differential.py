"""The metadata cache never changes a trace: op_db samples and the suite's models.

Each is traced with ``md.trace`` three ways -- cache off; cache on, in a fresh
cache; cache on, interleaved in a shuffled (seeded) order with the same call
on other logical devices, other float dtypes and under ``no_grad`` -- and the
traces must be identical (``str(trace)``, every call's ``TensorMeta``, the
leaves, outputs and gradients).  The full op_db run is
``python tools/opdb_conformance.py --cache-diff -j 2``.
"""

import copy

import pytest

from tests.models import MODELS, train_step
from tests.test_opdb import DTYPES, SUBSET
from tools.opdb_conformance import FAIL, cache_differential, cache_variants, op_db, op_id, run_cache_diff

_BY_ID = {op_id(o): o for o in op_db()}
# Composites that build tensors from their inputs' options (Note [Meta from options]).
_OPTIONS = ["corrcoef", "cov", "tensor_split", "nn.functional.normalize", "trapezoid"]


@pytest.mark.parametrize("name", SUBSET + _OPTIONS)
def test_cache_differential_opdb_sample(name):
    result = run_cache_diff(_BY_ID[name], DTYPES, max_samples=6)
    counts = result["counts"]["cache"]
    assert sum(counts.values()) > 0, "no usable sample"
    assert counts.get(FAIL, 0) == 0, result["failures"]["cache"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cache_differential_model_training_step(name):
    model, inputs = MODELS[name]()
    run, others = cache_variants(lambda *xs: train_step(model, *xs), inputs)
    # The same step of the model in float64: other dtypes throughout.
    wide = copy.deepcopy(model).double()
    others.append(
        lambda: cache_variants(
            lambda *xs: train_step(wide, *xs), tuple(x.double() if x.is_floating_point() else x for x in inputs)
        )[0](True)
    )
    assert cache_differential(run, others, seed=len(name)) is None
