"""Start-up costs, each in a fresh process: ``import torch``, ``import
metadispatch`` (target: at most 0.3 s more than torch), and ``metadispatch
trace`` on the default (target: under 3 s wall on 2 cores).

Wall time is what a user waits; CPU time (user + system of the child) is
printed beside it because on a shared machine wall time also counts other
people's work.  Each figure is the best of ``--repeat`` runs.  Then
``-X importtime`` says where import time goes: metadispatch's own modules,
and the heaviest imports ``metadispatch trace`` pulls in (``torch._dynamo``
is the one to watch: torch's Python references import it on first use,
Note [Random fills without dynamo] in ``metadispatch/rules/random_fill.py``).

    python benchmarks/bench_startup.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time

from common import machine

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)


_BARE = ("--optimizer", "none", "--steps", "1")


def _cli() -> list[str]:
    exe = shutil.which("metadispatch")
    return [exe] if exe else [PY, "-m", "metadispatch"]


def _run(cmd: list[str]) -> tuple[float, float]:
    """(wall, child CPU) seconds of one run of ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=ENV, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def best(cmd: list[str], repeat: int) -> tuple[float, float]:
    runs = [_run(cmd) for _ in range(repeat)]
    return min(w for w, _ in runs), min(c for _, c in runs)


def importtime(code: list[str]) -> list[tuple[str, int, int]]:
    """(module, self us, cumulative us) from ``python -X importtime``."""
    err = subprocess.run(code, env=ENV, capture_output=True, text=True, check=True).stderr
    rows = []
    for line in err.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, total, name = line[len("import time:") :].split("|")
        rows.append((name[1:].rstrip(), int(own), int(total)))  # nesting kept as leading spaces
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    repeat = parser.parse_args().repeat
    print(machine())
    print(f"load average {os.getloadavg()[0]:.1f}; best of {repeat} fresh processes\n")

    torch_w, torch_c = best([PY, "-c", "import torch"], repeat)
    md_w, md_c = best([PY, "-c", "import metadispatch"], repeat)
    # the bare forward and backward: the default's AdamW steady state traces two steps (cli/steps.py)
    trace_w, trace_c = best(_cli() + ["trace", *_BARE], repeat)
    default_w, default_c = best(_cli() + ["trace"], repeat)  # what the Quickstart runs
    rows = [
        ("import torch", torch_w, torch_c, ""),
        ("import metadispatch", md_w, md_c, f"+{md_w - torch_w:.2f} s wall over torch (target <= 0.3 s)"),
        ("metadispatch trace --optimizer none --steps 1", trace_w, trace_c, ""),
        ("metadispatch trace (defaults)", default_w, default_c, "target < 3 s wall on 2 cores"),
    ]
    print(f"{'what':<46}{'wall':>8}{'cpu':>8}  note")
    for what, w, c, note in rows:
        print(f"{what:<46}{w:>7.2f}s{c:>7.2f}s  {note}")

    own = [
        r
        for r in importtime([PY, "-X", "importtime", "-c", "import metadispatch"])
        if r[0].lstrip().startswith("metadispatch")
    ]
    print(f"\nmetadispatch's own modules, self time: {sum(r[1] for r in own) / 1e3:.0f} ms in {len(own)} modules")
    trace_imports = importtime([PY, "-X", "importtime", "-m", "metadispatch", "trace"])
    heavy = sorted((r for r in trace_imports if not r[0].startswith(" ")), key=lambda r: -r[2])[:6]
    print("heaviest top-level imports of `metadispatch trace`:")
    for name, _, total in heavy:
        print(f"  {name:<28}{total / 1e3:>8.0f} ms")


if __name__ == "__main__":
    main()
