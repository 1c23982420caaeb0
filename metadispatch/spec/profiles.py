"""GPU profiles: what a named GPU decides for memory and time estimates.

A :class:`GPUProfile` is a frozen record of the figures an analysis needs --
memory capacity, bandwidth, dense peak FLOP/s per dtype -- for one GPU.  The
built-in profiles come from vendor datasheets (named in the comments beside
each); the memory size is the total the device reports to CUDA
(``torch.cuda.get_device_properties(i).total_memory``), which is a little less
than the marketing figure, because that is what an out-of-memory error is
measured against.  Register your own with :func:`register_gpu`.

The profile also holds what the GPU's attention backend choice reads
(``cuda_version``, ``cudnn_version``, ``cudnn_frontend_d256``): the CUDA and
cuDNN that the installed torch's default CUDA wheels ship, see ``WHEEL``.

Limits: peak figures are *dense* (no 2:4 sparsity) at boost clock; real
kernels reach a fraction of them, which ``md.runtime``'s efficiency tables
model.  A dtype the GPU has no tensor-core path for (fp8 before Hopper) is
absent from ``flops``; a caller falls back to the nearest wider dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..errors import MetaDispatchError

__all__ = ["GPUProfile", "register_gpu", "gpu_profile", "gpu_profiles", "DEFAULT_GPU", "WHEEL"]

DEFAULT_GPU = "h100"  # the GPU most published step times are measured on
MiB = 2**20
T = 10**12

# (CUDA_VERSION, cuDNN runtime version) of the default Linux CUDA wheel of each
# torch release, as C++ encodes them (13000 = 13.0, 92400 = 9.24.0): from the
# wheel's METADATA (``Requires-Dist: nvidia-cudnn-cu13==9.20.0.48`` for torch
# 2.13.0+cu130, ``nvidia-cudnn-cu13==9.24.0.43`` for 2.14.1+cu130).
_WHEELS = {(2, 13): (13000, 92000), (2, 14): (13000, 92400)}
_MAJOR, _MINOR = (int(x) for x in torch.__version__.split(".")[:2])
WHEEL = _WHEELS.get((_MAJOR, _MINOR), _WHEELS[(2, 14)])


@dataclass(frozen=True)
class GPUProfile:
    """One GPU's figures.

    >>> import metadispatch as md
    >>> p = md.gpu_profile("h100")
    >>> p.title, p.flops["bf16"] / 1e12, round(p.memory / 2 ** 30, 1)
    ('H100 80 GB', 989.5, 79.2)
    """

    name: str  # registry key, lower case: "h100"
    title: str  # for people: "H100 80 GB"
    compute_capability: tuple[int, int]
    sm_count: int
    memory: int  # bytes the device reports as total_memory
    bandwidth: float  # HBM/GDDR bytes per second
    flops: Mapping[str, float]  # dtype name -> dense peak FLOP/s (int8: OP/s)
    l2_bytes: int
    interconnect: float  # bytes per second per GPU, one direction summed over links
    # What SDPA's backend choice reads besides the SM (rules/attention.py).
    cuda_version: int = WHEEL[0]
    cudnn_version: int = WHEEL[1]
    # Whether torch's bundled cuDNN frontend is >= 1.24 (kCuDNNFrontendSupportsD256:
    # head dims up to 256 on sm90/sm10x with cuDNN > 9.22).  True in the 2.14.1
    # cu130 wheel (its check_cudnn_tensor_shapes has no frontend test left);
    # 2.13's rule does not read it (Note [cuDNN head dim and decode by release]).
    cudnn_frontend_d256: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", MappingProxyType(dict(self.flops)))

    # Immutable: a copy is the profile itself, and pickling rebuilds it (a
    # mappingproxy does not pickle).  A trace holding an unregistered profile
    # deep-copies and pickles.
    def __copy__(self) -> GPUProfile:
        return self

    def __deepcopy__(self, memo) -> GPUProfile:
        return self

    def __reduce__(self):
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return _rebuild, (fields | {"flops": dict(self.flops)},)

    def __hash__(self) -> int:  # flops is a mapping; the profile keys cached answers (cache.context)
        return hash(
            (
                self.name,
                self.compute_capability,
                self.sm_count,
                self.memory,
                self.cuda_version,
                self.cudnn_version,
                self.cudnn_frontend_d256,
            )
        )

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for a dtype name, the nearest wider one if absent."""
        for d in _WIDER.get(dtype, (dtype,)):
            if d in self.flops:
                return self.flops[d]
        raise MetaDispatchError(f"GPU profile {self.name!r} has no peak for {dtype!r}")


_WIDER = {
    "fp8": ("fp8", "fp16"),
    "int8": ("int8", "fp16"),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "tf32": ("tf32", "fp32"),
}


def _flops(fp64, fp32, tf32, bf16, fp16, fp8, int8) -> dict:
    out = dict(fp64=fp64, fp32=fp32, tf32=tf32, bf16=bf16, fp16=fp16, fp8=fp8, int8=int8)
    return {k: v * T for k, v in out.items() if v is not None}


def _rebuild(fields: dict) -> GPUProfile:
    return GPUProfile(**fields)


_PROFILES: dict = {}


def register_gpu(profile: GPUProfile, *, override: bool = False) -> GPUProfile:
    """Make a profile known by its ``name``; a second one of a name raises unless ``override``.

    >>> import dataclasses, metadispatch as md
    >>> mine = dataclasses.replace(md.gpu_profile("h100"), name="h100-tp", memory=70 * 2 ** 30)
    >>> md.register_gpu(mine).name, md.gpu_profile("h100-tp").memory == 70 * 2 ** 30
    ('h100-tp', True)
    """
    key = profile.name.lower()
    if key in _PROFILES and not override:
        raise MetaDispatchError(f"a GPU profile named {key!r} is registered already; pass override=True")
    _PROFILES[key] = profile
    return profile


def gpu_profile(name: str | GPUProfile | None = None) -> GPUProfile:
    """The profile registered as ``name`` (``None``: the default, ``h100``); a profile passes through."""
    if isinstance(name, GPUProfile):
        return name
    key = (name or DEFAULT_GPU).lower()
    if key not in _PROFILES:
        raise MetaDispatchError(
            f"unknown GPU {name!r}; known: {', '.join(sorted(_PROFILES))} (md.register_gpu adds one)"
        )
    return _PROFILES[key]


def gpu_profiles() -> dict:
    """Name -> profile, every one registered."""
    return dict(_PROFILES)


# Memory sizes: total_memory as torch.cuda.get_device_properties prints it (MiB),
# taken from public logs where one was found, else nvidia-smi's total.
for _p in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 column); 81,089 MiB printed by torch on an H100 80GB HBM3.
    GPUProfile(
        "h100",
        "H100 80 GB",
        (9, 0),
        132,
        81089 * MiB,
        3.35e12,
        _flops(67, 67, 494.5, 989.5, 989.5, 1979, 1979),
        50 * MiB,
        900e9,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM); 143,156 MiB printed by torch on an H200.
    GPUProfile(
        "h200",
        "H200 141 GB",
        (9, 0),
        132,
        143156 * MiB,
        4.8e12,
        _flops(67, 67, 494.5, 989.5, 989.5, 1979, 1979),
        50 * MiB,
        900e9,
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column); 81,920 MiB nvidia-smi total (approximate).
    GPUProfile(
        "a100-80gb",
        "A100 80 GB",
        (8, 0),
        108,
        81920 * MiB,
        2.039e12,
        _flops(19.5, 19.5, 156, 312, 312, None, 624),
        40 * MiB,
        600e9,
    ),
    # NVIDIA A100 datasheet (40GB SXM column); 40,536 MiB printed on an A100-SXM4-40GB.
    GPUProfile(
        "a100-40gb",
        "A100 40 GB",
        (8, 0),
        108,
        40536 * MiB,
        1.555e12,
        _flops(19.5, 19.5, 156, 312, 312, None, 624),
        40 * MiB,
        600e9,
    ),
    # NVIDIA L4 Tensor Core GPU datasheet (dense = half the sparse figures); 23,034 MiB nvidia-smi total;
    # fp64 is 1/64 of fp32; interconnect is PCIe Gen4 x16.
    GPUProfile(
        "l4", "L4 24 GB", (8, 9), 58, 23034 * MiB, 300e9, _flops(0.47, 30.3, 60, 121, 121, 242.5, 242.5), 48 * MiB, 64e9
    ),
    # NVIDIA L40S datasheet (https://www.nvidia.com/en-us/data-center/l40s/; dense = half the
    # sparse figures); 46,068 MiB nvidia-smi total (approximate); fp64 is 1/64 of fp32 (Ada), not
    # on the datasheet; L2 96 MB from the Ada architecture whitepaper; PCIe Gen4 x16.
    GPUProfile(
        "l40s",
        "L40S 48 GB",
        (8, 9),
        142,
        46068 * MiB,
        864e9,
        _flops(1.43, 91.6, 183, 362, 362, 733, 733),
        96 * MiB,
        64e9,
    ),
    # NVIDIA HGX B200 datasheet, per GPU (dense = half the sparse figures); 183,359 MiB nvidia-smi
    # total (approximate); L2 126 MB is from NVIDIA's Blackwell tuning guide, not the datasheet.
    GPUProfile(
        "b200",
        "B200 180 GB",
        (10, 0),
        148,
        183359 * MiB,
        8e12,
        _flops(37, 75, 1100, 2250, 2250, 4500, 4500),
        126 * MiB,
        1.8e12,
    ),
):
    register_gpu(_p)
