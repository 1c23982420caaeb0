"""``md.max_batch`` for the LLaMA-7B step (AdamW, 2048 tokens, A100 80 GB): the search's time, fresh processes.

    python benchmarks/bench_max_batch.py [--runs 3]

Each run is a new process (the first trace of a process fills the caches,
a search a user starts pays for that), alternating two searches:

- ``shared``: what ``metadispatch trace --max-batch`` does: one model built
  a depth, the confirming batches after one warm-up (Note [One warm-up for
  two batches] in planning/batch.py);
- ``apart``: the search before that: a new model for every trace, and each
  full trace its own warm-up (``share=False``).

Printed: the answer, the traces, the search's wall time (``found.seconds``)
and its CPU time, each run and the median, with the load average, since
this is wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GPU = "a100-80gb"


def one(kind: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from metadispatch.cli import targets
    from metadispatch.cli.steps import with_optimizer
    from metadispatch.cli.trace_cmd import batch_steps
    from metadispatch.mode.mode import MetaMode
    from metadispatch.planning.batch import max_batch

    def build(batch, layers=None):
        return targets.default_target("cuda", True, batch, 2048, layers=layers)

    if kind == "shared":
        make_step = batch_steps(build, "adamw", build(2), "cuda")
    else:

        def make_step(batch, layers=None):
            t = build(batch, layers)
            return with_optimizer(t.step, "adamw"), (t.model, *t.inputs)

    cpu = time.process_time()
    found = max_batch(
        make_step,
        GPU,
        warmup=1,
        scale=(2, 4),
        share=kind == "shared",
        mode_factory=lambda: MetaMode(device="cuda", gpu=GPU),
    )
    cpu = time.process_time() - cpu
    return {
        "batch": found.batch,
        "tried": sorted(found.tried),
        "shared": found.shared,
        "reserved": [found.fits.reserved_peak, found.next.reserved_peak],
        "wall": found.seconds,
        "cpu": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", choices=["shared", "apart"])
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results: dict = {"shared": [], "apart": []}
    for _ in range(args.runs):
        for kind in results:
            load = os.getloadavg()[0]
            out = subprocess.run(
                [sys.executable, __file__, "--one", kind], check=True, capture_output=True, text=True, env=env
            )
            r = json.loads(out.stdout.splitlines()[-1])
            results[kind].append(r)
            print(
                f"{kind:6s} batch {r['batch']} (full traces {r['tried']}, after another's warm-up {r['shared']}): "
                f"{r['wall']:5.1f} s wall, {r['cpu']:4.1f} s CPU, load {load:.1f}",
                flush=True,
            )
    a, b = results["shared"], results["apart"]
    assert [r["batch"] for r in a] == [r["batch"] for r in b] and a[0]["reserved"] == b[0]["reserved"]
    for kind, rs in results.items():
        wall = statistics.median(r["wall"] for r in rs)
        cpu = statistics.median(r["cpu"] for r in rs)
        print(f"median {kind:6s}: {wall:5.1f} s wall, {cpu:4.1f} s CPU")


if __name__ == "__main__":
    main()
