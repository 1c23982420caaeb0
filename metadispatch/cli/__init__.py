"""The command line, ``metadispatch trace|summary|replay|check|serve|plan``.

``main`` routes: it builds the parser from one module per command and
turns what a command raised into its exit code.  The commands:
``trace_cmd`` traces a model's step and prints its report (``--world-size``:
``plan`` traces one rank of an N-GPU training step, wrapping the blocks
``blocks`` finds in the model or ``--blocks`` names; ``--pp``: ``pipeline``
steps the stages ``stages`` cuts the model into); ``summary`` prints a
saved trace's report (and reads files for ``replay``, which runs one);
``check`` runs ``md.check``; ``serve`` prints ``md.serve_plan`` for a
transformers causal LM, ``planner`` ``md.plan``'s ranked training
configurations.  What they share: ``options`` (argument types and the
parser class), ``terminal`` (the progress line, failures and printing),
``targets`` (what to trace: the built-in LLaMA of ``llama``,
``MODULE:CALLABLE``, a transformers config) and ``steps`` (the optimizer
and the step traced: ``--optimizer``, ``--steps``).  The top stage: may
import anything in the package.
"""
