"""What a trace tells you: FLOPs, memory, tables, exports.

Pure functions of a :class:`~metadispatch.Trace`; nothing here traces or
runs.  May import ``ir`` and below.
"""
