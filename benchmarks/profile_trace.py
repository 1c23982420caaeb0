"""Where md.trace spends its time, by stage (cProfile, cumulative).

    python benchmarks/profile_trace.py

The profiler inflates small Python functions, so read the shares, not the
milliseconds.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import metadispatch as md  # noqa: E402
from benchmarks.common import llama_config, table  # noqa: E402

STAGES = [  # (label, file suffix, function name); cumulative time of each
    ("all of md.trace", "api.py", "_run"),
    ("  inside dispatch (per aten call)", "dispatch.py", "dispatch"),
    ("    meta kernels and rules (cache misses)", "router.py", "route"),
    ("    rebuilding outputs from the cache", "cache.py", "replay"),
    ("    cache keys", "cache.py", "key_from_encoded"),
    ("    recording the call", "record.py", "record"),
    ("    encoding inputs", "record.py", "encode_inputs"),
    ("    known values", "known.py", "propagate"),
    ("    converting inputs", "dispatch.py", "_convert"),
    ("    finding the device", "dispatch.py", "_device"),
    ("    wrapping outputs", "dispatch.py", "_wrap_outputs"),
    ("  autograd engine (backward, incl. its dispatches)", "~", "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
]


def main() -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    with md.MetaMode():
        model = LlamaForCausalLM(llama_config(8))
        ids = torch.randint(0, 32000, (1, 128))

    def step(ids):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()

    md.trace(step, ids)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        md.trace(step, ids)
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = None
    rows = []
    for label, file, name in STAGES:
        cum = sum(v[3] for (f, _, n), v in stats.items() if n == name and f.endswith(file))
        total = total or cum
        rows.append((label, f"{100 * cum / total:.0f}%"))
    print(table(rows, ("stage (LLaMA 8L/1024 fw+bw)", "share")))


if __name__ == "__main__":
    main()
