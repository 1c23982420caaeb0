"""The command line: ``python -m metadispatch`` (installed as ``metadispatch``).

``trace`` builds a model under MetaMode (nothing is allocated), traces a
training step and prints what it would do: ops, FLOPs, peak memory and a
per-module table.  ``summary``, ``replay`` and ``check`` work on saved traces
and models with the tools other modules provide.  Tables fit the terminal;
a progress line shows on a terminal only.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time

import torch

from . import targets

__all__ = ["main"]

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class _Progress:
    """``label: N calls`` redrawn on stderr while a trace grows, if a terminal."""

    def __init__(self, label: str, count) -> None:
        self.label, self.count = label, count
        self.on = sys.stderr.isatty()
        self._stop = threading.Event()

    def __enter__(self):
        if self.on:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            sys.stderr.write(f"\r{self.label}: {self.count()} calls")
            sys.stderr.flush()

    def __exit__(self, *exc) -> None:
        if self.on:
            self._stop.set()
            self._thread.join()
            sys.stderr.write("\r\033[K")


def _width() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def report(trace, *, top: int = 10, depth: int = 2, width: int | None = None) -> str:
    """Ops, FLOPs, peak memory and the module tree, as the CLI prints them."""
    from ..analysis.flops import flops, fmt_count
    from ..analysis.memory import memory
    from ..analysis.tables import module_table, render

    f, m = flops(trace), memory(trace)
    calls: dict = {}
    for call in trace.calls:
        calls[call.op] = calls.get(call.op, 0) + 1
    ops = sorted(calls, key=lambda op: (-f.by_op.get(op, 0), -calls[op], op))[:top]
    phases = {p: sum(1 for c in trace.calls if c.phase == p) for p in ("forward", "backward", "optimizer")}
    lines = [f"{len(trace.calls)} calls (" + ", ".join(f"{n} {p}" for p, n in phases.items() if n)
             + f"), {len(calls)} distinct ops"]
    rows = [(op, calls[op], fmt_count(f.by_op[op]) if op in f.by_op else "-") for op in ops]
    lines += render(("op", "calls", "FLOPs"), rows, width=width)
    lines += ["", str(f).split("\n")[0] + (f"; no formula for {len(f.uncounted)} ops" if f.uncounted else "")]
    lines += ["", str(m), module_table(trace, f, m, depth=depth, width=width)]
    return "\n".join(lines)


def _cmd_trace(args) -> int:
    from ..tracing.tracer import tracer
    from ..core.mode import MetaMode

    device = args.device
    dtype = _DTYPES[args.dtype] if args.dtype else None
    if args.hf:
        t = targets.hf_target(args.hf, targets.parse_overrides(args.config), device,
                              not args.forward_only, args.batch, args.seq or 128, dtype)
    elif args.target:
        t = targets.callable_target(args.target, device, not args.forward_only)
    else:
        t = targets.default_target(device, not args.forward_only, args.batch, args.seq or 2048)
    modes: list = []  # the mode, so that the progress line can count its calls
    run = tracer(mode_factory=lambda: modes.append(MetaMode(device=device)) or modes[-1])
    start = time.perf_counter()
    with _Progress("tracing", lambda: len(modes[-1].trace) if modes else 0):
        trace = run(t.step, t.model, *t.inputs)
    seconds = time.perf_counter() - start
    what = "forward" if args.forward_only else "forward and backward"
    print(f"{t.name}: {what} on {device}, traced in {seconds:.1f} s")
    print(report(trace, top=args.top, depth=args.depth, width=_width()))
    return _exports(trace, args)


def _exports(trace, args) -> int:
    if args.perfetto:
        from ..analysis.export import save_perfetto

        save_perfetto(trace, args.perfetto)
        print(f"wrote {args.perfetto} (open in https://ui.perfetto.dev)")
    if args.plot:
        from ..analysis.export import save_plot

        save_plot(trace, args.plot)
        print(f"wrote {args.plot}")
    if args.out:
        if not hasattr(trace, "save"):
            return _missing("--out", "Trace.save (saving traces)")
        trace.save(args.out)
        print(f"wrote {args.out}")
    return 0


def _missing(what: str, needs: str) -> int:
    print(f"metadispatch: {what} needs {needs}, which this build of metadispatch does not have",
          file=sys.stderr)
    return 2


def _load(path):
    import metadispatch as md

    load = getattr(md, "load", None) or getattr(md.Trace, "load", None)
    return load(path) if load is not None else None


def _cmd_summary(args) -> int:
    trace = _load(args.file)
    if trace is None:
        return _missing("summary", "md.load (loading saved traces)")
    print(report(trace, top=args.top, depth=args.depth, width=_width()))
    return 0


def _cmd_replay(args) -> int:
    import metadispatch as md

    replay = getattr(md, "replay", None)
    if replay is None:
        return _missing("replay", "md.replay")
    trace = _load(args.file)
    if trace is None:
        return _missing("replay", "md.load (loading saved traces)")
    result = replay(trace, device=args.device)
    print(result)
    return 0 if result.ok else 1


def _cmd_check(args) -> int:
    from ..debug.check import checker
    from ..core.realrun import DEFAULT_LIMIT

    model, inputs = targets.load_callable(args.target)()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    limit = args.limit if args.limit is not None else DEFAULT_LIMIT
    report = checker(args.device, limit=limit, recheck_calls=not args.no_recheck)(model, *inputs)
    print(report)
    return 0 if report.ok else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="metadispatch", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="trace a model's training step and print what it costs",
                       description="Trace a model (default: built-in LLaMA-7B) without running it; "
                                   "print ops, FLOPs, peak memory and a per-module table.")
    t.add_argument("target", nargs="?", help="MODULE:CALLABLE returning (model, example inputs)")
    t.add_argument("--hf", metavar="ARCH", help="a transformers model type built from its config, e.g. llama")
    t.add_argument("--config", metavar="KEY=VALUE", action="append", help="config overrides for --hf")
    t.add_argument("--device", default="cuda", help="logical device (default: cuda)")
    t.add_argument("--dtype", choices=sorted(_DTYPES), help="cast the --hf model to this dtype")
    t.add_argument("--batch", type=int, default=1, help="batch size (built-in and --hf)")
    t.add_argument("--seq", type=int, help="sequence length (default 2048 built-in, 128 --hf)")
    t.add_argument("--forward-only", action="store_true", help="trace forward only")
    t.add_argument("--out", metavar="FILE", help="save the trace")
    t.add_argument("--perfetto", metavar="FILE", help="write a Chrome-trace/Perfetto JSON")
    t.add_argument("--plot", metavar="FILE", help="write a memory-timeline PNG (needs matplotlib)")
    for q in (t, s := sub.add_parser("summary", help="print the report of a saved trace",
                                      description="Print ops, FLOPs, memory and modules of a saved trace.")):
        q.add_argument("--top", type=int, default=10, help="ops to list (default 10)")
        q.add_argument("--depth", type=int, default=2, help="module tree depth (default 2)")
    s.add_argument("file", help="a saved trace")
    r = sub.add_parser("replay", help="run a saved trace for real and verify it",
                       description="Replay a saved trace on a real device and check every result.")
    r.add_argument("file", help="a saved trace")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    c = sub.add_parser("check", help="trace past unsupported ops and compare with the real kernels",
                       description="Run md.check on MODULE:CALLABLE's (model, inputs) and print the "
                                   "report; exit 1 when it finds anything.")
    c.add_argument("target", help="MODULE:CALLABLE returning (model, example inputs)")
    c.add_argument("--device", default=None, help="logical device for factories (e.g. cuda)")
    c.add_argument("--limit", type=int, default=None,
                   help="bytes of real inputs one call may materialise (default 1 GiB)")
    c.add_argument("--no-recheck", action="store_true", help="skip the CPU re-check of every call")
    t.set_defaults(run=_cmd_trace)
    s.set_defaults(run=_cmd_summary)
    r.set_defaults(run=_cmd_replay)
    c.set_defaults(run=_cmd_check)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return args.run(args)

