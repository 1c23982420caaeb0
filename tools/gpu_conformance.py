"""Real-GPU conformance: a logical-GPU trace against the same step on this host's GPU.

``model_conformance.py`` checks a logical CPU against the real CPU; its
``cuda`` column only says that a logical GPU traces.  This tool needs a real
CUDA device and checks, for each configuration of ``model_conformance.py``,
the trace of ``md.tracer(device="cuda", gpu=<this GPU's profile>)`` against
the same step run on the GPU:

* ``ops``: the recorded op names, in order, equal what the GPU dispatches,
  logged by a ``TorchDispatchMode`` (``md.testing.eager_calls``);
* ``meta``: every output's shape, dtype, significant strides, offset and
  device, and the parameters' gradients, equal the real run's;
* ``flops``: ``md.flops`` equals ``FlopCounterMode`` on the real GPU run;
* ``memory``: ``md.memory``'s peak against ``torch.cuda.max_memory_allocated``
  of a run that begins with cuBLAS's workspaces freed, as a process's first
  step does;
* ``replay``: ``md.replay(..., device="cuda")`` of the trace is ``ok``, and its
  output and gradients equal the eager GPU step's bit for bit where the
  kernels are deterministic.

and, for each case of the SDPA golden table (``tests/sdpa_golden.py``) whose
GPU has this GPU's compute capability, the backend the GPU runs against the
one the trace records and the one the table derives from torch's source.

"This GPU's profile" is the built-in profile of the same compute capability
and SM count, with the CUDA and cuDNN versions of the installed torch (what
SDPA's choice reads).  The results are printed as a table and written as
JSON (``--json``), with the first difference of every configuration that
differs; ``docs/model-conformance.md`` records a run.

    python tools/gpu_conformance.py [names] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import sys
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import model_conformance as mc  # noqa: E402

import metadispatch as md  # noqa: E402
from metadispatch.spec.profiles import gpu_profiles  # noqa: E402
from metadispatch.testing import eager_calls, this_gpu_profile, trace_calls  # noqa: E402

DEVICE = "cuda"  # a smoke test of the tool sets "cpu"


def _cuda(x):
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    if isinstance(x, torch.nn.Module):
        return copy.deepcopy(x).to(DEVICE)
    return x


def _fresh():
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


CALLS: dict = {}  # configuration -> both call lists, where they differ (--calls FILE)


def _show(call) -> str:
    return f"{call.op} {[(tuple(s), str(d)[6:], st, o, str(dev)) for s, d, st, o, dev in call.outputs]}"


def _first_difference(real, traced) -> str:
    for i, (a, b) in enumerate(zip(real, traced)):
        if a != b:
            return f"#{i}: real {_show(a)} | traced {_show(b)}"
    return f"real {len(real)} calls, traced {len(traced)}" if len(real) != len(traced) else ""


def _op_diff(real, traced) -> list:
    """Where the op names differ: (index, real ops from there, traced ops from there), up to 3 places."""
    import difflib

    a, b = [c.op for c in real], [c.op for c in traced]
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            out.append([tag, i1, a[i1 : min(i2, i1 + 6)], j1, b[j1 : min(j2, j1 + 6)]])
        if len(out) == 4:
            break
    return out


# Training steps with an optimizer, beside model_conformance's forward and
# backward: CUDA takes AdamW's foreach path and keeps its step counters on the
# CPU (capturable=False), which a logical GPU must record the same way.
OPTIMIZED = {
    "opt.llama_adamw": ("hf.llama", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "opt.resnet18_sgd": ("tv.resnet18", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "opt.gpt2_adam_fused": ("hf.gpt2", lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True)),
}


def _optimized(step, make):
    def with_optimizer(model, *inputs):
        opt = make(model.parameters())
        out = step(model, *inputs)
        opt.step()
        return out

    return with_optimizer


def check(name: str, gpu: md.GPUProfile) -> dict:
    base_name, make_opt = OPTIMIZED.get(name, (name, None))
    config = mc.CONFIGS[base_name]
    row: dict = {"config": name}
    if config.needs and importlib_missing(config.needs):
        return {**row, "skipped": f"{config.needs} not installed"}
    torch.manual_seed(0)
    try:
        model, inputs = config.build()
    except Exception as e:
        return {**row, "skipped": f"cannot build: {type(e).__name__}: {str(e)[:100]}"}
    step = mc._step(config, DEVICE)
    if make_opt is not None:
        step = _optimized(step, make_opt)
    started = time.perf_counter()
    try:
        trace = md.tracer(device=DEVICE, gpu=gpu if DEVICE == "cuda" else None)(step, _cuda(model), *map(_cuda, inputs))
        row["traces"] = "yes"
    except Exception as e:
        return {**row, "traces": "error", "notes": f"trace: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    row["trace_s"] = round(time.perf_counter() - started, 3)
    real_model = _cuda(model)
    torch.manual_seed(0)
    try:
        real = eager_calls(step, real_model, *map(_cuda, inputs))
    except Exception as e:
        return {**row, "skipped": f"the real run fails: {type(e).__name__}: {str(e)[:160]}"}
    traced = trace_calls(trace)
    row["ops"] = "yes" if [c.op for c in traced] == [c.op for c in real] else f"no ({len(traced)} vs {len(real)})"
    grads = {n: (tuple(g.shape), g.dtype, mc._significant(g.shape, g.stride)) for n, g in trace.grads.items()}
    real_grads = mc._grads_meta(real_model)
    row["meta"] = "yes" if traced == real and grads == real_grads else "no"
    if traced != real:
        row["first_difference"] = _first_difference(real, traced)
        row["op_diff"] = _op_diff(real, traced)
        CALLS[name] = {"real": [_show(c) for c in real], "traced": [_show(c) for c in traced]}
    if grads != real_grads:
        row["grads_differ"] = sorted(n for n in grads.keys() | real_grads.keys() if grads.get(n) != real_grads.get(n))[
            :5
        ]
    row["flops_real"] = _try(lambda: _real_flops(step, model, inputs))
    row["flops_traced"] = _try(lambda: md.flops(trace).total)
    row["flops"] = "yes" if row["flops_real"] == row["flops_traced"] else "no"
    row.update(_memory(step, model, inputs, trace))
    row.update(_replay(step, model, inputs, trace))
    return row


def _real_flops(step, model, inputs) -> int:
    with FlopCounterMode(display=False) as counter:
        step(_cuda(model), *map(_cuda, inputs))
    return counter.get_total_flops()


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def _try(fn):
    try:
        out = fn()
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return ("yes" if out else "no") if isinstance(out, bool) else out


def _memory(step, model, inputs, trace) -> dict:
    _fresh()
    base = torch.cuda.memory_allocated()
    m, xs = _cuda(model), [_cuda(x) for x in inputs]
    out = step(m, *xs)
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated() - base
    real_reserved = torch.cuda.max_memory_reserved()
    del m, xs, out
    got = {"memory_real": real, "reserved_real": real_reserved}
    got["memory_traced"] = _try(lambda: md.memory(trace).peak)
    got["memory_traced_no_ws"] = _try(lambda: md.memory(trace, workspaces=False).peak)
    got["reserved_traced"] = _try(lambda: md.memory(trace, allocator="cuda").reserved_peak)
    got["unsized"] = _try(lambda: dict(md.memory(trace).unsized))
    got["memory"] = "yes" if got["memory_traced"] == real else "no"
    return got


def _replay(step, model, inputs, trace) -> dict:
    try:
        r = md.replay(trace, (_cuda(model), *map(_cuda, inputs)), device=DEVICE)
    except Exception as e:
        return {"replay": "error", "replay_note": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    got = {"replay": "yes" if r.ok else "no"}
    if not r.ok:
        got["replay_note"] = f"{len(r.mismatches)} mismatched, {len(r.made_up)} made up: " + "; ".join(
            str(x)[:200] for x in list(r.mismatches)[:2]
        )
    eager_model = _cuda(model)
    with torch.random.fork_rng(devices=[0] if DEVICE == "cuda" else []):
        torch.set_rng_state(trace.rng_state)
        out = step(eager_model, *map(_cuda, inputs))
    eager_grads = {n: p.grad for n, p in eager_model.named_parameters() if p.grad is not None}
    differ = [n for n, g in eager_grads.items() if n not in r.grads or not mc._bitwise(r.grads[n], g)]
    if not mc._bitwise(r.output, out):
        differ.insert(0, "output")
    got["replay_equals_eager"] = "yes" if not differ else f"no: {len(differ)} of {len(eager_grads) + 1} ({differ[:3]})"
    return got


# -- SDPA -------------------------------------------------------------------

_OPS = {
    "aten._scaled_dot_product_flash_attention.default": "flash",
    "aten._scaled_dot_product_efficient_attention.default": "efficient",
    "aten._scaled_dot_product_cudnn_attention.default": "cudnn",
}


def sdpa_cases(gpu: md.GPUProfile) -> list[dict]:
    from sdpa_golden import CASES

    same = {n for n, p in gpu_profiles().items() if tuple(p.compute_capability) == tuple(gpu.compute_capability)}
    out = []
    for c in CASES:
        if c["gpu"] not in same:
            continue
        real = _try(lambda c=c: _sdpa_backend(c, None))
        traced = _try(lambda c=c: _sdpa_backend(c, gpu))
        out.append(
            {
                "case": f"{c['group']}-{c['gpu']}-{str(c['dtype'])[6:]}-{'x'.join(map(str, c['q']))}",
                "expected": c["expected"],
                "real": real,
                "traced": traced,
            }
        )
    return out


def _sdpa_backend(c: dict, gpu) -> str:
    """The backend of the case's SDPA: run on the GPU (``gpu`` None) or traced under ``gpu``."""
    from test_sdpa_choice import _BACKENDS, _deterministic, attention
    from torch.nn.attention import sdpa_kernel

    flags = [_BACKENDS[b] for b in c["flags"]] if c["flags"] else list(_BACKENDS.values())
    mode = md.MetaMode(device=DEVICE, gpu=gpu) if gpu is not None else _EagerOps()
    with mode, sdpa_kernel(flags, set_priority=c["priority"]), _deterministic(c["deterministic"]):
        with torch.device(DEVICE):
            attention(c)
    ops = {call.op for call in mode.trace.calls} if gpu is not None else mode.ops
    fused = sorted(_OPS[o] for o in ops if o in _OPS)
    return "+".join(fused) if fused else "math"


class _EagerOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


# -- the README's step at full size -----------------------------------------


def headline(gpu: md.GPUProfile) -> list[dict]:
    """The built-in LLaMA-7B step (bf16, and autocast bf16 over float32
    weights) and a transformers LLaMA-7B bf16 step, 2,048 tokens: the peak
    ``md.memory`` predicts against the real step's on this GPU, and the op
    sequences."""
    from metadispatch.cli import targets

    makers = {
        "built-in llama-7b bf16": lambda lazy: targets.default_target(lazy=lazy),
        "built-in llama-7b amp bf16": lambda lazy: targets.default_target(lazy=lazy, amp=("cuda", torch.bfloat16)),
        "transformers llama-7b bf16": lambda lazy: targets.hf_target(
            "llama", {}, seq=2048, dtype=torch.bfloat16, lazy=lazy
        ),
    }
    rows = []
    for name, make in makers.items():
        row: dict = {"step": name}
        try:
            target = make(False)
            started = time.perf_counter()
            trace = md.tracer(device="cuda", gpu=gpu)(target.step, target.model, *target.inputs)
            row["trace_s"] = round(time.perf_counter() - started, 2)
            row["predicted_peak"] = md.memory(trace).peak
            row["predicted_reserved"] = md.memory(trace, allocator="cuda").reserved_peak
            traced = trace_calls(trace)
            del target, trace
            target = make(True)
            _fresh()
            base = torch.cuda.memory_allocated()
            torch.manual_seed(0)
            with torch.device(DEVICE):
                model, inputs = target.build()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            real = eager_calls(target.step, model, *inputs)
            torch.cuda.synchronize()
            row["real_peak"] = torch.cuda.max_memory_allocated() - base
            row["real_reserved"] = torch.cuda.max_memory_reserved()
            same = [c.op for c in real] == [c.op for c in traced]
            row["ops"] = "yes" if same else f"no ({len(traced)} vs {len(real)})"
            row["meta"] = "yes" if real == traced else "no"
            if real != traced:
                row["first_difference"] = _first_difference(real, traced)
                row["op_diff"] = _op_diff(real, traced)
                CALLS[name] = {"real": [_show(c) for c in real], "traced": [_show(c) for c in traced]}
            del model, inputs
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    _fresh()
    return rows


COLUMNS = ("config", "traces", "ops", "meta", "flops", "memory", "replay")


def table(rows: list[dict]) -> str:
    """The rows as docs/model-conformance.md's real-GPU table: ``memory`` is
    the traced peak over the real one; ``replay`` is ``ok`` or not."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "skipped" in r or "crashed" in r:
            lines.append(f"| {r['config']} | {r.get('skipped') or 'crashed: ' + r['crashed']} |" + " |" * 5)
            continue
        cells = [str(r.get(c, "-")) for c in COLUMNS]
        real, traced = r.get("memory_real"), r.get("memory_traced")
        if isinstance(real, int) and isinstance(traced, int) and real:
            cells[5] = "yes" if real == traced else f"{traced / real:.3f}x"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="the configurations whose names contain one of these")
    parser.add_argument("--json", metavar="FILE", help="write every result, with first differences, here")
    parser.add_argument("--no-sdpa", action="store_true", help="leave out the SDPA golden cases")
    parser.add_argument("--headline", action="store_true", help="also the 7B steps (needs about 60 GiB)")
    parser.add_argument("--calls", metavar="FILE", help="write both call lists of each step that differs here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    gpu = this_gpu_profile()
    head = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "profile": {f.name: getattr(gpu, f.name) for f in dataclasses.fields(gpu)} | {"flops": dict(gpu.flops)},
        "cudnn": torch.backends.cudnn.version(),
    }
    print(json.dumps(head, default=str), flush=True)
    big = headline(gpu) if args.headline else []
    rows = []
    for n in [n for n in [*mc.CONFIGS, *OPTIMIZED] if not args.names or any(a in n for a in args.names)]:
        try:
            rows.append(check(n, gpu))
        except Exception as e:  # one configuration's crash is a result, not the end of the run
            where = traceback.format_exc().splitlines()[-6:]
            rows.append({"config": n, "crashed": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", "at": where})
        print(json.dumps(rows[-1], default=str), flush=True)
    print(table(rows), flush=True)
    sdpa = [] if args.no_sdpa else sdpa_cases(gpu)
    agree = sum(s["real"] == s["traced"] for s in sdpa)
    print(f"SDPA: {agree} of {len(sdpa)} cases record the backend the GPU runs", flush=True)
    for s in sdpa:
        if s["real"] != s["traced"] or s["real"] != s["expected"]:
            print("  ", json.dumps(s), flush=True)
    if args.calls:
        with open(args.calls, "w", encoding="utf-8") as f:
            json.dump(CALLS, f, indent=0)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**head, "rows": rows, "sdpa": sdpa, "headline": big}, f, default=str, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
