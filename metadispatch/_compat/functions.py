"""torch-function modes and torch's Python bindings: the stack MetaMode's swap sits on, the C++ functions it sees.

Part of ``metadispatch._compat`` (its docstring says why private torch APIs live here alone).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from .process import call_inside

# Tensor.to's argument parser: (device, dtype, non_blocking, memory_format).
parse_to = torch._C._nn._parse_to
# torch's C++ functions (torch.tensor_split, torch._VF.lstm, ...): what a
# torch-function mode sees as ``func`` for them.
variable_functions = torch._C._VariableFunctions
# Where torch's generated Python bindings live, searched in this order for an
# op's name (Note [Calling ops through their Python bindings] in execution/bindings.py).
python_bindings = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)
# F.scaled_dot_product_attention's C++ entry (rules/attention.py calls it plainly).
sdpa_entry = torch._C._nn.scaled_dot_product_attention
# Turns torch-function modes off for the duration: code that reads a real
# tensor under a MetaMode (conversion, hooks) sees it, not its stand-in.
no_torch_function = torch._C.DisableTorchFunction
no_torch_function_subclass = torch._C.DisableTorchFunctionSubclass


def call_without_torch_function(fn, *args):
    """``fn(*args)`` with torch-function modes off, back on whatever line an interrupt hits."""
    guard = no_torch_function()
    return call_inside(guard.__enter__, lambda: guard.__exit__(None, None, None), fn, args)


# Whether a subclass's torch function runs now (a MetaTensor getter is then a Python call); C, no frame.
torch_function_enabled = torch._C._is_torch_function_enabled


def function_mode_stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


function_stack_len = torch._C._len_torch_function_stack
function_stack_at = torch._C._get_function_stack_at


def top_function_mode():
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def call_without_function_mode(mode, fn, *args):
    """``fn(*args)`` with ``mode`` (the top of the function-mode stack) off it
    for the duration, as torch takes a mode off while its handler runs."""
    torch._C._pop_torch_function_stack()
    try:
        return fn(*args)
    finally:
        torch._C._push_on_torch_function_stack(mode)


def call_with_function_mode(mode, fn, args, kwargs):
    """``fn(*args, **kwargs)`` with ``mode`` pushed back on the function-mode
    stack for the duration (from inside its own handler, where torch took it off)."""
    torch._C._push_on_torch_function_stack(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        remove_function_mode(mode)


# The torch function behind weight_norm's C++ composite (gpu/autocast.py ports it).
weight_norm_interface = torch._weight_norm_interface


# torch.nn.functional's C bindings (``nll_loss_nd``, ``nll_loss``)
nn_functions = torch._C._nn


def device_constructors() -> frozenset:
    """The torch functions ``torch.set_default_device`` gives a device when
    they are called without one (``torch.zeros``, ``torch.tensor``, ...): its
    ``DeviceContext``'s own list (Note [A factory's named device] in
    mode/devices.py)."""
    from torch.utils._device import _device_constructors

    return frozenset(_device_constructors())


def push_function_mode(mode) -> None:
    torch._C._push_on_torch_function_stack(mode)


def remove_function_mode(mode) -> None:
    """Take ``mode`` off torch's function-mode stack, wherever it is (idempotent)."""
    stack = function_mode_stack()
    if all(m is not mode for m in stack):
        return
    above = []
    while True:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
