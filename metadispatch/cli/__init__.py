"""The command line, ``metadispatch trace|summary|replay|check``.

``main`` parses and runs; ``targets`` builds what to trace (the built-in
LLaMA of ``llama``, ``MODULE:CALLABLE``, a transformers config); ``steps``
the optimizer and the step traced (``--optimizer``, ``--steps``); ``plan``
traces one rank of an N-GPU training step (``--world-size``), wrapping the
blocks ``blocks`` finds in the model (or ``--blocks`` names).  The top
stage: may import anything in the package.
"""
