"""FakeTensorMode's keyword arguments, accepted where MetaMode behaves alike.

``MetaMode`` is meant as a drop-in for FakeTensorMode's common uses, so code
written as ``FakeTensorMode(allow_non_fake_inputs=True)`` or
``mode.from_tensor(t, static_shapes=True)`` keeps working.  Each option is
accepted with the value(s) MetaMode already behaves as; any other value is a
feature MetaMode deliberately lacks, and raises
:class:`~metadispatch.errors.UnsupportedFeatureError` saying why and what to
use instead, rather than being silently ignored.

>>> import metadispatch as md
>>> md.MetaMode(allow_non_fake_inputs=True).device is None
True
>>> md.MetaMode(static_shapes=False)
Traceback (most recent call last):
  ...
metadispatch.errors.UnsupportedFeatureError: MetaMode(static_shapes=False) is not supported: MetaMode traces static shapes only (no SymInts, no ShapeEnv); see docs/fake-tensor-mode.md
"""

from __future__ import annotations

from ..errors import UnsupportedFeatureError

__all__ = ["check_mode_options", "check_from_tensor_options"]

_ANY = object()
_STATIC = "MetaMode traces static shapes only (no SymInts, no ShapeEnv)"

# FakeTensorMode keyword -> (values MetaMode behaves as, why others are refused)
_MODE = {
    "allow_non_fake_inputs": ((True,), "MetaMode always converts real tensors that reach an op"),
    "allow_fallback_kernels": (
        (False,),
        "MetaMode never runs real kernels; md.check() runs the ops no rule can answer for real",
    ),
    "static_shapes": ((True,), _STATIC),
    "shape_env": ((None,), _STATIC),
    "propagate_real_tensors": ((False,), "use md.check() to compare with a real run"),
    "export": ((False,), "MetaMode is not a torch.export tracer"),
}
_FROM_TENSOR = {
    "static_shapes": ((None, True), _STATIC),
    "symbolic_context": ((None,), _STATIC),
    "source": (_ANY, ""),  # names the tensor for dynamo's guards: nothing to do
    "trace": (_ANY, ""),  # structured logging of the conversion: nothing to do
}


def check_mode_options(options: dict) -> None:
    _check("MetaMode", _MODE, options)


def check_from_tensor_options(options: dict) -> None:
    _check("MetaMode.from_tensor", _FROM_TENSOR, options)


def _check(where: str, table: dict, options: dict) -> None:
    for name, value in options.items():
        if name not in table:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
        accepted, why = table[name]
        if accepted is not _ANY and not any(value is a or value == a for a in accepted):
            raise UnsupportedFeatureError(
                f"{where}({name}={value!r}) is not supported: {why}; see docs/fake-tensor-mode.md"
            )
