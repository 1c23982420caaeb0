"""Golden traces: the printed form is deterministic and readable."""

import expecttest
import torch
from torch import nn

import metadispatch as md


class TinyBlock(nn.Module):
    """One pre-norm transformer block: attention and an MLP."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2), dim=-1)
        y = (att @ v.transpose(1, 2)).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.mlp(x)


def _train_step(model):
    def step(x):
        out = model(x)
        out.sum().backward()
        return out

    return step


class TestGolden(expecttest.TestCase):
    def test_trace_mlp_forward_backward_golden(self):
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        t = md.trace(_train_step(model), torch.randn(5, 4))
        self.assertExpectedInline(
            str(t),
            """\
$0: f32[3, 4] = param 0.weight
$1: f32[4, 3]{1, 4} = aten.t.default($0)  # 0
$2: f32[3] = param 0.bias
$3: f32[5, 4] = arg args[0]
$4: f32[5, 3] = aten.addmm.default($2, $3, $1)  # 0
$5: f32[5, 3] = aten.relu.default($4)  # 1
$6: f32[5, 3] = aten.detach.default($5)  # 1
$7: f32[2, 3] = param 2.weight
$8: f32[3, 2]{1, 3} = aten.t.default($7)  # 2
$9: f32[2] = param 2.bias
$10: f32[5, 2] = aten.addmm.default($9, $5, $8)  # 2
$11: f32[] = aten.sum.default($10)
$12: f32[] = aten.ones_like.default($11, pin_memory=False, memory_format=torch.preserve_format)
$13: f32[5, 2]{0, 0} = aten.expand.default($12, [5, 2])  # (bw)
$14: f32[2, 3] = aten.t.default($8)  # 2 (bw)
$15: f32[5, 3] = aten.mm.default($13, $14)  # 2 (bw)
$16: f32[2, 5]{0, 0} = aten.t.default($13)  # 2 (bw)
$17: f32[2, 3] = aten.mm.default($16, $5)  # 2 (bw)
$18: f32[3, 2]{1, 3} = aten.t.default($17)  # 2 (bw)
$19: f32[1, 2] = aten.sum.dim_IntList($13, [0], True)  # 2 (bw)
$20: f32[2] = aten.view.default($19, [2])  # 2 (bw)
$21: f32[2] = aten.detach.default($20)  # 2 (bw)
$22: f32[2, 3] = aten.t.default($18)  # 2 (bw)
$23: f32[2, 3] = aten.detach.default($22)  # 2 (bw)
$24: f32[5, 3] = aten.detach.default($6)  # 1 (bw)
$25: f32[5, 3] = aten.threshold_backward.default($15, $24, 0)  # 1 (bw)
$26: f32[3, 5]{1, 3} = aten.t.default($25)  # 0 (bw)
$27: f32[3, 4] = aten.mm.default($26, $3)  # 0 (bw)
$28: f32[4, 3]{1, 4} = aten.t.default($27)  # 0 (bw)
$29: f32[1, 3] = aten.sum.dim_IntList($25, [0], True)  # 0 (bw)
$30: f32[3] = aten.view.default($29, [3])  # 0 (bw)
$31: f32[3] = aten.detach.default($30)  # 0 (bw)
$32: f32[3, 4] = aten.t.default($28)  # 0 (bw)
$33: f32[3, 4] = aten.detach.default($32)  # 0 (bw)""",
        )

    def test_trace_transformer_block_forward_golden(self):
        t = md.tracer(device="cuda")(TinyBlock(), torch.randn(2, 3, 8))
        self.assertExpectedInline(
            str(t),
            """\
$0: f32[2, 3, 8]@cuda:0 = arg args[0]
$1: f32[8]@cuda:0 = param norm.weight
$2: f32[8]@cuda:0 = param norm.bias
$3: f32[2, 3, 8]@cuda:0, $4: f32[2, 3, 1]@cuda:0, $5: f32[2, 3, 1]@cuda:0 = aten.native_layer_norm.default($0, [8], $1, $2, 1e-05)  # norm
$6: f32[24, 8]@cuda:0 = param qkv.weight
$7: f32[8, 24]{1, 8}@cuda:0 = aten.t.default($6)  # qkv
$8: f32[6, 8]@cuda:0 = aten.view.default($3, [6, 8])  # qkv
$9: f32[6, 24]@cuda:0 = aten.mm.default($8, $7)  # qkv
$10: f32[2, 3, 24]@cuda:0 = aten._unsafe_view.default($9, [2, 3, 24])  # qkv
$11: f32[2, 3, 3, 2, 4]@cuda:0 = aten.view.default($10, [2, 3, 3, 2, 4])
[$12: f32[2, 3, 2, 4]{72, 24, 4, 1}@cuda:0, $13: f32[2, 3, 2, 4]{72, 24, 4, 1}+8@cuda:0, $14: f32[2, 3, 2, 4]{72, 24, 4, 1}+16@cuda:0] = aten.unbind.int($11, 2)
$15: f32[2, 2, 3, 4]{72, 4, 24, 1}@cuda:0 = aten.transpose.int($12, 1, 2)
$16: f32[2, 2, 3, 4]{72, 4, 24, 1}+8@cuda:0 = aten.transpose.int($13, 1, 2)
$17: f32[2, 2, 4, 3]{72, 4, 1, 24}+8@cuda:0 = aten.transpose.int($16, -1, -2)
$18: f32[2, 2, 3, 4]{72, 4, 24, 1}@cuda:0 = aten.expand.default($15, [2, 2, 3, 4])
$19: f32[2, 2, 3, 4]@cuda:0 = aten.clone.default($18, memory_format=torch.contiguous_format)
$20: f32[4, 3, 4]@cuda:0 = aten._unsafe_view.default($19, [4, 3, 4])
$21: f32[2, 2, 4, 3]{72, 4, 1, 24}+8@cuda:0 = aten.expand.default($17, [2, 2, 4, 3])
$22: f32[2, 2, 4, 3]@cuda:0 = aten.clone.default($21, memory_format=torch.contiguous_format)
$23: f32[4, 4, 3]@cuda:0 = aten._unsafe_view.default($22, [4, 4, 3])
$24: f32[4, 3, 3]@cuda:0 = aten.bmm.default($20, $23)
$25: f32[2, 2, 3, 3]@cuda:0 = aten._unsafe_view.default($24, [2, 2, 3, 3])
$26: f32[2, 2, 3, 3]@cuda:0 = aten._softmax.default($25, -1, False)
$27: f32[2, 2, 3, 3]@cuda:0 = aten.detach.default($26)
$28: f32[2, 2, 3, 4]{72, 4, 24, 1}+16@cuda:0 = aten.transpose.int($14, 1, 2)
$29: f32[2, 2, 3, 3]@cuda:0 = aten.expand.default($26, [2, 2, 3, 3])
$30: f32[4, 3, 3]@cuda:0 = aten.view.default($29, [4, 3, 3])
$31: f32[2, 2, 3, 4]{72, 4, 24, 1}+16@cuda:0 = aten.expand.default($28, [2, 2, 3, 4])
$32: f32[2, 2, 3, 4]@cuda:0 = aten.clone.default($31, memory_format=torch.contiguous_format)
$33: f32[4, 3, 4]@cuda:0 = aten._unsafe_view.default($32, [4, 3, 4])
$34: f32[4, 3, 4]@cuda:0 = aten.bmm.default($30, $33)
$35: f32[2, 2, 3, 4]@cuda:0 = aten._unsafe_view.default($34, [2, 2, 3, 4])
$36: f32[2, 3, 2, 4]{24, 4, 12, 1}@cuda:0 = aten.transpose.int($35, 1, 2)
$37: f32[2, 3, 2, 4]@cuda:0 = aten.clone.default($36, memory_format=torch.contiguous_format)
$38: f32[2, 3, 8]@cuda:0 = aten._unsafe_view.default($37, [2, 3, 8])
$39: f32[8, 8]@cuda:0 = param proj.weight
$40: f32[8, 8]{1, 8}@cuda:0 = aten.t.default($39)  # proj
$41: f32[6, 8]@cuda:0 = aten.view.default($38, [6, 8])  # proj
$42: f32[6, 8]@cuda:0 = aten.mm.default($41, $40)  # proj
$43: f32[2, 3, 8]@cuda:0 = aten._unsafe_view.default($42, [2, 3, 8])  # proj
$44: f32[2, 3, 8]@cuda:0 = aten.add.Tensor($0, $43)
$45: f32[6, 8]@cuda:0 = aten.view.default($44, [6, 8])  # mlp.0
$46: f32[16, 8]@cuda:0 = param mlp.0.weight
$47: f32[8, 16]{1, 8}@cuda:0 = aten.t.default($46)  # mlp.0
$48: f32[16]@cuda:0 = param mlp.0.bias
$49: f32[6, 16]@cuda:0 = aten.addmm.default($48, $45, $47)  # mlp.0
$50: f32[2, 3, 16]@cuda:0 = aten.view.default($49, [2, 3, 16])  # mlp.0
$51: f32[2, 3, 16]@cuda:0 = aten.gelu.default($50)  # mlp.1
$52: f32[6, 16]@cuda:0 = aten.view.default($51, [6, 16])  # mlp.2
$53: f32[8, 16]@cuda:0 = param mlp.2.weight
$54: f32[16, 8]{1, 16}@cuda:0 = aten.t.default($53)  # mlp.2
$55: f32[8]@cuda:0 = param mlp.2.bias
$56: f32[6, 8]@cuda:0 = aten.addmm.default($55, $52, $54)  # mlp.2
$57: f32[2, 3, 8]@cuda:0 = aten.view.default($56, [2, 3, 8])  # mlp.2
$58: f32[2, 3, 8]@cuda:0 = aten.add.Tensor($44, $57)""",
        )

    def test_trace_summary_golden(self):
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        t = md.trace(_train_step(model), torch.randn(5, 4))
        self.assertExpectedInline(
            t.summary(),
            """\
29 calls: 8 forward, 21 backward; answered by meta 29

op                               calls
-------------------------------  -----
aten.t.default                       9
aten.detach.default                  6
aten.mm.default                      3
aten.addmm.default                   2
aten.sum.dim_IntList                 2
aten.view.default                    2
aten.relu.default                    1
aten.sum.default                     1
aten.ones_like.default               1
aten.expand.default                  1
aten.threshold_backward.default      1

module  calls
------  -----
2          12
0          10
1           4
<top>       3""",
        )


def test_trace_records_what_replay_needs():
    model = nn.Linear(3, 2)
    t = md.trace(_train_step(model), torch.randn(4, 3))
    leaves = {leaf.name: leaf for leaf in t.leaves.values()}
    assert {name: leaf.kind for name, leaf in leaves.items()} == {"weight": "param", "bias": "param", "args[0]": "arg"}
    mm = next(c for c in t if c.op == "aten.addmm.default")
    assert mm.func is torch.ops.aten.addmm.default
    assert [m.id for m in mm.inputs] == [leaves["bias"].meta.id, leaves["args[0]"].meta.id, t[0].outputs[0].id]
    assert (mm.module, mm.phase, mm.rule) == ("", "forward", "meta")
    assert {c.phase for c in t} == {"forward", "backward"}
    assert sorted(t.grads) == ["bias", "weight"]
    assert t.grads["weight"].shape == (2, 3)
    assert isinstance(t.output, md.MetaTensor) and t.output_meta.shape == (4, 2)


def test_trace_records_in_place_as_same_id_and_views_share_storage():
    def fn(x):
        y = x.view(6)
        y.add_(1)
        return y.t() if y.dim() == 2 else y

    t = md.trace(fn, torch.ones(2, 3))
    view, add_ = t[0], t[1]
    assert add_.outputs[0].id == view.outputs[0].id
    assert view.outputs[0].storage == t.leaves[view.inputs[0].id].meta.storage


def test_trace_module_attribution_also_in_backward():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    t = md.trace(_train_step(model), torch.randn(2, 4))
    bw = {c.module for c in t if c.phase == "backward"}
    assert {"0", "1"} <= bw
    assert {c.module for c in t if c.op == "aten.tanh.default"} == {"1"}


def test_trace_backward_attribution_follows_the_autograd_node():
    # torch's ModuleTracker loses track of modules whose inputs need no grad
    # (an embedding); the node being executed names the forward op exactly.
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    t = md.trace(_train_step(model), torch.tensor([[1, 2, 3]]))
    backward = {c.op: c.module for c in t if c.phase == "backward"}
    assert backward["aten.embedding_dense_backward.default"] == "0"
    assert backward["aten.threshold_backward.default"] == "2"
    forward_modules = {c.module for c in t if c.phase == "forward"}
    assert {c.module for c in t if c.phase == "backward"} <= forward_modules


def test_trace_output_records_carry_the_requires_grad_autograd_gave():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)

    def fn(x):
        y = lin(x).relu()
        with torch.no_grad():
            w = y * 2
        d = y.detach() + 1
        return y.sum(), w, d

    t = md.trace(fn, torch.ones(4, 3))
    by_op = {c.op: c.outputs[0].requires_grad for c in t}
    # The same ops run for real, their outputs read after autograd set them.
    x = torch.ones(4, 3)
    real_y = lin(x).relu()
    with torch.no_grad():
        real_w = real_y * 2
    real_d = real_y.detach() + 1
    assert by_op["aten.addmm.default"] is lin(x).requires_grad is True
    assert by_op["aten.relu.default"] is real_y.requires_grad
    assert by_op["aten.sum.default"] is real_y.sum().requires_grad is True
    assert by_op["aten.mul.Tensor"] is real_w.requires_grad is False
    assert by_op["aten.add.Tensor"] is real_d.requires_grad is False


def test_a_view_made_outside_the_mode_is_recorded_as_the_view_it_is():
    # Note [Views of leaves]: a tensor that reaches the mode with no recorded
    # producer but on a recorded tensor's storage (a view taken between two
    # entries of the mode) is that tensor's data, not a made-up input.
    mode = md.MetaMode()
    with mode:
        y = torch.randn(4, 3) * 2
    v = y.t()  # a MetaTensor op with no mode: nothing recorded
    with mode:
        v.sum()
    view = mode.trace.calls[2]
    assert (view.op, view.note) == ("aten.as_strided.default", "untraced view")
    assert view.args == (mode.trace.calls[1].outputs[0], (3, 4), (1, 3), 0)
    assert mode.trace.calls[3].args == (view.outputs[0],)
    assert not mode.trace.leaves
