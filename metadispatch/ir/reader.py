"""Decoding a parsed trace document, checking every value as it goes.

Nothing in the document is executed.  Op names are looked up in torch's
operator registry and must name an existing overload that replay may run
(Note [Ops a file may name] in decode.py); keyword names must be parameters
of the op's schema; dtypes, layouts, memory formats and devices come from
fixed tables; constants are raw bytes.  Every problem raises
:class:`TraceFormatError` naming the file and the JSON path of the bad value,
so a bad file fails at load time, before replay runs anything.

The file is untrusted (docs/trace-format.md, "Threat model"): nesting is
capped at ``MAX_DEPTH``, strings at ``MAX_STRING`` characters, sizes,
strides and offsets below 2**63, and checking is linear in the document's
size -- nothing is searched per distinct value.

The tables (strings, ops, tensor records) are checked once each, a column at
a time (Note [Tables, not trees] in serialize.py): a column passes a few
C-level checks -- the set of its types, its minimum and maximum -- and only a
column that fails them is walked in Python, to name the first bad entry.
JSON paths are built only then, too.

Note [One reader per file]
~~~~~~~~~~~~~~~~~~~~~~~~~~
This module is longer than the others (~450 lines is the rule) because
:class:`Reader` is one decoder of one document, read in file order:
strings, then tensor records, then leaves, then calls, each table referring
into the ones before it by index.  Every check shares the reader's failure
path (the file's name and the JSON path of the value, built only on
failure) and the tables read so far (``strings``, ``tensors``, the ids
``defined``); a value refers to a tensor record, a call to its op's schema
and to the ids defined before it.  Cut into modules, each piece would take
the reader's state as an argument and call back into it; so it is one
class, its methods in the order of the file, with the small pure helpers
at the end.  The op filter and the fixed tables it reads are decode.py.
"""

from __future__ import annotations

import base64
import math
import re
from itertools import chain, repeat
from typing import TYPE_CHECKING

import torch

from ..errors import TraceFormatError
from ..spec.schema import schema_of
from .assumptions import Assumption
from .calls import OpCall
from .decode import RECORDED_CHECKS, RETURN_TYPES, TAGS, decode_device, is_marker, refusal, resolve_op
from .records import Group, Leaf, TensorMeta, tensor_metas
from .rng import RngEvent
from .text import clip, printable

if TYPE_CHECKING:  # type-only: trace.py is above this module
    from .trace import Trace

__all__ = ["Reader", "MAX_DEPTH", "MAX_STRING", "MAX_DIMS"]

MAX_DEPTH = 32  # nesting of values: HF outputs (tuples of tuples) need about 5
MAX_STRING = 1 << 16  # characters in any string but constant data
MAX_DIMS = 64  # dimensions of a tensor record: torch's kernels stop at 25 (TensorIterator)
_SIZE_LIMIT = 1 << 63  # sizes, strides, offsets, ids: what an int64 holds

_KINDS = {"arg", "param", "buffer", "const", "input", "grad", "view", "state"}
_PHASES = {"forward", "backward", "optimizer"}
_INT = {int}
_PLAIN = {type(None), bool, int, float, str}
_TENSOR_COLUMNS = ("id", "shape", "dtype", "stride", "storage_offset", "device", "requires_grad", "storage")
_LEAF_COLUMNS = ("tensor", "kind", "name", "value")
_CALL_COLUMNS = ("op", "args", "kwargs", "outputs", "module", "phase", "rule", "source", "note")


class Reader:
    """Decodes a parsed document, checking every value against what it may be."""

    def __init__(self, name: str, allow_ops=()) -> None:
        self.name = name
        self.allow_ops = {str(op) for op in allow_ops}  # "mylib.op.default", "mylib::op" or "mylib::*"
        self.defined: set = set()  # tensor ids seen so far (leaves, outputs)
        self.strings: list = []
        self.tensors: list = []  # TensorMeta, by index in the tensors table

    def fail(self, where, what: str):
        raise TraceFormatError(f"{self.name}: {_path(where)}: {what}")

    def field(self, d, key: str, where: str, types):
        if not isinstance(d, dict) or key not in d:
            self.fail(where, f"missing field {key!r}")
        v = d[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in _tuple(types)):
            self.fail(f"{where}.{key}", f"expected {_names(types)}, got {type(v).__name__}")
        return v

    def trace(self, doc: dict, t: Trace) -> Trace:
        """Fill the empty trace ``t`` from ``doc``."""
        self.strings = self.field(doc, "strings", "file", list)
        if not set(map(type, self.strings)) <= {str} or (self.strings and max(map(len, self.strings)) > MAX_STRING):
            self.first_bad(self.strings, "strings", _is_short_str, "expected a string")
        ops = [self.op(name, f"ops[{i}]") for i, name in enumerate(self.field(doc, "ops", "file", list))]
        self.tensors = self.tensor_table(self.columns(doc, "tensors", _TENSOR_COLUMNS))
        for leaf in self.leaves(self.columns(doc, "leaves", _LEAF_COLUMNS)):
            t.leaves[leaf.meta.id] = leaf
        t.calls = self.calls(self.columns(doc, "calls", _CALL_COLUMNS), ops)
        t.output_meta = self.value(doc.get("output"), "output", _USE)
        for k, i in self.field(doc, "grads", "file", dict).items():
            self.text(k, "grads")
            t.grads[k] = self.ref(i, ("grads", k), _USE)
        modules = self.field(doc, "modules", "file", dict)
        for k, v in modules.items():
            self.text(k, "modules")
            self.text(v, ("modules", k))
        t.modules = dict(modules)
        gpu = doc.get("gpu")
        t.gpu = self.text(gpu, "gpu") if gpu is not None else None
        rng = doc.get("rng_state")
        t.rng_state = self.bytes_tensor(rng, "rng_state", _RNG_BYTES) if rng is not None else None
        threads = doc.get("threads")
        if threads is not None:
            if type(threads) is not int or not 1 <= threads <= _MAX_THREADS:
                self.fail("threads", f"expected a number of threads from 1 to {_MAX_THREADS}, got {threads!r}")
            t.threads = threads
        switches = doc.get("conv_switches")
        if switches is not None:
            if not (isinstance(switches, list) and len(switches) == 2 and all(type(s) is bool for s in switches)):
                self.fail("conv_switches", f"expected two flags, got {switches!r}")
            t.conv_switches = tuple(switches)
        self.streams(doc, t)
        names = doc.get("arg_names")
        if names is not None:
            if not isinstance(names, list):
                self.fail("arg_names", f"expected a list, got {type(names).__name__}")
            t.arg_names = [self.text(n, ("arg_names", i)) for i, n in enumerate(names)]
        aliases = doc.get("aliases") or {}
        if not isinstance(aliases, dict):
            self.fail("aliases", f"expected an object, got {type(aliases).__name__}")
        t.aliases = {self.text(k, "aliases"): self.text(v, ("aliases", k)) for k, v in aliases.items()}
        constants = doc.get("arg_constants")
        if constants is not None:
            if not isinstance(constants, dict):
                self.fail("arg_constants", f"expected an object, got {type(constants).__name__}")
            t.arg_constants = {
                self.text(k, "arg_constants"): self.text(v, ("arg_constants", k)) for k, v in constants.items()
            }
        deaths = doc.get("deaths")
        if deaths is not None:
            storages, calls = self.columns(doc, "deaths", ("storage", "call"))
            self.counts(storages, "deaths.storage")
            self.counts(calls, "deaths.call")
            t.deaths = dict(zip(storages, calls))
        if doc.get("storage_bytes") is not None:
            storages, sizes = self.columns(doc, "storage_bytes", ("storage", "bytes"))
            self.counts(storages, "storage_bytes.storage")
            self.counts(sizes, "storage_bytes.bytes")
            t.storage_bytes = dict(zip(storages, sizes))
        self.step(doc, t)
        self.world(doc, t)
        return t

    def step(self, doc: dict, t: Trace) -> None:
        """Which step the trace is, its marks, and its storages' bytes at the start (ir/cut.py)."""
        warmup = doc.get("warmup") or 0
        if type(warmup) is not int or not 0 <= warmup < _SIZE_LIMIT:
            self.fail("warmup", f"expected a number of steps, got {_short(warmup)}")
        t.warmup = warmup
        marks = doc.get("marks") or {}
        if not isinstance(marks, dict):
            self.fail("marks", f"expected an object, got {type(marks).__name__}")
        for k, v in marks.items():
            if type(v) is not int or not 0 <= v <= len(t.calls):
                self.fail(("marks", k), f"expected a call index, got {_short(v)}")
            t.marks[self.text(k, "marks")] = v
        self.assumptions(doc, t)
        if doc.get("start_bytes") is not None:
            storages, sizes = self.columns(doc, "start_bytes", ("storage", "bytes"))
            self.counts(storages, "start_bytes.storage")
            self.counts(sizes, "start_bytes.bytes")
            t.start_bytes = dict(zip(storages, sizes))

    def assumptions(self, doc: dict, t: Trace) -> None:
        """What the trace assumed (ir/assumptions.py): [call, op, module, user line or null, value, why] each."""
        rows = doc.get("assumptions") or []
        if not isinstance(rows, list):
            self.fail("assumptions", f"expected a list, got {_short(rows)}")
        for i, row in enumerate(rows):
            if not (isinstance(row, list) and len(row) == 6 and type(row[0]) is int and 0 <= row[0] <= len(t.calls)):
                self.fail(("assumptions", i), f"expected [call, op, module, source, value, basis], got {_short(row)}")
            index, op, module, source, value, basis = row
            texts = [self.text(v, ("assumptions", i)) for v in (op, module, value, basis)]
            where = None if source is None else self.text(source, ("assumptions", i))
            t.assumptions.append(Assumption(index, texts[0], texts[1], where, texts[2], texts[3]))

    def streams(self, doc: dict, t: Trace) -> None:
        """The random streams of format 4 (ir/rng.py); absent from older files."""
        cuda = doc.get("rng_cuda") or {}
        if not isinstance(cuda, dict):
            self.fail("rng_cuda", f"expected an object, got {type(cuda).__name__}")
        for k, v in cuda.items():
            self.stream(k, ("rng_cuda", k), cuda_only=True)
            t.rng_cuda[k] = self.bytes_tensor(v, ("rng_cuda", k), _RNG_BYTES)
        if doc.get("generators") is not None:
            devices, states = self.columns(doc, "generators", ("device", "state"))
            for i, (d, v) in enumerate(zip(devices, states)):
                self.device(self.text(d, ("generators.device", i)), ("generators.device", i))
                t.generators.append(
                    (d, None if v is None else self.bytes_tensor(v, ("generators.state", i), _RNG_BYTES))
                )
        if doc.get("rng_events") is not None:
            cols = self.columns(doc, "rng_events", ("at", "action", "stream", "slot", "state"))
            self.counts(cols[0], "rng_events.at")
            for i, (at, action, stream, slot, v) in enumerate(zip(*cols)):
                if action not in _ACTIONS:
                    self.fail(("rng_events.action", i), f"expected one of {sorted(_ACTIONS)}, got {_short(action)}")
                self.stream(stream, ("rng_events.stream", i))
                if (
                    type(slot) is not int
                    or not -1 <= slot < _SIZE_LIMIT
                    or (slot < 0) != (action != "save" and (v is not None or action != "load"))
                ):
                    self.fail(("rng_events.slot", i), f"not a slot for this event: {_short(slot)}")
                state = None if v is None else self.bytes_tensor(v, ("rng_events.state", i), _RNG_BYTES)
                t.rng_events.append(RngEvent(at, action, stream, slot, state))

    def stream(self, name, where, cuda_only: bool = False) -> None:
        if not (type(name) is str and _STREAM.fullmatch(name)) or (cuda_only and not name.startswith("cuda:")):
            self.fail(where, f"not a generator stream: {_short(name)}")

    def world(self, doc: dict, t: Trace) -> None:
        """A logical world's size and rank, and its process groups (version 4)."""
        world = doc.get("world")
        if world is not None:
            if not (
                isinstance(world, list) and len(world) == 2 and all(_is_count(v) for v in world) and world[1] < world[0]
            ):
                self.fail("world", "expected [world size, rank]")
            t.world = tuple(world)
        groups = doc.get("groups") or []
        if not isinstance(groups, list):
            self.fail("groups", "expected a list")
        for i, g in enumerate(groups):
            group = self.value(g, ("groups", i), _PLAIN_REF)
            if not isinstance(group, Group):
                self.fail(("groups", i), "expected a group")
            t.groups[group.name] = group

    # -- tables, a column at a time

    def columns(self, doc, name: str, names: tuple) -> list:
        """The columns of table ``name``, each a list, all of one length."""
        table = self.field(doc, name, "file", dict)
        cols = [self.field(table, c, name, list) for c in names]
        for c, col in zip(names, cols):
            if len(col) != len(cols[0]):
                self.fail(f"{name}.{c}", f"{len(col)} entries, but {name}.{names[0]} has {len(cols[0])}")
        return cols

    def first_bad(self, col: list, where: str, ok, what: str):
        """Fail naming the first entry of ``col`` that ``ok`` rejects."""
        for i, v in enumerate(col):
            if not ok(v):
                self.fail(f"{where}[{i}]", f"{what}, got {_short(v)}")
        raise AssertionError(f"{where}: a column check failed but no entry is bad")

    def counts(self, col: list, where: str) -> None:
        """Every entry a non-negative integer below 2**63."""
        if not (set(map(type, col)) <= _INT and (not col or (min(col) >= 0 and max(col) < _SIZE_LIMIT))):
            self.first_bad(col, where, _is_count, "expected a non-negative integer")

    def text(self, v, where) -> str:
        """``v``, which must be a string of at most MAX_STRING characters."""
        if not _is_short_str(v):
            self.fail(where, f"expected a string of at most {MAX_STRING} characters, got {_short(v)}")
        return v

    def indexes(self, col: list, n: int, where: str, what: str, nullable: bool = False) -> None:
        """Every entry an index into a table of ``n`` (or null, where ``nullable``)."""
        ints = [i for i in col if i is not None] if nullable else col
        if not (set(map(type, ints)) <= _INT and (not ints or (min(ints) >= 0 and max(ints) < n))):
            self.first_bad(
                col,
                where,
                lambda i: (i is None and nullable) or _is_count(i) and i < n,
                f"expected an index into {what} (which has {n} entries)",
            )

    def strs(self, col: list, where: str, nullable: bool = False) -> list:
        """A column of indexes into ``strings``, as the strings."""
        strings = self.strings
        self.indexes(col, len(strings), where, "strings", nullable)
        if nullable:
            return [None if i is None else strings[i] for i in col]
        return list(map(strings.__getitem__, col))

    def sizes(self, col: list, where: str, what: str) -> None:
        """Every entry a list of at most MAX_DIMS non-negative integers (a shape or strides)."""
        if set(map(type, col)) <= {list} and (not col or max(map(len, col)) <= MAX_DIMS):
            flat = list(chain.from_iterable(col))
            if set(map(type, flat)) <= _INT and (not flat or (min(flat) >= 0 and max(flat) < _SIZE_LIMIT)):
                return
        for i, seq in enumerate(col):
            if not isinstance(seq, list) or not all(type(s) is int for s in seq):
                self.fail(f"{where}[{i}]", f"{what}s must be a list of integers, got {_short(seq)}")
            if len(seq) > MAX_DIMS:
                self.fail(f"{where}[{i}]", f"{len(seq)} dimensions, more than {MAX_DIMS}")
            if seq and min(seq) < 0:
                self.fail(f"{where}[{i}]", f"negative {what} in {_short(seq)}")
            if seq and max(seq) >= _SIZE_LIMIT:
                self.fail(f"{where}[{i}]", f"{what} of 2**63 or more in {_short(seq)}")

    def tensor_table(self, cols: list) -> list:
        ids, shapes, dtypes, strides, offsets, devices, rgs, storages = cols
        self.counts(ids, "tensors.id")
        self.sizes(shapes, "tensors.shape", "size")
        self.sizes(strides, "tensors.stride", "stride")
        if shapes and max(map(math.prod, shapes)) >= _SIZE_LIMIT:
            self.first_bad(shapes, "tensors.shape", lambda s: math.prod(s) < _SIZE_LIMIT, "2**63 or more elements")
        if list(map(len, shapes)) != list(map(len, strides)):
            self.first_bad(
                list(zip(shapes, strides)),
                "tensors.stride",
                lambda p: len(p[0]) == len(p[1]),
                "(shape, stride) differ in length",
            )
        self.counts(offsets, "tensors.storage_offset")
        self.counts(storages, "tensors.storage")
        if not set(map(type, rgs)) <= {bool}:
            self.first_bad(rgs, "tensors.requires_grad", lambda v: type(v) is bool, "expected true or false")
        dtypes = self.strs(dtypes, "tensors.dtype")
        devices = self.strs(devices, "tensors.device")
        # A bad name is located only when one fails: searching the column for
        # every distinct name would be quadratic in the number of names.
        by_dtype = {n: self.dtype(n, _Lazy(dtypes, n, "tensors.dtype")) for n in set(dtypes)}
        by_device = {n: self.device(n, _Lazy(devices, n, "tensors.device")) for n in set(devices)}
        # tuple.__new__ on rows from zip: the NamedTuple's own __new__ is
        # Python code, and this table has a row per tensor record.
        return list(
            map(
                tuple.__new__,
                repeat(TensorMeta),
                zip(
                    ids,
                    map(tuple, shapes),
                    map(by_dtype.__getitem__, dtypes),
                    map(tuple, strides),
                    offsets,
                    map(by_device.__getitem__, devices),
                    rgs,
                    storages,
                ),
            )
        )

    def leaves(self, cols: list) -> list:
        tensors, kinds, names, values = cols
        self.indexes(tensors, len(self.tensors), "leaves.tensor", "tensors")
        kinds = self.strs(kinds, "leaves.kind")
        if not set(kinds) <= _KINDS:
            self.first_bad(kinds, "leaves.kind", _KINDS.__contains__, "unknown leaf kind")
        out = []
        for i, (ti, kind, name, value) in enumerate(zip(tensors, kinds, self.strs(names, "leaves.name"), values)):
            meta = self.tensors[ti]
            if value is not None:
                value = self.const(value, meta, f"leaves.value[{i}]")
            out.append(Leaf(meta, kind, name, value))
            self.defined.add(meta.id)
        return out

    def calls(self, cols: list, ops: list) -> list:
        op_col, args_col, kwargs_col, outputs_col = cols[:4]
        self.indexes(op_col, len(ops), "calls.op", "ops")
        modules, phases, rules = (self.strs(c, f"calls.{n}") for c, n in zip(cols[4:7], ("module", "phase", "rule")))
        if not set(phases) <= _PHASES:
            self.first_bad(phases, "calls.phase", _PHASES.__contains__, "unknown phase")
        sources, notes = self.strs(cols[7], "calls.source", True), self.strs(cols[8], "calls.note", True)
        calls, value, seq = [], self.value, self.seq
        for i, (oi, args, kwargs, outputs) in enumerate(zip(op_col, args_col, kwargs_col, outputs_col)):
            func, name, params, n_positional, n_returns, required = ops[oi]
            if type(args) is not list or len(args) > n_positional:
                self.fail(("calls.args", i), _misfit("arguments", args, name, n_positional))
            if type(outputs) is not list or len(outputs) > n_returns:
                self.fail(("calls.outputs", i), _misfit("outputs", outputs, name, n_returns))
            if type(kwargs) is not dict:
                self.fail(("calls.kwargs", i), f"expected an object, got {type(kwargs).__name__}")
            args = seq(args, ("calls.args", i), _USE)
            if kwargs:
                self.keywords(kwargs, params, len(args), ("calls.kwargs", i), name)
                kwargs = {k: value(v, (("calls.kwargs", i), k), _USE) for k, v in kwargs.items()}
            if len(args) < len(required[0]) or required[1]:
                self.required(required, args, kwargs, ("calls.args", i), name)
            checked = RECORDED_CHECKS.get(func.name())
            if checked is not None and not {name, func.name(), func.namespace + "::*"} & self.allow_ops:
                self.recorded_check(args, kwargs, checked, ("calls.args", i), name)
            outputs = seq(outputs, ("calls.outputs", i), _DEFINE)
            values = (*args, *(kwargs or {}).values(), *outputs)
            if is_marker(func) and any(next(tensor_metas(x), None) is not None for x in values):
                # a record_function marker holds no tensor: replay skips it, so
                # a tensor one "defines" would reach later calls undefined
                self.fail(("calls.outputs", i), f"{name} is a record_function marker and holds no tensors")
            calls.append(
                OpCall(
                    i, func, name, args, kwargs or None, outputs, modules[i], phases[i], rules[i], sources[i], notes[i]
                )
            )
        return calls

    def recorded_check(self, args: tuple, kwargs, messages: frozenset, where, op: str) -> None:
        """A check a trace records (Note [Checks a trace records]): a tensor and one of eager's messages."""
        tensor = len(args) == 2 and next(tensor_metas(args[0]), None) is not None
        if kwargs or not tensor or type(args[1]) is not str or args[1] not in messages:
            self.fail(
                where,
                f"replay will not run {op} with these arguments: a trace records it only as eager's "
                f"check of {len(messages)} known messages, and replay would raise the file's text",
            )

    def keywords(self, kwargs: dict, params: tuple, n_args: int, where, op: str) -> None:
        """Keyword names must be parameters of the schema not already given by position."""
        for k in kwargs:
            if k not in params:
                self.fail(
                    (where, _short(k)),
                    f"{op} has no parameter {_short(k)} (its schema has {', '.join(params) or 'none'})",
                )
            if params.index(k) < n_args:
                self.fail((where, k), f"{op}'s parameter {k!r} is also given by position")

    def required(self, required: tuple, args: tuple, kwargs, where, op: str) -> None:
        """Every parameter without a default is given: replay would call the op without it."""
        positional, keyword = required
        for k, param in enumerate(positional):
            if k >= len(args) and param not in (kwargs or {}):
                self.fail(where, f"{op} is missing its required argument {param!r}")
        for param in keyword:
            if param not in (kwargs or {}):
                self.fail(where, f"{op} is missing its required argument {param!r}")

    def op(self, name, where: str) -> tuple:
        """``(OpOverload, name, parameter names, number of positional ones, number of returns, required)``;
        ``required`` is (positional parameters without a default, keyword-only ones without a default)."""
        func = resolve_op(name) if isinstance(name, str) else None
        if func is None:
            self.fail(
                where, f"unknown op {_short(name)}: this torch ({torch.__version__}) has no such operator overload"
            )
        why = refusal(func)
        allowed = self.allow_ops
        if func.name() in RECORDED_CHECKS and not {name, func.name(), func.namespace + "::*"} & allowed:
            why = None  # each call's message is checked (Note [Checks a trace records] in decode.py)
        elif why is not None and not {name, func.name(), func.namespace + "::*"} & allowed:
            self.fail(
                where,
                f"replay will not run {name}: {why}; a trace you trust can "
                f"allow it with load(..., allow_ops=[{name!r}])",
            )
        schema = schema_of(func)
        params = tuple(a.name for a in schema.arguments)
        required = (
            tuple(a.name for a in schema.arguments if not a.kwarg_only and not a.has_default_value()),
            tuple(a.name for a in schema.arguments if a.kwarg_only and not a.has_default_value()),
        )
        n_positional = sum(not a.kwarg_only for a in schema.arguments)
        return func, name, params, n_positional, len(schema.returns), required

    # -- values

    def value(self, x, where, mode: int, depth: int = 0):
        t = type(x)
        if t is str:
            return x if len(x) <= MAX_STRING else self.text(x, where)
        if t in _PLAIN:
            return x
        if depth >= MAX_DEPTH:
            self.fail(where, f"values nested deeper than {MAX_DEPTH} levels")
        if t is dict:
            if len(x) == 1 and "t" in x:
                return self.ref(x["t"], where, mode)
            return self.tagged(x, where, mode, depth + 1)
        if t is list:
            return self.seq(x, where, mode, depth + 1)
        self.fail(where, "expected a value or a one-key tagged object")

    def seq(self, xs: list, where, mode: int, depth: int = 0) -> tuple:
        """``value`` of each of ``xs``, with tensor references (most arguments) taken first."""
        if set(map(type, xs)) <= _NUMBERS:  # [1, 0], shapes, scalars
            return tuple(xs)
        ref, value = self.ref, self.value
        return tuple(
            [
                ref(x["t"], (where, k), mode)
                if type(x) is dict and len(x) == 1 and "t" in x
                else value(x, (where, k), mode, depth)
                for k, x in enumerate(xs)
            ]
        )

    def tagged(self, x: dict, where, mode: int, depth: int):
        if len(x) != 1:
            self.fail(where, "expected a value or a one-key tagged object")
        ((tag, v),) = x.items()
        if tag == "dict":
            if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
                self.fail(where, "a dict must be a list of [key, value] pairs")
            out = {}
            for k, val in v:
                k = self.value(k, where, _PLAIN_REF, depth)
                if type(k) not in _PLAIN:
                    self.fail(where, "a dict key must be a plain value")
                out[k] = self.value(val, (where, _short(k)), mode, depth)
            return out
        if tag == "return_type":
            return self.return_type(v, where, mode, depth)
        decode = TAGS.get(tag)
        if decode is None:
            self.fail(where, f"unknown tag {_short(tag)}")
        try:
            return decode(v)
        except (TypeError, ValueError, AttributeError, RuntimeError):
            self.fail(where, f"bad {tag} value {_short(v)}")

    def return_type(self, v, where, mode: int, depth: int):
        """``[name, [values]]``: a ``torch.return_types`` named tuple, by name from a fixed table."""
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[1], list)):
            self.fail(where, "a return_type must be [name, [values]]")
        cls = RETURN_TYPES.get(v[0]) if type(v[0]) is str else None
        if cls is None:
            self.fail(where, f"unknown return type {_short(v[0])}")
        if len(v[1]) != cls.n_sequence_fields:
            self.fail(where, f"return type {v[0]} holds {cls.n_sequence_fields} values, got {len(v[1])}")
        return cls(self.seq(v[1], (where, v[0]), mode, depth))

    def ref(self, i, where, mode: int) -> TensorMeta:
        """The tensor record at index ``i``; a use must follow its definition."""
        if type(i) is not int or not 0 <= i < len(self.tensors):
            self.fail(where, f"no tensor record {i!r} (tensors has {len(self.tensors)})")
        m = self.tensors[i]
        if mode == _USE:
            if m.id not in self.defined:
                self.fail(where, f"tensor ${m.id} is used before any leaf or call defines it")
        elif mode == _DEFINE:
            self.defined.add(m.id)
        return m

    def dtype(self, name, where: str) -> torch.dtype:
        try:
            return TAGS["dtype"](name)
        except ValueError:
            self.fail(where, f"unknown dtype {_short(name)}")

    def device(self, name, where: str) -> torch.device:
        try:
            return decode_device(name)
        except ValueError:
            self.fail(where, f"bad device {_short(name)}")

    def const(self, d, meta: TensorMeta, where: str) -> torch.Tensor:
        dtype = self.dtype(self.field(d, "dtype", where, str), where)
        shape = self.field(d, "shape", where, list)
        if tuple(shape) != meta.shape or dtype != meta.dtype:
            self.fail(where, f"value {dtype}{shape} does not match its leaf {meta.dtype}{list(meta.shape)}")
        t = self.bytes_tensor(self.field(d, "data", where, str), where, meta.numel * dtype.itemsize)
        if t.numel() != meta.numel * dtype.itemsize:
            self.fail(where, f"{t.numel()} bytes of data for {meta.numel} elements of {dtype}")
        return t.view(dtype).reshape(meta.shape).clone()

    def bytes_tensor(self, s, where: str, limit: int) -> torch.Tensor:
        if not isinstance(s, str) or len(s) > 4 * (limit // 3 + 1):
            self.fail(where, f"expected base64 text of at most {limit} bytes")
        try:
            raw = base64.b64decode(s, validate=True)
        except (TypeError, ValueError):
            self.fail(where, "data is not base64")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


# What a tensor reference means where it appears: a use (its id must be
# defined already), a definition (a call's output), or neither (trace output).
_PLAIN_REF, _USE, _DEFINE = 0, 1, 2
_NUMBERS = {type(None), bool, int, float}
_MAX_THREADS = 1 << 12  # replay runs with this many: a file must not ask for a million
_RNG_BYTES = 1 << 16  # torch.get_rng_state() is 5056 bytes
_ACTIONS = {"save", "load", "seed"}  # ir/rng.py
_STREAM = re.compile(r"cpu|cuda:(0|[1-9][0-9]{0,3})|generator (0|[1-9][0-9]{0,8})")


class _Lazy:
    """``where[i]`` for the first ``i`` holding ``name``, found only when printed."""

    def __init__(self, col: list, name, where: str) -> None:
        self.col, self.name, self.where = col, name, where

    def __str__(self) -> str:
        return f"{self.where}[{self.col.index(self.name)}]"


def _short(v, n: int = 80) -> str:
    """``repr(v)`` cut to ``n`` characters, for messages about hostile values."""
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _is_short_str(v) -> bool:
    return type(v) is str and len(v) <= MAX_STRING


def _path(where) -> str:
    """A JSON path from nested ``(parent, key)`` pairs, built only for a message.

    Keys may come from the file (module and parameter names): they are
    escaped and clipped like any string from a file.
    """
    if not isinstance(where, tuple):
        return str(where)
    parent, key = where
    if isinstance(key, int):
        return f"{_path(parent)}[{key}]"
    return f"{_path(parent)}.{printable(clip(str(key), 80))}"


def _misfit(what: str, v, op: str, n: int) -> str:
    if type(v) is not list:
        return f"expected a list of {what}, got {type(v).__name__}"
    return f"{len(v)} {what} do not fit the schema of {op}, which has {n}"


def _is_count(v) -> bool:
    return type(v) is int and 0 <= v < _SIZE_LIMIT


def _tuple(t):
    return t if isinstance(t, tuple) else (t,)


def _names(types) -> str:
    return " or ".join(t.__name__ for t in _tuple(types))
