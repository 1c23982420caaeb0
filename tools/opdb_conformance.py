"""op_db conformance: metadispatch's metadata against the real CPU kernel.

For every OpInfo in ``torch.testing._internal.common_methods_invocations.op_db``,
every dtype it supports on CPU and every sample input, the op runs on real
CPU tensors and on stand-ins, and each output must match the real one in
shape, dtype, device, storage offset and significant strides
(``torch._prims_common.check_significant_strides``).  A stand-in run that
raises a data-dependent error passes (the op needs values); a sample the
real kernel rejects is not counted.

Three stand-ins, measured on the same samples:

* ``ours``: MetaTensors under a ``MetaMode`` (logical device cpu);
* ``fake``: torch's ``FakeTensorMode``;
* ``meta``: plain tensors on the ``meta`` device (device not compared).

``--no-mode`` adds each subclass used outside any mode (issue 15: a
MetaTensor must answer the same with or without one):

* ``ours-no-mode``: ``md.to_meta`` tensors, no mode entered; every tensor
  output must also be a MetaTensor (no plain ``meta`` tensor reaches the
  user, and no real one);
* ``fake-no-mode`` (with ``--anchors``): FakeTensors made by a
  ``FakeTensorMode`` that is not entered when the op runs.

The full run (all ops, all dtypes; about an hour on 2 cores, use ``-j``)::

    python tools/opdb_conformance.py --anchors -j 16

prints the pass rate of each and the failing ops.  ``tests/test_opdb.py``
runs a quick subset with the same code.

``--cache-diff`` checks instead that the metadata cache never changes an
answer: every sample is traced with ``md.trace`` under ten configurations
(logical cpu; cuda with the h100, a100 and l4 profiles; another float dtype;
``no_grad``; ``inference_mode``; autocast on cpu and on cuda; oneDNN off), each three
ways -- cache off; cache on in a fresh cache; cache on, interleaved with all
the others and a non-recording run in a shuffled (seeded) order -- and each
configuration's traces must be identical (``str(trace)`` and every
``TensorMeta``) or raise the same error::

    python tools/opdb_conformance.py --cache-diff -j 2

and ``--cache-diff --models`` the same for a training step of each model in
``tests/models.py``.  ``tests/core/test_cache_differential.py`` runs both on a
sample.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import sys
import warnings
from collections import Counter, defaultdict

import torch
from torch._prims_common import check_significant_strides
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metadispatch as md  # noqa: E402

PASS, DATA, FAIL, SKIP = "pass", "data-dependent", "fail", "skip"


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def op_id(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def samples(opinfo, dtypes=None):
    """(dtype, SampleInput) for the op's CPU dtypes (or ``dtypes`` among them)."""
    supported = sorted(opinfo.supported_dtypes("cpu"), key=str)
    for dtype in supported:
        if dtypes is not None and dtype not in dtypes:
            continue
        try:
            for s in opinfo.sample_inputs("cpu", dtype, requires_grad=False):
                yield dtype, s
        except Exception:  # a sample generator that fails on this build
            continue


def _call(opinfo, s, convert):
    inp, args, kwargs = pytree.tree_map(
        lambda x: convert(x) if isinstance(x, torch.Tensor) else x, (s.input, s.args, s.kwargs)
    )
    return opinfo.op(inp, *args, **kwargs)


def _is_data_dependent(e: Exception) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if isinstance(e, (md.DataDependentError, DataDependentOutputException, DynamicOutputShapeException)):
        return True
    text = str(e)
    return "cannot be called on meta tensors" in text or "data-dependent" in text or "unbacked" in text.lower()


def compare(real, ours, check_device=True) -> str | None:
    """None when every tensor of ``ours`` matches ``real``, else the first problem."""
    r_leaves = [x for x in pytree.tree_leaves(real) if isinstance(x, torch.Tensor)]
    o_leaves = [x for x in pytree.tree_leaves(ours) if isinstance(x, torch.Tensor)]
    if len(r_leaves) != len(o_leaves):
        return f"{len(o_leaves)} tensor outputs != {len(r_leaves)}"
    for i, (r, o) in enumerate(zip(r_leaves, o_leaves)):
        if r.shape != o.shape:
            return f"out{i} shape {tuple(o.shape)} != {tuple(r.shape)}"
        if r.dtype != o.dtype:
            return f"out{i} dtype {o.dtype} != {r.dtype}"
        if check_device and r.device != o.device:
            return f"out{i} device {o.device} != {r.device}"
        if r.numel() > 0 and r.storage_offset() != o.storage_offset():
            return f"out{i} storage offset {o.storage_offset()} != {r.storage_offset()}"
        ok, _ = check_significant_strides(r, o, only_cuda=False)
        if not ok:
            return f"out{i} strides {o.stride()} != {r.stride()}"
    return None


def _has_tensor_input(s) -> bool:
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((s.input, s.args, s.kwargs)))


def _wrong_type(got, cls) -> str | None:
    for i, x in enumerate(x for x in pytree.tree_leaves(got) if isinstance(x, torch.Tensor)):
        if cls is not None and not isinstance(x, cls):
            return f"out{i} is a {type(x).__name__} on {x.device}, not a {cls.__name__}"
    return None


def _ours(opinfo, s):
    with md.MetaMode(record=False) as mode:
        return _call(opinfo, s, mode.from_tensor)


def _fake(opinfo, s):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return _call(opinfo, s, mode.from_tensor)


def _meta(opinfo, s):
    return _call(opinfo, s, lambda t: t.to("meta"))


def _ours_no_mode(opinfo, s):
    return _call(opinfo, s, md.to_meta)


def _fake_no_mode(opinfo, s):
    from torch._subclasses.fake_tensor import FakeTensorMode

    return _call(opinfo, s, FakeTensorMode(allow_non_fake_inputs=True).from_tensor)


STANDINS = {
    "ours": _ours,
    "ours-no-mode": _ours_no_mode,
    "fake": _fake,
    "fake-no-mode": _fake_no_mode,
    "meta": _meta,
}
# The subclass every tensor output of a stand-in must be, where it must.
_OUTPUT_TYPE = {"ours-no-mode": md.MetaTensor}


def _outcome(run, cache: bool):
    """What a caller can see of ``run(cache)``: the whole trace, or the error."""
    try:
        t = run(cache)
    except Exception as e:
        return ("raised", type(e).__name__, (str(e).splitlines() or [""])[0])
    calls = [(c.op, c.args, c.kwargs, c.outputs, c.rule, c.note, c.phase) for c in t]
    leaves = sorted((i, leaf.meta, leaf.kind, leaf.name) for i, leaf in t.leaves.items())
    return ("trace", str(t), repr(calls), repr(leaves), repr(t.output_meta), repr(t.grads))


def _differs(name, got, want) -> str | None:
    if got == want:
        return None
    where = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), 0)
    return f"{name}: {str(got[where])[:300]} != cache off: {str(want[where])[:300]}"


def cache_differential(configs, fillers=(), seed: int = 0, rounds: int = 2) -> str | None:
    """None when every configuration's trace is the same three ways, else what differed.

    ``configs``: name -> ``run(cache)``, the same call traced under one
    configuration (device, profile, dtype, grad mode, autocast).  Each is
    traced with the cache off; with the cache on, in a fresh cache; and with
    the cache on, ``rounds`` times each, every configuration and every
    ``filler`` (a call that only fills the cache, errors ignored) in one
    shuffled (seeded) order, so each is served what the others left.
    """
    off = {name: _outcome(run, False) for name, run in configs.items()}
    for name, run in configs.items():
        md.core.cache.clear()
        problem = _differs(f"{name}, fresh cache", _outcome(run, True), off[name])
        if problem:
            return problem
    md.core.cache.clear()
    jobs: list = [name for name in configs for _ in range(rounds)] + list(fillers)
    random.Random(seed).shuffle(jobs)
    for job in jobs:
        if callable(job):
            try:
                job()
            except Exception:
                pass
            continue
        problem = _differs(f"{job}, interleaved", _outcome(configs[job], True), off[job])
        if problem:
            return problem
    return None


_OTHER_FLOAT = {
    torch.float32: torch.float64,
    torch.float64: torch.float32,
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
}


def _cast(x):
    return x.to(_OTHER_FLOAT[x.dtype]) if isinstance(x, torch.Tensor) and x.dtype in _OTHER_FLOAT else x


def cache_configs(fn, args, wide=None):
    """``(configs, fillers)`` for :func:`cache_differential`: ``fn(*args)``
    traced on logical cpu; on cuda with three GPU profiles (h100, the
    default; a100 on ``cuda:1``; l4); with the float arguments in another
    dtype (or ``wide``, a ``(fn, args)`` to trace instead); under
    ``no_grad``, ``inference_mode``, autocast on cpu and on cuda, and with
    oneDNN off (convolution's backend choice).  The filler runs the call in a non-recording mode (the cache's other key path).
    """

    def traced(device=None, gpu=None, around=contextlib.nullcontext, fn=fn, args=args):
        def run(cache):
            with around():
                return md.tracer(mode_factory=lambda: md.MetaMode(device=device, gpu=gpu, cache=cache))(fn, *args)

        return run

    def unrecorded():
        with md.MetaMode(record=False) as mode:
            fn(*pytree.tree_map_only(torch.Tensor, mode.from_tensor, args))

    fn_wide, args_wide = wide if wide is not None else (fn, pytree.tree_map(_cast, args))
    configs = {
        "cpu": traced(),
        "cuda h100": traced("cuda"),
        "cuda:1 a100": traced("cuda:1", gpu="a100-80gb"),
        "cuda l4": traced("cuda", gpu="l4"),
        "other float dtype": traced(fn=fn_wide, args=args_wide),
        "no_grad": traced(around=torch.no_grad),
        "inference_mode": traced(around=torch.inference_mode),
        "autocast cpu bf16": traced(around=lambda: torch.autocast("cpu", torch.bfloat16)),
        "autocast cuda fp16": traced("cuda", around=lambda: torch.autocast("cuda", torch.float16)),
        "oneDNN off": traced(around=lambda: torch.backends.mkldnn.flags(enabled=False)),
    }
    return configs, [unrecorded]


def run_cache_diff(opinfo, dtypes=None, max_samples=None, seed=0, rounds=2, per_dtype=None) -> dict:
    """The --cache-diff check for one OpInfo: {"op", "counts", "failures"};
    at most ``max_samples`` in all and ``per_dtype`` of each dtype."""
    counts, failures, n, seen = Counter(), [], 0, Counter()
    for dtype, s in samples(opinfo, dtypes):
        if max_samples is not None and n >= max_samples:
            break
        if per_dtype is not None and seen[dtype] >= per_dtype:
            continue
        n += 1
        seen[dtype] += 1
        configs, fillers = cache_configs(lambda inp, a, k: opinfo.op(inp, *a, **k), (s.input, s.args, s.kwargs))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problem = cache_differential(configs, fillers, seed + n, rounds)
        counts[PASS if problem is None else FAIL] += 1
        if problem is not None and len(failures) < 3:
            failures.append(f"{dtype}: {problem}")
    return {"op": op_id(opinfo), "counts": {"cache": dict(counts)}, "failures": {"cache": failures}}


def model_cache_diff(name: str, rounds: int = 2) -> str | None:
    """The --cache-diff check for a training step of ``tests/models.py``'s
    model ``name``, its other-dtype configuration the model in float64."""
    from tests.models import MODELS, train_step

    model, inputs = MODELS[name]()
    wide = copy.deepcopy(model).double()
    wide_inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    configs, fillers = cache_configs(
        lambda *xs: train_step(model, *xs), inputs, wide=(lambda *xs: train_step(wide, *xs), wide_inputs)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cache_differential(configs, fillers, seed=len(name), rounds=rounds)


def run_sample(opinfo, s, standins=("ours",)) -> dict:
    """{standin: (status, detail)} for one sample; empty when the real kernel rejects it."""
    try:
        real = _call(opinfo, s, lambda t: t)
        if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in pytree.tree_leaves(real)):
            return {}  # sparse outputs: MetaTensors are strided only
    except Exception:
        return {}
    out = {}
    for name in standins:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = STANDINS[name](opinfo, s)
        except Exception as e:  # the stand-in failed: data-dependent or a real failure
            status = DATA if _is_data_dependent(e) else FAIL
            out[name] = (
                status,
                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150]}" if str(e).strip() else type(e).__name__,
            )
            continue
        try:
            problem = compare(real, got, check_device=name != "meta")
            if problem is None and _has_tensor_input(s):  # a factory of scalars makes real tensors
                problem = _wrong_type(got, _OUTPUT_TYPE.get(name))
        except Exception as e:  # an output that has no strides, say
            problem = f"could not compare: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        out[name] = (PASS, "") if problem is None else (FAIL, problem)
    # The meta device cannot tell data dependence from a missing kernel; an
    # op ours and fake both find data-dependent counts as such for it too.
    if "meta" in out and out["meta"][0] == FAIL and out.get("ours", (None,))[0] == DATA:
        out["meta"] = (DATA, out["meta"][1])
    return out


def run_op(opinfo, standins=("ours",), dtypes=None, max_samples=None) -> dict:
    """{standin: Counter(status)} and the first failures, for one OpInfo."""
    torch.manual_seed(0)
    counts = defaultdict(Counter)
    failures = defaultdict(list)
    n = 0
    for dtype, s in samples(opinfo, dtypes):
        if max_samples is not None and n >= max_samples:
            break
        res = run_sample(opinfo, s, standins)
        if res:
            n += 1
        for name, (status, detail) in res.items():
            counts[name][status] += 1
            if status == FAIL and len(failures[name]) < 3:
                failures[name].append(f"{dtype}: {detail}")
    return {"op": op_id(opinfo), "counts": dict(counts), "failures": dict(failures)}


def _run_op_by_index(job):
    i, standins, dtypes, max_samples = job
    if standins == ("cache",):
        return run_cache_diff(op_db()[i], dtypes, max_samples)
    return run_op(op_db()[i], standins, dtypes, max_samples)


def summarise(results, standins) -> str:
    lines = []
    for name in standins:
        total = Counter()
        for r in results:
            total.update(r["counts"].get(name, {}))
        n = sum(total.values())
        ok = total[PASS] + total[DATA]
        lines.append(
            f"{name}: {ok}/{n} samples pass ({100.0 * ok / max(n, 1):.2f}%); "
            f"{total[DATA]} data-dependent, {total[FAIL]} fail"
        )
        failing = [r for r in results if r["counts"].get(name, {}).get(FAIL)]
        lines.append(f"  failing ops ({len(failing)}):")
        for r in sorted(failing, key=lambda r: r["op"]):
            lines.append(f"    {r['op']}: {r['counts'][name][FAIL]} samples; {r['failures'][name][0]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--anchors", action="store_true", help="also measure FakeTensorMode and meta")
    p.add_argument("--no-mode", action="store_true", help="also measure the stand-ins used outside any mode")
    p.add_argument("--ops", nargs="*", help="only these OpInfo names (name or name.variant)")
    p.add_argument("--max-samples", type=int, default=None, help="per op, over all dtypes")
    p.add_argument(
        "--cache-diff", action="store_true", help="check instead that the metadata cache never changes a trace"
    )
    p.add_argument("--models", action="store_true", help="with --cache-diff: the test suite's models, not op_db")
    p.add_argument("-j", "--jobs", type=int, default=1)
    ns = p.parse_args(argv)
    if ns.models:
        from tests.models import MODELS

        failed = 0
        for name in MODELS:
            problem = model_cache_diff(name)
            failed += problem is not None
            print(f"{name}: {'pass' if problem is None else problem}")
        return 1 if failed else 0
    standins = ("cache",) if ns.cache_diff else ("ours", "fake", "meta") if ns.anchors else ("ours",)
    if ns.no_mode and not ns.cache_diff:
        standins += ("ours-no-mode", "fake-no-mode") if ns.anchors else ("ours-no-mode",)
    db = op_db()
    idx = [i for i, o in enumerate(db) if not ns.ops or op_id(o) in ns.ops or o.name in ns.ops]
    jobs = [(i, standins, None, ns.max_samples) for i in idx]
    if ns.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(ns.jobs, maxtasksperchild=20) as pool:
            results = list(pool.imap_unordered(_run_op_by_index, jobs))
    else:
        results = [_run_op_by_index(j) for j in jobs]
    print(f"{len(results)} OpInfos")
    print(summarise(results, standins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
