"""Real-model conformance: a logical-CPU trace against the real CPU run of the same step.

Beside ``opdb_conformance.py`` (one op at a time), this runs whole training
steps -- forward, backward -- of real model setups and checks, per
configuration:

* ``traces``: ``md.trace`` on a logical CPU completes;
* ``ops``: the recorded op sequence (names, in order) equals what a real CPU
  run dispatches, logged by a ``TorchDispatchMode`` (``md.testing.eager_calls``);
* ``meta``: every output's shape, dtype, significant strides (of dimensions
  longer than 1), offset and device equal the real run's, and so do the
  parameters' gradients;
* ``flops``: ``md.flops`` equals ``FlopCounterMode`` on the real run;
* ``memory``: ``md.memory``'s peak equals the real run's (``md.LiveStorages``);
* ``fake``: the same step traces under ``FakeTensorMode`` (for comparison);
* ``replay``: ``md.replay`` of the trace on the CPU, with the same weights and
  inputs, is ``ok`` and its output and gradients equal the eager step's (run
  from the generator state the trace began with) bit for bit;
* ``materialize``: the model built under ``md.MetaMode`` from a seed and
  ``md.materialize``d equals, parameter for parameter and buffer for buffer,
  bit for bit, the model built eagerly from the same seed;
* ``cuda``: ``md.tracer(device="cuda", gpu="h100")`` traces the step (autocast
  on CUDA where the configuration autocasts, with CUDA's autocast policy:
  Note [Autocast on a logical GPU]); a logical GPU, no values to compare.

A column that fails is a result in the table (``error`` and a note), not a
crash of the tool.

A configuration whose library is not installed (torchvision, timm, diffusers,
transformers) is skipped.  ``tests/test_model_conformance.py`` runs a quick
subset; the table in ``docs/model-conformance.md`` comes from::

    python tools/model_conformance.py            # every configuration
    python tools/model_conformance.py lstm gpt2  # some

``--expect docs/model-conformance.md`` compares every result column with the
docs' table for the installed torch and exits 1 on a difference; CI runs it
on both torch versions, so the table stays what the tool says.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metadispatch as md  # noqa: E402
from metadispatch.testing import eager_calls, trace_calls  # noqa: E402


class Config(NamedTuple):
    build: Callable  # () -> (model, inputs)
    needs: str = ""  # a library that must be installed
    autocast: bool = False
    channels_last: bool = False
    step: Callable | None = None  # (device) -> step(model, *inputs); default: forward, sum, backward
    collected: Callable | None = None  # () -> what the step's hooks wrote outside the model, emptied
    inference: bool = False  # a forward under torch.inference_mode(), no backward
    saved: bool = False  # replay the trace as saved to a file and loaded back
    onednn: bool = True  # False: the step runs with torch.backends.mkldnn disabled


def _step(config: Config, device: str = "cpu"):
    if config.step is not None:
        return config.step(device)

    def step(model, *inputs):
        if config.inference:
            with torch.inference_mode():
                return _first_tensor(model(*inputs))
        with (
            torch.autocast(device, dtype=torch.bfloat16, enabled=config.autocast),
            torch.backends.mkldnn.flags(enabled=config.onednn),
        ):
            out = model(*inputs)
        out = _first_tensor(out)
        out.float().sum().backward()
        return out

    return step


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):  # transformers / diffusers outputs
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    return next(
        t
        for t in (_first_tensor(o) if not isinstance(o, torch.Tensor) else o for o in out if o is not None)
        if t is not None
    )


# -- configurations ---------------------------------------------------------


def _seq(*layers):
    return nn.Sequential(*layers)


class _Apply(nn.Module):
    def __init__(self, fn, *mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)
        self.fn = fn

    def forward(self, *x):
        return self.fn(self.mods, *x)


def _nn(name):
    t = torch.randn
    return {
        "nn.lstm": lambda: (nn.LSTM(16, 32, num_layers=2, batch_first=True), (t(4, 7, 16),)),
        "nn.gru": lambda: (nn.GRU(16, 32, bidirectional=True), (t(7, 4, 16),)),
        "nn.mha": lambda: (
            _Apply(lambda m, x: m[0](x, x, x)[0], nn.MultiheadAttention(32, 4, batch_first=True)),
            (t(2, 9, 32),),
        ),
        "nn.transformer": lambda: (nn.Transformer(32, 4, 2, 2, 64, batch_first=True), (t(2, 7, 32), t(2, 5, 32))),
        "nn.conv3d": lambda: (
            _seq(nn.Conv3d(3, 8, 3), nn.BatchNorm3d(8), nn.ReLU(), nn.Conv3d(8, 4, 3)),
            (t(2, 3, 8, 8, 8),),
        ),
        "nn.embedding_bag": lambda: (nn.EmbeddingBag(50, 16, mode="mean"), (torch.randint(0, 50, (4, 6)),)),
        "nn.ctc": lambda: (
            _Apply(
                lambda m, x: nn.functional.ctc_loss(
                    m[0](x).log_softmax(2),
                    torch.tensor([[1, 2, 2], [1, 3, 4]]),
                    torch.tensor([6, 6]),
                    torch.tensor([3, 3]),
                ),
                nn.Linear(8, 5),
            ),
            (t(6, 2, 8),),
        ),
        "nn.convnet_channels_last": lambda: (
            _seq(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 8, 3, groups=8)).to(
                memory_format=torch.channels_last
            ),
            (t(2, 3, 16, 16).contiguous(memory_format=torch.channels_last),),
        ),
        "nn.checkpoint": lambda: (
            _Apply(
                lambda m, x: torch.utils.checkpoint.checkpoint(m[0], x, use_reentrant=False),
                _seq(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)),
            ),
            (t(4, 16),),
        ),
        "nn.autocast_mlp": lambda: (
            _seq(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8)),
            (t(4, 16),),
        ),
        "nn.autocast_convnet": lambda: (
            _seq(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)),
            (t(2, 3, 12, 12),),
        ),
        "nn.autocast_lstm": lambda: (nn.LSTM(16, 32), (t(7, 4, 16),)),
    }[name]


# -- training patterns: a step of their own ---------------------------------


def _loader_model():
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(20, 16, generator=g), torch.randn(20, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=6, shuffle=True, generator=torch.Generator())
    return _seq(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), (loader,)


def _epoch_step(device):
    """An epoch over a shuffling DataLoader (Note [A DataLoader inside a traced step])."""

    def step(model, loader):
        loader.generator.manual_seed(2)  # every run (traced, eager, replayed) reads the epoch in one order
        for x, y in loader:
            out = model(x.to(device))
            nn.functional.mse_loss(out, y.to(device)).backward()
        return out

    return step


def _in_backward_model():
    return _seq(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)), (torch.randn(4, 16),)


def _in_backward_step(device):
    """torch's "optimizer step in backward" recipe: per-parameter optimizers keyed by parameter."""

    def step(model, x):
        optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

        def hook(p):
            optimizers[p].step()
            optimizers[p].zero_grad()

        handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
        out = model(x)
        out.sum().backward()
        for h in handles:
            h.remove()
        return out

    return step


SHAPES: list = []  # what the shape-collecting hooks append to: kept after md.trace, as in eager


def _taken(collected: list) -> list:
    out = list(collected)
    collected.clear()
    return out


def _hook_shapes_model():
    SHAPES.clear()  # what earlier runs of the row appended
    model = _seq(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    for m in model:
        m.register_forward_hook(lambda m, args, out: SHAPES.append(tuple(out.shape)))
    return model, (torch.randn(2, 3, 8, 8),)


def _hf(kind):
    def build():
        import transformers as tf

        ids = torch.randint(0, 100, (2, 12))
        encoder_decoder = dict(  # bart and whisper: one layer each side
            vocab_size=100,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
        )
        encoder = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
        small = dict(vocab_size=100, **encoder, num_key_value_heads=2)
        if kind == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(**small)), (ids,)
        if kind == "gpt2":
            return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4)), (ids,)
        if kind == "t5":
            cfg = tf.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
            return tf.T5ForConditionalGeneration(cfg), (ids, None, ids)
        if kind == "bert":
            cfg = tf.BertConfig(vocab_size=100, **encoder)
            return tf.BertModel(cfg), (ids,)
        if kind == "vit":
            cfg = tf.ViTConfig(image_size=32, patch_size=8, **encoder)
            return tf.ViTModel(cfg), (torch.randn(2, 3, 32, 32),)
        if kind == "qwen3_moe":
            cfg = tf.Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8)
            return tf.Qwen3MoeForCausalLM(cfg), (ids,)
        if kind == "mamba":
            cfg = tf.MambaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, state_size=8)
            return tf.MambaForCausalLM(cfg), (ids,)
        if kind == "bart":
            cfg = tf.BartConfig(**encoder_decoder, max_position_embeddings=32)
            return tf.BartForConditionalGeneration(cfg), (ids, None, ids)
        if kind == "wav2vec2":
            cfg = tf.Wav2Vec2Config(
                vocab_size=100,
                **encoder,
                conv_dim=(16, 16),
                conv_stride=(5, 2),
                conv_kernel=(10, 3),
                num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4,
                apply_spec_augment=False,  # its masks are drawn with numpy
                layerdrop=0.0,
            )
            return tf.Wav2Vec2Model(cfg), (torch.randn(2, 400),)
        if kind == "mixtral":
            cfg = tf.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)
            return tf.MixtralForCausalLM(cfg), (ids,)
        if kind == "deepseek_v3":
            cfg = tf.DeepseekV3Config(
                **{**small, "num_key_value_heads": 4},
                moe_intermediate_size=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                n_shared_experts=1,
            )
            return tf.DeepseekV3ForCausalLM(cfg), (ids,)
        if kind == "llama_checkpointing":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**small))
            model.gradient_checkpointing_enable()
            return model, (ids,)
        if kind == "whisper":
            cfg = tf.WhisperConfig(
                **encoder_decoder,
                num_mel_bins=16,
                max_source_positions=16,
                max_target_positions=16,
                pad_token_id=1,
                bos_token_id=2,
                eos_token_id=2,
                decoder_start_token_id=2,
            )
            return tf.WhisperModel(cfg), (torch.randn(2, 16, 32), None, ids[:, :4])
        raise KeyError(kind)

    return build


def _tv(name, shape=(2, 3, 64, 64), channels_last=False, **kwargs):
    def build():
        import torchvision

        model = torchvision.models.get_model(name, weights=None, **kwargs)
        x = torch.randn(*shape)
        if channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        return model, (x,)

    return build


def _detection():
    import torchvision

    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64
    )

    def losses(m, images, boxes, labels):
        targets = [{"boxes": b, "labels": lab} for b, lab in zip(boxes, labels)]
        return sum(m[0](list(images), targets).values())

    boxes = torch.tensor([[[4.0, 4.0, 30.0, 40.0]], [[10.0, 8.0, 60.0, 50.0]]])
    return _Apply(losses, model.train()), (torch.rand(2, 3, 64, 64), boxes, torch.tensor([[1], [2]]))


def _raft():
    import torchvision

    model = torchvision.models.optical_flow.raft_small(weights=None)
    return _Apply(lambda m, a, b: m[0](a, b, num_flow_updates=2)[-1], model), (
        torch.rand(1, 3, 128, 128),  # the correlation pyramid needs 128 pixels
        torch.rand(1, 3, 128, 128),
    )


_CUSTOM_OP = None


def _scaled_tanh():
    """A ``torch.library`` custom op with a fake kernel and an autograd formula,
    registered once, when its configuration is first built."""
    global _CUSTOM_OP
    if _CUSTOM_OP is None:

        @torch.library.custom_op("mdconformance::scaled_tanh", mutates_args=())
        def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
            return torch.tanh(x) * scale

        @scaled_tanh.register_fake
        def _(x, scale):
            return torch.empty_like(x)

        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            return grad * (ctx.scale - y * y / ctx.scale), None

        def setup_context(ctx, inputs, output):
            ctx.scale = inputs[1]
            ctx.save_for_backward(output)

        scaled_tanh.register_autograd(backward, setup_context=setup_context)
        _CUSTOM_OP = scaled_tanh
    return _CUSTOM_OP


def _custom_op():
    op = _scaled_tanh()
    return _Apply(lambda m, x: m[1](op(m[0](x), 2.0)), nn.Linear(16, 32), nn.Linear(32, 8)), (torch.randn(4, 16),)


def _compiled():
    model = _seq(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    return torch.compile(model, backend="eager"), (torch.randn(4, 16),)


def _diffusers(kind):
    def build():
        import diffusers as df

        if kind == "unet":
            model = df.UNet2DModel(
                sample_size=16,
                in_channels=3,
                out_channels=3,
                layers_per_block=1,
                block_out_channels=(16, 32),
                norm_num_groups=8,
                down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            )
            return model, (torch.randn(2, 3, 16, 16), torch.tensor([10, 20]))
        if kind == "vae":
            model = df.AutoencoderKL(
                in_channels=3,
                out_channels=3,
                block_out_channels=(16, 32),
                norm_num_groups=8,
                down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2,
                latent_channels=4,
            )
            return model, (torch.randn(2, 3, 16, 16),)
        if kind == "dit":
            model = df.DiTTransformer2DModel(
                num_attention_heads=2,
                attention_head_dim=8,
                in_channels=4,
                num_layers=2,
                sample_size=8,
                patch_size=2,
                num_embeds_ada_norm=10,
            )
            return model, (torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.tensor([0, 3]))
        raise KeyError(kind)

    return build


def _timm(name, **kwargs):
    def build():
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        return model, (torch.randn(2, 3, 64, 64),)

    return build


CONFIGS: dict[str, Config] = {
    **{
        n: Config(_nn_builder)
        for n, _nn_builder in (
            (n, (lambda n=n: _nn(n)()))
            for n in (
                "nn.lstm",
                "nn.gru",
                "nn.mha",
                "nn.transformer",
                "nn.conv3d",
                "nn.embedding_bag",
                "nn.ctc",
                "nn.convnet_channels_last",
                "nn.checkpoint",
            )
        )
    },
    **{n: Config(lambda n=n: _nn(n)(), autocast=True) for n in ("nn.autocast_mlp", "nn.autocast_convnet")},
    # oneDNN's bf16 LSTM exists on some CPUs only (AVX2-only hosts fail to build its primitive,
    # CI's among them): the row takes ATen's own LSTM, so its answer is the same on every host
    "nn.autocast_lstm": Config(lambda: _nn("nn.autocast_lstm")(), autocast=True, onednn=False),
    **{
        f"hf.{k}": Config(_hf(k), needs="transformers")
        for k in ("llama", "gpt2", "t5", "bert", "vit", "qwen3_moe", "mamba", "whisper")
    },
    "hf.llama_autocast": Config(_hf("llama"), needs="transformers", autocast=True),
    **{f"hf.{k}": Config(_hf(k), needs="transformers") for k in ("bart", "wav2vec2", "llama_checkpointing")},
    # issue 28: MoE models (Mixtral replayed from its file), and a forward under inference mode
    "hf.mixtral_saved": Config(_hf("mixtral"), needs="transformers", saved=True),
    "hf.deepseek_v3": Config(_hf("deepseek_v3"), needs="transformers"),
    "hf.llama_inference": Config(_hf("llama"), needs="transformers", inference=True),
    "nn.custom_op": Config(_custom_op),
    "nn.dataloader_epoch": Config(_loader_model, step=_epoch_step),
    "nn.optimizer_in_backward": Config(_in_backward_model, step=_in_backward_step),
    "nn.hook_shapes": Config(_hook_shapes_model, collected=lambda: _taken(SHAPES)),
    "nn.compiled": Config(_compiled),
    "tv.resnet18": Config(_tv("resnet18"), needs="torchvision"),
    "tv.resnet18_channels_last": Config(_tv("resnet18", channels_last=True), needs="torchvision"),
    "tv.convnext_tiny": Config(_tv("convnext_tiny"), needs="torchvision"),
    "tv.vit_b_16": Config(_tv("vit_b_16", shape=(1, 3, 224, 224)), needs="torchvision"),
    "tv.mobilenet_v3_small": Config(_tv("mobilenet_v3_small"), needs="torchvision"),
    "tv.fcn_resnet50": Config(_tv("fcn_resnet50", num_classes=4, weights_backbone=None), needs="torchvision"),
    "tv.r3d_18": Config(_tv("r3d_18", shape=(1, 3, 4, 32, 32)), needs="torchvision"),
    "tv.fasterrcnn": Config(_detection, needs="torchvision"),
    "tv.raft_small": Config(_raft, needs="torchvision"),
    "tv.swin_t": Config(_tv("swin_t"), needs="torchvision"),
    "tv.efficientnet_b0": Config(_tv("efficientnet_b0"), needs="torchvision"),
    **{f"diffusers.{k}": Config(_diffusers(k), needs="diffusers") for k in ("unet", "vae", "dit")},
    "timm.resnet18": Config(_timm("resnet18"), needs="timm"),
    "timm.convnext_atto": Config(_timm("convnext_atto"), needs="timm"),
    "timm.vit_tiny": Config(_timm("vit_tiny_patch16_224", img_size=64), needs="timm"),
    "timm.swinv2": Config(_timm("swinv2_cr_tiny_ns_224", img_size=64), needs="timm"),
}


# -- the checks -------------------------------------------------------------


def _ok(fn) -> tuple[str, str]:
    try:
        return ("yes" if fn() else "no"), ""
    except Exception as e:  # a column's failure is a result, not a crash of the tool
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _grads_meta(model) -> dict:
    return {
        n: (tuple(p.grad.shape), p.grad.dtype, _significant(p.grad.shape, p.grad.stride()))
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _significant(shape, stride) -> tuple:
    return tuple(st if n > 1 else None for n, st in zip(shape, stride))


def check(name: str) -> dict:
    """One row: each column's result ("yes"/"no"/"error"/"skipped") and notes."""
    config = CONFIGS[name]
    if config.needs and importlib.util.find_spec(config.needs) is None:
        return {"config": name, "skipped": f"{config.needs} not installed"}
    torch.manual_seed(0)
    try:
        model, inputs = config.build()
    except Exception as e:
        return {"config": name, "skipped": f"cannot build: {type(e).__name__}: {str(e)[:80]}"}
    step = _step(config)
    row, notes = {"config": name}, []
    try:
        trace = md.trace(step, model, *inputs)
        row["traces"] = "yes"
    except Exception as e:
        row["traces"] = "error"
        notes.append(f"trace: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        trace = None
    kept = config.collected() if config.collected is not None else None
    real_model = copy.deepcopy(model)
    try:
        real = eager_calls(step, real_model, *inputs)
    except Exception as e:
        return {"config": name, "skipped": f"the real run fails: {type(e).__name__}: {str(e)[:80]}"}
    if kept is not None and trace is not None and kept != config.collected():
        row["traces"] = "no"  # what the step wrote outside the model is not what eager leaves
        notes.append("trace: the hooks' writes outside the model differ from eager's")
    if trace is not None:
        traced = trace_calls(trace)
        row["ops"] = (
            "yes" if [c.op for c in traced] == [c.op for c in real] else f"no ({len(traced)} vs {len(real)} calls)"
        )
        grads = {n: (tuple(g.shape), g.dtype, _significant(g.shape, g.stride)) for n, g in trace.grads.items()}
        row["meta"] = "yes" if traced == real and grads == _grads_meta(real_model) else "no"
        with FlopCounterMode(display=False) as counter:
            step(copy.deepcopy(model), *inputs)
        row["flops"], note = _ok(lambda: md.flops(trace).total == counter.get_total_flops())
        real_model = copy.deepcopy(model)
        with md.LiveStorages(real_model, *inputs) as live:
            step(real_model, *inputs)
        peak = md.memory(trace, workspaces=False).peak  # LiveStorages sees storages, not kernels' scratch
        row["memory"] = "yes" if peak == live.peak else f"no ({peak - live.peak:+,} B of {live.peak:,})"
    row["fake"], note = _ok(lambda: _fake_step(step, model, inputs))
    if note:
        notes.append(f"fake: {note}")
    if trace is not None:
        row["replay"], note = _column(lambda: _replay(step, model, inputs, _saved(trace) if config.saved else trace))
        if note:
            notes.append(f"replay: {note}")
    row["materialize"], note = _column(lambda: _materialize(config))
    if note:
        notes.append(f"materialize: {note}")
    row["cuda"], note = _ok(lambda: md.tracer(device="cuda", gpu="h100")(_step(config, "cuda"), model, *inputs))
    if note:
        notes.append(f"cuda: {note}")
    row["notes"] = "; ".join(notes)
    return row


def _column(fn) -> tuple[str, str]:
    """A column whose ``fn`` returns "" when it holds, or why not."""
    try:
        why = fn()
    except Exception as e:  # a failure is a result, not a crash of the tool
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return ("yes", "") if not why else ("no", why)


def _replay(step, model, inputs, trace) -> str:
    """Replay against the eager step from the generator state the trace began with."""
    r = md.replay(trace, (model, *inputs))
    eager_model = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.set_rng_state(trace.rng_state)
        out = step(eager_model, *inputs)
    grads = {n: p.grad for n, p in eager_model.named_parameters() if p.grad is not None}
    differ = [n for n, g in grads.items() if n not in r.grads or not _bitwise(r.grads[n], g)]
    if not _bitwise(r.output, out):
        differ.insert(0, "output")
    if r.ok and not differ:
        return ""
    why = "ok" if r.ok else f"not ok: {len(r.mismatches)} mismatched calls, {len(r.made_up)} made up"
    if not differ:
        return f"{why}; the values equal eager's"
    return f"{why}; {len(differ)} of {len(grads) + 1} values differ from eager's ({', '.join(differ[:2])})"


def _saved(trace):
    """The trace written to a file and loaded back (what a replay elsewhere runs)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json.gz")
        trace.save(path)
        return md.Trace.load(path)


def _bitwise(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.detach(), b.detach())
    )


def _materialize(config: Config, seed: int = 1) -> str:
    """The model built on meta and materialised against the eager build, both from ``seed``."""
    torch.manual_seed(seed)
    with md.MetaMode():
        meta, _ = config.build()
    torch.manual_seed(seed)
    eager, _ = config.build()
    got, expected = _state(md.materialize(meta)), _state(eager)
    if [n for n, _ in got] != [n for n, _ in expected]:
        return f"names differ: {len(got)} vs {len(expected)} tensors"
    differ = [
        n
        for (n, a), (_, b) in zip(got, expected)
        if type(a) is not type(b) or a.requires_grad != b.requires_grad or not _bitwise(a, b)
    ]
    return f"{len(differ)} of {len(got)} tensors differ ({', '.join(differ[:2])})" if differ else ""


def _state(module) -> list:
    """Every parameter and buffer, persistent or not, under each of its names."""
    return list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))


def _fake_step(step, model, inputs) -> bool:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel = copy.deepcopy(model)
    for mod in fmodel.modules():
        for table in (mod._parameters, mod._buffers):
            for k, t in table.items():
                if t is not None:
                    fake = mode.from_tensor(t)
                    table[k] = nn.Parameter(fake, t.requires_grad) if table is mod._parameters else fake
    with mode:
        step(fmodel, *(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs))
    return True


COLUMNS = ("config", "traces", "ops", "meta", "flops", "memory", "fake", "replay", "materialize", "cuda", "notes")


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['config']} | skipped: {r['skipped']} |" + " |" * (len(COLUMNS) - 2))
        else:
            lines.append("| " + " | ".join(str(r.get(c, "-")) for c in COLUMNS) + " |")
    return "\n".join(lines)


def expected(path: str, version: str) -> dict[str, dict]:
    """The rows of the table in ``path`` that follows the line
    ``<!-- model-conformance torch X.Y -->`` for this torch's ``X.Y``:
    config -> its result columns (the notes are written for people)."""
    lines = open(path, encoding="utf-8").read().splitlines()
    marker = f"<!-- model-conformance torch {version} -->"
    if marker not in lines:
        raise SystemExit(f"{path} has no table marked {marker!r}")
    rows = {}
    for line in lines[lines.index(marker) + 1 :]:
        if rows and not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        installed = not (cells[1].startswith("skipped:") and cells[1].endswith("not installed"))
        if len(cells) == len(COLUMNS) and cells[0] not in ("config", "---") and installed:
            rows[cells[0]] = dict(zip(COLUMNS[1:-1], cells[1:-1]))
    return rows


def differences(rows: list[dict], want: dict[str, dict]) -> list[str]:
    """Each configuration whose result columns differ from ``want``, or is missing on either side."""
    # A library that is not installed leaves its rows out; a model that cannot
    # be built or run is a difference.
    # A column a row has no result for reads as the table writes it ("-":
    # nothing to compare after the trace failed); a skipped row, every column.
    got = {
        r["config"]: {c: "skipped" if "skipped" in r else str(r.get(c, "-")) for c in COLUMNS[1:-1]}
        for r in rows
        if not r.get("skipped", "").endswith("not installed")
    }
    out = []
    for name in sorted(got.keys() | want.keys()):
        if got.get(name) != want.get(name):
            changed = {c: (want.get(name, {}).get(c), got.get(name, {}).get(c)) for c in COLUMNS[1:-1]}
            diff = {c: f"{a} -> {b}" for c, (a, b) in changed.items() if a != b}
            if name not in want or name not in got:
                diff = "only in the " + ("run" if name in got else "docs")
            out.append(f"{name}: {diff}")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="run the configurations whose names contain one of these")
    parser.add_argument(
        "--expect",
        metavar="DOC",
        help="compare every result column with DOC's table for this torch version; exit 1 on a difference",
    )
    args = parser.parse_args(argv)
    names = [n for n in CONFIGS if not args.names or any(a in n for a in args.names)]
    torch.set_num_threads(1)
    rows = []
    for n in names:
        rows.append(check(n))
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"torch {torch.__version__}\n")
    print(table(rows))
    if args.expect:
        want = expected(args.expect, ".".join(torch.__version__.split(".")[:2]))
        if args.names:
            want = {k: v for k, v in want.items() if k in names}
        diff = differences(rows, want)
        if diff:
            print(f"\n{len(diff)} configurations differ from {args.expect} (update its table if the change is right):")
            print("\n".join("  " + d for d in diff))
            return 1
        print(f"\nevery row equals {args.expect}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
