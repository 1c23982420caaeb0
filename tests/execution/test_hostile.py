"""Hostile trace files: the corpus of tests/hostile_traces.py, run as a user would.

The corpus runs in a child process with an address-space limit
(hostile_check.py), as a user running ``metadispatch replay`` on a file from
anyone would; each file's outcome, memory, imports and effects are checked
against what its name says (see hostile_traces.py).  Time is bounded from
here: a file still running after ``_PER_FILE`` seconds -- a C kernel no
signal interrupts -- gets the child killed and counts as a failure, and a
new child takes the files after it.  A sample of the corpus also goes
through the command line itself.  One promise at a time:
test_hostile_load.py, test_hostile_replay.py; random mutations:
test_hostile_fuzz.py.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time

import pytest

from tests import guarded, hostile_check
from tests import hostile_traces as hostile

_LIMIT = 4 << 30  # RLIMIT_AS of the child: torch itself maps about 0.7 GiB
_PER_FILE = 30.0  # seconds a file may take; loading torch and warming up gets _START
_START = 300.0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    directory, outside, home = root / "corpus", root / "outside", root / "home"
    for d in (directory, outside, home):
        d.mkdir()
    names = hostile.write_corpus(str(directory), str(outside))
    before = _listing(root)
    env = dict(os.environ, HOME=str(home), TMPDIR=str(home), PYTHONPATH=os.getcwd())
    results, rss = _run(directory, names, home, env)
    return dict(
        names=names,
        results=results,
        rss=rss,
        directory=directory,
        outside=outside,
        home=home,
        env=env,
        root=root,
        before=before,
        after=_listing(root),
    )


# Files aimed at kernels that follow values (hostile_indices.py) and at replay's memory (hostile_memory.py)
_MEMORY = ("-checked-", "-full-", "-refused-", "-missing-argument-", "sparse-", "reshape-alias-")


def _memory(names: list) -> list:
    return [n for n in names if any(k in n for k in _MEMORY)]


@pytest.fixture(scope="module")
def guarded_runs(corpus):
    """The whole corpus again under the guard-page allocator (tests/guarded.py): past the end of every
    tensor's memory; and the memory files with the guard before it."""
    library = guarded.require()
    home, directory = corpus["home"], corpus["directory"]
    above, _ = _run(directory, corpus["names"], home, guarded.environment(library, corpus["env"]))
    below, _ = _run(directory, _memory(corpus["names"]), home, guarded.environment(library, corpus["env"], below=True))
    return {"above": above, "below": below}


def _run(directory, names: list, home, env) -> tuple:
    """Every file through hostile_check.py: (results by name, peak RSS of each child)."""
    results: dict = {}
    rss: list = []
    todo = list(names)
    while todo:
        with open(home / "stderr", "wb") as err:
            child = subprocess.Popen(
                [sys.executable, hostile_check.__file__, str(_LIMIT), *(str(directory / n) for n in todo)],
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=str(home),
                env=env,
            )
            todo = _follow(child, todo, results, rss)
    return results, rss


def _follow(child, todo: list, results: dict, rss: list) -> list:
    """Read ``child``'s lines until it ends or a file runs past its time; the files still to run.

    Reads the pipe unbuffered: a line sitting in a reader's buffer would keep
    ``select`` waiting for data that has already come.
    """
    fd, pending = child.stdout.fileno(), b""
    current, deadline = None, time.monotonic() + _START
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            chunk = os.read(fd, 1 << 16) if sel.select(timeout=max(deadline - time.monotonic(), 0)) else None
            if not chunk:  # killed for time, or it crashed: the file in flight is the culprit
                why = f"killed after {_PER_FILE:.0f} s" if chunk is None else "the child died"
                child.kill()
                why += f" ({child.wait()})"
                if current is None and not todo:
                    return []
                failed = current or todo[0]
                results[failed] = {"file": failed, "stage": "?", "error": f"untyped {why}", "changed": False}
                return todo[todo.index(failed) + 1 :]
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                record = json.loads(line)
                if "start" in record:
                    current, deadline = record["start"], time.monotonic() + _PER_FILE
                elif "file" in record:
                    results[record["file"]] = record
                    todo.remove(record["file"])
                    current = None
                elif "maxrss_kib" in record:
                    rss.append(record["maxrss_kib"])
                    child.wait()
                    return []


def _listing(root) -> dict:
    return {str(p): p.lstat().st_mtime_ns for p in root.rglob("*") if "home" not in p.parts}


@pytest.mark.slow  # the corpus fixture runs every file in a subprocess
def test_hostile_corpus_has_every_class_and_a_hundred_files(corpus):
    names = corpus["names"]
    assert len(names) >= 100
    assert {n.split("-")[0] for n in names} == set(hostile.CLASSES)


@pytest.mark.slow  # the corpus fixture runs every file in a subprocess
def test_hostile_corpus_has_150_files_aimed_at_kernels_that_follow_values(corpus):
    names = corpus["names"]
    assert len([n for n in names if any(k in n for k in _MEMORY[:4])]) >= 150
    assert {n.split("-")[0] for n in _memory(names)} >= {"load", "replay", "safe"}


@pytest.mark.slow  # the corpus fixture runs every file in a subprocess
def test_hostile_check_ran_every_file(corpus):
    assert sorted(corpus["results"]) == sorted(corpus["names"])


_EXPECTED = {
    "load": lambda r: r["stage"] == "load" and r["error"] == "TraceFormatError",
    "replay": lambda r: r["stage"] == "replay" and r["error"] == "ReplayError",
    "budget": lambda r: r["stage"] == "replay" and r["error"] == "BudgetExceededError",
    "safe": lambda r: r["error"] is None or not r["error"].startswith("untyped"),
}


@pytest.mark.slow  # the corpus fixture runs every file in a subprocess
def test_hostile_files_end_as_their_class_says(corpus):
    wrong = [r for name, r in corpus["results"].items() if not _EXPECTED[name.split("-")[0]](r)]
    assert wrong == []


@pytest.mark.slow  # the corpus under the guard allocator, twice
@pytest.mark.parametrize("guard", ["above", "below"])
def test_hostile_files_end_as_their_class_says_under_the_guard_allocator(corpus, guarded_runs, guard):
    """0 crashes, 0 untyped errors, 0 ``replay ok`` on an out-of-range index: an out-of-bounds read
    or write the plain run would miss kills the child here (the file then ends 'untyped')."""
    results = guarded_runs[guard]
    want = corpus["names"] if guard == "above" else _memory(corpus["names"])
    assert sorted(results) == sorted(want)
    wrong = {n: r for n, r in results.items() if not _EXPECTED[n.split("-")[0]](r) or r["changed"]}
    assert wrong == {}


@pytest.mark.slow  # the corpus fixture runs every file in a subprocess
def test_hostile_files_never_change_the_callers_tensors(corpus):
    assert [n for n, r in corpus["results"].items() if r["changed"]] == []


@pytest.mark.slow  # the corpus fixture runs every file in a subprocess
def test_hostile_files_import_no_module(corpus):
    assert {n: r["modules"] for n, r in corpus["results"].items() if r.get("modules")} == {}


@pytest.mark.slow  # the corpus fixture runs every file in a subprocess
def test_hostile_files_create_no_marker_and_touch_no_file(corpus):
    assert list(corpus["outside"].iterdir()) == []
    assert corpus["after"] == corpus["before"]


@pytest.mark.slow  # the corpus fixture runs every file in a subprocess
def test_hostile_files_are_handled_in_bounded_time_and_memory(corpus):
    # Time is bounded by the runner (_run kills a child after _PER_FILE
    # seconds on one file), not by a measured duration: no file may hit it.
    killed = sorted(n for n, r in corpus["results"].items() if "killed" in (r["error"] or ""))
    assert killed == []
    assert corpus["rss"] and max(corpus["rss"]) < (2 << 20)  # KiB: under 2 GiB peak


# One file of each outcome, and names and keys with terminal escapes: the exit
# code docs/cli.md promises (0 ok, 1 mismatches, 3 refused) and one line on
# stderr, escaped.  (what, which of the files of that name) -> exit codes.
_CLI_SAMPLE = {
    ("escape-in-modules-key", 0): {3},
    ("reshape-alias-write", 0): {3},
    ("sum-2**62-zero-stride", 0): {3},
    ("sparse-over-caller", 0): {3},
    ("norm-stats-batch_norm", 0): {0, 1},
    ("module-name", 1): {0, 1},  # the second module-name payload holds escape codes
}
# The command line's main() for each file in one child (one torch import,
# not one per file): exit code, stdout and stderr as JSON lines.
_CLI_CHILD = """
import contextlib, io, json, sys
from metadispatch.cli.main import main
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["replay", path])
    print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


@pytest.mark.slow  # starts Python twice
def test_hostile_command_line_refuses_in_one_escaped_line(corpus):
    def file(what, k):
        return str(corpus["directory"] / [n for n in corpus["names"] if n.split("-", 2)[2] == f"{what}.json"][k])

    paths = [file(*key) for key in _CLI_SAMPLE]
    run = {"cwd": str(corpus["home"]), "env": corpus["env"], "capture_output": True, "text": True, "timeout": 300}
    # The installed entry point once, on the first file: what a user types.
    entry = subprocess.run([sys.executable, "-m", "metadispatch", "replay", paths[0]], **run)
    child = subprocess.run([sys.executable, "-c", _CLI_CHILD, *paths], **run)
    outcomes = dict(zip(_CLI_SAMPLE, (json.loads(line) for line in child.stdout.splitlines())))
    assert len(outcomes) == len(_CLI_SAMPLE), child.stderr[-2000:]
    assert [entry.returncode, entry.stdout, entry.stderr] == outcomes[next(iter(_CLI_SAMPLE))]
    assert {key: code for key, (code, _, _) in outcomes.items() if code not in _CLI_SAMPLE[key]} == {}
    for key, (code, out, err) in outcomes.items():
        assert "\x1b" not in out + err and "Traceback" not in err, key
        if code == 3:
            assert err.startswith("metadispatch replay: ") and len(err.splitlines()) == 2, err
