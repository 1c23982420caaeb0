"""Built-in rules, one module per op family.

Importing this package registers them.  Each rule is a plain function
registered with ``@builtin_rule``; each has a differential test against the
real kernel (``tests/rules/test_rules.py`` and the family's own test).  Families:
``activations``, ``attention`` (SDPA on a logical GPU, with ``sdp_choice``
its backend choice, ``attention_math`` its math body with dropout,
``attention_rng`` its seed and offset), ``batch_norm_cuda``,
``collectives``, ``convolution``, ``cudnn_branch`` and ``cudnn_rnn`` (RNNs
on a logical GPU), ``data_dependent``, ``device_hinted`` (torch's meta
functions asked for the logical device), ``embedding``, ``grouped_mm``,
``histogram``, ``linalg``, ``losses`` (reduced losses on the loss's storage),
``normalization``, ``pinned`` (page-locked host memory), ``pooling``,
``random_fill``, ``scaled_mm``; ``storages`` is their helper for outputs on
storages larger than their shapes.
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
    losses,
    normalization,
    pinned,
    pooling,
    random_fill,
    scaled_mm,
)
