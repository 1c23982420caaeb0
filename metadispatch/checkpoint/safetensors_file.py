"""Read a safetensors file's header: 8 bytes of length, then that many bytes of JSON.

Requirements:

- read the 8-byte length and the header, nothing else (the tensor data that
  follows is never touched);
- trust nothing: the length is bounded (``MAX_HEADER``), the JSON may not
  repeat a key, each entry must name a known dtype, a shape of
  non-negative ints and ``data_offsets`` whose span is exactly the shape's
  bytes and lies inside the file; spans may not overlap.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import CheckpointFormatError
from .entries import MAX_HEADER, Entry, byte_size, refuse

__all__ = ["read_safetensors", "DTYPES"]

# safetensors' dtype names (its Rust ``Dtype`` enum) for the dtypes torch has.
DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors(path: str, opener=open) -> tuple[dict[str, Entry], dict]:
    """``(entries by name, __metadata__)`` of the safetensors file at ``path``."""
    name = os.path.basename(path)
    with opener(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            refuse(path, "", f"{size} bytes: too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or n > size - 8:
            refuse(path, "", f"header length {n} exceeds the file ({size} bytes) or {MAX_HEADER} bytes")
        raw = f.read(n)
    header = _parse(path, raw)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        refuse(path, "__metadata__", "is not a map of strings")
    data_bytes = size - 8 - n
    entries = {key: _entry(path, name, key, info, data_bytes) for key, info in header.items()}
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            refuse(path, b, f"its data overlaps {a!r}'s")
    return entries, metadata


def _parse(path: str, raw: bytes) -> dict:
    def no_repeats(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            refuse(path, next(k for k in keys if keys.count(k) > 1), "appears twice in the header")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_repeats)
    except CheckpointFormatError:
        raise  # our own refusal, from the hook
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        refuse(path, "", f"the header is not JSON ({type(e).__name__}: {str(e)[:200]})")
    if not isinstance(header, dict):
        refuse(path, "", "the header is not a JSON object")
    return header


def _entry(path: str, file: str, key: str, info, data_bytes: int) -> Entry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        refuse(path, key, "is not an object with dtype, shape and data_offsets")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        refuse(path, key, f"dtype {info['dtype']!r} is not one torch has (known: {', '.join(DTYPES)})")
    nbytes = byte_size(path, key, info["shape"], dtype)
    offsets = info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        refuse(path, key, f"data_offsets {offsets!r} is not two ints")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        refuse(path, key, f"data_offsets {offsets} lie outside the file's {data_bytes} bytes of data")
    if end - begin != nbytes:
        refuse(path, key, f"data_offsets {offsets} span {end - begin} bytes, its shape needs {nbytes}")
    shape = tuple(info["shape"])
    stride = tuple(_contiguous(shape))
    return Entry(key, shape, dtype, file, stride, begin, f"bytes {begin}", nbytes)


def _contiguous(shape: tuple) -> list:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return stride[::-1]
