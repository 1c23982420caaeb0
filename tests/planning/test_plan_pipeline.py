"""md.plan's pipeline candidates (``search={"pp": [2]}``) against direct traces of each stage's rank,
written here with torch's own APIs (Note [Scoring a pipeline configuration])."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import metadispatch as md
from metadispatch.ir.cut import step_from

transformers = pytest.importorskip("transformers")
pipelining = pytest.importorskip("torch.distributed.pipelining")

from tests.planning.test_plan import BATCH, CONFIG, GPUS, SEQ, make_model  # noqa: E402

SEARCH = {"micro_batch": [2], "optimizer": ["foreach"], "tp": [1], "pp": [2], "pp_schedule": ["1f1b", "gpipe"]}


class Stage(torch.nn.Module):
    """Half of a transformers LLaMA, as a script writes a stage: embedding first, norm and head last."""

    def __init__(self, model, index: int) -> None:
        super().__init__()
        half = len(model.model.layers) // 2
        self.config, self.index = model.config, index
        self.embed = model.model.embed_tokens if index == 0 else None
        self.rotary = model.model.rotary_emb
        self.layers = torch.nn.ModuleList(model.model.layers[half * index : half * (index + 1)])
        self.norm, self.head = (model.model.norm, model.lm_head) if index == 1 else (None, None)

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask

        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
        )
        rope = self.rotary(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        return self.head(self.norm(h)) if self.head is not None else h


def loss_fn(logits, labels):
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(), ignore_index=-100)


def direct(c: dict, rank: int):
    """``rank``'s second step of the pipeline configuration ``c``, in md.tracer(world_size=4)."""

    def run():
        mesh = init_device_mesh("cuda", (2, c["replicate"], c["shard"]), mesh_dim_names=("pp", "replicate", "shard"))
        index = mesh.get_local_rank("pp")
        mod = Stage(make_model(), index)
        if c["ac"] == "block":
            md.apply_ac(mod, [f"layers.{i}" for i in range(len(mod.layers))])
        dp = mesh["replicate", "shard"] if c["replicate"] > 1 else mesh["shard"]
        for layer in mod.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(mod, mesh=dp)
        b, h = c["micro_batch"], CONFIG.hidden_size
        x = torch.empty(b, SEQ, dtype=torch.long) if index == 0 else torch.empty(b, SEQ, h, requires_grad=True)
        out = torch.empty(b, SEQ, CONFIG.vocab_size if index else h, requires_grad=True)
        stage = pipelining.PipelineStage(
            mod, index, 2, torch.device("cuda"), input_args=(x,), output_args=(out,), group=mesh["pp"].get_group()
        )
        del x, out  # the declared shapes: the stage keeps only their metadata
        kind = pipelining.Schedule1F1B if c["pp_schedule"] == "1f1b" else pipelining.ScheduleGPipe
        schedule = kind(stage, n_microbatches=c["accum"], loss_fn=loss_fn)
        opt = torch.optim.AdamW(mod.parameters(), lr=1e-4, foreach=True)
        ids = torch.randint(0, CONFIG.vocab_size, (b * c["accum"], SEQ), device="cuda")
        for _ in range(2):
            md.mark("step")
            schedule.step(*((ids,) if index == 0 else ()), **({"target": ids, "losses": []} if index else {}))
            opt.step()
            opt.zero_grad()

    return md.tracer(world_size=GPUS, rank=rank, device="cuda", gpu="h100")(run)


@pytest.fixture(scope="module")
def table():
    return md.plan(make_model, gpus=GPUS, gpu="h100", global_batch=BATCH, seq=SEQ, search=SEARCH)


def test_plan_pipeline_every_candidates_per_rank_peak_equals_a_direct_trace(table):
    piped = [c for c in table if c.config.get("pp") == 2]
    assert len(piped) == 8 and all(c.fits for c in piped)  # shard 1 and 2, AC none and block, two schedules
    for c in piped:
        assert sorted(c.ranks) == [0, 2]  # each stage's first rank
        for rank, peak in c.ranks.items():
            t = direct(c.config, rank)
            assert abs(peak - md.memory(t, since="step").peak) <= 1024, (c.config, rank)
        assert c.peak == max(c.ranks.values())


def test_plan_pipeline_step_time_is_the_stages_run_against_each_other(table):
    c = next(c for c in table if c.config.get("pp") == 2 and c.config["ac"] == "none")
    traces = [step_from(t, t.marks["step"]) for t in (direct(c.config, r) for r in (0, 2))]
    assert c.step_time == pytest.approx(md.runtime(traces, gpu="h100").total)
    assert "pp 2" in str(table)
    retraced = c.retrace()  # the worst stage's rank, afresh
    assert retraced.world[1] == max(c.ranks, key=c.ranks.get)
    assert abs(md.memory(retraced, since="step").peak - c.peak) <= 1024


def test_plan_pipeline_names_the_rule_a_configuration_breaks():
    table = md.plan(make_model, gpus=GPUS, global_batch=BATCH, seq=SEQ, search={**SEARCH, "pp": [3]})
    piped = [c for c in table if c.config.get("pp") == 3]
    assert piped and all(c.why == "pp 3 x tp 1 does not divide 4 GPUs" for c in piped)
