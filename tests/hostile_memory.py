"""Hostile files aimed at what replay runs: memory safety, hidden writes and budgets.

Each builder returns a :class:`~tests.hostile_doc.Doc` of one attack, so
that tests/execution/test_hostile_replay.py can check one promise at a time, and
:func:`write` puts them all in the corpus (hostile_traces.py) with the class
each must end as:

- reads and writes outside a tensor's memory: a sparse tensor with
  unchecked indices added into a dense one, a view ``_reshape_alias`` made
  past its storage;
- writes of the caller's tensors the schema does not announce: batch-norm
  statistics, a sparse tensor over the caller's values, ``set_`` growing the
  caller's storage, ``set_data``;
- costs the budget must see: sizes read from values (``bincount``,
  ``repeat_interleave``), reading 2**62 elements of a 4-byte tensor, a
  kernel's scratch copy, a matrix power with a huge exponent, an ``unbind``
  into 2**22 tensors, 5k empty calls, a chain of 10k ``set_`` (quadratic
  once);
- calls replay cannot size before running: no meta kernel, a data-dependent
  result that lies about its size.
"""

from __future__ import annotations

import base64

import torch

from tests.hostile_doc import Doc, ref

__all__ = ["write", "BUILDERS"]


def const(d: Doc, values) -> int:
    """A constant leaf holding ``values`` (a CPU tensor); its tensor-table row."""
    raw = values.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    dtype = str(values.dtype).removeprefix("torch.")
    row = d.tensor(d.next_id(), list(values.shape), dtype=dtype)
    d.leaf("const", "", row, {"dtype": dtype, "shape": list(values.shape), "data": base64.b64encode(raw).decode()})
    return row


def made_up(d: Doc, shape, stride, dtype="float32") -> int:
    """A leaf replay makes up (4 bytes with stride 0, however many elements)."""
    row = d.tensor(d.next_id(), shape, dtype=dtype, stride=stride)
    d.leaf("input", "", row)
    return row


_SPARSE_KW = {
    "dtype": {"dtype": "float32"},
    "layout": {"layout": "sparse_coo"},
    "device": {"device": "cpu"},
    "pin_memory": False,
    "is_coalesced": True,
}


def sparse_into_dense(base, index: int) -> Doc:
    """Add a sparse tensor whose one index is ``index`` into ``zeros(4)``: a heap write."""
    d = Doc(base)
    idx, val = const(d, torch.tensor([[index]])), const(d, torch.tensor([1234.5]))
    sp, dense = d.tensor(d.next_id(), [4], stride=[0]), d.tensor(d.next_id() + 1, [4])
    d.call(
        "aten._sparse_coo_tensor_with_dims_and_tensors.default", [1, 0, [4], ref(idx), ref(val)], _SPARSE_KW, [ref(sp)]
    )
    d.call("aten.zeros.default", [[4]], {"device": {"device": "cpu"}}, [ref(dense)])
    d.call("aten.add_.Tensor", [ref(dense), ref(sp)], {}, [ref(dense)])
    return d


def sparse_over_caller(base) -> Doc:
    """A sparse tensor over the caller's ``y`` (the schema says fresh), divided in place."""
    d = Doc(base)
    y, idx = d.leaf_index("args[2]"), const(d, torch.arange(4)[None])
    sp = d.tensor(d.next_id(), [4])
    d.call(
        "aten._sparse_coo_tensor_with_dims_and_tensors.default", [1, 0, [4], ref(idx), ref(y)], _SPARSE_KW, [ref(sp)]
    )
    d.call("aten.div_.Scalar", [ref(sp), 1e30], {}, [ref(sp)])
    return d


def reshape_alias_past_storage(base, write: bool) -> Doc:
    """A view of 64 (write) or 4096 (read) elements over a 4-element storage."""
    d = Doc(base)
    n = d.next_id()
    z = d.tensor(n, [4])
    d.call("aten.zeros.default", [[4]], {"device": {"device": "cpu"}}, [ref(z)])
    size = 64 if write else 4096
    v = d.tensor(n + 1, [size], storage=d.d["tensors"]["storage"][z])
    d.call("aten._reshape_alias.default", [ref(z), [size], [1]], {}, [ref(v)])
    if write:
        d.call("aten.fill_.Scalar", [ref(v), 1.0], {}, [ref(v)])
    else:
        d.call("aten.clone.default", [ref(v)], {}, [ref(d.tensor(n + 2, [size]))])
    return d


# op -> its arguments with (input, statistics a, statistics b): the caller's
# bias and y (4 elements each) are the running statistics of a 4-channel input
NORMS = {
    "aten.batch_norm.default": lambda x, a, b: [x, None, None, a, b, True, 1.0, 1e-5, False],
    "aten.instance_norm.default": lambda x, a, b: [x, None, None, a, b, True, 1.0, 1e-5, False],
    "aten._batch_norm_impl_index.default": lambda x, a, b: [x, None, None, a, b, True, 1.0, 1e-5, False],
    "aten.native_batch_norm.default": lambda x, a, b: [x, None, None, a, b, True, 1.0, 1e-5],
    "aten.batch_norm_update_stats.default": lambda x, a, b: [x, a, b, 1.0],
}


def norm_on_callers_statistics(base, op: str) -> Doc:
    """A norm in training on a fresh (2, 4, 3) input, with the caller's tensors as its statistics."""
    d = Doc(base)
    a, b = ref(d.leaf_index("bias")), ref(d.leaf_index("args[2]"))
    x = d.tensor(d.next_id(), [2, 4, 3])
    d.call("aten.ones.default", [[2, 4, 3]], {}, [ref(x)])
    ns, name, overload = op.split(".")
    real = getattr(getattr(getattr(torch.ops, ns), name), overload)(
        *NORMS[op](torch.ones(2, 4, 3), torch.zeros(4), torch.ones(4))
    )
    d.call(op, NORMS[op](ref(x), a, b), {}, [_record(d, r) for r in (real if isinstance(real, tuple) else (real,))])
    return d


def _record(d: Doc, value):
    """``value`` as an output of the call being built: a new tensor record, or the number itself."""
    if not isinstance(value, torch.Tensor):
        return value
    dtype = str(value.dtype).removeprefix("torch.")
    return ref(d.tensor(d.next_id(), list(value.shape), dtype=dtype, stride=list(value.stride())))


def set_growing_callers_storage(base) -> Doc:
    d = Doc(base)
    y, n = d.leaf_index("args[2]"), d.next_id()
    z = d.tensor(n, [0])
    d.call("aten.empty.memory_format", [[0]], {}, [ref(z)])
    grown = d.tensor(n, [1 << 22])
    d.call("aten.set_.source_Tensor_storage_offset", [ref(z), ref(y), 0, [1 << 22], [1]], {}, [ref(grown)])
    return d


def set_data_then_write(base) -> Doc:
    d = Doc(base)
    y, n = d.leaf_index("args[2]"), d.next_id()
    z = d.tensor(n, [4])
    d.call("aten.zeros.default", [[4]], {}, [ref(z)])
    d.call("aten.set_data.default", [ref(z), ref(y)], {}, [])
    d.call("aten.mul_.Scalar", [ref(z), 0.0], {}, [ref(z)])
    return d


def value_sized(base, op: str, elements: int) -> Doc:
    """``bincount``/``repeat_interleave`` of a constant asking for ``elements`` outputs, recorded as 1."""
    d = Doc(base)
    c = const(d, torch.tensor([elements - 1 if op == "bincount" else elements]))
    out = d.tensor(d.next_id(), [1], dtype="int64")
    d.call("aten.bincount.default" if op == "bincount" else "aten.repeat_interleave.Tensor", [ref(c)], {}, [ref(out)])
    d.d["output"] = ref(out)
    return d


def zero_stride_reduction(base, op: str, elements: int) -> Doc:
    """``sum``/``median`` of a 4-byte made-up leaf of ``elements`` elements."""
    d = Doc(base)
    e = made_up(d, [elements], [0])
    d.call(f"aten.{op}.default", [ref(e)], {}, [ref(d.tensor(d.next_id(), []))])
    return d


def matrix_power(base, n: int, exponent: int) -> Doc:
    d = Doc(base)
    k = d.next_id()
    a = d.tensor(k, [n, n])
    d.call("aten.eye.default", [n], {"device": {"device": "cpu"}}, [ref(a)])
    d.call("aten.matrix_power.default", [ref(a), exponent], {}, [ref(d.tensor(k + 1, [n, n]))])
    return d


def unbind_rows(base, rows: int) -> Doc:
    d = Doc(base)
    e = made_up(d, [rows], [0])
    d.call("aten.unbind.int", [ref(e)], {}, [[ref(d.tensor(d.next_id(), []))]])
    return d


def many_calls(base, n: int) -> Doc:
    """``n`` in-place calls on an empty tensor: nothing to allocate, all to compile and run."""
    d = Doc(base)
    e = d.tensor(d.next_id(), [0])
    d.call("aten.empty.memory_format", [[0]], {}, [ref(e)])
    d.call("aten.relu_.default", [ref(e)], {}, [ref(e)])
    c = d.d["calls"]
    for col in c:
        c[col].extend([c[col][-1]] * (n - 1))
    return d


def chained_set(base, leaves: int) -> Doc:
    """One tensor ``set_`` to each of ``leaves`` leaves in turn."""
    d = Doc(base)
    z = d.tensor(d.next_id(), [0])
    d.call("aten.empty.memory_format", [[0]], {}, [ref(z)])
    first = d.next_id()
    for i in range(leaves):
        leaf = d.tensor(first + i, [0])
        d.leaf("input", "", leaf)
        d.call("aten.set_.source_Tensor", [ref(z), ref(leaf)], {}, [ref(z)])
    return d


def no_meta_kernel(base) -> Doc:
    d = Doc(base)
    x = d.leaf_index("args[1]")
    d.call("aten._add_relu.Scalar", [ref(x), 1.0], {}, [ref(d.tensor(d.next_id(), [2, 4]))])
    return d


def data_dependent_lie(base) -> Doc:
    """``nonzero`` of a constant with 3 nonzeros, recorded as one; its result then feeds an outer product."""
    d = Doc(base)
    c = const(d, torch.tensor([1.0, 2.0, 3.0]))
    n = d.next_id()
    nz = d.tensor(n, [1, 1], dtype="int64")
    d.call("aten.nonzero.default", [ref(c)], {}, [ref(nz)])
    d.call("aten.mul.Tensor", [ref(nz), ref(nz)], {}, [ref(d.tensor(n + 1, [1, 1], dtype="int64"))])
    return d


def complex_nan_argument(base) -> Doc:
    """A complex scalar of nan and inf: repro() must write it as Python."""
    d = Doc(base)
    x = d.leaf_index("args[1]")
    d.call("aten.add.Tensor", [ref(x), {"complex": ["nan", "inf"]}], {}, [ref(d.tensor(d.next_id(), [2, 4]))])
    return d


BUILDERS = {  # name in the corpus -> (class, builder)
    "sparse-oob-write": ("replay", lambda b: sparse_into_dense(b, 6)),
    "sparse-oob-write-far": ("replay", lambda b: sparse_into_dense(b, 1 << 30)),
    "sparse-over-caller": ("replay", sparse_over_caller),
    "reshape-alias-write": ("replay", lambda b: reshape_alias_past_storage(b, True)),
    "reshape-alias-read": ("replay", lambda b: reshape_alias_past_storage(b, False)),
    **{f"norm-stats-{op.split('.')[1]}": ("safe", lambda b, op=op: norm_on_callers_statistics(b, op)) for op in NORMS},
    "set-grows-caller": ("safe", set_growing_callers_storage),
    "set-data-then-write": ("safe", set_data_then_write),
    "bincount-from-values": ("replay", lambda b: value_sized(b, "bincount", 20_000_000)),
    "repeat-interleave-from-values": ("replay", lambda b: value_sized(b, "repeat_interleave", 20_000_000)),
    "sum-2**62-zero-stride": ("budget", lambda b: zero_stride_reduction(b, "sum", 1 << 62)),
    "tight-median-scratch": ("budget", lambda b: zero_stride_reduction(b, "median", 100_000_000)),
    "matrix-power-2**62": ("budget", lambda b: matrix_power(b, 2048, (1 << 62) - 1)),
    "unbind-2**22-rows": ("replay", lambda b: unbind_rows(b, 1 << 22)),
    "tight-5k-calls": ("budget", lambda b: many_calls(b, 5_000)),
    "tight-chained-set-10k": ("budget", lambda b: chained_set(b, 10_000)),
    "no-meta-kernel": ("replay", no_meta_kernel),
    "data-dependent-lie": ("replay", data_dependent_lie),
    "complex-nan-repro": ("safe", complex_nan_argument),
}


def write(put, base) -> None:
    """Put every attack above into the corpus."""
    for what, (cls, build) in BUILDERS.items():
        put(cls, what, build(base).d)
