"""Serving plans from traced prefill and decode steps, read from the model's own cache code.

``kv`` (``md.kv_layout``: the KV cache a model's attention writes, per
layer kind) and ``serve`` (``md.serve_plan``: weights, KV cache,
concurrency and latency from a traced prefill and decode; one rank of
it split over tensor-parallel GPUs by ``planning.tp``, which md.plan
shares).  A room of its own because it answers another question than
training plans (``planning``): how many sequences fit, not which step
configuration.  May import ``planning`` and below.
"""
