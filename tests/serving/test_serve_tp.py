"""md.serve_plan(tp=N) against a real tensor-parallel CPU run: ``gloo`` ranks of the parallelized model.

Per rank, the KV bytes per token (over two lengths), the weights and the
prefill's all-reduces of the plan -- traced on rank 0 of a logical world --
equal what a real 2-process run of the same model split the same way
holds and calls (tests/serving/tp_ranks.py).
"""

import json

import pytest
import torch
import torch.multiprocessing as mp

import metadispatch as md
from tests.serving.test_kv import _CONFIGS as KV_CONFIGS
from tests.serving.test_kv import real_cache_bytes

transformers = pytest.importorskip("transformers")
from tests.serving.tp_ranks import measure  # noqa: E402 (after transformers is known to be there)

TP, LENGTHS, PREFILL = 2, (24, 40), 24


def _mistral_two_kv_heads():
    cfg = KV_CONFIGS["mistral_sliding"]()
    cfg.num_key_value_heads, cfg.sliding_window = 2, 256  # every length measured still grows
    return cfg


_CONFIGS = {"llama": KV_CONFIGS["llama_gqa"], "mistral": _mistral_two_kv_heads}


@pytest.fixture(scope="module")
def real_ranks(tmp_path_factory):
    """name -> each rank's measurements, from one real run of every config over TP gloo processes."""
    out = tmp_path_factory.mktemp("tp")
    configs = {name: make() for name, make in _CONFIGS.items()}
    mp.start_processes(measure, args=(TP, configs, LENGTHS, str(out)), nprocs=TP, start_method="spawn")
    return {name: [json.loads((out / name / f"{r}.json").read_text()) for r in range(TP)] for name in configs}


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_serve_plan_tp_kv_and_weights_are_a_real_ranks(name, real_ranks):
    plan = md.serve_plan(_CONFIGS[name](), gpu="h100", tp=TP, max_model_len=64, max_num_batched_tokens=PREFILL)
    a, b = LENGTHS
    for rank in real_ranks[name]:  # both ranks hold the same: the heads and the MLP split evenly
        cache = rank["cache"]
        assert plan.kv_per_token == (cache[str(b)] - cache[str(a)]) / (b - a) > 0
        assert plan.weights == rank["weights"]
    assert plan.collectives[0] == len(real_ranks[name][0]["collectives"]) > 0
    assert set(real_ranks[name][0]["collectives"]) == {"all_reduce"}


def test_serve_plan_tp_splits_the_real_unsplit_cache():
    cfg = _CONFIGS["llama"]()
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    whole = (sum(real_cache_bytes(real, 40)) - sum(real_cache_bytes(real, 24))) / 16
    two = md.serve_plan(cfg, gpu="h100", tp=2, max_model_len=64, max_num_batched_tokens=32)
    assert two.kv_per_token == whole / 2  # two KV heads, one per rank
    # GQA with fewer KV heads than ranks: each of 4 ranks holds one head, as vLLM replicates them
    four = md.serve_plan(cfg, gpu="h100", tp=4, max_model_len=64, max_num_batched_tokens=32)
    assert four.kv_per_token == whole / cfg.num_key_value_heads
    assert any("rowwise" in a for a in two.assumptions)


def test_serve_plan_tp_times_include_the_all_reduces():
    cfg = _CONFIGS["llama"]()
    one, two = (md.serve_plan(cfg, gpu="h100", tp=tp, max_model_len=64, max_num_batched_tokens=32) for tp in (1, 2))
    assert one.collectives == (0, 0) and one.collective_s == (0.0, 0.0)
    # one all-reduce after attention and one after the MLP, per layer, in a prefill and in a decode step
    assert two.collectives == (2 * cfg.num_hidden_layers,) * 2
    assert 0 < two.collective_s[0] < two.ttft and 0 < two.collective_s[1] < two.tpot
    assert "collectives    4 in a prefill" in str(two)


@pytest.mark.parametrize("tp", [3, 0, 2.0])
def test_serve_plan_tp_that_cannot_split_the_model_is_refused(tp):
    with pytest.raises(md.MetaDispatchError, match=f"serve_plan: tp={tp!r}"):
        md.serve_plan(_CONFIGS["llama"](), gpu="h100", tp=tp, max_model_len=64, max_num_batched_tokens=32)
