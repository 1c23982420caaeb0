"""What replay checks of a trace before its kernels run: what it will cost, what each kernel will follow.

A trace is a program, and a file anyone wrote can aim one at the machine
(docs/trace-format.md, "Threat model").  ``positions`` classes every op a
file may name by what its values become (data, a position its kernel
checks, one replay checks, or refused), reading ``spec/position_data.py``
(the families whose values are data).  Before anything runs: ``budget`` (the
limits), ``costs`` (the walk that sizes each call), ``work`` and
``sizes`` (one call's work and scratch, list and data-dependent sizes).
While a loaded trace runs: ``fences`` around each call, with
``index_checks`` (the registry of checks before the calls that need one)
holding ``value_checks`` (the index-like values a kernel follows) and
``shape_checks`` (the shapes a kernel trusts).  Nothing here runs a trace;
``execution`` calls these.  May import ``tracing`` and below.
"""
