"""Checkpoints and modules built under a MetaMode, differential against torch's meta device and eager.

Note [Copying real values into a MetaTensor outside a mode] (tensor/lostcopy.py)
and Note [torch.load inside a MetaMode] (mode/realcode.py).
"""

import io
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import metadispatch as md


def _build():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))


def _checkpoint():
    torch.manual_seed(123)
    model = _build()
    model[1].running_mean.uniform_()  # a buffer with values of its own
    return model.state_dict()


def _saved(sd) -> io.BytesIO:
    f = io.BytesIO()
    torch.save(sd, f)
    f.seek(0)
    return f


def _messages(load):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load()
    return result, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _meta_built():
    with md.MetaMode():
        return _build()


def test_load_state_dict_into_metatensors_warns_per_key_as_the_meta_device_does():
    sd = _checkpoint()
    on_meta, ours = _build().to("meta"), _meta_built()
    expected, torch_words = _messages(lambda: on_meta.load_state_dict(sd))
    result, words = _messages(lambda: ours.load_state_dict(sd))
    assert result == expected  # "All keys matched" either way: no key is missing
    assert len(words) == len(torch_words) == len(sd)  # one per key, the counter buffer too
    for ours_w, torch_w in zip(words, torch_words, strict=True):
        key = torch_w.split(":")[0]
        assert ours_w.startswith(f"{key}: copying from a non-meta parameter in the checkpoint to")
        assert "assign=True" in ours_w and "no-op" in ours_w
    # both still hold no data
    assert all(isinstance(v, md.MetaTensor) for v in ours.state_dict().values())
    assert all(v.is_meta for v in on_meta.state_dict().values())


def test_load_state_dict_into_metatensors_raises_when_warnings_are_errors():
    sd = _checkpoint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning):
            _build().to("meta").load_state_dict(sd)
        with pytest.raises((UserWarning, RuntimeError), match="no-op"):
            _meta_built().load_state_dict(sd)


def test_load_state_dict_assign_holds_the_checkpoints_tensors():
    sd = _checkpoint()
    on_meta, ours = _build().to("meta"), _meta_built()
    _, torch_words = _messages(lambda: on_meta.load_state_dict(sd, assign=True))
    _, words = _messages(lambda: ours.load_state_dict(sd, assign=True))
    assert words == torch_words == []
    for module in (on_meta, ours):
        got = module.state_dict()
        assert all(type(got[k]) is torch.Tensor and got[k].data_ptr() == sd[k].data_ptr() for k in sd)
    assert [type(p) for p in ours.parameters()] == [type(p) for p in on_meta.parameters()]
    x = torch.randn(2, 3, 3, 3)
    assert torch.equal(ours.eval()(x), on_meta.eval()(x))


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("source", ["torch.load", "in scope"])
def test_load_state_dict_inside_the_mode_materializes_the_checkpoint(assign, source):
    sd = _checkpoint()
    f = _saved(sd)
    with md.MetaMode():
        model = _build()
        model.load_state_dict(torch.load(f) if source == "torch.load" else sd, assign=assign)
    real = md.materialize(model)
    eager = _build()
    eager.load_state_dict(sd, assign=assign)
    got, want = real.state_dict(), eager.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    assert [type(p) for p in real.parameters()] == [type(p) for p in eager.parameters()]


def test_load_state_dict_torch_load_inside_the_mode_gives_eagers_real_tensors():
    sd = _checkpoint()
    eager, f = torch.load(_saved(sd)), _saved(sd)
    with md.MetaMode():
        loaded = torch.load(f)
    assert list(loaded) == list(eager)
    assert all(type(loaded[k]) is torch.Tensor and torch.equal(loaded[k], eager[k]) for k in eager)


def test_load_state_dict_torch_load_inside_the_mode_after_safetensors_was_imported():
    # safetensors' load(data) once replaced torch.load's original in the
    # patches' table: with safetensors.torch imported, torch.load(f) inside a
    # mode raised "load() takes 1 positional argument but 2 were given".
    pytest.importorskip("safetensors.torch")
    sd = _checkpoint()
    f = _saved(sd)
    with md.MetaMode():
        loaded = torch.load(f, map_location="cpu")
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_load_state_dict_torch_load_inside_a_trace_leaves_the_model_as_it_was():
    sd = _checkpoint()
    torch.manual_seed(0)
    model = _build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    f = _saved(sd)

    def step(x):
        f.seek(0)
        model.load_state_dict(torch.load(f))
        return model.eval()(x)

    x = torch.randn(2, 3, 3, 3)
    t = md.trace(step, x)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    eager_model = _build()
    eager_model.load_state_dict(sd)
    result = md.replay(t, (x,), module=model)
    assert result.ok, result
    assert torch.equal(result.output, eager_model.eval()(x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_load_state_dict_logical_gpu_checkpoint_loads_with_map_location_cuda():
    sd = _checkpoint()
    f = _saved(sd)
    with pytest.raises(RuntimeError):  # eager, on this host
        torch.load(_saved(sd), map_location="cuda")
    with md.MetaMode(device="cuda"):
        model = _build()
        model.load_state_dict(torch.load(f, map_location="cuda"))
        assert model[0].weight.device == torch.device("cuda", 0)
    real = md.materialize(model)
    assert all(torch.equal(real.state_dict()[k].cpu(), v) for k, v in sd.items())


def test_load_state_dict_a_checkpoint_past_const_limit_is_kept_whole():
    torch.manual_seed(5)
    sd = nn.Linear(128, 64).state_dict()  # 8,192 weights: past the default const_limit of 4,096
    f = _saved(sd)
    with md.MetaMode():
        model = nn.Linear(128, 64)
        model.load_state_dict(torch.load(f))
    real = md.materialize(model)
    assert torch.equal(real.weight, sd["weight"]) and torch.equal(real.bias, sd["bias"])
    # a state dict from the caller's scope is a constant like any other: past
    # const_limit, materialize refuses rather than make the values up
    with md.MetaMode():
        model = nn.Linear(128, 64)
        model.load_state_dict(sd)
    with pytest.raises(md.MetaDispatchError, match="const_limit"):
        md.materialize(model)


@pytest.mark.parametrize("reader", ["safe_open", "load_file", "load"])
def test_load_state_dict_safetensors_inside_the_mode_materializes_the_checkpoint(reader, tmp_path):
    # Note [Tensors made from bytes inside a MetaMode]: safe_open (transformers'
    # from_pretrained) is bound where no patch reaches it; its torch.asarray of
    # the file's bytes is made for real.
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    torch.manual_seed(6)
    sd = {k: v.contiguous() for k, v in nn.Linear(128, 64).state_dict().items()}
    sd["bias"] = sd["bias"].to(torch.bfloat16)
    path = tmp_path / "m.safetensors"
    st.save_file(sd, path)
    with md.MetaMode():
        if reader == "safe_open":
            with safe_open(path, framework="pt") as f:
                loaded = {k: f.get_tensor(k) for k in f.keys()}
        elif reader == "load_file":
            loaded = st.load_file(path)
        else:
            loaded = st.load(path.read_bytes())
        model = nn.Linear(128, 64, dtype=torch.bfloat16)
        model.load_state_dict(loaded)
    real = md.materialize(model)
    assert torch.equal(real.weight, sd["weight"].to(torch.bfloat16)) and torch.equal(real.bias, sd["bias"])


_SAFE_OPEN_CUDA = """
import torch, metadispatch as md
from safetensors import safe_open
with md.MetaMode(device="cuda"):
    with safe_open({path!r}, framework="pt", device="cuda") as f:
        try:
            f.get_tensor("weight")
        except md.UnsupportedFeatureError as e:
            print("refused:", e)
"""


def test_load_state_dict_safe_open_onto_a_logical_gpu_is_refused_not_a_segfault(tmp_path):
    # Note [A pinned buffer's address] in mode/swap.py: safetensors reads a
    # tensor for "cuda" into a pinned torch.empty through its data_ptr(), 0
    # for a MetaTensor; the write killed the process.  In a subprocess, so
    # that a segfault fails this test rather than pytest.
    st = pytest.importorskip("safetensors.torch")
    path = tmp_path / "m.safetensors"
    st.save_file(nn.Linear(4, 3).state_dict(), path)
    run = subprocess.run(
        [sys.executable, "-c", _SAFE_OPEN_CUDA.format(path=str(path))], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: Tensor.data_ptr() of a torch.empty(..., pin_memory=True) MetaTensor (f32[3, 4])" in run.stdout
    assert "safe_open(device='cuda')" in run.stdout and "device='cpu'" in run.stdout


def test_load_state_dict_safe_open_on_the_cpu_stands_in_on_a_logical_gpu(tmp_path):
    # what the refusal above suggests: the checkpoint's tensors, as eager reads them, on the mode's device
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    path = tmp_path / "m.safetensors"
    st.save_file(nn.Linear(4, 3).state_dict(), path)
    with safe_open(path, framework="pt", device="cpu") as f:
        eager = {k: f.get_tensor(k) for k in f.keys()}
    with md.MetaMode(device="cuda"), safe_open(path, framework="pt", device="cpu") as f:
        loaded = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: (v.shape, v.dtype) for k, v in loaded.items()} == {k: (v.shape, v.dtype) for k, v in eager.items()}
    assert {v.device for v in loaded.values()} == {torch.device("cuda:0")}
