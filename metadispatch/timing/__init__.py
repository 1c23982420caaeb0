"""How long a traced step takes: on a named GPU, in a pipeline, across ranks.

Pure functions of a :class:`~metadispatch.Trace` and a GPU profile, as the
analyses are, reading their FLOPs and bytes (``analysis``): ``runtime``
(``md.runtime``: each call's time on a named GPU, the step's), ``bubble``
(a pipeline's bubble, from its stages' traces), ``calibrate`` (the
efficiency table fitted to measured times), ``comms`` (``md.comms``: a
rank's collectives and their bytes) and ``collective_cost`` (a
collective's time over the links between ranks).  May import
``analysis`` and below.
"""
