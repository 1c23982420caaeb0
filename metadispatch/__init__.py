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

import importlib as _importlib
from typing import TYPE_CHECKING

from . import rules as _rules  # noqa: F401  (registers the built-in rules)
from .errors import (
    BudgetExceededError,
    CheckpointFormatError,
    CheckpointMismatchError,
    DataDependentError,
    DoesNotFitError,
    MaterializeLimitError,
    MetaDispatchError,
    ReplayError,
    TraceFormatError,
    UnsupportedFeatureError,
    UnsupportedOpError,
)
from .gpu import cuda_answers as _cuda_answers


def _counters(trace, profile):
    """torch.cuda's memory counters for a logical GPU (Note [Wiring] in
    tensor/tensor.py), imported when a mode first needs them: the analyses stay
    unloaded by ``import metadispatch`` (Note [Public names load on first use])."""
    from .analysis.cuda_counters import Counters

    return Counters(trace, profile)


_cuda_answers.WIRING.counters = _counters
del _counters  # reached through the wiring only


if TYPE_CHECKING:  # the same names, eagerly, for type checkers
    from . import checkpoint, testing
    from .analysis.fit import fits
    from .analysis.flops import flops, register_flops, unregister_flops
    from .analysis.live import LiveStorages
    from .analysis.memory import memory
    from .analysis.steps import Step, Steps, generation_steps
    from .analysis.tables import module_table, shape_log
    from .core.registry import register_meta, unregister_meta
    from .debug.check import check, checker
    from .debug.diff import diff
    from .debug.report import Report
    from .debug.verify import RuleCheck, verify_rule
    from .execution.audit import Audit, audit
    from .execution.materialize import materialize
    from .execution.replay import Mismatch, Replay, replay
    from .ir.trace import Leaf, OpCall, TensorMeta, Trace
    from .mode.mode import MetaMode
    from .planning.ac import ACPlan, apply_ac, plan_ac, remove_ac
    from .planning.batch import MaxBatch, max_batch
    from .planning.train import Candidate, PlanTable, plan
    from .spec.profiles import GPUProfile, gpu_profile, register_gpu
    from .tensor.tensor import MetaTensor
    from .timing.calibrate import calibrate, load_efficiency
    from .timing.comms import comms
    from .timing.runtime import Efficiency, runtime
    from .tracing.marks import mark
    from .tracing.tracer import to_meta, trace, tracer
    from .trust.budget import Budget
    from .values.assume import GenerateAssumptions
    from .values.routing import RoutingAssumption

# Note [Public names load on first use]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``import metadispatch`` registers the built-in rules (which loads ``core``
# and ``ir``) and nothing else: the analyses, replay, the debugging tools and
# the test helpers are imported when one of their names is first read
# (PEP 562 ``__getattr__``): ``import metadispatch`` after ``import torch``
# went from 0.23-0.26 s to 0.08-0.11 s of CPU (docs/benchmarks.md,
# "Start-up").  Each
# name then lives in the module's globals like an eagerly imported one, and
# ``dir()`` lists the same names as before: the public ones and the
# subpackages.
_LAZY = {
    "calibrate": "timing.calibrate",
    "load_efficiency": "timing.calibrate",
    "comms": "timing.comms",
    "fits": "analysis.fit",
    "serve_plan": "serving.serve",
    "ServePlan": "serving.serve",
    "max_batch": "planning.batch",
    "plan_ac": "planning.ac",
    "apply_ac": "planning.ac",
    "remove_ac": "planning.ac",
    "ACPlan": "planning.ac",
    "MaxBatch": "planning.batch",
    "plan": "planning.train",
    "PlanTable": "planning.train",
    "Candidate": "planning.train",
    "kv_layout": "serving.kv",
    "KVLayout": "serving.kv",
    "flops": "analysis.flops",
    "register_flops": "analysis.flops",
    "unregister_flops": "analysis.flops",
    "LiveStorages": "analysis.live",
    "memory": "analysis.memory",
    "generation_steps": "analysis.steps",
    "Step": "analysis.steps",
    "Steps": "analysis.steps",
    "Efficiency": "timing.runtime",
    "runtime": "timing.runtime",
    "module_table": "analysis.tables",
    "shape_log": "analysis.tables",
    "MetaMode": "mode.mode",
    "GPUProfile": "spec.profiles",
    "gpu_profile": "spec.profiles",
    "register_gpu": "spec.profiles",
    "register_meta": "core.registry",
    "unregister_meta": "core.registry",
    "MetaTensor": "tensor.tensor",
    "check": "debug.check",
    "checker": "debug.check",
    "diff": "debug.diff",
    "Report": "debug.report",
    "RuleCheck": "debug.verify",
    "verify_rule": "debug.verify",
    "Budget": "trust.budget",
    "audit": "execution.audit",
    "Audit": "execution.audit",
    "materialize": "execution.materialize",
    "Mismatch": "execution.replay",
    "Replay": "execution.replay",
    "replay": "execution.replay",
    "Leaf": "ir.trace",
    "OpCall": "ir.trace",
    "TensorMeta": "ir.trace",
    "Trace": "ir.trace",
    "to_meta": "tracing.tracer",
    "trace": "tracing.tracer",
    "tracer": "tracing.tracer",
    "mark": "tracing.marks",
    "GenerateAssumptions": "values.assume",
    "RoutingAssumption": "values.routing",
}
_SUBPACKAGES = (
    "analysis",
    "checkpoint",
    "core",
    "debug",
    "execution",
    "gpu",
    "ir",
    "mode",
    "rules",
    "spec",
    "tensor",
    "testing",
    "tracing",
    "values",
    "world",
)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _SUBPACKAGES:
        value = _importlib.import_module(f".{name}", __name__)
    elif name == "__version__":
        # Written once, in pyproject.toml; an uninstalled checkout has none.
        import importlib.metadata

        try:
            value = importlib.metadata.version("metadispatch")
        except importlib.metadata.PackageNotFoundError:
            value = "0+unknown"
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    hidden = {"_LAZY", "_SUBPACKAGES", "_importlib", "TYPE_CHECKING", "__getattr__", "__dir__"}
    return sorted((set(globals()) - hidden) | set(__all__) | set(_SUBPACKAGES) | {"__version__"})


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
    "mark",
    "GenerateAssumptions",
    "RoutingAssumption",
    "generation_steps",
    "Step",
    "Steps",
    "register_meta",
    "unregister_meta",
    "diff",
    "testing",
    "checkpoint",
    "flops",
    "register_flops",
    "unregister_flops",
    "memory",
    "fits",
    "serve_plan",
    "ServePlan",
    "kv_layout",
    "KVLayout",
    "max_batch",
    "MaxBatch",
    "plan",
    "PlanTable",
    "Candidate",
    "plan_ac",
    "apply_ac",
    "remove_ac",
    "ACPlan",
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
    "audit",
    "Audit",
    "Budget",
    "MetaDispatchError",
    "UnsupportedOpError",
    "DataDependentError",
    "TraceFormatError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "UnsupportedFeatureError",
    "ReplayError",
    "BudgetExceededError",
    "check",
    "checker",
    "Report",
    "MaterializeLimitError",
    "DoesNotFitError",
    "verify_rule",
    "RuleCheck",
]
