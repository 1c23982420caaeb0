"""Hostile files aimed at kernels that follow values: every op replay checks, refuses or must load complete.

:func:`write` puts into the corpus (hostile_traces.py), for every case of
tests/position_cases.py -- each op whose kernel follows its inputs' values or
shapes unchecked (trust/positions.py) -- the legitimate call, which must replay
(``safe``), and each bad variant, which must end in a ``ReplayError`` before
the kernel runs (``replay``); the issue's findings with their indices made
by ``aten.full`` in the file; ``grid_sampler``'s grid at the extremes of
floats, which its kernel bounds (``safe``); a call of each family replay refuses outright
(sparse, quantized, packed weights, oneDNN, engine state, GPU sequence
offsets); and calls missing an argument their schema requires (``load``).
test_hostile.py runs them with the rest of the corpus, and again under the
guard-page allocator (tests/guarded.py), where a read or write one element
outside a tensor kills the child.
"""

from __future__ import annotations

import torch

from tests.hostile_doc import Doc, ref
from tests.hostile_memory import const
from tests.position_cases import CASES
from tests.position_traces import arguments, case_doc

__all__ = ["write"]

# (op, arguments: fn(doc, a constant maker) -> args): one call of each refused family
_REFUSED = {
    "sobol": ("aten._sobol_engine_draw.default", lambda c: [c(torch.zeros(1, 2, dtype=torch.int64)), 3,
                                                             c(torch.zeros(2, 30, dtype=torch.int64)), 1000, 0, None]),
    "sparse-coo": ("aten.sparse_coo_tensor.indices", lambda c: [c(torch.tensor([[1 << 40]])), c(torch.ones(1))]),
    "sparse-csr": ("aten._sparse_csr_tensor_unsafe.default", lambda c: [c(torch.tensor([0, 9])),
                                                                         c(torch.tensor([1 << 30])), c(torch.ones(1)),
                                                                         [1, 4]]),
    "quantize": ("aten.quantize_per_tensor.default", lambda c: [c(torch.ones(4)), 0.1, 0, {"dtype": "quint8"}]),
    "fbgemm-packed": ("aten.fbgemm_linear_fp16_weight.default", lambda c: [c(torch.ones(2, 4)),
                                                                           c(torch.ones(64, dtype=torch.uint8)),
                                                                           c(torch.ones(4))]),
    "int4pack": ("aten._weight_int4pack_mm.default", lambda c: [c(torch.ones(2, 64, dtype=torch.bfloat16)),
                                                                 c(torch.ones(8, 8, dtype=torch.uint8)), 32,
                                                                 c(torch.ones(2, 8, 2, dtype=torch.bfloat16))]),
    "mkldnn": ("aten.to_mkldnn.default", lambda c: [c(torch.ones(4))]),
    "nested": ("aten._nested_view_from_buffer.default", lambda c: [c(torch.ones(4)),
                                                                   c(torch.tensor([[1 << 30]])),
                                                                   c(torch.tensor([[1]])), c(torch.tensor([0]))]),
    "flash-offsets": ("aten._flash_attention_forward.default", lambda c: [c(torch.ones(4, 2, 8)), c(torch.ones(4, 2, 8)),
                                                                         c(torch.ones(4, 2, 8)),
                                                                         c(torch.tensor([0, 1 << 30])),
                                                                         c(torch.tensor([0, 4])), 4, 4, 0.0, False,
                                                                         False]),
}  # fmt: skip

# The findings, their indices made in the file by aten.full (case op, argument)
_FULL = ["max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward", "adaptive_max_pool2d_backward",
         "adaptive_max_pool3d_backward", "embedding_dense_backward"]  # fmt: skip

# A call of each kind of argument left out: positional tensor, list of tensors, keyword-only out, an int
_MISSING = [
    (
        "aten.max_pool2d_with_indices_backward.default",
        lambda x: [ref(x), ref(x), [1, 1], [1, 1], [0, 0], [1, 1], False],
    ),
    ("aten._embedding_bag.default", lambda x: [ref(x), ref(x)]),
    ("aten.index.Tensor", lambda x: [ref(x)]),
    ("aten.add.out", lambda x: [ref(x), ref(x)]),
    ("aten.embedding_dense_backward.default", lambda x: [ref(x), ref(x), 5]),
    ("aten._pad_packed_sequence.default", lambda x: [ref(x), ref(x), False, 0.0]),
]


# Floats a kernel turns into positions and bounds itself: grid_sampler's grid, at the extremes (must run)
_GRIDS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 1e30, "-huge": -1e30}


def _name(case) -> str:
    return case.op._schema.name.split("::")[1]


def write(put, base) -> None:
    """Put every file above into the corpus."""
    for case in CASES:
        put("safe", f"checked-{_name(case)}", case_doc(base, case, arguments(case)).d)
        for bad in case.bad:
            put("replay", f"checked-{_name(case)}-{bad[0]}", case_doc(base, case, arguments(case, bad)).d)
    for case in (c for c in CASES if _name(c) in _FULL):
        bad = ("indices", lambda a: torch.full_like(a["indices"], 1 << 40))
        put("replay", f"full-{_name(case)}", case_doc(base, case, arguments(case, bad), fill="indices").d)
        bad = ("indices", lambda a: torch.full_like(a["indices"], 1000))
        put("replay", f"full-near-{_name(case)}", case_doc(base, case, arguments(case, bad), fill="indices").d)
    grid = next(c for c in CASES if _name(c) == "grid_sampler_2d")
    for what, v in _GRIDS.items():
        put(
            "safe",
            f"checked-grid-{what}",
            case_doc(base, grid, arguments(grid, ("grid", lambda a, v=v: a["grid"].fill_(v)))).d,
        )
    for what, (op, args) in _REFUSED.items():
        d = Doc(base)
        d.call(op, args(lambda t, d=d: ref(const(d, t))), {}, [ref(d.tensor(d.next_id(), [1]))])
        put("replay", f"refused-{what}", d.d)
    for op, args in _MISSING:
        d = Doc(base)
        x = d.leaf_index("args[1]")
        d.call(op, args(x), {}, [ref(d.tensor(d.next_id(), [2, 4]))])
        put("load", f"missing-argument-{op.split('.')[1]}", d.d)
