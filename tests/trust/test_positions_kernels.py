"""The ops classed ``kernel`` do check their index-like arguments: extreme values get torch's error.

Ir/positions.py trusts these kernels to check the arguments it names.  The
proof, per torch version: every such op called with its index-like values
set to the most extreme of their dtype (tests/kernel_proofs.py), in a child
process under the guard-page allocator (tests/guarded.py), so that a kernel
that follows a value instead of refusing it is caught even when it does not
crash.  Samples come from op_db, mechanically -- the calls its OpInfos make
to these ops, forward and backward, seen by a dispatch logger -- and, for
ops op_db does not reach, from tests/kernel_samples.py.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from metadispatch.trust.positions import KERNEL, KERNEL_OPS, position
from tests import guarded, kernel_proofs
from tests.kernel_samples import HAND

_LIMIT = 4 << 30
_STEMS = (
    "gather scatter index take put embedding unpool fractional nll cross_entropy margin searchsorted one_hot "
    "bincount repeat_interleave masked tensor_split narrow lu ldl lstm gru rnn"
).split()


class _Log(TorchDispatchMode):
    """Keeps up to three calls of each ``kernel``-classed op, with copies of their arguments."""

    def __init__(self, seen: dict) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        p = position(func)
        calls = self.seen.setdefault(str(func), [])
        if p is not None and p.kind == KERNEL and len(calls) < 3:
            leaves = pytree.tree_leaves((args, kwargs))
            if all(not isinstance(t, torch.Tensor) or (t.layout == torch.strided and t.numel() < 4096) for t in leaves):
                copy = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
                calls.append(pytree.tree_map(copy, (args, kwargs)))
        return out


def _opdb_samples() -> dict:
    from torch.testing._internal.common_methods_invocations import op_db  # noqa: PLC0415 -- heavy, test-only

    seen: dict = {}
    warnings.simplefilter("ignore")
    for info in op_db:
        if not any(stem in info.name for stem in _STEMS):
            continue
        for dtype in (torch.float32, torch.int64):
            if dtype not in info.supported_dtypes("cpu"):
                continue
            grad = dtype == torch.float32 and info.supports_autograd
            try:
                samples = list(info.sample_inputs("cpu", dtype, requires_grad=grad))[:3]
            except Exception:  # noqa: BLE001 -- an OpInfo that cannot make samples here gives none
                continue
            for s in samples:
                try:
                    with _Log(seen):
                        out = info.op(s.input, *s.args, **s.kwargs)
                        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                        if outs:
                            sum(o.float().sum() for o in outs).backward()
                except Exception:  # noqa: BLE001 -- a sample the kernel refuses is no sample
                    continue
    return {k: v for k, v in seen.items() if v}


@pytest.fixture(scope="module")
def proofs(tmp_path_factory):
    library = guarded.require()
    samples = [(name, a, kw) for name, calls in _opdb_samples().items() for a, kw in calls]
    names = {s[0] for s in samples}
    for op, build in HAND:
        args, kwargs = build()
        samples.append((str(op), args, kwargs))
    # an in-place packet op_db misses takes its functional packet's samples
    for name, args, kwargs in list(samples):
        ns, op, overload = name.split(".")
        inplace = getattr(getattr(torch.ops, ns), op + "_", None)
        if inplace is not None and overload in inplace.overloads() and f"{ns}.{op}_.{overload}" not in names:
            samples.append((f"{ns}.{op}_.{overload}", args, kwargs))
    path = tmp_path_factory.mktemp("proofs") / "samples.pkl"
    with open(path, "wb") as f:
        pickle.dump(samples, f)
    env = guarded.environment(library, dict(os.environ, PYTHONPATH=os.getcwd()))
    return samples, _run(path, env)


def _run(path, env) -> dict:
    """Every mutation's result; a child that dies names the call in flight and the next starts after it."""
    results, skip = {}, 0
    while True:
        child = subprocess.run(
            [sys.executable, kernel_proofs.__file__, str(_LIMIT), str(path), str(skip)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        current = None
        for line in child.stdout.splitlines():
            record = json.loads(line)
            if "start" in record:
                current, skip = record["start"], record["n"]
            elif "key" in record:
                results[record["key"]], current = record["result"], None
        if current is None:
            return results
        results[current] = f"crashed ({child.returncode}): {child.stderr.strip()[-300:]}"


@pytest.mark.slow  # op_db's samples and a child under the guard allocator
def test_positions_kernels_every_kernel_op_has_a_sample(proofs):
    samples, _ = proofs
    sampled = {name.rsplit(".", 1)[0].replace(".", "::", 1) for name, _, _ in samples}
    assert sorted(set(KERNEL_OPS) - sampled) == []


@pytest.mark.slow  # op_db's samples and a child under the guard allocator
def test_positions_kernels_extreme_indices_never_crash_or_touch_memory_outside(proofs):
    _, results = proofs
    assert results and {k: r for k, r in results.items() if r.startswith("crashed")} == {}


@pytest.mark.slow  # op_db's samples and a child under the guard allocator
def test_positions_kernels_extreme_indices_get_torchs_error(proofs):
    """Out-of-range integers are refused by the kernel; ops that wrap or clamp them into range
    (their class says so) and boolean masks may run -- the guard saw them stay inside."""
    _, results = proofs
    lenient = {f"aten.{n.split('::')[1]}" for n, p in KERNEL_OPS.items() if "clamp" in p.why or "wrap" in p.why}
    wrong = {
        k: r
        for k, r in results.items()
        if r == "ran" and ":all=True" not in k and k.split("|")[0].rsplit(".", 1)[0] not in lenient
    }
    assert wrong == {}
