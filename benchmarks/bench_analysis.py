"""How long the analyses of a large trace take: the built-in LLaMA-7B step.

    python benchmarks/bench_analysis.py

Traces the built-in LLaMA-7B bf16 training step (1 x 2048 tokens, logical
``cuda``) once, then times each analysis of that trace (median CPU time of
3 runs after one warm-up): ``md.memory``, the caching-allocator simulation
(``md.memory(allocator="cuda")``), ``md.fits`` and ``md.runtime``.  The
targets (issue 18): the simulation and the step-time estimate each under
1 s.  The ratio is to the time of tracing the step in the same run.  It
also prints the estimate's figures: step time, MFU, peak reserved.
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import metadispatch as md  # noqa: E402
from benchmarks.common import best_of, machine, table  # noqa: E402
from metadispatch.cli.targets import default_target  # noqa: E402


def main() -> None:
    target = default_target("cuda", True, 1, 2048)
    t0 = time.process_time()
    trace = md.tracer(device="cuda")(target.step, target.model, *target.inputs)
    traced = time.process_time() - t0
    analyses = {
        "md.memory": lambda: md.memory(trace),
        'md.memory(allocator="cuda")': lambda: md.memory(trace, allocator="cuda", gpu="h100"),
        'md.fits(gpu="h100")': lambda: md.fits(trace, gpu="h100"),
        'md.runtime(gpu="h100")': lambda: md.runtime(trace, gpu="h100"),
    }
    rows = [("trace the step", f"{traced:.2f}s", "1.00")]
    for name, fn in analyses.items():
        seconds = best_of(fn, repeat=3)
        rows.append((name, f"{seconds:.2f}s", f"{seconds / traced:.2f}"))
    print(machine())
    print(f"LLaMA-7B bf16 step, 1 x 2048 tokens: {len(trace.calls)} calls")
    print(table(rows, ("what", "cpu", "of tracing")))
    r, cuda = md.runtime(trace, gpu="h100"), md.memory(trace, allocator="cuda", gpu="h100")
    print(f"estimate: {r.total * 1e3:.1f} ms, MFU {r.mfu:.1%}; {cuda.reserved_peak / 2**30:.1f} GiB reserved")


if __name__ == "__main__":
    main()
