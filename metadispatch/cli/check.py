"""``metadispatch check``: ``md.check`` on ``MODULE:CALLABLE``'s (model, inputs).

The report is a finding (exit 1 when it finds anything), also where the
model stops: it says where and why.  The CPU re-check of every call is
no reference for another device, so ``--device cuda`` needs
``--no-recheck``.
"""

from __future__ import annotations

import torch

from ..spec.profiles import DEFAULT_GPU
from . import options, targets
from .targets import UsageError
from .terminal import Progress, out, stage

__all__ = ["add_parser", "run"]


def add_parser(sub, kw: dict):
    """Register ``check`` on the subcommands ``sub`` and return its parser."""
    c = sub.add_parser(
        "check",
        **kw,
        help="trace past unsupported ops and compare with the real kernels",
        description="Run md.check on MODULE:CALLABLE's (model, inputs) and print the "
        "report; exit 1 when it finds anything.",
    )
    c.add_argument("target", help="MODULE:CALLABLE returning (model, example inputs)")
    c.add_argument("--device", type=options.device, default=None, help="logical device for factories (e.g. cuda)")
    c.add_argument(
        "--limit",
        type=options.at_least(0),
        default=None,
        help="bytes of real inputs one call may materialise (default 1 GiB)",
    )
    c.add_argument("--no-recheck", action="store_true", help="skip the CPU re-check of every call")
    c.add_argument("--gpu", metavar="NAME", type=options.gpu, help="the GPU logical cuda answers as (default h100)")
    return c


def run(args) -> int:
    from ..debug.check import checker
    from ..values.realrun import DEFAULT_LIMIT

    device = torch.device(args.device) if args.device is not None else None
    if device is not None and device.type != "cpu" and not args.no_recheck:
        raise UsageError(
            f"--device {args.device}: check re-runs every call on the CPU, which is no "
            f"reference for {args.device}; add --no-recheck to trace on logical "
            f"{args.device} without re-checking"
        )
    cuda = device is not None and device.type == "cuda"
    if args.gpu and not cuda:
        raise UsageError("--gpu needs --device cuda (it names the GPU logical cuda answers as)")
    gpu = (args.gpu or DEFAULT_GPU) if cuda else None
    limit = args.limit if args.limit is not None else DEFAULT_LIMIT
    with Progress("building the model"), stage("building the model"):
        model, inputs = targets.model_and_inputs(args.target, targets.load_callable(args.target)())
    run = checker(args.device, limit=limit, recheck_calls=not args.no_recheck, gpu=gpu)
    # A model that stops is a finding (exit 1), not a failure to run: the
    # report says where it stopped and why.
    with Progress("checking"):
        report = run(model, *inputs)
    print(f"{args.target}: checked on {args.device or 'cpu'}" + (f" ({gpu})" if gpu else ""))
    out(report)
    return 0 if report.ok else 1
