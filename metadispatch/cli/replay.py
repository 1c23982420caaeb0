"""``metadispatch replay``: run a saved trace on a real device and check every call.

A file holds no weights or inputs: replay makes them up (and says which).
One rank of a logical world is refused with what to do instead: its
collectives need the other ranks (Note [A logical world's file in summary]
in ``summary.py``).
"""

from __future__ import annotations

import torch

from . import summary
from .targets import UsageError
from .terminal import Failure, Progress, out, stage

__all__ = ["add_parser", "run"]


def add_parser(sub, kw: dict):
    """Register ``replay`` on the subcommands ``sub`` and return its parser."""
    r = sub.add_parser(
        "replay",
        **kw,
        help="run a saved trace for real and verify it",
        description="Replay a saved trace on a real device and check every result.",
    )
    r.add_argument("file", help="a saved trace")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    return r


def run(args) -> int:
    import metadispatch as md

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here; replay on --device cpu")
    trace = _load_for_replay(args.file)
    with Progress("replaying"), stage("replay failed"):
        # A file holds no weights or inputs: replay makes them up and checks
        # every call's metadata; the output lists what was made up.
        result = md.replay(trace, device=args.device, allow_made_up=True)
    out(result)
    return 0 if result.ok else 1


def _load_for_replay(path):
    """The trace at ``path``, refused with what to do instead where it is one rank of a logical world.

    A world's file names collective and FSDP ops, which the loader refuses
    ("unknown op"); it is read again the way ``summary`` reads it only to say
    what the file is -- the trace replay runs is the one loaded with every
    check (Note [A logical world's file in summary]).
    """
    import metadispatch as md

    try:
        trace = summary.load(path)
    except Failure as failure:
        error = failure.error
        if not isinstance(error, md.TraceFormatError) or not any(
            f"'{ns}." in str(error) for ns in summary.WORLD_NAMESPACES
        ):
            raise
        with stage(f"could not read {path}"):
            world = summary.load_world(path).world
        if world is None:
            raise
        raise UsageError(_world_refusal(path, *world)) from None
    if trace.world is not None:
        raise UsageError(_world_refusal(path, *trace.world))
    return trace


def _world_refusal(path, size: int, rank: int) -> str:
    return (
        f"{path} is rank {rank} of a logical world of {size} ranks (metadispatch trace "
        f"--world-size {size}): its collectives exchange data with the other ranks, which one process "
        f"does not have, so it cannot be replayed here. Instead: 'metadispatch summary {path}' reads its "
        "memory, FLOPs and collectives; to check the step's values on real kernels, trace it without "
        "--world-size and replay that file; or replay each rank's trace with md.replay in that rank's "
        f"process of a real {size}-process job (docs/distributed.md)"
    )
