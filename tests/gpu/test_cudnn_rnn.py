"""RNNs on a logical GPU record cuDNN's kernels: Note [cuDNN RNNs on a logical GPU].

No GPU runs here, and FakeTensorMode cannot be the reference: on torch 2.14.1's
CUDA build, FakeTensors on ``cuda`` reach the composite's ``try_get_weight_buf``,
which asks cuDNN for a handle and fails without a driver.  So the op
sequence is derived from torch's C++ (``use_cudnn`` in
aten/src/ATen/native/RNN.cpp, ``_cudnn_impl``/``_cudnn_rnn``/
``_cudnn_rnn_backward`` in aten/src/ATen/native/cudnn/RNN.cpp, the
``_cudnn_rnn`` entry of derivatives.yaml); what torch itself can answer is
compared with torch: the shapes and dtypes of every output and gradient
against an eager CPU run of the same module, and ``_cudnn_rnn``'s outputs
against torch's own meta kernel.
"""

import dataclasses

import expecttest
import pytest
import torch
from torch import nn

import metadispatch as md
from metadispatch.rules.cudnn_rnn import GRU, LSTM, RNN_RELU, RNN_TANH, weight_count
from metadispatch.spec import profiles

pytestmark = pytest.mark.filterwarnings("ignore:PyTorch was compiled without cuDNN")

MODES = {nn.LSTM: LSTM, nn.GRU: GRU}
CASES = {
    "lstm": lambda: nn.LSTM(4, 6),
    "lstm-2layer-bidir-batch-first": lambda: nn.LSTM(4, 6, 2, bidirectional=True, batch_first=True),
    "lstm-proj": lambda: nn.LSTM(4, 6, 2, proj_size=3),
    "lstm-proj-no-bias-bidir": lambda: nn.LSTM(4, 6, 2, proj_size=3, bias=False, bidirectional=True),
    "lstm-dropout": lambda: nn.LSTM(4, 6, 3, dropout=0.5),
    "gru-bidir-batch-first": lambda: nn.GRU(4, 6, 2, bidirectional=True, batch_first=True),
    "gru-no-bias": lambda: nn.GRU(4, 6, bias=False),
    "rnn-tanh": lambda: nn.RNN(4, 6, 2),
    "rnn-relu-bidir": lambda: nn.RNN(4, 6, nonlinearity="relu", bidirectional=True),
}


def _mode(m) -> int:
    if isinstance(m, nn.RNN):
        return RNN_TANH if m.nonlinearity == "tanh" else RNN_RELU
    return MODES[type(m)]


def _step(m, x):
    out, _ = m(x)
    out.square().sum().backward()
    return out


def _input(m, dtype=torch.float32):
    return torch.randn((3, 5, 4) if m.batch_first else (5, 3, 4), dtype=dtype)


def _calls(trace, op):
    return [c for c in trace.calls if c.op == op]


@pytest.mark.parametrize("case", CASES)
def test_cudnn_rnn_forward_and_backward_are_cudnns(case):
    torch.manual_seed(0)
    m = CASES[case]()
    x = _input(m)
    trace = md.tracer(device="cuda")(_step, m, x)
    ops = [c.op for c in trace.calls]
    (fw,) = _calls(trace, "aten._cudnn_rnn.default")
    (bw,) = _calls(trace, "aten._cudnn_rnn_backward.default")
    assert not {"aten.addmm.default", "aten.mm.default", "aten.unsafe_split.Tensor"} & set(ops)  # no per-step cells
    # _cudnn_impl's arguments: the modules' own, weight_buf None (MetaTensors are never flat), batch sizes empty
    proj = getattr(m, "proj_size", 0)
    hidden, layers = m.hidden_size, m.num_layers
    assert fw.args[2] == (4 if m.bias else 2) + (proj > 0) and fw.args[3] is None
    assert fw.args[6:14] == (_mode(m), hidden, proj, layers, m.batch_first, m.dropout, True, m.bidirectional)
    # The output's shape and dtype are eager's; its layout is cuDNN's: made
    # sequence-first, transposed for batch_first (``_cudnn_rnn``).
    eager = m(x)[0]
    out = fw.output_metas[0]
    assert (out.shape, out.dtype) == (eager.shape, eager.dtype)
    seq_first = torch.empty(out.shape[1], out.shape[0], out.shape[2]).transpose(0, 1)
    assert out.stride == (seq_first.stride() if m.batch_first else eager.contiguous().stride())
    # the flat weight buffer: every weight and two biases per layer
    dirs = 2 if m.bidirectional else 1
    biases = 0 if m.bias else 2 * layers * dirs * {LSTM: 4, GRU: 3}.get(_mode(m), 1) * hidden
    assert fw.output_metas[4].shape == (sum(p.numel() for p in m.parameters()) + biases,)
    # backward is handed what derivatives.yaml hands it, and makes eager's gradients
    assert bw.args[3] is fw.outputs[4] and bw.args[20] is fw.outputs[3]
    _step(m, x)
    assert sorted(trace.grads) == sorted(n for n, _ in m.named_parameters())
    for name, p in m.named_parameters():
        assert (trace.grads[name].shape, trace.grads[name].dtype) == (p.grad.shape, p.grad.dtype), name


def test_cudnn_rnn_weight_gradients_are_views_of_one_buffer_only_with_biases():
    # _cudnn_rnn_backward_weight: views into dw when its stride0 is the
    # module's (biases present), fresh tensors otherwise (_copyParams).
    for bias, shared in ((True, True), (False, False)):
        m = nn.LSTM(4, 6, 2, bias=bias)
        trace = md.tracer(device="cuda")(_step, m, _input(m))
        (bw,) = _calls(trace, "aten._cudnn_rnn_backward.default")
        grads = bw.outputs[3]
        assert len({g.storage for g in grads}) == (1 if shared else len(grads))
        offsets = [g.storage_offset for g in grads]
        if not shared:
            assert offsets == [0] * len(grads)
            continue
        # cuDNN's weight space, as a real H100 laid out this LSTM's gradients
        # (tools/gpu_conformance.py): both layers' matrices, then their biases
        w_ih0, w_hh0, w_ih1, w_hh1 = 4 * 6 * 4, 4 * 6 * 6, 4 * 6 * 6, 4 * 6 * 6
        mats = w_ih0 + w_hh0 + w_ih1 + w_hh1
        assert offsets == [0, w_ih0, mats, mats + 24, w_ih0 + w_hh0, w_ih0 + w_hh0 + w_ih1, mats + 48, mats + 72]


def test_cudnn_rnn_weight_gradients_as_an_h100_lays_them_out():
    # The offsets a real H100 (torch 2.11, cuDNN 9.19) gave nn.GRU(16, 32,
    # bidirectional=True)'s gradients in the conformance zoo's step.
    m = nn.GRU(16, 32, bidirectional=True)
    trace = md.tracer(device="cuda")(_step, m, torch.randn(7, 4, 16))
    (bw,) = _calls(trace, "aten._cudnn_rnn_backward.default")
    names = [n for n, _ in m.named_parameters()]
    got = dict(zip(names, (g.storage_offset for g in bw.outputs[3])))
    assert got == {
        "weight_ih_l0": 0,
        "weight_hh_l0": 1536,
        "bias_ih_l0": 9216,
        "bias_hh_l0": 9312,
        "weight_ih_l0_reverse": 4608,
        "weight_hh_l0_reverse": 6144,
        "bias_ih_l0_reverse": 9408,
        "bias_hh_l0_reverse": 9504,
    }


def test_cudnn_rnn_outputs_agree_with_torchs_meta_kernel():
    # torch's meta kernel for _cudnn_rnn knows the shapes; it says contiguous
    # for batch_first, where cuDNN transposes (the one difference, on purpose).
    m = nn.LSTM(4, 6, 2, proj_size=3, batch_first=True)
    trace = md.tracer(device="cuda")(_step, m, _input(m))
    (fw,) = _calls(trace, "aten._cudnn_rnn.default")
    meta = [torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device="meta") for t in fw.inputs]
    args = list(fw.args)
    args[0], args[4], args[5] = (meta[fw.inputs.index(fw.args[i])] for i in (0, 4, 5))
    args[1] = [meta[fw.inputs.index(w)] for w in fw.args[1]]
    args[3] = torch.empty(fw.output_metas[4].shape, device="meta")
    theirs = torch.ops.aten._cudnn_rnn.default(*args)
    for ours, t in zip(fw.output_metas, theirs):
        assert (ours.shape, ours.dtype) == (t.shape, t.dtype)
    assert fw.output_metas[0].stride != theirs[0].stride() and fw.output_metas[1].stride == theirs[1].stride()


def test_cudnn_rnn_disabled_or_ineligible_keeps_the_generic_path():
    m = nn.GRU(4, 6)
    x = _input(m)
    on = md.tracer(device="cuda")(_step, m, x)
    with torch.backends.cudnn.flags(enabled=False):  # the same process: nothing cached decides
        off = md.tracer(device="cuda")(_step, m, x)
    assert _calls(on, "aten._cudnn_rnn.default") and not [c for c in off.calls if "cudnn" in c.op]
    assert _calls(off, "aten.addmm.default")
    empty = md.tracer(device="cuda")(lambda m, x: m(x)[0], m, torch.randn(5, 0, 4))  # no elements: no cuDNN
    assert not [c for c in empty.calls if "cudnn" in c.op]


def test_cudnn_rnn_bfloat16_needs_sm80():
    volta = dataclasses.replace(md.gpu_profile("a100-40gb"), name="test-rnn-sm70", compute_capability=(7, 0))
    md.register_gpu(volta)
    try:
        for gpu, dtype, cudnn in (
            ("h100", torch.bfloat16, True),
            ("test-rnn-sm70", torch.bfloat16, False),
            ("test-rnn-sm70", torch.float16, True),
        ):
            m = nn.LSTM(4, 6).to(dtype)
            trace = md.tracer(device="cuda", gpu=gpu)(_step, m, _input(m, dtype))
            assert bool(_calls(trace, "aten._cudnn_rnn.default")) == cudnn, (gpu, dtype)
    finally:
        profiles._PROFILES.pop("test-rnn-sm70", None)


def test_cudnn_rnn_refuses_mixed_dtypes_as_the_kernel_does():
    # nn.LSTM checks first; the op itself (check_attributes in RNN.h) for other callers
    m = nn.LSTM(4, 6)

    def call(x, h):
        return torch.lstm(x, (h, h), m._flat_weights, True, 1, 0.0, True, False, False)

    with pytest.raises(RuntimeError, match="Input and parameter tensors are not the same dtype"):
        md.tracer(device="cuda")(call, torch.randn(5, 3, 4).double(), torch.zeros(1, 3, 6).double())


def test_cudnn_rnn_without_a_mode_answers_the_same():
    # Note [Composite overrides without a mode]: MetaTensors alone take the same path.
    m, x, h0 = nn.LSTM(4, 6, 2, dropout=0.2, batch_first=True), torch.randn(3, 5, 4), torch.zeros(2, 3, 6)
    traced = md.tracer(device="cuda")(lambda m, x, h: m(x, (h, h)), m, x, h0).output_meta[0]
    meta = md.to_meta(m, device="cuda")
    out, _ = meta(md.to_meta(x, device="cuda"), (md.to_meta(h0, device="cuda"),) * 2)
    assert (out.shape, out.stride(), out.device) == (traced.shape, traced.stride, traced.device)
    out.sum().backward()
    assert meta.weight_hh_l1.grad.shape == m.weight_hh_l1.shape


def test_cudnn_rnn_logical_cpu_is_unchanged():
    m = nn.LSTM(4, 6, 2)
    trace = md.tracer(device="cpu")(_step, m, _input(m))
    assert _calls(trace, "aten.mkldnn_rnn_layer.default") and not [c for c in trace.calls if "cudnn" in c.op]


def test_cudnn_rnn_dropout_state_is_made_once_and_handed_to_every_call():
    # get_dropout_state: made by the first training call with dropout, then
    # handed to every cuDNN RNN call on the device (dropout or not).
    a, b = nn.LSTM(4, 6, 2, dropout=0.5), nn.GRU(6, 6)

    def step(x):
        b(a(x)[0])[0].sum().backward()

    trace = md.tracer(device="cuda")(step, torch.randn(5, 3, 4))
    (init,) = _calls(trace, "aten._cudnn_init_dropout_state.default")
    assert init.args[:2] == (0.5, True)
    calls = _calls(trace, "aten._cudnn_rnn.default") + _calls(trace, "aten._cudnn_rnn_backward.default")
    assert len(calls) == 4 and all(c.args[-1 if "backward" not in c.op else 19] is init.outputs[0] for c in calls)
    again = md.tracer(device="cuda")(_step, a, torch.randn(5, 3, 4))  # a trace is a fresh process's
    assert len(_calls(again, "aten._cudnn_init_dropout_state.default")) == 1


def test_cudnn_rnn_inference_has_no_reserve_and_refuses_backward_in_eval():
    m = nn.LSTM(4, 6).eval()
    with torch.no_grad():
        trace = md.tracer(device="cuda")(lambda m, x: m(x)[0], m, _input(m))
    (fw,) = _calls(trace, "aten._cudnn_rnn.default")
    assert fw.args[12] is False and fw.output_metas[3].shape == (0,)
    with pytest.raises(RuntimeError, match="only be called in training mode"):  # as on a GPU
        md.tracer(device="cuda")(_step, m, _input(m))


def test_cudnn_rnn_retain_graph_clones_the_reserve():
    # derivatives.yaml: ``retain_variables ? result3.clone() : result3``
    m = nn.GRU(4, 6)
    trace = md.tracer(device="cuda")(lambda m, x: m(x)[0].sum().backward(retain_graph=True), m, _input(m))
    (fw,) = _calls(trace, "aten._cudnn_rnn.default")
    (clone,) = [c for c in trace.calls if c.op == "aten.clone.default" and c.args[0] is fw.outputs[3]]
    (bw,) = _calls(trace, "aten._cudnn_rnn_backward.default")
    assert bw.args[20] is clone.outputs[0]


def test_cudnn_rnn_packed_sequence_passes_its_batch_sizes():
    lstm = nn.LSTM(4, 6)

    def packed(x, lengths):
        lstm.cuda()
        p = nn.utils.rnn.pack_padded_sequence(x.cuda(), lengths)
        out, _ = lstm(p)
        out.data.sum().backward()
        return out.data

    x, lengths = torch.randn(5, 3, 4), torch.tensor([5, 3, 2])
    report = md.checker("cuda", recheck_calls=False)(packed, x, lengths)
    assert report.error is None, str(report)
    (fw,) = _calls(report.trace, "aten._cudnn_rnn.default")
    eager = nn.utils.rnn.pack_padded_sequence(x, lengths)
    assert list(fw.args[14]) == eager.batch_sizes.tolist() and fw.args[10] is False
    assert fw.output_metas[0].shape == lstm(eager)[0].data.shape


def test_cudnn_rnn_trace_saves_loads_prints_and_is_analysed_honestly(tmp_path):
    m = nn.LSTM(4, 6, 2, dropout=0.25)
    trace = md.tracer(device="cuda")(_step, m, _input(m))
    path = tmp_path / "rnn.json.gz"
    trace.save(path)
    loaded = md.Trace.load(path)
    assert loaded.lines() == trace.lines() and any("aten._cudnn_rnn.default(" in line for line in loaded.lines())
    # No FLOP formula exists for _cudnn_rnn (FlopCounterMode counts 0): listed, not guessed.
    flops = md.flops(loaded)
    assert flops.uncounted["aten._cudnn_rnn.default"] == 1 and "no formula" in str(flops)
    # cuDNN's reserve, workspaces and dropout state are not sized: said where the figure is printed.
    for memory in (md.memory(loaded), md.memory(loaded, allocator="cuda"), md.fits(loaded)):
        assert "not sized: " in str(memory) and "the peak is low" in str(memory)
    assert md.memory(loaded).unsized == {
        "aten._cudnn_init_dropout_state.default": 1,
        "aten._cudnn_rnn.default": 1,
        "aten._cudnn_rnn_backward.default": 1,
    }
    assert not md.memory(md.tracer(device="cpu")(_step, m, _input(m))).unsized


def test_cudnn_rnn_flatten_weight_answers_as_torchs_meta_kernel():
    # _cudnn_rnn_flatten_weight_meta (cudnn/RNN.cpp) returns zeros of cuDNN's
    # length and moves nothing; here without a cuDNN handle.
    with md.MetaMode(device="cuda") as mode:
        m = nn.LSTM(4, 6, 2, proj_size=3, device="cuda")
        with torch.no_grad():
            buf = torch._cudnn_rnn_flatten_weight(m._flat_weights, 5, 4, LSTM, 6, 3, 2, False, False)
    assert buf.shape == (weight_count(LSTM, 4, 6, 3, 2, False),) == (sum(p.numel() for p in m.parameters()),)
    assert mode.trace.calls[-1].op == "aten._cudnn_rnn_flatten_weight.default"
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in m.parameters())  # not moved


class TestGolden(expecttest.TestCase):
    def test_cudnn_rnn_batch_first_lstm_step_reads_as_the_cuda_program(self):
        # Derived from torch's C++ (the module docstring): the whole stack in
        # one _cudnn_rnn, the weights copied into a fresh buffer (weight_buf
        # None: Note [cuDNN RNNs on a logical GPU]), cuDNN's batch_first
        # output strides, and one _cudnn_rnn_backward with every weight's
        # gradient a view into one buffer.  A GPU's dispatch log also shows
        # try_get_weight_buf's empty/set_ before _cudnn_rnn (not recorded).
        m = nn.LSTM(2, 3, batch_first=True)
        h0, c0 = torch.zeros(1, 4, 3), torch.zeros(1, 4, 3)
        trace = md.tracer(device="cuda")(lambda x: m(x, (h0, c0))[0].sum().backward(), torch.randn(4, 5, 2))
        self.assertExpectedInline(
            "\n".join(trace.lines()),
            """\
$0: f32[4, 5, 2]@cuda:0 = arg args[0]
$1: f32[12, 2]@cuda:0 = param weight_ih_l0
$2: f32[12, 3]@cuda:0 = param weight_hh_l0
$3: f32[12]@cuda:0 = param bias_ih_l0
$4: f32[12]@cuda:0 = param bias_hh_l0
$5: f32[1, 4, 3]@cuda:0 = const
$6: f32[1, 4, 3]@cuda:0 = const
$7: f32[4, 5, 3]{3, 12, 1}@cuda:0, $8: f32[1, 4, 3]@cuda:0, $9: f32[1, 4, 3]@cuda:0, $10: u8[0]@cuda:0, $11: f32[84]@cuda:0 = aten._cudnn_rnn.default($0, [$1, $2, $3, $4], 4, None, $5, $6, 2, 3, 0, 1, True, 0.0, True, False, [], None)
$12: f32[4, 5, 3]{3, 12, 1}@cuda:0 = aten.detach.default($7)
$13: f32[]@cuda:0 = aten.sum.default($7)
$14: f32[]@cuda:0 = aten.ones_like.default($13, pin_memory=False, memory_format=torch.preserve_format)
$15: f32[4, 5, 3]{0, 0, 0}@cuda:0 = aten.expand.default($14, [4, 5, 3])  # (bw)
$16: f32[4, 5, 3]{3, 12, 1}@cuda:0 = aten.detach.default($12)  # (bw)
$17: f32[4, 5, 2]{2, 8, 1}@cuda:0, $18: f32[1, 4, 3]@cuda:0, $19: f32[1, 4, 3]@cuda:0, [$20: f32[12, 2]@cuda:0, $21: f32[12, 3]+24@cuda:0, $22: f32[12]+60@cuda:0, $23: f32[12]+72@cuda:0] = aten._cudnn_rnn_backward.default($0, [$1, $2, $3, $4], 4, $11, $5, $6, $16, $15, None, None, 2, 3, 0, 1, True, 0.0, True, False, [], None, $10, [False, False, False, True])  # (bw)
$24: f32[12, 2]@cuda:0 = aten.detach.default($20)  # (bw)
$25: f32[12]+60@cuda:0 = aten.detach.default($22)  # (bw)
$26: f32[12, 3]+24@cuda:0 = aten.detach.default($21)  # (bw)
$27: f32[12]+72@cuda:0 = aten.detach.default($23)  # (bw)""",
        )


def test_cudnn_rnn_stand_ins_do_not_flatten_the_weights_again():
    # A real GPU's LSTM step (an H100's dispatch log) begins with the hidden
    # states' zeros; it flattened its weights when it moved there, not in the
    # step.  The module's _flat_weights are its real parameters, which the
    # trace never replaces (Note [Other threads see the real model]).
    m = nn.LSTM(16, 32, num_layers=2, batch_first=True)
    real_flat = list(m._flat_weights)
    trace = md.tracer(device="cuda")(_step, m, torch.randn(4, 7, 16))
    ops = [c.op for c in trace.calls]
    assert ops[:3] == ["aten.zeros.default", "aten.zeros.default", "aten._cudnn_rnn.default"]
    assert not any("flatten_weight" in op for op in ops)
    assert all(a is b for a, b in zip(m._flat_weights, real_flat))  # put back
    assert not m._weights_have_changed()
