"""What replay returns: :class:`Replay`, and the records it holds.

``Replay.ok`` is the claim the whole of replay exists to make or refuse
(docs/replay.md): every call matched its record and nothing was made up.
"""

from __future__ import annotations

from typing import NamedTuple

from ..ir.compare import Mismatch

__all__ = ["Replay", "Mismatch", "Tolerance"]


class Tolerance(NamedTuple):
    """How far replayed values may stray from eager's, and why they may at all."""

    rtol: float
    atol: float
    why: str


class Replay:
    """The result of :func:`replay`: real outputs, gradients, mismatches and made-up data.

    ``ok`` holds exactly when every call matched its record and every leaf
    and random stream was bound from the user's data, a recorded constant or
    a recorded state (docs/replay.md); ``made_up`` lists what was not, as
    :class:`~metadispatch.binding.streams.MadeUp` (name, call, why).
    ``tolerance`` is None where replayed values equal eager's bit for bit,
    else the :class:`Tolerance` within which they do.
    """

    def __init__(
        self,
        output,
        grads: dict,
        buffers: dict,
        mismatches: list,
        made_up: list | tuple = (),
        allow_made_up: bool = False,
        tolerance: Tolerance | None = None,
        checked: bool = True,
        times: list | None = None,
    ) -> None:
        self.output = output  # what fn returned, with real tensors
        self.grads = grads  # parameter name -> real gradient
        self.buffers = buffers  # buffer name -> its real value after the trace
        self.mismatches = mismatches
        self.made_up = list(made_up)
        self.allow_made_up = allow_made_up
        self.tolerance = tolerance
        self.checked = checked  # False: ``check=False``, no call was compared with its record
        self.times = times  # seconds per trace call with ``timing=True``, else None

    @property
    def ok(self) -> bool:
        """True only when checked, every call matched and nothing was made up (unless allowed)."""
        return self.checked and not self.mismatches and (self.allow_made_up or not self.made_up)

    def _verdict(self) -> str:
        return "ok" if self.ok else "not ok" if self.checked else "unchecked"

    def __repr__(self) -> str:
        parts = [f"{len(self.mismatches)} mismatches"] if self.mismatches else []
        if self.made_up:
            parts.append(f"{len(self.made_up)} made up" + (" (allowed)" if self.allow_made_up else ""))
        return f"<Replay: {self._verdict()}{': ' if parts else ''}{', '.join(parts)}>"

    def __str__(self) -> str:
        """One line if every call matched on the user's data, else one line per problem."""
        if not self.checked:
            lines = ["replay unchecked (check=False): no result was compared with its record; not ok"]
        elif self.mismatches:
            lines = [f"replay found {len(self.mismatches)} mismatch(es) between recorded and real results:"]
            lines += [f"  {m}" for m in self.mismatches]
        else:
            lines = [
                f"replay {'ok' if self.ok else 'not ok'}: every recorded result matched the real kernel"
                + (", but" if not self.ok else "")
            ]
        if self.made_up:
            lines.append(
                f"replay made up {len(self.made_up)} input(s) or random stream(s)"
                + (
                    " (allowed: values are not eager's)"
                    if self.allow_made_up
                    else "; its values are not eager's (allow_made_up=True accepts this)"
                )
                + ":"
            )
            lines += [f"  {m}" for m in self.made_up[:_SHOWN]]
            if len(self.made_up) > _SHOWN:
                lines.append(f"  ... and {len(self.made_up) - _SHOWN} more (Replay.made_up)")
        return "\n".join(lines)


_SHOWN = 8  # made-up entries printed; a model without its weights has hundreds
