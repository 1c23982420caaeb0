"""``metadispatch trace --pp 2`` on an encoder (transformers BertModel) and
vision models (torchvision resnet18, whose stages pass feature maps of
another shape, a torchvision ViT and a timm ViT) against real 2-process ``gloo`` runs of
the same code (cli/pipeline.py's ``run_stages``; Note [Pipeline stages of
encoders and vision models] in pipeline/families.py): per rank the
same parameter shards, the same sends and receives, the peak within 1 KiB;
and the command line prints each stage's peak.  An encoder-decoder is
refused as a usage error, named.

As in test_distributed.py (Note [Ranks forked from one server]): the ranks
rendezvous on a file store, no port, no environment variable set.
"""

import json
import re

import pytest

import metadispatch as md
from metadispatch.cli.main import main
from tests.distributed_cases import comparable, step_ops_as_real, traced_rank
from tests.world.test_distributed import _spawn

pytest.importorskip("transformers")

_REAL: dict = {}


def _real(case: str, tmp_path_factory) -> list:
    if case not in _REAL:
        _REAL.update(_spawn([case], 2, tmp_path_factory))
    return _REAL[case]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,target,needs",
    [
        ("cli-pp-bert", "tiny_bert4", "transformers"),
        ("cli-pp-bert-lm", "tiny_bert_lm4", "transformers"),  # an LM head, its loss the model's
        ("cli-pp-falcon", "tiny_falcon4", "transformers"),  # a decoder named otherwise (pipeline/decoders.py)
        ("cli-pp-hf-vit", "tiny_hf_vit4", "transformers"),  # an image classifier, its loss the model's
        ("cli-pp-opt", "tiny_opt4", "transformers"),  # learned positions, projected embeddings
        ("cli-pp-bloom", "tiny_bloom4", "transformers"),  # ALiBi, rebuilt on every stage
        ("cli-pp-gpt-neo", "tiny_gpt_neo4", "transformers"),  # learned positions, local blocks
        ("cli-pp-resnet18", "tiny_resnet18", "torchvision"),
        ("cli-pp-vit", "tiny_vit", "torchvision"),
        ("cli-pp-timm-vit", "tiny_timm_vit", "timm"),
    ],
)
def test_pipeline_families_cli_pp_traces_what_a_real_gloo_run_takes(case, target, needs, tmp_path_factory, capsys):
    pytest.importorskip(needs)
    real = _real(case, tmp_path_factory)
    peaks = []
    for rank in range(2):
        trace, shards = traced_rank(rank, 2, case, device="cpu")
        assert shards == real[rank]["shards"], f"rank {rank}"
        collectives = json.loads(json.dumps(comparable(md.comms(trace).calls)))
        assert collectives == real[rank]["collectives"], f"rank {rank}"
        assert collectives and {c[0] for c in collectives} <= {"c10d.send.default", "c10d.recv_.default"}, (
            f"rank {rank}"
        )
        assert step_ops_as_real(trace, real[rank]), f"rank {rank}: the step's ops are not the real run's"
        assert [a.op for a in trace.assumptions] == ["pipeline vote"], rank  # the world's one assumption, named
        peak = md.memory(trace).peak
        assert abs(peak - real[rank]["peak"]) <= 1024, f"rank {rank}: traced {peak:,} B, real {real[rank]['peak']:,} B"
        peaks.append(peak)
    assert peaks[0] != peaks[1]  # the stages differ: the stem on one, the head on the other
    argv = ["trace", f"tests.distributed_cases:{target}", "--device", "cpu", "--world-size", "2", "--pp", "2"]
    assert main([*argv, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{len(real[0]['collectives'])} collectives in the step" in out
    assert "pipeline: 2 stages on 2 ranks" in out
    assert re.search(r"^  rank 0 \(stage 0\): \S+ \([\d,]+ B\)$", out, re.M)
    assert re.search(r"^  rank 1 \(stage 1\): \S+ \([\d,]+ B\)$", out, re.M)


def test_pipeline_families_cli_pp_refuses_an_encoder_decoder_naming_it(capsys):
    argv = ["trace", "tests.distributed_cases:tiny_t5", "--device", "cpu", "--world-size", "2", "--pp", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--pp: cannot split a T5ForConditionalGeneration into pipeline stages: it is an encoder-decoder" in err
    assert "Traceback" not in err
