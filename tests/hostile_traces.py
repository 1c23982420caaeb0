"""A corpus of hostile trace files, and the checks each must pass.

``write_corpus(directory, outside)`` writes one file per attack, each named
``<class>-<n>-<what>`` with what must happen to it:

- ``load``: ``md.Trace.load`` raises TraceFormatError;
- ``replay``: loading works, replay raises a ReplayError (a write to a
  caller's tensor, a kernel that fails);
- ``budget``: replay raises BudgetExceededError before running anything;
- ``safe``: loading and replay succeed or raise a MetaDispatchError, and
  nothing else happens (payloads in names stay names, legitimate writes go
  to copies).

Every file, whatever its class, must leave no marker file (payloads try to
create ``outside/pwned*``), write no file outside the corpus directory, leave
the caller's tensors unchanged and import no module.  ``check(directory)``
runs in a child process under an address-space limit (``python
tests/hostile_traces.py check DIR``) and prints one JSON line per file;
``tests/test_hostile.py`` runs it.  ``python tests/hostile_traces.py write
DIR OUTSIDE`` writes the corpus by hand.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import sys

CLASSES = ("load", "replay", "budget", "safe")
BIG = 1 << 40  # bytes no default budget allows


# -- the base trace and edits to it


def base_doc(tmp: str) -> dict:
    """A small trace of ``(lin(x) + y).relu().sum()`` as a document."""
    import metadispatch as md

    lin, x, y = user_tensors()
    path = os.path.join(tmp, "base.json")
    md.trace(_fn, lin, x, y).save(path)
    with open(path) as f:
        doc = json.load(f)
    os.unlink(path)
    return doc


def _fn(m, x, y):
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


def _t(i: int) -> dict:
    return {"t": i}


# -- the corpus


def write_corpus(directory: str, outside: str) -> list:
    """Write every hostile file into ``directory``; return their names."""
    base = base_doc(directory)
    files: list = []

    def put(cls: str, what: str, doc=None, raw: bytes | None = None) -> None:
        assert cls in CLASSES
        name = f"{cls}-{len(files):03d}-{what}.json"
        data = raw if raw is not None else json.dumps(doc).encode()
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
        files.append(name)

    marker = os.path.join(outside, "pwned")
    payloads = [
        f"x=__import__('os').system('touch {marker}0') or 1",
        f"a\nopen({marker + '1'!r}, 'w')\nb",
        f"y, **{{}}); open({marker + '2'!r}, 'w'); (",
        f"self=__import__('builtins').exec(\"open({marker + '3'!r},'w')\")",
        "λ",  # an identifier, but not a parameter
        "\x1b[2Jother",
        "other" + " " * 3,
        "__class__",
    ]
    _code(put, base, payloads, marker)
    _effects(put, base, marker)
    _writes(put, base)
    _dos(put, base, directory)
    _malformed(put, base)
    _streams(put, base)
    _combined(put, base, payloads, marker)
    # A FIFO and a link to a device must be refused without blocking.
    fifo = os.path.join(directory, f"load-{len(files):03d}-fifo.json")
    os.mkfifo(fifo)
    files.append(os.path.basename(fifo))
    dev = os.path.join(directory, f"load-{len(files):03d}-dev-zero.json")
    os.symlink("/dev/zero", dev)
    files.append(os.path.basename(dev))
    sub = os.path.join(directory, f"load-{len(files):03d}-directory.json")
    os.mkdir(sub)
    files.append(os.path.basename(sub))
    return files


def _code(put, base, payloads, marker) -> None:
    """Names from the file pasted into code: kwargs, ops, enums, modules."""
    for p in payloads:
        d = Doc(base)
        d.d["calls"]["kwargs"][-1] = {p: 1}
        put("load", "kwarg-name", d.d)
    for op in [
        "__import__('os').system('x')",
        "os.system.default",
        "builtins.eval.default",
        "aten.mm.default; import os",
        "aten.__class__.default",
        "torch._C.default",
        "aten.mm.__call__",
        "ops.load_library.default",
        "aten..default",
        "aten.mm.default\n",
        "a" * 100000,
        "sys.modules.default",
    ]:
        d = Doc(base)
        d.d["ops"][0] = op
        put("load", "op-name", d.d)
    for tag, name in [
        ("dtype", "onnx"),
        ("dtype", "_C"),
        ("dtype", "nn"),
        ("layout", "distributed"),
        ("memory_format", "hub"),
        ("dtype", "__builtins__"),
        ("device", "onnx"),
        ("device", "cuda:99999999"),
        ("device", "cpu:-1"),
        ("memory_format", "jit"),
        ("layout", "_dynamo"),
        ("dtype", "quantization"),
    ]:
        d = Doc(base)
        d.d["output"] = {tag: name}
        put("load", f"enum-{tag}", d.d)
    d = Doc(base)
    d.d["strings"][d.d["tensors"]["dtype"][0]] = "onnx"
    put("load", "tensor-dtype-import", d.d)
    d = Doc(base)
    d.d["strings"][d.d["tensors"]["device"][0]] = "export"
    put("load", "tensor-device-import", d.d)
    # Payloads in module and leaf names load -- they are data -- and must
    # stay data in the printed trace, the repro snippet and the report.
    for p in [
        f"fc\nopen({marker + '4'!r}, 'w')",
        "\x1b]0;owned\x07\x1b[31mred",
        "\u202eevil",
        f"x'); open({marker + '5'!r}, 'w'); ('",
    ]:
        d = Doc(base)
        d.d["calls"]["module"] = [d.s(p)] * len(d.d["calls"]["module"])
        d.d["modules"][p] = p
        put("safe", "module-name", d.d)
        d = Doc(base)
        d.d["calls"]["note"] = [d.s(p)] * len(d.d["calls"]["note"])
        put("safe", "note", d.d)


def _effects(put, base, marker) -> None:
    """Ops with effects outside their tensors."""
    cases = [
        ("aten.from_file.default", [marker + "6", True, 16], {}),
        ("aten.from_file.default", [marker + "7"], {"shared": True, "size": 4}),
        ("aten._print.default", ["hello"], {}),
        ("aten._assert_async.msg", None, {}),
        ("aten._assert_scalar.default", [0, "boom"], {}),
        ("aten.sym_constrain_range.default", [1], {"min": 0}),
        ("aten._cufft_clear_plan_cache.default", [0], {}),
        ("profiler._record_function_enter.default", ["x", None], {}),
        ("aten._backward.default", None, {}),
        ("aten.record_stream.default", None, {}),
        ("quantized.add.default", None, {}),
        ("mkldnn._is_mkldnn_acl_supported.default", [], {}),
        ("c10d.barrier.default", None, {}),
        ("_c10d_functional.wait_tensor.default", None, {}),
        ("inductor.accumulate_grad_.default", None, {}),
        ("aten.set_.source_Storage", None, {}),
    ]
    for op, args, kwargs in cases:
        d = Doc(base)
        x = d.leaf_index("args[1]")
        d.call(op, args if args is not None else [_t(x)], kwargs, [])
        put("load", "effect-" + op.split(".")[1], d.d)


def _writes(put, base) -> None:
    """Calls aimed at the caller's tensors."""

    def with_calls(calls, cls="replay"):
        d = Doc(base)
        x, w = d.leaf_index("args[1]"), d.leaf_index("weight")
        nid = d.next_id()
        for op, args, kwargs, outs in calls(d, x, w, nid):
            d.call(op, args, kwargs, outs)
        return d.d

    # By keyword, so that position 0 looks unwritten.
    put(
        "safe",
        "self-keyword",
        with_calls(lambda d, x, w, n: [("aten.add_.Tensor", [], {"self": _t(x), "other": 1}, [_t(x)])]),
    )
    put(
        "safe",
        "self-keyword-param",
        with_calls(lambda d, x, w, n: [("aten.mul_.Tensor", [], {"self": _t(w), "other": 0}, [_t(w)])]),
    )
    # A view given a false storage number, then written.
    put(
        "safe",
        "lying-storage",
        with_calls(
            lambda d, x, w, n: [
                ("aten.view.default", [_t(x), [8]], {}, [_t(d.tensor(n, [8], storage=99999))]),
                (
                    "aten.fill_.Scalar",
                    [_t(d.tensor(n, [8], storage=99999)), 7.0],
                    {},
                    [_t(d.tensor(n, [8], storage=99999))],
                ),
            ]
        ),
    )
    # set_ onto the caller's tensor, then written: a legitimate pattern.
    put(
        "safe",
        "set-then-write",
        with_calls(
            lambda d, x, w, n: [
                ("aten.empty.memory_format", [[0]], {}, [_t(d.tensor(n, [0]))]),
                ("aten.set_.source_Tensor", [_t(d.tensor(n, [0])), _t(x)], {}, [_t(d.tensor(n, [2, 4]))]),
                ("aten.add_.Tensor", [_t(d.tensor(n, [2, 4])), 1], {}, [_t(d.tensor(n, [2, 4]))]),
            ]
        ),
    )
    put("safe", "set-caller", with_calls(lambda d, x, w, n: [("aten.set_.source_Tensor", [_t(x), _t(w)], {}, [_t(x)])]))
    # Ops whose schema hides an alias: only the guard sees these.
    for op in ["aten.type_as.default", "aten._unsafe_view.default"]:
        put(
            "replay" if op.endswith("type_as.default") else "safe",
            "hidden-alias-" + op.split(".")[1],
            with_calls(
                lambda d, x, w, n, op=op: [
                    (op, [_t(x), _t(x) if "type_as" in op else [2, 4]], {}, [_t(d.tensor(n, [2, 4]))]),
                    ("aten.mul_.Tensor", [_t(d.tensor(n, [2, 4])), 3], {}, [_t(d.tensor(n, [2, 4]))]),
                ]
            ),
        )
    for op, args, _kwargs in [
        ("aten.copy_.default", "x_from_w", {}),
        ("aten.add.out", "out", {}),
        ("aten.index_put_.default", "index_put", {}),
        ("aten.resize_.default", "resize", {}),
        ("aten.as_strided_.default", "as_strided", {}),
        ("aten.zero_.default", "zero", {}),
        ("aten._foreach_add_.Scalar", "foreach", {}),
        ("aten.detach_.default", "detach", {}),
        ("aten.t_.default", "t", {}),
    ]:

        def calls(d, x, w, n, op=op, args=args):
            if args == "x_from_w":
                return [
                    ("aten.zeros.default", [[2, 4]], {}, [_t(d.tensor(n, [2, 4]))]),
                    (op, [_t(x), _t(d.tensor(n, [2, 4]))], {}, [_t(x)]),
                ]
            if args == "out":
                return [(op, [_t(w), 1.0], {"out": _t(x)}, [_t(x)])]
            if args == "index_put":
                return [
                    ("aten.zeros.default", [[1]], {"dtype": {"dtype": "int64"}}, [_t(d.tensor(n, [1], dtype="int64"))]),
                    (op, [_t(x), [_t(d.tensor(n, [1], dtype="int64"))], _t(x)], {}, [_t(x)]),
                ]
            if args == "resize":
                return [(op, [_t(x), [1, 1]], {}, [_t(x)])]
            if args == "as_strided":
                return [(op, [_t(x), [1], [1]], {}, [_t(x)])]
            if args == "foreach":
                return [(op, [[_t(x), _t(w)], 1.0], {}, [])]
            return [(op, [_t(x)], {}, [_t(x)])]

        put("safe", "write-" + op.split(".")[1], with_calls(calls))
    # An output that takes the id of the caller's tensor, then is written.
    put(
        "safe",
        "id-reuse",
        with_calls(
            lambda d, x, w, n: [
                ("aten.alias.default", [_t(x)], {}, [_t(d.tensor(d.d["tensors"]["id"][x], [2, 4]))]),
                ("aten.add_.Tensor", [_t(x), 1], {}, [_t(x)]),
            ]
        ),
    )


def _dos(put, base, directory) -> None:
    """Small files that would cost much memory or time."""

    def one(op, args, kwargs, shape, dtype="float32"):
        d = Doc(base)
        n = d.next_id()
        d.call(op, args, kwargs, [_t(d.tensor(n, shape, dtype=dtype))])
        return d.d

    huge = [1 << 20, 1 << 20]
    put("budget", "empty-huge", one("aten.empty.memory_format", [huge], {}, huge))
    put("budget", "empty-huge-lying", one("aten.empty.memory_format", [huge], {}, [1]))
    put("budget", "full-huge-lying", one("aten.full.default", [huge, 1.0], {}, [1]))
    put("budget", "ones-huge", one("aten.ones.default", [[BIG]], {}, [BIG]))
    put("budget", "arange-huge-lying", one("aten.arange.default", [BIG], {}, [1], "int64"))
    put("budget", "randn-huge-lying", one("aten.randn.default", [[1 << 38]], {}, [2]))
    d = Doc(base)
    x = d.leaf_index("args[1]")
    n = d.next_id()
    d.call("aten.expand.default", [_t(x), [1 << 18, 2, 4]], {}, [_t(d.tensor(n, [1 << 18, 2, 4], stride=[0, 4, 1]))])
    d.call("aten.repeat.default", [_t(x), [1 << 20, 1 << 10]], {}, [_t(d.tensor(n + 1, [1]))])
    put("budget", "repeat-lying", d.d)
    # Big leaves (made up by replay) and big matrix products.
    for k, reps in ((1, 1), (2, 16)):
        d = Doc(base)
        n = d.next_id()
        a = d.tensor(n, [16384, 16384])
        d.leaf("input", f"big{k}", a)
        for r in range(reps):
            d.call("aten.mm.default", [_t(a), _t(a)], {}, [_t(d.tensor(n + 1 + r, [16384, 16384]))])
        put("budget", f"mm-16k-{reps}", d.d)
    # FLOPs without a big allocation: many products of moderate matrices.
    d = Doc(base)
    n = d.next_id()
    a = d.tensor(n, [4096, 4096])
    d.leaf("input", "a", a)
    for _ in range(200):
        d.call("aten.mm.default", [_t(a), _t(a)], {}, [_t(d.tensor(n + 1, [4096, 4096]))])
    put("budget", "mm-many", d.d)
    d = Doc(base)
    n = d.next_id()
    a = d.tensor(n, [1 << 16, 1 << 16])
    d.leaf("input", "a", a)
    d.call(
        "aten.linalg_inv_ex.default", [_t(a)], {}, [_t(d.tensor(n + 1, [1])), _t(d.tensor(n + 2, [1], dtype="int32"))]
    )
    put("budget", "inverse-huge", d.d)
    # Decompression bomb, nesting, long strings, many devices.
    text = json.dumps(base)
    bomb = gzip.compress(text[:-1].encode() + b', "pad": "' + b" " * (300 << 20) + b'"}', compresslevel=9)
    put("load", "gzip-bomb", raw=bomb)
    put("load", "gzip-trailing-garbage", raw=gzip.compress(text.encode()) + b"garbage")
    for depth in (40, 1000, 100000):
        put("load", f"nesting-{depth}", raw=(text[:-1] + ', "output": ' + "[" * depth + "]" * depth + "}").encode())
    d = Doc(base)
    d.d["output"] = {"dict": [[{"dict": []}, 1]]}
    put("load", "dict-key-dict", d.d)
    d = Doc(base)
    d.d["strings"].append("m" * (1 << 20))
    put("load", "long-string", d.d)
    d = Doc(base)
    d.d["output"] = "v" * (1 << 20)
    put("load", "long-value-string", d.d)
    d = Doc(base)
    d.d["output"] = {"int": "9" * 100000}
    put("load", "huge-int-tag", d.d)
    d = Doc(base)
    d.d["output"] = {"complex": ["1" * 100000, "1"]}
    put("load", "huge-complex-tag", d.d)
    d = Doc(base)
    d.d["modules"] = {"m": ["not", "a", "string"]}
    put("load", "module-not-string", d.d)
    d = Doc(base)
    d.d["rng_state"] = "A" * (1 << 20)
    put("load", "huge-rng-state", d.d)
    # Many distinct device strings, each bad: linear time, refused.
    d = Doc(base)
    start = len(d.d["strings"])
    d.d["strings"] += [f"cuda:{i}x" for i in range(60000)]
    t = d.d["tensors"]
    for col in t:
        t[col] = [t[col][0]] * 60000
    t["device"] = list(range(start, start + 60000))
    put("load", "many-devices", d.d)
    for what, path, value in [
        ("size-2**63", ("tensors", "shape", 0), [1 << 63, 1]),
        ("size-2**64", ("tensors", "shape", 0), [1 << 64]),
        ("numel-2**63", ("tensors", "shape", 0), [1 << 32, 1 << 32]),
        ("stride-2**63", ("tensors", "stride", 0), [1 << 63, 1]),
        ("offset-2**63", ("tensors", "storage_offset", 0), 1 << 63),
        ("id-2**70", ("tensors", "id", 0), 1 << 70),
        ("storage-huge", ("tensors", "storage", 0), 1 << 64),
    ]:
        d = Doc(base)
        d.d[path[0]][path[1]][path[2]] = value
        put("load", what, d.d)


def _malformed(put, base) -> None:
    """Values that do not fit the op: refused at load or as a ReplayError."""
    d = Doc(base)
    x, w = d.leaf_index("args[1]"), d.leaf_index("weight")
    n = d.next_id()
    d.call("aten.mm.default", [_t(x), _t(x)], {}, [_t(d.tensor(n, [2, 2]))])
    put("replay", "mm-shapes", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.view.default", [_t(d.leaf_index("args[1]")), [3, 3]], {}, [_t(d.tensor(n, [3, 3]))])
    put("replay", "view-numel", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call(
        "aten.as_strided.default",
        [_t(d.leaf_index("args[1]")), [100], [1000]],
        {},
        [_t(d.tensor(n, [100], stride=[1000]))],
    )
    put("replay", "as-strided-out-of-bounds", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.add.Tensor", [_t(d.leaf_index("args[1]")), 1], {"bogus": 2}, [_t(d.tensor(n, [2, 4]))])
    put("load", "unknown-kwarg", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.add.Tensor", [_t(d.leaf_index("args[1]")), 1], {"self": 2}, [_t(d.tensor(n, [2, 4]))])
    put("load", "kwarg-repeats-positional", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.add.out", [_t(x), _t(x), 1, _t(w)], {}, [_t(w)])
    put("load", "kwarg-only-by-position", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.relu.default", [_t(x)], {}, [_t(d.tensor(n, [2, 4])), _t(d.tensor(n, [2, 4]))])
    put("load", "too-many-outputs", d.d)
    d = Doc(base)
    d.d["calls"]["args"][-1] = [{"t": 10**9}]
    put("load", "bad-tensor-ref", d.d)
    d = Doc(base)
    d.d["leaves"]["value"][0] = {"dtype": "float32", "shape": [2, 4], "data": "A" * (1 << 20)}
    put("load", "const-data-too-long", d.d)
    d = Doc(base)
    d.d["leaves"]["kind"][0] = d.s("const")
    d.d["leaves"]["value"][0] = {"dtype": "float32", "shape": [4], "data": "AAAA"}
    put("load", "const-shape", d.d)
    d = Doc(base)
    d.d["version"] = True
    put("load", "version-true", d.d)
    d = Doc(base)
    d.d["calls"]["kwargs"][-1] = []
    put("load", "kwargs-list", d.d)
    d = Doc(base)
    d.d["tensors"]["dtype"][0] = -1
    put("load", "dtype-index", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.index.Tensor", [_t(x), [_t(d.tensor(n, [3], dtype="int64"))]], {}, [_t(d.tensor(n + 1, [3, 4]))])
    put("load", "index-undefined", d.d)
    d = Doc(base)
    d.d["leaves"]["value"][0] = {"dtype": "float32", "shape": [4], "data": 5}
    put("load", "const-data-type", d.d)


def _streams(put, base) -> None:
    """Random streams (format 4): states are bounded bytes, names come from fixed sets."""

    def events(*rows):
        d = Doc(base)
        d.d["rng_events"] = {k: [r[i] for r in rows] for i, k in enumerate(("at", "action", "stream", "slot", "state"))}
        return d.d

    put("load", "rng-state-too-long", events((0, "load", "cpu", -1, "A" * (1 << 18))))
    put("load", "rng-stream-name", events((0, "save", "cpu; rm -rf /", 0, None)))
    put("load", "rng-action", events((0, "exec", "cpu", 0, None)))
    put("load", "rng-slot-and-state", events((0, "load", "cpu", 3, "AAAA")))
    put("load", "rng-at-negative", events((-1, "save", "cpu", 0, None)))
    put("replay", "rng-load-unsaved-slot", events((0, "load", "cpu", 7, None)))
    put("replay", "rng-state-garbage", events((0, "load", "cpu", -1, "AAAA")))
    put(
        "safe",
        "rng-save-load-after-the-end",
        events((10**6, "save", "cpu", 0, None), (10**6, "load", "cuda:0", 0, None)),
    )
    d = Doc(base)
    d.d["rng_cuda"] = {"cpu": "AAAA"}
    put("load", "rng-cuda-names-cpu", d.d)
    d = Doc(base)
    d.d["generators"] = {"device": ["onnx"], "state": [None]}
    put("load", "generator-device", d.d)
    d = Doc(base)
    d.d["generators"] = {"device": ["cpu"], "state": ["A" * (1 << 18)]}
    put("load", "generator-state-too-long", d.d)
    for ref in (-1, 1 << 40, "0", [0]):
        d = Doc(base)
        n = d.next_id()
        d.call("aten.randn.generator", [[2, 4]], {"generator": {"generator": ref}}, [_t(d.tensor(n, [2, 4]))])
        put("load", "generator-ref", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.randn.generator", [[2, 4]], {"generator": {"generator": 5}}, [_t(d.tensor(n, [2, 4]))])
    put("safe", "generator-ref-without-state", d.d)  # made up, and said so
    d = Doc(base)
    d.d["arg_names"] = ["\x1b[2J" * 10, 5]
    put("load", "arg-names", d.d)


def _combined(put, base, payloads, marker) -> None:
    """Two attacks in one file: the first refusal must come first."""
    for p in payloads[:4]:
        d = Doc(base)
        d.call("aten.from_file.default", [marker + "8", True, 8], {p: 1}, [])
        put("load", "kwarg-and-effect", d.d)
    d = Doc(base)
    x = d.leaf_index("args[1]")
    n = d.next_id()
    d.call("aten.empty.memory_format", [[BIG]], {}, [_t(d.tensor(n, [1]))])
    d.call("aten.add_.Tensor", [], {"self": _t(x), "other": 1}, [_t(x)])
    put("budget", "budget-and-write", d.d)
    d = Doc(base)
    d.d["strings"][d.d["calls"]["module"][0]] = "\x1b[2J" + "m" * (1 << 17)
    put("load", "escape-and-long", d.d)
    d = Doc(base)
    d.call("aten._print.default", ["\x1b[2Jhi"], {}, [])
    d.d["output"] = {"dtype": "onnx"}
    put("load", "print-and-import", d.d)
    text = json.dumps(Doc(base).d)
    put(
        "load",
        "gzip-nesting",
        raw=gzip.compress((text[:-1] + ', "output": ' + "[" * 50000 + "]" * 50000 + "}").encode()),
    )
    d = Doc(base)
    x = d.leaf_index("args[1]")
    n = d.next_id()
    d.call("aten.view.default", [_t(x), [8]], {}, [_t(d.tensor(n, [8], storage=0))])
    d.call(
        "aten.type_as.default", [_t(d.tensor(n, [8], storage=0)), _t(x)], {}, [_t(d.tensor(n + 1, [8], storage=123))]
    )
    d.call(
        "aten.fill_.Scalar",
        [],
        {"self": _t(d.tensor(n + 1, [8], storage=123)), "value": 5.0},
        [_t(d.tensor(n + 1, [8], storage=123))],
    )
    put("replay", "view-type_as-keyword-fill", d.d)


# -- the check, in a child process


def check(directory: str, limit_bytes: int) -> None:
    """Load, print, repro and replay every file; print one JSON line of findings each."""
    import gc
    import resource
    import signal
    import time

    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    import torch

    import metadispatch as md
    from metadispatch.cli.main import report
    from metadispatch.ir.text import printable

    lin, x, y = user_tensors()
    originals = [t.detach().clone() for t in (x, y, *lin.parameters())]
    # Warm up every lazy import a good file needs, so a new module means the file caused it.
    base = os.path.join(os.getcwd(), "warm.json")  # the child runs in a scratch directory
    md.trace(_fn, lin, x, y).save(base)
    md.replay(md.Trace.load(base), (lin, x, y))
    report(md.Trace.load(base))
    md.Trace.load(base)[0].repro()

    def timeout(*_):
        raise TimeoutError("took too long")

    signal.signal(signal.SIGALRM, timeout)
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        before = set(sys.modules)
        start = time.perf_counter()
        stage, error = "load", None
        signal.alarm(30)
        try:
            t = md.Trace.load(path)
            stage = "print"
            text = str(t) + t.summary() + report(t)
            stage = "replay"
            md.replay(t, (lin, x, y))
            stage = "repro"  # run only what replay ran within its budget
            for call in t.calls:
                code = compile(call.repro(), "<repro>", "exec")
                try:
                    exec(code, {"print": lambda *a: None})
                except RuntimeError:  # the real kernel refusing, as it would for the user
                    pass
            stage = "done"
            del text
        except md.MetaDispatchError as e:
            error = type(e).__name__
            printable(str(e))
        except BaseException as e:  # noqa: BLE001 -- reported, the test fails on it
            error = f"untyped {type(e).__name__}: {str(e)[:300]}"
        finally:
            signal.alarm(0)
            t = None
            gc.collect()
        seconds = time.perf_counter() - start
        changed = not all(torch.equal(a, b) for a, b in zip(originals, (x, y, *lin.parameters())))
        new_modules = sorted(set(sys.modules) - before)
        print(
            json.dumps(
                {
                    "file": name,
                    "stage": stage,
                    "error": error,
                    "seconds": seconds,
                    "changed": changed,
                    "modules": new_modules[:5],
                }
            ),
            flush=True,
        )
    print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        print("\n".join(write_corpus(sys.argv[2], sys.argv[3])))
    else:
        check(sys.argv[2], int(sys.argv[3]))
