"""Everyday training-loop patterns leave the user's objects as they were.

A differential sweep: each pattern builds real objects (a small model, an
optimizer with state from a real step, schedulers, scalers, hooks,
parametrisations ...) and a step that changes them when run eagerly.  The
step is run under ``md.trace``, ``md.check`` and a bare ``MetaMode``, ending
normally or by an exception part way; afterwards everything reachable from
the user's objects -- every tensor's bytes, metadata, version counter,
``.grad``, the identity of each object in every state dict, hook tables,
tensor attributes -- must be as before, no MetaTensor (nor a tensor on
``meta``) may be reachable from them, and once the trace is dropped no real
tensor the test made may be kept alive by metadispatch.

``tests/mode/test_untouched.py`` holds the first matrix of this kind (in-place
inputs, caches on attributes, optimizers, one scheduler, dropout, RNG); the
patterns here are the ones it does not cover.
"""

from __future__ import annotations

import copy
import gc
import inspect
import io
import types
import weakref

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, prune
from torch.optim.optimizer import register_optimizer_step_post_hook

import metadispatch as md
from metadispatch.tensor.tensor import MetaTensor


def _x():
    return torch.randn(4, 6)


def _model():
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _loss(model, x):
    return model(x).pow(2).mean()


def _eager_step(model, opt=None):
    """One real step, so that .grad and the optimizer's state exist."""
    _loss(model, _x()).backward()
    if opt is not None:
        opt.step()


# Each pattern returns (step, args, roots); roots name the user's objects.


def _with_optimizer(make, prepare=None):
    def pattern():
        m = _model()
        if prepare is not None:
            prepare(m[0])
        opt = make(m.parameters())
        _eager_step(m, opt)

        def step(x):
            opt.zero_grad()
            _loss(m, x).backward()
            opt.step()

        return step, (_x(),), {"m": m, "opt": opt}

    return pattern


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
    "adamw_for_loop": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
}
PATTERNS = {f"optimizer_{name}": _with_optimizer(make) for name, make in OPTIMIZERS.items()}


def pattern(fn):
    PATTERNS[fn.__name__] = fn
    return fn


@pattern
def zero_grad_keeps_grads():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _eager_step(m)

    def step(x):
        opt.zero_grad(set_to_none=False)
        _loss(m, x).backward()
        opt.step()

    return step, (_x(),), {"m": m, "opt": opt}


def _with_scheduler(make, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
    def pattern():
        m = _model()
        opt = optimizer(m.parameters())
        sched = make(opt)
        _eager_step(m, opt)
        sched.step()

        def step(x):
            opt.zero_grad()
            _loss(m, x).backward()
            opt.step()
            sched.step()

        return step, (_x(),), {"m": m, "opt": opt, "sched": sched}

    return pattern


PATTERNS["scheduler_step_lr"] = _with_scheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))
PATTERNS["scheduler_one_cycle"] = _with_scheduler(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=10))
PATTERNS["scheduler_lambda"] = _with_scheduler(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9**e))


def _scaler_pattern(used_before: bool):
    def pattern():
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)

        def step(x):
            opt.zero_grad()
            scaler.scale(_loss(m, x)).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()

        if used_before:
            step(_x())
        return step, (_x(),), {"m": m, "opt": opt, "scaler": scaler}

    return pattern


PATTERNS["grad_scaler_fresh"] = _scaler_pattern(False)
PATTERNS["grad_scaler_used"] = _scaler_pattern(True)


@pattern
def clip_grad_value():
    m = _model()
    _eager_step(m)

    def step(x):
        _loss(m, x).backward()
        nn.utils.clip_grad_value_(m.parameters(), 0.01)
        nn.utils.clip_grad_norm_(m.parameters(), 0.1, foreach=False)

    return step, (_x(),), {"m": m}


@pattern
def ema_averaged_model():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ema = torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    _eager_step(m, opt)
    ema.update_parameters(m)

    def step(x):
        opt.zero_grad()
        _loss(m, x).backward()
        opt.step()
        ema.update_parameters(m)

    return step, (_x(),), {"m": m, "opt": opt, "ema": ema}


@pattern
def swa_averaged_model():
    m = _model()
    swa = torch.optim.swa_utils.AveragedModel(m)
    swa.update_parameters(m)

    def step(x):
        _loss(m, x).backward()
        swa.update_parameters(m)

    return step, (_x(),), {"m": m, "swa": swa}


def _parametrized(apply):
    return _with_optimizer(lambda ps: torch.optim.Adam(ps, lr=0.01), prepare=apply)


PATTERNS["weight_norm"] = _parametrized(parametrizations.weight_norm)
PATTERNS["spectral_norm"] = _parametrized(parametrizations.spectral_norm)
PATTERNS["orthogonal"] = _parametrized(parametrizations.orthogonal)
PATTERNS["pruned_l1"] = _parametrized(lambda lin: prune.l1_unstructured(lin, "weight", amount=0.4))


def _batchnorm(**kwargs):
    def pattern():
        m = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5, **kwargs), nn.Linear(5, 3))
        _eager_step(m)

        def step(x):
            m.train()
            _loss(m, x).backward()

        return step, (_x(),), {"m": m}

    return pattern


PATTERNS["batchnorm_cumulative"] = _batchnorm(momentum=None)
PATTERNS["batchnorm_no_running_stats"] = _batchnorm(track_running_stats=False)


@pattern
def module_hooks_keep_tensors():
    m = _model()
    kept: dict = {"pre": [], "fwd": [], "bwd": []}
    m[0].register_forward_pre_hook(lambda mod, args: kept["pre"].append(args[0] * 1))
    m[1].register_forward_hook(lambda mod, args, out: kept["fwd"].append(out))
    m[2].register_full_backward_hook(lambda mod, gin, gout: kept["bwd"].append(gout[0]))
    _eager_step(m)  # the lists hold real tensors before the trace

    def step(x):
        _loss(m, x).backward()

    return step, (_x(),), {"m": m, "kept": kept}


@pattern
def tensor_hooks_keep_tensors():
    m = _model()
    kept: list = []
    seen: list = []
    m[0].weight.register_hook(lambda g: kept.append(g) or g * 2)
    m[2].bias.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    _eager_step(m)

    def step(x):
        _loss(m, x).backward()

    return step, (_x(),), {"m": m, "kept": kept, "seen": seen}


@pattern
def hook_registered_in_step():
    m = _model()
    kept: list = []

    def step(x):
        m[0].register_forward_hook(lambda mod, args, out: kept.append(out))
        m[2].weight.register_hook(lambda g: kept.append(g))
        _loss(m, x).backward()

    return step, (_x(),), {"m": m, "kept": kept}


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embed(ids))))


@pattern
def tied_weights():
    m = Tied()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.tensor([[1, 2, 3]])).logsumexp(-1).mean().backward()
    opt.step()

    def step(ids):
        opt.zero_grad()
        m(ids).logsumexp(-1).mean().backward()
        opt.step()

    return step, (torch.tensor([[3, 4, 5], [0, 1, 6]]),), {"m": m, "opt": opt}


@pattern
def freeze_inside_step():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    _eager_step(m, opt)

    def step(x):
        m[0].requires_grad_(False)
        opt.zero_grad()
        _loss(m, x).backward()
        opt.step()
        m[0].requires_grad_(True)
        m[2].weight.requires_grad = False

    return step, (_x(),), {"m": m, "opt": opt}


@pattern
def no_grad_and_inference_mode():
    m = _model()
    _eager_step(m)

    def step(x):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(p.grad, alpha=-0.1)
        with torch.inference_mode():
            m(x).sum()
        m.eval()
        with torch.no_grad():
            m(x)
        m.train()
        _loss(m, x).backward()

    return step, (_x(),), {"m": m}


@pattern
def gradient_accumulation():
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    _eager_step(m, opt)

    def step(x):
        opt.zero_grad()
        for micro in x.chunk(2):
            (_loss(m, micro) / 2).backward()
        opt.step()

    return step, (_x(),), {"m": m, "opt": opt}


@pattern
def half_inside_step():
    m = _model()
    _eager_step(m)

    def step(x):
        m.to(torch.bfloat16)
        _loss(m, x.bfloat16()).backward()
        m.half()
        m.float()

    return step, (_x(),), {"m": m}


@pattern
def state_dict_round_trip():
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    _eager_step(m, opt)
    saved: dict = {}

    def step(x):
        saved["model"] = m.state_dict()
        saved["opt"] = opt.state_dict()
        opt.zero_grad()
        _loss(m, x).backward()
        opt.step()
        m.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])

    return step, (_x(),), {"m": m, "opt": opt, "saved": saved}


@pattern
def load_state_dict_of_real_tensors():
    m = _model()
    other = _model()

    def step(x):
        m.load_state_dict(other.state_dict())
        _loss(m, x).backward()

    return step, (_x(),), {"m": m, "other": other}


@pattern
def torch_save_in_step():
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    _eager_step(m, opt)
    buffers: list = []

    def step(x):
        _loss(m, x).backward()
        opt.step()
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
        buffers.append(buf)

    return step, (_x(),), {"m": m, "opt": opt, "buffers": buffers}


@pattern
def loss_item_logged():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _eager_step(m)
    losses: list = []

    def step(x):
        loss = _loss(m, x)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    return step, (_x(),), {"m": m, "opt": opt, "losses": losses}


class Trainer:
    """The user's own object holding the model, optimizer and bookkeeping."""

    def __init__(self):
        self.model = _model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.steps = 0
        self.last_loss = None
        self.history: list = []

    def step(self, x):
        self.opt.zero_grad()
        loss = _loss(self.model, x)
        loss.backward()
        self.opt.step()
        self.steps += 1
        self.last_loss = loss.detach()
        self.history.append(self.last_loss)


@pattern
def trainer_object():
    trainer = Trainer()
    trainer.step(_x())
    return trainer.step, (_x(),), {"trainer": trainer}


@pattern
def module_zero_grad_and_vector_to_parameters():
    m = _model()
    _eager_step(m)

    def step(x):
        m.zero_grad(set_to_none=False)
        _loss(m, x).backward()
        vec = nn.utils.parameters_to_vector(m.parameters())
        nn.utils.vector_to_parameters(vec - 0.1 * vec, m.parameters())

    return step, (_x(),), {"m": m}


@pattern
def manual_warmup_and_new_param_group():
    m = _model()
    extra = nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    _eager_step(m, opt)

    def step(x):
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.5
        if len(opt.param_groups) == 1:
            opt.add_param_group({"params": [extra], "lr": 0.01})
        opt.zero_grad()
        (_loss(m, x) + extra.sum()).backward()
        opt.step()

    return step, (_x(),), {"m": m, "opt": opt, "extra": extra}


def _chained(opt):
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])


PATTERNS["chained_schedulers"] = _with_scheduler(_chained, lambda ps: torch.optim.AdamW(ps, lr=0.1))


@pattern
def reduce_on_plateau():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    sched.step(1.0)

    def step(x):
        loss = _loss(m, x)
        loss.backward()
        opt.step()
        sched.step(loss.detach())

    return step, (_x(),), {"m": m, "opt": opt, "sched": sched}


@pattern
def autocast_bf16():
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    _eager_step(m, opt)

    def step(x):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(m, x)
        loss.float().backward()
        opt.step()

    return step, (_x(),), {"m": m, "opt": opt}


@pattern
def teacher_copy_and_functional_call():
    m = _model()
    held: dict = {}
    params = dict(m.named_parameters())

    def step(x):
        held["teacher"] = copy.deepcopy(m)
        with torch.no_grad():
            target = held["teacher"](x)
        out = torch.func.functional_call(m, params, (x,))
        (out - target).pow(2).mean().backward()

    return step, (_x(),), {"m": m, "held": held, "params": params}


@pattern
def pruned_inside_step():
    m = _model()
    _eager_step(m)

    def step(x):
        prune.l1_unstructured(m[0], "weight", amount=0.3)
        _loss(m, x).backward()

    return step, (_x(),), {"m": m}


@pattern
def parametrized_inside_step():
    m = _model()
    _eager_step(m)

    def step(x):
        parametrizations.weight_norm(m[2])
        _loss(m, x).backward()
        torch.nn.utils.parametrize.remove_parametrizations(m[2], "weight")

    return step, (_x(),), {"m": m}


@pattern
def seeded_dropout_in_step():
    m = nn.Sequential(nn.Linear(6, 5), nn.Dropout(0.3))

    def step(x):
        torch.manual_seed(123)
        m(x).sum().backward()

    return step, (_x(),), {"m": m}


@pattern
def grads_deleted_and_set_in_step():
    m = _model()
    _eager_step(m)
    g = torch.ones(3, 5)

    def step(x):
        for p in m.parameters():
            del p.grad
        m[2].weight.grad = g
        _loss(m, x).backward()
        m[0].weight.grad.mul_(0)

    return step, (_x(),), {"m": m, "g": g}


# ---------------------------------------------------------------------------


def _snapshot(step, args, roots):
    return md.testing.snapshot(step=step, args=args, **roots)


def _extra_state(roots) -> dict:
    """What ``md.testing.snapshot`` does not describe: tensor hook tables and
    tensor attributes, by identity; a module's class (parametrisations)."""
    out = {}
    for path, t in _tensors(roots):
        hooks = t._backward_hooks
        out[path] = (
            type(t).__name__,
            None if hooks is None else [(k, id(v)) for k, v in hooks.items()],
            [(k, id(v)) for k, v in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).items()],
            sorted((k, id(v)) for k, v in vars(t).items()) if hasattr(t, "__dict__") else None,
        )
    for name, obj in roots.items():
        if isinstance(obj, nn.Module):
            for sub_name, sub in obj.named_modules(remove_duplicate=False):
                out[f"{name}.{sub_name}<class>"] = type(sub)
    return out


def _tensors(roots):
    seen = set()
    for name, obj in roots.items():
        for path, t in _reachable(name, obj):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                yield path, t


def _reachable(name, root):
    """Everything ``root`` reaches through Python references (gc) and the
    attributes gc does not see (a tensor's .grad and hook tables)."""
    stack, seen = [(name, root)], set()
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type, types.CodeType, types.FrameType)):
            continue
        if isinstance(obj, dict) and "__builtins__" in obj:  # a module's globals
            continue
        if isinstance(obj, types.FunctionType) and obj.__module__.startswith(("torch", "metadispatch")):
            continue
        seen.add(id(obj))
        yield path, obj
        children = list(gc.get_referents(obj))
        if isinstance(obj, torch.Tensor):
            children += [
                obj.grad if obj.is_leaf else None,
                obj._backward_hooks,
                getattr(obj, "_post_accumulate_grad_hooks", None),
            ]
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in obj.items() if not isinstance(k, torch.Tensor))
        stack.extend((f"{path}.*", c) for c in children if c is not None)


def _metas(roots) -> list:
    return [
        path
        for name, obj in roots.items()
        for path, t in _reachable(name, obj)
        if isinstance(t, MetaTensor) or isinstance(t, torch.Tensor) and t.is_meta
    ]


def _run(verb, step, args):
    # restore="all": the whole roll-back, which these patterns hold to; the
    # default gives back the machinery only (test_untouched.py's
    # test_untouched_default_keeps_what_the_step_wrote_as_eager_does).
    if verb == "trace":
        return md.tracer(restore="all")(step, *args)
    if verb == "check":
        return md.checker(restore="all")(step, *args)
    with md.MetaMode() as mode:
        step(*args)
    return mode


def _ending(step, ending):
    """The step, ending as asked: ``returns``, or ``interrupted`` part way --
    a KeyboardInterrupt from the first optimizer step (after it, before
    schedulers, scalers and EMA updates), else from the end of the first
    forward (before backward), else at the end."""
    if ending == "returns":
        return step

    def interrupt(*_):
        raise KeyboardInterrupt

    def ended(*args):
        hooks = [
            register_optimizer_step_post_hook(interrupt),
            nn.modules.module.register_module_forward_hook(interrupt),
        ]
        try:
            step(*args)
        finally:
            for h in hooks:
                h.remove()
        raise KeyboardInterrupt

    return ended


# Patterns that read a value of the data on the way (``loss.item()``, a
# scaler's ``found_inf.item()``): md.trace and a bare MetaMode stop there
# with a DataDependentError -- which must leave everything as it was too;
# md.check answers them with the real kernel.  ``torch.save`` of
# MetaTensors is refused by name.  (Counters in buffers are known values:
# test_training_patterns_counter_buffers_trace_as_eager_runs.)
STOPS = {
    "grad_scaler_fresh": (md.DataDependentError, {"trace", "MetaMode"}),
    "grad_scaler_used": (md.DataDependentError, {"trace", "MetaMode"}),
    "torch_save_in_step": (md.UnsupportedFeatureError, {"trace", "MetaMode"}),  # Note [torch.save inside a traced step]
    "loss_item_logged": (md.DataDependentError, {"trace", "MetaMode"}),
    "reduce_on_plateau": (md.DataDependentError, {"trace", "MetaMode"}),
}

# docs/untouched.md, Limits: a bare MetaMode does not know the user's
# objects -- it saves a module at its first forward and an optimizer at its
# first step; what the block stores in the user's own lists and dicts is the
# block's output, MetaTensors.  md.trace covers all of these.
_NOT_SAVED = "a bare MetaMode saves no {}; md.trace does"
_AFTER_STEP = _NOT_SAVED.format("module before its forward (n_averaged += 1)")
_IN_FORWARD = _NOT_SAVED.format("list or dict the block stores in")
_BEFORE_FORWARD = _NOT_SAVED.format("module changed before its first forward")
# name -> (reason, the endings it fails for: an interrupt at the first
# optimizer step or forward comes before an EMA update or a scheduler step)
_BARE_MODE_MISSES = {
    "ema_averaged_model": (_AFTER_STEP, {"returns"}),
    "swa_averaged_model": (_AFTER_STEP, {"returns"}),
    "grad_scaler_fresh": (_NOT_SAVED.format("GradScaler"), {"returns"}),
    "grad_scaler_used": (_NOT_SAVED.format("GradScaler"), {"returns"}),
    "scheduler_lambda": (_NOT_SAVED.format("scheduler"), {"returns"}),
    "scheduler_one_cycle": (_NOT_SAVED.format("scheduler"), {"returns"}),
    "scheduler_step_lr": (_NOT_SAVED.format("scheduler"), {"returns"}),
    "hook_registered_in_step": (_IN_FORWARD, {"returns", "interrupted"}),
    "module_hooks_keep_tensors": (_IN_FORWARD, {"returns", "interrupted"}),
    "state_dict_round_trip": (_IN_FORWARD, {"returns", "interrupted"}),
    "tensor_hooks_keep_tensors": (_IN_FORWARD, {"returns"}),
    "chained_schedulers": (_NOT_SAVED.format("scheduler"), {"returns"}),
    "pruned_inside_step": (_BEFORE_FORWARD, {"returns", "interrupted"}),
    "parametrized_inside_step": (_BEFORE_FORWARD, {"returns", "interrupted"}),
    "manual_warmup_and_new_param_group": (
        _NOT_SAVED.format("optimizer before its first step (param_groups written)"),
        {"returns", "interrupted"},
    ),
    "teacher_copy_and_functional_call": (
        _NOT_SAVED.format("dict: functional_call writes the module's tensors, the stand-ins, back into it"),
        {"returns", "interrupted"},
    ),
    "trainer_object": (_NOT_SAVED.format("object of the user's own class"), {"returns"}),
}


# How each verb's run ends.  An exception after md.check's step is reported,
# not raised; one after md.trace's step is test_untouched.py's ("raises"),
# and the interrupt part way here reaches the same exits earlier.
_ENDINGS = {
    "trace": ("returns", "interrupted"),
    "check": ("returns", "interrupted"),
    "MetaMode": ("returns", "interrupted"),
}


def _cases():
    for name in sorted(PATTERNS):
        for verb, endings in _ENDINGS.items():
            for ending in endings:
                reason, endings = _BARE_MODE_MISSES.get(name, (None, ()))
                miss = verb == "MetaMode" and ending in endings
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if miss else []
                yield pytest.param(name, verb, ending, marks=marks, id=f"{name}-{verb}-{ending}")


def _raised(name, verb, ending):
    """What running the pattern ``verb``-wise and ending ``ending`` raises."""
    stop, verbs = STOPS.get(name, (None, ()))
    if ending == "interrupted":  # part way: before or after the stop
        return (stop, KeyboardInterrupt) if verb in verbs else KeyboardInterrupt
    return stop if verb in verbs else None


@pytest.mark.parametrize(("name", "verb", "ending"), list(_cases()))
def test_training_patterns_leave_user_objects_as_they_were(name, verb, ending):
    torch.manual_seed(0)
    step, args, roots = PATTERNS[name]()
    run = _ending(step, ending)
    before, extra = _snapshot(step, args, roots), _extra_state(roots)
    raised = _raised(name, verb, ending)
    if raised is None:
        _run(verb, run, args)
    else:
        with pytest.raises(raised):
            _run(verb, run, args)
    before.assert_unchanged(_snapshot(step, args, roots))
    assert _extra_state(roots) == extra
    assert _metas({"step": step, "args": args, **roots}) == []


def test_training_patterns_change_their_objects_when_run_eagerly():
    """The sweep can fail: run for real, every pattern changes what it reaches."""
    unchanged = []
    for name, make in PATTERNS.items():
        torch.manual_seed(0)
        step, args, roots = make()
        before, extra = _snapshot(step, args, roots), _extra_state(roots)
        step(*args)
        if _snapshot(step, args, roots) == before and _extra_state(roots) == extra:
            unchanged.append(name)
    assert unchanged == []


def test_training_patterns_keep_no_real_tensor_alive():
    """Every pattern traced, its objects dropped while the trace lives: no
    real tensor they reached survives.  One test, one full collection (a
    collection per pattern was most of this file's time); the message names
    every pattern that keeps one."""
    refs, traces = {}, []
    for name, make in sorted(PATTERNS.items()):
        torch.manual_seed(0)
        step, args, roots = make()
        refs[name] = [weakref.ref(t) for _, t in _tensors({"step": step, "args": args, **roots})]
        assert refs[name], name
        stop = STOPS.get(name, (None,))[0]
        try:
            traces.append(md.trace(step, *args))
        except Exception as e:  # what stopped the step holds no real tensor either
            assert stop is not None and isinstance(e, stop), (name, e)
            traces.append(e.with_traceback(None))  # its frames are the step's, which hold the user's objects
        del step, args, roots
    gc.collect()
    alive = {name: n for name, rs in refs.items() if (n := sum(r() is not None for r in rs))}
    assert alive == {}, f"real tensors alive while the traces live, by pattern: {alive}"
    assert len(traces) == len(PATTERNS)


def test_training_patterns_loss_item_stops_naming_the_op_and_the_line():
    step, args, roots = PATTERNS["loss_item_logged"]()
    with pytest.raises(md.DataDependentError) as e:
        md.trace(step, *args)
    lines, first = inspect.getsourcelines(step)
    line = first + next(i for i, text in enumerate(lines) if "loss.item()" in text)
    assert "aten._local_scalar_dense.default" in str(e.value)
    assert f"test_training_patterns.py:{line} in step" in "\n".join(e.value.__notes__)
    assert roots["losses"] == []


def test_training_patterns_parameter_hooks_run_in_the_trace_as_in_eager():
    """Hooks on the real parameters -- a gradient scaled by ``register_hook``,
    an optimizer step in backward by ``register_post_accumulate_grad_hook``
    (torch's own recipe) -- run on their stand-ins: the trace holds their
    ops, as the eager run does, and the model is left as it was."""
    m = _model()
    m[0].weight.register_hook(lambda g: g * 2)

    def step_in_backward(p):
        p.add_(p.grad, alpha=-0.1)
        p.grad = None

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    x = _x()
    before = md.testing.snapshot(m)
    trace = md.trace(lambda x: _loss(m, x).backward(), x)
    before.assert_unchanged(md.testing.snapshot(m))
    eager = md.testing.eager_calls(lambda x: _loss(m, x).backward(), x)
    assert md.testing.trace_calls(trace) == eager
    assert sum(c.op == "aten.add_.Tensor" for c in eager) == 4  # the hooks ran


def test_training_patterns_parameter_attributes_are_read_through_stand_ins():
    """Training code reads flags it set on its parameters (Megatron's
    ``param.sequence_parallel``); the stand-in has them, the real one keeps its own."""
    m = _model()
    m[0].weight.sequence_parallel = True

    def step(x):
        scale = 2.0 if m[0].weight.sequence_parallel else 1.0
        m[0].weight.sequence_parallel = False  # rebinding on the stand-in
        return (_loss(m, x) * scale).backward()

    trace = md.trace(step, _x())
    assert m[0].weight.sequence_parallel is True
    assert any(c.op == "aten.mul.Tensor" and 2.0 in c.args for c in trace)


@pytest.mark.parametrize("name", ["batchnorm_cumulative", "swa_averaged_model", "ema_averaged_model"])
def test_training_patterns_counter_buffers_trace_as_eager_runs(name):
    """``BatchNorm(momentum=None)`` divides by ``num_batches_tracked`` and
    ``AveragedModel`` branches on ``n_averaged``: the trace reads their values
    (Note [Counters in buffers]) and runs the ops eager runs, where it
    stopped with a DataDependentError."""
    torch.manual_seed(0)
    step, args, roots = PATTERNS[name]()
    trace = md.trace(step, *args)
    assert any("known value" in line for line in trace.lines())
    assert md.testing.trace_calls(trace) == md.testing.eager_calls(step, *args)


def _gpt2_training():
    """A tiny GPT-2 (tied embedding and head) with AdamW, a warm-up schedule
    from transformers, clipping and a loss log, after one real step."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=40, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, 10)
    log: dict = {"loss": []}

    def step(ids):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        log["loss"].append(loss.detach())

    step(torch.randint(0, 40, (2, 8)))
    return step, (torch.randint(0, 40, (2, 8)),), {"model": model, "opt": opt, "sched": sched, "log": log}


@pytest.mark.slow  # ~5 s: a transformers import and a GPT-2 step traced and checked
@pytest.mark.parametrize("verb", ["trace", "check"])
def test_training_patterns_transformers_gpt2_step_leaves_its_objects_as_they_were(verb):
    step, args, roots = _gpt2_training()
    for ending in ("returns", "interrupted"):
        before, extra = _snapshot(step, args, roots), _extra_state(roots)
        if ending == "returns":
            _run(verb, step, args)
        else:
            with pytest.raises(KeyboardInterrupt):
                _run(verb, _ending(step, ending), args)
        before.assert_unchanged(_snapshot(step, args, roots))
        assert _extra_state(roots) == extra
        assert _metas({"step": step, "args": args, **roots}) == []
