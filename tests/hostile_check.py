"""Run hostile trace files as a user would, in a child process: one JSON line of findings each.

``python tests/hostile_check.py LIMIT FILE...`` limits the process to LIMIT
bytes of address space, warms up every lazy import a good file needs (so that
a module imported later is one a file caused), then for each file prints
``{"start": name}``, loads it, prints it (``str``, ``summary``, the command
line's report), replays it against ``hostile_doc.user_tensors()`` and runs
the ``repro()`` snippets of its calls (of a long trace, the first and last
hundred), and prints ``{"file": name, "stage":
..., "error": ..., "changed": ..., "modules": ...}``; last,
``{"maxrss_kib": ...}``.

Files named ``*-tight-*`` replay under a small budget (64 MiB, 10**9
FLOPs): what they test is that the budget counts something (calls, scratch),
which the default budget -- half this machine's free memory -- would allow.

There is no alarm here: a signal handler cannot interrupt a long C kernel.
The parent (tests/execution/test_hostile.py) kills this process when a file runs past
its time and starts another at the next file.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time

from tests.hostile_doc import step, user_tensors

TIGHT = (1 << 26, 10**9)  # bytes, FLOPs


def main(limit: int, paths: list) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    import metadispatch as md
    from metadispatch.cli.summary import report
    from metadispatch.ir.text import printable

    lin, x, y = user_tensors()
    originals = [t.detach().clone() for t in (x, y, *lin.parameters())]
    warm = os.path.join(os.getcwd(), "warm.json")  # the child runs in a scratch directory
    md.trace(step, lin, x, y).save(warm)
    md.replay(md.Trace.load(warm), (lin, x, y))
    report(md.Trace.load(warm))
    md.Trace.load(warm)[0].repro()
    for path in paths:
        name = os.path.basename(path)
        print(json.dumps({"start": name}), flush=True)
        before = set(sys.modules)
        start = time.perf_counter()
        budget = md.Budget(*TIGHT) if "-tight-" in name else None
        stage, error = "load", None
        try:
            t = md.Trace.load(path)
            stage = "print"
            text = str(t) + t.summary() + report(t)
            stage = "replay"
            md.replay(t, (lin, x, y), budget=budget)
            stage = "repro"  # run only what replay ran within its budget
            for call in _ends(t.calls):
                code = compile(call.repro(), "<repro>", "exec")
                try:
                    exec(code, {"print": lambda *a: None})
                except RuntimeError:  # the real kernel refusing, as it would for the user
                    pass
            stage = "done"
            del text
        except md.MetaDispatchError as e:
            error = type(e).__name__
            printable(str(e))
        except BaseException as e:  # noqa: BLE001 -- reported, the test fails on it
            error = f"untyped {type(e).__name__}: {str(e)[:300]}"
        finally:
            t = None
            gc.collect(1)  # young objects only: a full collection costs ~0.1 s a file with torch loaded
        changed = not all(torch.equal(a, b) for a, b in zip(originals, (x, y, *lin.parameters())))
        print(
            json.dumps(
                {
                    "file": name,
                    "stage": stage,
                    "error": error,
                    "seconds": time.perf_counter() - start,
                    "changed": changed,
                    "modules": sorted(set(sys.modules) - before)[:5],
                }
            ),
            flush=True,
        )
    print(json.dumps({"maxrss_kib": _peak_rss_kib()}), flush=True)


def _peak_rss_kib() -> int:
    """This program's peak resident set, in KiB.

    ``VmHWM``, not ``ru_maxrss``: Linux folds the RSS of the image a process
    had before ``exec`` into ``ru_maxrss``, and a child forked from a pytest
    worker that has run a few hundred tests starts from that worker's ~2 GiB
    (the suite once reported 2.27 GiB for a corpus that peaks under 1 GiB).
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _ends(calls: list) -> list:
    """The calls whose snippets are run: all of a short trace; of a long one
    the first and last hundred (hostile calls are appended to a base trace)."""
    return calls if len(calls) <= 400 else calls[:100] + calls[-100:]


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
