"""Running a trace for real: ``md.replay`` and ``md.materialize``.

``program`` compiles the calls to straight-line Python (``bindings``: the
Python binding proven the same as the op; ``reference``: the plain loop it
is tested against), ``replay`` runs them on what ``binding`` bound,
``matching`` checks each call against its record, into a ``result``
(``timing``: per-call times); ``uninit`` finds memory read before any call
wrote it, ``collectives`` runs a rank's collectives over a real process
group, ``materialize`` replays a module's construction, the part of the
trace it needs (``slicing``), or loads it from a checkpoint; ``audit`` says what a
load left wrong.  What a file's trace may cost and which
values its kernels follow is checked by ``trust``, below.  May import
``binding`` and below.
"""
