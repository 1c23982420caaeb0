"""Does repeated use grow the process?  metadispatch beside FakeTensorMode.

    python benchmarks/bench_growth.py           # the full loops (a few minutes)
    python benchmarks/bench_growth.py --quick   # a tenth of each loop

Three loops, each run for each tool in a fresh interpreter so one cannot
inherit the other's caches or allocator state:

- mode entries: enter and leave a mode 200,000 times, one op inside;
- fresh traces: trace a small MLP step (forward and backward) on 1,000 fresh
  1 MiB inputs, dropping each result;
- distinct shapes: 10,000 matmuls of distinct shapes inside one mode, every
  one a new cache key; metadispatch's mode also records them (its trace
  grows by two calls an iteration, ~1.4 KB), so the loop runs again with
  ``MetaMode(record=False)``: the cache alone.

Growth is resident memory (VmRSS) after the loop minus after a warm-up of the
same loop, with ``gc.collect()`` before each reading: what the loop keeps,
not what the first iteration imports.  Each tool's caches are left as its
users would leave them (metadispatch's shared metadata cache is bounded by
entries and bytes, see docs/cache.md).
"""

from __future__ import annotations

import gc
import subprocess
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks.common import machine, rss, table  # noqa: E402

LOOPS = {"mode entries": 200_000, "fresh traces": 1_000, "distinct shapes": 10_000, "distinct shapes, no trace": 10_000}
_ROWS = 2**14  # a fresh 1 MiB input each trace (16 float32 columns), as in issue 13


def _mode(tool, record: bool = True):
    if tool == "metadispatch":
        import metadispatch as md

        return md.MetaMode(record=record)
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _iteration(loop: str, tool: str):
    """One iteration of ``loop`` for ``tool``, as a closure over its setup."""
    if loop == "mode entries":

        def once(i):
            with _mode(tool):
                torch.ones(2) + 1

        return once
    model = _mlp()
    if loop == "fresh traces":
        if tool == "metadispatch":
            import metadispatch as md

            def once(i):
                md.trace(lambda x: model(x).sum().backward(), torch.randn(_ROWS, 16))
        else:
            state = {k: v.detach().requires_grad_() for k, v in model.state_dict().items()}

            def once(i):
                with _mode(tool) as mode:
                    fake_model = _mlp()  # FakeTensorMode has no step tracer: convert by hand
                    fake_model.load_state_dict({k: mode.from_tensor(v) for k, v in state.items()}, assign=True)
                    fake_model(mode.from_tensor(torch.randn(_ROWS, 16))).sum().backward()

        return once
    mode = _mode(tool, record=loop == "distinct shapes")
    mode.__enter__()  # one mode for the whole loop: the cache is what grows
    w = torch.empty(4, 4)

    def once(i):
        torch.empty(i + 1, 4) @ w

    return once


def child(loop: str, tool: str, n: int) -> None:
    torch.set_num_threads(1)
    once = _iteration(loop, tool)
    for i in range(max(1, n // 20)):  # warm-up: imports, first-call caches
        once(n + i if loop.startswith("distinct") else -1 - i)
    gc.collect()
    before = rss()
    for i in range(n):
        once(i)
    gc.collect()
    print(rss() - before)


def measure(loop: str, tool: str, n: int) -> int:
    out = subprocess.run(
        [sys.executable, __file__, "--child", loop, tool, str(n)], check=True, capture_output=True, text=True
    ).stdout
    return int(out.split()[-1])


def main(quick: bool) -> None:
    print(machine())
    rows = []
    for loop, n in LOOPS.items():
        n = n // 10 if quick else n
        ours, fake = measure(loop, "metadispatch", n), measure(loop, "FakeTensorMode", n)
        rows.append((f"{loop} ({n:,})", f"{ours / 2**20:.1f}", f"{fake / 2**20:.1f}"))
    print(table(rows, ("loop", "metadispatch MiB", "FakeTensorMode MiB")))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main("--quick" in sys.argv)
