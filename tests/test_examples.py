"""Every script in examples/ runs, and every docstring example in the package holds."""

import doctest
import importlib
import importlib.util
import json
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
_ARGV = {"trace_hf_model.py": ["2"]}

# Each script as ``python script.py`` runs it: ``__main__``, its own argv
# and globals, its output captured; one JSON line per script.
_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv, path = argv, argv[0]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
            ok = True
        except SystemExit as e:
            ok = e.code in (None, 0)
        except BaseException:
            ok = False
            traceback.print_exc()
    print(json.dumps([ok, out.getvalue(), err.getvalue()]), flush=True)
"""


@pytest.fixture(scope="module")
def script_runs(request) -> dict:
    """name -> (ok, stdout, stderr) of every script this session selected.

    The scripts run one after another in one child process: a fresh
    interpreter for each cost an ``import torch`` (and the first meta
    kernels' imports of torch._dynamo) apiece, most of their time.  Each
    still runs as ``__main__`` with fresh globals; what they share is the
    process (custom_op_rule.py's op and rule stay registered after it).
    """
    selected = [
        item.callspec.params["script"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_examples_script_runs"
    ]
    argvs = [[str(p), *_ARGV.get(p.name, [])] for p in selected]
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(argvs)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == len(selected), result.stderr[-3000:]
    return {p.name: line for p, line in zip(selected, lines)}


@pytest.mark.parametrize("script", _SCRIPTS, ids=lambda p: p.name)
def test_examples_script_runs(script, script_runs):
    ok, out, err = script_runs[script.name]
    assert ok, err[-3000:]
    assert out.strip()


# metadispatch.integrations.X imports the framework X, which is optional.
MODULES = ["metadispatch"] + sorted(
    m.name
    for m in pkgutil.walk_packages(metadispatch.__path__, "metadispatch.")
    if m.name != "metadispatch.__main__"
    and not (
        m.name.startswith("metadispatch.integrations.") and importlib.util.find_spec(m.name.rsplit(".", 1)[1]) is None
    )
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
