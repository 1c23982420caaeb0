"""Finding out why: ``md.check``, its report, ``md.verify_rule``, ``md.diff``.

``check`` traces past ops no rule answers and ``recheck`` re-runs every call
on CPU; ``report`` presents what they found; ``verify`` checks one rule;
``diff`` compares two traces.  May import ``execution``, ``tracing``,
``analysis``, ``core``, ``ir`` and below.
"""
