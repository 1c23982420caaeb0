"""The verbs that trace a user's function: ``md.trace``, ``md.tracer``, ``md.to_meta``.

``tracer`` runs the function under a recording MetaMode with the user's
module state stood in for (``mode.standins``, which MetaMode itself uses).
May import ``rules`` and below.
"""
