"""train.py's parts in one process, without training: the configuration (dataclass defaults, YAML preset, command
line, model keys), optimizer groups, TrainState, the bf16 warning, failing every rank together, the token-id check
and the command line's error handling."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bilinear_lm.training import TrainingInputError, TrainState, distributed, parse_config, together

REPO = Path(__file__).resolve().parents[1]
PRESET = str(REPO / "bilinear_lm" / "configs" / "shakespeare-char.yaml")
SMALL = {"hidden_size": 16, "num_hidden_layers": 2, "num_heads": 2, "state_size": 4, "rank": 4}


# -------------------------------------------------------------------------------------------- configuration
def test_command_line_over_preset_over_dataclass_default(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("max_steps: 7\nlearning_rate: 2.0e-3\ntokenizer: char\nsample_prompt: null\n"
                      "model:\n  hidden_size: 64\n  num_heads: 2\n")
    cfg = parse_config(["--config", str(preset), "--learning_rate=5e-4", "--model.num_heads", "4", "--block-size",
                        "32", "--learning_rate", "3e-4"])
    assert cfg.train.max_steps == 7 and cfg.data.tokenizer == "char"  # the preset's
    assert cfg.train.learning_rate == 3e-4 and cfg.data.block_size == 32  # the command line's (the last one)
    assert cfg.train.batch_size == 16 and cfg.train.sample_prompt is None  # the dataclass defaults
    assert cfg.model == {"hidden_size": 64, "num_heads": 4}  # the preset's model keys, the command line over them
    assert parse_config([]).train.max_steps == 1000 and parse_config([]).model == {}


@pytest.mark.parametrize("command_line, launcher, preset, expected", [
    ("fp16", "bf16", "no", ("fp16", "train.py --mixed_precision")),
    (None, "bf16", "no", ("bf16", "the launcher's: accelerate launch --mixed_precision or its config file, over the "
                                  "preset's no")),
    (None, "bf16", None, ("bf16", "the launcher's: accelerate launch --mixed_precision or its config file")),
    (None, "no", "bf16", ("bf16", "the preset's")),  # the launcher's "no" is also its default: not a choice
    (None, None, "bf16", ("bf16", "the preset's")),
    (None, "no", None, (None, "the launcher's default")),
    (None, None, None, (None, "the default")),
])
def test_mixed_precision_command_line_then_launcher_then_preset(tmp_path, command_line, launcher, preset, expected):
    preset_file = tmp_path / "preset.yaml"
    preset_file.write_text("max_steps: 3\n" + (f"mixed_precision: {preset!r}\n" if preset else ""))
    argv = ["--config", str(preset_file)] + (["--mixed_precision", command_line] if command_line else [])
    cfg = parse_config(argv, environ={"ACCELERATE_MIXED_PRECISION": launcher} if launcher else {})
    assert (cfg.train.mixed_precision, cfg.mixed_precision_from) == expected
    assert cfg.train.max_steps == 3 and cfg.argv == tuple(argv)


@pytest.mark.parametrize("preset_text, message", [
    ("max_steps: many\n", r"preset .*p.yaml: argument --max_steps/--max-steps: invalid int value: 'many'"),
    ("mixed_precision: no\n", r"preset .*p.yaml: argument --mixed_precision.* invalid choice: 'false'"),
    ("learning_rat: 0.1\n", r"preset .*p.yaml: unknown argument '--learning_rat' \(did you mean --learning_rate\?\)"),
    ("model:\n  hiden_size: 3\n", r"preset .*p.yaml: unknown model key 'hiden_size'; valid model keys: .*hidden_size"),
    ("model:\n  conv_width: wide\n", r"preset .*p.yaml: argument --model.conv_width: invalid int value: 'wide'"),
    ("- max_steps\n", r"--config .*p.yaml': a preset maps keys to values"),
    ("max_steps: [1\n", r"--config .*p.yaml': not valid YAML"),
])
def test_bad_preset_values_are_one_line_errors_naming_the_key(tmp_path, preset_text, message):
    (tmp_path / "p.yaml").write_text(preset_text)
    with pytest.raises(TrainingInputError, match=message):
        parse_config(["--config", str(tmp_path / "p.yaml")])


def test_new_model_options_parse_with_their_types_when_the_preset_does_not_set_them():
    from bilinear_lm.baselines import build_model

    cfg = parse_config(["--config", PRESET, "--model.conv_width", "4", "--model.additive_input", "1",
                        "--model.hidden_act", "gelu", "--model.reset_state_at_eos", "yes",
                        "--model.rms_norm_eps", "1e-6", "--model.intermediate_size", "96"])
    model = cfg.model
    assert model["conv_width"] == 4 and type(model["conv_width"]) is int
    assert model["additive_input"] is True and model["reset_state_at_eos"] is True  # bools, not the int 1 / "yes"
    assert model["hidden_act"] == "gelu"
    assert model["rms_norm_eps"] == 1e-6 and type(model["rms_norm_eps"]) is float
    assert model["intermediate_size"] == 96
    built = build_model("bilinear", {**model, "eos_token_id": 0}, vocab_size=65)
    assert built.config.conv_width == 4 and built.config.additive_input is True
    assert built.config.hidden_act == "gelu" and built.config.reset_state_at_eos is True
    # a string-typed key keeps what YAML would turn into a bool; a bare flag is true; "=" works as a separator
    assert parse_config(["--model.hidden_act", "yes"]).model["hidden_act"] == "yes"
    assert parse_config(["--model.additive_input"]).model["additive_input"] is True
    assert parse_config(["--model.initializer_range=-0.5"]).model["initializer_range"] == -0.5
    assert parse_config(["--model.eos_token_id", "[1, 2]"]).model["eos_token_id"] == [1, 2]  # int | list: as YAML
    with pytest.raises(TrainingInputError, match="argument --model.additive_input: invalid bool value: 'maybe'"):
        parse_config(["--model.additive_input", "maybe"])
    for value in ("4.5", "4.0"):  # ints are written as ints, as for the training keys
        with pytest.raises(TrainingInputError, match=f"argument --model.conv_width: invalid int value: '{value}'"):
            parse_config(["--model.conv_width", value])


def test_preset_model_values_are_typed(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("model:\n  hidden_size: 64\n  rms_norm_eps: 1e-6\n  additive_input: true\n")
    model = parse_config(["--config", str(preset)]).model
    assert model == {"hidden_size": 64, "rms_norm_eps": 1e-6, "additive_input": True}  # YAML reads 1e-6 as a string
    assert type(model["rms_norm_eps"]) is float


def test_help_lists_every_key_and_every_model_key_with_its_type(capsys):
    import train

    with pytest.raises(SystemExit) as exit_:
        train.cli(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for pattern in (r"--model.conv_width +int +0\n", r"--model.additive_input +bool +False\n",
                    r"--model.hidden_act +str +'silu'\n", r"--model.reset_state_at_eos +bool +False\n",
                    r"--model.vocab_size +int +len\(tokenizer\)\n", r"--max_steps MAX_STEPS.*\n +optimizer steps",
                    r"--config CONFIG +a YAML preset", r"--model.allow_neg_eigval +bool +False\n",
                    r"--model.dt_bias_init +str +'paper'\n",
                    r"--model_type \{bilinear,llama,gated_deltanet,mamba2,mamba,lstm\}"):
        assert re.search(pattern, out), pattern


def test_help_as_a_script_loads_no_data_pipeline_launcher_or_trainer():
    """`python train.py --help` prints the same help before train.py imports the training stack: no datasets, no
    accelerate, not transformers' trainer utilities (which import peft where it is installed), and no model (the
    package loads its model classes on first use; the baselines stay unimported): 9.1 -> 7.6 s on an EPYC AVX2,
    then without the model (results-history.md, 2026-11-29)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"--model.conv_width +int +0\n", out.stdout)
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "bilinear_lm.training.config" in imported
    training_stack = {"datasets", "peft", "lm_eval", "transformers.trainer_utils", "bilinear_lm.training.data",
                      "transformers.modeling_utils", "bilinear_lm.modeling.modeling_bilinear", "bilinear_lm.baselines"}
    assert not imported & training_stack, imported & training_stack


def test_eos_follows_every_document_of_a_dataset_but_not_every_line_of_a_txt_file(tmp_path):
    """--add_eos by default: on for --dataset (a Hub dataset, here a local folder of one) and .jsonl rows, which are
    documents; off for a .txt file, whose rows are its lines; --add_eos true puts it after every line too."""
    from bilinear_lm.training import load_data

    docs = [f"story number {i}, once upon a time. " * 8 for i in range(12)]
    (tmp_path / "stories").mkdir()
    (tmp_path / "stories" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "lines.txt").write_text("".join(d + "\n" for d in docs))
    for data_args, documents in (([f"--dataset={tmp_path / 'stories'}"], True),
                                 ([f"--train_file={tmp_path / 'lines.txt'}"], False),
                                 ([f"--train_file={tmp_path / 'lines.txt'}", "--add_eos=true"], True)):
        cfg = parse_config([*data_args, "--bpe_vocab_size=300", "--block_size=16", "--batch_size=1",
                            f"--output_dir={tmp_path / 'out'}"])
        data = load_data(cfg, SimpleNamespace(is_main_process=True, num_processes=1), None)
        ids = torch.cat([data.blocks[split][:]["input_ids"].flatten() for split in ("train", "validation")])
        eos = (ids == data.tokenizer.eos_token_id).sum().item()
        assert eos >= len(docs) - 2 if documents else eos == 0, (data_args, eos)  # the packing drops partial tails


# ------------------------------------------------------------------------------------- optimizer groups
def _group_names(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return [sorted(names[id(p)] for p in g["params"]) for g in groups]


def _expected_bilinear(layers, conv=False, transition=("W1", "W2"), tied=True):
    """Written out by hand from the rule (not derived from the code under test)."""
    decay, no_decay = ["model.embed_tokens.weight"], ["model.norm.weight"]
    if not tied:
        decay.append("lm_head.weight")
    for i in range(layers):
        p = f"model.layers.{i}."
        decay += [p + "mixer.in_proj.weight", p + "mixer.out_proj.weight", p + "mlp.gate_up_proj.weight",
                  p + "mlp.down_proj.weight", *(p + "mixer.transition." + w for w in transition)]
        no_decay += [p + "mixer_norm.weight", p + "mlp_norm.weight", p + "mixer.transition.factor_bias", p + "mixer.h_start",
                     p + "mixer.state_norm.weight"]
        if conv:
            decay.append(p + "conv.weight")
    return [sorted(decay), sorted(no_decay)]


@pytest.mark.parametrize("extra, expected", [
    ({}, dict()),
    ({"conv_width": 4}, dict(conv=True)),
    ({"mixer_type": "full"}, dict(transition=("W",))),
    ({"mixer_type": "diagonal"}, dict(transition=())),
    ({"tie_word_embeddings": False}, dict(tied=False)),
])
def test_bilinear_optimizer_groups_by_name(extra, expected):
    from bilinear_lm.baselines import build_model, optimizer_groups

    model = build_model("bilinear", {**SMALL, **extra}, vocab_size=30)
    groups = optimizer_groups(model, 0.25)  # the one entry point: the bilinear rules for a bilinear model
    assert [g["weight_decay"] for g in groups] == [0.25, 0.0]
    assert _group_names(model, groups) == _expected_bilinear(2, **expected)


def test_bilinear_optimizer_groups_skip_frozen_and_refuse_unknown_parameters():
    from bilinear_lm.baselines import build_model, optimizer_groups

    model = build_model("bilinear", SMALL, vocab_size=30)
    model.model.layers[0].mixer.h_start.requires_grad_(False)
    assert "model.layers.0.mixer.h_start" not in sum(_group_names(model, optimizer_groups(model, 0.1)), [])
    model.model.layers[1].mixer.new_thing = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="no weight-decay rule for parameter model.layers.1.mixer.new_thing"):
        optimizer_groups(model, 0.1)


@pytest.mark.parametrize("model_type", ["llama", "mamba", "lstm"])
def test_baseline_optimizer_groups_decay_only_linear_and_embedding_weights(model_type):
    from bilinear_lm.baselines import build_model, optimizer_groups

    with torch.device("meta"):
        model = build_model(model_type, SMALL, vocab_size=30)
    decay, no_decay = _group_names(model, optimizer_groups(model, 0.1))
    everything = sorted(n for n, p in model.named_parameters())
    assert sorted(decay + no_decay) == everything
    matrices = {"llama": ("_proj.weight", "embed_tokens.weight", "lm_head.weight"),
                "mamba": ("in_proj.weight", "x_proj.weight", "dt_proj.weight", "out_proj.weight", "embeddings.weight",
                          "lm_head.weight"),
                "lstm": ("embed.weight", "head.weight")}[model_type]
    assert decay == sorted(n for n in everything if n.endswith(matrices))
    assert not any("norm" in n or n.endswith((".bias", "A_log", ".D", "conv1d.weight")) or n.startswith("lstm.")
                   for n in decay)


def test_train_py_builds_adamw_on_the_models_groups():
    import train
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(
        vocab={c: i for i, c in enumerate("abcdefghij")}, merges=[])))
    accelerator = SimpleNamespace(num_processes=1)
    for model_type, rule in (("bilinear", lambda m: _expected_bilinear(2, conv=True)),
                             ("llama", None)):
        cfg = parse_config(["--config", PRESET, "--model_type", model_type, "--weight_decay", "0.3",
                            *[x for k, v in SMALL.items() for x in (f"--model.{k}", str(v))],
                            "--model.conv_width", "4", "--model.additive_input", "true"])
        model, optimizer, scheduler = train.build_model_and_optimizer(cfg, accelerator, tokenizer)
        groups = optimizer.param_groups
        assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
        names = _group_names(model, groups)
        if rule is not None:
            assert names == rule(model)
        assert not any("norm" in n for n in names[0])


def test_evaluation_keeps_no_tensor_per_batch_and_averages_the_batch_means():
    """train.evaluate sums the batch means as floats: as many live tensors during the 12th batch as during the 2nd
    (a tensor kept per batch fragments glibc's heap by about a batch's logits a batch: 8.9 GB after 100 Gutenberg
    batches). The loss is the mean of the batches' means, of the first ``eval_iters`` only when given."""
    import gc

    import train

    counts = []

    class Model(torch.nn.Module):
        def forward(self, x):
            gc.collect()
            counts.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
            return SimpleNamespace(loss=x.float().mean())

    batches = [{"x": torch.full((2, 3), float(i))} for i in range(12)]
    accelerator = SimpleNamespace(gather=lambda t: t, is_local_main_process=False)
    assert train.evaluate(Model(), batches, accelerator, eval_iters=0)["val_loss"] == pytest.approx(5.5)
    assert len(counts) == 12 and counts[-1] == counts[1]
    result = train.evaluate(Model(), batches, accelerator, eval_iters=5)
    assert result["val_loss"] == pytest.approx(2.0) and result["val_ppl"] == pytest.approx(math.exp(2.0))


# ------------------------------------------------------------------------------------------ TrainState
def test_train_state_round_trips_and_reads_old_checkpoints(tmp_path):
    state = TrainState(step=5, epoch=1, batches_done=3, train_seconds=12.5)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 5, "epoch": 1, "batches_done": 3,
                                                             "train_seconds": 12.5}))
    assert TrainState.load(tmp_path) == state
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 5, "epoch": 1, "batches_done": 3}))
    assert TrainState.load(tmp_path) == TrainState(step=5, epoch=1, batches_done=3, train_seconds=0.0)


# ------------------------------------------------------------------------------------------ bf16 on CPU
@pytest.mark.parametrize("native, warns", [(True, False), (False, True), (None, False)])
def test_bf16_warning_on_a_cpu_without_native_bf16(monkeypatch, native, warns):
    monkeypatch.setattr(distributed, "cpu_has_native_bf16", lambda: native)
    warning = distributed.bf16_cpu_warning("bf16", "cpu")
    assert (warning is not None) == warns
    if warns:
        assert "14x slower" in warning and "--mixed_precision no" in warning
    assert distributed.bf16_cpu_warning("no", "cpu") is None and distributed.bf16_cpu_warning("bf16", "cuda") is None


def test_native_bf16_probe_reads_the_cpu_flags(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw amx_bf16 amx_tile\n")
    assert distributed.cpu_has_native_bf16(str(cpuinfo)) is True
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    assert distributed.cpu_has_native_bf16(str(cpuinfo)) is True
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512vl avx512dq\n")
    assert distributed.cpu_has_native_bf16(str(cpuinfo)) is False  # AVX512 alone: oneDNN emulates bf16
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # aarch64
    assert distributed.cpu_has_native_bf16(str(cpuinfo)) is True
    # no flags to read: oneDNN's answer, when it says there is no bf16 path at all
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert distributed.cpu_has_native_bf16(str(tmp_path / "missing")) is False
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert distributed.cpu_has_native_bf16(str(tmp_path / "missing")) is None


# ------------------------------------------------------------------------------------ failing together
class FakeAccelerator:
    """Rank `rank` of 2; `gather` answers with the given per-rank failure flags (the other rank's included)."""

    def __init__(self, rank, other_failed):
        self.num_processes, self.process_index, self.is_main_process = 2, rank, rank == 0
        self.device, self.other_failed, self.gathers = "cpu", other_failed, 0

    def gather(self, tensor):
        self.gathers += 1
        flags = [int(self.other_failed)] * 2
        flags[self.process_index] = int(tensor.item())
        return torch.tensor(flags)


def test_a_rank_fails_when_the_main_process_failed_and_does_not_run_its_part():
    calls = []
    with pytest.raises(TrainingInputError, match="building the tokenizer failed on process 0 .* stopping process 1 "
                                                 "too"):
        together(FakeAccelerator(1, other_failed=True), lambda: calls.append(1), "building the tokenizer",
                 main_first=True)
    assert calls == []


def test_the_failed_rank_raises_its_own_error_and_success_everywhere_returns():
    from bilinear_lm.training import DataError

    def fail():
        raise DataError("tokenizer path is not a directory")

    with pytest.raises(DataError, match="tokenizer path is not a directory"):
        together(FakeAccelerator(0, other_failed=False), fail, "building the tokenizer", main_first=True)
    ranks = [FakeAccelerator(0, other_failed=False), FakeAccelerator(1, other_failed=False)]
    assert [together(acc, lambda: "tok", "x", main_first=True) for acc in ranks] == ["tok", "tok"]
    assert ranks[0].gathers == ranks[1].gathers == 2  # every rank takes part in the same collectives
    with pytest.raises(TrainingInputError, match="tokenizing failed on process 1"):
        together(FakeAccelerator(0, other_failed=True), lambda: "tok", "tokenizing")


# ------------------------------------------------------------------------------------ command-line errors
def test_cli_prints_input_errors_as_one_line_and_keeps_tracebacks_of_bugs(monkeypatch, capsys, tmp_path):
    import train

    assert train.cli(["--max_stepz", "3"]) == 1
    assert capsys.readouterr().err == ("error: unknown argument '--max_stepz' (did you mean --max_steps?); train.py "
                                       "--help lists the arguments\n")
    assert train.cli(["--config", str(tmp_path / "missing.yaml")]) == 1
    assert capsys.readouterr().err.startswith(f"error: --config '{tmp_path / 'missing.yaml'}': preset file not found")

    def internal_bug(*args, **kwargs):
        raise ValueError("an internal error")

    monkeypatch.setattr(train, "load_data", internal_bug)
    with pytest.raises(ValueError, match="an internal error"):  # not swallowed into "error: ..."
        train.cli(["--config", PRESET, "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("flag", ["--transition_lr_scale", "--log_shard_checksums"])
def test_removed_flags_are_unknown_arguments(flag, capsys):
    """--transition_lr_scale (rejected by a measurement, docs/results.md) and --log_shard_checksums (a test
    hook now) are gone: one line, exit status 1."""
    import train

    assert train.cli(["--config", PRESET, flag, "2"]) == 1
    assert capsys.readouterr().err == f"error: unknown argument '{flag}'; train.py --help lists the arguments\n"


def test_out_of_vocabulary_token_ids_are_a_clear_error(tmp_path):
    """A tokenizer whose ids are not below its length (a gap in its vocabulary)."""
    from datasets import Dataset, DatasetDict
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from bilinear_lm.training import check_blocks_fit_vocabulary, tokenize_and_pack

    vocab = {c: i for i, c in enumerate("abcd")} | {"e": 40}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])))
    assert len(tokenizer) == 5
    raw = DatasetDict(train=Dataset.from_dict({"text": ["abcdabcde" * 4]}),
                      validation=Dataset.from_dict({"text": ["abcdabcd" * 2]}))
    blocks = tokenize_and_pack(raw, tokenizer, 8)
    with pytest.raises(TrainingInputError, match=r"token id 40 in the train data is outside the model's "
                                                 r"vocabulary of 5 ids .*--model.vocab_size 41"):
        check_blocks_fit_vocabulary(blocks, 5)
    check_blocks_fit_vocabulary(blocks, 41)


# ------------------------------------------------------------------------------------------ checkpoints
def _fake_checkpoint(root, step, complete=True):
    """OUTPUT_DIR/checkpoints/step_N with a few files and a manifest, like save_checkpoint writes (no training)."""
    from bilinear_lm.training.checkpoint import DONE_MARKER, write_manifest

    path = root / "checkpoints" / f"step_{step}"
    (path / "tokenizer").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (path / "tokenizer" / "tokenizer.json").write_text("{}")
    write_manifest(path)
    if complete:
        (path / DONE_MARKER).write_text(f"{step}\n")
    return path


@pytest.mark.parametrize("damage, reason", [
    (None, None),
    ("flip", r"model.safetensors does not match its SHA-256 in the manifest \(corrupted\)"),
    ("truncate", r"model.safetensors has 1000 bytes, the manifest says 1024 \(truncated"),
    ("delete", r"tokenizer/tokenizer.json is missing"),
    ("manifest", r"its manifest.json is unreadable"),
])
def test_verify_checkpoint_names_what_is_wrong(tmp_path, damage, reason):
    from bilinear_lm.training import verify_checkpoint

    path = _fake_checkpoint(tmp_path, 2)
    weights = path / "model.safetensors"
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[500] ^= 0x01
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "delete":
        (path / "tokenizer" / "tokenizer.json").unlink()
    elif damage == "manifest":
        (path / "manifest.json").write_text('{"files": [')
    problem = verify_checkpoint(path)
    assert problem is None if reason is None else re.fullmatch(reason + ".*", problem), problem


def test_latest_skips_damaged_and_incomplete_checkpoints_with_a_warning_and_a_named_one_is_an_error(tmp_path):
    from bilinear_lm.training import find_checkpoint, latest_checkpoint

    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4)
    (_fake_checkpoint(tmp_path, 6) / "model.safetensors").write_bytes(b"short")
    _fake_checkpoint(tmp_path, 8, complete=False)
    warnings = []
    assert find_checkpoint(str(tmp_path), "latest", warn=warnings.append) == tmp_path / "checkpoints" / "step_4"
    assert warnings == [f"warning: skipping checkpoint {tmp_path / 'checkpoints' / 'step_6'}: model.safetensors has "
                        f"5 bytes, the manifest says 1024 (truncated or overwritten); trying the previous one"]
    with pytest.raises(TrainingInputError, match=r"step_6'?: the checkpoint is damaged: model.safetensors has 5 "
                                                 r"bytes") as err:
        find_checkpoint(str(tmp_path / "checkpoints" / "step_6"), str(tmp_path / "checkpoints" / "step_6"))
    assert "\n" not in str(err.value)
    with pytest.raises(TrainingInputError, match="not a complete checkpoint directory"):
        find_checkpoint(str(tmp_path), str(tmp_path / "checkpoints" / "step_8"))
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step_{step}" / "model.safetensors").write_bytes(b"")
    warnings.clear()
    # none usable: None, and the damaged ones named with why, newest first (train.py's error lists them), no warnings
    assert find_checkpoint(str(tmp_path), "latest", warn=warnings.append) is None and warnings == []
    path, damaged = latest_checkpoint(str(tmp_path), warn=warnings.append)
    assert path is None and warnings == []
    assert [(p.name, why.split(",")[0]) for p, why in damaged] == [
        ("step_6", "model.safetensors has 5 bytes"), ("step_4", "model.safetensors has 0 bytes"),
        ("step_2", "model.safetensors has 0 bytes")]


def test_prune_keeps_the_newest_complete_checkpoints_and_never_partial_or_just_written_ones(tmp_path):
    from bilinear_lm.training import prune_checkpoints

    for step in (2, 4, 6, 10):
        _fake_checkpoint(tmp_path, step)
    partial = _fake_checkpoint(tmp_path, 12, complete=False)
    tmp = tmp_path / "checkpoints" / ".tmp_step_14"
    tmp.mkdir()
    deleted = prune_checkpoints(str(tmp_path), 2, keep=tmp_path / "checkpoints" / "step_10")
    assert sorted(p.name for p in deleted) == ["step_2", "step_4"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".tmp_step_14", "step_10", "step_12",
                                                                           "step_6"]
    assert partial.exists() and tmp.exists()
    # the one just written survives even when it is not among the newest (a run resumed from an older checkpoint)
    assert prune_checkpoints(str(tmp_path), 1, keep=tmp_path / "checkpoints" / "step_6") == []
    assert (tmp_path / "checkpoints" / "step_6").exists() and (tmp_path / "checkpoints" / "step_10").exists()


def test_every_option_is_classified_for_resume_and_the_flags_parse():
    from dataclasses import fields

    from bilinear_lm.training import DataConfig, TrainConfig
    from bilinear_lm.training.checkpoint import (RESUME_CHANGE_ALLOWED_WITH_FLAG, RESUME_FREE, RESUME_MUST_MATCH,
                                                 RESUME_TOKENIZER)

    names = [f.name for cls in (DataConfig, TrainConfig) for f in fields(cls)]
    sets = (RESUME_MUST_MATCH, RESUME_TOKENIZER, RESUME_CHANGE_ALLOWED_WITH_FLAG, RESUME_FREE)
    assert {n: sum(n in s for s in sets) for n in names} == {n: 1 for n in names}
    assert set().union(*sets) == set(names)
    cfg = parse_config(["--save_total_limit", "2", "--allow_config_change"])
    assert cfg.train.save_total_limit == 2 and cfg.train.allow_config_change is True
    assert parse_config([]).train.save_total_limit == 3 and parse_config([]).train.allow_config_change is False
    with pytest.raises(TrainingInputError, match="--save_total_limit must be 0"):
        parse_config(["--save_total_limit", "-1"])


def test_config_check_names_changed_model_options_and_gates_data_changes(tmp_path):
    from bilinear_lm.training import check_config_change
    from bilinear_lm.training.checkpoint import CONFIG_FILE, config_record

    base = ["--config", PRESET, "--batch_size", "4", "--model.hidden_size", "32"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config_record(parse_config(base))))
    warnings = []
    check_config_change(tmp_path, parse_config(base + ["--max_steps", "7", "--eval_interval", "3",
                                                       "--model.recurrence_impl", "chunked"]), warn=warnings.append)
    assert warnings == []
    with pytest.raises(TrainingInputError, match=r"the model differs from the checkpoint's \(--model_type bilinear -> "
                                                 r"llama, --model.hidden_size 32 -> 48, --model.state_size 48 -> 16\)"):
        check_config_change(tmp_path, parse_config(base + ["--model.hidden_size", "48", "--model.state_size", "16",
                                                           "--model_type", "llama"]))
    with pytest.raises(TrainingInputError, match=r"\(--block_size 64 -> 32\).*--allow_config_change"):
        check_config_change(tmp_path, parse_config(base + ["--block_size", "32"]))
    check_config_change(tmp_path, parse_config(base + ["--batch_size", "8", "--allow_config_change"]),
                        warn=warnings.append)
    assert len(warnings) == 1 and "--batch_size 4 -> 8" in warnings[0]
    # the model default is the same value written out: no change
    check_config_change(tmp_path, parse_config(base + ["--model.rms_norm_eps", "1e-5"]))


def test_a_resumed_run_keeps_the_checkpoints_tokenizer_and_refuses_another_even_with_allow_config_change(tmp_path):
    """--bpe_vocab_size 2048 on resuming a 4096 BPE run used to warn "4096 -> 2048" and keep the old tokenizer: a
    one-line error now, with or without --allow_config_change (the model learned the old tokenizer's ids). A
    --bpe_vocab_size that trains nothing (the checkpoint's tokenizer is char) passes."""
    from bilinear_lm.training import check_config_change
    from bilinear_lm.training.checkpoint import CONFIG_FILE, config_record

    base = ["--config", PRESET, "--tokenizer", "bpe", "--bpe_vocab_size", "4096"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config_record(parse_config(base))))
    for extra in ([], ["--allow_config_change"]):
        with pytest.raises(TrainingInputError, match=rf"^--resume_from_checkpoint {tmp_path}: the tokenizer is the "
                                                     rf"checkpoint's \(--bpe_vocab_size 4096 -> 2048\): a resumed run "
                                                     rf"keeps {tmp_path / 'tokenizer'}, .* even with "
                                                     rf"--allow_config_change; .* start a new --output_dir"):
            check_config_change(tmp_path, parse_config(base + ["--bpe_vocab_size", "2048"] + extra))
        with pytest.raises(TrainingInputError, match=r"the tokenizer is the checkpoint's \(--tokenizer bpe -> char\)"):
            check_config_change(tmp_path, parse_config(base + ["--tokenizer", "char"] + extra))
    char = ["--config", PRESET, "--tokenizer", "char"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config_record(parse_config(char))))
    check_config_change(tmp_path, parse_config(char + ["--bpe_vocab_size", "2048"]))


def test_a_checkpoint_from_before_manifests_is_used_with_a_warning(tmp_path):
    from bilinear_lm.training import find_checkpoint, verify_checkpoint

    path = _fake_checkpoint(tmp_path, 2)
    (path / "manifest.json").unlink()
    warnings = []
    assert verify_checkpoint(path) is None
    assert find_checkpoint(str(tmp_path), "latest", warn=warnings.append) == path
    assert find_checkpoint(str(path), str(path), warn=warnings.append) == path
    assert warnings == [f"warning: {path} has no manifest.json (saved before checkpoints had one): using it "
                        f"unverified"] * 2


# ---------------------------------------------------------------------------------------------- streaming
def test_a_resumed_streaming_run_reads_the_blocks_an_uninterrupted_one_reads(tmp_path, monkeypatch):
    """--streaming: the checkpoint records the stream's position (data_state_0.json); the run resumed from it reads
    the next blocks an uninterrupted run reads."""
    import train
    from bilinear_lm.training import micro_batches

    text = "".join(f"line {i}: to be, or not to be, that is the question.\n" for i in range(300))
    (tmp_path / "train.txt").write_text(text)
    (tmp_path / "val.txt").write_text(text[:2000])
    seen = {}

    def recorded(accelerator, train_dl, state):
        for batch in micro_batches(accelerator, train_dl, state):
            seen[state.step + 1] = batch["input_ids"].tolist()
            yield batch

    monkeypatch.setattr(train, "micro_batches", recorded)

    def run(out, max_steps, *extra):
        seen.clear()
        train.main(["--config", PRESET, f"--train_file={tmp_path / 'train.txt'}", f"--validation_file={tmp_path / 'val.txt'}",
                    "--streaming=true", f"--output_dir={out}", f"--max_steps={max_steps}", "--save_interval=2",
                    "--eval_interval=0", "--sample_tokens=0", "--block_size=16", "--batch_size=2", "--num_proc=1",
                    *[f"--model.{k}={v}" for k, v in SMALL.items()], *extra])
        return dict(seen)

    uninterrupted = run(tmp_path / "a", 4)
    assert run(tmp_path / "b", 2) == {k: uninterrupted[k] for k in (1, 2)}
    assert (tmp_path / "b" / "checkpoints" / "step_2" / "data_state_0.json").is_file()
    assert run(tmp_path / "b", 4, "--resume_from_checkpoint=latest") == {k: uninterrupted[k] for k in (3, 4)}


def test_a_stream_shorter_than_a_batch_is_an_error_not_an_endless_loop(tmp_path):
    """--streaming cannot know the stream's length up front: a pass that gives no batch (here 2 blocks for a batch of
    4) must stop the run (on 2 ranks, a rank with no batch spun forever while the other waited in its all-reduce)."""
    import train

    (tmp_path / "train.txt").write_text("to be, or not to be, that is the question.\n")  # 44 characters: 2 blocks of 16
    (tmp_path / "val.txt").write_text("to be, or not to be, that is the question.\n" * 3)
    with pytest.raises(TrainingInputError, match=r"gives process 0 no batch of --batch_size 4 blocks in a whole pass "
                                                 r"over the data \(1 process reads its blocks, so it needs at least 4 "
                                                 r"blocks of --block_size tokens\)"):
        train.main(["--config", PRESET, f"--train_file={tmp_path / 'train.txt'}",
                    f"--validation_file={tmp_path / 'val.txt'}", "--streaming=true", f"--output_dir={tmp_path / 'o'}",
                    "--max_steps=2", "--eval_interval=0", "--sample_tokens=0", "--block_size=16", "--batch_size=4",
                    "--num_proc=1", *[f"--model.{k}={v}" for k, v in SMALL.items()]])

