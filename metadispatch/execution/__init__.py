"""Running a trace for real: ``md.replay`` and ``md.materialize``.

``inputs`` refuses what cannot be bound, ``leaves`` binds the trace's
leaves to real tensors (or makes them up, listed), ``streams`` gives the
random ops eager's generator states, ``program`` compiles the calls to
straight-line Python, ``replay`` runs and checks them into a ``result``,
``materialize`` replays a module's construction (docs/replay.md).  What a
trace may cost and write is known before it runs: ``budget`` (its limits),
``costs`` (the walk that sizes each call), ``work`` and ``sizes`` (one
call's work, scratch and list or data-dependent sizes), ``writes`` (which
leaves it writes, and the guard); ``fences`` check a file's calls while they
run.  May import ``tracing``, ``core``, ``ir`` and below.
"""
