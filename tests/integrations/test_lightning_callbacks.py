"""Lightning callbacks come out of a traced step as they went in: FitCheck's
dry run and md.tracer(restore="all") (Note [What FitCheck leaves behind] in
integrations/lightning_step.py, Note [The integrations' steps are the user's]
in tracing/reach.py), against real Lightning training without them."""

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import metadispatch as md  # noqa: E402
from metadispatch.integrations.lightning import FitCheck  # noqa: E402
from tests.integrations.test_lightning import LM  # noqa: E402


class Stateful(L.Callback):
    """A user's callback that the optimisation loop's hooks write: a counter, a list of tensors, a dict."""

    def __init__(self) -> None:
        self.steps = 0
        self.norms: list = []
        self.seen: dict = {}

    def on_after_backward(self, trainer, pl_module) -> None:
        self.seen["grad"] = next(pl_module.parameters()).grad

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps += 1
        self.norms.append(torch.stack([p.grad.norm() for p in pl_module.parameters()]).sum())

    def state_dict(self) -> dict:
        return {"steps": self.steps, "norms": list(self.norms)}

    def load_state_dict(self, state) -> None:
        self.steps, self.norms = state["steps"], list(state["norms"])


def _plain(v, depth=0):
    """A callback's value as data: tensors by their values (a MetaTensor by its type), containers by content."""
    if isinstance(v, md.MetaTensor):
        return ("MetaTensor", tuple(v.shape))
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape), v.detach().tolist())
    if isinstance(v, dict):
        return {k: _plain(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, (int, float, str, bool, type(None))) or hasattr(v, "value"):  # an enum: its value
        return getattr(v, "value", v)
    return type(v).__name__


def _state(cb) -> dict:
    own = {k: v for k, v in vars(cb).items() if k not in ("log", "log_dict")}  # Lightning's bound module methods
    return {"vars": _plain(own), "state_dict": _plain(cb.state_dict())}


class _Seen(L.Callback):
    """The other callbacks' state when its on_fit_start runs (before and after FitCheck's)."""

    def __init__(self, callbacks) -> None:
        self.callbacks, self.states = callbacks, None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.states = [_state(c) for c in self.callbacks]


def _callbacks(tmp_path):
    return [
        Stateful(),
        EarlyStopping(monitor="loss", patience=3),
        LearningRateMonitor(),
        ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="loss", save_top_k=1),
    ]


def _fit(tmp_path, check: bool):
    torch.manual_seed(0)
    model, callbacks = LM(), _callbacks(tmp_path)
    before, after = _Seen(callbacks), _Seen(callbacks)
    first = [before, FitCheck(gpu="h100"), after] if check else [before, after]
    trainer = L.Trainer(
        limit_train_batches=3,
        max_epochs=2,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        gradient_clip_val=0.5,
        callbacks=[*first, *callbacks],
    )
    trainer.fit(model)
    return model, callbacks, before.states, after.states


def test_fitcheck_leaves_every_callback_as_it_was(tmp_path):
    _, callbacks, before, after = _fit(tmp_path, check=True)
    assert before == after
    assert [s["vars"]["steps"] for s in after[:1]] == [0] and after[0]["vars"]["norms"] == []


def test_training_after_fitcheck_is_bit_identical_callbacks_included(tmp_path):
    checked, with_check, _, _ = _fit(tmp_path / "checked", check=True)
    plain, without, _, _ = _fit(tmp_path / "plain", check=False)
    assert checked.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in checked.state_dict().items())
    stateful, stopping, lrs, ckpt = with_check
    assert stateful.steps == without[0].steps == 6  # two epochs of three batches, nothing from the dry run
    assert _plain(stateful.norms) == _plain(without[0].norms)
    assert _plain(stopping.state_dict()) == _plain(without[1].state_dict())
    assert lrs.lrs == without[2].lrs and lrs.lrs
    assert torch.equal(ckpt.best_model_score, without[3].best_model_score)
    assert (ckpt.best_model_path.rsplit("/", 1)[-1]) == without[3].best_model_path.rsplit("/", 1)[-1]


def test_trace_restore_all_of_a_fit_that_stops_leaves_the_callbacks_as_they_were(tmp_path):
    # EarlyStopping reads the epoch's loss: md.trace stops there, after the
    # batches' hooks wrote the callbacks; restore="all" gives back what they wrote
    torch.manual_seed(0)
    model, callbacks = LM(), _callbacks(tmp_path)
    trainer = L.Trainer(
        limit_train_batches=2,
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=callbacks,
    )
    before = [_state(c) for c in callbacks]
    with pytest.raises(md.DataDependentError, match="early_stopping.py"):
        md.tracer(restore="all")(lambda: trainer.fit(model))
    assert [_state(c) for c in callbacks] == before
