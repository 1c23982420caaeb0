"""md.to_meta on tensors, modules and pytrees."""

import pytest
import torch
from torch import nn

import metadispatch as md


def test_api_to_meta_module_is_a_new_module_and_copies_no_data():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}
    meta = md.to_meta(model, device="cuda")
    assert meta is not model
    assert all(isinstance(t, md.MetaTensor) and t.is_cuda for t in meta.state_dict(keep_vars=True).values())
    assert all(isinstance(p, nn.Parameter) for p in meta.parameters())
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == ptrs
    assert not any(isinstance(t, md.MetaTensor) for t in model.state_dict(keep_vars=True).values())
    out = meta(md.to_meta(torch.ones(2, 3), device="cuda"))
    assert out.shape == (2, 4) and out.device == torch.device("cuda:0")


def test_api_to_meta_keeps_tied_weights_tied():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    meta = md.to_meta(model)
    assert meta["emb"].weight is meta["head"].weight
    assert len(list(meta.parameters())) == 1


def test_api_to_meta_pytree_and_shared_storage():
    base = torch.arange(12.0).view(3, 4)
    out = md.to_meta({"a": base, "b": [base[1], 3]})
    assert out["b"][1] == 3
    assert out["a"].untyped_storage()._cdata == out["b"][0].untyped_storage()._cdata
    assert out["b"][0].storage_offset() == 4


def test_api_trace_of_meta_module_names_its_parameters():
    meta = md.to_meta(nn.Linear(3, 2))
    t = md.trace(meta, md.to_meta(torch.ones(1, 3)))
    assert sorted(leaf.name for leaf in t.leaves.values() if leaf.kind == "param") == ["bias", "weight"]


# The public API before the subpackages came (CONTRIBUTING.md, "What is
# public"): every name stays in __all__ and resolves, whatever moves inside.
PUBLIC_BEFORE_THE_LAYOUT = [
    "MetaTensor",
    "MetaMode",
    "Trace",
    "OpCall",
    "TensorMeta",
    "Leaf",
    "trace",
    "tracer",
    "to_meta",
    "register_meta",
    "unregister_meta",
    "diff",
    "testing",
    "flops",
    "register_flops",
    "unregister_flops",
    "memory",
    "LiveStorages",
    "module_table",
    "shape_log",
    "replay",
    "Replay",
    "Mismatch",
    "materialize",
    "MetaDispatchError",
    "UnsupportedOpError",
    "DataDependentError",
    "TraceFormatError",
    "UnsupportedFeatureError",
    "check",
    "checker",
    "Report",
    "MaterializeLimitError",
    "verify_rule",
    "RuleCheck",
]


def test_api_all_keeps_every_public_name_and_each_resolves():
    assert sorted(set(PUBLIC_BEFORE_THE_LAYOUT) - set(md.__all__)) == []
    assert [name for name in md.__all__ if not hasattr(md, name)] == []
    assert len(md.__all__) == len(set(md.__all__))


def test_api_dir_lists_the_public_names_and_the_subpackages():
    # the names load on first use (Note [Public names load on first use]),
    # dir() lists them all the same, and each is the object its module defines
    import importlib

    listed = dir(md)
    subpackages = ["analysis", "core", "debug", "execution", "ir", "rules", "testing", "tracing"]
    assert [n for n in md.__all__ + subpackages + ["__version__"] if n not in listed] == []
    # besides them only submodules (as many as have been imported: "cli" once
    # a test ran it); pytest's assertion rewriting adds "@py_builtins" and such
    others = [n for n in listed if n.isidentifier() and not n.startswith("__") and n not in md.__all__ + subpackages]
    assert [n for n in others if not isinstance(getattr(md, n), type(md))] == []
    assert {"_compat", "_rules", "errors"} <= set(others)
    for name in md.__all__:
        value = getattr(md, name)
        if not isinstance(value, type(md)):
            assert getattr(importlib.import_module(value.__module__), name) is value, name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        md.nonexistent  # noqa: B018


def test_api_version_comes_from_the_package_metadata():
    import importlib.metadata

    assert md.__version__ == importlib.metadata.version("metadispatch")
