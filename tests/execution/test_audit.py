"""md.audit after the loading paths people use, each finding checked against the model itself."""

import torch
from torch import nn

import metadispatch as md
from tests.models import tied_llama


def test_audit_names_what_a_partial_assign_left_on_meta():
    state = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).state_dict()
    del state["1.running_var"], state["0.bias"]
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    result = model.load_state_dict(state, strict=False, assign=True)
    found = md.audit(model)
    assert set(found.on_meta) == set(result.missing_keys) == {"0.bias", "1.running_var"}
    assert all(dict(model.state_dict()).get(n).is_meta for n in found.on_meta)


def test_audit_finds_the_tie_assign_true_breaks():
    eager = tied_llama()
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    with torch.device("meta"):
        model = tied_llama()
    model.load_state_dict(state, assign=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # what torch did
    assert md.audit(model).broken_ties == (("model.embed_tokens.weight", "lm_head.weight"),)
    model.tie_weights()
    assert md.audit(model).broken_ties == ()
    assert md.audit(eager).ok and md.audit(tied_llama(tie=False)).ok  # no tie declared, none broken


def test_audit_with_a_reference_finds_ties_by_identity():
    with md.MetaMode():
        reference = nn.ModuleDict({"a": nn.Linear(4, 4, bias=False), "b": nn.Linear(4, 4, bias=False)})
    reference["b"].weight = reference["a"].weight
    model = nn.ModuleDict({"a": nn.Linear(4, 4, bias=False), "b": nn.Linear(4, 4, bias=False)})
    assert md.audit(model, reference).broken_ties == (("a.weight", "b.weight"),)
    model["b"].weight = model["a"].weight
    assert md.audit(model, reference).ok


def test_audit_finds_buffers_to_empty_left_uninitialised():
    eager = tied_llama()
    with md.MetaMode():
        reference = tied_llama()
    with torch.device("meta"):
        model = tied_llama()
    model.to_empty(device="cpu")  # non-persistent buffers: whatever memory held
    model.load_state_dict(eager.state_dict())
    rotary = "model.rotary_emb.inv_freq"
    assert not torch.equal(dict(model.named_buffers())[rotary], dict(eager.named_buffers())[rotary])
    found = md.audit(model, reference)
    assert rotary in found.uninitialised and not found.on_meta
    assert md.audit(eager, reference).ok
    assert isinstance(reference.model.rotary_emb.inv_freq, md.MetaTensor)  # the reference is untouched


def test_audit_two_parameters_over_one_storage_are_a_broken_tie(tmp_path):
    def build():
        model = nn.ModuleDict({"emb": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
        model["head"].weight = model["emb"].weight
        return model

    torch.save(build().state_dict(), tmp_path / "m.pt")  # the tie stored once
    with torch.device("meta"):
        model = build()
    model.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True), assign=True)
    emb, head = model["emb"].weight, model["head"].weight
    assert emb.data_ptr() == head.data_ptr() and len(list(model.parameters())) == 2  # what torch did
    with md.MetaMode():
        reference = build()
    assert md.audit(model, reference).broken_ties == (("emb.weight", "head.weight"),)
