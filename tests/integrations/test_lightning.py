"""Lightning: md.trace of Trainer.fit, and FitCheck against eager Lightning's own step.

Lightning is installed in CI's torch 2.14.1 leg only; elsewhere these skip.
"""

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy  # noqa: E402

import metadispatch as md  # noqa: E402
from metadispatch.errors import DoesNotFitError, UnsupportedFeatureError  # noqa: E402
from metadispatch.integrations.lightning import FitCheck, training_step_fn  # noqa: E402
from metadispatch.integrations.lightning_step import check_strategy  # noqa: E402


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


class Quiet(LM):
    """LM with a foreach AdamW and no ``self.log``: eager Lightning on the CPU then
    dispatches what FitCheck traces on the logical GPU, op for op (a CPU AdamW
    defaults to its per-parameter loop, CUDA's to foreach; FitCheck's
    ``self.log`` is a no-op)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)


class GAN(L.LightningModule):
    """Manual optimisation with two optimizers, as a GAN steps its generator and discriminator."""

    def __init__(self, log=True):
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.d = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.logs = log

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        ones = torch.ones(real.shape[0], 1, device=real.device)
        self.toggle_optimizer(opt_g)
        fake = self.g(torch.randn(real.shape[0], 8, device=real.device))
        g_loss = F.binary_cross_entropy_with_logits(self.d(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_real = F.binary_cross_entropy_with_logits(self.d(real), ones)
        d_loss = (d_real + F.binary_cross_entropy_with_logits(self.d(fake.detach()), 1 - ones)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        if self.logs:
            self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self):
        return [
            torch.optim.Adam(self.g.parameters(), lr=2e-4, foreach=True),
            torch.optim.Adam(self.d.parameters(), lr=2e-4, foreach=True),
        ]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        ds = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g))
        return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)


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
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # right after FitCheck's on_fit_start
        # (its per-optimizer records are keyed by the optimizers' ids, which differ between runs)
        self.scaler = (
            None if scaler is None else ({k: copy.copy(v) for k, v in vars(scaler).items()}, scaler.state_dict())
        )
        self.optimizers = [copy.deepcopy(opt.state_dict()) for opt in trainer.optimizers]


def _fit_with(callbacks, module=LM, plugins=(), **kw):
    torch.manual_seed(0)
    m = module()
    snap = _Snapshot()
    trainer = _trainer(callbacks=[*callbacks, snap], plugins=[copy.deepcopy(p) for p in plugins], **kw)
    trainer.fit(m)
    return m, snap, trainer


def _fp16():
    # Lightning turns precision="16-mixed" into bf16 on a CPU Trainer; the plugin keeps it
    return MixedPrecision("16-mixed", "cpu")


@pytest.mark.parametrize(
    ("module", "plugins"),
    [(LM, ()), (LM, (_fp16(),)), (GAN, ()), (GAN, (_fp16(),))],
    ids=["lm", "lm-16", "gan", "gan-16"],
)
def test_fitcheck_changes_nothing(module, plugins):
    checked, with_check, trainer = _fit_with([check := FitCheck(gpu="h100")], module, plugins)
    plain, without, reference = _fit_with([], module, plugins)
    assert check.fit.fits
    for k, v in without.state.items():
        assert torch.equal(with_check.state[k], v), k
    assert torch.equal(with_check.rng, without.rng)
    assert with_check.plain == without.plain
    assert with_check.grads == without.grads == [None] * len(without.grads)
    if plugins:  # never called: its scale not even made yet, no optimizer recorded
        (attrs, state), (attrs0, state0) = with_check.scaler, without.scaler
        assert attrs["_scale"] is None and attrs["_growth_tracker"] is None and not attrs["_per_optimizer_states"]
        assert attrs.keys() == attrs0.keys() and state == state0
    assert with_check.optimizers == without.optimizers
    # and the training that followed is the same, bit for bit: weights, optimizer state, steps, scaler
    for k, v in plain.state_dict().items():
        assert torch.equal(checked.state_dict()[k], v), k
    for a, b in zip(trainer.optimizers, reference.optimizers, strict=True):
        for sa, sb in zip(a.state.values(), b.state.values(), strict=True):
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sb)
    assert trainer.global_step == reference.global_step == (4 if module is GAN else 2)
    if plugins:
        assert trainer.precision_plugin.scaler.state_dict() == reference.precision_plugin.scaler.state_dict()


class _EagerStep(L.Callback):
    """What eager Lightning dispatches for the second batch (its first step has no optimizer state yet)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.log = md.testing._EagerLog()  # md.testing.eager_calls's log, across two hooks
            self.log.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.log.__exit__(None, None, None)
            self.ops = [c.op for c in self.log.calls]


@pytest.mark.parametrize("module", [Quiet, lambda: GAN(log=False)], ids=["automatic", "manual-two-optimizers"])
@pytest.mark.parametrize("fp16", [False, True], ids=["32", "16-mixed"])
def test_fitcheck_traces_what_eager_lightning_dispatches_for_a_step(module, fp16):
    plugins = (_fp16(),) if fp16 else ()
    check, eager = FitCheck(gpu="h100"), _EagerStep()
    _fit_with([check], module, plugins)
    _fit_with([eager], module, plugins)
    traced = [c.op for c in check.trace.calls]
    if fp16:
        # CPU's autocast and CUDA's cast at different points (log_softmax's input, its
        # gradient): the same casts, the rest op for op
        cast = "aten._to_copy.default"
        assert traced.count(cast) == eager.ops.count(cast) > 0
        traced, eager.ops = [o for o in traced if o != cast], [o for o in eager.ops if o != cast]
        steps = 2 if module is not Quiet else 1
        assert traced.count("aten._amp_foreach_non_finite_check_and_unscale_.default") == steps
        assert traced.count("aten._amp_update_scale_.default") == steps
        assert len(check.trace.assumptions) == 2 * steps  # found_inf = 0, the warmup's and the step's
    else:
        assert check.trace.assumptions == []  # nothing made up or declared
    assert traced == eager.ops


def _clipped():
    check, eager = FitCheck(gpu="h100"), _EagerStep()
    _fit_with([check], Quiet, gradient_clip_val=0.5)
    _fit_with([eager], Quiet, gradient_clip_val=0.5)
    return [c.op for c in check.trace.calls], eager.ops


def test_fitcheck_traces_the_trainers_gradient_clipping():
    traced, eager = _clipped()
    # clip_grad_norm_: the total norm clamped, then the gradients scaled, before the step
    assert traced.count("aten.clamp.default") == eager.count("aten.clamp.default") == 1
    assert traced.index("aten.clamp.default") < traced.index("aten._foreach_addcdiv_.ScalarList")
    # foreach, as on a real GPU: the gradients' norms in one call, the norm of their norms, one scaling
    assert traced.count("aten._foreach_norm.Scalar") == traced.count("aten._foreach_mul_.Tensor") == 1
    assert traced.count("aten.linalg_vector_norm.default") == 1


def test_fitcheck_gradient_clipping_is_what_eager_lightning_dispatches():
    traced, eager = _clipped()
    assert traced == eager


def test_fitcheck_steps_every_optimizer_of_a_manual_step():
    check = FitCheck(gpu="h100")
    gan, _, trainer = _fit_with([check], GAN)
    steps = [c for c in check.trace.calls if c.op == "aten._foreach_addcdiv_.ScalarList"]
    assert len(steps) == 2  # the generator's Adam and the discriminator's
    assert {c.args[0][0].shape for c in steps} == {gan.g[0].weight.shape, gan.d[0].weight.shape}
    assert md.memory(check.trace).by_category["optimizer state"] > 0


def test_fitcheck_16_mixed_traces_a_cuda_grad_scaler_and_leaves_the_users_alone():
    check = FitCheck(gpu="h100")
    _, _, trainer = _fit_with([check], LM, (_fp16(),))
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler._device == "cpu"
    ops = [c.op for c in check.trace.calls]
    mms = [c for c in check.trace.calls if c.op == "aten.addmm.default"]
    assert mms and all(c.outputs[0].dtype == torch.float16 for c in mms)  # CUDA's autocast, the plugin's dtype
    assert (
        ops.index("aten._amp_foreach_non_finite_check_and_unscale_.default")
        < ops.index("aten._foreach_addcdiv_.ScalarList")
        < ops.index("aten._amp_update_scale_.default")
    )
    # the step is traced as taken: "no inf/nan found" is listed, at the unscale-and-check, for the warmup and the step
    warm, taken = check.trace.assumptions
    assert check.trace.calls[taken.index].op == taken.op == "aten._amp_foreach_non_finite_check_and_unscale_.default"
    assert taken.value == "found_inf = 0" and taken.basis.startswith("no inf/nan found") and taken.source
    assert (warm.index, warm.op) == (0, taken.op) and "before the cut" in warm.basis
    # the scale and growth tracker are the steady state's: state on the logical GPU, from before the step
    state = [leaf for leaf in check.trace.leaves.values() if leaf.meta.shape == () and leaf.meta.device.type == "cuda"]
    assert {leaf.meta.dtype for leaf in state} >= {torch.float32, torch.int32}


@pytest.mark.parametrize("strategy", [FSDPStrategy, DDPStrategy])
def test_fitcheck_refuses_strategies_that_shard_or_wrap_the_module(strategy):
    with pytest.raises(UnsupportedFeatureError, match=f"strategy {strategy.__name__} .*world_size=N"):
        check_strategy(strategy())


def test_fitcheck_refuses_ddp_at_setup_before_anything_is_traced():
    check = FitCheck(gpu="h100")
    trainer = L.Trainer(
        strategy="ddp", devices=1, accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[check]
    )
    try:
        with pytest.raises(UnsupportedFeatureError, match="strategy DDPStrategy wraps the module"):
            trainer.fit(LM())
    finally:
        if torch.distributed.is_initialized():  # Lightning leaves its process group up after a failed fit
            torch.distributed.destroy_process_group()
    assert check.trace is None


def _without_lightnings_bookkeeping(direct, check):
    """Assert ``direct`` (training_step_fn's trace) is ``check``'s (Lightning's loop) less the
    loop's own calls: the loss divided by the accumulation (and its gradient), a detached copy
    of it, and the profiler's marks."""
    mine = [c.op for c in direct.calls if not c.op.startswith("profiler.")]
    theirs = iter([c.op for c in check.calls if not c.op.startswith("profiler.")])
    assert all(op in theirs for op in mine)  # a subsequence
    extra = Counter(c.op for c in check.calls if not c.op.startswith("profiler.")) - Counter(mine)
    assert extra == Counter({"aten.div.Tensor": 2, "aten.detach.default": 2, "aten.clone.default": 1})


def test_training_step_fn_traces_what_lightning_runs_in_automatic_optimisation():
    check = FitCheck(gpu="h100")
    _fit_with([check], Quiet)
    torch.manual_seed(0)
    m = Quiet()
    batch = next(iter(m.train_dataloader()))
    t = md.tracer(device="cuda", gpu="h100", warmup=1)(training_step_fn(m, m.configure_optimizers()), batch)
    _without_lightnings_bookkeeping(t, check.trace)
    assert md.fits(t, "h100").reserved_peak == check.fit.reserved_peak


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
    _without_lightnings_bookkeeping(t, check.trace)
    assert check.fit.reserved_peak == md.fits(t, "h100").reserved_peak
