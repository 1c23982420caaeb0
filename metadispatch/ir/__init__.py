"""The trace as data: records, the :class:`Trace`, its file form, repro snippets.

``records`` (tensor records and leaves), ``calls`` (one call, ``OpCall``),
``rng`` (random streams as data), ``assumptions`` (a value a trace
assumed, ``Assumption``), ``text`` (plain text and tables),
``trace`` (the trace and its printed form), ``cut`` (a trace from one of
its calls on: the steady-state step, the step after a mark), ``liveness`` (where each id is last used), ``compare`` (recorded metadata
against a real tensor: the one ``Mismatch``), ``serialize`` (versioned
JSON files), ``reader`` and ``decode`` (a file's values, checked and
decoded without running anything) and ``repro`` (one call as a snippet).
Everything above reads or writes these records; modules here know
nothing of MetaTensors, modes or replay.  May import ``spec`` and below.
"""
