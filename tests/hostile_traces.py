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
the caller's tensors unchanged and import no module.  hostile_check.py runs
the files in a child process under an address-space limit and
``tests/execution/test_hostile.py`` holds each to its class.  ``python
tests/hostile_traces.py DIR OUTSIDE`` writes the corpus by hand.
"""

from __future__ import annotations

import gzip
import json
import os
import sys

from tests import hostile_indices, hostile_memory
from tests.hostile_doc import Doc, base_doc, ref

CLASSES = ("load", "replay", "budget", "safe")
BIG = 1 << 40  # bytes no default budget allows


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
    _limits(put, base)
    hostile_memory.write(put, base)
    hostile_indices.write(put, base)
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
        d.call(op, args if args is not None else [ref(x)], kwargs, [])
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
        with_calls(lambda d, x, w, n: [("aten.add_.Tensor", [], {"self": ref(x), "other": 1}, [ref(x)])]),
    )
    put(
        "safe",
        "self-keyword-param",
        with_calls(lambda d, x, w, n: [("aten.mul_.Tensor", [], {"self": ref(w), "other": 0}, [ref(w)])]),
    )
    # A view given a false storage number, then written.
    put(
        "safe",
        "lying-storage",
        with_calls(
            lambda d, x, w, n: [
                ("aten.view.default", [ref(x), [8]], {}, [ref(d.tensor(n, [8], storage=99999))]),
                (
                    "aten.fill_.Scalar",
                    [ref(d.tensor(n, [8], storage=99999)), 7.0],
                    {},
                    [ref(d.tensor(n, [8], storage=99999))],
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
                ("aten.empty.memory_format", [[0]], {}, [ref(d.tensor(n, [0]))]),
                ("aten.set_.source_Tensor", [ref(d.tensor(n, [0])), ref(x)], {}, [ref(d.tensor(n, [2, 4]))]),
                ("aten.add_.Tensor", [ref(d.tensor(n, [2, 4])), 1], {}, [ref(d.tensor(n, [2, 4]))]),
            ]
        ),
    )
    put(
        "safe",
        "set-caller",
        with_calls(lambda d, x, w, n: [("aten.set_.source_Tensor", [ref(x), ref(w)], {}, [ref(x)])]),
    )
    # Ops whose schema hides an alias: only the guard sees these.
    for op in ["aten.type_as.default", "aten._unsafe_view.default"]:
        put(
            "replay" if op.endswith("type_as.default") else "safe",
            "hidden-alias-" + op.split(".")[1],
            with_calls(
                lambda d, x, w, n, op=op: [
                    (op, [ref(x), ref(x) if "type_as" in op else [2, 4]], {}, [ref(d.tensor(n, [2, 4]))]),
                    ("aten.mul_.Tensor", [ref(d.tensor(n, [2, 4])), 3], {}, [ref(d.tensor(n, [2, 4]))]),
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
                    ("aten.zeros.default", [[2, 4]], {}, [ref(d.tensor(n, [2, 4]))]),
                    (op, [ref(x), ref(d.tensor(n, [2, 4]))], {}, [ref(x)]),
                ]
            if args == "out":
                return [(op, [ref(w), 1.0], {"out": ref(x)}, [ref(x)])]
            if args == "index_put":
                return [
                    (
                        "aten.zeros.default",
                        [[1]],
                        {"dtype": {"dtype": "int64"}},
                        [ref(d.tensor(n, [1], dtype="int64"))],
                    ),
                    (op, [ref(x), [ref(d.tensor(n, [1], dtype="int64"))], ref(x)], {}, [ref(x)]),
                ]
            if args == "resize":
                return [(op, [ref(x), [1, 1]], {}, [ref(x)])]
            if args == "as_strided":
                return [(op, [ref(x), [1], [1]], {}, [ref(x)])]
            if args == "foreach":
                return [(op, [[ref(x), ref(w)], 1.0], {}, [])]
            return [(op, [ref(x)], {}, [ref(x)])]

        put("safe", "write-" + op.split(".")[1], with_calls(calls))
    # An output that takes the id of the caller's tensor, then is written.
    put(
        "safe",
        "id-reuse",
        with_calls(
            lambda d, x, w, n: [
                ("aten.alias.default", [ref(x)], {}, [ref(d.tensor(d.d["tensors"]["id"][x], [2, 4]))]),
                ("aten.add_.Tensor", [ref(x), 1], {}, [ref(x)]),
            ]
        ),
    )


def _dos(put, base, directory) -> None:
    """Small files that would cost much memory or time."""

    def one(op, args, kwargs, shape, dtype="float32"):
        d = Doc(base)
        n = d.next_id()
        d.call(op, args, kwargs, [ref(d.tensor(n, shape, dtype=dtype))])
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
    d.call("aten.expand.default", [ref(x), [1 << 18, 2, 4]], {}, [ref(d.tensor(n, [1 << 18, 2, 4], stride=[0, 4, 1]))])
    d.call("aten.repeat.default", [ref(x), [1 << 20, 1 << 10]], {}, [ref(d.tensor(n + 1, [1]))])
    put("budget", "repeat-lying", d.d)
    # Big leaves (made up by replay) and big matrix products.
    for k, reps in ((1, 1), (2, 16)):
        d = Doc(base)
        n = d.next_id()
        a = d.tensor(n, [16384, 16384])
        d.leaf("input", f"big{k}", a)
        for r in range(reps):
            d.call("aten.mm.default", [ref(a), ref(a)], {}, [ref(d.tensor(n + 1 + r, [16384, 16384]))])
        put("budget", f"mm-16k-{reps}", d.d)
    # FLOPs without a big allocation: many products of moderate matrices.
    d = Doc(base)
    n = d.next_id()
    a = d.tensor(n, [4096, 4096])
    d.leaf("input", "a", a)
    for _ in range(200):
        d.call("aten.mm.default", [ref(a), ref(a)], {}, [ref(d.tensor(n + 1, [4096, 4096]))])
    put("budget", "mm-many", d.d)
    d = Doc(base)
    n = d.next_id()
    a = d.tensor(n, [1 << 16, 1 << 16])
    d.leaf("input", "a", a)
    d.call(
        "aten.linalg_inv_ex.default",
        [ref(a)],
        {},
        [ref(d.tensor(n + 1, [1])), ref(d.tensor(n + 2, [1], dtype="int32"))],
    )
    put("budget", "inverse-huge", d.d)
    # Decompression bomb, nesting, long strings, many devices.
    text = json.dumps(base)
    put("load", "gzip-bomb", raw=_repeated(text[:-1].encode() + b', "pad": "', b" " * (1 << 20), 300, b'"}'))
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
    d.call("aten.mm.default", [ref(x), ref(x)], {}, [ref(d.tensor(n, [2, 2]))])
    put("replay", "mm-shapes", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.view.default", [ref(d.leaf_index("args[1]")), [3, 3]], {}, [ref(d.tensor(n, [3, 3]))])
    put("replay", "view-numel", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call(
        "aten.as_strided.default",
        [ref(d.leaf_index("args[1]")), [100], [1000]],
        {},
        [ref(d.tensor(n, [100], stride=[1000]))],
    )
    put("replay", "as-strided-out-of-bounds", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.add.Tensor", [ref(d.leaf_index("args[1]")), 1], {"bogus": 2}, [ref(d.tensor(n, [2, 4]))])
    put("load", "unknown-kwarg", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.add.Tensor", [ref(d.leaf_index("args[1]")), 1], {"self": 2}, [ref(d.tensor(n, [2, 4]))])
    put("load", "kwarg-repeats-positional", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.add.out", [ref(x), ref(x), 1, ref(w)], {}, [ref(w)])
    put("load", "kwarg-only-by-position", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.relu.default", [ref(x)], {}, [ref(d.tensor(n, [2, 4])), ref(d.tensor(n, [2, 4]))])
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
    d.call("aten.index.Tensor", [ref(x), [ref(d.tensor(n, [3], dtype="int64"))]], {}, [ref(d.tensor(n + 1, [3, 4]))])
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
    for index in (-1, 1 << 40, "0", [0]):
        d = Doc(base)
        n = d.next_id()
        d.call("aten.randn.generator", [[2, 4]], {"generator": {"generator": index}}, [ref(d.tensor(n, [2, 4]))])
        put("load", "generator-ref", d.d)
    d = Doc(base)
    n = d.next_id()
    d.call("aten.randn.generator", [[2, 4]], {"generator": {"generator": 5}}, [ref(d.tensor(n, [2, 4]))])
    put("safe", "generator-ref-without-state", d.d)  # made up, and said so
    d = Doc(base)
    d.d["arg_names"] = ["\x1b[2J" * 10, 5]
    put("load", "arg-names", d.d)


def _repeated(head: bytes, chunk: bytes, times: int, tail: bytes) -> bytes:
    """gzip of ``head + chunk * times + tail``, as one member per piece (load reads every
    member): compressing the chunk once keeps writing a 300 MiB bomb instant."""
    once = gzip.compress(chunk, compresslevel=9, mtime=0)
    return gzip.compress(head, mtime=0) + once * times + gzip.compress(tail, mtime=0)


def _limits(put, base) -> None:
    """What loading bounds besides bytes: values parsed, digits, dimensions, escapes, printing."""
    text = json.dumps(base).encode()
    put("load", "values-bomb", raw=_repeated(text[:-1] + b', "pad": [', b"[]," * (1 << 20), 9, b"[]]}"))
    d = Doc(base)
    d.d["version"], d.d["output"] = 2, 12345
    put("load", "v2-5000-digits", raw=json.dumps(d.d).replace("12345", "9" * 5000).encode())
    d = Doc(base)
    d.d["output"] = ref(d.tensor(999, [3]))
    put("load", "output-undefined", d.d)
    d = Doc(base)
    d.d["tensors"]["shape"][0], d.d["tensors"]["stride"][0] = [1] * 65, [1] * 65
    put("load", "65-dimensions", d.d)
    for field, value in (
        ("modules", {"\x1b]0;owned\x07fc": 5}),
        ("grads", {"\x1b[2Jw": 99}),
        ("rng_cuda", {"\x1b[31m": "A"}),
    ):
        d = Doc(base)
        d.d[field] = value
        put("load", f"escape-in-{field}-key", d.d)
    n = Doc(base).next_id()
    for op, args in (
        ("aten._functional_assert_async.msg", [ref(0), "\x1b[2Jboom", ref(0)]),
        ("aten._functional_assert_scalar.default", [False, "boom", ref(0)]),
        ("aten._functional_sym_constrain_range.default", [1, 2, 3, ref(0)]),
    ):
        d = Doc(base)
        d.call(op, args, {}, [ref(d.tensor(n, [0]))])
        put("load", "raises-" + op.split(".")[1], d.d)
    d = Doc(base)  # every call names a 64Ki-character module and note: printing must clip them
    c = d.d["calls"]
    c["module"], c["note"] = [d.s("m" * 65536)] * len(c["module"]), [d.s("n" * 65536)] * len(c["note"])
    for col in c:
        c[col] = c[col] * 100
    put("safe", "print-amplification", d.d)


def _combined(put, base, payloads, marker) -> None:
    """Two attacks in one file: the first refusal must come first."""
    for p in payloads[:4]:
        d = Doc(base)
        d.call("aten.from_file.default", [marker + "8", True, 8], {p: 1}, [])
        put("load", "kwarg-and-effect", d.d)
    d = Doc(base)
    x = d.leaf_index("args[1]")
    n = d.next_id()
    d.call("aten.empty.memory_format", [[BIG]], {}, [ref(d.tensor(n, [1]))])
    d.call("aten.add_.Tensor", [], {"self": ref(x), "other": 1}, [ref(x)])
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
    d.call("aten.view.default", [ref(x), [8]], {}, [ref(d.tensor(n, [8], storage=0))])
    d.call(
        "aten.type_as.default", [ref(d.tensor(n, [8], storage=0)), ref(x)], {}, [ref(d.tensor(n + 1, [8], storage=123))]
    )
    d.call(
        "aten.fill_.Scalar",
        [],
        {"self": ref(d.tensor(n + 1, [8], storage=123)), "value": 5.0},
        [ref(d.tensor(n + 1, [8], storage=123))],
    )
    put("replay", "view-type_as-keyword-fill", d.d)


if __name__ == "__main__":
    print("\n".join(write_corpus(sys.argv[1], sys.argv[2])))
