"""metadispatch: know what a PyTorch model will do -- every op, shape, stride
and device -- without running it, then prove it by replaying the trace.

>>> import torch, metadispatch as md
>>> t = md.trace(lambda x: x.sum(), torch.ones(2))
>>> print(t)
$0: f32[2] = arg args[0]
$1: f32[] = aten.sum.default($0)

Importing this package changes nothing global: modes and hooks exist only
while a ``MetaMode`` is entered or ``md.trace`` runs.
"""

import importlib.metadata as _metadata

from . import rules as _rules  # noqa: F401  (registers the built-in rules)
from . import testing
from .analysis import cuda_counters as _cuda_counters  # noqa: F401  (torch.cuda's memory counters, Note [Wiring])
from .analysis.calibrate import calibrate, load_efficiency
from .analysis.comms import comms
from .analysis.fit import fits
from .analysis.flops import flops, register_flops, unregister_flops
from .analysis.live import LiveStorages
from .analysis.memory import memory
from .analysis.runtime import Efficiency, runtime
from .analysis.tables import module_table, shape_log
from .core.mode import MetaMode
from .core.profiles import GPUProfile, gpu_profile, register_gpu
from .core.registry import register_meta, unregister_meta
from .core.tensor import MetaTensor
from .debug.check import check, checker
from .debug.diff import diff
from .debug.report import Report
from .debug.verify import RuleCheck, verify_rule
from .errors import (
    BudgetExceededError,
    DataDependentError,
    MaterializeLimitError,
    MetaDispatchError,
    ReplayError,
    TraceFormatError,
    UnsupportedFeatureError,
    UnsupportedOpError,
)
from .execution.budget import Budget
from .execution.materialize import materialize
from .execution.replay import Mismatch, Replay, replay
from .ir.trace import Leaf, OpCall, TensorMeta, Trace
from .tracing.tracer import to_meta, trace, tracer

# The version is written once, in pyproject.toml; an uninstalled checkout has none.
try:
    __version__ = _metadata.version("metadispatch")
except _metadata.PackageNotFoundError:
    __version__ = "0+unknown"

__all__ = [
    "MetaTensor",
    "MetaMode",
    "Trace",
    "OpCall",
    "TensorMeta",
    "Leaf",
    "trace",
    "tracer",
    "to_meta",
    "register_meta",
    "unregister_meta",
    "diff",
    "testing",
    "flops",
    "register_flops",
    "unregister_flops",
    "memory",
    "fits",
    "runtime",
    "Efficiency",
    "calibrate",
    "load_efficiency",
    "comms",
    "LiveStorages",
    "module_table",
    "shape_log",
    "GPUProfile",
    "gpu_profile",
    "register_gpu",
    "replay",
    "Replay",
    "Mismatch",
    "materialize",
    "Budget",
    "MetaDispatchError",
    "UnsupportedOpError",
    "DataDependentError",
    "TraceFormatError",
    "UnsupportedFeatureError",
    "ReplayError",
    "BudgetExceededError",
    "check",
    "checker",
    "Report",
    "MaterializeLimitError",
    "verify_rule",
    "RuleCheck",
]
