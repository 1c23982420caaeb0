"""``md.calibrate``: ``md.runtime``'s efficiency table fitted to measured call times.

Requirements: turn the per-call seconds a real run measured
(``md.replay(trace, device="cuda", timing=True).times``, Note [Timing
replayed calls]) into an :class:`Efficiency` for that GPU, and keep it as a
file.  Each figure is the median over the calls it governs, so one outlier
kernel moves nothing:

- ``launch``: the median time of calls whose roofline (every peak reached)
  is under 0.1 microseconds -- there is nothing to them but launching;
- ``memory``: calls whose roofline is memory-bound (below the ridge of
  FLOPs per byte) and which took more than twice the launch cost: bytes
  over (bandwidth x time);
- each op class and FLOP bucket: compute-bound calls of that class and
  bucket, likewise past the launch cost: FLOPs over (peak x time).

A figure without calls to fit keeps the table's value; none exceeds 1.
Collectives' ``interconnect`` and ``latency`` are not fitted (a one-GPU
replay has none).
"""

from __future__ import annotations

import dataclasses
import json
import statistics

from ..analysis.flops import call_flops
from ..errors import MetaDispatchError
from ..ir.trace import Trace
from ..spec.profiles import GPUProfile, gpu_profile
from .runtime import INF, Efficiency, call_bytes, classify, dtype_name, efficiency_for

__all__ = ["calibrate", "load_efficiency"]

_CLASSES = ("matmul", "attention", "convolution", "other")


def calibrate(
    trace: Trace, times: list, gpu: str | GPUProfile | None = None, path=None, base: Efficiency | None = None
) -> Efficiency:
    """An :class:`Efficiency` for ``gpu`` fitted to ``times`` (seconds per call of ``trace``).

    ``base`` gives the figures nothing measured (default: the table in use
    for ``gpu``); ``path`` also writes the table as JSON (``load_efficiency``
    reads it back).

    >>> import torch, metadispatch as md
    >>> t = md.tracer(device="cuda")(lambda x: x * 2, torch.ones(1 << 24))
    >>> e = md.calibrate(t, [100e-6], gpu="h100")  # as if measured on an H100
    >>> round(e.memory, 2), e.launch  # 2 x 64 MiB in 100 us at 3.35 TB/s; nothing to fit launch on
    (0.4, 6e-06)
    """
    profile = gpu_profile(gpu if gpu is not None else trace.gpu)
    base = base or efficiency_for(profile)
    if len(times) != len(trace.calls):
        raise MetaDispatchError(f"md.calibrate: {len(times)} times for a trace of {len(trace.calls)} calls")
    launch: list = []
    memory: list = []
    compute: dict = {c: {} for c in _CLASSES}
    rows = []
    for call, t in zip(trace.calls, times):
        kind = classify(call)
        if kind in ("free", "collective") or not t > 0:
            continue
        flops, nbytes = call_flops(call) or 0, call_bytes(call)
        peak = profile.peak(dtype_name(call))
        at_peak, at_bandwidth = flops / peak, nbytes / profile.bandwidth
        if max(at_peak, at_bandwidth) < 1e-7:
            launch.append(t)
        rows.append((kind, flops, t, at_peak, at_bandwidth))
    fitted_launch = statistics.median(launch) if launch else base.launch
    for kind, flops, t, at_peak, at_bandwidth in rows:
        if t <= 2 * fitted_launch:
            continue
        if at_peak > at_bandwidth:
            buckets = getattr(base, kind)
            bound = next(b for b, _ in buckets if flops <= b)
            compute[kind].setdefault(bound, []).append(at_peak / t)
        elif at_bandwidth > 0:
            memory.append(at_bandwidth / t)
    table: dict = {}
    for kind in _CLASSES:
        table[kind] = tuple((b, _fit(compute[kind].get(b), e)) for b, e in getattr(base, kind))
    eff = dataclasses.replace(base, launch=fitted_launch, memory=_fit(memory, base.memory), **table)
    if path is not None:
        with open(path, "w") as f:
            json.dump(_to_json(eff, profile), f, indent=1)
    return eff


def _fit(values, default: float) -> float:
    return min(1.0, statistics.median(values)) if values else default


def _to_json(eff: Efficiency, profile: GPUProfile) -> dict:
    out: dict = {"gpu": profile.name}
    for field in dataclasses.fields(eff):
        v = getattr(eff, field.name)
        out[field.name] = [["inf" if b == INF else b, e] for b, e in v] if isinstance(v, tuple) else v
    return out


def load_efficiency(path) -> Efficiency:
    """The :class:`Efficiency` that :func:`calibrate` wrote to ``path``."""
    with open(path) as f:
        data = json.load(f)
    data.pop("gpu", None)
    names = {f.name for f in dataclasses.fields(Efficiency)}
    if not isinstance(data, dict) or set(data) - names:
        raise MetaDispatchError(f"{path}: not an efficiency table (fields {sorted(names)})")
    for kind in _CLASSES:
        if kind in data:
            data[kind] = tuple((INF if b == "inf" else float(b), float(e)) for b, e in data[kind])
    return Efficiency(**data)
