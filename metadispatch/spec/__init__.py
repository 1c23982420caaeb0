"""What is known before anything runs: facts about ops and GPUs, and our own ops.

``schema`` (each op's facts from its schema: aliasing, writes, device
arguments, computed once and cached), ``profiles`` (GPU datasheets: what a
named GPU decides for memory, time and kernel choices), ``ownops``
(metadispatch's own ops, which a trace records as one call),
``position_data`` (the op families whose tensors' values are data, never
positions a kernel follows: read by ``trust/positions.py``).  May import
``_compat`` and ``errors`` only.
"""
