"""Running a trace for real: ``md.replay`` and ``md.materialize``.

``leaves`` binds the trace's leaves to real tensors, ``program`` compiles
the calls to straight-line Python, ``replay`` runs and checks them,
``materialize`` replays a module's construction.  May import ``tracing``,
``core``, ``ir`` and below.
"""
