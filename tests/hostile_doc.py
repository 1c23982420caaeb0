"""The document of a small valid trace, and edits to it: what hostile files are made of.

``base_doc`` traces ``(lin(x) + y).relu().sum()`` and returns its saved
document; :class:`Doc` edits a copy (adds strings, tensor records, leaves
and calls) and keeps it otherwise well formed; ``user_tensors`` are the
caller's tensors every replay of a hostile file is handed, which must come
out unchanged.  Used by the corpus (hostile_traces.py), its checker
(hostile_check.py) and the tests that build one attack at a time.
"""

from __future__ import annotations

import copy
import json
import os


def base_doc(tmp: str) -> dict:
    """A small trace of ``(lin(x) + y).relu().sum()`` as a document."""
    import metadispatch as md

    lin, x, y = user_tensors()
    path = os.path.join(tmp, "base.json")
    md.trace(step, lin, x, y).save(path)
    with open(path) as f:
        doc = json.load(f)
    os.unlink(path)
    return doc


def step(m, x, y):
    """The traced code: a linear layer, an add and a reduction."""
    return (m(x) + y).relu().sum()


def user_tensors():
    """The caller's tensors every replay is handed: (module, x, y)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 4), torch.randn(2, 4), torch.randn(4)


class Doc:
    """Edits to a trace document that keep it otherwise well formed."""

    def __init__(self, doc: dict) -> None:
        self.d = copy.deepcopy(doc)

    def s(self, text: str) -> int:
        self.d["strings"].append(text)
        return len(self.d["strings"]) - 1

    def tensor(self, tid: int, shape, dtype="float32", stride=None, offset=0, storage=None, device="cpu") -> int:
        t = self.d["tensors"]
        if stride is None:
            stride, acc = [], 1
            for n in reversed(shape):
                stride.insert(0, acc)
                acc *= max(n, 1)
        for col, v in (
            ("id", tid),
            ("shape", list(shape)),
            ("dtype", self._sidx(dtype)),
            ("stride", list(stride)),
            ("storage_offset", offset),
            ("device", self._sidx(device)),
            ("requires_grad", False),
            ("storage", tid + 1000 if storage is None else storage),
        ):
            t[col].append(v)
        return len(t["id"]) - 1

    def _sidx(self, text: str) -> int:
        strs = self.d["strings"]
        return strs.index(text) if text in strs else self.s(text)

    def leaf_index(self, name: str) -> int:
        """The tensor-table index of leaf ``name`` (``args[1]``, ``weight``)."""
        leaves = self.d["leaves"]
        for ti, ni in zip(leaves["tensor"], leaves["name"]):
            if self.d["strings"][ni] == name:
                return ti
        raise KeyError(name)

    def leaf(self, kind: str, name: str, tensor: int, value=None) -> None:
        leaves = self.d["leaves"]
        leaves["tensor"].append(tensor)
        leaves["kind"].append(self._sidx(kind))
        leaves["name"].append(self._sidx(name))
        leaves["value"].append(value)

    def call(self, op: str, args, kwargs=None, outputs=(), module=None) -> None:
        ops = self.d["ops"]
        if op not in ops:
            ops.append(op)
        c = self.d["calls"]
        c["op"].append(ops.index(op))
        c["args"].append(args)
        c["kwargs"].append(kwargs or {})
        c["outputs"].append(list(outputs))
        c["module"].append(self._sidx(module) if module is not None else c["module"][0])
        c["phase"].append(c["phase"][0])
        c["rule"].append(c["rule"][0])
        c["source"].append(None)
        c["note"].append(None)

    def next_id(self) -> int:
        return max(self.d["tensors"]["id"]) + 1


def ref(i: int) -> dict:
    """A reference to row ``i`` of the tensors table."""
    return {"t": i}
