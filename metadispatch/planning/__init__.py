"""Plans that trace the step again until they find an answer: the largest batch, what to checkpoint, a training configuration.

Each planner traces the user's step (``tracing``) under a candidate -- a
batch size, a set of modules to checkpoint, a prompt length -- and reads
the traces with ``analysis``: ``batch`` (``md.max_batch``: the largest
batch that fits a GPU, guessed first by ``affine`` from small traces),
``ac`` (``md.plan_ac``, ``md.apply_ac``, ``md.remove_ac``: what
to checkpoint to fit a budget), ``tp`` (one rank of a model split over
tensor-parallel GPUs, for md.plan and ``serving``), ``train`` (``md.plan``: the fastest training configuration that
fits on N logical GPUs, which it returns as ``table``'s ranked
``PlanTable`` of ``Candidate``, each mesh's rank programs traced by
``programs``; ``pipeline_candidates`` makes and scores its pipeline configurations
of the stages ``pipeline`` cuts;
``parallel_dims`` searches and builds sequence, context and expert
parallelism).  The
analyses themselves stay pure functions of a trace.  May import
``analysis`` and below.
"""
