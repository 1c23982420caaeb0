"""Saving and loading traces: versioned JSON, optionally gzipped.

The format is described in ``docs/trace-format.md``.  Loading is data only:
nothing in the file is executed -- no pickle, no ``eval``, no ``torch.load``;
``reader.py`` checks every value as it decodes it.

Limits: ``trace.output`` (the MetaTensors ``fn`` returned) is not saved, only
``output_meta``; containers other than tuples, lists and dicts (such as a
Hugging Face ``ModelOutput``) come back as plain dicts or tuples.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import os
import zlib

import torch

from .errors import TraceFormatError
from .reader import Reader
from .trace import Leaf, OpCall, TensorMeta, Trace

__all__ = ["save", "load", "FORMAT", "VERSION"]

FORMAT = "metadispatch.trace"
VERSION = 1


# -- writing

def save(trace: Trace, path) -> None:
    """Write ``trace`` to ``path``; gzip when the name ends in ``.gz``.

    >>> import os, tempfile, torch, metadispatch as md
    >>> t = md.trace(lambda x: x.sum(), torch.ones(2))
    >>> path = os.path.join(tempfile.mkdtemp(), "t.json")
    >>> t.save(path)
    >>> str(md.Trace.load(path)) == str(t)
    True
    """
    doc = {
        "format": FORMAT, "version": VERSION, "torch": torch.__version__,
        "leaves": [_leaf_doc(leaf) for leaf in trace.leaves.values()],
        "calls": [_call_doc(c) for c in trace.calls],
        "output": _enc(trace.output_meta, "output"),
        "grads": {k: _enc(m, f"grads.{k}") for k, m in trace.grads.items()},
        "modules": dict(trace.modules),
        "rng_state": _b64(trace.rng_state) if trace.rng_state is not None else None,
        # storage number -> index of the first call after it was freed
        "deaths": ({str(k): v for k, v in trace.deaths.items()} if trace.deaths is not None else None),
    }
    data = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    if str(path).endswith(".gz"):
        data = gzip.compress(data, compresslevel=5, mtime=0)  # 9 costs 3x the time for 5% less
    with open(path, "wb") as f:
        f.write(data)


def _leaf_doc(leaf: Leaf) -> dict:
    return {"meta": _enc(leaf.meta, "leaf"), "kind": leaf.kind, "name": leaf.name,
            "value": _value_doc(leaf.value) if leaf.value is not None else None}


def _call_doc(c: OpCall) -> dict:
    where = f"calls[{c.index}]"
    return {"op": c.op, "args": _enc(c.args, where + ".args"),
            "kwargs": {k: _enc(v, f"{where}.kwargs.{k}") for k, v in c.kwargs.items()},
            "outputs": _enc(c.outputs, where + ".outputs"), "module": c.module,
            "phase": c.phase, "rule": c.rule, "source": c.source, "note": c.note}


def _b64(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return base64.b64encode(raw).decode()


def _value_doc(t: torch.Tensor) -> dict:
    return {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "data": _b64(t)}


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _enc(x, where: str):
    """Plain JSON for recorded values; tagged objects for everything else."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"float": repr(x)}
    if isinstance(x, TensorMeta):
        return {"tensor": [x.id, list(x.shape), _dtype_name(x.dtype), list(x.stride),
                           x.storage_offset, str(x.device), x.requires_grad, x.storage]}
    if isinstance(x, torch.dtype):
        return {"dtype": _dtype_name(x)}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    if isinstance(x, complex):
        return {"complex": [repr(x.real), repr(x.imag)]}
    if isinstance(x, (tuple, list)):
        return [_enc(y, f"{where}[{i}]") for i, y in enumerate(x)]
    if isinstance(x, dict):
        return {"dict": [[_enc(k, where), _enc(v, f"{where}.{k}")] for k, v in x.items()]}
    raise TypeError(f"cannot save {type(x).__name__} at {where}: not a recorded value type")


# -- reading

def load(path) -> Trace:
    """Read a trace written by :func:`save`; raise TraceFormatError if it is not one."""
    name = os.path.basename(str(path))
    with open(path, "rb") as f:
        data = f.read()
    doc = _parse(data, name)
    return Reader(name).trace(doc)


def _parse(data: bytes, name: str) -> dict:
    if not data:
        raise TraceFormatError(f"{name}: the file is empty")
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError, zlib.error) as e:
            raise TraceFormatError(f"{name}: broken gzip data (truncated?): {e}") from None
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise TraceFormatError(f"{name}: not a trace: the file is not UTF-8 JSON text") from None
    except json.JSONDecodeError as e:
        raise TraceFormatError(
            f"{name}: not valid JSON at line {e.lineno} column {e.colno} ({e.msg}); "
            "truncated or not a trace?") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceFormatError(f"{name}: not a trace: expected a JSON object with "
                               f"\"format\": \"{FORMAT}\"")
    if doc.get("version") != VERSION:
        raise TraceFormatError(f"{name}: unknown format version {doc.get('version')!r}; "
                               f"this metadispatch reads version {VERSION}")
    return doc


def _no_constant(c: str):
    raise TraceFormatError(f"non-standard JSON constant {c}")
