"""The command line, ``metadispatch trace|summary|replay|check|serve|plan``.

``main`` parses and runs; ``targets`` builds what to trace (the built-in
LLaMA of ``llama``, ``MODULE:CALLABLE``, a transformers config); ``steps``
the optimizer and the step traced (``--optimizer``, ``--steps``); ``plan``
traces one rank of an N-GPU training step (``--world-size``), wrapping the
blocks ``blocks`` finds in the model (or ``--blocks`` names); ``serve``
prints ``md.serve_plan`` for a transformers causal LM, ``planner``
``md.plan``'s ranked training configurations.  The top
stage: may import anything in the package.
"""
