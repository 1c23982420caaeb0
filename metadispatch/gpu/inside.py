"""torch's Python functions, seen inside: the calls they make meet the mode.

Note [Seeing inside torch's Python functions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A torch-function mode sees the outermost call only: torch takes the mode
off while its handler runs, and a Python function's own
``has_torch_function`` check sends it to the handler whole.  So what
``F.multi_head_attention_forward`` calls -- ``F.dropout``,
``F.scaled_dot_product_attention`` -- never met the MetaMode's overrides
(Note [Composite overrides]): on a logical GPU ``nn.MultiheadAttention``
recorded the math attention and the generic dropout where a GPU runs its
fused kernels; nor did autocast's policy (Note [Autocast on a logical GPU]).

Such a function is run as the same code object with a globals mapping in
which the three ``has_torch_function`` names answer False (its own check
lets its body run; the real module globals answer every other name), with
the mode pushed back on the stack, so each call its body makes comes to
the mode's handler.  A body that reaches its own handler another way (a C
method of the same name: ``Tensor.unflatten``'s ``super().unflatten``,
which torch names by the Python override) is answered as that C method
(``reentered``).  Limits: a body that assigns module globals writes them to
the mapping, not the module.
"""

from __future__ import annotations

import threading
import types

__all__ = ["see_inside", "reentered", "seeing_inside"]


class _State(threading.local):
    def __init__(self):
        self.stack: list = []  # functions being seen inside, with their first argument


_STATE = _State()


def _false(*_args) -> bool:
    return False


class _NoCheckGlobals(dict):
    """A Python function's module globals, with torch's ``has_torch_function``
    checks answering False: the function's own check lets its body run, and
    every call it makes still meets the mode."""

    def __init__(self, real: dict):
        super().__init__(
            has_torch_function=_false,
            has_torch_function_unary=_false,
            has_torch_function_variadic=_false,
            __builtins__=real.get("__builtins__", __builtins__),
        )
        self._real = real

    def __missing__(self, key):
        return self._real[key]


_GLOBALS: dict[int, tuple] = {}
_REBOUND: dict = {}


def reentered(func, args) -> bool:
    """Whether ``func``'s body, seen inside, called the C method of the same
    name (``Tensor.unflatten``'s ``super().unflatten``: torch names the
    Python override as the function a C method's handler gets), which is
    answered as that C method."""
    first = args[0] if args else None
    return any(f is func and a is first for f, a in _STATE.stack)


def seeing_inside() -> bool:
    """Whether a call comes from a torch Python function's body the swap sees inside."""
    return bool(_STATE.stack)


def see_inside(func: types.FunctionType, args):
    first = args[0] if args else None
    rebound = _REBOUND.get(func)
    if rebound is None:
        module = func.__globals__
        entry = _GLOBALS.get(id(module))
        if entry is None or entry[0] is not module:
            entry = _GLOBALS[id(module)] = (module, _NoCheckGlobals(module))
        rebound = types.FunctionType(func.__code__, entry[1], func.__name__, func.__defaults__, func.__closure__)
        rebound.__kwdefaults__ = func.__kwdefaults__
        _REBOUND[func] = rebound

    def run(*a, **k):
        _STATE.stack.append((func, first))
        try:
            return rebound(*a, **k)
        finally:
            _STATE.stack.pop()

    return run
