"""md.plan's expert parallelism with tensor (and sequence) or context parallelism (planning/parallel_dims.py) against
direct traces written here with torch's own APIs: TP (SP) on the attention, the experts spread over ``ep``
shard ranks at each TP coordinate (every TP rank routes the same, whole tokens), FSDP2 on the rest."""

import functools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import metadispatch as md

transformers = pytest.importorskip("transformers")

from tests.planning.test_plan import BATCH, GPUS, SEQ, make_moe  # noqa: E402
from tests.planning.test_plan_dims import direct as dims_direct  # noqa: E402

SEARCH = {"micro_batch": [2], "optimizer": ["foreach"], "ac": ["none"], "tp": [2], "ep": [2], "shard": [2]}


def tp_layer(layer, mesh, first: bool, last: bool, sp: bool) -> None:
    """torchtitan's TP (SP) plan for a Qwen3-MoE block's attention; the MoE MLP whole (gathered in and
    scattered out with SP)."""
    rows = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()
    plan: dict = {f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"} | {"self_attn.o_proj": rows}
    if sp:
        plan |= {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "mlp": PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=False,
            ),
        }
    parallelize_module(layer, mesh, plan)
    if sp and first:
        parallelize_module(
            layer,
            mesh,
            PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False),
        )
    if sp and last:
        parallelize_module(
            layer, mesh, PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
        )


def make_bf16():  # CP's ring handles the flash/cuDNN kernels an H100 picks for bf16 (test_plan_dims.py)
    return make_moe().to(torch.bfloat16)


def direct(c: dict, make=make_moe):
    """test_plan_dims.direct with this file's TP (SP) plan for a Qwen3-MoE block."""
    return dims_direct(c, make, functools.partial(tp_layer, sp=c["sp"]) if c["tp"] > 1 else None)


def test_plan_expert_parallel_with_tp_and_sp_peaks_as_a_direct_trace():
    table = md.plan(make_moe, gpus=GPUS, global_batch=BATCH, seq=SEQ, search={**SEARCH, "sp": [False, True]})
    scored = [c for c in table if c.peak is not None]
    assert {c.config["sp"] for c in scored} == {False, True}, [c.why for c in table]
    for c in scored:
        t = direct(c.config)
        assert abs(c.peak - md.memory(t, since="step").peak) <= 1024, c.config
        assert c.reserved_peak == md.fits(t, since="step").reserved_peak, c.config
        groups = {(x.op, x.group.ranks) for x in md.comms(c.retrace()).calls if "all_to_all" in x.op}
        assert ("_c10d_functional.all_to_all_single.default", (0, 2)) in groups, groups  # EP over shard, tp 0


def test_plan_expert_parallel_with_cp_borrows_shard_x_cp_ranks_and_peaks_as_a_direct_trace():
    search = {**SEARCH, "tp": [1], "cp": [2], "shard": [1, 2]}
    table = md.plan(make_bf16, gpus=GPUS, global_batch=BATCH // 2, seq=SEQ, search=search)
    scored = [c for c in table if c.peak is not None]
    assert {c.config["shard"] for c in scored} == {1, 2}, [c.why for c in table]
    for c in scored:
        t = direct(c.config, make_bf16)
        assert abs(c.peak - md.memory(t, since="step").peak) <= 1024, c.config
        assert c.reserved_peak == md.fits(t, since="step").reserved_peak, c.config
    odd = md.plan(make_bf16, gpus=GPUS, global_batch=BATCH // 2, seq=SEQ, search={**search, "ep": [4], "shard": [1]})
    assert all(c.why == "ep 4 does not divide shard 1 x cp 2 (EP borrows FSDP2's shard ranks)" for c in odd), [
        c.why for c in odd
    ]


def test_plan_pipeline_with_sp_cp_or_ep_is_a_candidate_refused_by_name():
    # shard 3 breaks every configuration's rule but those pipeline_rule refuses first: nothing is traced
    search = {**SEARCH, "pp": [2], "sp": [False, True], "cp": [1, 2], "ep": [1, 2], "shard": [3]}
    table = md.plan(make_moe, gpus=GPUS, global_batch=BATCH, seq=SEQ, search=search)
    piped = {(c.config["sp"], c.config["cp"], c.config["ep"]): c.why for c in table if c.config.get("pp") == 2}
    assert len(piped) == 8, piped
    assert piped.pop((False, 1, 1)).startswith("shard 3 does not divide")
    assert piped[(True, 2, 2)] == (
        "sp and cp and ep with pp is not searched (the pipeline's stages are wrapped with TP and FSDP2 only)"
    )
    assert all(
        why.endswith("with pp is not searched (the pipeline's stages are wrapped with TP and FSDP2 only)")
        for why in piped.values()
    ), piped
