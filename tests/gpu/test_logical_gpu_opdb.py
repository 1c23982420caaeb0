"""Every op_db sample on a logical GPU dispatches what C++ dispatches for CUDA.

The reference is C++ itself: on a CUDA build of torch (the 2.14 leg's wheel,
which runs without a GPU), FakeTensors on ``cuda`` carry CUDA's keys, so
every composite takes CUDA's branch and a ``TorchDispatchMode`` inside the
FakeTensorMode logs what a GPU would dispatch.  A logical GPU's MetaTensor is
a meta tensor to C++ (Note [Logical device]); each branch where that made it
differ is an override or a rule now (softmax of half to float, dropout,
rms_norm, batch norm, logsigmoid, numbers written into a tensor).  The
differences left are listed with their reasons; a new one fails here.
"""

import itertools

import pytest
import torch

import metadispatch as md
from metadispatch.testing import trace_calls
from tests.fake_cuda import CudaLog
from tests.gpu.test_autocast_cuda import needs_fake_cuda

KNOWN = {
    # A FakeTensor on a host without a GPU cannot ask which fused attention
    # kernel the device has and takes the math one; a logical GPU answers as
    # its profile (tests/test_sdp_choice.py).
    "nn.functional.scaled_dot_product_attention": "the oracle cannot choose SDPA's kernel",
    # An index tensor from the user's scope stays on the CPU on a GPU and is
    # copied to it by indexing; a logical GPU takes it where the mode is.
    "__getitem__": "a CPU index tensor's copy to the GPU is not recorded",
    "nn.functional.embedding_bag": "per_sample_weights with padding_idx: CUDA's order of the index copy",
    # An empty matrix: C++ answers with at::zeros, the override with new_zeros.
    "linalg.matrix_rank": "zeros of an empty input made another way",
}


def _key(calls):
    return [(c.op, tuple((o[0], o[1]) for o in c.outputs)) for c in calls if c.op != "aten.lift_fresh.default"]


@needs_fake_cuda
@pytest.mark.slow
def test_opdb_samples_on_a_logical_gpu_are_what_cuda_dispatches():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.common_methods_invocations import op_db

    equal, differ = 0, {}
    for info in op_db:
        if torch.float32 not in info.supported_dtypes("cuda"):
            continue
        for s in itertools.islice(info.sample_inputs("cpu", torch.float32), 2):
            try:
                with FakeTensorMode(allow_non_fake_inputs=True):
                    fake = s.transform(lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t)
                    with CudaLog() as log:
                        info.op(fake.input, *fake.args, **fake.kwargs)
            except Exception:
                continue  # C++ refuses the sample on CUDA (or FakeTensor cannot run it)
            trace = md.tracer(device="cuda")(lambda s=s, op=info.op: op(s.input, *s.args, **s.kwargs))
            if _key(log.calls) == _key(trace_calls(trace)):
                equal += 1
            else:
                differ.setdefault(info.name, 0)
                differ[info.name] += 1
    assert set(differ) <= set(KNOWN), {n: differ[n] for n in set(differ) - set(KNOWN)}
    assert equal > 1200
