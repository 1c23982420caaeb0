"""Running a trace for real: ``md.replay`` and ``md.materialize``.

``inputs`` refuses what cannot be bound, ``leaves`` binds the trace's
leaves to real tensors (or makes them up, listed), ``devices`` says where
each logical device runs, ``streams`` gives the random ops eager's
generator states, ``program`` compiles the calls to straight-line Python
(``bindings``: the Python binding proven the same as the op; ``reference``:
the plain loop it is tested against), ``replay``
runs and checks them into a ``result`` (``timing``: per-call times),
``collectives`` runs a rank's collectives over a real process group,
``materialize`` replays a module's construction, the part of the trace it
needs (``slicing``), or loads it from a checkpoint; ``audit`` says what a
load left wrong.  What a trace may cost and write is known before it
runs: ``budget`` (its limits), ``costs`` (the walk that sizes each call),
``work`` and ``sizes`` (one call's work, scratch and list or
data-dependent sizes), ``writes`` (which leaves it writes, and the guard),
``uninit`` (memory read before any call wrote it); ``fences`` check a
file's calls while they run, with ``index_checks`` (the registry of
checks on the index-like values and the shapes a kernel follows, held by
``value_checks`` and ``shape_checks``) before each call that needs one.  May import ``tracing`` and below.
"""
