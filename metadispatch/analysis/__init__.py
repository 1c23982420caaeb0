"""What a trace tells you: FLOPs, memory, time, communication, tables, exports.

Pure functions of a :class:`~metadispatch.Trace`; nothing here runs
(``live`` watches a real run), and only ``batch``, ``ac``, ``kv`` and ``serve`` trace.  ``flops`` (torch's formulas on the
recorded shapes), ``memory`` (live bytes by category and module), ``roles``
(what each storage of a step is for), ``allocator`` and ``allocconfig``
(the CUDA caching allocator simulated, and its options), ``reserved``
(reserved memory through it), ``workspace`` (kernel workspaces no tensor
holds), ``fit`` (will the step fit on a GPU), ``batch``
(``md.max_batch``: the largest batch that fits) and ``ac`` (``md.plan_ac``:
what to checkpoint to fit a budget), ``cuda_counters``
(``torch.cuda``'s memory counters for a logical GPU), ``runtime`` (the
step's time on a named GPU; ``bubble``, a pipeline's, from its stages'
traces) and ``calibrate (its efficiency table fitted
to measurements), ``comms`` and ``collective_cost`` (a rank's collectives
and their time), ``tables`` (printed tables), ``export`` (Perfetto JSON,
memory plots), ``live`` (``md.LiveStorages``, the same accounting on a real
run), ``kv`` (``md.kv_layout``: the KV cache a model's attention writes,
per layer kind) and ``serve`` (``md.serve_plan``: a serving plan from
traced prefill and decode).  May import ``execution`` and below.
"""
