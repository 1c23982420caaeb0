"""Decoding a parsed trace document, checking every value as it goes.

Nothing in the document is executed.  Op names are looked up in torch's
operator registry and must name an existing overload; dtypes, layouts and
memory formats must be values torch defines; constants are raw bytes.  Every
problem raises :class:`TraceFormatError` naming the file and the JSON path of
the bad value, so a bad file fails at load time, before replay runs anything.
"""

from __future__ import annotations

import base64

import torch

from .errors import TraceFormatError
from .trace import Leaf, OpCall, TensorMeta, Trace, _tensor_metas

__all__ = ["Reader", "resolve_op"]

_KINDS = {"arg", "param", "buffer", "const", "input"}
_PHASES = {"forward", "backward"}


class Reader:
    """Decodes a parsed document, checking every value against what it may be."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.defined: set = set()  # tensor ids seen so far (leaves, outputs)
        # A tensor appears once as an output and again as each use; records
        # already checked are served from here (keyed by their contents).
        self._tensors: dict = {}
        self._dtypes: dict = {}
        self._devices: dict = {}

    def fail(self, where: str, what: str):
        raise TraceFormatError(f"{self.name}: {where}: {what}")

    def field(self, d, key: str, where: str, types):
        if not isinstance(d, dict) or key not in d:
            self.fail(where, f"missing field {key!r}")
        v = d[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in _tuple(types)):
            self.fail(f"{where}.{key}", f"expected {_names(types)}, got {type(v).__name__}")
        return v

    def trace(self, doc: dict) -> Trace:
        t = Trace()
        for i, ld in enumerate(self.field(doc, "leaves", "file", list)):
            leaf = self.leaf(ld, f"leaves[{i}]")
            t.leaves[leaf.meta.id] = leaf
            self.defined.add(leaf.meta.id)
        for i, cd in enumerate(self.field(doc, "calls", "file", list)):
            t.calls.append(self.call(cd, i))
        t.output_meta = self.value(doc.get("output"), "output")
        for k, v in self.field(doc, "grads", "file", dict).items():
            t.grads[k] = self.tensor_ref(v, f"grads.{k}")
        t.modules = {str(k): str(v) for k, v in self.field(doc, "modules", "file", dict).items()}
        rng = doc.get("rng_state")
        t.rng_state = self.bytes_tensor(rng, "rng_state") if rng is not None else None
        deaths = doc.get("deaths")
        if deaths is not None:
            t.deaths = {self.count(k, f"deaths.{k}"): self.count(v, f"deaths.{k}")
                        for k, v in self.field(doc, "deaths", "file", dict).items()}
        return t

    def count(self, v, where: str) -> int:
        """A non-negative integer, also from a JSON object key."""
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            self.fail(where, f"expected a non-negative integer, got {v!r}")
        return v

    def leaf(self, d, where: str) -> Leaf:
        meta = self.tensor(self.field(d, "meta", where, dict), where + ".meta")
        kind = self.field(d, "kind", where, str)
        if kind not in _KINDS:
            self.fail(where + ".kind", f"unknown leaf kind {kind!r}")
        value = d.get("value")
        if value is not None:
            value = self.const(value, meta, where + ".value")
        return Leaf(meta, kind, self.field(d, "name", where, str), value)

    def call(self, d, i: int) -> OpCall:
        where = f"calls[{i}]"
        op = self.field(d, "op", where, str)
        func = resolve_op(op)
        if func is None:
            self.fail(where + ".op", f"unknown op {op!r}: this torch ({torch.__version__}) "
                      "has no such operator overload")
        args = self.value(self.field(d, "args", where, list), where + ".args", uses=True)
        kwargs = {k: self.value(v, f"{where}.kwargs.{k}", uses=True)
                  for k, v in self.field(d, "kwargs", where, dict).items()}
        outputs = self.value(self.field(d, "outputs", where, list), where + ".outputs")
        schema = func._schema
        if len(args) > len(schema.arguments) or len(outputs) > len(schema.returns):
            self.fail(where, f"{len(args)} arguments and {len(outputs)} outputs do not fit "
                      f"the schema of {op}: {schema}")
        self.defined.update(m.id for m in _tensor_metas(outputs))
        phase = self.field(d, "phase", where, str)
        if phase not in _PHASES:
            self.fail(where + ".phase", f"unknown phase {phase!r}")
        opt = (str, type(None))
        return OpCall(i, func, op, tuple(args), kwargs or None, tuple(outputs),
                      self.field(d, "module", where, str), phase,
                      self.field(d, "rule", where, str), self.field(d, "source", where, opt),
                      self.field(d, "note", where, opt))

    def value(self, x, where: str, uses: bool = False):
        if x is None or isinstance(x, (bool, int, str, float)):
            return x
        if isinstance(x, list):
            return tuple(self.value(y, f"{where}[{i}]", uses) for i, y in enumerate(x))
        if not isinstance(x, dict) or len(x) != 1:
            self.fail(where, "expected a value or a one-key tagged object")
        (tag, v), = x.items()
        if tag == "tensor":
            return self.tensor_ref(x, where) if uses else self.tensor(x, where)
        if tag == "dict":
            if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
                self.fail(where, "a dict must be a list of [key, value] pairs")
            return {self.value(k, where): self.value(val, f"{where}.{k}", uses) for k, val in v}
        decode = _TAGS.get(tag)
        if decode is None:
            self.fail(where, f"unknown tag {tag!r}")
        try:
            return decode(v)
        except (TypeError, ValueError, AttributeError, RuntimeError):
            self.fail(where, f"bad {tag} value {v!r}")

    def tensor_ref(self, x, where: str) -> TensorMeta:
        m = self.tensor(x, where)
        if m.id not in self.defined:
            self.fail(where, f"tensor ${m.id} is used before any leaf or call defines it")
        return m

    def tensor(self, x, where: str) -> TensorMeta:
        v = self.field(x, "tensor", where, list)
        if len(v) != 8:
            self.fail(where, f"a tensor record has 8 fields, got {len(v)}")
        tid, shape, dtype, stride, offset, device, rg, storage = v
        try:
            key = (tid, tuple(shape), dtype, tuple(stride), offset, device, rg, storage)
            hit = self._tensors.get(key)
        except TypeError:  # unhashable parts: let the checks below say what
            key = hit = None
        if hit is not None:
            return hit
        self.nonneg(tid, where + " id")
        self.nonneg(offset, where + " storage offset")
        self.nonneg(storage, where + " storage number")
        for what, seq in (("size", shape), ("stride", stride)):
            if not isinstance(seq, list) or not all(type(s) is int for s in seq):
                self.fail(where, f"{what}s must be a list of integers, got {seq!r}")
            if seq and min(seq) < 0:
                self.fail(where, f"negative {what} in {seq}")
        if len(shape) != len(stride):
            self.fail(where, f"shape {shape} and stride {stride} differ in length")
        if not isinstance(rg, bool):
            self.fail(where, "requires_grad must be true or false")
        m = TensorMeta(tid, tuple(shape), self.dtype(dtype, where), tuple(stride), offset,
                       self.device(device, where), rg, storage)
        if key is not None:
            self._tensors[key] = m
        return m

    def nonneg(self, v, where: str) -> None:
        if not _is_int(v) or v < 0:
            self.fail(where, f"expected a non-negative integer, got {v!r}")

    def dtype(self, name, where: str) -> torch.dtype:
        d = self._dtypes.get(name) if isinstance(name, str) else None
        if d is None:
            d = getattr(torch, name, None) if isinstance(name, str) else None
            if not isinstance(d, torch.dtype):
                self.fail(where, f"unknown dtype {name!r}")
            self._dtypes[name] = d
        return d

    def device(self, name, where: str) -> torch.device:
        d = self._devices.get(name) if isinstance(name, str) else None
        if d is None:
            try:
                d = torch.device(name)
            except (TypeError, RuntimeError):
                self.fail(where, f"bad device {name!r}")
            self._devices[name] = d
        return d

    def const(self, d, meta: TensorMeta, where: str) -> torch.Tensor:
        dtype = self.dtype(self.field(d, "dtype", where, str), where)
        shape = self.field(d, "shape", where, list)
        if tuple(shape) != meta.shape or dtype != meta.dtype:
            self.fail(where, f"value {dtype}{shape} does not match its leaf "
                      f"{meta.dtype}{list(meta.shape)}")
        t = self.bytes_tensor(self.field(d, "data", where, str), where)
        if t.numel() != meta.numel * dtype.itemsize:
            self.fail(where, f"{t.numel()} bytes of data for {meta.numel} elements of {dtype}")
        return t.view(dtype).reshape(meta.shape).clone()

    def bytes_tensor(self, s, where: str) -> torch.Tensor:
        try:
            raw = base64.b64decode(s, validate=True)
        except (TypeError, ValueError):
            self.fail(where, "data is not base64")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(
            0, dtype=torch.uint8)


def _decode_float(v):
    if v not in ("inf", "-inf", "nan"):
        raise ValueError(v)
    return float(v)


def _decode_complex(real: str, imag: str) -> complex:
    return complex(float(real), float(imag))  # float() parses numbers only


def _enum(kind):
    def decode(name):
        v = getattr(torch, name) if isinstance(name, str) and not name.startswith("_") else None
        if not isinstance(v, kind):
            raise ValueError(name)
        return v
    return decode


_TAGS = {
    "float": _decode_float,
    "dtype": _enum(torch.dtype),
    "layout": _enum(torch.layout),
    "memory_format": _enum(torch.memory_format),
    "device": torch.device,
    "complex": lambda v: _decode_complex(*v),
}


def resolve_op(name: str):
    """The OpOverload called ``ns.op.overload``, or None; never runs anything else.

    >>> resolve_op("aten.mm.default")
    <OpOverload(op='aten.mm', overload='default')>
    >>> resolve_op("os.system.default") is None
    True
    """
    parts = name.split(".")
    if len(parts) != 3 or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        return None
    ns, op, overload = parts
    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or overload not in packet.overloads():
        return None
    func = getattr(packet, overload)
    return func if isinstance(func, torch._ops.OpOverload) else None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tuple(t):
    return t if isinstance(t, tuple) else (t,)


def _names(types) -> str:
    return " or ".join(t.__name__ for t in _tuple(types))
