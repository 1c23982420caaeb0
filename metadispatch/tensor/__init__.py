"""The MetaTensor: a tensor that holds no data but reports a real device.

``tensor`` (MetaTensor, its logical device, the per-thread dispatch
state), ``convert`` (a real tensor's stand-in, memoised), ``state`` (the one object a MetaTensor
carries: its device, record, name and value knowledge), ``describe`` (how a call's inputs read in an
error message), ``lostcopy`` (a real tensor copied into a MetaTensor outside a mode, warned of).  May import ``ir``, ``spec`` and below.
"""
