"""Read a ``torch.save`` zip's tensors by its records: no tensor data, no pickle code.

A ``torch.save`` file (the zip format, torch >= 1.6) holds ``<prefix>/data.pkl``,
a pickle whose tensors are calls of ``torch._utils._rebuild_tensor_v2`` (or
``_v3``, or ``_rebuild_parameter`` around one) on a *persistent id*
``("storage", FloatStorage, "0", "cpu", numel)`` naming the record
``<prefix>/data/0`` that holds the bytes.

Requirements:

- read the zip's directory and ``data.pkl``, never a ``data/`` record;
- run no code from the file.  ``pickle.Unpickler`` would call the globals the
  file names; instead :func:`_interpret` walks the opcodes (``pickletools.genops``
  decodes them and nothing more) on a small stack machine that knows the
  few globals ``torch.save`` of tensors and state dicts writes -- the set
  ``weights_only=True`` allows for tensors -- and builds inert records;
  any other global is refused, named;
- bound everything: the pickle's size, every tensor against its storage and
  every storage against its record's size in the zip's directory.

Note [What inspect accepts of a pickle]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
State dicts, nested dicts and lists of them, with tensors, parameters and
plain values (numbers, strings, None, bools) as leaves: what ``torch.save``
writes for ``model.state_dict()``, an optimizer's ``state_dict()`` or a
``{"model": ..., "epoch": 3}`` dict.  A tensor is named by its path of keys
joined with ``.``.  Objects of other classes (a Lightning checkpoint's
hyper-parameters, a pickled ``nn.Module``) are refused with the global's name,
as ``torch.load(weights_only=True)`` refuses them.
"""

from __future__ import annotations

import io
import os
import pickletools
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import CheckpointFormatError
from .entries import MAX_HEADER, Entry, byte_size, refuse
from .safetensors_file import DTYPES

__all__ = ["read_torch_zip", "named_tensors"]

_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "UntypedStorage": torch.uint8,
}
# dtypes pickle as ``torch.<name>`` globals (``_rebuild_tensor_v3``'s argument).
_DTYPES = {str(d).removeprefix("torch."): d for d in (*DTYPES.values(), torch.complex128)}
_REBUILDS = ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter", "_rebuild_parameter_with_state")


@dataclass(frozen=True)
class _Global:
    name: str  # "module.qualname"


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype


def read_torch_zip(path: str, opener=open) -> dict[str, Entry]:
    """Entries by name of the ``torch.save`` zip at ``path``."""
    with opener(path, "rb") as f:
        try:
            z = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, ValueError, OSError) as e:
            refuse(path, "", f"not a readable zip ({e}); torch.save's format before torch 1.6 is not read")
        sizes = {i.filename: i.file_size for i in z.infolist()}
        pickles = [n for n in sizes if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pickles) != 1:
            refuse(path, "", f"holds {len(pickles)} <prefix>/data.pkl records, torch.save writes one")
        prefix = pickles[0].removesuffix("data.pkl")
        if sizes[pickles[0]] > MAX_HEADER:
            refuse(path, pickles[0], f"{sizes[pickles[0]]} bytes of pickle exceed {MAX_HEADER}")
        order = z.read(prefix + "byteorder").decode("ascii", "replace") if prefix + "byteorder" in sizes else "little"
        if order != "little":
            refuse(path, prefix + "byteorder", f"byte order {order!r}: only little-endian files are read")
        try:
            data = z.read(pickles[0])
        except (zipfile.BadZipFile, ValueError, OSError) as e:
            refuse(path, pickles[0], f"unreadable ({e})")
    root = _interpret(path, data)
    entries: dict[str, Entry] = {}
    for name, t in named_tensors(path, root, _Tensor):
        entries[name] = _entry(path, name, t, sizes.get(f"{prefix}data/{t.storage.key}"))
    return entries


def _entry(path: str, name: str, t: _Tensor, record_bytes) -> Entry:
    s = t.storage
    if record_bytes is None:
        refuse(path, name, f"its storage {s.key!r} has no data/{s.key} record")
    storage_bytes = s.numel * s.dtype.itemsize
    if storage_bytes > record_bytes:
        refuse(path, name, f"storage {s.key!r} claims {storage_bytes} bytes, its record holds {record_bytes}")
    nbytes = byte_size(path, name, t.shape, t.dtype)
    if not (isinstance(t.stride, tuple) and len(t.stride) == len(t.shape)) or not all(
        type(x) is int and 0 <= x < 2**63 for x in (*t.stride, t.offset)
    ):
        refuse(path, name, f"stride {t.stride!r} or offset {t.offset!r} does not fit shape {list(t.shape)}")
    if nbytes:
        last = t.offset + sum((d - 1) * st for d, st in zip(t.shape, t.stride))
        if (last + 1) * t.dtype.itemsize > storage_bytes:
            refuse(path, name, f"reaches element {last} of storage {s.key!r}, which holds {storage_bytes} bytes")
    return Entry(name, tuple(t.shape), t.dtype, os.path.basename(path), tuple(t.stride), t.offset, s.key, storage_bytes)


def named_tensors(path: str, root, kind):
    """(dotted name, leaf) for every leaf of type ``kind`` in ``root``'s dicts and lists."""
    stack = [("", root, 0)]
    while stack:
        name, obj, depth = stack.pop()
        if isinstance(obj, kind):
            yield name, obj
        elif depth > 64:
            refuse(path, name, "nested more than 64 levels deep")
        elif isinstance(obj, dict):
            for k, v in reversed(list(obj.items())):
                stack.append((f"{name}.{k}" if name else str(k), v, depth + 1))
        elif isinstance(obj, (list, tuple)):
            for i, v in reversed(list(enumerate(obj))):
                stack.append((f"{name}.{i}" if name else str(i), v, depth + 1))


# -- the stack machine


def _interpret(path: str, data: bytes):
    """The object ``data`` (a pickle) describes, with tensors as :class:`_Tensor` records."""
    stack: list = []
    marks: list[int] = []
    memo: dict = {}
    try:
        for op, arg, pos in pickletools.genops(io.BytesIO(data)):
            name = op.name
            if name == "STOP":
                if len(stack) != 1:
                    break
                return stack[0]
            if name in ("PROTO", "FRAME"):
                continue
            if name == "MARK":
                marks.append(len(stack))
            elif name in _ATOM_OPS:
                stack.append(arg if name not in _CONSTANTS else _CONSTANTS[name])
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "EMPTY_LIST":
                stack.append([])
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                stack[len(stack) - n :] = [tuple(stack[len(stack) - n :])]
            elif name in ("TUPLE", "APPENDS", "SETITEMS", "LIST", "DICT"):
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                _collect(path, pos, name, stack, items)
            elif name == "APPEND":
                value = stack.pop()
                _expect(path, pos, stack[-1], list).append(value)
            elif name == "SETITEM":
                value, key = stack.pop(), stack.pop()
                _expect(path, pos, stack[-1], dict)[_key(path, pos, key)] = value
            elif name in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[arg if name != "MEMOIZE" else len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                if arg not in memo:
                    refuse(path, f"pickle byte {pos}", f"reads memo {arg}, never written")
                stack.append(memo[arg])
            elif name == "GLOBAL":
                module, _, qual = str(arg).partition(" ")
                stack.append(_global(path, pos, module, qual))
            elif name == "STACK_GLOBAL":
                qual, module = stack.pop(), stack.pop()
                stack.append(_global(path, pos, module, qual))
            elif name == "BINPERSID":
                stack.append(_storage(path, pos, stack.pop()))
            elif name == "REDUCE":
                args = stack.pop()
                stack.append(_call(path, pos, stack.pop(), args))
            elif name == "BUILD":
                stack.pop()  # an OrderedDict's ``_metadata``, a Parameter's state: not tensors
                _expect(path, pos, stack[-1], (dict, _Tensor))
            else:
                refuse(path, f"pickle byte {pos}", f"opcode {name}, which torch.save does not write")
    except CheckpointFormatError:
        raise
    except (ValueError, IndexError, TypeError, KeyError) as e:
        refuse(path, "data.pkl", f"malformed pickle ({type(e).__name__}: {e})")
    refuse(path, "data.pkl", "the pickle does not end with one object and STOP")


_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_ATOM_OPS = {
    *_CONSTANTS,
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "BINFLOAT",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
    "BINBYTES",
    "SHORT_BINBYTES",
}


def _collect(path, pos, name, stack, items) -> None:
    if name == "TUPLE":
        stack.append(tuple(items))
    elif name == "LIST":
        stack.append(list(items))
    elif name == "APPENDS":
        _expect(path, pos, stack[-1], list).extend(items)
    else:
        target = {} if name == "DICT" else _expect(path, pos, stack[-1], dict)
        if len(items) % 2:
            refuse(path, f"pickle byte {pos}", f"{name} with an odd number of items")
        for k, v in zip(items[::2], items[1::2]):
            target[_key(path, pos, k)] = v
        if name == "DICT":
            stack.append(target)


def _expect(path, pos, obj, kind):
    if not isinstance(obj, kind):
        refuse(path, f"pickle byte {pos}", f"an item added to a {type(obj).__name__}")
    return obj


def _key(path, pos, key):
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        refuse(path, f"pickle byte {pos}", f"a dict key of type {type(key).__name__}")
    return key


def _global(path, pos, module, qual) -> _Global:
    if not isinstance(module, str) or not isinstance(qual, str):
        refuse(path, f"pickle byte {pos}", "a global named by something other than strings")
    name = f"{module}.{qual}"
    known = (
        name in ("collections.OrderedDict", "torch.Size", "torch.storage.UntypedStorage")
        or (module == "torch._utils" and qual in _REBUILDS)
        or (module == "torch" and (qual in _STORAGES or qual in _DTYPES))
    )
    if not known:
        refuse(
            path,
            name,
            "a global torch.save does not write for tensors and dicts (Note [What inspect accepts of a pickle])",
        )
    return _Global(name)


def _storage(path, pos, pid) -> _Storage:
    ok = isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)
    if not ok or not isinstance(pid[2], str) or type(pid[4]) is not int or pid[4] < 0:
        refuse(path, f"pickle byte {pos}", f"persistent id {pid!r} is not a torch.save storage")
    dtype = _STORAGES.get(pid[1].name.rpartition(".")[2])
    if dtype is None:
        refuse(path, pid[2], f"storage class {pid[1].name} is not a storage")
    return _Storage(dtype, pid[2], pid[4])


def _call(path, pos, fn, args):
    if not isinstance(fn, _Global) or not isinstance(args, tuple):
        refuse(path, f"pickle byte {pos}", f"a call of {fn!r}, not of a known global")
    qual = fn.name.rpartition(".")[2]
    if fn.name == "collections.OrderedDict" and args == ():
        return OrderedDict()
    if fn.name == "torch.Size" and len(args) == 1 and isinstance(args[0], tuple):
        return args[0]
    if qual in ("_rebuild_parameter", "_rebuild_parameter_with_state") and args and isinstance(args[0], _Tensor):
        return args[0]
    if qual == "_rebuild_tensor_v2" and 6 <= len(args) <= 7 and isinstance(args[0], _Storage):
        return _Tensor(args[0], args[1], args[2], args[3], args[0].dtype)
    if qual == "_rebuild_tensor_v3" and 7 <= len(args) <= 8 and isinstance(args[0], _Storage):
        dtype = _DTYPES.get(args[6].name.removeprefix("torch.")) if isinstance(args[6], _Global) else None
        if dtype is not None:
            return _Tensor(args[0], args[1], args[2], args[3], dtype)
    refuse(path, fn.name, f"called with arguments torch.save does not write ({len(args)} of them)")
