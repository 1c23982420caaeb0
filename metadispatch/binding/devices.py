"""Where each of a trace's logical devices runs in replay.

Note [Devices in replay]
~~~~~~~~~~~~~~~~~~~~~~~~
Every logical device of a trace maps to the one replay device: a trace
recorded on a logical GPU replays on the CPU, one recorded on a logical CPU
on a GPU.  The exception is a GPU trace replayed on a GPU of its kind: its
CPU tensors stay on the CPU, because the GPU program has them there --
CUDA's kernels make some themselves (memory-efficient attention's Philox
seed and offset), torch's optimizers keep their step counters there, a CPU
scalar takes part in a GPU op.  Mapped onto the GPU they replayed another
program, and the check of a kernel's own CPU outputs failed on a real H100
(tools/gpu_conformance.py).  "Its kind": the trace holds a tensor on a device
of the replay device's type.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

from ..ir.trace import Trace

__all__ = ["keeps_cpu", "target"]

CPU = torch.device("cpu")
_KEEPS: WeakKeyDictionary = WeakKeyDictionary()  # trace -> {device type: answer}


def keeps_cpu(trace: Trace, device: torch.device) -> bool:
    """Whether ``trace``'s CPU tensors stay on the CPU when it replays on ``device``."""
    if device.type == "cpu":
        return False
    per_trace = _KEEPS.setdefault(trace, {})
    answer = per_trace.get(device.type)
    if answer is None:
        kind = device.type
        answer = per_trace[kind] = any(leaf.meta.device.type == kind for leaf in trace.leaves.values()) or any(
            m.device.type == kind for call in trace.calls for m in call.output_metas
        )
    return answer


def target(recorded: torch.device, device: torch.device, keep_cpu: bool) -> torch.device:
    """The device a tensor recorded on ``recorded`` replays on."""
    return CPU if keep_cpu and recorded.type == "cpu" else device
