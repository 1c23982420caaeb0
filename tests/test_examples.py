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


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_examples_script_runs(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [sys.executable, str(script)] + (["2"] if script.name == "trace_hf_model.py" else [])
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


MODULES = sorted(m.name for m in pkgutil.walk_packages(metadispatch.__path__, "metadispatch.")
                 if m.name != "metadispatch.__main__")


@pytest.mark.parametrize("name", ["metadispatch"] + MODULES)
def test_examples_docstrings_hold(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
