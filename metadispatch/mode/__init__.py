"""MetaMode and what entering it changes.

``mode`` (MetaMode: the dispatch mode, its entry and exit as an undo
ledger, the per-thread torch-function swap of real tensors), ``standins``
(the user's module state stood in for and put back), ``reach`` (what a
user's function can reach), ``unseen`` (torch's Python functions no mode
sees, guarded), ``modules`` (which module is running), ``fakecompat``
(FakeTensorMode's options, accepted where MetaMode behaves alike).  May
import ``core`` and below.
"""
