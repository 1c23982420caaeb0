"""The logical N-rank world: ``torch.distributed`` as one rank of it sees it.

``world`` (the world and what it patches while a mode is entered),
``ddp_setup`` (DDP's C++ setup helpers as the collectives they run),
``fsdp_chunks`` (the chunks of a parameter a rank reads), ``fsdp_storage``
(FSDP2's storage frees, made visible to dispatch), ``pipeline`` (a pipeline
stage's warm-up vote, answered for a stage traced alone), ``context_parallel``
(ring attention's variants checked against a real run; the rest refused),
``inflight`` (functional collectives' buffers held until they are waited on),
``expert_parallel`` (transformers' fused MoE experts split over EP ranks,
dispatched by dropless all-to-all).
May import ``gpu`` and below.
"""
