"""md.plan against direct traces of the configurations it ranks, written here with torch's own APIs."""

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import metadispatch as md
from metadispatch.spec import profiles

transformers = pytest.importorskip("transformers")

GPUS, BATCH, SEQ = 4, 8, 16
CONFIG = transformers.LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
SEARCH = {"micro_batch": [2], "optimizer": ["foreach"]}
# Qwen3-MoE: 4 experts, top 2, on transformers' fused experts (3-d parameters, torch._grouped_mm); its
# attention projections are Linear and split by TP, the experts stay whole on each TP rank
MOE = transformers.Qwen3MoeConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",)
MLP = ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)


def make_model():
    return transformers.LlamaForCausalLM(CONFIG)


def make_moe():
    return transformers.Qwen3MoeForCausalLM(MOE)


# what the direct traces split colwise and rowwise under TP, per model (written out, not md.plan's own)
TP_NAMES = {make_model: (ATTENTION[0] + MLP[0], ATTENTION[1] + MLP[1]), make_moe: ATTENTION}


@pytest.fixture(scope="module")
def table():
    return md.plan(make_model, gpus=GPUS, gpu="h100", global_batch=BATCH, seq=SEQ, search=SEARCH)


def direct(c: dict, gpu: str = "h100", make=make_model):
    """Rank 0's second step of ``c`` traced in md.tracer(world_size=4), every micro-batch of it run."""

    def run():
        model = make()
        if c["ac"] == "block":
            md.apply_ac(model, [f"model.layers.{i}" for i in range(len(model.model.layers))])
        mesh = init_device_mesh("cuda", (c["replicate"], c["shard"], c["tp"]), mesh_dim_names=("r", "s", "tp"))
        if c["tp"] > 1:
            cols, rows = TP_NAMES[make]
            for layer in model.model.layers:
                tp_plan = {n: ColwiseParallel() for n in cols} | {n: RowwiseParallel() for n in rows}
                parallelize_module(layer, mesh["tp"], tp_plan)
        dp = mesh["r", "s"] if c["replicate"] > 1 else mesh["s"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=c["optimizer"] == "foreach" or None)
        ids = torch.randint(0, model.config.vocab_size, (c["micro_batch"], SEQ), device="cuda")
        for _ in range(2):
            md.mark("step")
            for _ in range(c["accum"]):
                model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    return md.tracer(world_size=GPUS, rank=0, device="cuda", gpu=gpu)(run)


def test_plan_every_candidates_peak_equals_a_direct_trace_of_its_config(table):
    scored = [c for c in table if c.peak is not None]
    assert len(scored) >= 8
    for c in scored:
        t = direct(c.config)
        assert abs(c.peak - md.memory(t, since="step").peak) <= 1024, c.config
        assert c.reserved_peak == md.fits(t, since="step").reserved_peak, c.config


def test_plan_every_moe_candidates_peak_equals_a_direct_trace_of_its_config():
    # a tiny Qwen3-MoE (routing, grouped experts, their FSDP2 shards); EP is not searched (docs/plan.md)
    table = md.plan(make_moe, gpus=GPUS, gpu="h100", global_batch=BATCH, seq=SEQ, search=SEARCH)
    scored = [c for c in table if c.peak is not None]
    assert len(scored) == 10 and {c.config["tp"] for c in scored} == {1, 2}
    for c in scored:
        t = direct(c.config, make=make_moe)
        assert md.fits(t, since="step").fits == c.fits, c.config
        assert abs(c.peak - md.memory(t, since="step").peak) <= 1024, c.config
        assert c.reserved_peak == md.fits(t, since="step").reserved_peak, c.config
    moe = t.calls[next(i for i, call in enumerate(t.calls) if "grouped_mm" in call.op)]
    assert moe.module.endswith("mlp.experts")  # the experts ran, through torch._grouped_mm


def test_plan_accumulation_beyond_two_micro_batches_keeps_the_peak_of_two():
    # Note [Tracing once per shape class]: accum 8 is scored from a trace of 2.
    table = md.plan(make_model, gpus=GPUS, global_batch=32, seq=SEQ, search={**SEARCH, "tp": [1], "shard": [4]})
    c = next(c for c in table if c.config["ac"] == "none")
    assert c.config["accum"] == 4
    assert abs(c.peak - md.memory(direct(c.config), since="step").peak) <= 1024


def test_plan_ranks_what_fits_by_step_time_and_names_the_rule_a_rejected_one_breaks(table):
    fitting = [c for c in table if c.fits]
    assert fitting and table.best is fitting[0]
    assert [c.step_time for c in fitting] == sorted(c.step_time for c in fitting)
    assert table.index(fitting[-1]) < min(table.index(c) for c in table if not c.fits)
    rejected = [c for c in table if c.config["tp"] == 4]
    assert rejected and all(c.why == "tp 4 does not divide num_key_value_heads=2" for c in rejected)
    assert all(c.tokens_per_s == pytest.approx(BATCH * SEQ / c.step_time) for c in fitting)
    assert "candidates" in str(table) and "not overlapped" in str(table)


@pytest.fixture
def small_gpu():
    name = "h100-plan-test"
    profiles.register_gpu(dataclasses.replace(md.gpu_profile("h100"), name=name, memory=67 * 2**20))
    yield name
    del profiles._PROFILES[name]


def test_plan_never_reports_as_fitting_what_a_direct_trace_does_not_fit(small_gpu):
    search = {**SEARCH, "tp": [1], "micro_batch": [1, 2]}
    table = md.plan(make_model, gpus=GPUS, gpu=small_gpu, global_batch=BATCH, seq=SEQ, search=search)
    assert any(c.fits for c in table) and any(c.reserved_peak and not c.fits for c in table)
    for c in table:
        if c.reserved_peak is None:
            continue
        assert md.fits(direct(c.config, small_gpu), since="step").fits == c.fits, c.config
        if not c.fits:
            assert c.why.startswith("reserved ") and "first OOM at call" in c.why


def test_plan_retrace_returns_the_configs_trace_afresh(table):
    best = table.best
    t = best.retrace()
    assert md.fits(t, since="step").reserved_peak == best.reserved_peak
    assert {"built", "step", "micro", "opt"} <= set(t.marks)


def test_plan_refuses_a_world_of_no_gpus():
    with pytest.raises(md.MetaDispatchError, match="gpus=0"):
        md.plan(make_model, gpus=0, global_batch=BATCH, seq=SEQ)


def make_deep(layers=6):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": layers}))


TP_NAMES[make_deep] = TP_NAMES[make_model]


def test_plan_scaled_from_two_depths_times_and_peaks_exactly_and_confirms_memory_by_full_traces():
    # Note [Scaling from two depths]: 4 and 5 layers extrapolated to 6, against 6 traced; micro-batches 1 and 2
    # and AC none and block of a mesh share one build (Note [One build for the configurations of a mesh])
    search = {**SEARCH, "tp": [1, 2], "shard": [2], "micro_batch": [1, 2]}
    full = md.plan(make_deep, gpus=GPUS, global_batch=BATCH, seq=SEQ, search=search)
    scaled = md.plan(make_deep, gpus=GPUS, global_batch=BATCH, seq=SEQ, search=search, scale=(4, 5), confirm=2)
    assert scaled.spent["4 layers"][0] == scaled.spent["5 layers"][0] == 2  # tp 1 and tp 2
    assert scaled.best.config == full.best.config and not scaled.best.scaled
    confirmed = [c for c in scaled if c.fits is not None]
    unknown = [c for c in scaled if c.fits is None]
    assert len([c for c in confirmed if c.fits]) == 2 and unknown
    assert all(c.scaled and c.why.startswith("not confirmed") for c in unknown)
    by_config = {str(c.config): c for c in full}
    for c in scaled:
        f = by_config[str(c.config)]
        assert c.step_time == pytest.approx(f.step_time, rel=1e-9)
        if c.fits is not None:  # confirmed: a full trace's figures (the search in full traced them in one build)
            assert (c.reserved_peak, c.fits) == (f.reserved_peak, f.fits) and abs(c.peak - f.peak) <= 1024
        else:  # each call's line in depth, two blocks kept at each end (Note [Blocks unlike their neighbours])
            assert abs(c.peak - f.peak) <= 1024, c.config
    assert [str(c.config) for c in scaled[:2]] == [str(c.config) for c in full[:2]]
    assert "?" in str(scaled)


def test_plan_refuses_a_scale_that_is_not_two_increasing_depths():
    with pytest.raises(md.MetaDispatchError, match=r"scale=\(4, 2\)"):
        md.plan(make_deep, gpus=GPUS, global_batch=BATCH, seq=SEQ, scale=(4, 2))


def test_plan_capacity_in_bytes_makes_the_larger_configs_not_fit_as_direct_traces_say():
    # 67 MiB: the tiny model's micro-batch 1 reserves less, micro-batch 2 more (2 MiB segments)
    cap = 67 * 2**20
    search = {**SEARCH, "tp": [1], "micro_batch": [1, 2]}
    small = md.plan(make_model, gpus=GPUS, gpu="h100", global_batch=BATCH, seq=SEQ, search=search, capacity=cap)
    assert any(c.fits for c in small) and any(c.fits is False for c in small)
    for c in small:
        if c.reserved_peak is None:
            continue
        assert md.fits(direct(c.config), capacity=cap, since="step").fits == c.fits, c.config
        assert c.fits == (c.reserved_peak <= cap)
        if not c.fits:
            assert c.why.startswith("reserved ") and "> 67MiB: first OOM at call" in c.why
    fitting = sum(bool(c.fits) for c in small)
    assert all(c.fits for c in list(small)[:fitting])  # what fits ranks first
    assert "67MiB each (capacity=)" in small.assumes
    with pytest.raises(md.MetaDispatchError, match="capacity=0"):
        md.plan(make_model, gpus=GPUS, global_batch=BATCH, seq=SEQ, capacity=0)


def state_at_optimizer(trace) -> int:
    """Bytes live at the step's first optimizer call, read from md.memory of a direct trace."""
    m = md.memory(trace, since="step")
    return m.timeline[next(i for i, call in enumerate(m.trace.calls) if call.phase == "optimizer")]


def test_plan_scaled_rejects_only_what_its_exact_state_figure_says_cannot_fit():
    # Note [What scaling may reject]: 69.5 MB holds shard 2's parameters, gradients and AdamW state
    # (with cuBLAS's workspace) but not shard 1's; some of the rest fit, some do not
    cap, search = 69_500_000, {**SEARCH, "tp": [1, 2]}
    table = md.plan(
        make_deep, gpus=GPUS, global_batch=BATCH, seq=SEQ, search=search, scale=(2, 4), confirm=2, capacity=cap
    )
    by_state = [c for c in table if c.why and c.why.startswith("parameters, gradients and optimizer state")]
    assert by_state and all(c.fits is False and c.scaled for c in by_state)
    assert {c.config["shard"] for c in by_state} == {1} and any(c.fits for c in table)
    for c in table:
        if c.state is None:
            continue
        t = direct(c.config, make=make_deep)
        assert abs(c.state - state_at_optimizer(t)) <= 1024, c.config
        verdict = md.fits(t, capacity=cap, since="step").fits
        assert c.fits is None or c.fits == verdict, c.config  # never fits where a direct trace does not


def test_plan_scaled_times_a_second_optimizer_from_one_optimizer_step_per_mesh():
    # Note [One optimizer step per mesh]: fused is traced once for the mesh, its other configs are foreach's twins
    search = {"tp": [1], "shard": [2], "micro_batch": [1, 2], "optimizer": ["foreach", "fused"]}
    full = md.plan(make_deep, gpus=GPUS, global_batch=BATCH, seq=SEQ, search=search)
    # from 1 and 2 layers (the scaled test above: 2 and 4), the cheapest depths
    scaled = md.plan(make_deep, gpus=GPUS, global_batch=BATCH, seq=SEQ, search=search, scale=(1, 2), confirm=1)
    # Note [One build for the configurations of a mesh]: one build a depth, foreach's 4 steps and fused's 1
    assert scaled.spent["1 layer"][0] == scaled.spent["2 layers"][0] == 1
    # of the 4 fused: one traced for the mesh, one perhaps confirmed by a full trace, the others twins
    assert sum(c.cached and c.scaled for c in scaled if c.config["optimizer"] == "fused") >= 2
    # its optimizer step traced alone in foreach's build (programs.py's _optimizer_alone): every scaled fused a twin
    assert all(c.cached for c in scaled if c.scaled and c.config["optimizer"] == "fused")
    by_config = {str(c.config): c for c in full}
    for c in scaled:
        f = by_config[str(c.config)]
        assert c.step_time == pytest.approx(f.step_time, rel=1e-9), c.config
        assert abs(c.state - f.state) <= 1024, c.config
    assert scaled.best.config == full.best.config


def test_plan_rejects_a_configuration_torch_refuses_and_says_what_it_raised():
    # TP on every GPU leaves no FSDP2 to make the norms and embeddings DTensors; fused AdamW refuses the mix
    search = {"tp": [2], "micro_batch": [1], "ac": ["none"], "optimizer": ["fused", "foreach"]}
    table = md.plan(make_model, gpus=2, global_batch=2, seq=SEQ, search=search)
    fused = next(c for c in table if c.config["optimizer"] == "fused")
    assert fused.fits is False and "mixed torch.Tensor and DTensor" in fused.why

    def tp_only():  # torch itself, written out: TP on both GPUs, no FSDP2, fused AdamW
        model = make_model()
        mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("tp",))
        cols, rows = TP_NAMES[make_model]
        for layer in model.model.layers:
            parallelize_module(layer, mesh, {n: ColwiseParallel() for n in cols} | {n: RowwiseParallel() for n in rows})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, CONFIG.vocab_size, (1, SEQ), device="cuda")
        model(ids, labels=ids).loss.backward()
        opt.step()

    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        md.tracer(world_size=2, rank=0, device="cuda")(tp_only)


def test_plan_names_the_optimizer_whose_construction_raised_not_the_configuration_before_it(monkeypatch):
    # the second optimizer's AdamW(...) raising was recorded against the first optimizer's last configuration
    # (its traced step replaced by the error), and in a build of its own raised UnboundLocalError
    adamw = torch.optim.AdamW

    def refusing(params, *args, fused=None, **kwargs):
        if fused:
            raise RuntimeError("fused refused here")
        return adamw(params, *args, fused=fused, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", refusing)
    search = {"tp": [1], "micro_batch": [1], "ac": ["none"], "optimizer": ["foreach", "fused"]}
    table = md.plan(make_model, gpus=2, global_batch=2, seq=SEQ, search=search)
    by = {c.config["optimizer"]: c for c in table}
    assert by["fused"].fits is False and "fused refused here" in by["fused"].why
    assert "fused refused here" not in (by["foreach"].why or "") and by["foreach"].fits
