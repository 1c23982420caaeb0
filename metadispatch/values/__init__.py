"""What is known of a MetaTensor's values, when anything is.

``known`` (tensors built from constants keep their contents), ``bounds``
(ranges of values when the values are not known), ``realrun`` (the real CPU
kernel on made-up inputs, the reference), ``literals`` (``torch.tensor(data,
device=D)`` as C++ builds it), ``initializers`` (data-dependent initialisers
recorded as one call), ``composites`` (C++ composites that read values
through a data pointer, in Python; ``packed_rnn``, the CPU kernel's RNN over a
PackedSequence), ``assume`` (a declared policy's answers
for the value reads of a generation loop: ``md.GenerateAssumptions``),
``routing`` (a declared MoE routing's token counts: ``md.RoutingAssumption``), ``fed`` (data a step is
fed, known whatever its size: the command line's token ids).  May import ``tensor`` and below.
"""
