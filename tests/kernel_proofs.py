"""Feed the index-like arguments of ``kernel``-classed ops extreme values, in a child under the guard allocator.

``python tests/kernel_proofs.py LIMIT SAMPLES`` limits the address space to
LIMIT bytes, reads the pickled list of ``(op name, args, kwargs)`` in
SAMPLES, and for each sample and each index-like argument the op's class
names (trust/positions.py) sets that argument's values to the most extreme of
its dtype (all of them, then only the last; a boolean mask all true) and
calls the op.  It prints ``{"start": key}`` before and ``{"key": ...,
"result": "error:IndexError" | "ran"}`` after each call.  A kernel that
follows such a value reads or writes far outside the tensor and the guard
allocator (tests/guarded.py) kills the process: the parent names the call in
flight and starts another child after it.
"""

from __future__ import annotations

import json
import pickle
import resource
import sys

import torch
from torch.utils import _pytree as pytree

from metadispatch.ir.decode import resolve_op
from metadispatch.trust.positions import position


def mutations(func, args, kwargs, names):
    """``(key, args, kwargs)`` with one index-like argument set to an extreme value."""
    params = [a.name for a in func._schema.arguments]
    labelled = [(params[k], v) for k, v in enumerate(args)] + list(kwargs.items())
    for name, value in labelled:
        if name not in names:
            continue
        flat, spec = pytree.tree_flatten(value)
        for j, t in enumerate(flat):
            if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.dtype.is_floating_point or t.dtype.is_complex:
                continue
            if t.dtype == torch.bool:
                fills = [("all", True)]
            else:
                info = torch.iinfo(t.dtype)
                big = min(1 << 40, info.max)
                fills = [("all", big), ("last", big)] + ([("all", -big), ("last", -big)] if info.min < 0 else [])
            for how, v in fills:
                y = t.clone()
                if how == "all":
                    y.fill_(v)
                else:
                    y.view(-1)[-1] = v
                changed = list(flat)
                changed[j] = y
                new = dict(labelled)
                new[name] = pytree.tree_unflatten(changed, spec)
                pos = [new[p] for p in params[: len(args)]]
                kw = {k: new[k] for k in kwargs}
                yield f"{name}[{j}]:{how}={v}", pos, kw


def main(limit: int, samples_path: str, skip: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with open(samples_path, "rb") as f:
        samples = pickle.load(f)
    n = 0
    for i, (name, args, kwargs) in enumerate(samples):
        func = resolve_op(name)
        for what, a, kw in mutations(func, args, kwargs, set(position(func).args)):
            n += 1
            if n <= skip:
                continue
            key = f"{name}|{i}|{what}"
            print(json.dumps({"start": key, "n": n}), flush=True)
            try:
                with torch.no_grad():
                    func(*a, **kw)
                result = "ran"
            except Exception as e:  # noqa: BLE001 -- torch's error is the expected outcome
                result = f"error:{type(e).__name__}"
            print(json.dumps({"key": key, "result": result}), flush=True)
    print(json.dumps({"done": n}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
