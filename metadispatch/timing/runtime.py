"""``md.runtime``: how long a traced step would take on a named GPU -- an estimate.

Note [Step time from a roofline]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each call of the trace becomes one kernel (eager PyTorch launches about one
per aten call) whose time is the slowest of three limits::

    compute  FLOPs / (peak FLOP/s of its dtype x compute efficiency)
    memory   bytes / (memory bandwidth x memory efficiency)
    launch   the host's cost of dispatching one eager op

Views, ``empty`` and other calls that move no data cost nothing.
Collectives are priced as ``md.comms`` prices them, ring or tree (Note
[Collectives on a ring or a tree]).  FLOPs
are torch's formulas (``md.flops``); bytes are what the call reads and
writes (each distinct input and output tensor once).  Efficiencies are data,
an :class:`Efficiency` per GPU profile, by op class and FLOP bucket, so that
a small GEMM is not priced like a large one.  The time of a step is the sum:
one stream, no overlap of kernels, which eager training on one GPU is close
to.  Since every efficiency is at most 1, no call is ever estimated below its
roofline bound (``tests/timing/test_runtime.py`` checks it over many traces).

Limits, stated rather than hidden: the shipped table is *uncalibrated* -- no
GPU was available to measure it; its figures come from published kernel
benchmarks (named beside each) and are the same for every profile, scaled
only by each profile's peaks and bandwidth.  Calibrating it needs per-call
times measured on the GPU.  Overlap (CUDA graphs, async collectives, several
streams) and fused kernels (``torch.compile``) are not modelled: such steps
run faster than estimated.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..analysis.export import chrome_trace
from ..analysis.flops import ancestors, call_flops, fmt_count
from ..analysis.tables import render
from ..analysis.workspace import CUBLAS_OPS
from ..errors import MetaDispatchError
from ..ir.decode import is_marker
from ..ir.trace import Trace
from ..spec.profiles import GPUProfile, gpu_profile
from .bubble import PipelineRuntime, pipeline_runtime
from .collective_cost import GPUS_PER_NODE, NETWORK, Link, seconds
from .comms import Collective, comms

__all__ = ["Efficiency", "DEFAULT_EFFICIENCY", "Runtime", "runtime", "roofline", "classify", "call_bytes", "dtype_name"]

aten = torch.ops.aten
INF = float("inf")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a GPU's peaks that kernels reach, by op class.

    A class maps to ``((FLOPs up to, efficiency), ...)`` in increasing order:
    the first bucket whose bound is at least the call's FLOPs applies.
    """

    matmul: tuple = ((1e8, 0.15), (1e10, 0.45), (1e11, 0.62), (INF, 0.70))
    attention: tuple = ((1e9, 0.20), (INF, 0.40))
    convolution: tuple = ((1e9, 0.25), (INF, 0.50))
    other: tuple = ((INF, 0.30),)  # compute-heavy ops without a class of their own
    memory: float = 0.80  # of peak bandwidth, for memory-bound kernels
    launch: float = 6e-6  # seconds of host time per eager op
    interconnect: float = 0.75  # of the profile's interconnect bandwidth
    latency: float = 10e-6  # seconds per collective

    def __post_init__(self) -> None:
        for name in ("matmul", "attention", "convolution", "other"):
            buckets = getattr(self, name)
            bounds = [b for b, _ in buckets]
            if not buckets or bounds != sorted(bounds) or bounds[-1] != INF:
                raise MetaDispatchError(f"Efficiency.{name}: buckets must be sorted and end at inf, got {buckets!r}")
            for _, e in buckets:
                _check_fraction(f"Efficiency.{name}", e)
        _check_fraction("Efficiency.memory", self.memory)
        _check_fraction("Efficiency.interconnect", self.interconnect)
        if not (self.launch >= 0 and self.latency >= 0):
            raise MetaDispatchError("Efficiency.launch and .latency must be non-negative seconds")

    def compute(self, kind: str, flops: float) -> float:
        buckets = getattr(self, kind)
        return buckets[bisect.bisect_left([b for b, _ in buckets], flops)][1]


def _check_fraction(name: str, e) -> None:
    if not (isinstance(e, (int, float)) and 0 < e <= 1):
        raise MetaDispatchError(f"{name} must be a fraction in (0, 1], got {e!r}")


# Sources for the defaults (uncalibrated: Note [Step time from a roofline]):
# large bf16 GEMMs reach 65-75% of dense peak on H100 and A100 (cuBLAS figures
# in NVIDIA's and Lambda's published GEMM benchmarks); FlashAttention-2 reports
# 35-50% of peak forward and less backward (Dao, 2023); streaming kernels reach
# ~80% of HBM bandwidth (STREAM-like measurements); PyTorch's eager dispatch
# costs a few microseconds of host time per op.
DEFAULT_EFFICIENCY = Efficiency()
_TABLES: dict = {}  # profile name -> Efficiency, where a calibrated table exists


def efficiency_for(profile: GPUProfile) -> Efficiency:
    return _TABLES.get(profile.name, DEFAULT_EFFICIENCY)


# -- classes of ops

_MATMUL = CUBLAS_OPS
_ATTENTION_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention",
    "_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
_CONV_NAMES = ("convolution", "cudnn_convolution", "_convolution", "mkldnn_convolution")
_FREE = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh.default,
    aten._unsafe_view.default,
    aten.set_.source_Storage_storage_offset,
    aten.resize_.default,
    aten.empty_like.default,
}
_COLLECTIVE_NS = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "int8",
}


def classify(call) -> str:
    """``free``, ``collective``, ``matmul``, ``attention``, ``convolution`` or ``other``."""
    func = call.func
    if func in _FREE or getattr(func, "is_view", False) or is_marker(func):  # markers run nothing
        return "free"
    ns, _, rest = call.op.partition(".")
    if ns in _COLLECTIVE_NS:
        return "collective"
    if func in _MATMUL or rest.startswith(("_scaled_mm.", "_grouped_mm.")):
        return "matmul"
    base = rest.partition(".")[0]
    if base.removesuffix("_backward") in _ATTENTION_NAMES:
        return "attention"
    if base.removesuffix("_backward") in _CONV_NAMES:
        return "convolution"
    return "other"


def call_bytes(call) -> int:
    """Bytes a call reads and writes: each distinct input and output tensor once."""
    seen: dict = {}
    for m in call.inputs + call.output_metas:
        seen[m.id] = m
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in seen.values())


def dtype_name(call) -> str:
    for m in call.inputs:
        if m.dtype.is_floating_point or m.dtype == torch.int8:
            if m.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                return "fp8"
            return _DTYPES.get(m.dtype, "fp32")
    return "fp32"


# Every kernel at the GPU's peaks, no launch cost: the bound no estimate may beat.
_ROOFLINE = Efficiency(
    matmul=((INF, 1.0),),
    attention=((INF, 1.0),),
    convolution=((INF, 1.0),),
    other=((INF, 1.0),),
    memory=1.0,
    launch=0.0,
    interconnect=1.0,
    latency=0.0,
)


def roofline(call, profile: GPUProfile, flops: int | None = None, collective: Collective | None = None) -> float:
    """The lower bound on a call's time: FLOPs at peak, bytes at full bandwidth
    (a collective, ``collective`` from ``md.comms``, at the full interconnect and network, no latency)."""
    flops = call_flops(call) if flops is None else flops
    return _call_time(call, flops, profile, _ROOFLINE, collective)[0]


# Note [Collectives on a ring or a tree]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A collective is priced by the model ``md.comms`` uses (Note [Time of a
# collective] in collective_cost.py): ring or tree, whichever is faster for
# an all-reduce or broadcast, over the profile's interconnect while the
# group's ranks share a node and over the network between nodes, with the
# efficiency table's latency per step and its fraction of both bandwidths.
# (An earlier ring-only formula here gave md.runtime and md.comms different
# times for the same call.)  A collective without payload (wait_tensor,
# barrier) and one over a single rank cost a launch.
def _collective_time(c: Collective, profile: GPUProfile, eff: Efficiency) -> float:
    ranks = tuple(c.group.ranks) if c.group is not None else (0,)
    net = Link(profile.interconnect * eff.interconnect, NETWORK * eff.interconnect, eff.latency, GPUS_PER_NODE)
    return seconds(c.kind, c.bytes, ranks, net)


def _call_time(call, flops, profile: GPUProfile, eff: Efficiency, coll: Collective | None = None) -> tuple[float, str]:
    kind = classify(call)
    if kind == "free" or (kind == "collective" and coll is None):
        return 0.0, "free"
    if coll is not None:
        return max(_collective_time(coll, profile, eff), eff.launch), "network"
    nbytes = call_bytes(call)
    flops = flops or 0
    compute = flops / (profile.peak(dtype_name(call)) * eff.compute(kind, flops)) if flops else 0.0
    memory = nbytes / (profile.bandwidth * eff.memory)
    t = max(compute, memory, eff.launch)
    return t, ("compute" if t == compute else "memory" if t == memory else "launch")


Seconds = dict  # name -> seconds


def _largest(d: dict) -> list:
    return sorted(d.items(), key=lambda kv: -kv[1])


@dataclass
class Runtime:
    """Estimated time of a traced step on one GPU; print it for a summary.

    ``per_call`` seconds and ``bound`` (``compute``, ``memory``, ``launch``,
    ``network`` or ``free``) per call; ``by_module`` is inclusive (a module
    and its children), ``""`` is the whole step.
    """

    gpu: GPUProfile
    efficiency: Efficiency
    per_call: list
    bound: list
    flops: int
    by_op: Seconds = field(default_factory=dict)
    by_phase: Seconds = field(default_factory=dict)
    by_module: Seconds = field(default_factory=dict)
    by_bound: Seconds = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Seconds for the whole traced step."""
        return sum(self.per_call)

    @property
    def mfu(self) -> float:
        """Counted FLOPs over (step time x the GPU's peak for the step's main dtype)."""
        return self.flops / (self.total * self.gpu.peak(self.main_dtype)) if self.total else 0.0

    main_dtype: str = "fp32"

    def __repr__(self) -> str:
        return f"<Runtime {self.total * 1e3:.1f} ms on {self.gpu.title}, MFU {self.mfu:.0%}>"

    def __str__(self) -> str:
        head = (
            f"estimated step time on {self.gpu.title}: {self.total * 1e3:.1f} ms "
            f"({fmt_count(self.flops)} FLOPs, MFU {self.mfu:.0%} of {self.main_dtype} peak; "
            + ", ".join(f"{b} {t * 1e3:.1f} ms" for b, t in _largest(self.by_bound) if t)
            + ")"
            + ("" if self.efficiency is not DEFAULT_EFFICIENCY else " -- uncalibrated efficiency table")
        )
        phases = [
            (p, f"{t * 1e3:.2f}", f"{t / self.total:.0%}" if self.total else "-")
            for p, t in sorted(self.by_phase.items())
        ]
        ops = [
            (op, f"{t * 1e3:.2f}", f"{t / self.total:.0%}" if self.total else "-") for op, t in _largest(self.by_op)[:8]
        ]
        return "\n".join(
            [head]
            + render(("phase", "ms", "share"), phases, align="<>>")
            + render(("op", "ms", "share"), ops, align="<>>")
        )

    def chrome_trace(self, trace: Trace) -> dict:
        """The trace as Chrome trace events laid out on the estimated times (microseconds)."""
        starts = [0.0]
        for t in self.per_call:
            starts.append(starts[-1] + t * 1e6)
        return chrome_trace(trace, clock=starts)

    def save_perfetto(self, trace: Trace, path) -> None:
        """Write :meth:`chrome_trace` as JSON; open it in ui.perfetto.dev."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(trace), f)


def runtime(
    trace: Trace | list, gpu: str | GPUProfile | None = None, efficiency: Efficiency | None = None
) -> Runtime | PipelineRuntime:
    """Estimate how long the traced step takes on ``gpu`` (Note [Step time from a roofline]).

    Given a list of traces -- each rank of a pipeline, in rank order -- the
    ranks are run against each other, each receive waiting for its send: a
    :class:`PipelineRuntime` with the step time, each rank's busy and idle
    time, the bubble and the micro-batches in flight (Note [A pipeline's
    bubble from its stages' traces] in timing/bubble.py).

    ``gpu``: a profile name or :class:`GPUProfile`; by default the one the
    trace was recorded for, else ``h100``.

    >>> import torch, metadispatch as md
    >>> t = md.tracer(device="cuda")(lambda a, b: a @ b, torch.ones(4096, 4096), torch.ones(4096, 4096))
    >>> r = md.runtime(t, gpu="h100")
    >>> round(r.total * 1e3, 2), r.bound
    (2.93, ['compute'])
    """
    if isinstance(trace, (list, tuple)):
        return pipeline_runtime(list(trace), [runtime(t, gpu, efficiency) for t in trace])
    profile = gpu_profile(gpu if gpu is not None else getattr(trace, "gpu", None))
    eff = efficiency or efficiency_for(profile)
    per_call, bounds, total_flops = [], [], 0
    by_op: Seconds = defaultdict(float)
    by_phase: Seconds = defaultdict(float)
    by_module: Seconds = defaultdict(float)
    by_bound: Seconds = defaultdict(float)
    by_dtype: dict[str, int] = defaultdict(int)
    ring = {c.index: c for c in comms(trace).calls} if trace.world else {}
    for call in trace.calls:
        flops = call_flops(call)
        t, bound = _call_time(call, flops, profile, eff, ring.get(call.index))
        per_call.append(t)
        bounds.append(bound)
        total_flops += flops or 0
        if flops:
            by_dtype[dtype_name(call)] += flops
        by_op[call.op] += t
        by_phase[call.phase] += t
        by_bound[bound] += t
        for m in ancestors(call.module):
            by_module[m] += t
    main = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "fp32"
    return Runtime(profile, eff, per_call, bounds, total_flops, by_op, by_phase, by_module, by_bound, main_dtype=main)
