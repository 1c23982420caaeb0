"""Per-trace fixed work: what ``md.trace`` spends around the step, against the step itself.

    python benchmarks/bench_fixed.py

Counted, not timed (``sys.settrace`` opcode events, repeatable on a loaded
machine): each Python opcode of a warm ``md.trace`` is charged to the
innermost stage of :data:`STAGES` on its stack -- the dispatch and
torch-function modes (per call), the step's own Python, and the fixed
work: the walk of what the step reaches, the module and optimizer
snapshots, the swap to stand-ins, the restore, mode entry and exit.
Then the scaling check, timed in one process: a tiny model's ``md.trace``
with and without 10,000 unrelated tensors and an unrelated 24-layer
module alive in the process (the fixed work should not grow with them).
"""

from __future__ import annotations

import gc
import sys
import time

import torch
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import metadispatch as md  # noqa: E402
from benchmarks.common import llama_config, table  # noqa: E402
from metadispatch.mode import mode as _mode  # noqa: E402
from metadispatch.mode import swap as _swap  # noqa: E402
from metadispatch.standins import snapshot, standins  # noqa: E402
from metadispatch.tracing import reach  # noqa: E402

# (label, code objects): an opcode is charged to the innermost one on its stack.
STAGES = [
    ("per call: dispatch", [_mode.MetaMode.__torch_dispatch__]),
    ("per call: torch-function swap", [_swap.SwapReal.__torch_function__]),
    ("fixed: reach walk", [reach.find]),
    ("fixed: snapshot", [snapshot.ModuleState.__init__, snapshot.Contents.__init__]),
    ("fixed: swap to stand-ins", [standins.StandIns._swap, standins.StandIns.save]),
    ("fixed: restore", [standins.StandIns._restore]),
    ("fixed: mode entry", [_mode.MetaMode.__enter__]),
    ("fixed: mode exit", [_mode.MetaMode.__exit__]),
    ("fixed: stand-ins entry/exit", [standins.StandIns.__enter__, standins.StandIns.__exit__]),
]
FIXED_PREFIX = "fixed"


def _code(fn):
    return getattr(fn, "__func__", fn).__code__


class OpcodeCounter:
    """``with OpcodeCounter(step_code) as c: ...``: opcodes by stage in ``c.counts``."""

    def __init__(self, step_code=None) -> None:
        self.labels = {_code(fn): label for label, fns in STAGES for fn in fns}
        if step_code is not None:
            self.labels.setdefault(step_code, "the step's own Python (model, autograd glue)")
        self.counts: dict = {}
        self._stack: list = ["fixed: md.trace's own lines"]

    def _local(self, frame, event, arg):
        if event == "opcode":
            label = self._stack[-1]
            self.counts[label] = self.counts.get(label, 0) + 1
        elif event == "return":
            self._stack.pop()
        return self._local

    def _global(self, frame, event, arg):
        if event != "call":
            return None
        frame.f_trace_opcodes = True
        self._stack.append(self.labels.get(frame.f_code, self._stack[-1]))
        return self._local

    def __enter__(self):
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)


def count(step, *args) -> tuple[dict, int]:
    """Opcodes by stage of one warm ``md.trace(step, *args)``, and its recorded calls."""
    calls = len(md.trace(step, *args))  # warm: the cache, torch's lazy imports
    with OpcodeCounter(_code(step)) as c:
        md.trace(step, *args)
    return c.counts, calls


def llama2():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(layers=2, hidden=256, heads=4, vocab=1000))
    return model, torch.randint(0, 1000, (1, 128))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=1000, n_positions=128))
    return model, torch.randint(0, 1000, (1, 128))


def lm_step(model):
    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def fixed_rows() -> list:
    rows = []
    for name, make in (("LLaMA 2L/256 fw+bw", llama2), ("GPT-2 2L/256 fw+bw", gpt2)):
        model, ids = make()
        counts, calls = count(lm_step(model), ids)
        total = sum(counts.values())
        fixed = sum(v for k, v in counts.items() if k.startswith(FIXED_PREFIX))
        rows.append((name, calls, f"{total / calls:,.0f}", f"{fixed / calls:,.0f}", f"{fixed:,}", ""))
        for label, v in sorted(counts.items(), key=lambda kv: -kv[1]):
            rows.append(("", "", "", "", f"{v:,}", label))
    return rows


def tiny():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return step, torch.randn(4, 16)


_CLUTTER: list = []  # what the process holds that the step does not touch


def _clutter() -> None:
    _CLUTTER.append([torch.randn(4) for _ in range(10_000)])
    _CLUTTER.append(nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 128) for _ in range(24)]))
    _CLUTTER.append([{"k": [i]} for i in range(200_000)])  # plain Python objects the collector walks


def scaling_rows(repeat: int = 50) -> list:
    step, x = tiny()
    md.trace(step, x)

    def measure():
        counts = count(step, x)[0]
        gc.collect()
        times = []
        for _ in range(repeat):
            t0 = time.process_time()
            md.trace(step, x)
            times.append(time.process_time() - t0)
        times.sort()
        return sum(counts.values()), times[len(times) // 2]

    before = measure()
    _clutter()
    gc.collect()
    after = measure()
    _CLUTTER.clear()
    return [
        ("tiny MLP + SGD, alone", f"{before[0]:,}", f"{before[1] * 1e3:.2f} ms"),
        ("with 10,000 tensors, a 24-layer module, 200,000 dicts alive", f"{after[0]:,}", f"{after[1] * 1e3:.2f} ms"),
        ("ratio", f"{after[0] / before[0]:.3f}x", f"{after[1] / before[1]:.2f}x"),
    ]


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print("opcodes of one warm md.trace, by stage (sys.settrace; per call = over recorded calls)")
    print(table(fixed_rows(), ("model", "calls", "per call", "fixed per call", "opcodes", "stage")))
    print()
    print("md.trace of a tiny step with the process's other objects (median CPU time, one process)")
    print(table(scaling_rows(), ("process holds", "opcodes", "md.trace")))


if __name__ == "__main__":
    main()
