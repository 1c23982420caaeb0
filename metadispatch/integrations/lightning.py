"""``FitCheck``: before ``Trainer.fit``, trace one training step on a logical GPU.

    trainer = L.Trainer(callbacks=[FitCheck(gpu="h100")])
    trainer.fit(model)  # logs "FitCheck: fits on H100 80 GB: yes, ...; step ... ms"

(docs/integrations.md has a run; no doctest here, as lightning is optional.)

Requirements:

- the step is the one ``fit`` runs with automatic optimisation: the
  optimizer the strategy built from ``configure_optimizers``,
  ``training_step`` under the precision plugin's forward context (a
  mixed-precision one's autocast rebuilt for ``cuda``), backward,
  ``optimizer.step`` and ``zero_grad``, on the first batch of the train
  dataloader; traced with ``md.tracer(device="cuda", gpu=gpu, warmup=1)``
  so the figure is the steady state (optimizer state alive), as
  ``md.max_batch`` does;
- the module, its optimizer and the RNG are as they were afterwards
  (Note [What FitCheck leaves behind]).

Limits: manual optimisation (``automatic_optimization = False``) is refused;
one optimizer (the first) is stepped; a strategy that shards or wraps the
module (FSDP, DeepSpeed) is not modelled -- trace those with ``md.tracer``'s
``world_size`` instead.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from .._compat import pytree
from ..analysis.fit import Fit, fits
from ..errors import DoesNotFitError, UnsupportedFeatureError
from ..ir.trace import Trace
from ..planning.batch import MaxBatch, max_batch
from ..timing.bubble import PipelineRuntime
from ..timing.runtime import Runtime, runtime
from ..tracing.tracer import tracer

__all__ = ["FitCheck", "training_step_fn", "resized_batch", "forward_context"]

log = logging.getLogger(__name__)

# Note [What FitCheck leaves behind]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# md.tracer gives back the modules, optimizers and RNG the step reaches
# (Note [What md.trace gives back]), so the traced step changes nothing.  Two
# things happen outside the trace: fetching the batch (a shuffling sampler
# draws from torch's RNG, so the fetch runs under ``fork_rng``), and
# detaching the Trainer for the trace's length -- ``self.log`` in a step that
# the Trainer's loop did not start refuses to run, and detached it is a no-op,
# which is what a dry run wants.  The Trainer is attached again in ``finally``.


def _loss(out) -> torch.Tensor:
    if isinstance(out, dict):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor):
        raise UnsupportedFeatureError(
            f"FitCheck: training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'"
        )
    return out


def training_step_fn(module: L.LightningModule, optimizer: torch.optim.Optimizer, context=None):
    """The step ``fit`` runs for one batch: ``fn(batch)`` for ``md.tracer``.

    ``context`` makes the forward's context (the precision plugin's
    ``forward_context``); none by default.
    """

    def step(batch):
        if context is None:
            out = module.training_step(batch, 0)
        else:
            with context():
                out = module.training_step(batch, 0)
        _loss(out).backward()
        optimizer.step()
        optimizer.zero_grad()

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


# Note [Autocast on the logical GPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A Trainer planned on a CPU machine has a precision plugin whose autocast is
# ``torch.autocast("cpu")``, which casts nothing on the logical CUDA device the
# step is traced on.  The step that would run on the GPU is the one under
# ``torch.autocast("cuda")`` with the plugin's dtype, so a ``MixedPrecision``
# plugin's context is rebuilt for ``cuda`` (as the plugin builds it, cache
# off).  16-mixed's GradScaler is not stepped: its few scalar ops do not move
# the peak.  Other plugins' contexts are entered as they are.


def forward_context(plugin):
    """The precision plugin's forward context for a step on the logical GPU (Note [Autocast on the logical GPU])."""
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
    (``md.max_batch`` over :func:`resized_batch`), in ``.max_batch``.
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

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise UnsupportedFeatureError(
                "FitCheck: manual optimisation (automatic_optimization=False) is not modelled; "
                "trace your step with md.tracer(device='cuda', warmup=1)"
            )
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        if optimizer is None:
            raise UnsupportedFeatureError("FitCheck: configure_optimizers gave no optimizer to step")
        batch = _first_batch(trainer, pl_module)
        step = training_step_fn(pl_module, optimizer, forward_context(trainer.precision_plugin))
        attached = pl_module._trainer
        pl_module._trainer = None  # Note [What FitCheck leaves behind]
        try:
            self.trace = tracer(device="cuda", gpu=self.gpu, warmup=1)(step, batch)
            if self.find_max_batch:
                self.max_batch = max_batch(
                    lambda size: (step, (resized_batch(batch, size),)), self.gpu, capacity=self.capacity
                )
        finally:
            pl_module._trainer = attached
        self.fit = fits(self.trace, self.gpu, self.capacity)
        self.runtime = took = runtime(self.trace, self.gpu)
        log.info("FitCheck: %s; step %.3g ms", self.fit.line(), took.total * 1e3)
        if self.raise_if_not_fits and not self.fit.fits:
            raise DoesNotFitError(f"FitCheck: {self.fit.line()}", fit=self.fit)
