"""md.checkpoint.check against what load_state_dict itself finds, on files written here."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import metadispatch as md
from tests.models import tied_llama


def _net():
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def test_check_finds_missing_and_unexpected_as_load_state_dict_does(tmp_path):
    state = _net().state_dict()
    del state["2.bias"]
    state["extra.weight"] = torch.ones(2)
    path = tmp_path / "m.pt"
    torch.save(state, path)
    with md.MetaMode():
        model = _net()
    found = md.checkpoint.check(model, path)
    want = _net().load_state_dict(torch.load(path, weights_only=True), strict=False)
    assert found.missing == tuple(want.missing_keys) == ("2.bias",)
    assert found.unexpected == tuple(want.unexpected_keys) == ("extra.weight",)
    assert not found.ok and not found.shape and not found.dtype


def test_check_finds_a_wrong_shape_and_a_dtype_on_a_meta_model(tmp_path):
    state = _net().state_dict()
    state["0.weight"] = torch.ones(3, 5)  # deliberately wrong
    state["2.weight"] = state["2.weight"].to(torch.bfloat16)
    path = tmp_path / "m.safetensors"
    save_file(state, path)
    with torch.device("meta"):
        model = _net()
    found = md.checkpoint.check(model, path)
    assert found.shape == (("0.weight", (3, 4), (3, 5)),)
    assert found.dtype == (("2.weight", torch.float32, torch.bfloat16),)
    with pytest.raises(RuntimeError, match=r"0\.weight.*torch.Size\(\[3, 5\]\)"):  # torch agrees
        _net().load_state_dict(load_file(path))
    assert found.lines()[0] == "shape: 0.weight: model [3, 4], checkpoint [3, 5]"


def test_check_tied_weights_saved_once_are_not_missing(tmp_path):
    tied_llama().save_pretrained(tmp_path)  # safetensors keeps one name of the tie
    with md.MetaMode():
        model = tied_llama()
    assert ("model.embed_tokens.weight", "lm_head.weight") in md.checkpoint.ties(model)
    stored = md.checkpoint.inspect(tmp_path).tensors
    assert "lm_head.weight" not in stored
    assert md.checkpoint.check(model, tmp_path).ok
    torch.save(tied_llama().state_dict(), tmp_path / "both.pt")  # both names, one storage
    assert md.checkpoint.check(model, tmp_path / "both.pt").ok


def test_check_finds_a_tie_stored_twice(tmp_path):
    state = {k: v.clone() for k, v in tied_llama().state_dict().items()}  # clones: two tensors
    save_file(state, tmp_path / "twice.safetensors")
    with md.MetaMode():
        model = tied_llama()
    found = md.checkpoint.check(model, tmp_path / "twice.safetensors")
    assert found.stored_twice == (("model.embed_tokens.weight", "lm_head.weight"),)
    # what that does: assign=True unties the model
    with torch.device("meta"):
        meta = tied_llama()
    meta.load_state_dict(state, assign=True)
    assert meta.lm_head.weight is not meta.model.embed_tokens.weight


def _llama_70b_on_meta():
    sizes = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
    with torch.device("meta"):
        return tied_llama(tie=False, **sizes, num_key_value_heads=8, vocab_size=128256).to(torch.bfloat16)


def _write_index(folder, shapes: dict, shards: int):
    """A sharded safetensors checkpoint: real headers, sparse bodies."""
    names = list(shapes)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for n in names[s::shards]:
            nbytes = 2 * int(torch.Size(shapes[n]).numel())
            header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[n] = file
        raw = json.dumps(header).encode()
        with open(folder / file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_check_a_70b_index_in_under_a_second(tmp_path):
    model = _llama_70b_on_meta()
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    shapes["lm_head.weight"] = (128256, 8192)
    shapes["model.layers.7.mlp.up_proj.weight"] = (28672, 8191)  # deliberately wrong
    _write_index(tmp_path, shapes, shards=30)
    start = time.perf_counter()
    found = md.checkpoint.check(model, tmp_path)
    elapsed = time.perf_counter() - start
    assert found.shape == (("model.layers.7.mlp.up_proj.weight", (28672, 8192), (28672, 8191)),)
    assert not found.missing and not found.unexpected and not found.dtype
    assert md.checkpoint.inspect(tmp_path).nbytes > 140e9  # 70B in bf16, read from headers
    assert elapsed < 1.0, elapsed  # the bound, for 723 keys in 30 shards
