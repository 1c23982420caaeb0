"""pytest plugin: MetaMode in a test's body, its device from a marker, golden traces.

Active once metadispatch is installed (entry point ``pytest11``); without
installing, add ``-p metadispatch_pytest``.  It gives:

- fixture ``meta_mode``: a :class:`~metadispatch.MetaMode` entered for the
  test's body and left after it, also when the test fails;
- marker ``@pytest.mark.metadispatch(device="cuda", stack=False)``: the
  keyword arguments of that mode.  ``pytest.mark.parametrize("meta_mode",
  ["cpu", "cuda"], indirect=True)`` sets the device per parameter instead;
- fixture ``expect_trace``: :func:`metadispatch.testing.assert_trace`, a
  golden-string comparison that ``EXPECTTEST_ACCEPT=1 pytest`` rewrites.

::

    @pytest.mark.metadispatch(device="cuda")
    def test_linear_runs_on_cuda(meta_mode, expect_trace):
        torch.nn.Linear(4, 2)(torch.empty(3, 4))
        expect_trace(meta_mode, \"\"\"\"\"\")   # filled in by EXPECTTEST_ACCEPT=1

Loading the plugin imports neither torch nor metadispatch: every pytest run
of a project that has metadispatch installed loads it, used or not.  That is
why it is a top-level module and not ``metadispatch.testing.plugin``: any
module inside the package runs ``metadispatch/__init__.py``, which imports
torch.  The fixtures import metadispatch when a test first asks for them.
"""

from __future__ import annotations

import pytest

_MARKER = "metadispatch"


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", f"{_MARKER}(device=None, stack=False): options of the MetaMode the meta_mode fixture enters"
    )


def _mode_options(request) -> dict:
    options: dict = {}
    marker = request.node.get_closest_marker(_MARKER)
    if marker is not None:
        if marker.args:
            raise pytest.UsageError(f"@pytest.mark.{_MARKER} takes keyword arguments only, e.g. device='cuda'")
        options.update(marker.kwargs)
    param = getattr(request, "param", None)
    if isinstance(param, dict):
        options.update(param)
    elif param is not None:
        options["device"] = param
    return options


@pytest.fixture
def meta_mode(request):
    """A MetaMode active for the test's body; see the module docstring."""
    from metadispatch import MetaMode

    with MetaMode(**_mode_options(request)) as mode:
        yield mode


@pytest.fixture
def expect_trace():
    """``expect_trace(trace_or_mode, "golden")``: metadispatch.testing.assert_trace."""
    from metadispatch.testing import assert_trace

    return assert_trace
