"""Find the CPU kernels that follow their arguments' values or shapes outside their memory.

For a torch upgrade, or a class in metadispatch/trust/positions.py in doubt:
this runs op_db's samples (forward and backward, float32 and int64) under a
dispatch logger, keeps the aten calls they make, and calls each again with
one argument changed, in child processes under the guard-page allocator of
the tests (tests/pageguard.c, tests/guarded.py):

* ``--values``: every integer in an index-like place -- each integer tensor
  set to the extremes of its dtype, 1000, -1000 (all elements, then only the
  last), each integer argument to +-2**40 and +-1000;
* ``--shapes``: each tensor argument shrunk to one element per dimension,
  or to one along its first or last dimension.

A call that kills its child (SIGSEGV: the guard page; SIGABRT: a write
into the slack, or the heap) is printed with its op's class.  An op whose
kernel was caught this way must be classed ``checked`` (with a check in
trust/index_checks.py or shape_checks.py) or ``refused``::

    python tools/position_probe.py --values --shapes            # every op op_db reaches (~20 min)
    python tools/position_probe.py --values max_pool2d embedding   # ops whose name holds these

Needs Linux and a C compiler for the allocator.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import warnings

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metadispatch.ir.decode import resolve_op  # noqa: E402
from metadispatch.trust.positions import position  # noqa: E402
from tests import guarded  # noqa: E402

_PER_OP = 6  # calls kept per op


class _Log(TorchDispatchMode):
    def __init__(self, calls: dict, names) -> None:
        super().__init__()
        self.calls, self.names = calls, names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        kept = self.calls.setdefault(name, [])
        if len(kept) < _PER_OP and (not self.names or any(n in name for n in self.names)):
            leaves = pytree.tree_leaves((args, kwargs))
            if all(not isinstance(t, torch.Tensor) or (t.layout == torch.strided and t.numel() < 5000) for t in leaves):
                kept.append(
                    pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
                )
        return out


def capture(names) -> dict:
    """Op name -> [(args, kwargs)] of the calls op_db's samples make."""
    from torch.testing._internal.common_methods_invocations import op_db

    warnings.simplefilter("ignore")
    calls: dict = {}
    for info in op_db:
        for dtype in (torch.float32, torch.int64):
            if dtype not in info.supported_dtypes("cpu"):
                continue
            grad = dtype == torch.float32 and info.supports_autograd
            try:
                samples = list(info.sample_inputs("cpu", dtype, requires_grad=grad))[:4]
            except Exception:  # noqa: BLE001 -- an OpInfo that makes no samples here
                continue
            for s in samples:
                try:
                    with _Log(calls, names):
                        out = info.op(s.input, *s.args, **s.kwargs)
                        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                        if outs:
                            sum(o.float().sum() for o in outs).backward()
                except Exception:  # noqa: BLE001 -- a sample the kernel refuses
                    continue
    return {k: v for k, v in calls.items() if v}


def _changes(args, kwargs, values: bool, shapes: bool):
    flat, spec = pytree.tree_flatten((args, kwargs))
    for i, x in enumerate(flat):
        variants = []
        if values and isinstance(x, torch.Tensor) and x.numel() and not (x.is_floating_point() or x.is_complex()):
            if x.dtype == torch.bool:
                continue
            info = torch.iinfo(x.dtype)
            for v in (info.max, info.min, 1000, -1000):
                if info.min <= v <= info.max:
                    variants += [(f"all={v}", x.clone().fill_(v)), (f"last={v}", _last(x, v))]
        elif values and type(x) is int:
            variants = [(f"int={v}", v) for v in (1 << 40, -(1 << 40), 1000, -1000)]
        if shapes and isinstance(x, torch.Tensor) and x.numel() > 1 and x.dim():
            variants.append(("shape=ones", x.reshape(-1)[:1].clone().reshape([1] * x.dim())))
            if x.shape[0] > 1:
                variants.append(("shape=first", x[:1].clone()))
            if x.shape[-1] > 1:
                variants.append(("shape=last", x[..., :1].clone()))
        for what, v in variants:
            changed = list(flat)
            changed[i] = v
            yield f"arg{i}:{what}", pytree.tree_unflatten(changed, spec)


def _last(x, v):
    y = x.clone()
    y.view(-1)[-1] = v
    return y


def child(path: str, skip: int, values: bool, shapes: bool, done_ops: set) -> None:
    """Run every change of every call (after the first ``skip``, and of no op in ``done_ops``),
    one JSON line before and after each."""
    with open(path, "rb") as f:
        calls = pickle.load(f)
    n = 0
    for name, samples in calls.items():
        func = resolve_op(name)
        for k, (args, kwargs) in enumerate(samples):
            for what, (a, kw) in _changes(args, kwargs, values, shapes):
                n += 1
                if n <= skip or name in done_ops:
                    continue
                print(json.dumps({"start": f"{name}|{k}|{what}", "n": n}), flush=True)
                try:
                    func(*a, **kw)
                except Exception:  # noqa: BLE001 -- refusing is what a kernel should do
                    pass
                print(json.dumps({"done": n}), flush=True)


def probe(calls: dict, values: bool, shapes: bool) -> list:
    """``(op, change, signal)`` for each change that killed its child."""
    library, why = guarded.preload()
    if library is None:
        raise SystemExit(why)
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump(calls, f)
    env = guarded.environment(library, dict(os.environ, PYTHONPATH=os.getcwd()))
    crashes, skip = [], 0
    while True:  # an op that killed a child once is not run again: one crash says it
        done = ",".join(op for op, _, _ in crashes)
        run = subprocess.run(
            [sys.executable, __file__, "--child", f.name, str(skip), str(int(values)), str(int(shapes)), done],
            capture_output=True,
            text=True,
            env=env,
        )
        current = None
        for line in run.stdout.splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if "start" in record:
                current, skip = record["start"], record["n"]
            elif "done" in record:
                current = None
        if current is None:
            os.unlink(f.name)
            return crashes
        crashes.append((*current.split("|", 2)[::2], run.returncode))


def main(argv: list) -> int:
    if argv[:1] == ["--child"]:
        child(argv[1], int(argv[2]), argv[3] == "1", argv[4] == "1", set(filter(None, argv[5].split(","))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", action="store_true", help="change the integers in index-like places")
    parser.add_argument("--shapes", action="store_true", help="shrink the tensor arguments")
    parser.add_argument("names", nargs="*", help="only ops whose name holds one of these")
    args = parser.parse_args(argv)
    if not (args.values or args.shapes):
        parser.error("say --values, --shapes or both")
    calls = capture(args.names)
    print(f"{len(calls)} ops, {sum(map(len, calls.values()))} calls", file=sys.stderr)
    for op, change, code in probe(calls, args.values, args.shapes):
        p = position(resolve_op(op))
        print(f"{op}\t{change}\tsignal {-code}\tclass {p.kind if p else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
