"""In-place random fills: ``normal_``, ``cauchy_``, ``exponential_``,
``geometric_``, ``log_normal_`` return ``self``, unchanged in metadata.

Note [Random fills without dynamo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch answers these on meta through its Python references
(``torch._refs.normal`` and friends), wrapped in ``torch._disable_dynamo``,
whose first call imports ``torch._dynamo``: about 1.5 s, paid by every
process that traces a model built with ``nn.init`` -- ``metadispatch trace``
on the default spent more time there than tracing.  The answer needs none
of it: the op writes ``self`` and returns it.  What the rules keep is the
kernels' refusals, checked before anything is written, in the CPU kernels'
order (the argument, then the dtype) and with their messages; the meta
kernels refuse the same calls (``tests/rules/test_rules.py`` checks both
against CPU).  The checks are plain ``if``s: ``torch._check`` imports
``torch.fx.experimental.symbolic_shapes`` on first use, another 0.7 s.  ``uniform_``, ``bernoulli_`` and ``random_`` have C++ meta
kernels and need no rule.
"""

from __future__ import annotations

import torch

from ..core.registry import builtin_rule

aten = torch.ops.aten


def _fill(x, what: str, argument_ok: bool, refusal: str, dtype_ok: bool):
    """``x``, after the CPU kernel's checks: its argument, then its dtype."""
    if not argument_ok:
        raise RuntimeError(refusal)
    if not dtype_ok:
        raise RuntimeError(f"{what} not implemented for {x.dtype}")
    return x


@builtin_rule(aten.normal_.default)
def normal_(x, mean=0.0, std=1.0, *, generator=None):
    return _fill(
        x,
        "normal_",
        std >= 0.0,
        f"normal expects std >= 0.0, but found std {std}",
        x.is_floating_point() or x.is_complex(),
    )


@builtin_rule(aten.cauchy_.default)
def cauchy_(x, median=0.0, sigma=1.0, *, generator=None):
    return _fill(
        x, "cauchy_", sigma > 0.0, f"cauchy_ expects sigma > 0.0, but found sigma={sigma}", x.is_floating_point()
    )


@builtin_rule(aten.exponential_.default)
def exponential_(x, lambd=1.0, *, generator=None):
    return _fill(
        x,
        "exponential_",
        lambd > 0.0,
        f"exponential_ expects lambda > 0.0, but found lambda={lambd}",
        x.is_floating_point(),
    )


@builtin_rule(aten.geometric_.default)
def geometric_(x, p, *, generator=None):
    return _fill(
        x,
        "geometric_",
        0 < p < 1,
        f"geometric_ expects p to be in (0, 1), but got p={p}",
        x.dtype != torch.bool and not x.is_complex(),
    )


@builtin_rule(aten.log_normal_.default)
def log_normal_(x, mean=1.0, std=2.0, *, generator=None):
    return _fill(
        x, "log_normal_", std > 0.0, f"log_normal_ expects std > 0.0, but found std={std}", x.is_floating_point()
    )
