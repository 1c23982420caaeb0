"""A DataLoader epoch inside a traced step: Note [A DataLoader inside a traced step] in mode/realcode.py."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torch.utils.data.dataloader import default_collate

import metadispatch as md
from tests.eager_ops import EagerOps

# The loader's own ops (its seed, the sampler's permutation): run for real, outside the trace.
_BOOKKEEPING = {
    "aten.empty.memory_format",
    "aten.random_.default",
    "aten._local_scalar_dense.default",
    "aten.randperm.generator",
    "aten.randperm.default",
}


def _dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(10, 4, generator=g), torch.randn(10, 1, generator=g))


def _collate_pairs(batch):  # a user's collate: stacks, then scales the inputs
    x, y = default_collate(batch)
    return x * 0.5, y


LOADERS = {
    "shuffle-seeded": lambda ds, g: DataLoader(ds, batch_size=3, shuffle=True, generator=g),
    "sequential": lambda ds, g: DataLoader(ds, batch_size=4),
    "drop-last-collate": lambda ds, g: DataLoader(ds, batch_size=3, drop_last=True, collate_fn=_collate_pairs),
    "sampler-with-generator": lambda ds, g: DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, generator=g)),
    "shuffle-global-rng": lambda ds, g: DataLoader(ds, batch_size=5, shuffle=True),
}


def _epoch(model, loader):
    def step():
        batches = []
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            batches.append(x)
        return batches

    return step


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_dataloader_epoch_traces_the_batches_eager_sees(name):
    torch.manual_seed(0)
    model, ds = nn.Linear(4, 1), _dataset()
    g = torch.Generator().manual_seed(7)
    loader = LOADERS[name](ds, g)
    g_state, cpu_state = g.get_state(), torch.get_rng_state()
    with EagerOps() as real:
        expected = _epoch(model, loader)()
    assert not torch.equal(g.get_state(), g_state) or name in ("sequential", "drop-last-collate", "shuffle-global-rng")
    model.zero_grad(set_to_none=True)
    g.set_state(g_state)
    torch.set_rng_state(cpu_state)

    t = md.trace(_epoch(model, loader))
    # the loader's generators are as they were; the model has no .grad
    assert torch.equal(g.get_state(), g_state) and torch.equal(torch.get_rng_state(), cpu_state)
    assert model.weight.grad is None
    assert [c.op for c in t.calls] == [op for op in real.ops if op not in _BOOKKEEPING]
    assert [o.shape for o in t.output] == [b.shape for b in expected]

    result = md.replay(t, module=model)
    assert result.ok, result
    assert all(torch.equal(r, e) for r, e in zip(result.output, expected, strict=True))

    # each batch a sampler drew is an assumption, naming the rows eager read
    drawn = [a for a in t.assumptions if a.op == "DataLoader._next_index"]
    if name in ("sequential", "drop-last-collate"):
        assert drawn == []
    else:
        rows = [[_row_of(ds, r) for r in batch] for batch in expected]
        assert [a.value for a in drawn] == [f"rows {r}" for r in rows]
        assert all("RandomSampler" in a.basis and "test_dataloader.py" in a.source for a in drawn)
        assert [t.calls[a.index].op for a in drawn] == ["aten.select.int"] * len(rows)  # the batch's first read


def _row_of(ds, row) -> int:
    (i,) = [i for i in range(len(ds)) if torch.equal(ds[i][0], row)]
    return i


def test_dataloader_with_workers_is_refused_naming_the_option():
    loader = DataLoader(_dataset(), batch_size=3, num_workers=2)
    with pytest.raises(md.UnsupportedFeatureError, match="num_workers=2"):
        md.trace(lambda: [x.sum() for x, _ in loader])


def test_dataloader_outside_a_mode_is_torchs():
    g = torch.Generator().manual_seed(3)
    with md.MetaMode():
        pass
    batches = [x for x, _ in DataLoader(_dataset(), batch_size=3, shuffle=True, generator=g)]
    g.manual_seed(3)
    assert all(
        torch.equal(a, b) for a, (b, _) in zip(batches, DataLoader(_dataset(), batch_size=3, shuffle=True, generator=g))
    )


def test_dataloader_rows_drawn_for_real_are_not_made_up_values_to_md_check():
    # md.check lists the rows (Note [A DataLoader inside a traced step]) but
    # made up nothing: the report is ok; a value made up beside them is listed apart
    torch.manual_seed(0)
    model, loader = nn.Linear(4, 1), DataLoader(_dataset(), batch_size=4, shuffle=True)
    report = md.check(_epoch(model, loader))
    assert report.ok, report
    assert len(report.assumptions) == 3 and not report.made_up

    def reads(model, loader):
        for x, _ in loader:
            (x + torch.randn(4)).nonzero()  # data-dependent on unknown values: made up

    read = md.check(lambda: reads(model, loader))
    drawn = [a for a in read.assumptions if a.op == "DataLoader._next_index"]
    assert len(drawn) == 3 and read.made_up and not set(drawn) & set(read.made_up)


class _TensorBatches(torch.utils.data.Sampler):
    """A batch sampler yielding tensors of indices: slices of one randperm."""

    def __len__(self):
        return 3

    def __iter__(self):
        order = torch.randperm(9)
        yield from (order[3 * i : 3 * i + 3] for i in range(3))


class _TensorRows(torch.utils.data.Sampler):
    """A sampler yielding 0-d tensors of indices."""

    def __len__(self):
        return 9

    def __iter__(self):
        yield from torch.randperm(9)


@pytest.mark.parametrize("kind", ["batch-sampler", "sampler"])
def test_dataloader_rows_drawn_as_tensors_are_listed_as_the_rows_read(kind):
    # Note [A DataLoader inside a traced step]: a sampler may yield index
    # tensors; the assumption lists the rows eager read, as ints
    torch.manual_seed(3)
    model, ds = nn.Linear(4, 1), _dataset()

    def loader():
        if kind == "batch-sampler":
            return DataLoader(ds, batch_sampler=_TensorBatches())
        return DataLoader(ds, sampler=_TensorRows(), batch_size=3)

    state = torch.get_rng_state()
    expected = _epoch(model, loader())()
    torch.set_rng_state(state)
    t = md.trace(_epoch(model, loader()))
    rows = [[_row_of(ds, r) for r in batch] for batch in expected]
    assert [a.value for a in t.assumptions if a.op == "DataLoader._next_index"] == [f"rows {r}" for r in rows]
