"""Run every benchmark and print their tables: ``python -m benchmarks``.

Each figure is a ratio measured side by side in one run (or an absolute
bound, for memory), printed with the absolute times beside it.
"""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for script in (
    "bench_startup.py",
    "bench_trace.py",
    "bench_footprint.py",
    "bench_replay.py",
    "bench_growth.py",
    "bench_distributed.py",
    "bench_analysis.py",
    "bench_sdpa_profile.py",
    "bench_max_batch.py",
):
    print(f"\n== {script}", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=True, cwd=HERE.parent)
