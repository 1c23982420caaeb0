"""What a trace stands in for the user's real tensors and modules, and how it gives them back.

``standins`` (StandIns: a MetaTensor for each real tensor a step reaches,
made before autograd sees it, one set per thread; the optimizer states and
foreach groups it copies) and ``snapshot`` (a module or container as it
was, put back by identity when the trace ends).  A room below ``mode``
because they hold the user's data and nothing of dispatch: MetaMode
enters them, ``tracing`` saves through them.  May import ``core`` and below.
"""
