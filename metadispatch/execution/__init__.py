"""Running a trace for real: ``md.replay`` and ``md.materialize``.

``inputs`` refuses what cannot be bound, ``leaves`` binds the trace's
leaves to real tensors (or makes them up, listed), ``devices`` says where
each logical device runs, ``streams`` gives the random ops eager's
generator states, ``program`` compiles the calls to straight-line Python
(``bindings``: the Python binding proven the same as the op; ``reference``:
the plain loop it is tested against), ``replay``
runs them, ``matching`` checks each call against its record, into a ``result`` (``timing``: per-call times),
``collectives`` runs a rank's collectives over a real process group,
``materialize`` replays a module's construction, the part of the trace it
needs (``slicing``).  Before it runs, ``writes`` (which leaves it writes, and the guard)
and ``uninit`` (memory read before any call wrote it); what a file's
trace may cost and which values its kernels follow is checked by
``trust``, below.  May import ``trust`` and below.
"""
