"""The logical GPU: what a CUDA device answers, on a host without one.

``logical_cuda`` (torch.cuda's host-side answers), ``cuda_answers`` (those
answers for a MetaMode's GPU, in its thread only), ``autocast`` (CUDA's
autocast policy, above autograd), ``gpu_composites`` (C++ composites that
branch on ``is_cuda()``), ``inside`` (torch's Python functions seen inside,
so their calls meet the mode), ``fastpath`` (attention modules' inference
fast paths as eager takes them).  May import ``values`` and below.
"""
