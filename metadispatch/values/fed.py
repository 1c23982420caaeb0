"""Data a step is fed, known to the trace whatever its size.

Note [The command line's token ids are data]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A model may read its inputs: 64 transformers models warn when a pad token
is among the ids and no attention mask is given
(``warn_if_padding_and_no_attention_mask``: ``pad in ids[:, [-1, 0]]``),
which FakeTensorMode skips by name and a trace of ids drawn on the meta
device cannot answer (``metadispatch trace --hf big_bird``, ``rembert``,
``megatron-bert`` failed with a DataDependentError).  A training script
feeds real ids, so the command line does: drawn for real from a generator
of its own (seed 0: the same every run, the process's RNG untouched) and
known to the trace whatever their number, as a user's batch is; its
trace's known_limit covers a tensor of their size (cli/trace_cmd.py), so
what the model makes of them and of constants alone (an all-ones
attention mask) is known too.
"""

from __future__ import annotations

import torch

from .. import _compat
from . import known

__all__ = ["random_ids"]


def random_ids(high: int, shape: tuple) -> torch.Tensor:
    """Token ids in ``[0, high)``, drawn for real and known to the active mode (on its device), whatever their number."""
    with _compat.no_torch_function(), _compat.no_python_dispatch():
        real = torch.randint(0, high, shape, generator=torch.Generator().manual_seed(0))
    mode = _compat.get_infra_mode(_compat.mode_key)
    if mode is None or not hasattr(mode, "constant_on"):
        return real
    ids = mode.constant_on(real, mode.device or torch.device("cpu"))
    if ids._md.known is None:  # more than the mode keeps: known all the same (Note above)
        known.know(ids, real, mode, limit=real.numel())
    return ids
