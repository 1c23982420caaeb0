"""The command line's errors: one line on stderr, an exit code per class, a traceback only with --debug."""

import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import metadispatch as md
from metadispatch.cli.main import EXIT_CODES, _Progress, main

USAGE, FAILURE = 2, 3


def _run(argv, capsys):
    """(exit code, stderr) of main(argv), whether it returns or argparse exits."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _assert_one_line(err: str, message: str):
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) <= 2 and message in lines[0], err  # the error, and a hint
    if len(lines) == 2:
        assert lines[1].startswith("  (")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trace", "--seq", "0"], "argument --seq: must be at least 1, got 0"),
        (["trace", "--batch", "0"], "argument --batch: must be at least 1, got 0"),
        (["trace", "--batch", "-1"], "argument --batch: must be at least 1, got -1"),
        (["trace", "--batch", "two"], "argument --batch: expected an integer, got 'two'"),
        (["summary", "t.json", "--top", "-1"], "argument --top: must be at least 1, got -1"),
        (["summary", "t.json", "--depth", "-5"], "argument --depth: must be at least 0, got -5"),
        (["trace", "--top", "0"], "argument --top: must be at least 1, got 0"),
        (["check", "m:f", "--limit", "-1"], "argument --limit: must be at least 0, got -1"),
        (["trace", "--device", "gpu"], "argument --device: not a device: 'gpu'"),
        (["trace", "--config", "n_layer=2"], "--config needs --hf"),
        (["trace", "not-a-spec"], "expected MODULE:CALLABLE, got 'not-a-spec'"),
        (["trace", "m:f", "--hf", "gpt2"], "give m:f or --hf gpt2, not both"),
        (["trace", "m:f", "--dtype", "f32"], "--dtype: for the built-in model and --hf only; m:f makes its own"),
        (["trace", "m:f", "--batch", "2", "--seq", "8"], "--batch, --seq: for the built-in model and --hf only"),
        (["trace", "--hf", "vit", "--seq", "8"], "--seq 8: --hf vit takes images, not tokens"),
        (["trace", "--hf", "hubert", "--seq", "8"], "--seq 8: --hf hubert takes raw audio, not tokens"),
        (  # a speech encoder-decoder without Whisper's features: an AttributeError while "building the model" before
            ["trace", "--hf", "voxtral"],
            "--hf voxtral: no inputs known for this speech model (VoxtralConfig has no num_mel_bins or "
            "max_source_positions",
        ),
        (["trace", "--known-limit", "0"], "argument --known-limit: must be at least 1, got 0"),
        (["trace", "--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
        (["trace", "--world-size", "2", "--rank", "-1"], "argument --rank: must be at least 0, got -1"),
        (["trace", "--world-size", "2", "--tp", "0"], "argument --tp: must be at least 1, got 0"),
        (["trace", "--world-size", "2", "--rank", "2", "--fsdp"], "--rank 2: not a rank of a world of 2"),
        (["trace", "--fsdp"], "--fsdp, --tp, --pp, --dp, --rank, --worst-rank and --blocks need --world-size"),
        (["trace", "--gpu", "bogus"], "argument --gpu: unknown GPU 'bogus'"),
        (["check", "m:f", "--gpu", "bogus"], "argument --gpu: unknown GPU 'bogus'"),
        (["check", "m:f", "--device", "cuda"], "--device cuda: check re-runs every call on the CPU"),
        (["replay", "t.json", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["trace", "--dtype", "f64"], "argument --dtype: invalid choice: 'f64'"),
        (["trace", "--amp", "f32"], "argument --amp: invalid choice: 'f32'"),
        (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
    ],
)
def test_cli_refuses_bad_arguments_with_exit_2(argv, message, capsys):
    code, err = _run(argv, capsys)
    assert code == USAGE
    _assert_one_line(err, message)


@pytest.mark.parametrize(
    "config, message",
    [
        ("bogus_key=5", "--config bogus_key: GPT2Config has no such key"),
        ("n_layers=2", "--config n_layers: GPT2Config has no such key (did you mean n_layer?)"),
        ("=1", "--config expects KEY=VALUE, got '=1'"),
        ("n_layer=-1", "--config n_layer=-1: must be an integer of at least 1 (GPT2Config's default is 12)"),
        ("n_layer=0", "--config n_layer=0: must be an integer of at least 1"),
        ("activation_function=5", "--config activation_function=5: expected a string (GPT2Config's default is"),
        ("layer_norm_epsilon=abc", "--config layer_norm_epsilon='abc': expected a number (GPT2Config's default is"),
        ("scale_attn_weights=3", "--config scale_attn_weights=3: expected True or False (GPT2Config's default is"),
        ("n_head=5", "--config: the gpt2 model refused these settings: `embed_dim` must be divisible by num_heads"),
    ],
)
def test_cli_config_keys_must_exist_and_sizes_be_positive(config, message, capsys):
    pytest.importorskip("transformers")
    code, err = _run(["trace", "--hf", "gpt2", "--config", config], capsys)
    assert code == USAGE
    _assert_one_line(err, message)


def test_cli_config_keys_of_nested_configs_must_exist(capsys):
    pytest.importorskip("transformers")
    code, err = _run(["trace", "--hf", "clip", "--config", "vision_config={'bogus': 1}"], capsys)
    assert code == USAGE
    _assert_one_line(err, "--config vision_config.bogus: CLIPVisionConfig has no such key")
    code, err = _run(["trace", "--hf", "clip", "--config", "vision_config={'num_hidden_layers': 0}"], capsys)
    assert code == USAGE
    _assert_one_line(err, "--config vision_config.num_hidden_layers=0: must be an integer of at least 1")


def test_cli_hf_unknown_type_is_a_usage_error(capsys):
    pytest.importorskip("transformers")
    code, err = _run(["trace", "--hf", "no_such_model"], capsys)
    assert code == USAGE
    _assert_one_line(err, "--hf no_such_model: not a transformers model type")


def test_cli_hf_refuses_kinds_it_cannot_feed_naming_what_it_supports(capsys):
    pytest.importorskip("transformers")
    small = ["num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "intermediate_size=64"]
    argv = ["trace", "--hf", "bert", "--seq", "8", "--forward-only"]
    code, err = _run(argv + [a for pair in small for a in ("--config", pair)], capsys)
    assert code == 0  # bert has a causal-LM head: fed token ids
    code, err = _run(["trace", "--hf", "llava"], capsys)
    assert code == USAGE
    _assert_one_line(err, "--hf llava: no inputs known for this kind of model; --hf supports decoder-only")
    assert "speech encoders with a CTC head on raw audio (wav2vec2, hubert, ...)" in err


def test_cli_hf_builds_ctc_speech_encoders_on_raw_audio(capsys):
    pytest.importorskip("transformers")
    from metadispatch.cli import targets

    small = ["num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "intermediate_size=64"]
    argv = ["trace", "--hf", "wav2vec2", "--top", "1"]
    for pair in small:
        argv += ["--config", pair]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("transformers Wav2Vec2ForCTC (batch 1 x 1 s of 16 kHz audio): forward and")
    t = targets.hf_target("wav2vec2", targets.parse_overrides(small), "cpu", True, 2)
    assert [tuple(x.shape) for x in t.inputs] == [(2, targets.AUDIO_SAMPLES)]
    assert t.model.config.layerdrop == 0.0  # a layer skipped at random (training) is no one step


_SMALL_SEQ2SEQ = [
    "--config",
    "d_model=32",
    "--config",
    "encoder_layers=1",
    "--config",
    "decoder_layers=1",
    "--config",
    "encoder_attention_heads=2",
    "--config",
    "decoder_attention_heads=2",
    "--config",
    "encoder_ffn_dim=64",
    "--config",
    "decoder_ffn_dim=64",
    "--seq",
    "8",
]


@pytest.mark.parametrize(
    "arch, extra, model, inputs",
    [
        ("bart", ["--config", "vocab_size=100"], "BartForConditionalGeneration", ("input_ids", "labels")),
        (
            "whisper",
            ["--config", "max_source_positions=16", "--config", "num_mel_bins=8"],
            "WhisperForConditionalGeneration",
            ("input_features", "labels"),
        ),
    ],
)
def test_cli_hf_builds_encoder_decoders_with_fitting_inputs(arch, extra, model, inputs, capsys):
    pytest.importorskip("transformers")
    from metadispatch.cli import targets

    code, _ = _run(["trace", "--hf", arch, "--forward-only", "--top", "2"] + _SMALL_SEQ2SEQ + extra, capsys)
    assert code == 0
    overrides = targets.parse_overrides([a for a in _SMALL_SEQ2SEQ + extra if "=" in a])
    t = targets.hf_target(arch, overrides, "cpu", False, 1, 8)
    assert t.name.startswith(f"transformers {model}")
    assert len(t.inputs) == len(inputs)
    if arch == "whisper":  # 2 x max_source_positions mel frames: what the encoder's convolutions expect
        assert tuple(t.inputs[0].shape) == (1, 8, 32)


def test_cli_hf_builds_vision_models_with_pixel_inputs(capsys):
    pytest.importorskip("transformers")
    code, _ = _run(
        [
            "trace",
            "--hf",
            "clip",
            "--forward-only",
            "--config",
            "vision_config={'image_size': 32, 'patch_size': 8, 'hidden_size': 32, 'intermediate_size': 64,"
            " 'num_hidden_layers': 1, 'num_attention_heads': 2}",
        ],
        capsys,
    )
    assert code == 0
    code, _ = _run(["trace", "--hf", "resnet", "--forward-only", "--config", "depths=[1, 1, 1, 1]"], capsys)
    assert code == 0


def test_cli_missing_file_is_a_failure_to_run(tmp_path, capsys):
    code, err = _run(["summary", str(tmp_path / "nope.json.gz")], capsys)
    assert code == FAILURE
    _assert_one_line(err, f"could not read {tmp_path / 'nope.json.gz'}: FileNotFoundError")


def test_cli_directory_is_a_failure_to_run(tmp_path, capsys):
    code, err = _run(["replay", str(tmp_path)], capsys)
    assert code == FAILURE
    _assert_one_line(err, f"could not read {tmp_path}: TraceFormatError")
    assert "not a regular file" in err  # refused before it is opened as a file (issue 11)


def test_cli_corrupt_trace_is_a_failure_to_run(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text('{"format": "metadispatch-trace", "version": 1, "calls": [')
    code, err = _run(["summary", str(path)], capsys)
    assert code == FAILURE
    _assert_one_line(err, f"could not read {path}: ")


def test_cli_unknown_module_is_a_failure_to_run(capsys):
    code, err = _run(["trace", "no_such_module_xyz:build"], capsys)
    assert code == FAILURE
    _assert_one_line(err, "building the model: ModuleNotFoundError: No module named 'no_such_module_xyz'")
    code, err = _run(["check", "tests.models:no_such_fn"], capsys)
    assert code == FAILURE
    _assert_one_line(err, "building the model: AttributeError")


@pytest.fixture
def raising_model(tmp_path):
    script = tmp_path / "raising.py"
    script.write_text(
        textwrap.dedent("""
        import torch

        class Bad(torch.nn.Module):
            def forward(self, x):
                raise ValueError("this model is broken")

        def build():
            return Bad(), torch.ones(2)
    """)
    )
    return f"{script}:build"


def test_cli_model_that_raises_is_a_failure_to_run(raising_model, capsys):
    code, err = _run(["trace", raising_model, "--device", "cpu"], capsys)
    assert code == FAILURE
    _assert_one_line(
        err, "the model raised while tracing: ValueError: this model is broken (at raising.py:6 in forward)"
    )


def test_cli_missing_file_the_model_reads_is_named(tmp_path, capsys):
    # The OS error's message alone ("No such file or directory") named no file.
    script = tmp_path / "loads.py"
    script.write_text("import torch\n\ndef build():\n    return torch.load('weights.pt'), ()\n")
    code, err = _run(["trace", f"{script}:build"], capsys)
    assert code == FAILURE
    _assert_one_line(err, "FileNotFoundError: No such file or directory: 'weights.pt' (at loads.py:4 in build)")
    code, err = _run(["trace", f"{tmp_path / 'absent.py'}:build"], capsys)
    assert code == FAILURE
    _assert_one_line(
        err, f"building the model: FileNotFoundError: No such file or directory: '{tmp_path / 'absent.py'}'"
    )


def test_cli_debug_shows_the_traceback(raising_model, capsys):
    code, err = _run(["trace", raising_model, "--device", "cpu", "--debug"], capsys)
    assert code == FAILURE and "Traceback (most recent call last)" in err
    code, err = _run(["--debug", "summary", "/no/such/file.json"], capsys)
    assert code == FAILURE and "Traceback (most recent call last)" in err


@pytest.mark.parametrize("option", ["--out", "--perfetto"])
def test_cli_output_that_cannot_be_written_is_a_failure_to_run(option, tmp_path, capsys):
    target = tmp_path / "no_such_dir" / "t.json"
    code, err = _run(["trace", "tests.models:mlp", "--device", "cpu", option, str(target)], capsys)
    assert code == FAILURE
    _assert_one_line(err, f"could not write {target}: FileNotFoundError")


def test_cli_check_on_logical_cuda_refuses_to_recheck_on_cpu(capsys):
    code, err = _run(["check", "tests.models:mlp", "--device", "cuda"], capsys)
    assert code == USAGE
    _assert_one_line(err, "--device cuda: check re-runs every call on the CPU")
    code, _ = _run(["check", "tests.models:mlp", "--device", "cuda", "--no-recheck"], capsys)
    assert code == 0


def test_cli_exit_codes_are_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = capsys.readouterr().out
    assert EXIT_CODES.splitlines()[1] in out and "3  failures to run" in out


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_cli_progress_shows_after_a_second_only(monkeypatch):
    monkeypatch.setattr(_Progress, "DELAY", 0.05)
    stream = _Terminal()
    with _Progress("building the model", stream=stream):
        time.sleep(0.3)
    assert "building the model..." in stream.getvalue()
    quick = _Terminal()
    monkeypatch.setattr(_Progress, "DELAY", 5.0)
    with _Progress("tracing", lambda: 3, stream=quick):
        pass
    assert quick.getvalue() == ""


def test_cli_hf_t5_starts_decoding_at_the_pad_token(capsys):
    # T5's config leaves decoder_start_token_id unset; the model raised on it.
    pytest.importorskip("transformers")
    argv = ["trace", "--hf", "t5", "--forward-only", "--top", "1", "--seq", "8"]
    for pair in ("num_layers=1", "num_decoder_layers=1", "d_model=32", "d_ff=64", "num_heads=2", "d_kv=16"):
        argv += ["--config", pair]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("transformers T5ForConditionalGeneration (batch 1 x 8 tokens): forward")


_TINY_GPT2 = ["--config", "n_layer=1", "--config", "n_embd=32", "--config", "n_head=2", "--top", "1"]


def test_cli_hf_seq_past_learned_positions_is_a_usage_error(capsys):
    pytest.importorskip("transformers")
    code, err = _run(["trace", "--hf", "gpt2", "--seq", "1025"] + _TINY_GPT2, capsys)
    assert code == USAGE
    _assert_one_line(err, "--seq 1025: longer than GPT2Config's n_positions (1024)")
    # Rotary positions have no such end: llama traces past max_position_embeddings.
    llama = ["--config", "num_hidden_layers=1", "--config", "hidden_size=32", "--config", "intermediate_size=64"]
    llama += ["--config", "num_attention_heads=2", "--config", "num_key_value_heads=2", "--config", "vocab_size=64"]
    code, err = _run(["trace", "--hf", "llama", "--seq", "4096", "--forward-only", "--top", "1"] + llama, capsys)
    assert code == 0, err


def test_cli_hf_trace_saves_and_loads_back(tmp_path, capsys):
    # The step's output was a ModelOutput holding a DynamicCache, which no
    # trace file records: --out failed after tracing for every --hf model.
    pytest.importorskip("transformers")
    path = tmp_path / "gpt2.json.gz"
    code, err = _run(["trace", "--hf", "gpt2", "--seq", "8", "--out", str(path)] + _TINY_GPT2, capsys)
    assert code == 0, err
    code, err = _run(["summary", str(path), "--top", "1"], capsys)
    assert code == 0, err


@pytest.fixture
def marked_build(tmp_path):
    """A target whose build leaves a marker file: whether it was built at all."""
    script = tmp_path / "marked.py"
    marker = tmp_path / "built"
    script.write_text(
        textwrap.dedent(f"""
        import pathlib, torch

        def build():
            pathlib.Path({str(marker)!r}).write_text("built")
            return torch.nn.Linear(2, 2), torch.ones(1, 2)

        def single():
            return torch.nn.Linear(2, 2)
    """)
    )
    return script, marker


@pytest.mark.parametrize("option", ["--out", "--plot"])
def test_cli_output_in_a_missing_folder_fails_before_building(option, marked_build, tmp_path, capsys):
    script, marker = marked_build
    target = tmp_path / "no_such_dir" / "t.json"
    code, err = _run(["trace", f"{script}:build", "--device", "cpu", option, str(target)], capsys)
    assert code == FAILURE and not marker.exists()
    _assert_one_line(err, f"could not write {target}: FileNotFoundError: no folder {target.parent}")
    code, err = _run(["trace", f"{script}:build", "--device", "cpu", option, str(tmp_path)], capsys)
    assert code == FAILURE and not marker.exists()
    _assert_one_line(err, f"could not write {tmp_path}: IsADirectoryError")


def test_cli_plot_in_a_format_matplotlib_lacks_fails_before_building(marked_build, tmp_path, capsys):
    # It failed after the whole trace, in matplotlib's savefig.
    script, marker = marked_build
    code, err = _run(["trace", f"{script}:build", "--device", "cpu", "--plot", str(tmp_path / "m.txt")], capsys)
    assert code == FAILURE and not marker.exists()
    _assert_one_line(
        err, "could not write " + str(tmp_path / "m.txt") + ": ValueError: matplotlib writes no 'txt' format"
    )
    # Without an extension: a PNG under the name given (savefig alone wrote m.png and the CLI said m).
    assert main(["trace", f"{script}:build", "--device", "cpu", "--plot", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m").read_bytes().startswith(b"\x89PNG") and not (tmp_path / "m.png").exists()


@pytest.mark.parametrize("command", ["trace", "check"])
def test_cli_target_returning_no_pair_is_a_usage_error(command, marked_build, capsys):
    script, _ = marked_build
    code, err = _run([command, f"{script}:single", "--device", "cpu"], capsys)
    assert code == USAGE
    _assert_one_line(err, f"{script}:single must return (model, example inputs), got Linear")


def test_cli_check_gpu_needs_logical_cuda_and_names_the_profile(marked_build, capsys):
    script, marker = marked_build
    code, err = _run(["check", f"{script}:build", "--gpu", "a100-80gb"], capsys)
    assert code == USAGE and not marker.exists()
    _assert_one_line(err, "--gpu needs --device cuda")
    code = main(["check", f"{script}:build", "--device", "cuda", "--no-recheck", "--gpu", "a100-80gb"])
    assert code == 0 and marker.exists()
    assert capsys.readouterr().out.startswith(f"{script}:build: checked on cuda (a100-80gb)\nmd.check: ")


def test_cli_check_of_a_model_that_raises_is_a_finding(raising_model, capsys):
    try:
        code = main(["check", raising_model])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err
    assert "Stopped: ValueError: this model is broken (module <top>, at raising.py:6 in forward)" in captured.out


@pytest.mark.slow  # a process of its own: imports torch again
def test_cli_console_finds_modules_where_the_user_stands(tmp_path):
    # An installed script's sys.path holds its own folder, not the user's;
    # `metadispatch check mymodel:build` must find ./mymodel.py as `python -m` would.
    script = Path(sys.executable).parent / "metadispatch"
    if not script.exists():
        pytest.skip("metadispatch is not installed as a script beside this python")
    (tmp_path / "mymodel.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(2, 2), torch.ones(1, 2)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run(
        [str(script), "check", "mymodel:build"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("mymodel:build: checked on cpu\nmd.check: ")


def test_cli_interrupt_exits_130_without_a_traceback(tmp_path, capsys):
    script = tmp_path / "interrupted.py"
    script.write_text("def build():\n    raise KeyboardInterrupt\n")
    code, err = _run(["trace", f"{script}:build", "--device", "cpu"], capsys)
    assert code == 130
    _assert_one_line(err, "metadispatch trace: interrupted")


def test_cli_error_whose_first_line_ends_in_a_colon_keeps_the_next(tmp_path, capsys):
    script = tmp_path / "colon.py"
    script.write_text(
        "def build():\n    raise ValueError('Validation error for field x:\\n    expected str, got int')\n"
    )
    code, err = _run(["trace", f"{script}:build", "--device", "cpu"], capsys)
    assert code == FAILURE
    _assert_one_line(err, "ValueError: Validation error for field x: expected str, got int (at colon.py:2 in build)")


class _ClosedPipe(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_cli_closed_stdout_is_no_failure_to_report(monkeypatch, capsys):
    # `metadispatch ... | head`: main leaves the broken pipe to console(),
    # which stops quietly; it is not "exit 3: failed: BrokenPipeError".
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    with pytest.raises(BrokenPipeError):
        main(["trace", "tests.models:mlp", "--device", "cpu"])
    assert capsys.readouterr().err == ""


def test_cli_findings_exit_1_replay_mismatch_and_check_problem(tmp_path, capsys):
    # A wrong rule (transposed strides) is recorded; replaying the file finds it.
    tril = torch.ops.aten.tril.default

    @md.register_meta(tril, override=True)
    def wrong(x, diagonal=0):
        return torch.empty_like(x).t()

    try:
        path = tmp_path / "wrong.json"
        md.trace(lambda x: x.tril(), torch.randn(3, 3)).save(path)
    finally:
        md.unregister_meta(tril)
    code = main(["replay", str(path)])
    captured = capsys.readouterr()
    assert code == 1 and captured.err == "" and "stride" in captured.out
    script = tmp_path / "dd.py"
    script.write_text("import torch\n\ndef build():\n    return (lambda x: (x > 0).nonzero()), torch.randn(4)\n")
    code = main(["check", f"{script}:build"])
    assert code == 1 and "Data-dependent ops" in capsys.readouterr().out


def test_cli_config_token_ids_may_be_zero():
    transformers = pytest.importorskip("transformers")
    from metadispatch.cli import targets

    config = transformers.GPT2Config()
    targets.check_overrides(config, {"bos_token_id": 0, "eos_token_id": 0})  # ids, not counts: no error
    with pytest.raises(targets.UsageError, match="n_layer=0: must be an integer of at least 1"):
        targets.check_overrides(config, {"n_layer": 0})


def test_cli_dtype_sets_the_built_in_models_dtype(tmp_path, capsys):
    # --dtype was read for --hf only: the built-in LLaMA stayed bf16 whatever it said.
    out = tmp_path / "t.json"
    assert main(["trace", "--dtype", "f32", "--seq", "8", "--forward-only", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("built-in LLaMA-7B (f32, batch 1 x 8 tokens)")
    params = [leaf.meta for leaf in md.Trace.load(out).leaves.values() if leaf.kind == "param"]
    assert len(params) == 291 and {p.dtype for p in params} == {torch.float32}


def test_cli_amp_traces_mixed_precision(tmp_path, capsys):
    # --amp: float32 weights, the forward under torch.autocast (Note [Autocast
    # on a logical GPU]); the built-in attention casts for its flash kernel.
    out = tmp_path / "t.json"
    assert main(["trace", "--amp", "bf16", "--seq", "8", "--optimizer", "none", "--steps", "1", "--out", str(out)]) == 0
    assert "built-in LLaMA-7B (f32, batch 1 x 8 tokens): forward and backward under autocast (bf16)" in (
        capsys.readouterr().out
    )
    trace = md.Trace.load(out)
    params = [leaf.meta for leaf in trace.leaves.values() if leaf.kind == "param"]
    assert {p.dtype for p in params} == {torch.float32}
    forward = [c for c in trace.calls if c.phase == "forward"]
    assert {c.output_metas[0].dtype for c in forward if c.op == "aten.mm.default"} == {torch.bfloat16}
    assert any(c.op == "aten._scaled_dot_product_flash_attention.default" for c in forward)
    assert {g.dtype for g in trace.grads.values()} == {torch.float32}


def test_cli_hf_builds_a_type_with_several_image_classifiers(capsys):
    # DeiT maps to two classes (with and without a distillation head); a default config's architectures is None,
    # which transformers' Auto class iterated: TypeError before
    pytest.importorskip("transformers")
    small = "image_size=32 patch_size=8 hidden_size=32 intermediate_size=64 num_hidden_layers=1 num_attention_heads=2"
    config = [a for pair in small.split() for a in ("--config", pair)]
    code, err = _run(["trace", "--hf", "deit", "--forward-only", *config], capsys)
    assert code == 0, err


@pytest.mark.parametrize("arch", ["big_bird", "rembert"])
def test_cli_hf_traces_a_model_that_reads_its_token_ids(arch, capsys):
    # transformers' padding warning reads pad in ids[:, [-1, 0]] (Note [The command line's token ids are data]):
    # a DataDependentError before; the ids are drawn from a generator of the command's own
    pytest.importorskip("transformers")
    small = "hidden_size=32 intermediate_size=64 num_hidden_layers=1 num_attention_heads=2"
    small += " input_embedding_size=32 output_embedding_size=32" if arch == "rembert" else ""
    config = [a for pair in small.split() for a in ("--config", pair)]
    state = torch.random.get_rng_state()
    code, err = _run(["trace", "--hf", arch, "--batch", "16", "--seq", "512", *config], capsys)  # past known_limit
    assert code == 0, err
    assert torch.equal(torch.random.get_rng_state(), state)


def test_cli_hf_xlnet_has_no_end_of_positions(capsys):
    # XLNet's max_position_embeddings is -1 (relative positions): --seq 128 was refused as longer than -1
    pytest.importorskip("transformers")
    small = "d_model=32 n_layer=1 n_head=2 d_inner=64"
    code, err = _run(
        ["trace", "--hf", "xlnet", "--forward-only", *[a for p in small.split() for a in ("--config", p)]], capsys
    )
    assert code == 0, err


def test_cli_known_limit_keeps_a_larger_constant_for_the_step_to_read(capsys):
    # LED pads to its attention window and reads a 4-d mask made of the ids' all-ones mask: 2 x 64 x 64 elements
    pytest.importorskip("transformers")
    small = "d_model=32 encoder_layers=1 decoder_layers=1 encoder_attention_heads=2 decoder_attention_heads=2"
    small += " encoder_ffn_dim=64 decoder_ffn_dim=64 attention_window=64"
    argv = ["trace", "--hf", "led", "--forward-only", "--batch", "2", "--seq", "64"]
    argv += [a for p in small.split() for a in ("--config", p)]
    code, err = _run(argv, capsys)
    assert code == FAILURE and "--known-limit N) with N >= 8,192 keeps them" in err, err
    code, err = _run([*argv, "--known-limit", "8192"], capsys)
    assert code == 0, err
