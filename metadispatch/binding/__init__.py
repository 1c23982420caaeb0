"""What replay is handed, bound to the trace: the caller's tensors, devices, random streams.

``inputs`` refuses what cannot be bound, by name; ``leaves`` binds the
trace's leaves to real tensors (the caller's, a kept constant, or made up
and listed), copying those the trace writes; ``writes`` (which leaves a
trace writes, and the guard that keeps every other caller's tensor
unwritten: Note [Replay never writes its inputs]); ``devices`` (where each
logical device runs); ``streams`` (the random streams, set to eager's
states or made up and listed).  Nothing here runs a call.  May import
``trust`` and below.
"""
