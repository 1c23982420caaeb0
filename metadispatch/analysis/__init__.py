"""What a trace tells you: FLOPs, memory, will it fit, tables, exports.

Pure functions of a :class:`~metadispatch.Trace`; nothing here runs
(``live`` watches a real run).  ``flops`` (torch's formulas on the
recorded shapes), ``memory`` (live bytes by category and module), ``roles``
(what each storage of a step is for), ``allocator`` and ``allocconfig``
(the CUDA caching allocator simulated, and its options), ``reserved``
(reserved memory through it), ``workspace`` (kernel workspaces no tensor
holds), ``fit`` (will the step fit on a GPU), ``cuda_counters``
(``torch.cuda``'s memory counters for a logical GPU), ``tables`` (printed
tables), ``export`` (Perfetto JSON, memory plots), ``live``
(``md.LiveStorages``, the same accounting on a real run), ``steps`` (the
prefill and decode steps of a traced ``generate()`` and their cache).  How long the
step takes is ``timing``, above; the planners that trace again until they
find an answer are ``planning``.  May import ``execution`` and below.
"""
