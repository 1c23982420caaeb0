"""MetaMode and what entering it changes.

``mode`` (MetaMode, the dispatch mode), ``entry`` (one entry's undo steps
and which mode holds the thread's dispatch slot), ``swap`` (the per-thread
torch-function swap of real tensors), ``devices`` (the device a
factory or a move names, checked against the logical machine), ``ledger`` (every process-wide patch,
claimed per thread) and ``patches`` (the groups of patches and which mode
claims which; the stand-ins themselves are the ``standins`` room's),
``unseen`` (torch's Python functions no mode
sees, guarded), ``realcode`` (torch's code run for real in a mode: a
DataLoader's bookkeeping), ``modules`` (which module is running), ``fakecompat``
(FakeTensorMode's options, accepted where MetaMode behaves alike).  May
import ``core`` and below.
"""
