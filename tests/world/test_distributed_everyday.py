"""A logical world on code people write every day: ``fully_shard(model)``
without a mesh on a logical GPU, tensor parallelism with an optimizer, and
the device questions torch's own code asks (``torch.cuda.is_available``,
``torch.accelerator``), each against what torch itself answers.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import metadispatch as md
from tests.distributed_cases import comparable

transformers = pytest.importorskip("transformers")

WORLD = 4


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _fsdp_llama_step(device: str):
    """A transformers LLaMA built here, ``fully_shard`` per layer and at the
    root with no mesh, forward and backward; what FSDP2 chose."""
    model = _llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(0, 96, (2, 8), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    p = next(model.parameters())
    return p.device_mesh.device_type, p.to_local().device.type


def _only_comms(trace) -> list:
    return comparable(md.comms(trace).calls)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the build's accelerator is answered only without CUDA")
@pytest.mark.parametrize("how", ["mode", "tracer"])
def test_distributed_fully_shard_without_a_mesh_on_a_logical_gpu_picks_cuda(how):
    # FSDP2's default mesh is on torch._C._get_accelerator(): "cpu" on a CPU
    # build, so it moved the parameters to the CPU and ``tensor.data =
    # tensor.to(device)`` failed (Note [A logical world's accelerator]).
    if how == "mode":
        with md.MetaMode(device="cuda", gpu="h100", world_size=WORLD) as mode:
            chose = _fsdp_llama_step("cuda")
        trace = mode.trace
    else:
        seen: list = []
        trace = md.tracer(device="cuda", gpu="h100", world_size=WORLD)(lambda: seen.append(_fsdp_llama_step("cuda")))
        chose = seen[0]
    assert chose == ("cuda", "cuda")
    # The same collectives as the logical CPU world (held to real gloo runs
    # in test_distributed_ground_truth.py): only the device differs.
    with md.MetaMode(device="cpu", world_size=WORLD) as cpu:
        assert _fsdp_llama_step("cpu") == ("cpu", "cpu")
    assert _only_comms(trace) == _only_comms(cpu.trace) != []


def _tp_step(foreach: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    parallelize_module(model, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return {name: tuple(p.grad.to_local().shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_tensor_parallel_with_adamw_traces_its_gradients_shards(foreach, rank):
    # The trace's gradients are DTensors: their names and this rank's shard
    # shapes, as a real step over torch's fake backend has them ('DTensor'
    # object has no attribute '_md_device' at the end of the trace).
    dist.init_process_group("fake", store=md._compat.fake_process_group_store(), rank=rank, world_size=2)
    try:
        expected = _tp_step(foreach)
    finally:
        dist.destroy_process_group()
    trace = md.tracer(device="cpu", world_size=2, rank=rank)(_tp_step, foreach)
    assert {name: tuple(m.shape) for name, m in trace.grads.items()} == expected


def _tp_inference(x):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with torch.inference_mode():
        return model(x)


def _collectives(counts) -> dict:
    return {str(op).split(".")[-1]: n for op, n in counts.items()}


@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_tensor_parallel_linears_under_inference_mode_shard_as_eager(rank):
    # Under inference_mode aten.linear reaches DTensor whole, which finds its
    # sharding through its decomposition on meta tensors: the mode once
    # decomposed it on the DTensors ("Cannot set version_counter for
    # inference tensor"), then recorded every candidate's meta calls.
    from torch.distributed.tensor.debug import CommDebugMode

    dist.init_process_group("fake", store=md._compat.fake_process_group_store(), rank=rank, world_size=2)
    try:
        with CommDebugMode() as comms:
            eager = _tp_inference(torch.randn(4, 8))
        eager_comms = _collectives(comms.get_comm_counts())
    finally:
        dist.destroy_process_group()
    trace = md.tracer(device="cpu", world_size=2, rank=rank)(_tp_inference, torch.randn(4, 8))
    out = trace.output_meta
    assert (tuple(out.shape), out.dtype) == (tuple(eager.shape), eager.dtype)
    traced = [c.op.split(".")[1] for c in trace.calls if c.op.split(".")[0] in ("c10d", "_c10d_functional")]
    traced = [op for op in traced if op not in ("_wrap_tensor_autograd", "wait_tensor")]
    assert {op: traced.count(op) for op in traced} == eager_comms  # the build's and the forward's
    assert eager_comms["all_gather_into_tensor"] == 2
    # the forward's matmuls on this rank's tensors; DTensor's sharding search is none of them
    assert [c.op for c in trace.calls].count("aten.addmm.default") == 2
    assert len(trace.calls) < 100


def _device_answers() -> tuple:
    acc = torch.accelerator.current_accelerator(check_available=True)
    return torch.cuda.is_available(), torch.accelerator.is_available(), acc


def test_distributed_logical_cpu_world_answers_the_hosts_device_questions():
    # Code that picks its device from torch.cuda.is_available() builds a
    # CPU model in a logical CPU world, as a real CPU job on this host does.
    host = _device_answers()
    seen: list = []
    md.tracer(device="cpu", world_size=2)(lambda: seen.append(_device_answers()))
    assert seen == [host]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a world answers for a logical GPU only without a real one")
def test_distributed_logical_gpu_world_answers_as_a_gpu_job():
    seen: list = []
    md.tracer(device="cuda", world_size=2)(lambda: seen.append(_device_answers()))
    assert seen == [(True, True, torch.device("cuda"))]
    assert _device_answers() == (False, False, None)  # the host's again


@pytest.mark.skipif(torch.cuda.is_available(), reason="a world answers for a logical GPU only without a real one")
def test_distributed_fully_shard_moves_a_model_built_on_the_cpu_to_the_logical_gpu():
    # A GPU job builds on the CPU and lets FSDP2 move the parameters
    # (``tensor.data = tensor.to("cuda")``); a logical CPU tensor and a logical
    # GPU one are different C++ kinds (Note [Data across logical devices]).
    with md.MetaMode(world_size=WORLD) as mode:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
        fully_shard(model)
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        weight = model[0].weight
        assert weight.to_local().device.type == "cuda" and weight.grad.to_local().device.type == "cuda"
    with md.MetaMode(device="cpu", world_size=WORLD) as cpu:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
        fully_shard(model)
        model(torch.randn(4, 8)).sum().backward()
    assert _only_comms(mode.trace) == _only_comms(cpu.trace) != []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a world answers for a logical GPU only without a real one")
def test_distributed_data_set_across_logical_devices_keeps_the_parameter():
    # As ``p.data = p.to(device)`` on a real tensor: the same Parameter, still
    # a leaf that requires grad, now on the other device, its grad there too.
    with md.MetaMode(world_size=2):
        layer = torch.nn.Linear(8, 4)
        weight = layer.weight
        weight.data = weight.to("cuda")
        layer.bias.data = layer.bias.to("cuda")
        layer(torch.randn(2, 8, device="cuda")).sum().backward()
        assert layer.weight is weight and isinstance(weight, torch.nn.Parameter)
        assert weight.is_leaf and weight.requires_grad and weight.device.type == weight.grad.device.type == "cuda"
