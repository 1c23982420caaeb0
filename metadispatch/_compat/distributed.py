"""torch.distributed: the fake backend, process groups, FSDP2's and DTensor's modules.

Part of ``metadispatch._compat`` (its docstring says why private torch APIs live here alone).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed import distributed_c10d


# -- torch.distributed (the logical world: world/world.py)
def fake_process_group_store():
    """A store for torch's ``fake`` backend, registering that backend first.

    The backend's creator is registered by importing torch's testing module;
    importing it here, on the first logical world, keeps that (and its second
    of import time) away from users who never ask for one.
    """
    from torch.testing._internal.distributed import fake_pg

    return fake_pg.FakeStore()


def process_group_of(obj):
    """The ProcessGroup a c10d op's boxed ``process_group`` argument holds."""
    return dist.ProcessGroup.unbox(obj)


def reduce_op_name(obj) -> str:
    """``"SUM"``, ``"AVG"``, ...: the op a c10d op's boxed ``reduce_op`` argument holds."""
    return dist.ReduceOp.RedOpType(obj.op()).name


def reduce_op(name: str):
    """The ``ReduceOp`` called ``name`` (the inverse of :func:`reduce_op_name`)."""
    return dist.ReduceOp.RedOpType.__members__[name]


def allgather_base(pg, output: torch.Tensor, input: torch.Tensor):
    """``pg``'s all-gather into one tensor (the method behind ``c10d._allgather_base_``); a Work."""
    return pg._allgather_base(output, input)


def reduce_scatter_base(pg, output: torch.Tensor, input: torch.Tensor, op):
    """``pg``'s reduce-scatter of one tensor (behind ``c10d._reduce_scatter_base_``); a Work."""
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = op
    return pg._reduce_scatter_base(output, input, opts)


def new_c10d_world():
    """A fresh registry of process groups, as torch.distributed starts with
    (a logical world's, in its thread: world/world.py)."""
    return distributed_c10d._World()


def named_process_groups() -> dict:
    """Every live process group -> its name (torch's registry of groups)."""
    return dict(distributed_c10d._world.pg_names)


def resolve_process_group(name: str):
    return distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]  # GroupName is a str


def fsdp_param_module():
    """FSDP2's ``_fsdp_param`` module, whose ``free_storage``/``alloc_storage`` world/fsdp_storage.py wraps."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return _fsdp_param


# Where torch.distributed asks which accelerator this build has (FSDP2's
# default mesh, ``init_process_group``'s default backend) and where
# ``torch.accelerator.current_accelerator`` asks: C++ functions on
# ``torch._C`` (gpu/logical_cuda.py answers them for a logical world's GPU).
accelerator_queries = (torch._C, ("_get_accelerator", "_accelerator_getAccelerator"))

resize_storage_bytes = torch.ops.inductor.resize_storage_bytes_.default

# A finished c10d Work around a future (rules/collectives.py).
work_from_future = torch._C._distributed_c10d._create_work_from_future  # type: ignore[attr-defined]


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding and redistribution plans (Note [One world at a time] in world/world.py)."""
    from torch.distributed.tensor import _redistribute, _sharding_prop
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()


def functional_collectives_module():
    """``torch.distributed._functional_collectives``, whose ``_are_we_tracing`` world/world.py answers."""
    from torch.distributed import _functional_collectives

    return _functional_collectives


def waits_on_use(func) -> bool:
    """Whether ``func`` on an ``AsyncCollectiveTensor`` waits for its collective: every op but a view
    (torch's own test, ``_is_view_op``: a first argument aliased and not written, no C++ composite)."""
    return not functional_collectives_module()._is_view_op(func)


# torch.distributed.tensor costs ~0.5 s to import (it pulls in sympy): only a
# logical world (world/world.py) needs it, so it is imported on first use.
def local_shard(t):
    """A DTensor's local tensor (this rank's shard of it); any other tensor, itself.

    Imports nothing: a DTensor exists only once its module is loaded.
    """
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(t, module.DTensor):
        return t._local_tensor
    return t


def pipeline_stage_class():
    """``torch.distributed.pipelining``'s ``PipelineStage``, if that module is
    loaded (importing it costs seconds: a logical world does not), else None."""
    module = sys.modules.get("torch.distributed.pipelining.stage")
    return getattr(module, "PipelineStage", None)


def pipeline_needs_dynamic(stage, has_backward: bool) -> bool:
    """Whether a ``PipelineStage`` votes to infer its metadata (its own
    declared metadata is incomplete): the vote ``_warmup_forward_vote`` casts."""
    from torch.distributed.pipelining._utils import InferenceMode

    return InferenceMode.needs_dynamic(stage._user_meta, has_backward)


def pipeline_schedules_module():
    """``torch.distributed.pipelining.schedules`` (whose ``_batch_p2p`` issues a schedule's messages), if loaded."""
    return sys.modules.get("torch.distributed.pipelining.schedules")


def pipeline_schedule_class():
    """``torch.distributed.pipelining``'s schedule base class, if loaded, else None."""
    module = sys.modules.get("torch.distributed.pipelining.schedules")
    return getattr(module, "_PipelineSchedule", None)


def pipeline_vote(stages: list, has_backward: bool) -> bool:
    """The stages' warm-up vote as a real run over gloo or NCCL runs it (torch
    2.14 skips it over the fake backend, and a logical world's trace must
    hold the real run's messages); each stage's mode from the result.
    False (nothing done) where a stage is not a ``PipelineStage``."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.stage import PipelineStage

    if not all(isinstance(stage, PipelineStage) for stage in stages):
        return False
    acc = None
    for stage in stages:
        acc = stage._warmup_forward_vote(has_backward, received_acc=acc)
    result = acc
    for stage in reversed(stages):
        result = stage._warmup_backward_result(received_result=result)
        stage._inference_mode = InferenceMode.STATIC if result.item() == 1 else InferenceMode.DYNAMIC
    return True


def dtensor_decomp_strategy_class():
    """DTensor's sharding propagation through an op's decomposition (None where torch has none)."""
    try:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy
    except ImportError:
        return None
    return DecompShardingStrategy


def dtensor_class():
    from torch.distributed.tensor import DTensor

    return DTensor


def tensor_experimental_module():
    from torch.distributed.tensor import experimental

    return experimental


def context_parallel_module():
    """``context_parallel``'s ring attention module, whose entry points world/context_parallel.py guards."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def context_parallel_variant():
    """What ``context_parallel`` is set to run now, as world/context_parallel.py reads it: its rotate
    method's name, ``convert_to_f32``, ``enable_load_balance``, and whether the monkey-patching API
    (not the module wrapper) dispatches it."""
    cp = context_parallel_module()
    options = cp._cp_options
    return (
        options.rotate_method.name,
        options.convert_to_f32,
        options.enable_load_balance,
        cp._dispatch_mode == cp._DispatchMode.MONKEY_PATCH,
    )


def context_parallel_class():
    """``context_parallel``'s ``_ContextParallel`` (its ``flex_input_fn`` is refused)."""
    return context_parallel_module()._ContextParallel
