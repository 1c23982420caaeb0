"""op_db conformance, quick subset: MetaTensor metadata equals the real CPU kernel's.

The harness is ``tools/opdb_conformance.py``; the full run over every
OpInfo, dtype and sample (with FakeTensorMode and the meta device as anchors)
is ``python tools/opdb_conformance.py --anchors -j 16``.  This subset covers
each op family once, for float32, int64 and bool where supported.
"""

import pytest
import torch

from tools.opdb_conformance import FAIL, op_db, op_id, run_op

SUBSET = [
    # pointwise, reductions, type promotion
    "add",
    "mul",
    "div.no_rounding_mode",
    "where",
    "clamp",
    "abs",
    "sum",
    "mean",
    "amax",
    "argmax",
    "cumsum",
    "softmax",
    "var_mean",
    # views and shape ops
    "transpose",
    "permute",
    "expand",
    "unbind",
    "split",
    "narrow",
    "as_strided",
    "flatten",
    "cat",
    "stack",
    "repeat",
    # indexing
    "index_select",
    "gather",
    "scatter_add",
    "index_put",
    "__getitem__",
    "masked_fill",
    # linear algebra and nn
    "mm",
    "bmm",
    "addmm",
    "nn.functional.linear",
    "nn.functional.conv2d",
    "nn.functional.layer_norm",
    "nn.functional.embedding",
    "nn.functional.cross_entropy",
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.max_pool2d",
    # factories and data-dependent ops
    "arange",
    "full_like",
    "nonzero",
    "masked_select",
    "unique",
    "sort",
    "topk",
]
DTYPES = {torch.float32, torch.int64, torch.bool}
_BY_ID = {op_id(o): o for o in op_db()}


@pytest.mark.parametrize("name", SUBSET)
def test_opdb_subset_matches_real_cpu_kernel(name):
    result = run_op(_BY_ID[name], ("ours",), DTYPES, max_samples=40)
    counts = result["counts"]["ours"]
    assert sum(counts.values()) > 0, "no usable sample"
    assert counts[FAIL] == 0, result["failures"]["ours"]
