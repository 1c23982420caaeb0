"""A model cut into pipeline stages, as torch.distributed.pipelining users cut it.

``split`` cuts transformers decoders built as LLaMA is, GPT-2 and (through
``families``) encoders and vision models into a first stage (the stem and
the first blocks), middle blocks and a last stage (the last blocks and the
head), with the activation shapes that flow between them.  ``--pp`` in the
CLI and md.plan's pipeline candidates (``planning``) trace those stages.
Imports only ``errors`` and torch.
"""
