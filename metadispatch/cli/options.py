"""The parser's pieces every command shares: argument types and the parser class.

An argument type refuses a bad value before anything is built (exit 2, one
line); ``Parser`` says a usage error in one line with a hint (``did you
mean --out?``) instead of argparse's usage text; ``Version`` reads the
installed version only when asked, so that start-up stays cheap.
"""

from __future__ import annotations

import argparse
import difflib
import sys

import torch

from ..errors import MetaDispatchError
from ..spec.profiles import gpu_profile

__all__ = ["DTYPES", "Parser", "Version", "at_least", "device", "gpu"]

# ``--dtype`` and ``--amp``: the short names the commands take.
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def gpu(text: str) -> str:
    # Checked before anything is built: an unknown name is a usage error (exit 2).
    try:
        return gpu_profile(text).name
    except MetaDispatchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def device(text: str) -> str:
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    return text


class Version(argparse.Action):
    """``--version``: read from the installed metadata only when asked (start-up stays cheap)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import metadispatch

        print(f"metadispatch {metadispatch.__version__} (torch {torch.__version__})")
        parser.exit()


class Parser(argparse.ArgumentParser):
    """argparse, with one line (and a hint) for a usage error instead of the usage text."""

    def error(self, message: str):
        hint = _suggestion(self, message) or f"see {self.prog} --help"
        sys.stderr.write(f"{self.prog}: error: {message}\n  ({hint})\n")
        sys.exit(2)


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``did you mean --out?`` for a mistyped option or command (argparse before 3.12 suggests none)."""
    if message.startswith("unrecognized arguments: "):
        typed = [a.split("=")[0] for a in message.split(": ", 1)[1].split() if a.startswith("-")]
        known = _options(parser)
    elif message.startswith("argument command: invalid choice: "):
        typed = [message.split("'")[1]] if message.count("'") >= 2 else []
        known = sorted(_commands(parser))
    else:
        return ""
    for word in typed:
        close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
        if close:
            return f"did you mean {close[0]}? see {parser.prog} --help"
    return ""


def _commands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _options(parser: argparse.ArgumentParser) -> list:
    """Every option string of ``parser`` and its commands (argparse reports unknown options at the top)."""
    out = {o for a in parser._actions for o in a.option_strings}
    for sub in _commands(parser).values():
        out.update(o for a in sub._actions for o in a.option_strings)
    return sorted(out)
