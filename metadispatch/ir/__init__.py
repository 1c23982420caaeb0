"""The trace as data: records, the :class:`Trace`, its file form, repro snippets.

The lowest stage: everything else reads or writes these records.  Modules
here may import only ``metadispatch._compat``, ``metadispatch.errors`` and
each other; they know nothing of MetaTensors, modes or replay.
"""
