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

from . import rules as _rules  # noqa: F401  (registers the built-in rules)
from . import testing
from .api import to_meta, trace, tracer
from .check import check, checker
from .diff import diff
from .errors import (DataDependentError, MaterializeLimitError, MetaDispatchError, TraceFormatError,
                     UnsupportedFeatureError, UnsupportedOpError)
from .flops import flops, register_flops, unregister_flops
from .memory import LiveStorages, memory
from .mode import MetaMode
from .registry import register_meta, unregister_meta
from .materialize import materialize
from .replay import Mismatch, Replay, replay
from .report import Report
from .verify import RuleCheck, verify_rule
from .tensor import MetaTensor
from .tables import module_table, shape_log
from .trace import Leaf, OpCall, TensorMeta, Trace

__version__ = "0.1.0"

__all__ = [
    "MetaTensor", "MetaMode", "Trace", "OpCall", "TensorMeta", "Leaf",
    "trace", "tracer", "to_meta", "register_meta", "unregister_meta", "diff", "testing",
    "flops", "register_flops", "unregister_flops", "memory", "LiveStorages", "module_table", "shape_log",
    "replay", "Replay", "Mismatch", "materialize",
    "MetaDispatchError", "UnsupportedOpError", "DataDependentError", "TraceFormatError",
    "UnsupportedFeatureError",
    "check", "checker", "Report", "MaterializeLimitError", "verify_rule", "RuleCheck",
]
