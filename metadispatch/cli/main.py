"""The command line: ``python -m metadispatch`` (installed as ``metadispatch``).

This module routes: it builds the parser from each command's module
(``trace_cmd``, ``summary``, ``replay``, ``check``, ``serve``, ``planner``;
each has ``add_parser(sub, kw)`` and ``run(args)``) and turns what a
command raised into its exit code.  Every error is one line on stderr (and
a hint where one helps); ``--debug`` adds the traceback.  Exit codes: see
``EXIT_CODES`` (and ``docs/cli.md``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback

from .. import _compat
from ..ir.text import printable
from . import check, planner, replay, serve, summary, trace_cmd
from .options import Parser, Version
from .targets import UsageError
from .terminal import Failure
from .terminal import Progress as _Progress  # noqa: F401 -- tests/cli/test_cli_errors.py reaches it here

__all__ = ["main", "EXIT_CODES"]

EXIT_CODES = """exit codes:
  0  success
  1  findings: replay mismatches, check problems
  2  usage errors: a bad argument, option or --config key
  3  failures to run: a missing, unreadable or corrupt file, an unknown module,
     a model that raised, an --out/--perfetto/--plot file that could not be written
  130  interrupted (Ctrl-C)"""

# In the order ``--help`` lists them.
_COMMANDS = (trace_cmd, summary, replay, check, serve, planner)


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="metadispatch",
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.add_argument("--version", action=Version, help="print metadispatch's and torch's versions and exit")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error"
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    kw = {"parents": [common], "epilog": EXIT_CODES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    for command in _COMMANDS:
        command.add_parser(sub, kw).set_defaults(run=command.run)
    return p


def console() -> int:
    """The ``metadispatch`` program: :func:`main` in a process of its own.

    Only here, never in :func:`main` (which tests and users call in their
    own process), torch's reference kernels and optimizer steps skip their
    dynamo import: Note [Reference kernels without dynamo in the command line].
    """
    _compat.skip_dynamo_in_reference_kernels()
    _compat.steps_without_graph_breaks()
    # Note [A command line that owns its heap]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # What torch built at import (about a million objects) lives until the process ends, so the cyclic
    # collector need not walk it again during the step, nor in the three
    # full collections of interpreter shutdown (~0.5 s of ``metadispatch
    # trace`` on 2 cores).  Frozen objects are freed by the exit itself;
    # atexit handlers, thread joins and flushes still run.  Only here: in
    # the user's process this would keep their garbage alive.
    gc.freeze()
    # MODULE:CALLABLE names the user's own modules, from where they stand, as
    # ``python -m`` would find them; an installed script's path lacks ".".
    sys.path.insert(0, os.getcwd())
    try:
        return main()
    except BrokenPipeError:
        # ``metadispatch summary t.json | head``: the reader has what it
        # wanted.  Point stdout at nothing, so that flushing it at exit does
        # not raise again, and stop as ``head`` would leave a writer.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        gc.freeze()  # and what the step built (see the Note above)


def main(argv=None) -> int:
    """Run the command line; returns the exit code (see ``EXIT_CODES``)."""
    args = _parser().parse_args(argv)
    prog = f"metadispatch {args.command}"
    try:
        return args.run(args)
    except UsageError as e:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"{prog}: error: {printable(str(e), keep=chr(10))}\n  (see {prog} --help)", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # stdout's reader went away: nothing to say, nowhere to say it (console())
    except Exception as e:  # a failure to run: one line, the traceback only with --debug
        if getattr(args, "debug", False):
            traceback.print_exc()
        doing, error = (e.doing, e.error) if isinstance(e, Failure) else ("failed", e)
        print(f"{prog}: {doing}: {_one_line(error, doing)}", file=sys.stderr)
        if not getattr(args, "debug", False):
            print("  (run with --debug for the traceback)", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # Ctrl-C: the shell's code for SIGINT, and no traceback
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _one_line(error: BaseException, doing: str = "") -> str:
    """``FileNotFoundError: No such file or directory: 'w.pt'``, and where the
    user's code raised it; the file is left out where ``doing`` names it."""
    from ..source import traceback_frame

    if isinstance(error, OSError) and error.strerror:
        text = f"{type(error).__name__}: {error.strerror}"
        if error.filename is not None and str(error.filename) not in doing:
            text += f": {str(error.filename)!r}"  # a model's missing data file, a MODULE:CALLABLE's .py
    else:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [""]
        # "Validation error for field 'x':" says what, its next line why.
        first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
        text = f"{type(error).__name__}: {first}"
    where = None if isinstance(error, ImportError) else traceback_frame(error.__traceback__)
    # Messages quote trace files (names, keys): escaped like everything printed.
    return printable(text + (f" (at {where})" if where else ""))
