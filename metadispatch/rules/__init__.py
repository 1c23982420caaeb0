"""Built-in rules, one module per op family.

Importing this package registers them.  Each rule is a plain function
registered with ``@builtin_rule``; each has a differential test against the
real CPU kernel in ``tests/test_rules.py``.
"""

from . import (  # noqa: F401
    activations,
    attention,
    attention_rng,
    batch_norm_cuda,
    collectives,
    convolution,
    cudnn_branch,
    cudnn_rnn,
    data_dependent,
    device_hinted,
    embedding,
    grouped_mm,
    histogram,
    linalg,
    normalization,
    pooling,
    random_fill,
    scaled_mm,
)
