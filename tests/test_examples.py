"""Every script in examples/ runs, and every docstring example in the package holds."""

import doctest
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import metadispatch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


# trace_hf_model.py builds a transformers model: slow (CONTRIBUTING.md, markers).
_SCRIPTS = [pytest.param(p, marks=pytest.mark.slow) if p.name == "trace_hf_model.py" else p for p in EXAMPLES]


@pytest.mark.parametrize("script", _SCRIPTS, ids=lambda p: p.name)
def test_examples_script_runs(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [sys.executable, str(script)] + (["2"] if script.name == "trace_hf_model.py" else [])
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


MODULES = ["metadispatch"] + sorted(
    m.name for m in pkgutil.walk_packages(metadispatch.__path__, "metadispatch.") if m.name != "metadispatch.__main__"
)


def _examples(name: str) -> int:
    return sum(len(t.examples) for t in doctest.DocTestFinder().find(importlib.import_module(name)))


# Only modules whose docstrings hold examples: a case that runs none could not fail.
WITH_EXAMPLES = [name for name in MODULES if _examples(name)]


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_examples_docstrings_hold(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
