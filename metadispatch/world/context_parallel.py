"""Context parallelism (``context_parallel`` on SDPA) on one rank of a logical world.

Note [Ring attention on one rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=...,
buffer_seq_dims=...)`` shards its buffers along the sequence (head-tail
load balancing: rank ``r`` keeps chunks ``r`` and ``2N-1-r``) and swaps
``F.scaled_dot_product_attention`` for a version that wraps q, k, v as
DTensors sharded on the sequence.  The C++ composite then asks CUDA's
backend choice for the DTensor (its global shapes) and calls the chosen
kernel's op on it -- which is why a logical GPU's SDPA override
(rules/attention.py) takes a DTensor of MetaTensor shards too -- and
DTensor hands that op to CP's handler: ring attention over the local
shards, each step one kernel call on the K/V block at hand, the K/V shards
all-gathered once (forward and backward) and the K/V gradients passed on
round the ring by ``all_to_all_single`` (``permute_tensor``).  None of it
reads another rank's values, so torch's own code runs on the traced rank
as on the real one; this module only refuses the variants whose trace has
not been checked against a real run (tests/world/test_context_parallel.py):

- a rotate method other than the default all-gather (``set_rotate_method("alltoall")``);
- ``convert_to_f32=False``, or no load balancing (a sequence not divisible
  by ``2 * world_size``);
- the module-wrapper API (``_context_parallel_shard`` with
  ``_enable_context_parallel_dispatcher``) and flex attention.

Limits: a real CPU job cannot run it at all (torch's CPU kernel,
``_scaled_dot_product_flash_attention_for_cpu``, has no CP rule), so on a
logical CPU world it fails as the real job does.
"""

from __future__ import annotations

from .. import _compat
from ..errors import UnsupportedFeatureError

__all__ = ["PATCHES"]


def _check() -> None:
    rotate, to_f32, balanced, monkey_patched = _compat.context_parallel_variant()
    refused = []
    if rotate != "ALL_GATHER":
        refused.append(f"rotate method {rotate} (set_rotate_method('alltoall'))")
    if not to_f32:
        refused.append("convert_to_f32=False")
    if not balanced:
        refused.append("no load balancing (a sequence not divisible by 2 * the CP world size)")
    if not monkey_patched:
        refused.append("the module-wrapper API (_context_parallel_shard / _enable_context_parallel_dispatcher)")
    if refused:
        raise UnsupportedFeatureError(
            "context_parallel in a logical world is traced with its defaults only (all-gather rotation, "
            f"float32 merging, head-tail load balancing); not checked: {'; '.join(refused)} "
            "(Note [Ring attention on one rank] in world/context_parallel.py)"
        )


def _guarded(below):
    def ring(*args, **kwargs):
        _check()
        return below(*args, **kwargs)

    return ring


def _refuse_flex(self, *args, **kwargs):
    raise UnsupportedFeatureError(
        "context parallelism with flex_attention is not traced in a logical world "
        "(Note [Ring attention on one rank] in world/context_parallel.py)"
    )


# (owner, attribute, make, why): the ledger's rows (mode/ledger.py), with world.py's.
PATCHES = [
    *[
        (
            _compat.context_parallel_module,
            name,
            _guarded,
            "ring attention: the variants checked against a real run (Note [Ring attention on one rank])",
        )
        for name in ("_templated_ring_attention", "_templated_ring_attention_backward")
    ],
    (
        _compat.context_parallel_class,
        "flex_input_fn",
        lambda below: _refuse_flex,
        "context-parallel flex attention, refused",
    ),
]
