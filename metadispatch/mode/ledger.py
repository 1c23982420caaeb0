"""The ledger: every process-wide change a MetaMode makes to torch, in one place.

Note [The ledger]
~~~~~~~~~~~~~~~~~
A dispatch mode and a torch-function mode are per thread, but some of what a
MetaMode must change is not: functions, classes and objects on torch's
modules (``torch.get_rng_state``, ``torch.save``, ``torch.cuda.*``,
``torch.distributed``'s world), attributes of torch's classes
(``DTensor.device``, ``Optimizer.state``).  Each such change is a
:class:`Patch`, declared by the module that needs it under a group name --
declaring installs nothing: importing metadispatch changes nothing global --
and made here only:

- a mode *claims* a group for its thread while it is entered; the first
  claim anywhere installs the group's patches, the last release puts
  torch's originals back (counts under a lock);
- what is installed is a dispatcher, not the replacement: it answers with
  the replacement in threads that claim the patch's group and with torch's
  original everywhere else -- another thread, or this one once its claim
  ends -- so no other thread sees a mode's answers (issue 27);
- several groups may patch one attribute (a logical world's ``torch.cuda``
  and a logical GPU's): one dispatcher serves them, the first claimed patch
  in declaration order answers, and each replacement is handed the next one
  down as its "original", so it can defer;
- a release is idempotent, counts change on one line with the flag that
  says they did, and the undo step is appended before the change (Note
  [Interrupts in mode entry and exit] in mode.py);
- :func:`inventory` lists what is replaced now; ``tests/mode/test_ledger.py``
  compares it with a scan of torch's modules and classes inside a logical
  world, after leaving it, after an exception, and from another thread.

What is not an attribute and so not here: hooks registered through torch's
API (module and optimizer hooks, which filter by thread and are removed by
their handles), and the few process-wide values torch itself offers no
per-thread form of, each named where it is set (the dispatch-mode flags
torch's own modes set, the garbage collector's thresholds, dynamo's stance,
torch's foreach type lists, ``only_lift_cpu_tensors``, a logical world's
``RANK``/``WORLD_SIZE``; docs/untouched.md lists them).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
from collections.abc import Callable
from typing import Any

from .. import _compat

__all__ = ["Patch", "declare", "declare_all", "claim", "claimed", "inventory", "users", "ABSENT"]


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()  # the original of an attribute the owner did not have


@dataclasses.dataclass(frozen=True, eq=False)
class Patch:
    """``owner.name`` answered by ``make(next)`` in threads that claim ``group``.

    ``make`` is called once per installation with what answers below this
    patch -- torch's original, or the dispatcher of the next patch on the
    same attribute -- and returns the replacement: a callable, a class, a
    :class:`property` (for an attribute of a class), or an object whose
    attributes answer for it.
    """

    group: str
    owner: Any  # a module or class; or a function returning it (None: nothing to patch) when imported lazily
    name: str
    make: Callable[[Any], Any]
    why: str  # a line for the inventory: what the patch answers
    # False: a value torch reads process-wide (dynamo's stance), set as is:
    # every thread sees it while any claim is held.
    per_thread: bool = True

    def resolve(self):
        return self.owner() if isinstance(self.owner, types.FunctionType) else self.owner


_DECLARED: dict[str, list[Patch]] = {}
_ORDER: list[Patch] = []  # every patch, in declaration order
_RANK: dict[Patch, int] = {}  # each patch's place in _ORDER (sorting a slot's few, not scanning every patch)
_LOCK = threading.Lock()
_USERS: dict[str, int] = {}  # group -> claims held, all threads
_SLOTS: dict[tuple[int, str], _Slot] = {}  # (id(owner), name) -> what is installed there


class _Claims(threading.local):
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}


_CLAIMS = _Claims()


def declare(group: str, owner, name: str, make: Callable[[Any], Any], why: str, per_thread: bool = True) -> Patch:
    """Declare that claiming ``group`` replaces ``owner.name`` (nothing changes yet)."""
    patch = Patch(group, owner, name, make, why, per_thread)
    _DECLARED.setdefault(group, []).append(patch)
    _RANK[patch] = len(_ORDER)
    _ORDER.append(patch)
    return patch


def declare_all(group: str, patches, per_thread: bool = True) -> None:
    """Declare ``(owner, name, make, why)`` rows, as a room lists its patches."""
    for owner, name, make, why in patches:
        declare(group, owner, name, make, why, per_thread)


def claimed(group: str) -> bool:
    """Whether this thread holds a claim on ``group``."""
    return _CLAIMS.counts.get(group, 0) > 0


def claim(group: str, steps: list) -> None:
    """Claim ``group`` for this thread until the undo ``steps`` run."""
    token = _Claim(group)
    steps.append(token.release)
    token.acquire()


def inventory() -> list[tuple[Any, str, str, str]]:
    """``(owner, name, group, why)`` for every patch installed now, in any thread."""
    return [(s.owner, s.name, p.group, p.why) for s in list(_SLOTS.values()) for p in list(s.patches)]


def users() -> dict[str, int]:
    """Group -> claims held now, in every thread."""
    return dict(_USERS)


class _Claim:
    """One claim on a group by this thread; ``release`` is idempotent."""

    __slots__ = ("group", "held")

    def __init__(self, group: str) -> None:
        self.group = group
        self.held = False

    def acquire(self) -> None:
        _compat.call_locked(_LOCK, self._acquire)

    def release(self) -> None:
        _compat.call_locked(_LOCK, self._release)

    def _acquire(self) -> None:
        g, counts = self.group, _CLAIMS.counts
        if not self.held:
            # fmt: off
            _USERS[g] = _USERS.get(g, 0) + 1; counts[g] = counts.get(g, 0) + 1; self.held = True  # noqa: E702,E501
            # fmt: on
        for patch in _DECLARED.get(g, ()):
            _install(patch)

    def _release(self) -> None:
        g, counts = self.group, _CLAIMS.counts
        if self.held:
            # A mode's undo steps run in the thread that claimed.
            # fmt: off
            _USERS[g] -= 1; counts[g] -= 1; self.held = False  # noqa: E702
            # fmt: on
        if not _USERS.get(g):
            _USERS.pop(g, None)
            for patch in reversed(_DECLARED.get(g, ())):
                _uninstall(patch)


class _Slot:
    """One replaced attribute: torch's original and the patches installed on it."""

    def __init__(self, owner, name: str) -> None:
        self.owner = owner
        self.name = name
        self.original = owner.__dict__.get(name, ABSENT) if isinstance(owner, type) else getattr(owner, name, ABSENT)
        self.patches: tuple[Patch, ...] = ()

    def rebuild(self) -> None:
        """Set the attribute to the dispatcher of the installed patches, or back to torch's."""
        if not self.patches:
            if self.original is ABSENT:
                if self.name in vars(self.owner):
                    delattr(self.owner, self.name)
            else:
                setattr(self.owner, self.name, self.original)
            return
        answer = self.original if self.original is not ABSENT else _inherited(self.owner, self.name)
        for patch in reversed(self.patches):  # the first declared answers first
            made = patch.make(answer)
            answer = _dispatcher(patch.group, made, answer, self.name) if patch.per_thread else made
        setattr(self.owner, self.name, answer)


def _inherited(owner, name: str):
    """What a class without ``name`` of its own answers: a base's attribute, or ABSENT."""
    for base in owner.__mro__[1:] if isinstance(owner, type) else ():
        if name in vars(base):
            return vars(base)[name]
    return ABSENT


def _install(patch: Patch) -> None:
    owner = patch.resolve()
    if owner is None:
        return
    key = (id(owner), patch.name)
    slot = _SLOTS.get(key)
    if slot is None:
        slot = _SLOTS[key] = _Slot(owner, patch.name)
    if patch not in slot.patches:
        # fmt: off
        slot.patches = tuple(sorted((*slot.patches, patch), key=_RANK.__getitem__)); slot.rebuild()  # noqa: E702
        # fmt: on


def _uninstall(patch: Patch) -> None:
    owner = patch.resolve()
    if owner is None:
        return
    key = (id(owner), patch.name)
    slot = _SLOTS.get(key)
    if slot is None:
        return
    if patch in slot.patches:
        slot.patches = tuple(p for p in slot.patches if p is not patch)
    slot.rebuild()
    if not slot.patches:
        del _SLOTS[key]


def _dispatcher(group: str, replacement, below, name: str):
    """``replacement`` in threads claiming ``group``, ``below`` elsewhere."""
    if isinstance(replacement, property):
        return _dispatching_property(group, replacement, below, name)
    if isinstance(below, type) and isinstance(replacement, type):
        return _PerThreadClass(
            below.__name__, (), {"_real": below, "_logical": replacement, "_group": group, "__wrapped__": below}
        )
    if callable(replacement) and (callable(below) or below is ABSENT):
        counts = _CLAIMS

        def per_thread(*args, **kwargs):
            if counts.counts.get(group, 0) > 0:
                return replacement(*args, **kwargs)
            return below(*args, **kwargs)

        if below is not ABSENT:
            functools.update_wrapper(per_thread, below)
        return per_thread
    return _PerThreadObject(group, replacement, below)


class _PerThreadClass(type):
    """A class replaced per thread: calling it makes the replacement's object
    in a claiming thread, the original's elsewhere; both are instances of it."""

    _real: type
    _logical: type
    _group: str

    def __call__(cls, *args, **kwargs):
        return (cls._logical if claimed(cls._group) else cls._real)(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, (cls._real, cls._logical))

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, (cls._real, cls._logical))


class _PerThreadObject:
    """An object replaced per thread: its attributes are the replacement's in
    a claiming thread, the original's elsewhere (``torch.distributed``'s world)."""

    __slots__ = ("_md_group", "_md_replacement", "_md_original")

    def __init__(self, group: str, replacement, original) -> None:
        object.__setattr__(self, "_md_group", group)
        object.__setattr__(self, "_md_replacement", replacement)
        object.__setattr__(self, "_md_original", original)

    def _md_target(self):
        return self._md_replacement if claimed(self._md_group) else self._md_original

    def __getattr__(self, name: str):
        return getattr(self._md_target(), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._md_target(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._md_target(), name)


def _dispatching_property(group: str, replacement: property, below, name: str) -> property:
    """A data descriptor: ``replacement`` in claiming threads; elsewhere the
    descriptor below, or the instance's own ``__dict__`` where the class had none."""

    def get(obj):
        if claimed(group):
            return replacement.__get__(obj)
        if below is ABSENT:
            try:
                return obj.__dict__[name]
            except KeyError:
                raise AttributeError(name) from None
        return below.__get__(obj, type(obj)) if hasattr(below, "__get__") else below

    def set_(obj, value) -> None:
        if claimed(group) and replacement.fset is not None:
            replacement.__set__(obj, value)
        elif below is ABSENT:
            obj.__dict__[name] = value
        elif hasattr(below, "__set__"):
            below.__set__(obj, value)
        else:
            obj.__dict__[name] = value

    return property(get, set_, doc=replacement.__doc__)
