"""``FitCheck``: before ``Trainer.fit``, trace one training step on a logical GPU.

    trainer = L.Trainer(callbacks=[FitCheck(gpu="h100")])
    trainer.fit(model)  # logs "FitCheck: fits on H100 80 GB: yes, ...; step ... ms"

(docs/integrations.md has a run; no doctest here, as lightning is optional.)

Requirements:

- the step is the one ``fit`` runs for a batch, by Lightning's own loop:
  automatic optimisation's closure (``training_step``, ``zero_grad``, the
  strategy's ``backward``) inside ``optimizer_step``, or, with
  ``automatic_optimization = False``, the ``training_step`` that calls
  ``manual_backward`` and steps its optimizers itself (a GAN's two); on the
  first batch of the train dataloader, under the precision plugin with its
  autocast on ``cuda`` and, for 16-mixed, a GradScaler on the logical GPU
  (Note [Autocast and GradScaler on the logical GPU]); traced with
  ``md.tracer(device="cuda", gpu=gpu, warmup=1)`` so the figure is the steady
  state (optimizer and scaler state alive), as ``md.max_batch`` does;
- the module, its optimizers, the user's scaler, the callbacks, the
  Trainer's progress and the RNG are as they were afterwards (Note [What
  FitCheck leaves behind]);
- a strategy it does not model is refused by name before anything is built
  (Note [Strategies FitCheck models]).

Limits: one batch and one optimizer step (``accumulate_grad_batches`` > 1
runs several batches a step: the figure is one of them stepped);
``self.log`` is a no-op in the traced step; a strategy that shards or wraps
the module (FSDP, DeepSpeed, DDP) is refused -- trace those with
``md.tracer``'s ``world_size``.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from .._compat import pytree
from ..analysis.fit import Fit, fits
from ..debug.check import guessing_mode
from ..errors import DoesNotFitError, UnsupportedFeatureError
from ..ir.trace import Trace
from ..mode.mode import MetaMode
from ..planning.batch import MaxBatch, max_batch
from ..timing.bubble import PipelineRuntime
from ..timing.runtime import Runtime, runtime
from ..tracing.tracer import tracer
from .lightning_step import check_strategy, dry_run, scaler_of, step_fn

__all__ = ["FitCheck", "training_step_fn", "resized_batch", "forward_context"]

log = logging.getLogger(__name__)


def _loss(out) -> torch.Tensor:
    if isinstance(out, dict):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor):
        raise UnsupportedFeatureError(
            f"FitCheck: training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'"
        )
    return out


def training_step_fn(module: L.LightningModule, optimizer: torch.optim.Optimizer, context=None):
    """Automatic optimisation's step for one batch without a Trainer: ``fn(batch)`` for ``md.tracer``.

    In Lightning's order: ``training_step``, ``zero_grad``, ``backward``,
    ``optimizer.step`` -- so the previous step's gradients are alive through
    the forward, as in ``fit`` (``FitCheck`` runs the Trainer's loop itself).
    ``context`` makes the forward's context (the precision plugin's
    ``forward_context``); none by default.
    """

    def step(batch):
        if context is None:
            out = module.training_step(batch, 0)
        else:
            with context():
                out = module.training_step(batch, 0)
        optimizer.zero_grad()
        _loss(out).backward()
        optimizer.step()

    return step


def resized_batch(batch, size: int):
    """``batch`` with ``size`` samples: each tensor whose first dimension is the batch's, as an empty ``meta`` tensor.

    The batch size is the first dimension of the first tensor in the batch;
    the step is traced on a logical device, so no data is made or read.
    """
    tensors = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise UnsupportedFeatureError("FitCheck: the batch holds no tensor with a batch dimension to resize")
    n = tensors[0].shape[0]
    return pytree.tree_map(
        lambda x: (
            torch.empty((size, *x.shape[1:]), dtype=x.dtype, device="meta")
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n
            else x
        ),
        batch,
    )


def forward_context(plugin):
    """The precision plugin's forward context for :func:`training_step_fn` on the logical GPU.

    A ``MixedPrecision`` plugin's autocast rebuilt for ``cuda``, as the
    plugin builds it (Note [Autocast and GradScaler on the logical GPU] in
    lightning_step.py); other plugins' contexts as they are.
    """
    if isinstance(plugin, MixedPrecision):
        dtype = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.half
        return lambda: torch.autocast("cuda", dtype=dtype, cache_enabled=False)
    return plugin.forward_context


def _first_batch(trainer: L.Trainer, module: L.LightningModule):
    source = trainer.datamodule if trainer.datamodule is not None else module
    with torch.random.fork_rng(devices=[]):  # Note [What FitCheck leaves behind]
        return next(iter(source.train_dataloader()))


class FitCheck(L.Callback):
    """Trace one steady-state training step at ``on_fit_start``; report ``fits`` and the step time.

    ``gpu``: the logical GPU (a profile name); ``capacity``: bytes instead
    of its memory.  After ``fit`` starts, ``.trace``, ``.fit`` (``md.fits``)
    and ``.runtime`` (``md.runtime``) hold the answers; with
    ``raise_if_not_fits=True`` a step that does not fit raises
    :class:`~metadispatch.errors.DoesNotFitError` before training begins.
    ``find_max_batch=True`` also searches the largest batch that fits
    (``md.max_batch`` over :func:`resized_batch`), in ``.max_batch``.  A
    strategy other than a single device's raises
    :class:`~metadispatch.errors.UnsupportedFeatureError` at ``setup``
    (Note [Strategies FitCheck models] in lightning_step.py).
    """

    def __init__(
        self,
        gpu: str = "h100",
        *,
        raise_if_not_fits: bool = False,
        capacity: int | None = None,
        find_max_batch: bool = False,
    ) -> None:
        self.gpu = gpu
        self.find_max_batch = find_max_batch
        self.max_batch: MaxBatch | None = None
        self.raise_if_not_fits = raise_if_not_fits
        self.capacity = capacity
        self.trace: Trace | None = None
        self.fit: Fit | None = None
        self.runtime: Runtime | PipelineRuntime | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer.strategy)  # before the strategy wraps or shards the module

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check_strategy(trainer.strategy)
        if pl_module.automatic_optimization and not trainer.optimizers:
            raise UnsupportedFeatureError("FitCheck: configure_optimizers gave no optimizer to step")
        batch = _first_batch(trainer, pl_module)
        step = step_fn(trainer, pl_module)
        # a GradScaler's step reads found_inf: declared, and listed in trace.assumptions with anything
        # else made up (Note [Autocast and GradScaler on the logical GPU])
        make = guessing_mode if scaler_of(trainer) is not None else MetaMode

        def mode():
            return make(device="cuda", gpu=self.gpu)

        with dry_run(trainer, pl_module):
            # restore="all": the callbacks the loop's hooks write come back too (Note [What FitCheck leaves behind])
            self.trace = tracer(mode_factory=mode, warmup=1, restore="all")(step, batch)
            if self.find_max_batch:
                self.max_batch = max_batch(
                    lambda size: (step_fn(trainer, pl_module), (resized_batch(batch, size),)),
                    self.gpu,
                    capacity=self.capacity,
                    mode_factory=mode,
                    restore="all",
                )
        self.fit = fits(self.trace, self.gpu, self.capacity)
        self.runtime = took = runtime(self.trace, self.gpu)
        log.info("FitCheck: %s; step %.3g ms", self.fit.line(), took.total * 1e3)
        if self.raise_if_not_fits and not self.fit.fits:
            raise DoesNotFitError(f"FitCheck: {self.fit.line()}", fit=self.fit)
