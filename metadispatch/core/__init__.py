"""The engine: MetaTensor, the mode, one call's dispatch and its router.

``tensor`` (MetaTensor, its logical device) at the bottom; ``schema``,
``registry``, ``source``, ``modules``, ``fakecompat`` beside it; then
``realrun`` (the real kernel on made-up inputs), ``known`` (known values),
``router`` and ``composites``, ``cache``, ``record`` (the recorder),
``dispatch``, ``standins`` (the user's state swapped out and put back) and
``reach`` (what a function can reach) and, on top, ``mode`` (MetaMode).  May import ``ir``,
``_compat`` and ``errors``; nothing above.
"""
