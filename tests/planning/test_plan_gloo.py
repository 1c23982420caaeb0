"""md.plan's chosen configurations, run for real over 4 ``gloo`` processes.

``md.plan`` scores each configuration on logical GPUs, and
tests/planning/test_plan.py holds every candidate's peak to a direct
``md.tracer(world_size=4, device="cuda")`` trace of it.  Here the chosen
configuration (and the fastest one with tensor parallelism) is written
out with torch's own APIs and run as a real 4-process job on the CPU
(``gloo``, as tests/world/test_distributed.py runs its patterns), and
every rank of the same configuration traced on a logical CPU world must
peak within 1 KiB of that rank's real steady-state step: the second step,
counted from its start with the first step's optimizer state alive, as
``md.memory(trace, since="step")`` counts it.  (A logical GPU's kernels --
its SDPA backend, cuBLAS's workspace -- are not a CPU's, so the logical GPU's
figure is not the CPU job's.  What ties the program written here to
md.plan's own (planning/programs.py) is that on the logical H100 it peaks
as md.plan scored it, within 1 KiB.)
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import metadispatch as md
from tests.world.test_distributed import _start

transformers = pytest.importorskip("transformers")

GPUS, BATCH, SEQ = 4, 8, 16
SEARCH = {"micro_batch": [1, 2], "optimizer": ["foreach"]}
_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def make_model():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CONFIG))


def _steps(c: dict, device: str, on_step=lambda n: None) -> None:
    """Configuration ``c`` built, wrapped and stepped twice, as a script writes it."""
    model = make_model()
    if c["ac"] == "block":
        md.apply_ac(model, [f"model.layers.{i}" for i in range(len(model.model.layers))])
    mesh = init_device_mesh(device, (c["replicate"], c["shard"], c["tp"]), mesh_dim_names=("r", "s", "tp"))
    if c["tp"] > 1:
        for layer in model.model.layers:
            plan = {n: ColwiseParallel() for n in _COLWISE} | {n: RowwiseParallel() for n in _ROWWISE}
            parallelize_module(layer, mesh["tp"], plan)
    if c["replicate"] * c["shard"] > 1:
        dp = mesh["r", "s"] if c["replicate"] > 1 else mesh["s"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, _CONFIG["vocab_size"], (c["micro_batch"], SEQ), device=device)
    for n in range(2):
        on_step(n)
        for _ in range(max(c["accum"], 1)):
            model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _real_rank(rank: int, world_size: int, configs: list, out_dir: str) -> None:
    """Each configuration's real steady-state peak on this rank, written to ``out_dir/<i>/<rank>.json``."""
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world_size)
    try:
        for i, c in enumerate(configs):
            torch.manual_seed(0)
            with md.LiveStorages(count_untracked=False) as live:  # Note [Storages made out of sight]
                start: dict = {}

                def at_second_step(n, start=start, live=live):
                    if n == 1:
                        start["at"] = len(live.timeline)

                _steps(c, "cpu", at_second_step)
            peak = max(live.timeline[start["at"] - 1 :])  # live when the second step begins, and after each op
            os.makedirs(os.path.join(out_dir, str(i)), exist_ok=True)
            with open(os.path.join(out_dir, str(i), f"{rank}.json"), "w") as f:
                json.dump({"peak": peak}, f)
    finally:
        dist.destroy_process_group()


def _traced_peak(c: dict, rank: int, device: str = "cpu") -> int:
    def run():
        _steps(c, device, lambda n: md.mark("step") if n == 1 else None)

    torch.manual_seed(0)
    gpu = {"gpu": "h100"} if device == "cuda" else {}
    trace = md.tracer(device=device, world_size=GPUS, rank=rank, **gpu)(run)
    return md.memory(trace, since="step").peak


@pytest.mark.slow
def test_plan_chosen_configurations_peak_as_a_real_gloo_run_per_rank(tmp_path):
    table = md.plan(make_model, gpus=GPUS, gpu="h100", global_batch=BATCH, seq=SEQ, search=SEARCH)
    fitting = [c for c in table if c.fits]
    chosen = [table.best.config]
    with_tp = next((c.config for c in fitting if c.config["tp"] > 1), None)
    assert with_tp is not None, "the search has a fitting tensor-parallel configuration"
    chosen += [with_tp] if with_tp != chosen[0] else []
    by_config = {str(c.config): c for c in table}
    for c in chosen:  # this file's program is md.plan's: on its logical H100 it peaks as md.plan scored it
        assert abs(_traced_peak(c, 0, "cuda") - by_config[str(c)].peak) <= 1024, c
    _start(_real_rank, (GPUS, chosen, str(tmp_path)), GPUS)
    for i, c in enumerate(chosen):
        for rank in range(GPUS):
            real = json.loads((tmp_path / str(i) / f"{rank}.json").read_text())["peak"]
            assert abs(_traced_peak(c, rank) - real) <= 1024, (c, rank)
