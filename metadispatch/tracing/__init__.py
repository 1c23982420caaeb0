"""The verbs that trace a user's function: ``md.trace``, ``md.tracer``, ``md.to_meta``.

``tracer`` runs the function under a recording MetaMode with the user's
module state stood in for (``standins``, which MetaMode itself uses), ``warmup=N`` steps first
for the steady state, and leaves everything the function can reach as it
was: ``reach`` is that walk (modules, optimizers, tensors, generators, the
closures and globals of functions), which ``md.testing.snapshot``,
``md.check`` and ``md.materialize`` walk too; ``leafviews`` binds a done
trace's unnamed leaves as views of the named tensors they lie on.  ``marks`` is ``md.mark``, a
point of the traced code an analysis can start at.
May import ``rules`` and below.
"""
