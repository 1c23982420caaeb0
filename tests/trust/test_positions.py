"""Every op a loaded trace may run has a memory class (trust/positions.py, Note [Values that become positions]).

The completeness test enumerates the operator registry of the installed
torch, so that a torch that adds an op fails here until the op is
classified; the rest hold the classification to what it claims and to the
default deny replay applies to an op with none.
"""

from __future__ import annotations

import json

import pytest
import torch

import metadispatch as md
from metadispatch import _compat
from metadispatch.ir.decode import refusal, resolve_op
from metadispatch.trust import fences, index_checks
from metadispatch.trust.index_checks import CHECKS
from metadispatch.trust.positions import CALLER, CHECKED, CHECKED_OPS, KERNEL, REFUSED, position
from tests.hostile_doc import Doc, base_doc, ref, user_tensors
from tests.hostile_memory import const


def _admitted() -> list:
    """Every aten and prims overload the op filter lets a file name."""
    out = []
    for name in sorted(_compat.registered_op_names()):
        ns, _, rest = name.partition("::")
        if ns not in ("aten", "prims"):
            continue
        op, _, overload = rest.partition(".")
        func = resolve_op(f"{ns}.{op}.{overload or 'default'}")
        if func is not None and refusal(func) is None:
            out.append(func)
    return out


_ADMITTED = _admitted()


def test_positions_every_admitted_op_has_a_class():
    assert len(_ADMITTED) > 2000
    assert [str(f) for f in _ADMITTED if position(f) is None] == []


def test_positions_refused_by_the_op_filter_are_the_callers():
    assert position(torch.ops.aten._print.default).kind == CALLER


def test_positions_checked_ops_and_registered_checks_are_the_same():
    assert CHECKED_OPS == set(CHECKS)


def _packet_params() -> dict:
    """A packet's parameter names over all its overloads: an entry names arguments of some overload."""
    params: dict = {}
    for func in _ADMITTED:
        params.setdefault(func._schema.name, set()).update(a.name for a in func._schema.arguments)
    return params


@pytest.mark.parametrize("kind", [KERNEL, CHECKED, REFUSED])
def test_positions_named_arguments_are_parameters_of_the_op(kind):
    params = _packet_params()
    named = {
        (func._schema.name, arg) for func in _ADMITTED if position(func).kind == kind for arg in position(func).args
    }
    assert sorted(f"{op}: {arg}" for op, arg in named if arg not in params[op]) == []


@pytest.mark.parametrize(
    "name",
    [
        "fbgemm_linear_int8_weight.default",
        "fbgemm_pack_gemm_matrix_fp16.default",
        "_weight_int4pack_mm.default",
        "_convert_weight_to_int4pack.default",
        "mkldnn_linear.default",
        "to_mkldnn.default",
        "quantize_per_tensor.default",
        "_sparse_coo_tensor_with_dims_and_tensors.default",
        "_nested_view_from_buffer.default",
    ],
)
def test_positions_ops_reinterpreting_packed_or_opaque_tensors_are_refused(name):
    assert position(resolve_op(f"aten.{name}")).kind == REFUSED


# -- what replay does with each class


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_doc(str(tmp_path_factory.mktemp("base")))


def _load(tmp_path, d: Doc) -> md.Trace:
    (tmp_path / "t.json").write_text(json.dumps(d.d))
    return md.Trace.load(tmp_path / "t.json")


def _index_select(base, index) -> Doc:
    d = Doc(base)
    src, idx = const(d, torch.arange(12.0).reshape(3, 4)), const(d, index)
    out = d.tensor(d.next_id(), [3, len(index)])
    d.call("aten.index_select.default", [ref(src), 1, ref(idx)], {}, [ref(out)])
    d.d["output"] = ref(out)
    return d


def test_positions_refused_op_is_refused_before_anything_runs(tmp_path, base):
    d = Doc(base)
    x = d.leaf_index("args[1]")
    d.call("aten.mul_.Tensor", [ref(x), 0.0], {}, [ref(x)])
    state = const(d, torch.zeros(2, 30, dtype=torch.int64))
    quasi = const(d, torch.zeros(1, 2, dtype=torch.int64))
    d.call("aten._sobol_engine_draw.default", [ref(quasi), 3, ref(state), 1000, 0, None], {}, [])
    lin, x_, y = user_tensors()
    with pytest.raises(
        md.ReplayError, match=r"_sobol_engine_draw.default \(its argument 'sobolstate'\).*Nothing was run"
    ):
        md.replay(_load(tmp_path, d), (lin, x_, y))


def _unclassify(monkeypatch, op) -> None:
    """Make ``op`` look like one a newer torch adds: no class, where replay asks."""
    real = fences.position
    for module in (fences, index_checks):
        monkeypatch.setattr(module, "position", lambda f: None if f is op else real(f))


def test_positions_an_unclassified_op_is_refused_an_integer_tensor(tmp_path, base, monkeypatch):
    """Default deny: an op a newer torch adds, with no class, may not be handed integers."""
    _unclassify(monkeypatch, torch.ops.aten.index_select.default)
    with pytest.raises(md.ReplayError, match=r"index_select.default refused before running: its argument 'index' is a"):
        md.replay(_load(tmp_path, _index_select(base, torch.tensor([0, 2]))), user_tensors())


def test_positions_an_unclassified_op_on_floats_runs(tmp_path, base, monkeypatch):
    _unclassify(monkeypatch, torch.ops.aten.relu.default)
    assert md.replay(_load(tmp_path, Doc(base)), user_tensors()).ok


def test_positions_a_kernel_checked_op_raises_torchs_error_as_a_replay_error(tmp_path, base):
    with pytest.raises(
        md.ReplayError, match=r"index_select.default.*failed: RuntimeError: INDICES element is out of DATA bounds"
    ):
        md.replay(_load(tmp_path, _index_select(base, torch.tensor([0, 1 << 40]))), user_tensors())
