"""Assertions for test suites: same ops as another function, or as a golden string.

Both compare canonical forms (:func:`metadispatch.debug.diff.canonical`), so they
do not depend on memory addresses, checkout paths, id numbering or the
keyword defaults that torch's bindings pass in one version and not the next.

>>> import torch, metadispatch as md
>>> md.testing.assert_same_ops(lambda x: x * 2, lambda x: 2 * x, torch.ones(3))
>>> md.testing.assert_same_ops(lambda x: x * 2, lambda x: x + x, torch.ones(3))
Traceback (most recent call last):
  ...
AssertionError: the two functions run different ops:
--- a
+++ b
@@ -1,2 +1,2 @@
 $0: f32[3] = arg
-$1: f32[3] = aten.mul.Tensor($0, 2)
+$1: f32[3] = aten.add.Tensor($0, $0)

Golden traces use expecttest: ``expected`` must be a string literal at the
call site, which ``EXPECTTEST_ACCEPT=1 pytest`` rewrites in place::

    md.testing.assert_trace(mode.trace, \"\"\"\\
    $0: f32[3] = arg args[0]
    \"\"\")
"""

from __future__ import annotations

from typing import Callable

from ..tracing.tracer import tracer
from ..debug.diff import canonical, diff
from ..core.mode import MetaMode
from ..ir.trace import Trace

__all__ = ["assert_same_ops", "assert_trace", "expected_form"]


def assert_same_ops(fn_a: Callable, fn_b: Callable, *args, device=None, modules: bool = False,
                    names: bool = False, **kwargs) -> None:
    """Fail, showing :func:`metadispatch.diff`, unless both run the same ops.

    Each function is traced with ``md.trace`` on the same arguments (on
    logical ``device`` if given); their traces must be equivalent.
    """
    run = tracer(device=device)
    a = run(fn_a, *args, **kwargs)
    b = run(fn_b, *args, **kwargs)
    d = diff(a, b, modules=modules, names=names)
    if d:
        raise AssertionError("the two functions run different ops:\n" + d)


def expected_form(trace: Trace | MetaMode | str) -> str:
    """The text a golden trace is compared with: canonical, with modules and names."""
    if isinstance(trace, MetaMode):
        trace = trace.trace
    return "\n".join(canonical(trace)) + "\n"


def assert_trace(trace: Trace | MetaMode | str, expected: str, *, skip: int = 0) -> None:
    """Compare a trace with the golden string literal ``expected`` (expecttest).

    With ``EXPECTTEST_ACCEPT=1`` a mismatch rewrites the literal in the
    caller's source instead of failing.  ``skip`` is the number of helper
    frames between the literal and this call.
    """
    import expecttest  # a test dependency only

    expecttest.assert_expected_inline(expected_form(trace), expected, skip=1 + skip)
