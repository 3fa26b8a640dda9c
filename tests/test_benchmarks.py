"""benchmarks/: speed.py and equal_time.py argument handling with the timing and training replaced (no benchmark is
run) and loss_by_position.py's counting. The benchmarks are scripts, not modules of the
package: loaded by path."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    """benchmarks/NAME.py as a module (``benchmark_NAME``), as ``python benchmarks/NAME.py`` would run it."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


equal_time, gpu, loss_by_position, prompt_lookup, speed = (
    load_script(n) for n in ("equal_time", "gpu", "loss_by_position", "prompt_lookup", "speed"))


@pytest.fixture
def untimed(monkeypatch):
    """A tiny size, two calls per timed function (a warm-up and one that "takes" 1 s), no matmul peak measurement."""
    monkeypatch.setitem(speed.SIZES, "tiny", dict(hidden_size=16, num_hidden_layers=1, num_heads=2,
                                                   state_size=4, rank=4))
    monkeypatch.setattr(speed, "timed", lambda fn, *args, **kwargs: (fn(), fn(), 1.0)[2])
    monkeypatch.setattr(speed, "matmul_peak", lambda dtype: 1e9)


@pytest.mark.parametrize("precisions", ["bf16", "fp32", "fp32,bf16"])
def test_train_part_with_any_precision_subset(untimed, precisions, capsys, monkeypatch):
    """The row's cells for any subset of precisions; the page-fault cell is the mean over the timed fp32 steps of the
    faults counted around each (a counter that advances by 7 at each reading: 7 a step)."""
    counter = iter(range(0, 10**6, 7))
    monkeypatch.setattr(speed, "minor_faults", lambda: next(counter))
    speed.main(["--parts", "train", "--sizes", "tiny", "--models", "bilinear", "--seq-lens", "8",
                "--tokens-per-step", "16", "--precisions", precisions])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny | bilinear |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # | size | model | params | T | batch | fp32 tok/s | bf16 tok/s | bf16/fp32 | MFU | recurrence share | faults |
    measured = precisions.split(",")
    assert cells[3:5] == ["8", "2"]
    assert cells[5] == ("16" if "fp32" in measured else "-")  # 2 x 8 tokens in one 1 s step
    assert cells[6] == ("16" if "bf16" in measured else "-")
    assert cells[7] == ("1.00x" if len(measured) == 2 else "-")
    assert (cells[9] == "-") == ("fp32" not in measured)  # the recurrence share is an fp32 measurement
    assert (cells[10] == "-") == ("fp32" not in measured)  # so are the page faults of a step
    assert cells[10] == ("7" if "fp32" in measured else "-")


def test_alloc_part_lists_the_ops_of_a_training_step(untimed, capsys):
    """Per model and length: a total row (every op of a step, its calls, page faults and MiB allocated), then the
    ops with the most faults and bytes, forward and backward (the MLP's matmuls, the gradients)."""
    speed.main(["--parts", "alloc", "--sizes", "tiny", "--models", "bilinear,llama", "--seq-lens", "8",
                "--tokens-per-step", "16", "--alloc-ops", "1000", "--malloc", "default"])
    out = capsys.readouterr().out
    assert "malloc keeps freed memory: False" in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    totals = [r for r in rows if r[4].startswith("**all")]
    assert [r[1] for r in totals] == ["bilinear", "llama"] and all(int(r[5]) > 100 for r in totals)
    ops = [r[4] for r in rows[rows.index(totals[0]) + 1:rows.index(totals[1])]]
    assert any(op.startswith("mm ") for op in ops) and any("backward" in op for op in ops)


def test_generate_part_runs_a_hybrid_and_memory_heads(untimed, monkeypatch, capsys):
    """Decode rows for a 1:1 hybrid and a model with one memory head per layer next to bilinear and Llama, each with
    its cache's bytes: the recurrent state's constant, the hybrid's growing with the context (its attention layer's
    keys), the memory heads' a constant 32 x 32 matrix, its coordinate and a convolution window of 3 x 96 more per
    layer."""
    monkeypatch.setitem(speed.SIZES, "tiny", {**speed.SIZES["tiny"], "num_hidden_layers": 2})
    speed.main(["--parts", "generate", "--sizes", "tiny", "--models", "hybrid-2,memory-1", "--contexts",
                "8,16", "--new-tokens", "2"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    cache = {(r[2].strip(), int(r[3])): float(r[5]) for r in rows}
    assert {m for m, _ in cache} == {"bilinear", "llama", "hybrid-2", "memory-1"}
    assert cache[("bilinear", 8)] == cache[("bilinear", 16)] > 0
    assert cache[("hybrid-2", 16)] > cache[("hybrid-2", 8)]
    memory_kib = 2 * (32 * 32 + 1 + 3 * 96) * 4 / 2 ** 10  # fp32, batch 1, two layers
    for context in (8, 16):
        assert cache[("memory-1", context)] == pytest.approx(cache[("bilinear", context)] + memory_kib, abs=0.01)


def test_output_writes_the_printed_tables_to_the_named_file_only(untimed, tmp_path, capsys):
    """--output FILE: the tables as printed, written (not appended) to FILE; nothing else is written."""
    results_page = BENCHMARKS.parent / "docs" / "results.md"
    before = results_page.read_text()
    out = tmp_path / "tables" / "speed.md"
    for _ in range(2):
        speed.main(["--parts", "train", "--sizes", "tiny", "--models", "bilinear", "--seq-lens", "8",
                    "--tokens-per-step", "16", "--precisions", "fp32", "--output", str(out)])
        printed = capsys.readouterr().out
        assert out.read_text().strip() in printed and "### Training throughput" in out.read_text()
    assert out.read_text().count("### Training throughput") == 1
    assert results_page.read_text() == before


def test_gpu_output_writes_the_printed_tables(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu.torch.cuda, "get_device_name", lambda index: "a GPU")
    monkeypatch.setattr(gpu, "part_scan", lambda args: "| scan | table |")
    out = tmp_path / "gpu.md"
    assert gpu.main(["--parts", "scan", "--output", str(out)]) == 0
    assert out.read_text() == "**scan** (a GPU, torch " + torch.__version__ + ")\n\n| scan | table |\n"
    assert out.read_text().strip() in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--precisions", "fp16"), ("--parts", "trian"), ("--sizes", "1B"),
                                        ("--models", "gpt")])
def test_unknown_values_are_named(flag, value, capsys):
    with pytest.raises(SystemExit):
        speed.main([flag, value])
    err = capsys.readouterr().err
    assert f"{flag}: unknown value {value!r}" in err and "choose from" in err


def test_gpu_benchmark_says_it_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--parts", "scan"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.main(["--parts", "scan,warp"])
    assert "unknown ['warp']" in capsys.readouterr().err


def test_equal_time_shares_a_calibration_between_runs_that_differ_only_in_optimizer_settings(monkeypatch, tmp_path,
                                                                                             capsys):
    """Learning rate and seed do not change a step's time: one calibration for both learning rates (so both train
    the same number of steps), another for a different model; a fake train.py records every call."""
    calls = []

    def fake_train(preset, out_dir, max_steps, eval_interval, overrides, threads, eval_iters=0, data_dir=None,
                   checkpoints=0):
        calls.append((out_dir.name, max_steps, overrides))
        if max_steps == 30:  # a calibration: 0.5 s a step for the bilinear model, 0.25 s for llama
            step_s = 0.25 if "llama" in overrides else 0.5
            return [{"step": s, "train_seconds": s * step_s, "tokens_per_sec": 100.0} for s in (10, 20, 30)]
        return [{"step": max_steps, "val_loss": 1.0}]

    monkeypatch.setattr(equal_time, "train", fake_train)
    monkeypatch.setattr(equal_time, "parameter_count", lambda checkpoint: 1000)
    out = tmp_path / "equal_time.md"
    equal_time.main(["--preset", "tiny", "--budgets", "60", "--seeds", "0", "--calibration-steps", "30",
                     "--workdir", str(tmp_path), "--run", "a=--learning_rate 1e-3", "--run", "b=--learning_rate=2e-3",
                     "--run", "c=--model_type llama --seed 3", "--output", str(out)])
    assert out.read_text().startswith("| run | params |") and out.read_text().strip() in capsys.readouterr().out
    calibrations = [c for c in calls if c[0].startswith("calib-")]
    assert len(calibrations) == 2 and all("--learning_rate" not in c[2] for c in calibrations)
    assert all("--seed" not in c[2] and "3" not in c[2] for c in calibrations)
    steps = {name.split("-")[0]: n for name, n, _ in calls if not name.startswith("calib-")}
    assert steps == {"a": 120, "b": 120, "c": 240}
    assert equal_time.timing_overrides(["--model.rank", "8", "--beta2", "0.95", "--seed=1", "--lr_x", "1",
                                        "--model.input_factor_init_std", "0.005", "--model.input_factor_multiplier=0.3"]
                                       ) == ["--model.rank", "8", "--lr_x", "1"]
    # options deleted from train.py are not listed (a run passing one fails in train.py, not here)
    assert not {"--transition_lr_scale", "--model.rotation_init_base", "--model.factor_bias_min",
                "--model.conv_residual", "--model.gate_activation"} & set(equal_time.UNTIMED_FLAGS)


@pytest.mark.parametrize("flags, threads", [(["--jobs", "2"], 1), (["--jobs", "1", "--threads", "1"], 1),
                                            (["--jobs", "1"], None)])
def test_equal_time_threads_each_run_and_calibration_and_keys_the_calibration_by_them(monkeypatch, tmp_path, flags,
                                                                                      threads):
    """--threads sets every train.py's thread count (calibration and run); the record keys a calibration by it, so
    that ``--jobs 1 --threads 1`` reuses the one-thread calibrations of ``--jobs 2`` and the default does not."""
    calls = []

    def fake_train(preset, out_dir, max_steps, eval_interval, overrides, threads, eval_iters=0, data_dir=None,
                   checkpoints=0):
        calls.append(threads)
        if max_steps == 30:
            return [{"step": s, "train_seconds": s * 0.5, "tokens_per_sec": 100.0} for s in (10, 20, 30)]
        return [{"step": max_steps, "val_loss": 1.0}]

    monkeypatch.setattr(equal_time, "train", fake_train)
    monkeypatch.setattr(equal_time, "parameter_count", lambda checkpoint: 1000)
    record = tmp_path / "record.jsonl"
    equal_time.main(["--preset", "tiny", "--budgets", "60", "--seeds", "0", "--calibration-steps", "30",
                     "--workdir", str(tmp_path), "--record", str(record), "--run", "a=", *flags])
    assert calls == [threads, threads]
    keys = [json.loads(line)["key"] for line in record.read_text().splitlines()]
    assert keys[0] == f"tiny 30 threads={threads} --log_interval 10"


def test_equal_time_record_resumes_a_comparison_on_a_machine_without_its_workdir(monkeypatch, tmp_path, capsys):
    """--record FILE: each calibration and finished run is appended as it ends (with the CPU and date); a second
    invocation with that file and an empty workdir trains nothing and prints the same table, and a new learning
    rate trains that run alone, for the recorded calibration's steps. Calibrations run at the runs' thread count
    (one with --jobs 2). A line that is not a record is a one-line error naming the file and the line."""
    calls = []

    def fake_train(preset, out_dir, max_steps, eval_interval, overrides, threads, eval_iters=0, data_dir=None,
                   checkpoints=0):
        calls.append((out_dir.name, max_steps, threads))
        if max_steps == 30:
            return [{"step": s, "train_seconds": s * 0.5, "tokens_per_sec": 100.0} for s in (10, 20, 30)]
        lr = float(overrides[overrides.index("--learning_rate") + 1])
        return [{"step": max_steps, "val_loss": 1.0 + lr, "peak_rss_mib": 9.0}]

    monkeypatch.setattr(equal_time, "train", fake_train)
    monkeypatch.setattr(equal_time, "parameter_count", lambda checkpoint: 1000)
    record = tmp_path / "record.jsonl"
    argv = lambda work, *runs: ["--preset", "tiny", "--budgets", "60", "--seeds", "0", "--calibration-steps", "30",
                                "--jobs", "2", "--workdir", str(tmp_path / work), "--record", str(record),
                                *[x for r in runs for x in ("--run", r)]]
    equal_time.main(argv("w1", "a=--learning_rate 1e-3", "b=--learning_rate 2e-3"))
    first = capsys.readouterr().out
    assert [c[1:] for c in calls] == [(30, 1), (120, 1), (120, 1)]  # one calibration, at one thread
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    assert [e.get("calibration", False) for e in entries] == [True, False, False]
    assert {e["label"]: e["evals"] for e in entries[1:]} == {"a": [{"step": 120, "val_loss": 1.001,
                                                                     "peak_rss_mib": 9.0}],
                                                              "b": [{"step": 120, "val_loss": 1.002,
                                                                     "peak_rss_mib": 9.0}]}
    assert all(e["cpu"] and e["date"] and e["threads"] == 1 for e in entries)
    calls.clear()
    equal_time.main(argv("w2", "a=--learning_rate 1e-3", "b=--learning_rate 2e-3"))
    assert calls == [] and capsys.readouterr().out == first
    equal_time.main(argv("w3", "a=--learning_rate 1e-3", "c=--learning_rate 5e-3"))
    assert calls == [("c-60-seed0", 120, 1)] and "| c | 0.00M | 100 | 500.0 | **1.005** |" in capsys.readouterr().out
    record.write_text(record.read_text() + "{not json\n")
    with pytest.raises(SystemExit, match=f"--record {record}: line 5 is not a record of this benchmark"):
        equal_time.main(argv("w4", "a=--learning_rate 1e-3"))


def stand_in_calls(tmp_path, *command) -> list[list[str]]:
    """The arguments of every call a committed shell command makes to $PYTHON, run with a stand-in that keeps them."""
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" >> {tmp_path / 'argv'}\nprintf '\\n' >> {tmp_path / 'argv'}\n")
    stand_in.chmod(0o755)
    subprocess.run(["bash", *command], check=True, env={**os.environ, "PYTHON": str(stand_in)})
    return [line.strip("\0").split("\0") for line in (tmp_path / "argv").read_text().splitlines() if line]


def gutenberg_runs(argv: list[str]) -> list[tuple[str, list[str]]]:
    assert argv[0] == "benchmarks/equal_time.py" and argv[argv.index("--record") + 1] == "docs/peers/gutenberg.jsonl"
    return [equal_time.parse_run(argv[i + 1]) for i, a in enumerate(argv) if a == "--run"]


def test_the_gutenberg_sweep_runs_nine_models_at_four_learning_rates_and_doubles_past_a_best_at_the_top(tmp_path):
    """The committed command of issue 47's Gutenberg sweep (a stand-in $PYTHON keeps its arguments): one call, into
    the record in docs/peers/, of nine models (seven, and Gated DeltaNet and its hybrid also with transformers'
    initialization) at four learning rates, and the larger ones tried where a best was at the top (Gated DeltaNet
    and its hybrid 8e-3, with transformers' init the former only, Mamba2 8e-3 to 3.2e-2); each run at the learning
    rate its label names."""
    (argv,) = stand_in_calls(tmp_path, str(BENCHMARKS / "gutenberg_peers.sh"), "sweep")
    runs = gutenberg_runs(argv)
    assert len(runs) == len({label for label, _ in runs}) == 9 * 4 + 6
    assert {label for label, _ in runs if label.split("@")[1] not in ("5e-4", "1e-3", "2e-3", "4e-3")} == {
        "gated_deltanet@8e-3", "gated_deltanet_hybrid@8e-3", "mamba2@8e-3", "mamba2@1.6e-2", "mamba2@3.2e-2",
        "gated_deltanet_qwen3_5_init@8e-3"}
    assert all(o[o.index("--learning_rate") + 1] == label.split("@")[1] for label, o in runs)


def test_the_gutenberg_30_minutes_run_each_model_at_its_best_recorded_learning_rate(tmp_path):
    """The 30-minute stage's calls: equal time (1800 s) and equal tokens, seed 1337 before 1338, then both seeds.
    Each model trains at the learning rate whose sweep run in the committed record scored lowest, with the sweep's own
    flags, and that best is inside the model's grid (below its largest); equal tokens is the pure model's recorded
    30-minute step count."""
    calls = stand_in_calls(tmp_path, str(BENCHMARKS / "gutenberg_peers.sh"), "30min")
    assert [(argv[argv.index("--seeds") + 1], "--steps" in argv) for argv in calls] == [
        ("1337", False), ("1337", True), ("1338", False), ("1338", True), ("1337,1338", False), ("1337,1338", True)]
    record = equal_time.Record(BENCHMARKS.parent / "docs" / "peers" / "gutenberg.jsonl")
    sweep = [e for e in record.entries.values() if e.get("budget") == 600]
    assert len(sweep) == 9 * 4 + 6
    best = {}
    for e in sweep:
        model, lr = e["label"].split("@")
        best.setdefault(model, []).append((e["evals"][-1]["val_loss"], lr))
    (tmp_path / "sweep").mkdir()
    (sweep_argv,) = stand_in_calls(tmp_path / "sweep", str(BENCHMARKS / "gutenberg_peers.sh"), "sweep")
    sweep_flags = {label: o for label, o in gutenberg_runs(sweep_argv)}
    for argv in calls:
        runs = gutenberg_runs(argv)
        assert sorted(label for label, _ in runs) == sorted(best)
        for label, overrides in runs:
            assert overrides == sweep_flags[f"{label}@{min(best[label])[1]}"], label
    assert all(float(min(tried)[1]) < max(float(lr) for _, lr in tried) for tried in best.values())
    pure_calibration = record.get("gutenberg 40 threads=1 --log_interval 10")["step_s"]
    equal_tokens = {argv[argv.index("--steps") + 1] for argv in calls if "--steps" in argv}
    assert equal_tokens == {str(int(1800 / pure_calibration))}
    assert all(argv[argv.index("--budgets") + 1] == "1800" for argv in calls if "--steps" not in argv)


def test_the_gutenberg_command_names_its_stage(tmp_path):
    """Without a stage, or with an unknown one, a one-line error naming the stages; nothing runs."""
    for stage in ([], ["sweeps"]):
        out = subprocess.run(["bash", str(BENCHMARKS / "gutenberg_peers.sh"), *stage], capture_output=True, text=True,
                             env={**os.environ, "PYTHON": "/bin/false"})
        assert out.returncode != 0 and "sweep" in out.stderr and "30min" in out.stderr


def test_the_formal_language_grid_records_into_the_checkout_with_the_field_protocol(tmp_path):
    """The committed command of issue 47's formal-language grid: four calls (seed 0, A5 and S5 to length 5,120, seeds
    1 and 2, then A5 and S5 again at 10,000 steps) into docs/peers/, whose arguments the probes' own parser takes: the
    field's lengths, 1,000 steps, and the groups' longer run in a folder of its own."""
    calls = stand_in_calls(tmp_path, str(BENCHMARKS / "field_peers.sh"))
    assert len(calls) == 4 and all(argv[argv.index("--output-dir") + 1].startswith("docs/peers/") for argv in calls)
    from bilinear_lm.probes.cli import build_parser

    parsed = [build_parser().parse_args(argv[1:]) for argv in calls]
    assert all(argv[0] == "eval/state_tracking.py" for argv in calls)
    assert all((args.sweep, args.train_lengths) == (True, (3, 40)) for args in parsed)
    assert [args.steps for args in parsed] == [1000, 1000, 1000, 10000]
    for groups in (parsed[1], parsed[3]):
        assert groups.tasks == "permutation_A5,permutation_S5" and max(groups.test_lengths) == 5120
    assert parsed[1].output_dir != parsed[3].output_dir and parsed[3].eval_every == 500


def test_the_recall_peers_run_in_the_recall_tables_protocol_then_at_zoologys_other_lrs(tmp_path):
    """The committed command of issue 47's MQAR cells: two calls into docs/peers/, whose arguments the recall CLI's
    own parser takes: the peers at 64x4 and 128x8 with the protocol of results.md's recall table (docs/recall-runs.json:
    its lr, at most 8 epochs, width 64, 2 layers, Zoology's data sizes), then the same at Zoology's other three lrs;
    each skipping the cells recorded apart in the other docs/peers/recall-*/ folders."""
    import json

    from bilinear_lm.probes.recall import ZOOLOGY_LRS, RecallConfig, zoology_batch_size
    from bilinear_lm.probes.recall_cli import build_parser

    calls = stand_in_calls(tmp_path, str(BENCHMARKS / "recall_peers.sh"))
    assert [argv[0] for argv in calls] == ["eval/recall.py"] * 2
    first, rest = (build_parser().parse_args(argv[1:]) for argv in calls)
    table_runs = json.loads((BENCHMARKS.parent / "docs" / "recall-runs.json").read_text())
    beside = [r["config"] for r in table_runs if r["model"] in ("llama", "bilinear-memory")
              and r["config"]["hidden_size"] == 64 and r["point"] in ("64x4", "128x8")]
    assert len(beside) == 4
    for args in (first, rest):
        assert args.output_dir == first.output_dir and args.output_dir.startswith("docs/peers/")
        assert args.points == "64x4,128x8" and set(args.models.split(",")) == {
            "gated_deltanet-zoology", "gated_deltanet", "gated_deltanet-neg", "gated_deltanet-square",
            "gated_deltanet-square-neg", "mamba2"}
        ours = {f: getattr(args, f) for f in RecallConfig.__dataclass_fields__ if f != "batch_size" and hasattr(args, f)}
        for c in beside:
            assert {f: c[f] for f in ours} == ours
            assert args.batch_size is None and zoology_batch_size(c["seq_len"]) == c["batch_size"]
    apart = sorted(str(p.relative_to(BENCHMARKS.parent)) for p in (BENCHMARKS.parent / "docs" / "peers").glob(
        "recall-*/results.json") if p.parent.name != "recall-epochs8")
    assert apart and all(sorted(args.skip_runs_in.split(",")) == apart for args in (first, rest))
    assert [float(lr) for lr in first.lrs.split(",")] == sorted({c["lr"] for c in beside})
    assert sorted(float(lr) for lr in (first.lrs + "," + rest.lrs).split(",")) == sorted(ZOOLOGY_LRS)


def test_the_recall_peers_run_all_their_cells_in_a_checkout_with_no_cells_run_apart(tmp_path):
    """In a checkout whose docs/peers/ holds only the script's own folder, both calls are made and skip nothing."""
    import shutil

    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    (checkout / "docs" / "peers" / "recall-epochs8").mkdir(parents=True)
    (checkout / "docs" / "peers" / "recall-epochs8" / "results.json").write_text("[]")
    shutil.copy(BENCHMARKS / "recall_peers.sh", checkout / "benchmarks")
    calls = stand_in_calls(tmp_path, str(checkout / "benchmarks" / "recall_peers.sh"))
    assert [argv[0] for argv in calls] == ["eval/recall.py"] * 2
    assert not any("--skip-runs-in" in argv for argv in calls)


def test_loss_by_position_counts_from_the_last_eos():
    """Positions by hand (EOS = 0); a model of uniform logits scores ln V at every target, so each bin's loss is
    ln V and its count is the number of targets whose position falls in it."""
    ids = torch.tensor([[5, 0, 3, 4, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 0]])
    expected = torch.tensor([[-1, 0, 1, 2, 0, 1, 2, 3], [-1, -1, -1, -1, -1, -1, -1, 0]])
    assert torch.equal(loss_by_position.document_positions(ids, 0), expected)

    class Uniform(torch.nn.Module):
        def forward(self, input_ids):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 10)})()

    losses, counts = loss_by_position.loss_by_position(Uniform(), ids, 0, [1, 2, 4], batch_size=1)
    assert counts.tolist() == [2, 3]  # position 1: two targets; positions 2-3: three (the EOS targets, 0, are out)
    torch.testing.assert_close(losses, torch.full((2,), math.log(10), dtype=torch.float64))


def test_equal_time_runs_continue_when_cut_and_calibrations_never_save(monkeypatch, tmp_path):
    """A run saves ten times (the newest kept) and continues a cut run from its last save, else starts again
    (train.py's resume, tested against an uncut run in test_train.py); its saves are deleted once it ends. A
    calibration saves nothing (a save inside it would be timed)."""
    commands = []

    def fake_subprocess_run(cmd, **kwargs):
        commands.append(cmd)
        out = Path(cmd[cmd.index("--output_dir") + 1])
        (out / "checkpoints" / "step_3").mkdir(parents=True)
        (out / "metrics.jsonl").write_text('{"step": 1, "train_seconds": 1.0, "tokens_per_sec": 1.0}\n'
                                           '{"step": 2, "train_seconds": 2.0, "tokens_per_sec": 1.0, "val_loss": 1.0}\n')
        (out / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")

    monkeypatch.setattr(equal_time.subprocess, "run", fake_subprocess_run)
    equal_time.main(["--preset", "tiny", "--budgets", "20", "--seeds", "0", "--calibration-steps", "2", "--evals", "1",
                     "--workdir", str(tmp_path), "--run", "a="])
    calibration, run = commands
    flag = lambda cmd, name: cmd[cmd.index(name) + 1] if name in cmd else None
    assert flag(calibration, "--save_interval") == "0" and "--resume_from_checkpoint" not in calibration
    assert flag(run, "--max_steps") == "20" and flag(run, "--save_interval") == "2"
    assert flag(run, "--save_total_limit") == "1" and flag(run, "--resume_from_checkpoint") == "latest"
    assert "--overwrite_output_dir" in run
    assert not (tmp_path / "a-20-seed0" / "checkpoints").exists() and (tmp_path / "a-20-seed0" / "metrics.jsonl").exists()


def test_equal_time_trains_the_hub_presets_on_the_local_data(monkeypatch, tmp_path, capsys):
    """The tinystories and gutenberg presets name Hub datasets; equal_time.py passes the local data their results
    were measured on, from --data-dir or $BILINEAR_LM_DATA_DIR (a run's own flags come later, so they win); other
    presets keep their own data and need no data folder. Without one, or without its files, a one-line usage error
    before any run."""
    commands = []
    monkeypatch.setattr(equal_time.subprocess, "run", lambda cmd, **kwargs: commands.append(cmd))
    (tmp_path / "metrics.jsonl").write_text("")
    data = tmp_path / "data"
    for name in ("tinystories/tinystories_sample.txt", "gutenberg/train.jsonl", "gutenberg/validation.jsonl"):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text("")
    for preset in ("tinystories", "gutenberg", "shakespeare-char"):
        equal_time.train(equal_time.PRESETS / f"{preset}.yaml", tmp_path, 5, 1, ["--seed", "1"], None, data_dir=data)
    equal_time.train(equal_time.PRESETS / "shakespeare-char.yaml", tmp_path, 5, 1, ["--seed", "1"], None)
    flag = lambda cmd, name: cmd[cmd.index(name) + 1]
    assert flag(commands[0], "--train_file") == str(data / "tinystories" / "tinystories_sample.txt")
    assert commands[0].index("--train_file") < commands[0].index("--seed")
    assert flag(commands[1], "--train_file") == str(data / "gutenberg" / "train.jsonl")
    assert flag(commands[1], "--validation_file") == str(data / "gutenberg" / "validation.jsonl")
    assert flag(commands[1], "--streaming") == "false"
    assert "--train_file" not in commands[2] and commands[3] == commands[2]

    monkeypatch.delenv(equal_time.DATA_ENV, raising=False)
    with pytest.raises(ValueError, match="--preset tinystories .*--data-dir DIR or set BILINEAR_LM_DATA_DIR=DIR"):
        equal_time.train(equal_time.PRESETS / "tinystories.yaml", tmp_path, 5, 1, [], None)
    (data / "gutenberg" / "validation.jsonl").unlink()
    for argv, message in ((["--preset", "gutenberg"],
                           "--preset gutenberg runs on local data (its preset names a Hub dataset): pass --data-dir "
                           "DIR or set BILINEAR_LM_DATA_DIR=DIR, DIR holding gutenberg/train.jsonl and "
                           "gutenberg/validation.jsonl"),
                          (["--preset", "gutenberg", "--data-dir", str(data)],
                           f"--preset gutenberg: no gutenberg/validation.jsonl in the data folder {data}")):
        with pytest.raises(SystemExit):
            equal_time.main(argv)
        assert f"error: {message}\n" in capsys.readouterr().err
    monkeypatch.setenv(equal_time.DATA_ENV, str(data))  # the env var as the default
    with pytest.raises(SystemExit):
        equal_time.main(["--preset", "gutenberg"])
    assert "no gutenberg/validation.jsonl" in capsys.readouterr().err
    assert len(commands) == 4  # no run started


def test_data_scale_measures_each_step_and_prints_a_row_per_num_proc(monkeypatch, tmp_path, capsys):
    """data_scale.py's steps in this process (the script runs each in a fresh one), then its table."""
    from types import SimpleNamespace

    data_scale = load_script("data_scale")
    text = tmp_path / "t.txt"
    text.write_text("to be, or not to be, that is the question\n" * 200)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    args = dict(file=str(text), val_fraction=0.1, bpe_vocab_size=300, tokenizer_dir=str(tmp_path / "tok"),
                block_size=16, add_eos=False, num_proc=1)
    bpe = data_scale.child(SimpleNamespace(**args, step="bpe"))
    tokenized = data_scale.child(SimpleNamespace(**args, step="tokenize"))
    assert bpe["bpe_s"] > 0 and tokenized["tokens"] > 0 and tokenized["tokens"] % 16 == 0
    assert tokenized["blocks_bytes"] >= tokenized["tokens"] * 4  # int32 ids
    monkeypatch.setattr(data_scale, "run_child", lambda args, step, root, num_proc=1: bpe if step == "bpe" else tokenized)
    data_scale.main(["--file", str(text), "--num-proc", "1,2", "--output", str(tmp_path / "table.md")])
    out = capsys.readouterr().out
    assert "BPE training (once, on the training split)" in out and "\n| 1 | " in out and "\n| 2 | " in out
    assert (tmp_path / "table.md").read_text().strip() == out.strip()


def test_loss_by_book_position_streams_a_recurrent_model_and_windows_attention(tiny_bilinear_config):
    """Each book one stream: the bins' losses times their counts add up to the protocol's total NLL (bilinear:
    streaming; Llama, whose KV cache grows: strided windows of the training length), counts by position in closed
    form."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bilinear_lm import BilinearForCausalLM
    from bilinear_lm.evaluation import perplexity as ppl

    torch.manual_seed(0)
    books = [torch.randint(0, 67, (n,)) for n in (30, 12)]
    edges = [1, 4, 16, 64]
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=67, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    for model, protocol, total in (
            (BilinearForCausalLM(tiny_bilinear_config), "streaming",
             lambda m, ids: ppl.streaming_perplexity(m, ids, segment_len=8)[0]),
            (llama, "strided 8/4", lambda m, ids: ppl.strided_perplexity(m, ids, max_length=8, stride=4)[0])):
        losses, counts, used = loss_by_position.loss_by_book_position(model.eval(), books, edges, window=8)
        assert used == protocol
        assert counts.tolist() == [3 + 3, 12 + 8, 29 - 15]  # targets 1..29 and 1..11 by position
        torch.testing.assert_close((losses * counts).sum().item(), sum(total(model, ids) for ids in books))


def test_book_bins_end_at_the_last_position_scored():
    assert loss_by_position.clip_edges([1, 512, 2048, 8192, 32768, 131072], 32768) == [1, 512, 2048, 8192, 32769]
    assert loss_by_position.clip_edges([1, 512, 2048], 4096) == [1, 512, 2048, 4097]


def test_compiled_part_adds_llama_and_another_checkouts_decoding(untimed, monkeypatch, tmp_path, capsys):
    """``--models llama`` adds Llama's rows (eager against its static cache's step); ``--baseline-tree DIR`` adds DIR's
    own decoding at every context, measured by DIR's benchmarks/speed.py in a subprocess; each gets its ratio line.
    Compilation is replaced by the eager call (this test checks the table, not Inductor)."""
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "get_compiled_call", lambda self, config: self.__call__)
    tree = tmp_path / "old"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "benchmarks" / "speed.py").write_text(  # an older speed.py's two functions: 1 ms per 100 of context
        "def build(name, size):\n    return type('Model', (), {'eval': lambda self: self})()\n\n\n"
        "def decode_latency(model, context, new_tokens, prefill_chunk):\n    return context / 1e5, 0\n")
    speed.main(["--parts", "compiled", "--sizes", "tiny", "--models", "llama", "--contexts", "800,1600",
                "--new-tokens", "2", "--compile-cache", "--baseline-tree", str(tree)])
    out = capsys.readouterr().out
    rows = {(r[2].strip(), int(r[3])): [c.strip() for c in r[4:-1]] for r in
            (line.split("|") for line in out.splitlines() if line.startswith("| tiny |"))}
    assert set(rows) == {(m, c) for m in ("bilinear, old (eager)", "bilinear", "llama") for c in (800, 1600)}
    assert rows[("bilinear, old (eager)", 800)][1] == "8.00" and rows[("bilinear, old (eager)", 1600)][1] == "16.00"
    assert float(rows[("llama", 800)][-1]) < 1e-4  # eager and "compiled" logits: the same call
    assert "Llama's compiled ms/token over the compiled bilinear model's: tiny at 800: " in out
    assert "old's eager ms/token over the compiled bilinear model's: tiny at 800: " in out
    with pytest.raises(SystemExit):
        speed.main(["--parts", "compiled", "--baseline-tree", str(tmp_path)])
    assert "has no benchmarks/speed.py; pass a checkout of this repository" in capsys.readouterr().err


def test_prompt_lookup_counts_drafts_and_checks_the_tokens(tmp_path, monkeypatch, capsys):
    """benchmarks/prompt_lookup.py on a tiny checkpoint (compiled decoding left out: tested elsewhere, slow to build):
    one row per text kind, prompt lookup's tokens equal greedy's, and on the repetitive text drafts were made and
    counted (the passage's opening repeated: lookup finds it)."""
    import json

    from fixtures import save_tiny_checkpoint

    from bilinear_lm.training import DEFAULT_TRAIN_FILE

    save_tiny_checkpoint(tmp_path / "model", "bilinear")
    text = Path(DEFAULT_TRAIN_FILE).read_text()[:20_000]
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": text}) + "\n")
    monkeypatch.setattr(prompt_lookup, "MODES", ("plain eager", "prompt lookup"))
    prompt_lookup.main(["--models", str(tmp_path / "model"), "--data", str(tmp_path / "docs.jsonl"), "--texts", "1",
                        "--passage", "24", "--repeat", "12", "--new-tokens", "8", "--rounds", "1",
                        "--lookup-tokens", "3"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {tmp_path}")]
    assert [row[1] for row in rows] == ["repetitive", "fresh"]
    assert all(row[-1] == "1/1 |" and row[5] == "-" for row in rows)
    accepted, drafted = rows[0][6].split("% of ")
    assert int(drafted) > 0 and 0 <= int(accepted) <= 100
