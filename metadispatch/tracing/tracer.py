"""The verbs: ``to_meta`` and ``trace``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _compat
from .._compat import pytree
from ..errors import MetaDispatchError
from ..ir.cut import step_from, step_until
from ..ir.records import arg_name, describe_constant
from ..ir.trace import Trace
from ..mode.mode import MetaMode
from ..standins.standins import StandIns
from ..tensor.convert import Converter
from ..tensor.state import state_of
from ..tensor.tensor import MetaTensor
from ..values import known
from .leafviews import bind_views
from .reach import find, holds_state, is_container, is_machinery

__all__ = ["to_meta", "trace", "tracer"]


def to_meta(x: Any, device=None) -> Any:
    """A MetaTensor copy (metadata only) of a tensor, module or pytree.

    A module comes back as a new module whose parameters and buffers are
    MetaTensors; the original is untouched, no data is copied, and tied
    parameters stay tied.

    >>> import torch, metadispatch as md
    >>> lin = md.to_meta(torch.nn.Linear(4, 2), device="cuda")
    >>> lin.weight
    MetaTensor(f32[2, 4], device='cuda:0', requires_grad=True)
    """
    convert = Converter(device)
    if isinstance(x, nn.Module):
        return _module_to_meta(x, convert)
    return pytree.tree_map(
        lambda v: (
            convert(v)
            if isinstance(v, torch.Tensor)
            else _module_to_meta(v, convert)
            if isinstance(v, nn.Module)
            else v
        ),
        x,
    )


def _module_to_meta(module: nn.Module, convert: Converter) -> nn.Module:
    # deepcopy with the memo pre-filled: every parameter and buffer maps to
    # its stand-in, so no tensor data is copied and sharing is kept.
    memo: dict = {}
    for t in list(module.parameters()) + list(module.buffers()):
        memo[id(t)] = convert(t)
    return copy.deepcopy(module, memo)


RESTORE = ("machinery", "all")


def check_restore(restore) -> None:
    """Refuse a ``restore=`` that is not one of :data:`RESTORE`."""
    if restore not in RESTORE:
        raise MetaDispatchError(f"restore={restore!r}: one of {', '.join(map(repr, RESTORE))}")


def tracer(
    device=None,
    *,
    stack: bool = False,
    gpu=None,
    world_size: int | None = None,
    rank: int = 0,
    restore: str = "machinery",
    mode_factory=None,
    warmup: int = 0,
    assume=None,
    known_limit: int | None = None,
) -> Tracer:
    """``md.trace`` with options: ``md.tracer(device="cuda", gpu="a100-80gb", stack=True)(fn, x)``.

    ``gpu`` names the profile a logical CUDA device answers as (MetaMode's
    ``gpu``); ``world_size`` and ``rank`` trace rank ``rank`` of a logical
    world (``MetaMode``'s options of the same names; ``docs/distributed.md``).
    ``restore``: what the trace gives back as it was (Note [What md.trace
    gives back]): ``"machinery"`` (the default) the modules, optimizers,
    schedulers, grad scalers and RNG the step reaches, leaving what the step
    wrote anywhere else as it left it, as eager does; ``"all"`` every list,
    dict, set and object of the user's it reaches too, for a dry run that
    leaves nothing behind.  (Options are ``md.tracer``'s: ``md.trace(fn,
    *args, **kwargs)`` hands every keyword to ``fn``.)

    ``warmup=N`` runs ``fn`` N times first and returns the trace of the
    next call: the steady-state step, with what the first N left alive
    (optimizer state, kept gradients, caches) live from its start (Note
    [What the calls before a cut leave alive] in ir/cut.py); the
    trace's ``warmup`` says so.

    ``known_limit``: the most elements a tensor computed from constants keeps
    its values with (MetaMode's option; Note [Known values] in values/known.py).

    ``assume`` declares what the trace cannot compute: with
    ``md.GenerateAssumptions(token_id=0)``, ``model.generate(ids,
    max_new_tokens=4)`` traces its prefill and decode steps, every next
    token being 0 and every assumption in ``trace.assumptions`` (Note
    [Generating under declared assumptions] in values/assume.py); with
    ``warmup=N`` too, the trace and its assumptions are of the last call.

    >>> import torch, metadispatch as md
    >>> model = torch.nn.Linear(256, 256)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> def step(x):
    ...     model(x).sum().backward()
    ...     opt.step()
    ...     opt.zero_grad()
    >>> first, second = (md.tracer(warmup=n)(step, torch.ones(8, 256)) for n in (0, 1))
    >>> m1, m2 = md.memory(first), md.memory(second)
    >>> m1.by_category["optimizer state"] == m2.by_category["optimizer state"] == 2 * 4 * (256 * 256 + 256) + 2 * 4
    True
    >>> state = [m.by_category_timeline["optimizer state"][0] for m in (m1, m2)]
    >>> state  # at the first call: AdamW's step counts; in the second step, exp_avg and exp_avg_sq too
    [8, 526344]
    """
    check_restore(restore)
    if type(warmup) is not int or warmup < 0:
        raise MetaDispatchError(f"warmup={warmup!r}: a number of steps, 0 or more")
    if known_limit is not None and mode_factory is not None:
        raise MetaDispatchError("known_limit= with no mode_factory= (a factory gives it to the mode it makes)")
    if assume is not None and mode_factory is not None:
        raise MetaDispatchError(
            "assume= with no mode_factory= (a factory gives it to the mode it makes: MetaMode(assume=...))"
        )

    def make_mode() -> MetaMode:
        if mode_factory is not None:
            return mode_factory()
        limit = known.DEFAULT_LIMIT if known_limit is None else known_limit
        return MetaMode(
            device=device, stack=stack, gpu=gpu, world_size=world_size, rank=rank, assume=assume, known_limit=limit
        )

    return Tracer(make_mode, restore, warmup)


class Tracer:
    """What :func:`tracer` returns: ``run(fn, *args, **kwargs)`` traces one
    call; ``run.steps(fn, calls)`` several in one mode (:func:`run_steps`)."""

    def __init__(self, make_mode: Callable[[], MetaMode], restore: str, warmup: int) -> None:
        self.make_mode, self.restore, self.warmup = make_mode, restore, warmup

    def __call__(self, fn: Callable, *args, **kwargs) -> Trace:
        return run_traced(self.make_mode(), fn, args, kwargs, self.restore, self.warmup)

    def steps(self, fn: Callable, calls: list) -> list:
        """One trace for each ``(args, kwargs)`` in ``calls``, after one warm-up (Note [One warm-up, several steps])."""
        return run_steps(self.make_mode(), fn, calls, self.restore, self.warmup)


def trace(fn: Callable, *args, **kwargs) -> Trace:
    """Run ``fn(*args, **kwargs)`` under a fresh MetaMode and return its trace.

    Real tensors in the arguments, and the real parameters and buffers of any
    module that runs, are stood in for by MetaTensors; the user's tensors and
    modules are never modified (no ``.grad``, no buffer updates).  An
    optimizer built before the trace steps on the stand-ins, from MetaTensor
    copies of its state, and is left as it was.  What the step writes
    elsewhere -- a list a hook appends shapes to, a dict of logs -- stays as
    the step left it, as in eager (``md.tracer(restore="all")`` rolls that
    back too).

    >>> import torch, metadispatch as md
    >>> model = torch.nn.Linear(3, 2)
    >>> t = md.trace(lambda x: model(x).sum().backward(), torch.ones(4, 3))
    >>> sorted(t.grads), model.weight.grad is None
    (['bias', 'weight'], True)
    """
    return run_traced(MetaMode(), fn, args, kwargs)


def run_traced(
    mode: MetaMode, fn: Callable, args: tuple, kwargs: dict, restore: str = "machinery", warmup: int = 0
) -> Trace:
    """Note [What md.trace gives back]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The model and its training machinery come out of a trace as they went
    in: every module, optimizer, scheduler and grad scaler the function
    reaches -- arguments, closures, the globals it names -- is saved before
    it runs (it may change them, ``.to()``, ``.train()``, before calling
    them, or without calling them at all) and put back on exit, with the
    RNG (the mode restores it).  What the step writes anywhere else stays
    as the step left it, as eager and FakeTensorMode leave it: a forward
    hook that collects shapes into the caller's list, ``losses.append``, a
    dict of logs, a counter on the user's own trainer object -- with
    MetaTensors where it stored tensors, which hold no real tensor (Note [No
    real tensor outlives the recording] in mode.py).  With ``restore="all"``
    every list, dict, set and object of the user's class the function
    reaches is saved and put back too (Note [The user's containers] in
    standins.py): a dry run that leaves nothing behind.
    """
    return run_steps(mode, fn, [(args, kwargs)], restore, warmup)[0]


def run_steps(mode: MetaMode, fn: Callable, calls: list, restore: str = "machinery", warmup: int = 0) -> list:
    """``fn(*args, **kwargs)`` for each ``(args, kwargs)`` of ``calls`` in one mode, after ``warmup`` calls with the
    first's; one trace each, as :func:`run_traced` would give it alone.

    Note [One warm-up, several steps]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``md.max_batch`` confirms its answer with the steady-state steps of two
    batches of one model; traced apart, each builds nothing but warms up
    once more.  Here the warm-up runs once, with the first call's
    arguments, then each call in turn, and each is cut out (``step_until``
    its end, ``step_from`` its start): its own arguments, output, ``.grad``
    tensors and assumptions (the warm-up's and its own), no other call's.
    The first cut is the trace of the warm-up then that call, which is what
    ``run_traced`` gives; a later one starts from what the calls before it
    left alive, which is what a warm-up of its own would have left only
    where that state does not depend on the arguments (an optimizer's
    moments and step count do not; a cache sized by the batch does) --
    the caller decides whether it does (Note [Searching for the largest
    batch] in planning/batch.py).  A declared policy (``assume=``) marks
    its steps over the whole trace, so it takes one call.
    """
    if len(calls) > 1 and mode.assume is not None:
        raise MetaDispatchError("assume=: traces one call (its steps' marks span the trace); not several at once")
    standins = StandIns(mode)
    kept = _saved_kind if restore == "all" else is_machinery
    if mode.assume is not None:  # Note [Generating under declared assumptions] in values/assume.py
        mode.assume.inputs(*calls[0])
    spans, outs, grads, named_each, names = [], [], [], [], []
    try:
        with standins:
            (args, kwargs), more = calls[0], calls[1:]
            reached = find({"fn": fn, "args": args, "kwargs": kwargs, "more": more}, kept, empty=True)
            objects = [obj for obj in reached if not is_container(obj)]
            containers = [obj for obj in reached if is_container(obj)]  # none unless restore="all"
            if containers:
                # an object's own tables (a GPT-2's ~2,000 hook dicts) are saved with it
                own = {id(v) for obj in objects for v in vars(obj).values()}
                for obj in containers:
                    if id(obj) not in own:
                        standins.save_container(obj)
            for obj in objects:
                standins.save(obj) if isinstance(obj, nn.Module) else standins.save_object(obj)
            if isinstance(fn, nn.Module):
                standins.add_root(fn)
            converted = [_convert_args(mode, standins, a, k) for a, k in calls]
            for a, k in calls:
                flat = pytree.tree_flatten_with_path((a, k))[0]
                arg_names = [arg_name(p) for p, v in flat if isinstance(v, torch.Tensor)]
                constants = {arg_name(p): describe_constant(v) for p, v in flat if not isinstance(v, torch.Tensor)}
                names.append((arg_names, constants))
            mode.trace.arg_names, mode.trace.arg_constants = names[0]
            mode._recorder.keep_known = bool(warmup)  # Note [Known state across a cut] in ir/cut.py
            rec = mode._recorder
            meta = lambda v: rec.meta_of(v) if isinstance(v, MetaTensor) else v  # noqa: E731
            with mode:
                for _ in range(warmup):  # what each returns dies before the next, as in ``for ...: fn(x)``
                    fn(*converted[0][0], **converted[0][1])
                for margs, mkwargs in converted:
                    start = len(mode.trace.calls)
                    out = fn(*margs, **mkwargs)
                    spans.append((start, len(mode.trace.calls)))
                    if more:  # its tensors die before the next call, as the warm-up's do
                        outs.append((None, pytree.tree_map(meta, out)))
                        grads.append(standins.grads(rec.meta_of))
                        del out
            tr = mode.trace
            if not more:
                # Note [Real tensors the step returns]
                out = pytree.tree_map(lambda v: mode.from_tensor(v) if type(v) is torch.Tensor else v, out)
                outs.append((out, pytree.tree_map(meta, out)))
                grads.append(standins.grads(rec.meta_of))
            for margs, mkwargs in converted:
                named = _named(standins, margs, mkwargs)
                for t in named:  # Note [State the step never reads]
                    rec.meta_of(t)
                bind_views(rec, named)
                named_each.append({rec.meta_of(t).id for t in named})
    finally:
        mode.forget_reals()  # Note [No real tensor outlives the recording]
        mode._recorder.release_trace()  # Note [Dropping a trace frees it] in record.py
    if warmup and mode.assume is not None:
        mode.assume.forget_warmup(tr, spans[0][0])
    first = spans[0][0] if warmup else 0
    everyone = set().union(*named_each)
    read_in = _reads(tr, [s for s, _ in spans]) if more else {}
    traces = []
    for i, (start, end) in enumerate(spans):
        one = tr
        if more:
            one = step_until(tr, end)
            one.assumptions = [a for a in one.assumptions if a.index < first or a.index >= start]
            # the other calls' arguments, and the constants only their steps read, are no leaves of this one
            others = everyone - named_each[i] | {k for k, steps in read_in.items() if not steps & {-1, i}}
            one.leaves = {k: v for k, v in tr.leaves.items() if k not in others}
            # nor is what is left of the earlier calls' arguments state at this one's start: they are gone,
            # but for a storage one of its own leaves is on (``data[:8]`` and ``data[:9]``: one buffer)
            kept_storages = {v.meta.storage for v in one.leaves.values()}
            gone = {tr.leaves[k].meta.storage for k in others} - kept_storages
            one.deaths = dict(one.deaths or {}) | dict.fromkeys(gone, start)
            one.arg_names, one.arg_constants = names[i]
        one.output, one.output_meta = outs[i]
        one.grads = grads[i]
        if warmup or i:
            one.warmup = warmup
            one = step_from(one, start)
        if mode.assume is not None:
            mode.assume.finish(one, start)  # its steps' marks
        traces.append(one)
    return traces


def _reads(trace: Trace, starts: list) -> dict:
    """Leaf id -> the steps (indices of ``starts``; -1 the warm-up) whose calls read it."""
    out: dict = {}
    step = -1
    for i, call in enumerate(trace.calls):
        while step + 1 < len(starts) and i >= starts[step + 1]:
            step += 1
        for m in call.inputs:
            if m.id in trace.leaves:
                out.setdefault(m.id, set()).add(step)
    return out


# Note [State the step never reads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A parameter, buffer or argument the traced code never passes to an op
# (LLaMA's ``original_inv_freq``, a head the step skips, an unused input) is
# still in the device's memory while the step runs: the real run's peak
# counts it.  It used to be no leaf of the trace, and md.memory, which counts
# the storages calls read, left it out (16 B short of the real peak on
# transformers' LLaMA, the whole head on a model whose step skips it).  So
# every tensor md.trace named becomes a leaf once the step is done, read or
# not; md.memory counts each leaf from the start.  Leaves the step read keep
# the number their first read gave them (printed traces do not move); one
# never read is numbered after the last call.  Such a tensor dropped during
# the step (``m.head = None``) is counted to the end: its death is not seen.


# Note [Real tensors the step returns]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A step can return a real tensor it reached from its scope, not through an
# argument or a module's parameters and buffers: ``return y, self.cache``
# where ``self.cache`` is a plain attribute that ``self.cache.add_(x)``
# updated.  The ops wrote its stand-in (a constant leaf), not the user's
# tensor, so the output is that stand-in: replay returns its own updated copy,
# as eager returns the updated tensor.  Left real, the trace kept the user's
# tensor alive, could not be saved, and replay handed back the unchanged
# original while saying ok.  A tensor no op read becomes a constant leaf
# (made up in replay where it is larger than ``const_limit``, as any constant).


def _named(standins: StandIns, margs, mkwargs) -> list:
    """Every stand-in ``md.trace`` named: arguments, parameters, buffers, and their ``.grad``."""
    found = [v for v in pytree.tree_leaves((margs, mkwargs)) if isinstance(v, MetaTensor)]
    found += standins.stand_ins()
    with _compat.no_torch_function_subclass():  # ``.grad`` of a MetaTensor is otherwise a torch-function call
        found += [t.grad for t in found if isinstance(t.grad, MetaTensor)]
    return [t for t in found if state_of(t) is not None and t._md.name is not None]


def _saved_kind(obj) -> bool:
    return is_container(obj) or holds_state(obj)


def _convert_args(mode, standins, args, kwargs):
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    out = []
    for path, v in leaves:
        if isinstance(v, nn.Module):
            standins.add_root(v)
        elif isinstance(v, torch.Tensor):
            m = mode.from_tensor(v)
            name = arg_name(path)
            if m._md.name is None:
                m._md.name = ("arg", name)
                _stand_grad(mode, v, m, name)
            else:  # the same tensor given twice
                mode.trace.aliases.setdefault(f"arg {name}", " ".join(m._md.name))
            v = m
        out.append(v)
    return pytree.tree_unflatten(out, spec)


def _stand_grad(mode: MetaMode, real: torch.Tensor, meta: MetaTensor, name: str) -> None:
    """An argument's ``.grad`` is a leaf ``grad <name>``, as a parameter's is: backward accumulates into it."""
    grad = real.grad
    if grad is not None and type(grad) is torch.Tensor and meta.grad is None:
        g = mode.from_tensor(grad)
        g._md.name = ("grad", name)
        mode._recorder.meta_of(g)  # a leaf, read or not (see StandIns._stand_grad)
        meta.grad = g
