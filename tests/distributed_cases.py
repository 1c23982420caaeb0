"""Distributed training steps run twice: for real over ``gloo`` and traced.

Each case builds its model, wraps it and takes one optimizer step inside
the function, so a real run under ``md.LiveStorages`` and a trace see the
same storages from the start.  ``real_rank`` is what each spawned process
runs; it writes its peak and its collectives where the parent reads them.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import metadispatch as md
from metadispatch.cli.llama import Llama, LlamaConfig
from tests.eager_ops import EagerOps

BATCH, SEQ = 2, 16


# vocab and hidden sizes that 4 ranks shard unevenly (18, 18, 18, 16 rows; 14 each)
CONFIG = LlamaConfig(vocab_size=70, dim=40, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=54)


# Where a real run measures what lives by category (real_rank sets it): called
# with the model and its optimizer once backward is done and once the step is.
PROBES: list = []


def _step(model: torch.nn.Module, foreach: bool, loss=lambda model, ids: model(ids, ids)) -> torch.nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    loss(model, ids).backward()
    _optimizer_step(model, opt)
    return model


def _optimizer_step(model: torch.nn.Module, opt) -> None:
    """``opt.step()`` and ``zero_grad()``, the probes called after backward and after the step."""
    for probe in PROBES:
        probe("backward", model, opt)
    opt.step()
    opt.zero_grad()
    for probe in PROBES:
        probe("step", model, opt)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their local shards)."""
    seen: dict = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def categories(when: str, model: torch.nn.Module, opt) -> dict:
    """What a real run holds by category: parameters and gradients after
    backward, parameters and optimizer state after the step."""
    params = _storage_bytes(model.parameters())
    if when == "backward":
        return {"params": params, "grads": _storage_bytes(p.grad for p in model.parameters())}
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"params": params, "optimizer state": _storage_bytes(state)}


def traced_categories(trace, device: str | None = None) -> dict:
    """The same figures from a trace: live at its first optimizer call (after
    backward, gradients in place) and after its last call (the step's end);
    ``device``: on that device only (``md.memory(trace, device=)``)."""
    m = md.memory(trace, device=device)
    first = next(i for i, c in enumerate(trace.calls) if c.phase == "optimizer")
    return {
        "backward": {c: m.by_category_timeline[c][first] for c in ("params", "grads")},
        "step": {c: m.by_category_timeline[c][-1] for c in ("params", "optimizer state")},
    }


def fsdp_step(foreach: bool, reshard: bool = True) -> torch.nn.Module:
    """FSDP2 on a tiny LLaMA (one unit per block, plus the root), one AdamW step."""
    model = Llama(CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    return _step(model, foreach)


def _tensor_parallel(model: torch.nn.Module, mesh) -> None:
    """Attention and MLP of every block colwise then rowwise over ``mesh``."""
    plan = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, mesh, plan)
        block.attn.n_heads //= mesh.size()  # each rank runs its own heads
        block.attn.n_kv //= mesh.size()


def tp_step(foreach: bool) -> torch.nn.Module:
    """Tensor parallelism in every block, one AdamW step."""
    model = Llama(CONFIG)
    _tensor_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    return _step(model, foreach)


def fsdp_tp_step(foreach: bool) -> torch.nn.Module:
    """2-D: tensor parallelism over pairs of ranks, FSDP2 across the pairs."""
    model = Llama(CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    _tensor_parallel(model, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return _step(model, foreach)


def fsdp_policy_step(mp: MixedPrecisionPolicy | None = None, offload: CPUOffloadPolicy | None = None):
    """FSDP2 with a mixed-precision or CPU-offload policy on every unit, one AdamW step."""
    model = Llama(CONFIG)
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    policies: dict = {"mp_policy": mp or MixedPrecisionPolicy()}
    if offload is not None:
        policies["offload_policy"] = offload
    for block in model.layers:
        fully_shard(block, mesh=mesh, **policies)
    fully_shard(model, mesh=mesh, **policies)
    return _step(model, foreach=False)


def ddp_step(foreach: bool) -> torch.nn.Module:
    """DistributedDataParallel (gradients all-reduced in buckets), one AdamW step."""
    model = DistributedDataParallel(Llama(CONFIG), bucket_cap_mb=0.02)  # a few buckets
    _step(model, foreach)
    return model.module


def fsdp_default_mesh_step() -> torch.nn.Module:
    """FSDP2 with no mesh given (the default one, on the build's accelerator)."""
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return _step(model, foreach=True)


def tp_mlp_step(foreach: bool) -> torch.nn.Module:
    """An MLP colwise then rowwise, every parameter a DTensor, one AdamW step.

    (AdamW ``foreach`` over a model only partly parallelised -- the LLaMA's
    norms and embedding stay plain tensors -- fails in torch itself, "got
    mixed torch.Tensor and DTensor", and so does its trace.)
    """
    model = torch.nn.Sequential(
        torch.nn.Linear(CONFIG.vocab_size, CONFIG.hidden_dim), torch.nn.GELU(), torch.nn.Linear(CONFIG.hidden_dim, 8)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    one_hot = torch.nn.functional.one_hot
    return _step(model, foreach, loss=lambda model, ids: model(one_hot(ids, CONFIG.vocab_size).float()).sum())


MICRO = 4  # micro-batches of BATCH rows each


def pipeline_step(schedule: str) -> torch.nn.Module:
    """Pipeline parallelism: one stage per rank (an MLP, the last one wider),
    ``MICRO`` micro-batches under ``schedule`` ("gpipe" or "1f1b"), one AdamW step.

    The stages declare their activations (``input_args``, ``output_args``):
    Note [A pipeline stage's vote] in world/pipeline.py.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dim, wide = CONFIG.dim, CONFIG.hidden_dim * (2 if rank == world - 1 else 1)
    stage_mod = torch.nn.Sequential(torch.nn.Linear(dim, wide), torch.nn.GELU(), torch.nn.Linear(wide, dim))
    x = torch.empty(BATCH, dim)
    stage = PipelineStage(
        stage_mod,
        rank,
        world,
        torch.device("cpu"),
        input_args=(x.requires_grad_(rank > 0),),
        output_args=(torch.empty(BATCH, dim, requires_grad=True),),
    )
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    run = kind(stage, n_microbatches=MICRO, loss_fn=lambda out, target: (out - target).pow(2).mean())
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3, foreach=False)
    data = torch.randn(BATCH * MICRO, dim)
    if rank == 0:
        run.step(data)
    elif rank == world - 1:
        run.step(target=torch.randn(BATCH * MICRO, dim), losses=[])
    else:
        run.step()
    _optimizer_step(stage_mod, opt)
    return stage_mod


# Multi-stage schedules: the class, and the stages rank r of p holds (of 2p).
# Interleaved ones loop (r, r + p); V-shaped ones fold back (r, 2p - 1 - r).
MULTI = {
    "interleaved": (ScheduleInterleaved1F1B, lambda r, p: (r, r + p)),
    "interleaved-zb": (ScheduleInterleavedZeroBubble, lambda r, p: (r, r + p)),
    "zbv": (ScheduleZBVZeroBubble, lambda r, p: (r, 2 * p - 1 - r)),
    "dualpipev": (ScheduleDualPipeV, lambda r, p: (r, 2 * p - 1 - r)),
}


def multi_stage_pipeline_step(schedule: str = "interleaved") -> torch.nn.Module:
    """Two stages per rank under a multi-stage schedule (``MULTI``):
    ``MICRO`` micro-batches, one AdamW step over both stages.

    Zero-bubble schedules split each backward into its input gradient
    (sent on at once) and its weight gradient (run later, to fill the
    bubble): torch's own ``stage_backward_input`` and ``stage_backward_weight``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    kind, placement = MULTI[schedule]
    dim = CONFIG.dim
    mods, stages = [], []
    for index in placement(rank, world):
        mod = torch.nn.Sequential(
            torch.nn.Linear(dim, CONFIG.hidden_dim), torch.nn.GELU(), torch.nn.Linear(CONFIG.hidden_dim, dim)
        )
        x = torch.empty(BATCH, dim, requires_grad=index > 0)
        out = torch.empty(BATCH, dim, requires_grad=True)
        stages.append(PipelineStage(mod, index, 2 * world, torch.device("cpu"), input_args=(x,), output_args=(out,)))
        mods.append(mod)
    model = torch.nn.ModuleList(mods)
    run = kind(stages, n_microbatches=MICRO, loss_fn=lambda out, target: (out - target).pow(2).mean())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    data, target = torch.randn(BATCH * MICRO, dim), torch.randn(BATCH * MICRO, dim)
    first, last = (s.is_first for s in stages), (s.is_last for s in stages)
    args = (data,) if any(first) else ()
    kwargs = {"target": target, "losses": []} if any(last) else {}
    run.step(*args, **kwargs)
    _optimizer_step(model, opt)
    return model


def three_d_step() -> torch.nn.Module:
    """3-D: a pipeline of 2 stages, each an MLP split colwise then rowwise
    over pairs of ranks (TP) and sharded by FSDP2 across the rest (DP), on
    one ``(pp, dp, tp)`` mesh; ``MICRO`` micro-batches of 1F1B, one AdamW step."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("pp", "dp", "tp"))
    index, dim = mesh.get_local_rank("pp"), CONFIG.dim
    mod = torch.nn.Sequential(
        torch.nn.Linear(dim, CONFIG.hidden_dim), torch.nn.GELU(), torch.nn.Linear(CONFIG.hidden_dim, dim)
    )
    parallelize_module(mod, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(mod, mesh=mesh["dp"])
    stage = PipelineStage(
        mod,
        index,
        2,
        torch.device("cpu"),
        input_args=(torch.empty(BATCH, dim, requires_grad=index > 0),),
        output_args=(torch.empty(BATCH, dim, requires_grad=True),),
        group=mesh["pp"].get_group(),
    )
    run = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=lambda out, target: (out - target).pow(2).mean())
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3, foreach=False)
    data, target = torch.randn(BATCH * MICRO, dim), torch.randn(BATCH * MICRO, dim)
    if index == 0:
        run.step(data)
    else:
        run.step(target=target, losses=[])
    _optimizer_step(mod, opt)
    return mod


class CapacityMoE(torch.nn.Module):
    """An expert-parallel MoE layer as GShard and DeepSpeed-MoE write it: top-1
    routing into a fixed capacity per expert, the ``[experts, capacity, dim]``
    buffer dispatched by an all-to-all, each rank's experts run on what it
    receives, and an all-to-all combines.  Buffer sizes follow from the
    capacity factor, whatever the routing (tokens past capacity are dropped)."""

    def __init__(self, dim: int, hidden: int, experts: int, capacity_factor: float = 1.25) -> None:
        super().__init__()
        self.world = dist.get_world_size()
        self.n_experts, self.factor = experts, capacity_factor
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        local = experts // self.world
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
            for _ in range(local)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        tokens, dim = x.shape
        e, world = self.n_experts, self.world
        capacity = int(self.factor * tokens / e + 0.999999)
        probs = self.gate(x).softmax(-1)
        top = probs.argmax(-1)
        mask = torch.nn.functional.one_hot(top, e)
        slot = (mask.cumsum(0) - 1) * mask  # each token's place in its expert's queue
        kept = mask * (slot < capacity)
        dispatch = torch.nn.functional.one_hot(slot.clamp(max=capacity - 1), capacity) * kept.unsqueeze(
            -1
        )  # [tokens, e, capacity]
        sent = torch.einsum("tec,td->ecd", dispatch.to(x.dtype), x).reshape(e * capacity, dim)
        group = dist.group.WORLD
        got = all_to_all_single_autograd(sent, None, None, group).reshape(world, len(self.experts), capacity, dim)
        out = torch.stack([expert(got[:, i]) for i, expert in enumerate(self.experts)], dim=1)
        back = all_to_all_single_autograd(out.reshape(e * capacity, dim), None, None, group).reshape(e, capacity, dim)
        weights = dispatch.to(x.dtype) * (probs * kept).unsqueeze(-1)
        return torch.einsum("tec,ecd->td", weights, back)


def moe_step() -> torch.nn.Module:
    """An expert-parallel MoE layer (2 experts a rank), one AdamW step."""
    model = CapacityMoE(CONFIG.dim, CONFIG.hidden_dim, experts=2 * dist.get_world_size())
    return _step(
        model, foreach=False, loss=lambda model, ids: model(torch.randn(BATCH * SEQ, CONFIG.dim)).pow(2).mean()
    )


def inflight_step() -> torch.nn.Module:
    """Functional collectives whose buffers outlive the program's references (Note [A collective's
    buffers live until its wait] in world/inflight.py): an all-gather whose input the program drops
    at once, waited on after a temporary larger than the model, and an all-reduce never waited on;
    then a linear layer's SGD step."""
    group = dist.group.WORLD
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gathered = funcol.all_gather_tensor(torch.ones(1024) * 2, 0, group)
    funcol.all_reduce(torch.ones(512) * 3, "sum", group)
    scale = torch.randn(4096).abs().mean()  # allocated while both are in flight: the peak
    y = model(torch.randn(4, 16)) * (gathered.sum() * scale)  # the sum waits on the all-gather
    y.pow(2).mean().backward()
    _optimizer_step(model, opt)
    return model


def hsdp_step() -> torch.nn.Module:
    """HSDP: FSDP2 on a 2-D mesh, sharded within pairs of ranks and replicated across them."""
    model = Llama(CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _step(model, foreach=False)


def tiny_gpt2():
    """(model, inputs): a transformers GPT-2 of two blocks in ``transformer.h``, for the command line."""
    import transformers  # only the cases that build it need it

    config = transformers.GPT2Config(vocab_size=CONFIG.vocab_size, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
    return transformers.GPT2LMHeadModel(config), (torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ)),)


def gpt2_fsdp_step() -> torch.nn.Module:
    """The command line's ``--fsdp`` plan on GPT-2: every block of ``transformer.h`` and the root."""
    model, _ = tiny_gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return _step(model, foreach=True, loss=lambda model, ids: model(ids).logits.float().sum())


CASES = {
    "fsdp": lambda: fsdp_step(foreach=False),
    "fsdp-foreach": lambda: fsdp_step(foreach=True),
    "fsdp-no-reshard": lambda: fsdp_step(foreach=True, reshard=False),
    "tp": lambda: tp_step(foreach=False),
    "fsdp-tp": lambda: fsdp_tp_step(foreach=False),
    "ddp": lambda: ddp_step(foreach=False),
    "ddp-foreach": lambda: ddp_step(foreach=True),
    "fsdp-default-mesh": fsdp_default_mesh_step,
    "tp-mlp": lambda: tp_mlp_step(foreach=False),
    "tp-mlp-foreach": lambda: tp_mlp_step(foreach=True),
    "hsdp": hsdp_step,
    "inflight": inflight_step,
    "gpt2-fsdp": gpt2_fsdp_step,
    "pp-gpipe": lambda: pipeline_step("gpipe"),
    "pp-1f1b": lambda: pipeline_step("1f1b"),
    "pp-interleaved": multi_stage_pipeline_step,
    "pp-interleaved-zb": lambda: multi_stage_pipeline_step("interleaved-zb"),
    "pp-zbv": lambda: multi_stage_pipeline_step("zbv"),
    "pp-dualpipev": lambda: multi_stage_pipeline_step("dualpipev"),
    "ep-moe": moe_step,
    "3d": three_d_step,
    "cli-pp": lambda: cli_pipeline_step("1f1b"),
    "cli-pp-zbv": lambda: cli_pipeline_step("zbv"),
    "cli-pp-hf-llama": lambda: cli_pipeline_step("1f1b", tiny_hf_llama4),
    "cli-pp-gpt2": lambda: cli_pipeline_step("gpipe", tiny_gpt2_4),
    "cli-pp-qwen2": lambda: cli_pipeline_step("1f1b", tiny_qwen2_4),
    "cli-pp-bert": lambda: cli_pipeline_step("1f1b", tiny_bert4),
    "cli-pp-bert-lm": lambda: cli_pipeline_step("gpipe", tiny_bert_lm4),
    "cli-pp-falcon": lambda: cli_pipeline_step("1f1b", tiny_falcon4),
    "cli-pp-hf-vit": lambda: cli_pipeline_step("gpipe", tiny_hf_vit4),
    "cli-pp-opt": lambda: cli_pipeline_step("1f1b", tiny_opt4),
    "cli-pp-bloom": lambda: cli_pipeline_step("gpipe", tiny_bloom4),
    "cli-pp-gpt-neo": lambda: cli_pipeline_step("1f1b", tiny_gpt_neo4),
    "cli-pp-resnet18": lambda: cli_pipeline_step("gpipe", tiny_resnet18),
    "cli-pp-vit": lambda: cli_pipeline_step("1f1b", tiny_vit),
    "cli-pp-timm-vit": lambda: cli_pipeline_step("1f1b", tiny_timm_vit),
    "fsdp-bf16": lambda: fsdp_policy_step(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    "fsdp-offload": lambda: fsdp_policy_step(offload=CPUOffloadPolicy(pin_memory=False)),
}


def cli_pipeline_step(schedule: str, build=None) -> torch.nn.Module:
    """The command line's ``--pp 2 --pp-schedule SCHEDULE --steps 1`` on ``build`` (:func:`tiny_llama4`): the same code."""
    from metadispatch.cli.pipeline import PipelinePlan, run_stages
    from metadispatch.cli.plan import Plan

    plan = Plan(dist.get_world_size(), dist.get_rank())
    model = run_stages(plan, PipelinePlan(2, schedule), build or tiny_llama4, "cpu", steps=1)
    for probe in PROBES:  # (the CLI's optimizer is made inside its step: categories are not compared)
        probe("backward", model, None)
    return model


def tiny_llama():
    """(model, inputs) for ``metadispatch trace tests.distributed_cases:tiny_llama``."""
    model = Llama(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    return model, (ids, ids)


def local_shapes(model: torch.nn.Module) -> list:
    """This rank's shard of each parameter (uneven ranks hold fewer rows)."""
    return [list(p.to_local().shape if hasattr(p, "to_local") else p.shape) for p in model.parameters()]


def step_ops_as_real(trace, real: dict) -> bool:
    """Whether the traced step's calls are, op for op, the last ops of the real run's TorchDispatchMode log
    (``real["ops"]``): a pipeline case ends with its one step (:func:`cli_pipeline_step`)."""
    step = [c.op for c in trace.calls][trace.marks["step"] :]
    return len(step) > 0 and real["ops"][-len(step) :] == step


def comparable(calls) -> list:
    """What must agree between a real run and a trace, per collective."""
    return [(c.op, c.kind, c.tensors, c.bytes, c.sent, c.group.rank, list(c.group.ranks)) for c in calls]


def real_rank(rank: int, world_size: int, cases: list, out_dir: str) -> None:
    """Run ``cases`` one after another in this rank's process, writing ``out_dir/<case>/<rank>.json``.

    One process group serves every case: starting a process and a group
    costs more than the cases themselves, and a real job also trains in a
    process whose group outlives one model.
    """
    # A file store, not a TCP port: a free port picked by the parent can be
    # taken by another process before the children bind it.
    store = f"file://{os.path.join(out_dir, 'rendezvous')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
    try:
        for case in cases:
            torch.manual_seed(0)
            measured: dict = {}
            PROBES[:] = [lambda when, model, opt, into=measured: into.setdefault(when, categories(when, model, opt))]
            with (
                md.testing.CollectiveLog() as log,
                md.LiveStorages(count_untracked=False) as live,
                EagerOps() as ops,
            ):  # Note [Storages made out of sight]
                model = CASES[case]()
            PROBES.clear()
            result = {
                "ops": ops.ops,
                "peak": live.peak,
                "collectives": comparable(log.calls),
                "shards": local_shapes(model),
                "categories": measured,
            }
            os.makedirs(os.path.join(out_dir, case), exist_ok=True)
            with open(os.path.join(out_dir, case, f"{rank}.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def traced_rank(rank: int, world_size: int, case: str, device=None) -> tuple:
    """The trace of one rank, and its parameters' local shapes."""
    torch.manual_seed(0)
    with md.MetaMode(device=device, world_size=world_size, rank=rank) as mode:
        model = CASES[case]()
    return mode.trace, local_shapes(model)


def fsdp_shards() -> list:
    """One FSDP2 step (AdamW foreach); this rank's parameter shards after it."""
    return [p.to_local() for p in fsdp_step(foreach=True).parameters()]


def replay_rank(rank: int, world_size: int, out_dir: str) -> None:
    """Run :func:`fsdp_shards` for real over ``gloo``, then replay this rank's
    trace (``out_dir/<rank>.json.gz``) over the same group; write the replay's
    verdict and whether its shards equal the real run's, bit for bit."""
    import torch.distributed.fsdp  # noqa: F401 -- registers the fsdp ops the trace names

    allow = open(os.path.join(out_dir, "ops")).read().split()
    trace = md.Trace.load(os.path.join(out_dir, f"{rank}.json.gz"), allow_ops=allow)
    store = f"file://{os.path.join(out_dir, 'rendezvous')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        real = [t.detach() for t in fsdp_shards()]
        r = md.replay(trace)
        result = {
            "ok": r.ok,
            "mismatches": [str(m) for m in r.mismatches],
            "made_up": [str(m) for m in r.made_up],
            "equal": [torch.equal(a, b) for a, b in zip(real, r.output)],
            "shards": len(real),
        }
        with open(os.path.join(out_dir, f"replay{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def tiny_llama4():
    """(model, inputs): the tiny LLaMA with four blocks and a batch of four, for ``trace --pp``."""
    model = Llama(dataclasses.replace(CONFIG, n_layers=4))
    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return model, (ids, ids)


def tiny_hf_llama4():
    """(model, inputs): a transformers LLaMA of four blocks (uneven GQA heads) and a batch of four, for ``trace --pp``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.dim,
        intermediate_size=CONFIG.hidden_dim,
        num_hidden_layers=4,
        num_attention_heads=CONFIG.n_heads,
        num_key_value_heads=CONFIG.n_kv_heads,
        max_position_embeddings=SEQ,
    )
    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.LlamaForCausalLM(config), (ids, ids)


def tiny_qwen2_4():
    """(model, inputs): a transformers Qwen2 of four blocks, the last two sliding-window ones, for ``trace --pp``
    (split as LLaMA is: pipeline/split.py)."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.dim,
        intermediate_size=CONFIG.hidden_dim,
        num_hidden_layers=4,
        num_attention_heads=CONFIG.n_heads,
        num_key_value_heads=CONFIG.n_kv_heads,
        max_position_embeddings=SEQ,
        use_sliding_window=True,
        sliding_window=SEQ // 2,
        max_window_layers=2,
    )
    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.Qwen2ForCausalLM(config), (ids, ids)


def tiny_gpt2_4():
    """(model, inputs): a transformers GPT-2 of four blocks (tied embeddings) and a batch of four, for ``trace --pp``."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=CONFIG.vocab_size, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config), (torch.randint(0, CONFIG.vocab_size, (4, SEQ)),)


def _bert4_config():
    import transformers

    return transformers.BertConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
    )


def tiny_bert4():
    """(model, inputs): a transformers BertModel (an encoder) of four blocks and a batch of four, for ``trace --pp``."""
    import transformers

    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.BertModel(_bert4_config()), (ids,)


def tiny_falcon4():
    """(model, inputs): a transformers Falcon of four blocks (rotary, its head tied to the word embeddings, blocks
    that return tuples), for ``trace --pp`` (pipeline/decoders.py), and token ids that are their own labels."""
    import transformers

    config = transformers.FalconConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.dim,
        num_hidden_layers=4,
        num_attention_heads=CONFIG.n_heads,
        max_position_embeddings=SEQ,
    )
    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.FalconForCausalLM(config), (ids, ids)


def tiny_hf_vit4():
    """(model, inputs): a transformers ViTForImageClassification of four blocks on four 32x32 images and their
    labels, for ``trace --pp`` (pipeline/families.py: its loss the model's own)."""
    import transformers

    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4
    )
    return transformers.ViTForImageClassification(config), (torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 1, 0]))


def tiny_opt4():
    """(model, inputs): a transformers OPT of four blocks shaped as OPT-350m (projected embeddings, no final
    norm), for ``trace --pp`` (pipeline/decoders.py), and token ids that are their own labels."""
    import transformers

    config = transformers.OPTConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.dim,
        ffn_dim=CONFIG.hidden_dim,
        num_hidden_layers=4,
        num_attention_heads=CONFIG.n_heads,
        max_position_embeddings=SEQ,
        word_embed_proj_dim=CONFIG.dim // 2,
        do_layer_norm_before=False,
    )
    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.OPTForCausalLM(config), (ids, ids)


def tiny_bloom4():
    """(model, inputs): a transformers BLOOM of four blocks (ALiBi, tied embeddings), for ``trace --pp``
    (pipeline/decoders.py), and token ids that are their own labels."""
    import transformers

    config = transformers.BloomConfig(
        vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.dim, n_layer=4, n_head=CONFIG.n_heads
    )
    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.BloomForCausalLM(config), (ids, ids)


def tiny_gpt_neo4():
    """(model, inputs): a transformers GPT-Neo of four blocks, global and local ones (a window shorter than the
    sequence), for ``trace --pp`` (pipeline/decoders.py), and token ids that are their own labels."""
    import transformers

    config = transformers.GPTNeoConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.dim,
        num_layers=4,
        num_heads=CONFIG.n_heads,
        attention_types=[[["global", "local"], 2]],
        window_size=SEQ // 2,
        max_position_embeddings=SEQ,
    )
    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.GPTNeoForCausalLM(config), (ids, ids)


def tiny_bert_lm4():
    """(model, inputs): what ``--hf bert`` builds, a transformers BertLMHeadModel (the encoder under an LM head,
    its decoder tied to the word embeddings) of four blocks, and token ids that are their own labels."""
    import transformers

    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.BertLMHeadModel(_bert4_config()), (ids, ids)


def tiny_resnet18():
    """(model, inputs): torchvision's resnet18 (ten classes) on four 64x64 images, for ``trace --pp``:
    its stages' feature maps differ in shape (pipeline/families.py)."""
    import torchvision

    return torchvision.models.resnet18(num_classes=10), (torch.randn(4, 3, 64, 64),)


def tiny_vit():
    """(model, inputs): a torchvision VisionTransformer of four blocks on four 32x32 images, for ``trace --pp``."""
    import torchvision

    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=4, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    return model, (torch.randn(4, 3, 32, 32),)


def tiny_t5():
    """(model, inputs): a transformers T5 (an encoder-decoder, which ``trace --pp`` refuses)."""
    import transformers

    config = transformers.T5Config(
        vocab_size=CONFIG.vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    ids = torch.randint(0, CONFIG.vocab_size, (4, SEQ))
    return transformers.T5ForConditionalGeneration(config), (ids, ids)


def tiny_timm_vit():
    """(model, inputs): a timm VisionTransformer (a register token) of four blocks on four 32x32 images."""
    import timm

    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=4, num_classes=10, reg_tokens=1
    )
    return model, (torch.randn(4, 3, 32, 32),)
