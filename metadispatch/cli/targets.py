"""What the command line traces: the built-in LLaMA, ``MODULE:CALLABLE`` or
a ``transformers`` architecture built from its config.

Each target is built under ``md.MetaMode(device=...)``, so building a 7B
model allocates nothing, and comes back as a :class:`Target`: the model, the
example inputs, and a step that runs forward and (unless told not to)
backward.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import MetaDispatchError
from ..mode.mode import MetaMode
from ..values import fed
from . import llama

__all__ = [
    "Target",
    "default_target",
    "callable_target",
    "hf_target",
    "load_callable",
    "model_and_inputs",
    "parse_overrides",
    "check_overrides",
    "UsageError",
    "SUPPORTED_HF",
]


class UsageError(ValueError):
    """A command-line argument that cannot work; the CLI exits 2 with its message."""


class Target(NamedTuple):
    name: str
    model: Any  # None when built lazily
    inputs: tuple
    step: Callable  # step(model, *inputs): what gets traced
    # build() -> (model, inputs) in the active mode: ``--world-size`` builds
    # inside the traced rank (cli/plan.py).
    build: Callable | None = None


def _built(name, build: Callable, step: Callable, device, lazy: bool) -> Target:
    """The target, its model built now under a non-recording MetaMode unless
    ``lazy``; ``name`` may be a function of the model (None when lazy)."""
    model, inputs = None, ()
    if not lazy:
        with MetaMode(device=device, record=False):
            model, inputs = build()
    return Target(name(model) if callable(name) else name, model, inputs, step, build)


def _train_step(backward: bool, call: Callable | None = None, amp: tuple | None = None) -> Callable:
    """The traced step: the forward (under ``torch.autocast(*amp)`` when
    mixed precision is asked for, as training scripts write it), then the
    backward of its loss outside autocast."""

    def step(model, *inputs):
        with torch.autocast(*amp) if amp is not None else contextlib.nullcontext():
            out = call(model, *inputs) if call is not None else model(*inputs)
        loss = _first_tensor(out)
        if backward and loss is not None and loss.requires_grad:
            (loss if loss.dim() == 0 else loss.float().sum()).backward()
        return out

    return step


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def default_target(
    device="cuda", backward=True, batch=1, seq=2048, lazy: bool = False, dtype=None, amp=None, layers=None
) -> Target:
    """LLaMA-7B in ``dtype`` (default bf16; float32 under ``amp``, mixed
    precision's master weights), a batch of ``batch`` x ``seq`` tokens;
    ``layers`` blocks instead of 32."""
    dtype = dtype or (torch.float32 if amp is not None else torch.bfloat16)
    short = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}.get(dtype, str(dtype))
    return _built(
        f"built-in LLaMA-7B ({short}, batch {batch} x {seq} tokens)",
        lambda: llama.build(llama.LlamaConfig(**({} if layers is None else {"n_layers": layers})), batch, seq, dtype),
        _train_step(backward, amp=amp),
        device,
        lazy,
    )


# Quoted for shells that glob brackets (zsh); a checkout installs its own extras.
_HF_MISSING = (
    "--hf needs transformers: pip install 'metadispatch[hf]' (in a checkout of metadispatch: pip install '.[hf]')"
)


def load_callable(spec: str) -> Callable:
    """``package.module:fn`` or ``path/to/file.py:fn``."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise UsageError(f"expected MODULE:CALLABLE, got {spec!r}")
    if mod_name.endswith(".py") or "/" in mod_name:
        path = Path(mod_name)
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(path.stem, module)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    return _builder(spec, getattr(module, attr))


def _builder(spec: str, obj) -> Callable:
    """``obj`` if it can build (model, inputs); a usage error naming what it is otherwise.

    A model itself (an ``nn.Module`` or its class) is the common slip: called
    with no inputs, its ``forward`` raised, which read as the model failing.
    """
    if isinstance(obj, torch.nn.Module) or (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        what = (
            f"the nn.Module class {obj.__name__}" if isinstance(obj, type) else f"an nn.Module ({type(obj).__name__})"
        )
        raise UsageError(
            f"{spec} is {what}, not a function returning (model, example inputs); "
            f"write one, e.g. def build(): return {getattr(obj, '__name__', type(obj).__name__)}(...), torch.randn(...)"
        )
    if not callable(obj):
        raise UsageError(f"{spec} is a {type(obj).__name__}, not a function returning (model, example inputs)")
    return obj


def callable_target(spec: str, device="cuda", backward=True, lazy: bool = False, amp=None) -> Target:
    """A function returning ``(model, inputs)``; inputs a tensor or a tuple."""
    fn = load_callable(spec)
    return _built(spec, lambda: model_and_inputs(spec, fn()), _train_step(backward, amp=amp), device, lazy)


def model_and_inputs(spec: str, built) -> tuple:
    """``(model, inputs as a tuple)`` from what ``spec``'s callable returned, or a usage error."""
    if not (isinstance(built, tuple) and len(built) == 2):
        got = f"a tuple of {len(built)}" if isinstance(built, tuple) else type(built).__name__
        raise UsageError(f"{spec} must return (model, example inputs), got {got}")
    model, inputs = built
    return model, inputs if isinstance(inputs, tuple) else (inputs,)


def parse_overrides(pairs: list) -> dict:
    """``["num_hidden_layers=2", "act='gelu'"]`` -> dict, values as Python literals."""
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--config expects KEY=VALUE, got {pair!r}")
        try:
            out[key.strip()] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key.strip()] = value
    return out


def check_overrides(config, overrides: dict, prefix: str = "") -> None:
    """Refuse keys the config class does not have (in nested configs too:
    ``vision_config={...}``), values of another type than the default's,
    and counts or sizes below 1."""
    name = type(config).__name__
    for key, value in overrides.items():
        where = f"--config {prefix}{key}"
        if not hasattr(config, key):
            close = difflib.get_close_matches(key, list(config.to_dict()), n=1)
            raise UsageError(f"{where}: {name} has no such key" + (f" (did you mean {close[0]}?)" if close else ""))
        default = getattr(config, key)
        if hasattr(default, "to_dict") and isinstance(value, dict):
            check_overrides(default, value, f"{prefix}{key}.")
            continue
        # A token id or an index may be 0; a count or a size may not.
        is_id = key.endswith(("_id", "_ids", "_index", "_idx"))
        is_count = isinstance(default, int) and not isinstance(default, bool) and default >= 1 and not is_id
        if is_count and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError(f"{where}={value!r}: must be an integer of at least 1 ({name}'s default is {default})")
        kind = _kind(default)
        if kind is not None and _kind(value) != kind:
            raise UsageError(f"{where}={value!r}: expected {kind} ({name}'s default is {default!r})")


def _kind(value) -> str | None:
    """What a value replacing a config default must be; None where the config class judges."""
    if isinstance(value, bool):
        return "True or False"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else None


SUPPORTED_HF = (
    "decoder-only language models (llama, gpt2, ...), encoder-decoder language models "
    "(bart, t5, ...), speech encoder-decoders (whisper), speech encoders with a CTC head on "
    "raw audio (wav2vec2, hubert, ...) and image classifiers (vit, resnet, ...)"
)
AUDIO_SAMPLES = 16000  # one second at 16 kHz: what --hf feeds a CTC speech encoder


def hf_config(arch: str, overrides: dict):
    """``arch``'s default transformers config with ``overrides``; a UsageError names what is wrong."""
    try:
        import transformers
    except ImportError as e:
        raise UsageError(_HF_MISSING) from e
    try:
        config = transformers.AutoConfig.for_model(arch)
    except ValueError:
        raise UsageError(f"--hf {arch}: not a transformers model type (e.g. llama, gpt2, bart, whisper, vit)") from None
    check_overrides(config, overrides)
    try:
        return transformers.AutoConfig.for_model(arch, **overrides)
    except (ValueError, TypeError) as e:  # the config class's own validation
        raise UsageError(f"--config: {type(config).__name__} refused it: {_message(e)}") from e


def require_causal_lm(arch: str, config, command: str) -> None:
    """Refuse, as a usage error, a ``--hf`` type that is not a decoder-only causal LM (``serve``, ``plan``)."""
    from transformers.models.auto import modeling_auto as auto

    encoder = arch in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if arch not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "is_encoder_decoder", False) or encoder:
        raise UsageError(f"--hf {arch}: {command} plans a decoder-only causal LM (e.g. llama, mistral, qwen3, gemma2)")


def hf_target(
    arch: str,
    overrides: dict,
    device="cuda",
    backward=True,
    batch=1,
    seq=None,
    dtype=None,
    lazy: bool = False,
    amp=None,
) -> Target:
    """A ``transformers`` model of architecture ``arch`` (a model type such
    as ``llama``, ``bart``, ``whisper`` or ``vit``) from its default config
    with ``overrides``, and inputs that fit it (see ``SUPPORTED_HF``).
    ``seq``: tokens (default 128); refused for models that take no tokens."""
    config = hf_config(arch, overrides)  # first: it says how to install transformers
    import transformers
    from transformers.models.auto import modeling_auto as auto

    if arch in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        kind, auto_class = "speech", transformers.AutoModelForSpeechSeq2Seq
    elif getattr(config, "is_encoder_decoder", False) and arch in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        kind, auto_class = "seq2seq", transformers.AutoModelForSeq2SeqLM
    elif arch in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        kind, auto_class = "image", transformers.AutoModelForImageClassification
    elif arch in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False):
        kind, auto_class = "causal", transformers.AutoModelForCausalLM
    elif _main_input(transformers, auto.MODEL_FOR_CTC_MAPPING_NAMES.get(arch)) == "input_values":
        kind, auto_class = "ctc", transformers.AutoModelForCTC
    else:
        raise UsageError(f"--hf {arch}: no inputs known for this kind of model; --hf supports {SUPPORTED_HF}")
    missing = [k for k in ("num_mel_bins", "max_source_positions") if not hasattr(config, k)]  # Whisper's features
    if kind == "speech" and missing:
        raise UsageError(
            f"--hf {arch}: no inputs known for this speech model ({type(config).__name__} has no {' or '.join(missing)}: "
            f"--hf feeds speech encoder-decoders Whisper's mel features); --hf supports {SUPPORTED_HF}"
        )
    if kind in ("image", "ctc") and seq is not None:
        takes = "images" if kind == "image" else "raw audio"
        raise UsageError(f"--seq {seq}: --hf {arch} takes {takes}, not tokens")
    seq = 128 if seq is None else seq
    if kind in ("causal", "seq2seq", "speech"):
        check_positions(config, kind, seq)
    for key in [k for k in config.to_dict() if k.endswith("layerdrop") and k not in overrides]:
        setattr(config, key, 0.0)  # a layer skipped at random makes no one step to trace
    if getattr(config, "architectures", None) is None:
        # the Auto class picks among a type's classes (DeiT: with or without a distillation head) by this
        # list, iterating it; a default config leaves it None, and from_config raised TypeError: the first
        config.architectures = []
    if kind == "seq2seq" and getattr(config, "decoder_start_token_id", None) is None:
        # T5's configs leave it unset (its checkpoints start decoding at the pad token).
        config.decoder_start_token_id = config.pad_token_id or 0
    names: list = []

    def build():
        try:
            model = auto_class.from_config(config)
        except (ValueError, AssertionError) as e:
            # A model that checks its config (heads dividing the width,
            # probabilities in [0, 1]) refused what --config set.
            if not overrides or isinstance(e, MetaDispatchError):
                raise
            raise UsageError(f"--config: the {arch} model refused these settings: {_message(e)}") from e
        if dtype is not None:
            model = model.to(dtype)
        inputs = _hf_inputs(kind, config, batch, seq, dtype)
        names[:] = inputs
        return model, tuple(inputs.values())

    def call(model, *values):
        # The tensors of the model's output: a cache object is no value a
        # trace records (--out could not save it).
        out = model(**dict(zip(names, values)))
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    shape = {"causal": f"batch {batch} x {seq} tokens", "seq2seq": f"batch {batch} x {seq} tokens"}.get(
        kind, f"batch {batch} x 1 s of 16 kHz audio" if kind == "ctc" else f"batch {batch}"
    )
    return _built(
        lambda model: f"transformers {type(model).__name__ if model is not None else arch} ({shape})",
        build,
        _train_step(backward, call, amp),
        device,
        lazy,
    )


def _message(error: BaseException) -> str:
    """An error's message on one line (a validation error's first line ends in ':')."""
    return " ".join(line.strip() for line in str(error).strip().splitlines() if line.strip())


def _main_input(transformers, class_name) -> str | None:
    """What a model class takes first (``input_values``: raw audio), or None."""
    return getattr(getattr(transformers, class_name, None), "main_input_name", None) if class_name else None


def check_positions(config, kind: str, seq: int, option: str = "--seq") -> None:
    """Refuse a ``--seq`` longer than the model's learned position embeddings
    (the real model would index past them); rotary and relative ones have no such end."""
    if any("rope" in k or "rotary" in k for k in config.to_dict()):
        return
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return
    for key in ("max_target_positions",) if kind == "speech" else ("n_positions", "max_position_embeddings"):
        limit = getattr(config, key, None)
        # XLNet's -1: relative positions, no end
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < seq:
            raise UsageError(
                f"{option} {seq}: longer than {type(config).__name__}'s {key} ({limit}), the length its "
                f"learned position embeddings cover; lower {option} or raise it with --config {key}=N"
            )


def _hf_inputs(kind: str, config, batch: int, seq: int, dtype) -> dict:
    """Example inputs (with labels, so that the model returns a loss) for one kind of model."""
    vocab = getattr(config, "vocab_size", 1000)
    if kind == "image":
        vision = getattr(config, "vision_config", None) or config  # CLIP-style configs nest it
        size = getattr(vision, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        pixels = torch.randn(batch, getattr(vision, "num_channels", 3), size, size, dtype=dtype)
        return {"pixel_values": pixels, "labels": torch.randint(0, config.num_labels, (batch,))}
    if kind == "ctc":
        # No labels: CTC's loss selects the labels a mask keeps (masked_select), a
        # size only data gives; backward runs from the logits instead.
        return {"input_values": torch.randn(batch, AUDIO_SAMPLES, dtype=dtype)}
    ids = fed.random_ids(vocab, (batch, seq))  # Note [The command line's token ids are data]
    if kind == "speech":
        frames = 2 * config.max_source_positions  # the encoder's two strided convolutions halve it
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, dtype=dtype), "labels": ids}
    return {"input_ids": ids, "labels": ids}
