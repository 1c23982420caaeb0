"""The engine: one aten call, from its arguments to its record.

``dispatch`` (convert inputs, find the device, route, wrap, record),
``hit`` (the cache-hit path: one pass from arguments to record),
``call`` (the Call object every stage reads),
``router`` (which stage answers: user rule, built-in rule, meta kernel,
decomposition), ``registry`` (the rule tables), ``cache`` (output metadata
by call, shared by every mode; ``recipe``: how an entry rebuilds the
outputs), ``record`` (the recorder: calls into
``OpCall`` records; ``backward_modules``: the module of a backward call),
``rngstate`` (the random streams a run draws from).
May import ``world``, ``gpu``, ``values``, ``tensor`` and below; nothing
here knows the mode.
"""
