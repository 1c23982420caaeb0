"""The inventory: every group of patches a MetaMode may claim, and which mode claims which.

Each room lists its own patches as ``PATCHES`` rows next to the code they
install (the replacements need that code); they are declared to the ledger
here, once, in the order in which they answer where two groups patch one
attribute (a logical GPU's ``torch.cuda`` answers before a logical world's:
Note [The ledger] in ledger.py).  ``claim_for`` is the one place that says
what a mode of given options changes in torch.
"""

from __future__ import annotations

from .. import _compat
from ..core import rngstate
from ..gpu import cuda_answers, fastpath, logical_cuda
from ..standins import standins
from ..values import initializers
from ..world import fsdp_storage, world
from . import ledger, realcode, unseen

__all__ = ["claim_for", "GROUPS"]

STAND_INS = "stand-ins"
UNSEEN = "unseen functions"
REAL_CODE = "code run for real"
INITIALISERS = "initialisers"
RNG = "random streams"
FAST_PATHS = "inference fast paths"
GPU = "logical GPU"
WORLD_GPU = "logical world's GPU"
WORLD = "logical world"
FSDP_STORAGE = "FSDP2's storage resizes"
COMPILED = "compiled code runs eagerly"

GROUPS = {  # group -> its rows, in answering order
    STAND_INS: standins.PATCHES,
    UNSEEN: unseen.PATCHES,
    REAL_CODE: realcode.PATCHES,
    INITIALISERS: initializers.PATCHES,
    RNG: rngstate.PATCHES,
    FAST_PATHS: fastpath.PATCHES,
    GPU: cuda_answers.PATCHES,
    WORLD_GPU: logical_cuda.PATCHES,
    WORLD: world.PATCHES,
    FSDP_STORAGE: fsdp_storage.PATCHES,  # md.LiveStorages' (analysis/live.py), on a real run
}
for _group, _rows in GROUPS.items():
    ledger.declare_all(_group, _rows)
# torch reads dynamo's stance process-wide: set, not answered per thread.
ledger.declare_all(COMPILED, _compat.EAGER_COMPILED, per_thread=False)


def claim_for(mode, steps: list) -> None:
    """Claim, for ``mode``'s thread until ``steps`` run, what a mode of its options changes."""
    ledger.claim(STAND_INS, steps)
    ledger.claim(UNSEEN, steps)
    ledger.claim(REAL_CODE, steps)  # Note [A DataLoader inside a traced step] in realcode.py
    ledger.claim(INITIALISERS, steps)
    ledger.claim(COMPILED, steps)  # Note [Compiled code runs eagerly under a mode] in _compat/process.py
    if mode.record:
        ledger.claim(RNG, steps)  # Note [RNG state as slots] in core/rngstate.py
        ledger.claim(FAST_PATHS, steps)  # Note [Inference fast paths] in gpu/fastpath.py


def claim_world(steps: list, cuda_without_cuda: bool) -> None:
    """A logical world's patches (world/world.py), and its GPU's answers on a host without CUDA."""
    if cuda_without_cuda:
        ledger.claim(WORLD_GPU, steps)
    ledger.claim(WORLD, steps)


def claim_gpu(steps: list) -> None:
    """A logical GPU's ``torch.cuda`` answers (gpu/cuda_answers.py)."""
    ledger.claim(GPU, steps)


def claim_fsdp_storage(steps: list) -> None:
    """FSDP2's storage resizes made visible to a dispatch mode (md.LiveStorages on a real run)."""
    ledger.claim(FSDP_STORAGE, steps)
