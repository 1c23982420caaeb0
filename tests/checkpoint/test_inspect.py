"""md.checkpoint.inspect against safetensors' and torch.load's own answers, on files written here."""

import json
import os
import pickle
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import metadispatch as md
from metadispatch.errors import CheckpointFormatError


def _state():
    base = torch.arange(24.0).view(4, 6)
    return {
        "w": torch.randn(4, 6),
        "h": torch.randn(3, 2).to(torch.bfloat16),
        "i": torch.arange(5),
        "flag": torch.tensor([True, False]),
        "u16": torch.arange(3).to(torch.uint16),  # a _rebuild_tensor_v3 dtype
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "view": base[1:, 2:],  # torch.save keeps the view: offset and strides
        "base": base,
    }


def _torch_answer(path, weights_only=True):
    loaded = torch.load(path, mmap=True, weights_only=weights_only)
    return {k: (tuple(v.shape), v.dtype, v.stride(), v.storage_offset()) for k, v in loaded.items()}


@pytest.mark.parametrize("protocol", [2, 5])  # torch.save's default, and frames with STACK_GLOBAL
def test_inspect_torch_zip_matches_torch_load(tmp_path, protocol):
    path = tmp_path / "m.pt"
    torch.save(_state(), path, pickle_protocol=protocol)
    got = md.checkpoint.inspect(path)
    assert got.format == "torch"
    # torch's weights_only reader knows no FRAME opcode (protocol 4+); the file is our own
    want = _torch_answer(path, weights_only=protocol == 2)
    assert {k: (e.shape, e.dtype, e.stride, e.offset) for k, e in got.tensors.items()} == want
    assert got.tensors["view"].storage == got.tensors["base"].storage  # one storage, two names
    assert got.tensors["view"].nbytes == 3 * 4 * 4
    assert got.nbytes == sum(t.untyped_storage().nbytes() for k, t in _state().items() if k != "view")


def test_inspect_safetensors_matches_safe_open(tmp_path):
    state = {k: v.contiguous() for k, v in _state().items() if k != "base"}
    path = tmp_path / "m.safetensors"
    save_file(state, path, metadata={"format": "pt"})
    got = md.checkpoint.inspect(path)
    with safe_open(path, framework="pt") as f:
        want = {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}
        assert got.metadata == f.metadata()
    assert {k: (e.shape, e.dtype) for k, e in got.tensors.items()} == want
    assert {k: e.nbytes for k, e in got.tensors.items()} == {k: v.nbytes for k, v in state.items()}


def test_inspect_nested_torch_checkpoint_names_tensors_by_path(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)
    got = md.checkpoint.inspect(path).tensors
    loaded = torch.load(path, weights_only=True)
    assert got["model.weight"].shape == (2, 3)
    assert got["optimizer.state.0.exp_avg"].shape == tuple(loaded["optimizer"]["state"][0]["exp_avg"].shape)
    assert "epoch" not in got


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_inspect_sharded_index_matches_the_shards(tmp_path, fmt):
    state = {f"layer{i}.weight": torch.randn(i + 1, 4) for i in range(5)}
    weight_map = {}
    for shard, names in enumerate(
        (["layer0.weight", "layer1.weight"], ["layer2.weight", "layer3.weight", "layer4.weight"])
    ):
        file = f"model-{shard:05d}.{'safetensors' if fmt == 'safetensors' else 'bin'}"
        part = {n: state[n] for n in names}
        save_file(part, tmp_path / file) if fmt == "safetensors" else torch.save(part, tmp_path / file)
        weight_map.update(dict.fromkeys(names, file))
    name = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / name).write_text(json.dumps({"metadata": {"total_size": 60}, "weight_map": weight_map}))
    got = md.checkpoint.inspect(tmp_path)  # the directory finds its index
    assert got.format == fmt and len(got.files) == 2
    assert {k: e.shape for k, e in got.tensors.items()} == {k: tuple(v.shape) for k, v in state.items()}
    assert {e.file for e in got.tensors.values()} == set(weight_map.values())


class _Counting:
    """An ``open`` that counts the bytes read through it."""

    def __init__(self):
        self.read = 0

    def __call__(self, path, mode="rb"):
        f = open(path, mode)  # noqa: SIM115 (returned)
        counter = self
        inner_read, inner_readinto = f.read, f.readinto

        class Wrapped:
            def __getattr__(self, name):
                return getattr(f, name)

            def read(self, n=-1):
                data = inner_read(n)
                counter.read += len(data)
                return data

            def readinto(self, b):
                n = inner_readinto(b)
                counter.read += n or 0
                return n

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return Wrapped()


def test_inspect_reads_only_headers_of_files_of_gibibytes(tmp_path):
    # safetensors: a real header and a sparse 4 GiB body
    big = 1 << 31  # bf16 elements: 4 GiB
    header = json.dumps({"big": {"dtype": "BF16", "shape": [big], "data_offsets": [0, 2 * big]}}).encode()
    st = tmp_path / "big.safetensors"
    with open(st, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 2 * big)
    # torch.save of a 3 GiB tensor: skip_data writes the records as holes
    hole = tmp_path / "hole"
    hole.write_bytes(b"")
    os.truncate(hole, 3 << 30)
    pt = tmp_path / "big.pt"
    with torch.serialization.skip_data():
        torch.save({"big": torch.from_file(str(hole), shared=True, size=3 << 29, dtype=torch.float16)}, pt)
    for path, overhead in ((st, 8 + len(header)), (pt, os.path.getsize(pt) - (3 << 30))):
        counting = _Counting()
        got = md.checkpoint.inspect(path, opener=counting)
        assert os.path.getsize(path) > 3 << 30
        assert got.tensors["big"].nbytes >= 3 << 30
        # every byte outside the tensor data at most, plus the 2 bytes that tell the format
        assert counting.read <= overhead + 2 + 64 * 1024, (path.name, counting.read)
    with safe_open(st, framework="pt") as f:
        assert tuple(f.get_slice("big").get_shape()) == md.checkpoint.inspect(st).tensors["big"].shape
    assert _torch_answer(pt)["big"][:2] == (md.checkpoint.inspect(pt).tensors["big"].shape, torch.float16)


def _safetensors(tmp_path, header, body=16):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(body))
    return path


@pytest.mark.parametrize(
    ("header", "entry", "says"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, "a", "span 12 bytes"),
        ({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, "a", "outside"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, "a", "dtype 'Q4'"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "a", "non-negative"),
        ({"a": {"dtype": "F32", "shape": [2]}}, "a", "data_offsets"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            "b",
            "overlaps",
        ),
        (b'{"a": 1, "a": 2}', "a", "twice"),
        (b"[" * 100000, "", "not JSON"),
    ],
)
def test_inspect_refuses_a_bad_safetensors_header_naming_the_entry(tmp_path, header, entry, says):
    path = _safetensors(tmp_path, header)
    with pytest.raises(CheckpointFormatError, match=says) as e:
        md.checkpoint.inspect(path)
    assert e.value.entry == entry and e.value.path == str(path)
    with pytest.raises(Exception):  # noqa: B017  (safetensors refuses it too)
        safe_open(path, framework="pt").keys()


def test_inspect_refuses_a_header_length_past_the_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes((1 << 60).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointFormatError, match="header length"):
        md.checkpoint.inspect(path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _zip_with_pickle(tmp_path, obj):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = pickle.dumps(obj, protocol=2) if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return bad


def test_inspect_runs_no_pickle_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = _zip_with_pickle(tmp_path, {"w": _Evil()})
    with pytest.raises(CheckpointFormatError, match="system") as e:
        md.checkpoint.inspect(bad)
    assert "system" in e.value.entry
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(pickle.UnpicklingError):  # torch's weights_only refuses it as well
        torch.load(bad, weights_only=True)


def test_inspect_refuses_a_tensor_past_its_storage(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(4)}, path)
    with zipfile.ZipFile(path) as z:
        names = {i.filename: z.read(i) for i in z.infolist()}
    pkl = next(n for n in names if n.endswith("data.pkl"))
    record = next(n for n in names if n.endswith("/data/0"))
    names[record] = names[record][:8]  # storage of 4 floats, record of 2
    with zipfile.ZipFile(path, "w") as z:
        for n, data in names.items():
            z.writestr(n, data)
    with pytest.raises(CheckpointFormatError, match="claims 16 bytes, its record holds 8") as e:
        md.checkpoint.inspect(path)
    assert e.value.entry == "w"
    assert pkl


def test_inspect_refuses_legacy_and_missing_files(tmp_path):
    legacy = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointFormatError):
        md.checkpoint.inspect(legacy)
    with pytest.raises(CheckpointFormatError, match="cannot be opened"):
        md.checkpoint.inspect(tmp_path / "none.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x"}}))
    with pytest.raises(CheckpointFormatError, match="plain file name") as e:
        md.checkpoint.inspect(tmp_path)
    assert e.value.entry == "../x"


class _StoragePickler(pickle.Pickler):
    """Writes persistent ids as torch.save does, from ``("pid", tuple)`` markers."""

    def persistent_id(self, obj):
        return obj[1] if isinstance(obj, tuple) and obj[:1] == ("pid",) else None


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ({"w": {1, 2}}, "'__builtin__.set'"),  # protocol 2 spells a set as a call of set
        ({"w": eval}, "'__builtin__.eval'"),
        ({"w": ("pid", ("storage", "FloatStorage", "0", "cpu", 4))}, "not a torch.save storage"),
        ({"w": ("pid", ("storage", torch.FloatStorage, "0", "cpu", -1))}, "not a torch.save storage"),
        ({(1, 2): 3}, "dict key of type tuple"),
    ],
)
def test_inspect_refuses_pickles_torch_save_does_not_write(tmp_path, obj, says):
    import io

    buf = io.BytesIO()
    _StoragePickler(buf, protocol=2).dump(obj)
    bad = _zip_with_pickle(tmp_path, None)
    with zipfile.ZipFile(bad) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(bad, "w") as z:
        for name, data in records.items():
            z.writestr(name, buf.getvalue() if name.endswith("data.pkl") else data)
    with pytest.raises(CheckpointFormatError, match=says):
        md.checkpoint.inspect(bad)


def _mutations(raw: bytes, span: int, seeds: int):
    import random

    for seed in range(seeds):
        r = random.Random(seed)
        data = bytearray(raw)
        for _ in range(r.randint(1, 4)):
            data[r.randrange(span)] = r.randrange(256)
        yield seed, bytes(data)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_inspect_corrupted_headers_raise_only_its_error(tmp_path, fmt):
    """Bytes of the pickle or the header changed at random: inspect answers or raises
    CheckpointFormatError, never anything else (every seed's failure is listed)."""
    state = {"a": torch.ones(3, 2), "b": torch.arange(4)}
    good, bad = tmp_path / "good", tmp_path / "bad"
    if fmt == "torch":
        torch.save({**state, "nested": [state["a"], {"c": torch.zeros(2).bfloat16()}], "n": 3}, good)
        with zipfile.ZipFile(good) as z:
            records = {i.filename: z.read(i) for i in z.infolist()}
        pkl = next(n for n in records if n.endswith("data.pkl"))
        cases = _mutations(records[pkl], len(records[pkl]), 400)
    else:
        save_file(state, good)
        raw = good.read_bytes()
        cases = _mutations(raw, 8 + int.from_bytes(raw[:8], "little"), 400)
    other = []
    for seed, data in cases:
        if fmt == "torch":
            with zipfile.ZipFile(bad, "w") as z:
                for name, record in records.items():
                    z.writestr(name, data if name == pkl else record)
        else:
            bad.write_bytes(data)
        try:
            md.checkpoint.inspect(bad)
        except CheckpointFormatError:
            pass
        except Exception as e:  # noqa: BLE001  (what the test is looking for)
            other.append(f"seed {seed}: {type(e).__name__}: {e}")
    assert not other, other
