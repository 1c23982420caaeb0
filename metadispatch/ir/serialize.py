"""Saving and loading traces: versioned JSON, optionally gzipped.

The format is described in ``docs/trace-format.md``.  Loading is data only:
nothing in the file is executed -- no pickle, no ``eval``, no ``torch.load``;
``reader.py`` checks every value as it decodes it.

JSON text is written and parsed by ``orjson``: the standard library's
encoder took as long as everything else in ``save`` together (5-9 ms of
13 for an 8-layer LLaMA trace; orjson 0.5 ms), and its parser twice
orjson's.  orjson holds integers to 64 bits, so larger ones are written as
``{"int": "..."}`` (version 3); version-2 files, which wrote them bare, are
parsed with the standard library.

Note [Tables, not trees]
~~~~~~~~~~~~~~~~~~~~~~~~
A tensor is recorded once as an output and again at every use, and a model
runs the same few ops with the same few module names thousands of times.
Version 1 wrote each of those in full, and saving, parsing and checking the
repeats cost more than recording the trace.  Version 2 writes each distinct
tensor record, op name and string once, in tables, and everything else refers
to them by index; the tables and the calls are stored column by column, so the
reader checks a whole column of indexes or sizes with a few C-level passes
instead of one Python call per value.

Limits: ``trace.output`` (the MetaTensors ``fn`` returned) is not saved, only
``output_meta``; the named tuples torch's ops return (``torch.return_types``,
by name from a fixed table) come back as themselves, other containers than
tuples, lists and dicts (such as a Hugging Face ``ModelOutput``) as plain
dicts or tuples.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import os
import stat
import zlib
from typing import TYPE_CHECKING

import orjson
import torch

from ..errors import TraceFormatError
from .calls import OpCall
from .decode import RETURN_TYPES
from .reader import Reader
from .records import Group, TensorMeta, tensor_bytes
from .rng import GeneratorRef

if TYPE_CHECKING:  # type-only: trace.py imports this module for Trace.save/load
    from .trace import Trace

__all__ = ["save", "load", "FORMAT", "VERSION"]

FORMAT = "metadispatch.trace"
VERSION = 4  # 3: no random streams but the CPU start state, no leaf kind "grad", no world or
# groups (read); 2: integers beyond 64 bits written bare (read); 1: no tables (unreadable)
_READS = (2, 3, 4)
_INT_RANGE = range(-(1 << 63), 1 << 64)  # what orjson writes and reads exactly


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
    # The writer tags every non-finite float and big integer, so the document
    # holds only what JSON (and orjson) represent exactly.
    data = orjson.dumps(_Writer().document(trace))
    if str(path).endswith(".gz"):
        # The document is mostly small integers; higher levels cost several
        # times the time for a few percent less.
        data = gzip.compress(data, compresslevel=1, mtime=0)
    with open(path, "wb") as f:
        f.write(data)


class _Writer:
    """Builds the version-2 document: tables of strings, ops and tensor records."""

    def __init__(self) -> None:
        self.strings: dict[str, int] = {}
        self.ops: dict[str, int] = {}
        self.refs: dict[TensorMeta, dict] = {}  # record -> its {"t": index}, shared

    def document(self, trace: Trace) -> dict:
        leaves = _columns(_LEAF_COLUMNS, map(self.leaf, trace.leaves.values()))
        calls = _columns(_CALL_COLUMNS, map(self.call, trace.calls))
        output = self.enc(trace.output_meta, "output")
        grads = {k: self.ref(m)["t"] for k, m in trace.grads.items()}
        tensors = self.tensors()  # last: it adds the dtype and device strings
        deaths = trace.deaths
        return {
            "format": FORMAT,
            "version": VERSION,
            "torch": torch.__version__,
            "strings": list(self.strings),
            "ops": list(self.ops),
            "tensors": tensors,
            "leaves": leaves,
            "calls": calls,
            "output": output,
            "grads": grads,
            "modules": dict(trace.modules),
            "gpu": getattr(trace.gpu, "name", trace.gpu),
            "rng_state": _b64(trace.rng_state) if trace.rng_state is not None else None,
            "threads": trace.threads,
            "conv_switches": list(trace.conv_switches) if trace.conv_switches is not None else None,
            "deaths": ({"storage": list(deaths), "call": list(deaths.values())} if deaths is not None else None),
            "storage_bytes": self.storage_bytes(trace),
            **self.streams(trace),
            "world": list(trace.world) if trace.world is not None else None,
            "groups": [self.enc(g, "groups") for g in trace.groups.values()],
            "arg_names": trace.arg_names,
            "arg_constants": trace.arg_constants,
            "aliases": trace.aliases,
            "warmup": trace.warmup,
            "marks": dict(trace.marks),
            "assumptions": [list(a) for a in trace.assumptions],
            "start_bytes": {"storage": list(trace.start_bytes), "bytes": list(trace.start_bytes.values())},
        }

    def storage_bytes(self, trace: Trace) -> dict:
        """Note [Storages larger than their tensors]: the storages larger than any tensor on them reaches."""
        reach: dict = {}
        for m in self.refs:  # every tensor record written
            reach[m.storage] = max(reach.get(m.storage, 0), tensor_bytes(m))
        larger = {n: b for n, b in trace.storage_bytes.items() if n in reach and b > reach[n]}
        return {"storage": list(larger), "bytes": list(larger.values())}

    def streams(self, trace: Trace) -> dict:
        """The random streams beyond the CPU start state (ir/rng.py)."""
        events = trace.rng_events
        return {
            "rng_cuda": {k: _b64(v) for k, v in trace.rng_cuda.items()},
            "generators": {
                "device": [d for d, _ in trace.generators],
                "state": [None if v is None else _b64(v) for _, v in trace.generators],
            },
            "rng_events": {
                "at": [e.at for e in events],
                "action": [e.action for e in events],
                "stream": [e.stream for e in events],
                "slot": [e.slot for e in events],
                "state": [None if e.state is None else _b64(e.state) for e in events],
            },
        }

    def s(self, text: str) -> int:
        i = self.strings.get(text)
        if i is None:
            i = self.strings[text] = len(self.strings)
        return i

    def ref(self, m: TensorMeta) -> dict:
        r = self.refs.get(m)
        if r is None:
            r = self.refs[m] = {"t": len(self.refs)}
        return r

    def tensors(self) -> dict:
        ms = list(self.refs)  # dicts keep insertion order: index order
        dtypes = {d: self.s(_dtype_name(d)) for d in {m.dtype for m in ms}}
        devices = {d: self.s(str(d)) for d in {m.device for m in ms}}
        return {
            "id": [m.id for m in ms],
            "shape": [m.shape for m in ms],
            "dtype": [dtypes[m.dtype] for m in ms],
            "stride": [m.stride for m in ms],
            "storage_offset": [m.storage_offset for m in ms],
            "device": [devices[m.device] for m in ms],
            "requires_grad": [m.requires_grad for m in ms],
            "storage": [m.storage for m in ms],
        }

    def leaf(self, leaf) -> tuple:
        value = _value_doc(leaf.value) if leaf.value is not None else None
        return self.ref(leaf.meta)["t"], self.s(leaf.kind), self.s(leaf.name), value

    def call(self, c: OpCall) -> tuple:
        op = self.ops.get(c.op)
        if op is None:
            op = self.ops[c.op] = len(self.ops)
        s, i = self.s, c.index
        kwargs = {k: self.enc(v, i) for k, v in c.kwargs.items()} if c.kwargs else _NONE
        return (
            op,
            self.seq(c.args, i),
            kwargs,
            self.seq(c.outputs, i),
            s(c.module),
            s(c.phase),
            s(c.rule),
            None if c.source is None else s(c.source),
            None if c.note is None else s(c.note),
        )

    def seq(self, xs: tuple, i: int) -> list:
        """``enc`` of each of ``xs``, with tensors (most arguments) taken first."""
        ref, enc = self.ref, self.enc
        return [ref(x) if type(x) is TensorMeta else enc(x, i) for x in xs]

    def enc(self, x, where):
        """Plain JSON for recorded values; tagged objects for everything else.

        ``where`` is the call index, or the name of what holds ``x``.
        """
        t = type(x)
        if t is TensorMeta:
            return self.ref(x)
        if t is Group:
            return {"group": [x.name, x.size, x.rank, list(x.ranks)]}
        if x is None or t is bool or t is str or (t is int and x in _INT_RANGE):
            return x
        if t is tuple or t is list:
            return self.seq(x, where)
        if isinstance(x, float):
            return x if math.isfinite(x) else {"float": repr(x)}
        if isinstance(x, int):
            return x if x in _INT_RANGE else {"int": str(int(x))}
        if isinstance(x, str):
            return x
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
        if t is GeneratorRef:
            return {"generator": x.index}
        if isinstance(x, dict):
            return {"dict": [[self.enc(k, where), self.enc(v, where)] for k, v in x.items()]}
        if RETURN_TYPES.get(t.__name__) is t:  # torch.sort's (values, indices) and its kin
            return {"return_type": [t.__name__, self.seq(tuple(x), where)]}
        where = f"calls[{where}]" if type(where) is int else where
        raise TypeError(f"cannot save {t.__name__} in {where}: not a recorded value type")


_NONE: dict = {}
_LEAF_COLUMNS = ("tensor", "kind", "name", "value")
_CALL_COLUMNS = ("op", "args", "kwargs", "outputs", "module", "phase", "rule", "source", "note")
_DTYPE_NAMES: dict = {}


def _columns(names: tuple, rows) -> dict:
    """Rows of equal length as a table: one list per column, by name."""
    cols = list(zip(*rows)) or [()] * len(names)
    return {name: list(col) for name, col in zip(names, cols)}


def _b64(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return base64.b64encode(raw).decode()


def _value_doc(t: torch.Tensor) -> dict:
    return {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "data": _b64(t)}


def _dtype_name(d: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(d)
    if name is None:  # str(dtype) is slow: a dozen microseconds
        name = _DTYPE_NAMES[d] = str(d).removeprefix("torch.")
    return name


# -- reading

MAX_SIZE = 1 << 28  # bytes of JSON text (after gunzip) load reads by default: 256 MiB
# JSON values load parses by default.  Parsed, a value costs up to ~130 bytes
# (``{"t": 1}`` is a dict, ``[]`` a list), so 256 MiB of ``[],`` would take 8
# GiB; 8M values hold traces of ~250k calls (a call takes ~33) in under 1 GiB.
MAX_VALUES = 1 << 23


def load(
    path, trace_cls: type[Trace], *, max_size: int = MAX_SIZE, max_values: int = MAX_VALUES, allow_ops=()
) -> Trace:
    """Read a trace written by :func:`save` into a new ``trace_cls``.

    Raises TraceFormatError if the file is not one.  The class is passed in
    because :class:`Trace` owns ``save``/``load`` and so sits above this module.

    The file is treated as untrusted (docs/trace-format.md, "Threat model"):
    only a regular file is read, at most ``max_size`` bytes of JSON text
    (decompressed) holding at most ``max_values`` JSON values, and ops replay
    may not run are refused unless named in ``allow_ops``
    (``"mylib.fused.default"``, ``"mylib::fused"``, or ``"mylib::*"`` for
    every op of a namespace).
    """
    name = os.path.basename(str(path))
    try:
        doc = _parse(_read(path, name, max_size), name, max_size, max_values)
        trace = Reader(name, allow_ops).trace(doc, trace_cls())
    except MemoryError:
        raise TraceFormatError(
            f"{name}: ran out of memory reading it; load(..., max_size=N, max_values=M) reads less"
        ) from None
    trace.untrusted = True
    return trace


def _read(path, name: str, max_size: int) -> bytes:
    """The bytes of a regular file; a FIFO or device is refused without blocking."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TraceFormatError(f"{name}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_size + 1)
    if len(data) > max_size:
        raise TraceFormatError(f"{name}: larger than {max_size} bytes (load(..., max_size=N) reads more)")
    return data


def _gunzip(data: bytes, name: str, max_size: int) -> bytes:
    """Decompress every gzip member, refusing more than ``max_size`` bytes of output."""
    out: list = []
    size = 0
    while data:
        d = zlib.decompressobj(wbits=31)
        try:
            chunk = d.decompress(data, max_size + 1 - size)
        except zlib.error as e:
            raise TraceFormatError(f"{name}: broken gzip data (truncated?): {e}") from None
        size += len(chunk)
        out.append(chunk)
        if size > max_size or d.unconsumed_tail:
            raise TraceFormatError(
                f"{name}: decompresses to more than {max_size} bytes (load(..., max_size=N) reads more)"
            )
        if not d.eof:
            raise TraceFormatError(f"{name}: broken gzip data (truncated?)")
        data = d.unused_data
        if data and data[:2] != b"\x1f\x8b":
            raise TraceFormatError(f"{name}: broken gzip data (trailing garbage)")
    return b"".join(out)


def _parse(data: bytes, name: str, max_size: int = MAX_SIZE, max_values: int = MAX_VALUES) -> dict:
    if not data:
        raise TraceFormatError(f"{name}: the file is empty")
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(data, name, max_size)
    # Every value but the first follows a comma or opens an array or object;
    # counted in the raw text (commas in strings too: an upper bound), at C
    # speed, before anything is parsed.
    values = data.count(b",") + data.count(b"[") + data.count(b"{")
    if values > max_values:
        raise TraceFormatError(
            f"{name}: holds up to {values} JSON values, more than {max_values} (load(..., max_values=N) reads more)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceFormatError(f"{name}: not a trace: the file is not UTF-8 JSON text") from None
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        doc = _parse_exactly(text, name)  # for its messages: where, and NaN by name
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceFormatError(f'{name}: not a trace: expected a JSON object with "format": "{FORMAT}"')
    if doc.get("version") not in _READS:
        raise TraceFormatError(
            f"{name}: unknown format version {doc.get('version')!r}; "
            f"this metadispatch reads versions {', '.join(map(str, _READS))}"
        )
    if doc["version"] == 2:
        doc = _parse_exactly(text, name)  # orjson would read a big integer as a float
    return doc


def _parse_exactly(text: str, name: str) -> dict:
    """The standard library's parse: exact big integers, precise error messages."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise TraceFormatError(
            f"{name}: not valid JSON at line {e.lineno} column {e.colno} ({e.msg}); truncated or not a trace?"
        ) from None
    except _LongInteger as e:
        at = text.find(e.args[0])
        line, column = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
        raise TraceFormatError(
            f"{name}: an integer of {len(e.args[0])} digits at line {line} column {column} "
            f"(a trace's integers have at most {_MAX_DIGITS})"
        ) from None
    except RecursionError:
        raise TraceFormatError(f"{name}: JSON nested too deeply to be a trace") from None


_MAX_DIGITS = 400  # as the {"int": ...} tag (decode.py); int() is quadratic beyond a few thousand


class _LongInteger(Exception):
    """An integer literal too long to convert (raised inside json.loads)."""


def _parse_int(digits: str) -> int:
    if len(digits) > _MAX_DIGITS:
        raise _LongInteger(digits)
    return int(digits)


def _no_constant(c: str):
    raise TraceFormatError(f"non-standard JSON constant {c}")
