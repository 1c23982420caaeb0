"""One batch as ``Trainer.fit`` runs it, ready to trace on a logical GPU.

``FitCheck`` (lightning.py) traces what this module gives it:
:func:`step_fn` runs the Trainer's own optimisation loop for one batch --
automatic optimisation's closure inside ``optimizer_step``, or a manual
``training_step`` that steps its optimizers itself -- and :func:`dry_run`
sets the Trainer up for that run and puts it back.

Requirements:

- what is traced is what Lightning dispatches for the batch: its hooks, the
  precision plugin, the strategy's ``backward`` and ``optimizer_step``, the
  user's overrides of them;
- on the logical GPU, as the step would run there, although the Trainer
  was made on a CPU (Note [Autocast and GradScaler on the logical GPU]);
- nothing of the user's is left changed (Note [What FitCheck leaves behind]).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy

from ..errors import UnsupportedFeatureError

__all__ = ["check_strategy", "step_fn", "dry_run", "scaler_of"]

# Note [Strategies FitCheck models]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# FitCheck models one process with the whole module: a single-device
# strategy.  FSDP and DeepSpeed shard the parameters, gradients and
# optimizer state over ranks and gather them per layer, and DDP wraps the
# module and all-reduces its gradients; their step is not the module's, and
# tracing the unwrapped step would give a figure N times too large (FSDP) or
# without the collectives' buckets (DDP), with nothing to say so.  They are
# refused by name, in ``setup`` -- before the strategy wraps or shards
# anything -- with what models them: one rank of a logical world
# (``md.tracer(world_size=N)``, ``metadispatch trace --world-size N --fsdp``,
# ``md.plan``).  Lightning builds FSDP only on a GPU Trainer and DeepSpeed
# only where it is installed; the refusal reads the strategy's class, so it
# needs neither.
_SHARDING = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAFSDPStrategy")


def check_strategy(strategy) -> None:
    """Raise :class:`~metadispatch.errors.UnsupportedFeatureError` for a strategy FitCheck does not model."""
    if isinstance(strategy, SingleDeviceStrategy):
        return
    name = type(strategy).__name__
    shards = any(c.__name__ in _SHARDING for c in type(strategy).__mro__)
    what = "shards the parameters, gradients and optimizer state over ranks" if shards else "wraps the module"
    cli = "--fsdp" if shards else "--dp"
    raise UnsupportedFeatureError(
        f"FitCheck: strategy {name} {what}, which FitCheck does not model (it traces one device holding the whole "
        "module; Note [Strategies FitCheck models]). Trace one rank of a logical world instead: "
        f"md.tracer(world_size=N) on the wrapped step, `metadispatch trace --world-size N {cli}`, or md.plan"
    )


def scaler_of(trainer: L.Trainer):
    """The precision plugin's GradScaler (16-mixed), or None."""
    return getattr(trainer.precision_plugin, "scaler", None)


# Note [Autocast and GradScaler on the logical GPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A Trainer planned on a CPU machine has a ``MixedPrecision`` plugin whose
# autocast is ``torch.autocast("cpu")``, which casts nothing on the logical
# CUDA device the step is traced on, and a 16-mixed plugin's GradScaler is
# a CPU one (Lightning itself turns ``precision="16-mixed"`` into bf16 on a
# CPU; ``plugins=[MixedPrecision("16-mixed", "cpu")]`` keeps it).  For the
# trace the plugin's device is ``cuda`` -- Lightning's own autocast then is
# CUDA's, in the plugin's dtype -- and its scaler is a CUDA GradScaler with
# the user's scale, factors, interval and growth count (its ``state_dict``,
# read before the trace), made inside the traced step (made outside, on a
# host without CUDA, it disables itself) and kept across the warmup, so its
# scale and growth tracker are the steady state's and its ``scale``,
# unscale-and-check and ``update`` calls are in the trace.  The step then
# asks ``found_inf.item()``, whether to skip ``optimizer.step``; the
# tracing mode declares it as md.check does -- no inf/nan found, the step is
# taken -- one assumption per unscale-and-check in ``trace.assumptions``
# (Note [GradScaler's found_inf] in values/assume.py).  The user's scaler is
# never called.


def step_fn(trainer: L.Trainer, module: L.LightningModule):
    """``fn(batch)`` for ``md.tracer``: the Trainer's loop for one batch (batch index 0)."""
    plugin = trainer.precision_plugin
    user = scaler_of(trainer)
    state = user.state_dict() if user is not None and user.is_enabled() else None
    epoch_loop = trainer.fit_loop.epoch_loop
    made: list = []  # the logical GPU's scaler, kept from the warmup to the step

    def step(batch):
        kwargs = OrderedDict(batch=batch, batch_idx=0)
        if user is not None:
            if not made:
                made.append(torch.amp.GradScaler("cuda", enabled=state is not None))
                if state is not None:
                    made[0].load_state_dict(state)
            plugin.scaler = made[0]
        try:
            if module.automatic_optimization:
                epoch_loop.automatic_optimization.run(trainer.optimizers[0], 0, kwargs)
            else:
                epoch_loop.manual_optimization.run(kwargs)
        finally:
            if user is not None:
                plugin.scaler = user

    return step


def _no_log(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def dry_run(trainer: L.Trainer, module: L.LightningModule):
    """The Trainer set up for :func:`step_fn`'s run, and put back however it ends.

    Note [What FitCheck leaves behind]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    md.tracer gives back the modules, optimizers, grad scalers and RNG the
    step reaches (Note [What md.trace gives back]), and with
    ``restore="all"`` every object, list and dict it reaches through the
    Trainer -- the callbacks, whose hooks the loop calls (``on_after_backward``,
    ``on_before_optimizer_step``: a counter, a list of gradient norms,
    ``ModelCheckpoint``'s and ``EarlyStopping``'s records), the loops'
    records (Note [The integrations' steps are the user's] in
    tracing/reach.py) -- so the traced step changes none of them.  What
    Lightning's loop changes besides is put back
    here: the optimisation progress it counts (``global_step`` reads it) and,
    for the run's length, the plugin's autocast device (Note [Autocast and
    GradScaler on the logical GPU]).  ``self.log`` is a no-op in the run: at
    ``on_fit_start`` Lightning refuses it, and a dry run logs nothing.  The
    batch is fetched outside the trace, under ``fork_rng`` (a shuffling
    sampler draws from torch's RNG).
    """
    plugin = trainer.precision_plugin
    loops = trainer.fit_loop.epoch_loop
    progress = [
        (p, p.state_dict())
        for p in (loops.automatic_optimization.optim_progress, loops.manual_optimization.optim_step_progress)
    ]
    device = plugin.device if isinstance(plugin, MixedPrecision) else None
    own = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    try:
        if device is not None:
            plugin.device = "cuda"
        module.log = module.log_dict = _no_log
        yield
    finally:
        for key in ("log", "log_dict"):
            if key in own:
                module.__dict__[key] = own[key]
            else:
                module.__dict__.pop(key, None)
        if device is not None:
            plugin.device = device
        for p, saved in progress:
            p.load_state_dict(saved)
