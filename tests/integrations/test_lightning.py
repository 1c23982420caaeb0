"""Lightning: md.trace of Trainer.fit, and FitCheck against a direct md.tracer trace of the same step.

Lightning is installed in CI's torch 2.14.1 leg only; elsewhere these skip.
"""

import copy

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

import metadispatch as md  # noqa: E402
from metadispatch.errors import DoesNotFitError  # noqa: E402
from metadispatch.integrations.lightning import FitCheck, training_step_fn  # noqa: E402


class LM(L.LightningModule):
    def __init__(self, d=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 4))
        self.d = d

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        ds = torch.utils.data.TensorDataset(
            torch.randn(64, self.d, generator=g), torch.randint(0, 4, (64,), generator=g)
        )
        return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)  # the sampler draws from torch's RNG


def _trainer(**kw):
    return L.Trainer(
        limit_train_batches=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **kw,
    )


def _plain(module):
    return {k: v for k, v in vars(module).items() if isinstance(v, (int, float, str, bool, type(None)))}


def test_trace_of_trainer_fit_leaves_module_unchanged():
    torch.manual_seed(0)
    m = LM()
    before = copy.deepcopy(m)
    rng = torch.get_rng_state()

    def fit():
        _trainer().fit(m)

    t = md.trace(fit)
    assert sum("addmm" in c.op for c in t.calls) == 4  # two steps, two Linear layers each
    assert m.state_dict().keys() == before.state_dict().keys()
    assert all(torch.equal(v, before.state_dict()[k]) for k, v in m.state_dict().items())
    assert _plain(m) == _plain(before)
    assert torch.equal(torch.get_rng_state(), rng)


class _Snapshot(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        self.state = copy.deepcopy(pl_module.state_dict())
        self.rng = torch.get_rng_state()
        self.plain = _plain(pl_module)
        self.grads = [p.grad for p in pl_module.parameters()]


def _fit_with(callbacks):
    torch.manual_seed(0)
    m = LM()
    snap = _Snapshot()
    _trainer(callbacks=[*callbacks, snap]).fit(m)
    return m, snap


def test_fitcheck_changes_nothing():
    checked, with_check = _fit_with([FitCheck(gpu="h100")])
    plain, without = _fit_with([])
    for k, v in without.state.items():
        assert torch.equal(with_check.state[k], v), k
    assert torch.equal(with_check.rng, without.rng)
    assert with_check.plain == without.plain
    assert with_check.grads == without.grads == [None] * 4
    # and the training that followed is the same, bit for bit
    for k, v in plain.state_dict().items():
        assert torch.equal(checked.state_dict()[k], v), k


def test_fitcheck_equals_direct_trace():
    check = FitCheck(gpu="h100")
    _fit_with([check])
    torch.manual_seed(0)
    m = LM()
    opt = m.configure_optimizers()
    batch = next(iter(m.train_dataloader()))
    t = md.tracer(device="cuda", gpu="h100", warmup=1)(training_step_fn(m, opt), batch)
    direct = md.fits(t, "h100")
    assert check.fit.fits and direct.fits
    assert check.fit.reserved_peak == direct.reserved_peak
    assert check.fit.line() == direct.line()
    assert check.runtime.total == md.runtime(t, "h100").total
    assert [c.op for c in check.trace.calls] == [c.op for c in t.calls]


def test_fitcheck_raises_when_it_does_not_fit():
    torch.manual_seed(0)
    with pytest.raises(DoesNotFitError, match="FitCheck: fits on H100 80 GB: no") as e:
        _trainer(callbacks=[FitCheck(gpu="h100", capacity=1024, raise_if_not_fits=True)]).fit(LM())
    assert e.value.fit is not None and not e.value.fit.fits


def test_fitcheck_max_batch_equals_md_max_batch():
    check = FitCheck(gpu="l4", capacity=200 * 2**20, find_max_batch=True)
    _fit_with([check])
    torch.manual_seed(0)
    m = LM()
    opt = m.configure_optimizers()
    step = training_step_fn(m, opt)

    def make_step(size):
        return step, ((torch.randn(size, 32), torch.randint(0, 4, (size,))),)

    direct = md.max_batch(make_step, "l4", capacity=200 * 2**20)
    assert check.max_batch.batch == direct.batch > 8
    assert check.max_batch.fits.reserved_peak == direct.fits.reserved_peak


def test_fitcheck_bf16_mixed_traces_cuda_autocast():
    check = FitCheck(gpu="h100")
    _fit_with_precision = _trainer(precision="bf16-mixed", callbacks=[check])
    torch.manual_seed(0)
    _fit_with_precision.fit(LM())
    torch.manual_seed(0)
    m = LM()
    batch = next(iter(m.train_dataloader()))
    step = training_step_fn(m, m.configure_optimizers(), lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    t = md.tracer(device="cuda", gpu="h100", warmup=1)(step, batch)
    mms = [c for c in check.trace.calls if c.op == "aten.addmm.default"]
    assert mms and all(c.outputs[0].dtype == torch.bfloat16 for c in mms)
    assert [c.op for c in check.trace.calls] == [c.op for c in t.calls]
    assert check.fit.reserved_peak == md.fits(t, "h100").reserved_peak
