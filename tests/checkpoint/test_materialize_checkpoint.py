"""md.materialize(model, checkpoint=path) against load_state_dict on an eagerly built model."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import metadispatch as md
from metadispatch.errors import CheckpointMismatchError, MetaDispatchError
from tests.models import tied_llama


def _net():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))


def _assert_same(got: nn.Module, want: nn.Module):
    a, b = dict(got.named_buffers()), dict(want.named_buffers())
    a |= dict(got.named_parameters())
    b |= dict(want.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert type(a[name]) is type(b[name]) and a[name].dtype == b[name].dtype, name
        assert a[name].stride() == b[name].stride() and torch.equal(a[name], b[name]), name
        assert a[name].requires_grad == b[name].requires_grad, name


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_materialize_checkpoint_tiny_llama_tied_as_load_state_dict(tmp_path, shard):
    torch.manual_seed(1)
    tied_llama().save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))  # one name of the tie
    assert (len(md.checkpoint.inspect(tmp_path).files) > 1) == (shard is not None)
    torch.manual_seed(2)  # the checkpoint, not the seed, decides the weights
    with md.MetaMode():
        model = tied_llama()
    md.materialize(model, checkpoint=tmp_path)
    torch.manual_seed(3)
    eager = tied_llama()
    eager.load_state_dict(_loaded(tmp_path), strict=False)
    _assert_same(model, eager)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie kept
    assert torch.equal(model.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)  # non-persistent
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(ids).logits, eager(ids).logits)


def _loaded(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_materialize_checkpoint_batchnorm_buffers_bit_exact(tmp_path, fmt):
    source = _net()
    source.train()(torch.randn(8, 3, 4, 4))  # running stats and num_batches_tracked move
    state = source.state_dict()
    state["4.weight"] = state["4.weight"].to(torch.bfloat16)  # load_state_dict casts it back
    path = tmp_path / f"m.{fmt}"
    torch.save(state, path) if fmt == "pt" else save_file(state, path)
    with md.MetaMode():
        model = _net()
    md.materialize(model, checkpoint=path)
    eager = _net()
    eager.load_state_dict(state)
    _assert_same(model, eager)
    assert model[1].num_batches_tracked.item() == 1


def test_materialize_checkpoint_plain_meta_and_a_tie_stored_twice(tmp_path):
    state = {k: v.clone() for k, v in tied_llama().state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])  # stored twice, different
    save_file(state, tmp_path / "twice.safetensors")
    with md.MetaMode():
        model = tied_llama()
    md.materialize(model, checkpoint=tmp_path / "twice.safetensors")
    eager = tied_llama()
    eager.load_state_dict(state)  # copies both into the one tensor: the last wins
    _assert_same(model, eager)
    with torch.device("meta"):
        plain = tied_llama()
    with pytest.raises(MetaDispatchError, match="inv_freq"):  # a non-persistent buffer nothing computes
        md.materialize(plain, checkpoint=tmp_path / "twice.safetensors")
    assert plain.lm_head.weight.is_meta  # nothing was loaded


def test_materialize_checkpoint_refuses_a_wrong_shape_before_loading(tmp_path):
    state = _net().state_dict()
    state["0.weight"] = torch.ones(4, 3, 2, 2)
    torch.save(state, tmp_path / "m.pt")
    with md.MetaMode():
        model = _net()
    with pytest.raises(CheckpointMismatchError, match=r"0\.weight") as e:
        md.materialize(model, checkpoint=tmp_path / "m.pt")
    assert e.value.findings.shape[0][0] == "0.weight"
    assert isinstance(model[0].weight, md.MetaTensor)
    del state["0.weight"]
    torch.save(state, tmp_path / "m.pt")
    with pytest.raises(CheckpointMismatchError, match="missing: 0.weight"):
        md.materialize(model, checkpoint=tmp_path / "m.pt")
    torch.manual_seed(0)
    with md.MetaMode():
        model = _net()
    md.materialize(model, checkpoint=tmp_path / "m.pt", strict=False)  # the missing one replayed
    torch.manual_seed(0)
    eager = _net()
    eager.load_state_dict(state, strict=False)
    _assert_same(model, eager)


def test_materialize_checkpoint_holds_one_checkpoint_tensor_at_a_time(tmp_path, monkeypatch):
    import weakref

    import metadispatch.execution.materialize as materialize_module

    state = _net().state_dict()
    path = tmp_path / "m.safetensors"  # a torch.save file is mmap'd: its pages are the page cache's
    save_file(state, path)
    alive_at_next = []
    real_stream = materialize_module.stream

    def watched(contents, names):
        earlier: list = []
        for name, value in real_stream(contents, names):
            alive_at_next.append(sum(r() is not None for r in earlier))
            earlier.append(weakref.ref(value))
            yield name, value
            del value

    monkeypatch.setattr(materialize_module, "stream", watched)
    with md.MetaMode():
        model = _net()
    md.materialize(model, checkpoint=path)
    assert len(alive_at_next) == len(state)
    assert max(alive_at_next) == 0  # each tensor read is gone when the next is read
