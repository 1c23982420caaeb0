"""Value bounds: what is known about a tensor's values when the values are not.

Note [Value bounds]
~~~~~~~~~~~~~~~~~~~
``md.check`` answers a data-dependent call from made-up data (Note [Made-up
data] in compare.py).  Made-up data that ignores how a tensor was produced
breaks the user's own code: torchvision picks a random index with
``int(torch.empty(1).uniform_(0., n).item())`` and indexes a tuple with it,
and a value from a standard normal is out of range for small ``n``.  So an
op whose outputs' range follows from its arguments gives them
``t._md.bounds = Bounds(lo, hi, how)`` -- ``lo <= value <= hi``, ``how`` the
op that said so -- and made-up data stays inside:

* sources: ``uniform_(a, b)``, ``rand``, ``randint(lo, hi)``, ``random_``,
  ``randperm(n)``, ``bernoulli``; indices bounded by a size (``argmax``,
  ``topk``/``sort`` indices, ``nonzero``, ``multinomial``, insertion points
  of ``searchsorted``/``bucketize``) and counts (``sum`` of a mask);
* transformations: ``clamp``, ``abs``, ``relu``, ``sigmoid``, ``softmax``,
  rounding and dtype casts, views and copies, and arithmetic with a Python
  number;
* an in-place op not listed here drops the bounds of what it writes.

Known values (Note [Known values] in known.py) are exact and win over
bounds; bounds only shape the data md.check has to make up.  Bounds are
computed for top-level calls only, from the op's arguments: a handful of
lookups per call on the listed ops, nothing on the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import _compat
from ..tensor.tensor import MetaTensor

__all__ = ["Bounds", "bounds_of", "bounds_without_inputs", "propagate", "fill_within", "decided", "COMPARISONS"]


class Bounds(NamedTuple):
    lo: float
    hi: float
    how: str  # "uniform_(0.0, 5.0)": the op and arguments that bound the values

    def __str__(self) -> str:
        return f"a value in [{_num(self.lo)}, {_num(self.hi)}] from {self.how}"


def _num(x) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 1e15 else str(x)


def bounds_of(t) -> Bounds | None:
    """The bounds of a MetaTensor's values, or None when nothing is known."""
    return t._md.bounds if isinstance(t, MetaTensor) else None


def fill_within(real: torch.Tensor, b: Bounds, gen: torch.Generator, ints: int) -> None:
    """Overwrite ``real`` with made-up data inside ``b``: uniform for floats,
    ``ints`` moved into the bounds for integers (deterministic, as compare.py's)."""
    lo, hi = b.lo, b.hi
    if real.dtype == torch.bool:
        real.fill_(bool(hi >= 1))
    elif real.dtype.is_floating_point:
        if math.isfinite(lo) and math.isfinite(hi):
            real.uniform_(lo, hi, generator=gen) if hi > lo else real.fill_(lo)
        elif math.isfinite(lo):
            real.normal_(generator=gen).abs_().add_(lo)
        elif math.isfinite(hi):
            real.normal_(generator=gen).abs_().neg_().add_(hi)
    elif not real.dtype.is_complex:
        real.fill_(_int_within(ints, lo, hi))


def _int_within(ints: int, lo: float, hi: float) -> int:
    """``ints`` moved into ``[lo, hi]``; either end may be infinite (``abs``
    bounds a value below only), and an empty range gives its low end."""
    low = math.ceil(lo) if math.isfinite(lo) else None
    high = math.floor(hi) if math.isfinite(hi) else None
    if low is not None and high is not None and low > high:
        return low
    value = ints if low is None else max(ints, low)
    return value if high is None else min(value, high)


def bounds_without_inputs(name: str) -> bool:
    """Whether a call of op ``name`` may give its outputs bounds though no
    input has any (``sigmoid``'s [0, 1], ``clamp``'s constants, a random
    source's range; core/hit.py asks).  Rules that only carry an input's
    bounds along (views, copies, ``x + 1``) give none then, and a comparison
    is decided only by its input's bounds."""
    return name in _RULES and name not in _CARRIED


def propagate(name: str, mutates: bool, args: tuple, kwargs: dict, result) -> None:
    """Give the outputs of a top-level call ``name`` their bounds, if it has a
    rule here; an in-place op without one drops the bounds of what it wrote."""
    rule = _RULES.get(name)
    if rule is None:
        if mutates:
            _forget(result)
        return
    outs = list(result) if isinstance(result, (list, tuple)) else [result]
    found = rule(_Args(args, kwargs))
    found = found if isinstance(found, list) else [found] * len(outs)
    for out, b in zip(outs, found):
        if isinstance(out, MetaTensor):
            if b is None:
                out._md.bounds = None
            else:
                out._md.bounds = b
                if name in _SOURCES and not _no_version(out):  # Note [Bounds that decide a comparison]
                    out._md.drawn = (b, out._version)


def _no_version(t) -> bool:
    """An inference tensor (made under ``torch.inference_mode()``) has no version
    counter, so nothing can tell that it was not written since it was drawn:
    its bounds decide no comparison."""
    with _compat.no_torch_function_subclass():
        return t.is_inference()


def _forget(result) -> None:
    for out in result if isinstance(result, (list, tuple)) else (result,):
        if isinstance(out, MetaTensor):
            out._md.bounds = None


class _Args:
    """Positional-or-keyword access to a call's arguments."""

    def __init__(self, args, kwargs) -> None:
        self.args, self.kwargs = args, kwargs

    def get(self, i: int, name: str, default=None):
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[i] if i < len(self.args) else default

    @property
    def self_bounds(self) -> Bounds | None:
        return bounds_of(self.args[0]) if self.args else None


def _b(lo, hi, how: str) -> Bounds | None:
    if lo is None or hi is None or isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        return None
    return Bounds(float(lo), float(hi), how)


def _intersect(a: _Args, lo, hi, how: str) -> Bounds | None:
    own = a.self_bounds
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        return None
    if own is not None:
        lo, hi, how = max(lo, own.lo), min(hi, own.hi), f"{own.how}, {how}"
    if lo == -math.inf and hi == math.inf:
        return None
    return Bounds(float(lo), float(hi), how)


def _same(a: _Args) -> Bounds | None:
    return a.self_bounds


def _abs(a: _Args) -> Bounds:
    own = a.self_bounds
    if own is None:
        return Bounds(0.0, math.inf, "abs")
    hi = max(abs(own.lo), abs(own.hi))
    lo = 0.0 if own.lo <= 0 <= own.hi else min(abs(own.lo), abs(own.hi))
    return Bounds(lo, hi, f"abs of {own.how}")


def _relu(a: _Args) -> Bounds:
    own = a.self_bounds
    if own is None:
        return Bounds(0.0, math.inf, "relu")
    return Bounds(max(own.lo, 0.0), max(own.hi, 0.0), f"relu of {own.how}")


def _affine(op: str) -> Callable[[_Args], Bounds | None]:
    """``x op number``: the bounds of ``x`` moved along."""

    def rule(a: _Args) -> Bounds | None:
        own, other = a.self_bounds, a.get(1, "other")
        if own is None or isinstance(other, torch.Tensor) or not isinstance(other, (int, float)):
            return None
        alpha = a.get(2, "alpha", 1)
        if op == "add":
            ends = (own.lo + other * alpha, own.hi + other * alpha)
        elif op == "sub":
            ends = (own.lo - other * alpha, own.hi - other * alpha)
        elif op == "mul":
            ends = (own.lo * other, own.hi * other)
        elif other == 0:
            return None
        else:
            ends = (own.lo / other, own.hi / other)
        ends = tuple(0.0 if math.isnan(e) else e for e in ends)
        return Bounds(min(ends), max(ends), f"{own.how} {op} {other}")

    return rule


def _index_of(size_from: Callable[[_Args], int | None], how: str) -> Callable[[_Args], Bounds | None]:
    def rule(a: _Args) -> Bounds | None:
        n = size_from(a)
        return None if n is None else Bounds(0.0, float(max(n - 1, 0)), f"{how} of a size-{n} dimension")

    return rule


def _dim_size(a: _Args) -> int | None:
    x, dim = a.args[0], a.get(1, "dim")
    if not isinstance(x, torch.Tensor):
        return None
    return x.numel() if dim is None else (x.shape[dim] if x.dim() else 1)


def _values_and_indices(how: str) -> Callable[[_Args], list]:
    """``topk``, ``sort``: values keep their bounds, indices lie within the dimension."""

    def rule(a: _Args) -> list:
        x = a.args[0]
        dim = a.get(2 if how == "topk" else 1, "dim", -1)
        n = x.shape[dim] if x.dim() else 1
        return [a.self_bounds, Bounds(0.0, float(max(n - 1, 0)), f"{how} indices of a size-{n} dimension")]

    return rule


def _random_from(a: _Args) -> Bounds | None:
    lo, hi = a.get(1, "from", 0), a.get(2, "to")
    return None if hi is None else _b(lo, hi - 1, f"random_({lo}, {hi})")


_RULES: dict[str, Callable[[_Args], Bounds | list | None]] = {
    "aten.uniform_.default": lambda a: _b(
        a.get(1, "from", 0.0), a.get(2, "to", 1.0), f"uniform_({a.get(1, 'from', 0.0)}, {a.get(2, 'to', 1.0)})"
    ),
    "aten.rand.default": lambda a: Bounds(0.0, 1.0, "rand"),
    "aten.rand.generator": lambda a: Bounds(0.0, 1.0, "rand"),
    "aten.rand_like.default": lambda a: Bounds(0.0, 1.0, "rand_like"),
    "aten.bernoulli.default": lambda a: Bounds(0.0, 1.0, "bernoulli"),
    "aten.bernoulli.p": lambda a: Bounds(0.0, 1.0, "bernoulli"),
    "aten.bernoulli_.float": lambda a: Bounds(0.0, 1.0, "bernoulli_"),
    "aten.randint.default": lambda a: _b(0, a.get(0, "high") - 1, f"randint({a.get(0, 'high')})"),
    "aten.randint.generator": lambda a: _b(0, a.get(0, "high") - 1, f"randint({a.get(0, 'high')})"),
    "aten.randint.low": lambda a: _b(
        a.get(0, "low"), a.get(1, "high") - 1, f"randint({a.get(0, 'low')}, {a.get(1, 'high')})"
    ),
    "aten.randint.low_generator": lambda a: _b(
        a.get(0, "low"), a.get(1, "high") - 1, f"randint({a.get(0, 'low')}, {a.get(1, 'high')})"
    ),
    "aten.randint_like.default": lambda a: _b(0, a.get(1, "high") - 1, f"randint_like({a.get(1, 'high')})"),
    "aten.randint_like.low_dtype": lambda a: _b(
        a.get(1, "low"), a.get(2, "high") - 1, f"randint_like({a.get(1, 'low')}, {a.get(2, 'high')})"
    ),
    "aten.random_.from": _random_from,
    "aten.random_.to": lambda a: _b(0, a.get(1, "to") - 1, f"random_({a.get(1, 'to')})"),
    "aten.randperm.default": lambda a: _b(0, a.get(0, "n") - 1, f"randperm({a.get(0, 'n')})"),
    "aten.randperm.generator": lambda a: _b(0, a.get(0, "n") - 1, f"randperm({a.get(0, 'n')})"),
    "aten.clamp.default": lambda a: _intersect(
        a, a.get(1, "min"), a.get(2, "max"), f"clamp({a.get(1, 'min')}, {a.get(2, 'max')})"
    ),
    "aten.clamp_.default": lambda a: _intersect(
        a, a.get(1, "min"), a.get(2, "max"), f"clamp({a.get(1, 'min')}, {a.get(2, 'max')})"
    ),
    "aten.clamp_min.default": lambda a: _intersect(a, a.get(1, "min"), None, f"clamp(min={a.get(1, 'min')})"),
    "aten.clamp_min_.default": lambda a: _intersect(a, a.get(1, "min"), None, f"clamp(min={a.get(1, 'min')})"),
    "aten.clamp_max.default": lambda a: _intersect(a, None, a.get(1, "max"), f"clamp(max={a.get(1, 'max')})"),
    "aten.clamp_max_.default": lambda a: _intersect(a, None, a.get(1, "max"), f"clamp(max={a.get(1, 'max')})"),
    "aten.abs.default": _abs,
    "aten.abs_.default": _abs,
    "aten.relu.default": _relu,
    "aten.relu_.default": _relu,
    "aten.sigmoid.default": lambda a: Bounds(0.0, 1.0, "sigmoid"),
    "aten._softmax.default": lambda a: Bounds(0.0, 1.0, "softmax"),
    "aten.argmax.default": _index_of(_dim_size, "argmax"),
    "aten.argmin.default": _index_of(_dim_size, "argmin"),
    "aten.topk.default": _values_and_indices("topk"),
    "aten.sort.default": _values_and_indices("sort"),
    "aten.nonzero.default": _index_of(lambda a: max(a.args[0].shape, default=1), "nonzero"),
    "aten.multinomial.default": _index_of(lambda a: a.args[0].shape[-1], "multinomial"),
    # An insertion point lies between 0 and the number of boundaries.
    "aten.searchsorted.Tensor": lambda a: _b(0, a.args[0].shape[-1], "searchsorted"),
    "aten.searchsorted.Scalar": lambda a: _b(0, a.args[0].shape[-1], "searchsorted"),
    "aten.bucketize.Tensor": lambda a: _b(0, a.get(1, "boundaries").shape[-1], "bucketize"),
    "aten.add.Tensor": _affine("add"),
    "aten.sub.Tensor": _affine("sub"),
    "aten.mul.Tensor": _affine("mul"),
    "aten.div.Tensor": _affine("div"),
    "aten.add_.Tensor": _affine("add"),
    "aten.sub_.Tensor": _affine("sub"),
    "aten.mul_.Tensor": _affine("mul"),
    "aten.div_.Tensor": _affine("div"),
}


def _sum(a: _Args) -> Bounds | None:
    """A count of True elements lies between 0 and their number; a sum of
    bounded values between the ends times that number."""
    x, own = a.args[0], a.self_bounds
    n = float(x.numel())
    if x.dtype == torch.bool:
        return Bounds(0.0, n, "a count of elements")
    if own is None:
        return None
    ends = tuple(0.0 if math.isnan(e) else e for e in (own.lo * n, own.hi * n))
    return Bounds(min(ends), max(ends), f"a sum of {int(n)} of {own.how}")


for _name in ("aten.sum.default", "aten.count_nonzero.default", "aten.count_nonzero.dim_IntList"):
    _RULES[_name] = _sum
# Rounding, casts, copies and views keep their input's values (or round them inward).
for _name in (
    "floor",
    "ceil",
    "trunc",
    "round",
    "_to_copy",
    "clone",
    "alias",
    "view",
    "_unsafe_view",
    "select.int",
    "slice.Tensor",
    "squeeze.default",
    "squeeze.dim",
    "squeeze.dims",
    "unsqueeze",
    "expand",
    "permute",
    "t",
    "transpose.int",
    "detach",
    "index.Tensor",
    "max",
    "min",
    "amax",
    "amin",
    "mean",
    "reshape",
    "flatten.using_ints",
    "unbind.int",
    "split.Tensor",
):
    _full = f"aten.{_name}" if "." in _name else f"aten.{_name}.default"
    _RULES[_full] = _same

# Rules that give nothing to an output whose inputs have no bounds.
_CARRIED = frozenset(
    name for name, r in _RULES.items() if r is _same or getattr(r, "__qualname__", "").startswith("_affine.")
)


# Note [Bounds that decide a comparison]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A comparison with a number that every value a random source can draw
# answers the same way has that answer whatever the draw: transformers'
# LayerDrop (BART, Whisper, Wav2Vec2 in transformers 5.17) asks
# ``torch.rand([]) < self.layerdrop`` in every training layer, which with
# ``layerdrop=0.0`` is False for any draw.  Such a result is not made up but
# certain, so it is a known value (Note [Known values] in known.py) and the
# ``if`` on it is answered, where it raised a DataDependentError.  Only a
# source's own output decides, and only while nothing wrote it (its version
# counter, which a write through a view bumps too): bounds carried through
# arithmetic ignore integer wraparound and float overflow.
_SOURCES = frozenset(
    name for name in _RULES if name.split(".")[1].startswith(("rand", "uniform_", "bernoulli", "random_"))
)
_DECIDE: dict[str, Callable[[Bounds, float], bool | None]] = {
    "aten.lt.Scalar": lambda b, c: True if b.hi < c else False if b.lo >= c else None,
    "aten.le.Scalar": lambda b, c: True if b.hi <= c else False if b.lo > c else None,
    "aten.gt.Scalar": lambda b, c: True if b.lo > c else False if b.hi <= c else None,
    "aten.ge.Scalar": lambda b, c: True if b.lo >= c else False if b.hi < c else None,
    "aten.eq.Scalar": lambda b, c: False if c < b.lo or c > b.hi else None,
    "aten.ne.Scalar": lambda b, c: True if c < b.lo or c > b.hi else None,
}
COMPARISONS = frozenset(_DECIDE)


def decided(name: str, args: tuple) -> bool | None:
    """The answer of comparison ``name`` that the bounds of its input decide, else None."""
    rule = _DECIDE.get(name)
    if rule is None or len(args) < 2 or type(args[1]) not in (int, float, bool) or math.isnan(float(args[1])):
        return None
    x = args[0]
    drawn = x._md.drawn if isinstance(x, MetaTensor) else None
    if drawn is None or drawn[1] != x._version:
        return None
    return rule(drawn[0], float(args[1]))
