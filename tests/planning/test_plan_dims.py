"""md.plan's sequence, context and expert parallelism (``search={"sp": ..., "cp": ..., "ep": ...}``) against
direct traces of each configuration, written here with torch's own APIs (planning/parallel_dims.py)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import metadispatch as md
from metadispatch.world.expert_parallel import expert_parallel

transformers = pytest.importorskip("transformers")

from tests.planning.test_plan import BATCH, GPUS, SEQ, make_model, make_moe  # noqa: E402

BASE = {"micro_batch": [2], "optimizer": ["foreach"], "ac": ["none"]}


def make_bf16():  # CP's ring handles the flash/cuDNN kernels an H100 picks for bf16, not f32's math fallback
    return make_model().to(torch.bfloat16)


def sp_layer(layer, mesh, first: bool, last: bool) -> None:
    """torchtitan's SP plan for one LLaMA block, written out; the residual stream sharded on the sequence."""
    rows = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    plan = {
        "input_layernorm": SequenceParallel(),
        "post_attention_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
        "self_attn.o_proj": rows,
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": rows,
    }
    parallelize_module(layer, mesh, plan)
    if first:
        parallelize_module(
            layer,
            mesh,
            PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False),
        )
    if last:
        parallelize_module(
            layer, mesh, PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
        )


def direct(c: dict, make, tp_layer=None):
    """Rank 0's second step of ``c`` in md.tracer(world_size=4), every micro-batch run; ``tp_layer(layer,
    tp_mesh, first, last)`` puts each block on the TP mesh where given.  With ep, the experts spread over
    ``ep`` of the shard x cp ranks, FSDP2 over the rest (torchtitan's EP borrows from dp_shard x cp)."""
    r, s, tp, cp, ep = c["replicate"], c["shard"], c["tp"], c["cp"], c["ep"]

    def run():
        model = make()
        layers = model.model.layers
        if c["ac"] == "block":
            md.apply_ac(model, [f"model.layers.{i}" for i in range(len(layers))])
        mesh = init_device_mesh("cuda", (r, s * cp, tp), mesh_dim_names=("r", "s", "tp"))
        cp_mesh = (
            init_device_mesh("cuda", (r, s, cp, tp), mesh_dim_names=("r", "s", "cp", "tp"))["cp"] if cp > 1 else None
        )
        if tp_layer is not None:
            for i, layer in enumerate(layers):
                tp_layer(layer, mesh["tp"], i == 0, i == len(layers) - 1)
        if ep > 1:
            em = init_device_mesh("cuda", (r, s * cp // ep, ep, tp), mesh_dim_names=("r", "s", "ep", "tp"))
            for layer in layers:
                expert_parallel(layer.mlp.experts, em["ep"])
                fully_shard(layer.mlp.experts, mesh=em["r", "s"] if r > 1 else em["s"])
                layer.mlp.experts.set_gradient_divide_factor(float(r * s * cp))  # torchtitan's: over all dp
        dp = mesh["r", "s"] if r > 1 else mesh["s"]
        for layer in layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        for _ in range(2):
            md.mark("step")
            for _ in range(c["accum"]):
                ids = torch.randint(0, model.config.vocab_size, (c["micro_batch"], SEQ), device="cuda")
                if cp_mesh is None:
                    model(ids, labels=ids).loss.backward()
                else:
                    with context_parallel(cp_mesh, buffers=[ids], buffer_seq_dims=[1]):
                        model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    routing = md.RoutingAssumption("uniform") if ep > 1 else None
    return md.tracer(world_size=GPUS, rank=0, device="cuda", gpu="h100", assume=routing)(run)


def check_against_direct(table, make, count: int) -> list:
    scored = [c for c in table if c.peak is not None]
    assert len(scored) == count, [c.why for c in table]
    for c in scored:
        t = direct(c.config, make, sp_layer if c.config["sp"] else None)
        assert abs(c.peak - md.memory(t, since="step").peak) <= 1024, c.config
        assert c.reserved_peak == md.fits(t, since="step").reserved_peak, c.config
        assert c.fits == md.fits(t, since="step").fits, c.config
    return scored


def test_plan_sequence_parallel_candidates_peak_as_a_direct_trace_and_reduce_scatter_over_tp():
    search = {**BASE, "tp": [2], "shard": [2], "sp": [False, True], "ac": ["none", "block"]}
    table = md.plan(make_model, gpus=GPUS, global_batch=BATCH, seq=SEQ, search=search)
    assert {c.config["sp"] for c in table} == {False, True} and any(" sp " in str(c) for c in table)
    for c in check_against_direct([c for c in table if c.config["sp"]], make_model, 2):
        tp_ops = {x.op for x in md.comms(c.retrace()).calls if x.group.size == 2 and x.group.ranks == (0, 1)}
        # SP: the rowwise projections reduce-scatter to the sequence, the colwise inputs all-gather it
        assert any("reduce_scatter" in op for op in tp_ops) and any("all_gather" in op for op in tp_ops), tp_ops


def test_plan_context_parallel_candidates_peak_as_a_direct_trace_and_run_the_ring():
    search = {**BASE, "tp": [1], "cp": [2], "shard": [1, 2]}
    table = md.plan(make_bf16, gpus=GPUS, global_batch=BATCH // 2, seq=SEQ, search=search)
    check_against_direct(table, make_bf16, 2)
    t = table.best.retrace()
    assert md.fits(t, since="step").reserved_peak == table.best.reserved_peak
    # the K/V shards passed round the ring (all_to_all_single) and FSDP2 over shard x cp ranks
    assert any("all_to_all_single" in x.op for x in md.comms(t).calls)
    assert table.best.config["cp"] == 2 and "cp 2" in str(table.best)


def test_plan_context_parallel_refuses_a_sequence_the_load_balanced_ring_cannot_split():
    table = md.plan(make_bf16, gpus=GPUS, global_batch=BATCH, seq=12, search={**BASE, "tp": [1], "cp": [4]})
    assert table and all(
        c.why == "cp 4 needs seq 12 divisible by 2 x cp = 8 (load-balanced ring attention)" for c in table
    )
    odd = md.plan(make_bf16, gpus=GPUS, global_batch=BATCH, seq=SEQ, search={**BASE, "tp": [2], "cp": [3]})
    assert all(c.why == "tp 2 x cp 3 does not divide 4 GPUs" for c in odd)


def test_plan_expert_parallel_candidates_peak_as_a_direct_trace_under_a_uniform_routing():
    search = {**BASE, "tp": [1], "ep": [2, 3, 4], "shard": [2, 4]}
    table = md.plan(make_moe, gpus=GPUS, global_batch=BATCH, seq=SEQ, search=search)
    whys = {(c.config["ep"], c.config["shard"]): c.why for c in table}
    assert whys[(3, 2)] == whys[(3, 4)] == "ep 3 does not divide num_experts=4"
    assert whys[(4, 2)] == "ep 4 does not divide shard 2 (EP borrows FSDP2's shard ranks)"
    scored = check_against_direct(table, make_moe, 3)  # (ep, shard): (2, 2), (2, 4), (4, 4)
    t = scored[0].retrace()
    assert md.fits(t, since="step").reserved_peak == scored[0].reserved_peak
    tolist = [a for a in t.assumptions if a.op == "Tensor.tolist"]
    assert tolist and all("RoutingAssumption('uniform')" in a.basis for a in tolist)
    experts = next(call for call in t.calls if "grouped_mm" in call.op)
    assert experts.module.endswith("mlp.experts")
    for c in scored:  # the experts' gradients are divided by all 4 dp ranks, as torchtitan sets it, not by edp
        calls = [call for call in c.retrace().calls if call.phase == "backward" and call.module.endswith("mlp.experts")]
        edp = c.config["shard"] // c.config["ep"]
        if edp == 1:  # FSDP2 on one rank divides the reduce's input itself
            assert {call.args[1] for call in calls if call.op == "aten.div.Tensor"} == {4.0}, c.config
        else:  # 1/4 before the sum over edp (FSDP2's default would be AVG over edp: ep times too large)
            ops = {
                a for call in calls if "reduce_scatter" in call.op for a in call.args if str(a).startswith("<reduce")
            }
            assert ops == {"<reduce op PREMUL_SUM>"}, (c.config, ops)


def test_plan_expert_parallel_is_refused_for_a_dense_model():
    # with tp (and sp): tests/planning/test_plan_dims_ep_tp.py
    table = md.plan(
        make_model, gpus=GPUS, global_batch=BATCH, seq=SEQ, search={**BASE, "tp": [1], "ep": [2], "shard": [2]}
    )
    assert all(c.why == "ep 2: the model has no fused MoE experts" for c in table)


def make_deep_bf16(layers=6):
    config = transformers.LlamaConfig(**{**make_model().config.to_dict(), "num_hidden_layers": layers})
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def test_plan_scaled_keeps_each_cp_meshs_optimizer_step_its_own():
    # Note [One optimizer step per mesh]: cp 2 shards the optimizer state over shard x cp, so its fused step is
    # traced for it, not borrowed from cp 1's; scaled times and state against full traces
    search = {**BASE, "tp": [1], "cp": [1, 2], "shard": [1], "micro_batch": [1], "optimizer": ["foreach", "fused"]}
    full = md.plan(make_deep_bf16, gpus=GPUS, global_batch=4, seq=SEQ, search=search)
    scaled = md.plan(make_deep_bf16, gpus=GPUS, global_batch=4, seq=SEQ, search=search, scale=(1, 2), confirm=1)
    by_config = {str(c.config): c for c in full}
    assert len(by_config) == 4 and all(c.step_time for c in full)
    for c in scaled:
        f = by_config[str(c.config)]
        assert c.step_time == pytest.approx(f.step_time, rel=1e-9), c.config
        assert abs(c.state - f.state) <= 1024, c.config
