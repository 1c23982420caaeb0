"""Converting real tensors to MetaTensors: the stand-in of each real tensor, memoised.

A real tensor reaching a mode (an argument, a parameter, a tensor from the
user's scope) gets one MetaTensor for its life, sharing a meta storage with
every stand-in of a tensor on the same real storage, and carrying what the
user hung on the real one (Note [What a stand-in carries]).  The real
tensor is read, never written, and held weakly.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .. import _compat
from .tensor import META, MetaTensor, in_kernel, is_wrapper_subclass, normalize_device, wrap

__all__ = ["Converter", "with_real_tensor"]


class Converter:
    """Turns real tensors into MetaTensors, memoised.

    The same real tensor always maps to the same MetaTensor, and real tensors
    that share a storage map to MetaTensors that share a meta storage.  The
    real tensor is never written to, and referred to weakly: an entry goes
    when its real tensor (or storage) dies, so ids cannot be confused and the
    user's tensors are not kept alive.
    """

    def __init__(self, device=None, *, hooks: bool = False) -> None:
        self.device = normalize_device(device) if device is not None else None
        self.hooks = hooks  # stand-ins run the real tensor's hooks (Note [What a stand-in carries])
        self._memo: dict = {}  # id(real) -> (weakref to real, meta)
        self._storages: dict = {}  # storage key -> (weakref to real storage, meta storage)

    def __call__(self, t: torch.Tensor) -> MetaTensor:
        if isinstance(t, MetaTensor):
            return t
        hit = self._memo.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        # Note [Inference stand-ins]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~
        # A stand-in is an inference tensor when the real one is, wherever it
        # is made.  A real tensor first reached inside ``torch.inference_mode()``
        # (an evaluation pass in a training step) is a normal tensor that
        # the step's later training forward saves for backward: an inference
        # stand-in failed there ("Inference tensors cannot be saved for
        # backward"), where eager runs.
        with _compat.no_torch_function(), torch.inference_mode(t.is_inference()):  # the real tensor's own metadata
            meta = self._convert(t)
        self._memo[id(t)] = (weakref.ref(t, functools.partial(_drop, self._memo, id(t))), meta)
        return meta

    def has(self, t: torch.Tensor) -> bool:
        """Whether ``t`` has a MetaTensor already."""
        hit = self._memo.get(id(t))
        return hit is not None and hit[0]() is t

    def forget(self) -> None:
        self._memo.clear()
        self._storages.clear()

    def _convert(self, t: torch.Tensor) -> MetaTensor:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) or is_wrapper_subclass(t):
            raise TypeError(f"cannot convert a {type(t).__name__} to a MetaTensor: only plain tensors")
        if t.layout != torch.strided:
            raise NotImplementedError(f"MetaTensor supports strided tensors only, got {t.layout}")
        device = self.device or (t.device if t.device.type != "meta" else META)
        with in_kernel():
            storage = self._meta_storage(t)
            elem = torch.empty(0, dtype=t.dtype, device=META)
            elem.set_(storage, t.storage_offset(), t.size(), t.stride())
        out = wrap(elem, device, t.requires_grad)
        if isinstance(t, torch.nn.Parameter):
            # What Parameter.__new__ does for tensor subclasses, minus the
            # detach() that would show up as a call in the trace.
            out._is_param = True
        _carry_user_state(t, out, self.hooks)
        return out

    def _meta_storage(self, t: torch.Tensor):
        real = t.untyped_storage()
        key = _compat.storage_key(t) if t.device.type != "meta" else id(t)
        hit = self._storages.get(key)
        if hit is None or hit[0]() is not real:
            meta = torch.UntypedStorage(real.nbytes(), device=META)
            hit = self._storages[key] = (weakref.ref(real, functools.partial(_drop, self._storages, key)), meta)
        return hit[1]


def _carry_user_state(t: torch.Tensor, out: MetaTensor, hooks: bool) -> None:
    """Note [What a stand-in carries]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Training code hangs things on its parameters: attributes read in the
    step (Megatron's ``param.sequence_parallel``, a sharding flag) and
    hooks -- ``register_hook`` (a gradient scaled or kept),
    ``register_post_accumulate_grad_hook`` (an optimizer step in backward).
    A bare stand-in had none of them: the attribute raised AttributeError
    where eager runs, and the hooks' ops were missing from the trace.  So a
    stand-in gets the real tensor's attributes (the same values, by
    reference, as eager reads them; rebinding one on the stand-in leaves
    the real tensor's alone) and the same hook functions, in order; a
    post-accumulate-grad hook is handed the real tensor, which it was
    registered on.  The
    real tensor's own tables are not touched.  ``md.to_meta``'s copies get
    the attributes but not the hooks, as ``copy.deepcopy`` gives none.
    """
    for key, value in t.__dict__.items():
        if not key.startswith("_md"):
            out.__dict__.setdefault(key, value)
    if not hooks or not t.requires_grad:
        return
    for hook in (t._backward_hooks or {}).values():
        out.register_hook(hook)
    if t.is_leaf:
        real = weakref.ref(t)
        for hook in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values():
            out.register_post_accumulate_grad_hook(functools.partial(with_real_tensor, hook, real))


def with_real_tensor(hook, real, stand_in) -> None:
    """Call a post-accumulate-grad hook with the tensor the user registered it
    on: the user keys their state by it (torch's optimizer-in-backward pattern,
    ``optimizer_dict[p].step()``), and what the hook does to it reaches the
    stand-in through the mode (Note [Swap above autograd])."""
    t = real()
    hook(t if t is not None else stand_in)


def _drop(table: dict, key, ref) -> None:
    entry = table.get(key)
    if entry is not None and entry[0] is ref:
        del table[key]
