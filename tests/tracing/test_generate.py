"""``model.generate()`` under md.GenerateAssumptions against eager CPU runs whose sampler returns the declared token.

Note [Generating under declared assumptions] in values/assume.py: the trace
must be the run eager makes when every next token is the declared id.  So
each eager run here forces that token (a logits processor leaving only it
finite: argmax and multinomial both return it), and the trace's calls, its
replay and the cache each step leaves are held to that run.
"""

import pytest
import torch

import metadispatch as md
from metadispatch.errors import DataDependentError
from metadispatch.serving.kv import cache_of
from metadispatch.testing import eager_calls, trace_calls

transformers = pytest.importorskip("transformers")

TOKEN = 5
# One shape for every architecture (GPT-2's config maps these names onto its own).
_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)


def _config(kind: str, **extra):
    return transformers.AutoConfig.for_model(kind, **_SHAPE, max_position_embeddings=64, **extra)


CONFIGS = {
    "llama": lambda: _config("llama", num_key_value_heads=2),
    "gpt2": lambda: _config("gpt2", bos_token_id=1, eos_token_id=2),
    "mistral": lambda: _config("mistral", num_key_value_heads=1, sliding_window=5),  # 6 + 4 tokens run past it
}


class _Force(transformers.LogitsProcessor):
    """Every score but ``token``'s is -inf: eager's argmax and multinomial both return it."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores):
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[:, self.token] = True
        return scores.masked_fill(~keep, float("-inf"))


def _model(name: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


def _generate(model, ids, **options):
    forced = transformers.LogitsProcessorList([_Force(TOKEN)])
    return lambda: model.generate(ids, max_new_tokens=4, logits_processor=forced, pad_token_id=0, **options)


_IDS = torch.tensor([[1, 3, 4, 6, 7, 8]])
_POLICY = md.GenerateAssumptions(token_id=TOKEN)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_trace_is_eager_run_with_the_declared_tokens(name, sample):
    model = _model(name)
    fn = _generate(model, _IDS, do_sample=sample)
    out = fn()
    assert out[0, _IDS.shape[1] :].tolist() == [TOKEN] * 4  # eager really took the assumed path
    trace = md.tracer(assume=_POLICY)(fn)
    assert trace_calls(trace) == eager_calls(fn)
    assert md.replay(trace, module=model).ok


@pytest.mark.parametrize(
    "name, cache", [(name, None) for name in CONFIGS] + [("llama", "static")], ids=lambda v: v or "dynamic"
)
def test_generate_steps_hold_the_cache_eager_holds(name, cache):
    model = _model(name)
    fn = _generate(model, _IDS, **({"cache_implementation": cache} if cache else {}))
    held: list = []

    def keep(module, args, kwargs, output):  # after each forward: the keys and values the next step reads
        kv = [t for layer in cache_of(output).layers for t in (layer.keys, layer.values)]
        held.append(sorted(t.untyped_storage().nbytes() for t in kv))

    handle = model.register_forward_hook(keep, with_kwargs=True)
    try:
        fn()
        eager = list(held)
        trace = md.tracer(assume=_POLICY)(fn)
    finally:
        handle.remove()
    steps = md.generation_steps(trace)
    assert [s.name for s in steps] == ["prefill", "decode 1", "decode 2", "decode 3"]
    assert [sorted(m.numel * m.dtype.itemsize for m in s.cache) for s in steps] == eager
    lengths = [{m.shape[-2] for m in s.cache} for s in steps]
    if cache == "static":  # allocated once for the longest sequence, written in place
        assert len({s.cache_bytes for s in steps}) == 1
    elif name != "mistral":  # a window's slice is a view: its storage is the whole concatenation
        assert lengths == [{n} for n in range(_IDS.shape[1], _IDS.shape[1] + 4)]


def test_generate_lists_every_assumption_in_the_trace():
    model = _model("llama")
    trace = md.tracer(assume=_POLICY)(lambda x: model.generate(x, max_new_tokens=3), _IDS)
    tokens = [a for a in trace.assumptions if a.op == "aten.argmax.default"]
    assert [a.value for a in tokens] == [f"tokens = {TOKEN}"] * 3
    assert all(a.source.startswith("utils.py:") and "_sample" in a.source for a in tokens)
    assert [a.op for a in trace.assumptions if a.op.startswith("arg ")] == ["arg args[0]"]
    printed = str(trace)
    assert printed.count(f"<assumed tokens = {TOKEN}: GenerateAssumptions(token_id={TOKEN})>") == 3
    assert [trace.calls[a.index].op for a in tokens] == ["aten.argmax.default"] * 3
    # the stop check, computed from the declared tokens: the loop ends at max_new_tokens
    stops = [a for a in trace.assumptions if a.op == "aten._local_scalar_dense.default"]
    assert [a.value for a in stops] == ["False", "False", "True"]
    assert all(a.basis == f"computed from {_POLICY!r}'s tokens" and "in __call__" in a.source for a in stops)


def test_a_declared_eos_token_stops_the_loop_as_eager_does():
    model = _model("llama")
    eos = model.config.eos_token_id
    forced = transformers.LogitsProcessorList([_Force(eos)])

    def fn():
        return model.generate(_IDS, max_new_tokens=4, logits_processor=forced)

    assert fn().shape[1] == _IDS.shape[1] + 1
    trace = md.tracer(assume=md.GenerateAssumptions(token_id=eos))(fn)
    assert trace.output_meta.shape == (1, _IDS.shape[1] + 1)
    assert trace_calls(trace) == eager_calls(fn)


def test_a_saved_trace_keeps_its_assumptions(tmp_path):
    model = _model("gpt2")
    trace = md.tracer(assume=_POLICY)(lambda x: model.generate(x, max_new_tokens=2), _IDS)
    trace.save(tmp_path / "t.json.gz")
    loaded = md.Trace.load(tmp_path / "t.json.gz")
    assert loaded.assumptions == trace.assumptions and len(trace.assumptions) == 5
    assert loaded.marks == trace.marks
    assert [(s.name, s.shapes()) for s in md.generation_steps(loaded)] == [
        (s.name, s.shapes()) for s in md.generation_steps(trace)
    ]


def test_generate_without_a_policy_stops_at_the_stop_check():
    model = _model("llama")
    with pytest.raises(DataDependentError, match="_local_scalar_dense"):
        md.trace(lambda: model.generate(_IDS, max_new_tokens=2))


def test_a_read_the_policy_does_not_name_keeps_its_error():
    def fn(x):
        return x * 2 if bool((x > 0).all()) else x

    with pytest.raises(DataDependentError, match="_local_scalar_dense"):
        md.tracer(assume=_POLICY)(fn, torch.randn(3))


def test_values_answer_a_named_read_and_list_it():
    def fn(x):
        return x * 2 if bool((x > 0).all()) else x

    policy = md.GenerateAssumptions(values={"aten._local_scalar_dense.default": True})
    trace = md.tracer(assume=policy)(fn, torch.randn(3))
    assert [c.op for c in trace][-1] == "aten.mul.Tensor"
    (a,) = trace.assumptions
    assert (a.op, a.value, a.basis) == (
        "aten._local_scalar_dense.default",
        "True",
        "given by values['aten._local_scalar_dense.default']",
    )


def test_values_give_a_data_dependent_op_its_outputs():
    policy = md.GenerateAssumptions(values={"aten.nonzero.default": torch.tensor([[0], [2]])})
    trace = md.tracer(assume=policy)(lambda x: (x > 0).nonzero(), torch.randn(4))
    assert trace.output_meta.shape == (2, 1)
    assert [a.value for a in trace.assumptions] == ["its outputs"]


def test_a_mode_factory_carries_the_policy():
    model = _model("llama")
    fn = _generate(model, _IDS)
    made = md.tracer(mode_factory=lambda: md.MetaMode(assume=_POLICY))(fn)
    direct = md.tracer(assume=_POLICY)(fn)
    assert made.marks == direct.marks and made.assumptions == direct.assumptions
    with pytest.raises(md.MetaDispatchError, match="assume= with no mode_factory="):
        md.tracer(assume=_POLICY, mode_factory=lambda: md.MetaMode())


@pytest.mark.parametrize("cache", [None, "static"], ids=lambda v: v or "dynamic")
def test_generate_after_a_warmup_is_eagers_second_run(cache):
    model = _model("llama")
    fn = _generate(model, _IDS, **({"cache_implementation": cache} if cache else {}))
    fn()  # eager's first run: what a second one finds (a static cache is built once)
    trace = md.tracer(assume=_POLICY, warmup=1)(fn)
    assert trace.warmup == 1 and trace_calls(trace) == eager_calls(fn)
    once = md.tracer(assume=_POLICY)(fn)
    assert [(a.op, a.value) for a in trace.assumptions] == [(a.op, a.value) for a in once.assumptions]
    tokens = [a.index for a in trace.assumptions if a.value == f"tokens = {TOKEN}"]
    assert len(tokens) == 4 and {trace.calls[i].op for i in tokens} == {"aten.argmax.default"}
    assert [s.name for s in md.generation_steps(trace)] == ["prefill", "decode 1", "decode 2", "decode 3"]


def test_a_model_built_under_a_logical_gpu_generates():
    config = CONFIGS["llama"]()

    def build_and_generate():
        model = transformers.LlamaForCausalLM(config).eval()
        return model.generate(torch.ones(2, 7, dtype=torch.long, device="cuda"), max_new_tokens=3)

    trace = md.tracer(device="cuda", assume=_POLICY)(build_and_generate)
    assert trace.output_meta.shape == (2, 10)
    steps = md.generation_steps(trace)
    assert [s.cache_bytes for s in steps] == [
        2 * 2 * 2 * 2 * n * 8 * 4 for n in (7, 8, 9)
    ]  # layers, K and V, batch, heads, head size, f32


@pytest.mark.parametrize("bad", [-1, 1.0, "0"])
def test_a_token_id_is_a_non_negative_int(bad):
    with pytest.raises(TypeError, match="token id"):
        md.GenerateAssumptions(token_id=bad)


def test_generate_under_md_check_stops_as_eager_does():
    # md.check makes up every token; the length criterion, known, still
    # stops the loop (Note [An operand that decides the result] in known.py):
    # before, the made-up stop read was False forever and the check never ended.
    model = _model("llama")
    run = lambda i: model.generate(i, max_new_tokens=3, do_sample=False, pad_token_id=0)  # noqa: E731
    report = md.check(run, _IDS)
    assert report.error is None, str(report)
    eager = run(_IDS)
    assert tuple(report.trace.output_meta.shape) == tuple(eager.shape)
    eager_forwards = sum(c.op == "aten.embedding.default" for c in eager_calls(run, _IDS))
    assert sum(c.op == "aten.embedding.default" for c in report.trace.calls) == eager_forwards == 3
