"""The guard-page allocator the memory tests run replay under: tests/pageguard.c, built on demand.

A kernel that reads or writes a few bytes past a tensor often neither
crashes nor changes a result anyone compares: replay says ``ok`` over heap
memory.  So the hostile corpus, the fuzzer and the kernel proofs run their
child processes with ``LD_PRELOAD`` of a small allocator that gives every
tensor's memory (the aligned allocations torch's CPU allocator makes) its own
mapping ending at an inaccessible page: touching past the end kills the
child with SIGSEGV, which the parent reports against the file in flight.
(Debian's electric-fence cannot load torch: it guards every malloc and runs
out of the kernel's memory mappings while torch imports -- pageguard.c says
more.)

:func:`preload` compiles it with the C compiler on ``PATH`` (``cc``,
``gcc`` or ``clang``), once per machine and source, into the temporary
directory; a test calls :func:`require`, which skips with the reason where
there is no compiler or no Linux.  ``.ci/run`` installs a compiler where it
can.  By hand::

    cc -shared -fPIC -O2 -o /tmp/pageguard.so tests/pageguard.c -ldl
    PAGEGUARD_EXACT=1 LD_PRELOAD=/tmp/pageguard.so metadispatch replay FILE
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pageguard.c")


def preload() -> tuple[str | None, str]:
    """``(path of the built library, "")``, or ``(None, why it cannot be built here)``."""
    if not sys.platform.startswith("linux"):
        return None, f"the guard-page allocator (tests/pageguard.c) needs Linux, not {sys.platform}"
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        return None, (
            "no C compiler (cc, gcc or clang) on PATH to build the guard-page allocator tests/pageguard.c; "
            "install one (Debian: apt-get install gcc) -- .ci/run does where it can"
        )
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"metadispatch-pageguard-{digest}.so")
    if not os.path.exists(out):
        partial = f"{out}.{os.getpid()}"
        run = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", partial, SOURCE, "-ldl"], capture_output=True, text=True
        )
        if run.returncode != 0:
            return None, f"{compiler} could not build tests/pageguard.c: {run.stderr.strip()[-500:]}"
        os.replace(partial, out)  # atomic: workers building at once each install a whole library
    return out, ""


def require() -> str:
    """The library's path; skips the calling test, with the reason, where it cannot be built."""
    path, why = preload()
    if path is None:
        pytest.skip(why)
    return path


def environment(library: str, base: dict | None = None, below: bool = False, exact: bool = True) -> dict:
    """The environment of a child that runs under the guard: past the end of every tensor's memory
    (``exact``: with no alignment slack) or, with ``below``, before its start."""
    env = dict(os.environ if base is None else base)
    env.update(LD_PRELOAD=library, PAGEGUARD_EXACT="1" if exact else "0", PAGEGUARD_BELOW="1" if below else "0")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
