"""md.max_batch against independent steady-state traces: the answer fits, one more does not."""

import pytest
import torch
from torch import nn

import metadispatch as md
from metadispatch.cli.llama import Llama, LlamaConfig
from metadispatch.cli.llama import build as llama_build
from tests.tracing.test_steady_state import _Block


def _with_adamw(model, forward):
    """make_step(batch): a step that runs ``forward(model, batch)``'s loss backward, then AdamW."""
    opt = torch.optim.AdamW(model.parameters())

    def make_step(batch):
        def step():
            forward(model, batch).backward()
            opt.step()
            opt.zero_grad()

        return step, ()

    return make_step


def llama():
    config = LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=512)
    ids = lambda b: torch.randint(0, 512, (b, 256))  # noqa: E731 (made in the trace: no real tensor)
    return _with_adamw(Llama(config), lambda m, b: m(ids(b), ids(b)))


def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=512, n_positions=256)
    model = transformers.GPT2LMHeadModel(config)

    def forward(m, b):
        ids = torch.randint(0, 512, (b, 256))
        return m(input_ids=ids, labels=ids).loss

    return _with_adamw(model, forward)


def resnet():
    stem = (nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
    model = nn.Sequential(*stem, _Block(16), _Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    return _with_adamw(model, lambda m, b: m(torch.randn(b, 3, 64, 64)).float().pow(2).mean())


def _fits(make_step, batch: int, gpu: str) -> bool:
    fn, args = make_step(batch)
    return md.fits(md.tracer(device="cuda", gpu=gpu, warmup=1)(fn, *args), gpu).fits


@pytest.mark.slow
@pytest.mark.parametrize("gpu", ["l4", "a100-40gb"])
@pytest.mark.parametrize("model", [llama, gpt2, resnet], ids=lambda f: f.__name__)
def test_max_batch_fits_and_one_more_does_not(model, gpu):
    make_step = model()
    found = md.max_batch(make_step, gpu)
    assert found.batch > 1 and found.fits.fits and not found.next.fits
    assert len(found.tried) <= 2 * found.batch.bit_length() + 2  # O(log n) traces
    assert _fits(make_step, found.batch, gpu) and not _fits(make_step, found.batch + 1, gpu)  # traced anew


def _deep_llama(batch, layers=None):
    """make_step(batch, layers=k): a LLaMA 8 blocks deep (or k), built on the meta device, with AdamW."""
    config = LlamaConfig(vocab_size=512, dim=256, n_layers=layers or 8, n_heads=4, n_kv_heads=4, hidden_dim=512)
    with md.MetaMode(device="cuda", record=False):
        model, (ids, labels) = llama_build(config, batch, 256)
    opt = torch.optim.AdamW(model.parameters())

    def step(model, ids, labels):
        model(ids, labels).backward()
        opt.step()
        opt.zero_grad()

    return step, (model, ids, labels)


@pytest.mark.slow
def test_max_batch_guesses_from_shallow_traces_and_confirms_with_two_full_ones():
    capacity = 3 * 2**30
    found = md.max_batch(_deep_llama, "l4", capacity=capacity, scale=(2, 4))
    # the guess bounds the allocated peak; the allocator's rounding, 3-7% here, takes one guess more
    assert found.small == 4 and found.guess >= found.batch > 1 and len(found.tried) <= 4
    assert found.fits.fits and not found.next.fits
    plain = md.max_batch(_deep_llama, "l4", capacity=capacity)
    assert plain.batch == found.batch  # traced anew: the answer fits, one more does not
    for batch, expected in ((found.batch, True), (found.batch + 1, False)):
        fn, args = _deep_llama(batch)
        assert md.fits(md.tracer(device="cuda", gpu="l4", warmup=1)(fn, *args), "l4", capacity).fits is expected


def test_max_batch_finds_the_answer_where_the_guess_is_wrong():
    # b * b MiB: the line through batches 2 and 3 guesses far too high; the search gallops back down
    def make_step(batch):
        return (lambda: torch.empty(batch * batch, 2**18).sum()), ()

    found = md.max_batch(make_step, "l4", capacity=100 * 2**20)
    assert found.guess > 2 * found.batch and found.batch == 9 and found.fits.fits and not found.next.fits
    assert found.failed == 10 and len(found.tried) <= 2 * found.guess.bit_length() + 2  # O(log n) traces


def test_max_batch_refuses_a_scale_it_cannot_use():
    with pytest.raises(md.MetaDispatchError, match="scale=.*2 <= a < c"):
        md.max_batch(_deep_llama, "l4", scale=(1, 4))
    with pytest.raises(md.MetaDispatchError, match="the model among the step's args"):
        md.max_batch(lambda b, layers=None: ((lambda: None), ()), "l4", scale=(2, 4))


def test_max_batch_on_a_world_answers_for_the_worst_rank():
    # 2 ranks each all-gather a batch-sized buffer; rank 1 also keeps a 10 MiB buffer
    import torch.distributed as dist

    def make_step(batch):
        def step():
            x = torch.empty(batch, 2**18)  # 1 MiB a sample
            extra = torch.empty(10 * 2**18) if dist.get_rank() == 1 else None
            dist.all_reduce(x)
            return extra

        return step, ()

    found = md.max_batch(make_step, "l4", capacity=100 * 2**20, world_size=2)
    alone = md.max_batch(make_step, "l4", capacity=100 * 2**20, world_size=2, ranks=[0])
    assert found.batch < alone.batch and found.fits.fits and not found.next.fits


def test_max_batch_says_zero_when_nothing_fits():
    found = md.max_batch(lambda b: ((lambda: torch.empty(b, 2**20).sum()), ()), "l4", capacity=2**20)
    assert found.batch == 0 and found.fits is None and not found.next.fits and found.failed == 1


@pytest.mark.slow
def test_max_batch_from_the_command_line(capsys):
    pytest.importorskip("transformers")
    from metadispatch.cli.main import main

    small = ["num_hidden_layers=1", "hidden_size=512", "intermediate_size=1024", "num_attention_heads=8"]
    small += ["num_key_value_heads=8", "vocab_size=32000"]
    argv = ["trace", "--hf", "llama", "--seq", "2048", "--gpu", "l4", "--max-batch"]
    assert main(argv + [a for kv in small for a in ("--config", kv)]) == 0
    out = capsys.readouterr().out
    found = int(out.split("largest batch that fits on L4 24 GB: ")[1].split(" ")[0])
    assert f"batch {found}: fits on L4 24 GB: yes" in out and f"batch {found + 1}: fits on L4 24 GB: no" in out
    assert "AdamW, step 2 of 2 (the steady state)" in out


def _one_llama(layers_default: int = 8):
    """make_step(batch, layers=k): one LLaMA a depth and its AdamW, the same step for every batch (shareable)."""
    built: dict = {}

    def make_step(batch, layers=None):
        depth = layers or layers_default
        if depth not in built:
            config = LlamaConfig(vocab_size=512, dim=256, n_layers=depth, n_heads=4, n_kv_heads=4, hidden_dim=512)
            with md.MetaMode(device="cuda", record=False):
                model, _ = llama_build(config, 1, 256)
            opt = torch.optim.AdamW(model.parameters())

            def step(model, ids):
                model(ids, ids).backward()
                opt.step()
                opt.zero_grad()

            built[depth] = model, step
        model, step = built[depth]
        with md.MetaMode(device="cuda", record=False):
            ids = torch.randint(0, 512, (batch, 256), device="cuda")
        return step, (model, ids)

    return make_step


def test_max_batch_confirms_two_batches_of_one_model_after_one_warmup():
    # Note [One warm-up for two batches]: batch + 1 is traced after batch's warm-up, and is
    # what a direct trace of it says, as the search with every batch its own warm-up
    capacity = 300 * 2**20
    make_step = _one_llama(4)
    found = md.max_batch(make_step, "l4", capacity=capacity, scale=(2, 3))
    apart = md.max_batch(make_step, "l4", capacity=capacity, scale=(2, 3), share=False)
    assert found.shared == [found.batch + 1] and apart.shared == [] and found.batch == apart.batch > 1
    assert found.fits.reserved_peak == apart.fits.reserved_peak and found.next.reserved_peak == apart.next.reserved_peak
    assert "1 after another's warm-up" in str(found)
    for batch, expected in ((found.batch, True), (found.batch + 1, False)):
        fn, args = make_step(batch)
        alone = md.fits(md.tracer(device="cuda", gpu="l4", warmup=1)(fn, *args), "l4", capacity)
        assert alone.fits is expected
        assert alone.reserved_peak == (found.fits if expected else found.next).reserved_peak


def test_max_batch_traces_apart_a_step_that_keeps_something_of_its_batch():
    # the step keeps its last batch's activations: what a warm-up leaves grows with the batch,
    # so batch + 1 after batch's warm-up would start from batch's, not its own
    kept: list = []
    lin = nn.Linear(2**10, 2**10)

    def step(x):
        kept[:] = [lin(x).detach()]

    def make_step(batch):
        with md.MetaMode(device="cuda", record=False):
            x = torch.empty(batch, 2**10, device="cuda")
        return step, (x,)

    found = md.max_batch(make_step, "l4", capacity=200 * 2**20)
    assert found.shared == [] and found.fits.fits and not found.next.fits
    for batch, expected in ((found.batch, True), (found.batch + 1, False)):
        fn, args = make_step(batch)
        assert md.fits(md.tracer(device="cuda", gpu="l4", warmup=1)(fn, *args), "l4", 200 * 2**20).fits is expected


def _world_step():
    """make_step(batch) on a world: one all-reduced 1 MiB-a-sample batch, the same step for every batch;
    rank 1 also keeps a 10 MiB buffer."""
    import torch.distributed as dist

    def step(x):
        extra = torch.empty(10 * 2**18) if dist.get_rank() == 1 else None
        dist.all_reduce(x)
        return extra

    def make_step(batch):
        with md.MetaMode(device="cuda", record=False):
            x = torch.empty(batch, 2**18, device="cuda")
        return step, (x,)

    return make_step


def test_max_batch_on_a_world_shares_a_warmup_and_answers_as_each_its_own():
    make_step = _world_step()
    found = md.max_batch(make_step, "l4", capacity=100 * 2**20, world_size=2)
    apart = md.max_batch(make_step, "l4", capacity=100 * 2**20, world_size=2, share=False)
    assert found.shared == [found.batch + 1] and found.tried == apart.tried and found.batch == apart.batch
    assert (found.fits.reserved_peak, found.next.reserved_peak) == (apart.fits.reserved_peak, apart.next.reserved_peak)


def test_max_batch_shares_a_warmup_on_ranks_that_are_not_the_first():
    # ranks=[1]: rank 1's states are the first (only) of each list; they were read at index 1 (IndexError)
    make_step = _world_step()
    found = md.max_batch(make_step, "l4", capacity=100 * 2**20, world_size=2, ranks=[1])
    apart = md.max_batch(make_step, "l4", capacity=100 * 2**20, world_size=2, ranks=[1], share=False)
    assert found.shared == [found.batch + 1] and found.tried == apart.tried and found.batch == apart.batch
    assert (found.fits.reserved_peak, found.next.reserved_peak) == (apart.fits.reserved_peak, apart.next.reserved_peak)


def test_max_batch_under_a_declared_policy_traces_each_batch_alone():
    # assume= marks one call's steps over its trace (Note [One warm-up, several steps]): the
    # search must not try to share a warm-up there, and answers as share=False does
    lin = nn.Linear(2**10, 2**10)

    def step(x):
        lin(x).sum().backward()

    def make_step(batch):
        with md.MetaMode(device="cuda", record=False):
            x = torch.empty(batch, 2**10, device="cuda")
        return step, (x,)

    def factory():
        return md.MetaMode(device="cuda", gpu="l4", assume=md.GenerateAssumptions(token_id=0))

    capacity = 200 * 2**20
    found = md.max_batch(make_step, "l4", capacity=capacity, mode_factory=factory)
    apart = md.max_batch(make_step, "l4", capacity=capacity, mode_factory=factory, share=False)
    assert found.shared == [] and found.batch == apart.batch > 1
    assert found.fits.fits and not found.next.fits
