"""An encoder under an LM head split into pipeline stages (pipeline/families.py ``LM_HEADS``): the stages run in
order compute the model's own logits and loss, bit for bit, on real data -- for a causal and a masked head, an
encoder and a decoder config (``is_decoder``: a causal mask)."""

import pytest
import torch

from metadispatch.pipeline.split import split
from tests.pipeline.in_order import assert_stages_give_the_models_output

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # eager attention reads the mask the stage builds
@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize(
    "name",
    [
        "BertLMHeadModel",
        "BertForMaskedLM",
        "RobertaForCausalLM",
        "RobertaForMaskedLM",
        "XLMRobertaForCausalLM",
        "XLMRobertaForMaskedLM",
        "ElectraForCausalLM",  # its embeddings narrower than its blocks: embeddings_project
        "ElectraForMaskedLM",
    ],
)
def test_stages_in_order_compute_the_models_logits_and_loss(name, decoder, attention):
    if decoder and "Masked" in name:
        pytest.skip("a masked LM is no decoder (transformers warns)")
    config_class = getattr(transformers, name.replace("LMHeadModel", "ForCausalLM").split("For")[0] + "Config")
    narrow = {"embedding_size": 16} if name.startswith("Electra") else {}
    config = config_class(
        **SMALL, **narrow, is_decoder=decoder, max_position_embeddings=40, attn_implementation=attention
    )
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).eval()
    ids = torch.randint(3, 97, (2, 16))
    labels = torch.randint(0, 97, (2, 16))
    labels[0, :3] = -100
    cut = split(model)
    assert cut.blocks == 4
    assert_stages_give_the_models_output(model, cut, ids, labels)


def test_the_blocks_are_named_by_the_base_models_prefix():
    model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**SMALL))
    assert split(model, "roberta.encoder.layer").blocks == 4
    with pytest.raises(Exception, match=r"blocks encoder.layer: a RobertaForMaskedLM is split at .*roberta.encoder"):
        split(model, "encoder.layer")


def test_the_cli_reports_one_peak_for_a_stage_whose_shapes_were_found_on_meta():
    # the stage's shapes are found on meta copies before the step (families.example_io): the full trace counts
    # none of their bytes, and the step cut from it counted them as state alive from its start -- the command
    # printed "1.81GiB allocated at peak" beside a per-stage peak of 1.33GiB and 1.42GiB reserved
    import metadispatch as md
    from metadispatch.cli.pipeline import PipelinePlan, stage_step
    from metadispatch.cli.plan import Plan, step_peak
    from metadispatch.ir.cut import step_from
    from tests.distributed_cases import tiny_bert_lm4

    for rank in (0, 1):
        trace, start = stage_step(Plan(2, rank), PipelinePlan(2, "1f1b"), tiny_bert_lm4, "cuda", "adamw", 2)
        step = step_from(trace, start)
        assert any(str(leaf.meta.device) == "meta" for leaf in step.leaves.values())  # the case at hand
        assert md.memory(step).peak == step_peak(trace, start), rank
        fit = md.fits(step, gpu="h100")
        assert fit.reserved_peak >= fit.memory.peak, rank
