"""md.check: keep-going tracing and its report."""

import sys
import textwrap

import pytest
import torch
from torch import nn

import metadispatch as md
from metadispatch.cli.main import main as cli_main


# Two custom ops with a CPU kernel and autograd but no fake/meta kernel.
@torch.library.custom_op("mdchecktest::gelu2", mutates_args=())
def gelu2(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * 2


@torch.library.custom_op("mdchecktest::pool3", mutates_args=())
def pool3(x: torch.Tensor) -> torch.Tensor:
    return x[..., ::3].clone()


gelu2.register_autograd(lambda ctx, grad: grad * 2)
pool3.register_autograd(
    lambda ctx, grad: grad.repeat_interleave(3, -1)[..., : ctx.n],
    setup_context=lambda ctx, inputs, output: setattr(ctx, "n", inputs[0].shape[-1]),
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return torch.ops.mdchecktest.gelu2(self.lin(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(6, 6)

    def forward(self, x):
        y = self.blocks(x)
        return self.head(y).relu() + torch.ops.mdchecktest.pool3(y).sum()


def test_check_custom_ops_without_meta_kernel_found_in_one_run():
    model = Model()
    report = md.check(lambda x: model(x).sum().backward(), torch.randn(4, 6))
    assert report.error is None
    by_op = {i.op: i for i in report.unsupported}
    assert set(by_op) == {"mdchecktest.gelu2.default", "mdchecktest.pool3.default"}
    gelu = by_op["mdchecktest.gelu2.default"]
    assert gelu.count == 2 and gelu.modules == ("blocks.0", "blocks.1")
    assert gelu.source.startswith("test_check.py:") and gelu.source.endswith("in forward")
    assert by_op["mdchecktest.pool3.default"].outputs == ("f32[4, 2]",)
    text = str(report)
    assert '@metadispatch.register_meta("mdchecktest::gelu2")' in text
    assert "def pool3_default_meta(x):" in text
    assert "# schema: mdchecktest::pool3(Tensor x) -> Tensor" in text
    # the trace went on past both ops, through backward
    assert any(c.phase == "backward" for c in report.trace)
    assert [c.note for c in report.trace if c.op.startswith("mdchecktest")] == ["real kernel"] * 3


def test_check_plain_trace_still_stops_at_the_first():
    model = Model()
    with pytest.raises(md.UnsupportedOpError, match="mdchecktest.gelu2"):
        md.trace(model, torch.randn(4, 6))


class MoE(nn.Module):
    """A mixture-of-experts layer routing tokens with nonzero, as Mixtral does."""

    def __init__(self, dim=8, experts=4, top_k=2):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        mask = nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, token = torch.nonzero(mask[e], as_tuple=True)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def test_check_moe_router_nonzero_keeps_going():
    moe = MoE()
    report = md.check(lambda x: moe(x).sum().backward(), torch.randn(5, 8))
    assert report.error is None and not report.unsupported and not report.mismatches
    nz = {i.op: i for i in report.data_dependent}["aten.nonzero.default"]
    assert nz.count == 4 and nz.outputs == ("i64[10, 2]{1, 10}",)  # all routed: an upper bound
    assert nz.source.startswith("test_check.py:") and "in forward" in nz.source
    assert "sizes are assumptions" in str(report)
    assert sum(c.phase == "backward" for c in report.trace) > 10


def test_check_refuses_above_the_limit_and_says_so():
    report = md.checker(limit=64)(lambda x: torch.ops.mdchecktest.gelu2(x), torch.randn(4, 6))
    assert isinstance(report.error, md.MaterializeLimitError)
    assert report.unsupported[0].refused.startswith("running it for real needs 96 bytes")
    assert "REFUSED" in str(report)


def test_check_report_catches_a_wrong_rule():
    @md.register_meta("mdchecktest::pool3")
    def pool3_wrong(x):
        return x.new_empty(x.shape[:-1] + (x.shape[-1] // 3,))  # should round up

    try:
        report = md.check(lambda x: torch.ops.mdchecktest.pool3(x) * 2, torch.randn(4, 7))
    finally:
        md.unregister_meta("mdchecktest::pool3")
    (m,) = report.mismatches
    assert (m.op, m.rule, m.problems) == ("mdchecktest.pool3.default", "user", ("shape (4, 2) != (4, 3)",))
    assert "shape (4, 2) != (4, 3)" in str(report) and not report.ok


def test_check_clean_model_is_ok():
    report = md.check(nn.Linear(3, 2), torch.randn(4, 3))
    assert report.ok and "0 mismatches" in str(report)


def test_check_cli_main_prints_the_report(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_target.py").write_text(
        textwrap.dedent("""
        import torch

        def main():
            return torch.ops.mdchecktest.gelu2, (torch.randn(2, 6),)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    status = cli_main(["check", "cli_target:main"])
    out = capsys.readouterr().out
    assert status == 1
    assert "mdchecktest.gelu2.default" in out and "register_meta" in out
    sys.modules.pop("cli_target", None)


def test_check_recheck_sees_list_views_as_aliases():
    report = md.check(lambda x: [t * 2 for t in x.unbind(0)] + list(x.split(1)), torch.randn(3, 2))
    assert report.ok, str(report)


def test_check_sdpa_causal_mask_built_on_meta_takes_the_inputs_device():
    # SDPA's C++ composite builds its causal mask with the MetaTensor's C++
    # options, on meta; adding it to cpu scores must not be a device error.
    q = torch.randn(1, 2, 4, 8)
    trace = md.trace(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), q)
    assert trace.calls[-1].output_metas[0].device == torch.device("cpu")


@pytest.mark.parametrize(
    "index",
    [
        lambda x, i: x[i],
        lambda x, i: torch.index_select(x, 0, i),
        lambda x, i: torch.nn.functional.embedding(i, x),
    ],
    ids=["getitem", "index_select", "embedding"],
)
def test_constant_indices_the_device_refuses_are_refused(index):
    # Note [Known indices out of range]: the meta kernel answers, eager raises.
    def step(x):
        return index(x, torch.tensor([0, 5]))

    x = torch.randn(3, 2)
    with pytest.raises(IndexError) as eager:
        step(x)
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 0 with size 3") as traced:
        md.trace(step, x)
    assert any("test_check.py" in note for note in traced.value.__notes__)  # the user's line
    report = md.check(step, x)  # stops where eager stops, with the real kernel's error
    assert not report.ok and f"IndexError: {eager.value}" in str(report)

    def in_range(x):
        return index(x, torch.tensor([0, 2]))

    def negative(x):
        return index(x, torch.tensor([-1]))

    try:
        negative(x)
    except IndexError:  # index_select and embedding refuse what indexing counts from the end
        with pytest.raises(IndexError):
            md.trace(negative, x)
    else:
        assert md.trace(negative, x).calls[-1].output_metas[0].shape == tuple(negative(x).shape)

    assert md.check(in_range, x).ok
    assert md.trace(in_range, x).calls[-1].output_metas[0].shape == tuple(in_range(x).shape)


def test_known_indices_after_a_mask_are_checked_against_their_own_dimension():
    x = torch.randn(2, 3, 4)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    fine = md.trace(lambda x: x[mask, torch.tensor([3, 0, 1, 2])], x)
    assert fine.calls[-1].output_metas[0].shape == (4,)
    with pytest.raises(IndexError, match="index 4 is out of bounds for dimension 2 with size 4"):
        md.trace(lambda x: x[mask, torch.tensor([4, 0, 1, 2])], x)
    with pytest.raises(IndexError):
        x[mask, torch.tensor([4, 0, 1, 2])]


def test_the_cache_never_answers_a_known_index_without_the_check():
    x = torch.randn(3, 2)
    md.trace(lambda x: x[torch.tensor([0, 1])], x)  # same metadata, in range
    with pytest.raises(IndexError):
        md.trace(lambda x: x[torch.tensor([0, 3])], x)
