"""``md.checkpoint.inspect``: a checkpoint's tensors, from a file or a shard index.

A path is read by what it is: a ``*.index.json`` (``model.safetensors.index.json``,
``pytorch_model.bin.index.json``: a ``weight_map`` from tensor name to shard
file) reads each shard's header once; a directory reads the index or the one
checkpoint file inside it; a file is safetensors or a ``torch.save`` zip by
its first bytes (a zip starts with ``PK``).

A shard index is untrusted too: a shard must be a plain file name beside the
index (no ``/``, no ``..``), and each name it maps must be in its shard.
"""

from __future__ import annotations

import json
import os

from .entries import MAX_HEADER, Contents, Entry, refuse
from .safetensors_file import read_safetensors
from .torch_zip import read_torch_zip

__all__ = ["inspect"]

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_FILES = ("model.safetensors", "pytorch_model.bin")


def inspect(path, *, opener=open) -> Contents:
    """The tensors of the checkpoint at ``path``: names, shapes, dtypes, bytes; no tensor data is read.

    ``path`` is a safetensors file, a ``torch.save`` zip, a shard index
    (``*.index.json``) or a directory holding one of them.  No pickle code
    runs (Note [What inspect accepts of a pickle] in ``torch_zip.py``).
    ``opener`` opens files (``open`` unless you count what is read).

    >>> import tempfile, os, torch, metadispatch as md
    >>> path = os.path.join(tempfile.mkdtemp(), "m.pt")
    >>> torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    >>> print(md.checkpoint.inspect(path))
    weight: torch.float32[2, 3] 24 bytes (m.pt)
    bias: torch.float32[2] 8 bytes (m.pt)
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = _inside(path)
    if path.endswith(".json"):
        return _index(path, opener)
    tensors, metadata, fmt = _file(path, opener)
    return Contents(path, fmt, tensors, (os.path.basename(path),), metadata)


def _inside(directory: str) -> str:
    for name in (*_INDEXES, *_FILES):
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    refuse(directory, "", f"holds none of {', '.join(_INDEXES + _FILES)}")


def _file(path: str, opener) -> tuple[dict[str, Entry], dict, str]:
    try:
        with opener(path, "rb") as f:
            magic = f.read(2)
    except OSError as e:
        refuse(path, "", f"cannot be opened ({e.strerror or e})")
    if magic == b"PK":
        return read_torch_zip(path, opener), {}, "torch"
    tensors, metadata = read_safetensors(path, opener)
    return tensors, metadata, "safetensors"


def _index(path: str, opener) -> Contents:
    try:
        with opener(path, "rb") as f:
            raw = f.read(MAX_HEADER + 1)
    except OSError as e:
        refuse(path, "", f"cannot be opened ({e.strerror or e})")
    if len(raw) > MAX_HEADER:
        refuse(path, "", f"an index larger than {MAX_HEADER} bytes")
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as e:
        refuse(path, "", f"not JSON ({type(e).__name__})")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        refuse(path, "weight_map", "missing, or not a map from tensor name to file name")
    folder = os.path.dirname(path)
    tensors: dict[str, Entry] = {}
    metadata: dict = dict(index.get("metadata") or {}) if isinstance(index.get("metadata"), dict) else {}
    formats = set()
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not shard or "/" in shard or "\\" in shard or shard in (".", "..") or shard != os.path.basename(shard):
            refuse(path, shard, "a shard that is not a plain file name beside the index")
        found, meta, fmt = _file(os.path.join(folder, shard), opener)
        formats.add(fmt)
        metadata.update(meta)
        for name, entry in found.items():
            if weight_map.get(name) == shard:
                tensors[name] = entry
    for name, shard in weight_map.items():
        if name not in tensors:
            refuse(path, name, f"mapped to {shard}, which holds no such tensor")
    fmt = formats.pop() if len(formats) == 1 else "mixed"
    ordered = {name: tensors[name] for name in weight_map}
    return Contents(path, fmt, ordered, tuple(shards), metadata)
