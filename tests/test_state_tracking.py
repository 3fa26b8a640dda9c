"""The state-tracking probes: the library (bilinear_lm.probes: models, training, length generalization) and
the CLI around it (bilinear_lm.probes.cli: single runs, sweeps; report: tables, plots), at tiny budgets."""
import dataclasses
import json
import math
import time

import pytest
import torch

from bilinear_lm.baselines import LSTMConfig, LSTMLanguageModel
from bilinear_lm.modeling.configuration_bilinear import MIXER_TYPES
from bilinear_lm.probes import (MODEL_NAMES, ProbeConfig, build_probe_model, class_logits, evaluate, make_task,
                                run_probe, state_consistency_loss)
from bilinear_lm.probes import cli as st
from bilinear_lm.probes import report

TINY = ["--threads", "1", "--val-size", "50", "--test-size", "40", "--hidden-size", "8", "--state-size", "8",
        "--eval-every", "5"]
TINY_CONFIG = ProbeConfig(val_size=50, test_size=40, hidden_size=8, state_size=8, eval_every=5)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is faster and robust to a loaded machine (2 threads oversubscribe it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_parity_bilinear_diagonal_generalizes_to_longer_sequences():
    """Minimal diagonal bilinear model, trained on lengths 2-10, is perfect at length 300 (val-based stopping)."""
    config = ProbeConfig(hidden_size=32, state_size=16, steps=600, eval_every=50, patience=100, val_size=200,
                         test_size=200, test_lengths=(100, 300))
    r = run_probe(make_task("parity"), "bilinear-diagonal", 0, config, log=lambda *_: None)
    assert r["stop_reason"] == "val_perfect" and r["steps"] < 600
    assert r["best_val_acc"] == 1.0
    for L in ("100", "300"):
        assert r["test"][L]["final_acc"] == 1.0
        assert r["test"][L]["beyond_train_acc"] == 1.0
        assert r["test"][L]["final_acc_norm"] == 1.0


def test_chunked_evaluation_matches_one_batch():
    torch.manual_seed(0)
    task = make_task("cycle_navigation", 4)
    model = LSTMLanguageModel(LSTMConfig(vocab_size=max(task.vocab_size, task.num_classes), hidden_size=8))
    x, y = task.sample(13, 17, torch.Generator().manual_seed(0))
    acc1, loss1 = evaluate(model, x, y, task.num_classes, eval_tokens=10 ** 6)
    acc2, loss2 = evaluate(model, x, y, task.num_classes, eval_tokens=17 * 3)  # chunks of 3 sequences
    assert torch.allclose(acc1, acc2) and abs(loss1 - loss2) < 1e-6
    logits = model(input_ids=x).logits[..., :task.num_classes]
    assert torch.allclose(acc1, (logits.argmax(-1) == y).double().mean(0))


def test_evaluate_names_bad_input():
    task = make_task("cycle_navigation", 4)
    model = LSTMLanguageModel(LSTMConfig(vocab_size=4, hidden_size=8))
    x, y = task.sample(3, 5, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"must both be non-empty \[batch, length\], got shapes \(3, 5\) and \(3, 4\)"):
        evaluate(model, x, y[:, :4], task.num_classes)
    with pytest.raises(ValueError, match=r"labels must be class ids in \[0, 2\) \(or -100: unlabelled\), got range "
                                         r"\[0, 3\]"):
        evaluate(model, x, torch.full_like(y, 3).index_fill_(1, torch.tensor([0]), 0), 2)
    with pytest.raises(ValueError, match="every label is -100 \\(unlabelled\\): nothing to score"):
        evaluate(model, x, torch.full_like(y, -100), task.num_classes)


@pytest.mark.parametrize("mixer", MIXER_TYPES)
def test_every_bilinear_mixer_builds_as_the_minimal_model(mixer):
    task = make_task("modular_arithmetic", 3)
    model, cfg = build_probe_model(f"bilinear-{mixer}", task, TINY_CONFIG)
    assert type(model).__name__ == "BilinearForCausalLM"
    assert model.config.num_hidden_layers == 1 and model.config.use_mlp is False
    assert model.config.mixer_type == mixer and cfg["vocab_size"] == task.vocab_size
    if mixer == "full":
        assert model.config.rank == task.vocab_size
    x, _ = task.sample(2, 7)
    assert class_logits(model, x, task.num_classes).shape == (2, 7, task.num_classes)
    assert model.config.use_gate is False  # the paper's linear readout
    gated = build_probe_model(f"bilinear-{mixer}", task, dataclasses.replace(TINY_CONFIG, gate=True))[0]
    assert gated.config.use_gate is True


def test_the_probe_mixers_are_the_model_config_mixers():
    """One list of mixers: the probe zoo takes the model config's, so a new mixer type is a new probe model."""
    from bilinear_lm.probes import models

    assert models.MIXER_TYPES is MIXER_TYPES
    assert [n for n in MODEL_NAMES if n.startswith("bilinear-")] == [f"bilinear-{m}" for m in MIXER_TYPES]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_name_builds_from_a_fresh_config(name):
    """Each name of the zoo from a ProbeConfig made here (no earlier call prepares it): the model family, depth and
    width it names, sized for the task, and class scores from a forward."""
    task = make_task("cycle_navigation", 5)  # 3 symbols, 5 classes: the vocabulary is max(3, 5)
    config = ProbeConfig(hidden_size=8, state_size=8, test_lengths=(3000,))
    model, cfg = build_probe_model(name, task, config)
    kind, _, n = name.partition("-")
    expected = {"bilinear": "BilinearForCausalLM", "hybrid": "BilinearForCausalLM", "stack": "BilinearForCausalLM",
                "lstm": "LSTMLanguageModel", "transformer": "LlamaForCausalLM", "mamba": "MambaForCausalLM",
                "gated_deltanet": "GatedDeltaNetForCausalLM", "gated_deltanet_neg": "GatedDeltaNetForCausalLM",
                "mamba2": "Mamba2ForCausalLM"}[kind]
    assert type(model).__name__ == expected and cfg["vocab_size"] == 5 == model.get_input_embeddings().num_embeddings
    assert model.config.hidden_size == 8
    if kind == "lstm":
        assert model.lstm.num_layers == (2 if n == "2" else 1)
    elif kind != "bilinear":
        assert model.config.num_hidden_layers == int(n)
    if kind in ("hybrid", "stack"):  # 3 bilinear : 1 attention, or 4 bilinear
        assert model.config.layer_types == ["bilinear"] * 3 + ["full_attention" if kind == "hybrid" else "bilinear"]
    if kind == "transformer":
        assert model.config.max_position_embeddings == 3001  # the longest test sequence fits
    if kind.startswith("gated_deltanet"):
        assert model.config.allow_neg_eigval == kind.endswith("_neg")
    x, _ = task.sample(2, 7)
    assert class_logits(model, x, task.num_classes).shape == (2, 7, 5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(train_lengths=(10, 2)), r"train_lengths must be a pair \(lo, hi\) of integers with 1 <= lo <= hi"),
    (dict(train_lengths=(0, 5)), "train_lengths"),
    (dict(test_lengths=()), "test_lengths must be a non-empty sequence"),
    (dict(test_lengths=(500, 0)), "test_lengths"),
    (dict(steps=0), "steps must be an integer >= 1"),
    (dict(hidden_size=8.0), "hidden_size must be an integer >= 1"),
    (dict(rank=0), "rank must be None"),
    (dict(lr=-1e-3), "lr must be None or a finite number > 0"),
    (dict(max_seconds=float("nan")), "max_seconds"),
    (dict(lr_schedule="linear"), "lr_schedule must be 'constant' or 'cosine'"),
    (dict(grad_clip=-1), "grad_clip"),
    (dict(state_consistency=float("inf")), "state_consistency must be a finite weight >= 0"),
])
def test_bad_probe_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match="ProbeConfig." + match):
        ProbeConfig(**kwargs)


def test_run_probe_refuses_bad_input_before_training():
    task = make_task("parity")
    with pytest.raises(ValueError, match="unknown model 'gru'; choose one of"):
        run_probe(task, "gru", 0, TINY_CONFIG)
    with pytest.raises(ValueError, match="hidden_size 8 must be divisible by num_heads 3"):
        run_probe(task, "transformer-1", 0, dataclasses.replace(TINY_CONFIG, num_heads=3))
    with pytest.raises(ValueError, match="config must be a ProbeConfig"):
        run_probe(task, "lstm", 0, {"steps": 1})
    with pytest.raises(ValueError, match="task must be a bilinear_lm.probes.Task"):
        run_probe("parity", "lstm", 0, TINY_CONFIG)
    with pytest.raises(ValueError, match="lstm has none"):
        run_probe(task, "lstm", 0, dataclasses.replace(TINY_CONFIG, state_consistency=1.0))


def test_a_hybrid_with_an_attention_window_has_sliding_attention_layers():
    task = make_task("parity")
    model, cfg = build_probe_model("hybrid-4", task, dataclasses.replace(TINY_CONFIG, attention_window=3))
    assert model.config.layer_types == ["bilinear"] * 3 + ["sliding_attention"] and model.config.sliding_window == 3
    assert model.model.rotary_emb is not None
    model, cfg = build_probe_model("hybrid-4", task, dataclasses.replace(TINY_CONFIG, attention_rope=False))
    assert model.config.layer_types[3] == "full_attention" and model.model.rotary_emb is None and not cfg["use_rope"]
    with pytest.raises(ValueError, match="ProbeConfig.attention_window must be None"):
        dataclasses.replace(TINY_CONFIG, attention_window=0)


def test_state_consistency_on_a_hybrid_reads_its_bilinear_layers_only():
    """hybrid-4 (3 bilinear layers, then attention): the center loss is the loss of its 3 bilinear layers' states."""
    task = make_task("parity")
    config = dataclasses.replace(TINY_CONFIG, state_consistency=1.0, steps=2, eval_every=2)
    record = run_probe(task, "hybrid-4", 0, config, log=lambda *_: None)
    assert math.isfinite(record["history"][-1]["consistency_loss"])
    model, _ = build_probe_model("hybrid-4", task, config)
    x, y = task.sample(4, 6, torch.Generator().manual_seed(0))
    states = model(input_ids=x, use_cache=False, output_mixer_states=True).mixer_states
    assert len(states) == 3 and all(h.shape[:2] == y.shape for h in states)


def test_cli_maps_its_flags_onto_the_probe_config():
    args = st.build_parser().parse_args([*TINY, "--train-lengths", "3-7", "--test-lengths", "40,80", "--gate",
                                         "--rank", "5", "--state-consistency", "2", "--max-seconds", "9"])
    assert st.config_from_args(ProbeConfig, args) == dataclasses.replace(
        TINY_CONFIG, train_lengths=(3, 7), test_lengths=(40, 80), gate=True, rank=5, state_consistency=2.0,
        max_seconds=9.0)
    assert st.config_from_args(ProbeConfig, st.build_parser().parse_args([])) == ProbeConfig()  # same defaults


def test_every_probe_config_field_is_a_flag_with_its_default_and_help():
    """The flags are made from ProbeConfig's fields: each field's flag, default and help text come from the field."""
    actions = {a.dest: a for a in st.build_parser()._actions}
    for f in dataclasses.fields(ProbeConfig):
        action = actions[f.name]
        flag = f.name.replace("_", "-")
        assert action.option_strings == ([f"--{flag}", f"--no-{flag}"] if f.default is True else [f"--{flag}"])
        assert action.default == f.default and action.help.startswith(f.metadata["help"])


def test_config_flags_follow_the_field_types():
    """A config class of every supported field type: flags parse into the field's type, defaults round-trip."""
    import argparse

    from bilinear_lm.probes.config import option

    @dataclasses.dataclass(frozen=True)
    class Settings:
        count: int = option(3, "an int")
        scale: float | None = option(None, "an optional float")
        mode: str = option("a", "a choice", choices=("a", "b"))
        span: tuple[int, int] = option((2, 10), "a range")
        lengths: tuple[int, ...] = option((5,), "a list")
        on: bool = option(False, "a switch")
        off: bool = option(True, "a switch that defaults on")

    parser = argparse.ArgumentParser()
    st.add_config_flags(parser, Settings)
    assert st.config_from_args(Settings, parser.parse_args([])) == Settings()
    args = parser.parse_args(["--count", "4", "--scale", "0.5", "--mode", "b", "--span", "3-7", "--lengths", "8,9",
                              "--on", "--no-off"])
    assert st.config_from_args(Settings, args) == Settings(4, 0.5, "b", (3, 7), (8, 9), True, False)
    assert "(default: 2-10)" in parser.format_help() and "(default: 5)" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--span", "two"])


def test_cli_single_run_writes_results_json(tmp_path):
    out = tmp_path / "r.json"
    start = time.time()
    st.main(["--task", "modular_addition", "--m", "3", "--model", "lstm", "--steps", "20",
             "--test-lengths", "30,50", "--output", str(out), *TINY])
    elapsed = time.time() - start
    (r,) = json.loads(out.read_text())["runs"]
    assert (r["task"], r["m"], r["model"], r["steps"], r["stop_reason"]) == ("modular_addition", 3, "lstm", 20, "steps")
    assert 0 < r["seconds"] + r["eval_seconds"] <= elapsed + 0.02 and r["train_lengths"] == [2, 10]
    V, H = 3, 8  # embedding V x H, LSTM 4H x (H + H) weights + 2 x 4H biases, head H x V + V
    assert r["num_params"] == V * H + 4 * H * 2 * H + 2 * 4 * H + H * V + V
    assert r["chance"] == pytest.approx(1 / 3)
    assert r["best_val_acc"] == pytest.approx(max(h["val_acc"] for h in r["history"]), abs=1e-5)   # selected on validation, not training
    for L in (30, 50):
        te = r["test"][str(L)]
        assert te["final_acc_norm"] == pytest.approx((te["final_acc"] - 1 / 3) / (2 / 3))
    assert "per_position_acc" not in r["test"]["30"]  # the curve only at the longest length, which the plot draws
    te = r["test"]["50"]
    assert len(te["per_position_acc"]) == 50
    assert te["final_acc"] == pytest.approx(te["per_position_acc"][-1], abs=1e-4)
    assert te["beyond_train_acc"] == pytest.approx(sum(te["per_position_acc"][10:]) / (50 - 10), abs=1e-3)


def test_sweep_writes_table_plot_and_resumes(tmp_path, capsys):
    argv = ["--sweep", "--tasks", "parity,cycle_navigation", "--ms", "3",
            "--models", "lstm,transformer-1,mamba-1,bilinear-cp", "--seeds", "0", "--steps", "4",
            "--test-lengths", "24", "--val-length", "12", "--output-dir", str(tmp_path), *TINY]
    st.main(argv)
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(runs) == 8
    assert {r["model"] for r in runs} == {"lstm", "transformer-1", "mamba-1", "bilinear-cp"}
    assert {r["model_config"]["model_type"] for r in runs} == {"lstm", "llama", "mamba", "bilinear"}
    table = (tmp_path / "table.md").read_text()
    assert "| model | parity | cycle_navigation m=3 |" in table and "| mamba-1 |" in table
    png = (tmp_path / "accuracy_vs_length.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    st.main(argv)                                   # everything done: resumes without new runs
    assert "resuming: 8 runs" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 8
    (tmp_path / "table.md").unlink()
    st.main(["--report", str(tmp_path / "results.json"), "--output-dir", str(tmp_path)])
    assert (tmp_path / "table.md").read_text() == table
    # sweeps run in parallel (one per core) are merged into one report
    parity, rest = tmp_path / "parity.json", tmp_path / "rest.json"
    parity.write_text(json.dumps({"runs": [r for r in runs if r["task"] == "parity"]}))
    rest.write_text(json.dumps({"runs": [r for r in runs if r["task"] != "parity"]}))
    merged = tmp_path / "merged"
    st.main(["--report", f"{parity},{rest}", "--output-dir", str(merged)])
    assert (merged / "table.md").read_text() == table
    assert len(json.loads((merged / "results.json").read_text())["runs"]) == 8
    for files, message in ((f"{parity},{tmp_path / 'results.json'}", "parity .* is in both"),
                           (f"{rest},{merged / 'results.json'}", "own results.json"),
                           (str(tmp_path / "missing.json"), "no results file at")):
        with pytest.raises(SystemExit, match=message):
            st.main(["--report", files, "--output-dir", str(merged)])
    assert len(json.loads((merged / "results.json").read_text())["runs"]) == 8  # a refused merge writes nothing


def test_each_model_keeps_its_own_color_in_every_panel(monkeypatch, tmp_path):
    """Twelve models on two tasks, one missing from the second panel: each model's curve has one color in both panels,
    and no two models share one (matplotlib's default cycle repeats after 10 and shifts when a model is missing)."""
    import matplotlib.pyplot as plt

    def run(task, model):
        return {"task": task, "task_params": {}, "model": model, "chance": 0.5, "train_lengths": [2, 8],
                "test": {"16": {"per_position_acc": [1.0] * 16}}}

    models = [f"model-{i}" for i in range(12)]
    runs = [run("cycle_navigation", m) for m in models] + [run("parity", m) for m in models if m != "model-5"]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    report.plot_accuracy_vs_length(runs, tmp_path / "plot.png")
    colors = [{line.get_label(): line.get_color() for line in ax.get_lines() if line.get_label() in models}
              for ax in figures[0].axes[:2]]
    assert len(colors[0]) == 12 and len(colors[1]) == 11
    assert all(colors[0][m] == c for m, c in colors[1].items())
    assert len(set(colors[0].values())) == 12
    assert len({report.model_color(i) for i in range(20)}) == 20


def _interrupt_at(text):
    def log(line):
        if text in line:
            raise KeyboardInterrupt
    return log


def _without_timings(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("seconds", "eval_seconds")}


@pytest.mark.parametrize("model", ["bilinear-cp", "lstm"])
def test_an_interrupted_probe_run_resumes_to_the_uninterrupted_result(tmp_path, model):
    """Cut while logging its second validation, the run restarts from the first one's checkpoint: the weights,
    Adam's moments, the length and data draws and the best weights so far carry over, so it ends as the
    uninterrupted run does, to the last digit."""
    task, config = make_task("parity"), dataclasses.replace(TINY_CONFIG, steps=20, verbose=True)
    whole = run_probe(task, model, 0, config, log=lambda _: None)
    checkpoint = tmp_path / "run.pt"
    with pytest.raises(KeyboardInterrupt):
        run_probe(task, model, 0, config, log=_interrupt_at("step     10"), checkpoint=checkpoint)
    lines = []
    resumed = run_probe(task, model, 0, config, log=lines.append, checkpoint=checkpoint)
    assert "resumed" in lines[0] and "at step 5" in lines[0] and len(lines) == 1 + 3 + 1  # steps 10, 15, 20; result
    assert _without_timings(resumed) == _without_timings(whole)
    assert len({h["train_loss"] for h in whole["history"]}) == 4  # the losses move: equal ones say something


def test_a_probe_checkpoint_of_something_else_is_refused(tmp_path):
    checkpoint = tmp_path / "run.pt"
    torch.save({"model": {}, "step": 3}, checkpoint)
    with pytest.raises(ValueError, match="not a probe run's checkpoint"):
        run_probe(make_task("parity"), "lstm", 0, dataclasses.replace(TINY_CONFIG, steps=5), checkpoint=checkpoint)


def test_another_probe_runs_checkpoint_is_refused_naming_what_differs(tmp_path):
    task, config, checkpoint = make_task("parity"), dataclasses.replace(TINY_CONFIG, steps=10), tmp_path / "run.pt"
    with pytest.raises(KeyboardInterrupt):  # cut after its first validation: the checkpoint of seed 0 at step 5
        run_probe(task, "lstm", 0, dataclasses.replace(config, verbose=True), log=_interrupt_at("step     10"),
                  checkpoint=checkpoint)
    with pytest.raises(ValueError, match=r"another probe run's checkpoint \(differing: seed\)"):
        run_probe(task, "lstm", 1, config, checkpoint=checkpoint)
    with pytest.raises(ValueError, match=r"\(differing: config\)"):
        run_probe(task, "lstm", 0, dataclasses.replace(config, lr=0.5), checkpoint=checkpoint)
    assert run_probe(task, "lstm", 0, config, checkpoint=checkpoint)["steps"] == 10  # verbose is not the run's


def test_a_sweep_continues_a_cut_run_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    argv = ["--sweep", "--tasks", "parity", "--models", "lstm", "--seeds", "0,1", "--steps", "15", "--verbose",
            "--test-lengths", "24", "--val-length", "12", "--output-dir", str(tmp_path / "cut"), *TINY]
    st.main([*argv[:-len(TINY) - 2], "--output-dir", str(tmp_path / "whole"), *TINY])
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())["runs"]
    run_probe_ = st.run_probe
    def cut_seed_1(task, model, seed, config, checkpoint):  # seed 0 finishes, seed 1 is cut after step 5
        return run_probe_(task, model, seed, config, checkpoint=checkpoint,
                          log=_interrupt_at("step     10") if seed == 1 else print)
    monkeypatch.setattr(st, "run_probe", cut_seed_1)
    with pytest.raises(KeyboardInterrupt):
        st.main(argv)
    assert len(json.loads((tmp_path / "cut" / "results.json").read_text())["runs"]) == 1
    assert len(list((tmp_path / "cut" / "checkpoints").iterdir())) == 1  # the cut run's; seed 0's was deleted
    monkeypatch.undo()
    capsys.readouterr()
    st.main(argv)
    assert "resuming: 1 runs" in (out := capsys.readouterr().out) and "resumed from" in out and "at step 5" in out
    cut = json.loads((tmp_path / "cut" / "results.json").read_text())["runs"]
    assert [_without_timings(r) for r in cut] == [_without_timings(r) for r in whole]
    assert not list((tmp_path / "cut" / "checkpoints").iterdir())


@pytest.mark.parametrize("argv,match", [
    (["--task", "parity", "--model", "gru"], "unknown model 'gru'"),
    (["--task", "parity", "--model", "bilinear-dense"], "unknown bilinear mixer 'dense'"),
    (["--task", "parity", "--model", "lstm", "--train-lengths", "10-2"], "--train-lengths"),
    (["--task", "automaton", "--model", "lstm"], "--automaton-file"),
    (["--task", "modular_addition", "--m", "1", "--model", "lstm"], "m must be an integer >= 2"),
    (["--model", "lstm"], "give --task"),
    (["--sweep", "--tasks", "parity,sorting", "--models", "lstm"], "unknown task 'sorting'"),
    (["--task", "parity", "--model", "lstm", "--state-consistency", "1"], "reads the bilinear recurrent state"),
    (["--task", "modular_arithmetic", "--model", "bilinear-cp", "--state-consistency", "1"], "labels merge states"),
    (["--task", "parity", "--model", "bilinear-cp", "--state-consistency", "-1"], "finite weight >= 0"),
])
def test_bad_cli_input_names_the_problem(argv, match, tmp_path):
    with pytest.raises(SystemExit, match=match):
        st.main([*argv, "--steps", "1", "--output-dir", str(tmp_path), *TINY])


def test_sweep_refuses_state_consistency_for_a_baseline_before_any_run(tmp_path):
    with pytest.raises(SystemExit, match="lstm has none"):
        st.main(["--sweep", "--tasks", "parity", "--models", "bilinear-cp,lstm", "--state-consistency", "1",
                 "--steps", "1", "--output-dir", str(tmp_path), *TINY])
    assert not (tmp_path / "results.json").exists()


def test_state_consistency_loss_matches_a_per_class_loop():
    """Center loss on unit-norm head states against a loop over classes; zero iff each class has one direction."""
    torch.manual_seed(0)
    B, T, N, H, C = 3, 5, 2, 4, 4
    states = [torch.randn(B, T, N, H, dtype=torch.float64) * torch.rand(B, T, N, 1, dtype=torch.float64) * 10
              for _ in range(2)]
    labels = torch.randint(C - 1, (B, T))
    labels[0, 0] = C - 1  # a class seen once contributes zero
    expected = []
    for h in states:
        unit = (h / h.norm(dim=-1, keepdim=True)).reshape(B * T, N * H)
        y = labels.reshape(-1)
        per_position = [((unit[i] - unit[y == y[i]].mean(0)) ** 2).sum() for i in range(B * T)]
        expected.append(torch.stack(per_position).mean())
    got = state_consistency_loss(states, labels, C)
    assert torch.allclose(got, torch.stack(expected).mean())
    # Same direction within each class at any positive scale: zero. A sign flip is penalized.
    protos = torch.randn(C, N, H, dtype=torch.float64)
    scale = torch.rand(B, T, N, 1, dtype=torch.float64) + 0.1
    same = [protos[labels] * scale]
    assert state_consistency_loss(same, labels, C) < 1e-24
    flipped = same[0].clone()
    flipped[1, 2] *= -1
    assert state_consistency_loss([flipped], labels, C) > 1e-3


def minimal_probe_logits_by_hand(model, x, h, memory_read=None):
    """The minimal probe model's logits (1 layer, no gate, no MLP) from its state ``h`` and, with memory heads, its
    memory's read-out: unit norm x scale (and the read-out beside it) -> out_proj -> residual -> RMSNorm -> head."""
    mixer = model.model.layers[0].mixer
    read = (h / h.norm(dim=-1, keepdim=True) * h.shape[-1] ** 0.5 * mixer.state_norm.weight).flatten(2)
    if memory_read is not None:
        read = torch.cat([read, memory_read.flatten(2)], -1)
    resid = model.model.embed_tokens(x) + read @ mixer.out_proj.weight.T
    normed = resid / resid.pow(2).mean(-1, keepdim=True).add(model.config.rms_norm_eps).sqrt() * model.model.norm.weight
    return normed @ model.lm_head.weight.T


def test_state_consistency_reads_the_states_the_model_reads_out():
    """outputs.mixer_states (what run_probe's center loss reads) are the states behind the logits: the minimal
    model's logits recomputed from them by hand (unit norm x scale -> out_proj -> residual -> RMSNorm -> head), and
    the center loss reaches the scan's weights, the input factors and the start state."""
    task = make_task("random_fsm", 4)
    model, _ = build_probe_model("bilinear-cp", task, dataclasses.replace(TINY_CONFIG, gate=False))
    model = model.double().train()
    x, y = task.sample(3, 6, torch.Generator().manual_seed(0))
    out = model(input_ids=x, use_cache=False, output_mixer_states=True)
    (h,) = out.mixer_states
    assert h.shape == (3, 6, 1, 8) and h.requires_grad
    mixer = model.model.layers[0].mixer
    torch.testing.assert_close(out.logits, minimal_probe_logits_by_hand(model, x, h))
    state_consistency_loss(out.mixer_states, y, task.num_classes).backward()
    for p in (mixer.transition.W2, mixer.in_proj.weight, mixer.h_start):  # through the scan, the input factors and the start state
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_state_consistency_reads_the_memory_read_outs_the_model_reads_out():
    """With memory heads, outputs.memory_reads (which run_probe's center loss reads beside the states) are the
    memory's read-outs behind the logits: the logits recomputed by hand from mixer_states and memory_reads
    (tracking read-out and memory read-out -> out_proj -> residual -> RMSNorm -> head), and a center loss on the
    read-outs reaches the memory's projection and decay. Without memory heads there are none."""
    task = make_task("parity")
    model, _ = build_probe_model("bilinear-cp", task, dataclasses.replace(TINY_CONFIG, memory_heads=2, memory_size=4))
    model = model.double().train()
    x, y = task.sample(3, 6, torch.Generator().manual_seed(0))
    out = model(input_ids=x, use_cache=False, output_mixer_states=True)
    (h,), (r,) = out.mixer_states, out.memory_reads
    assert r.shape == (3, 6, 2, 4) and r.requires_grad
    mixer = model.model.layers[0].mixer
    torch.testing.assert_close(out.logits, minimal_probe_logits_by_hand(model, x, h, r))
    state_consistency_loss(out.memory_reads, y, task.num_classes).backward()
    assert mixer.memory.in_proj.weight.grad.abs().sum() > 0 and mixer.memory.A_log.grad.abs().sum() > 0
    assert mixer.transition.W2.grad is None  # the read-outs' loss reaches the memory, not the tracking state
    plain, _ = build_probe_model("bilinear-cp", task, TINY_CONFIG)
    assert plain(input_ids=x, use_cache=False, output_mixer_states=True).memory_reads is None


def test_state_consistency_changes_training_and_is_recorded(tmp_path):
    """Same seed and data: the center loss changes the weights (cross-entropy logged apart), and is recorded."""
    runs = {}
    for w in ("0", "0.5"):
        out = tmp_path / f"r{w}.json"
        st.main(["--task", "random_fsm", "--m", "3", "--model", "bilinear-cp", "--steps", "10", "--state-consistency", w,
                 "--test-lengths", "20", "--output", str(out), *TINY])
        runs[w] = json.loads(out.read_text())["runs"][0]
    off, on = runs["0"], runs["0.5"]
    assert on["state_consistency"] == 0.5 and off["state_consistency"] == 0.0
    assert "consistency_loss" in on["history"][0] and "consistency_loss" not in off["history"][0]
    assert [h["step"] for h in on["history"]] == [h["step"] for h in off["history"]] == [5, 10]
    assert all(a["train_loss"] != b["train_loss"] for a, b in zip(on["history"], off["history"]))


def test_state_consistency_loss_names_a_capture_mismatch():
    with pytest.raises(ValueError, match="one \\[B, T, heads, state\\] tensor per bilinear layer"):
        state_consistency_loss([], torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="output_mixer_states=True"):
        state_consistency_loss([torch.randn(2, 4, 1, 8)], torch.zeros(2, 3, dtype=torch.long), 4)


def test_sweep_into_a_results_file_reruns_only_the_same_settings(tmp_path, capsys):
    """A sweep skips a run already in its results file only when every setting matches: a plain run is not taken for
    a gated, other-rank or other-size run (nor the other way round)."""
    base = ["--sweep", "--tasks", "parity", "--models", "bilinear-cp", "--steps", "2", "--test-lengths", "12",
            "--val-length", "12", "--output-dir", str(tmp_path), *TINY]
    variants = [[], ["--gate"], ["--rank", "4"], ["--state-size", "4"], ["--hidden-size", "4"]]
    for extra in variants:
        st.main([*base, *extra])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(runs) == len(variants)
    configs = [r["model_config"] for r in runs]
    assert [c["use_gate"] for c in configs] == [False, True, False, False, False]
    assert [(c["rank"], c["state_size"], c["hidden_size"]) for c in configs] == [
        (8, 8, 8), (8, 8, 8), (4, 8, 8), (4, 4, 8), (8, 8, 4)]
    capsys.readouterr()
    for extra in variants:  # each again: all done
        st.main([*base, *extra])
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == len(variants)
    assert "final acc @" not in capsys.readouterr().out  # no run logged: none trained


def test_runs_with_and_without_state_consistency_are_separate_rows():
    config = dataclasses.asdict(ProbeConfig())
    base = {"task": "parity", "task_params": {}, "model": "bilinear-cp", "seed": 0, "config": config}
    a, b = dict(base), dict(base, state_consistency=5.0, config={**config, "state_consistency": 5.0})
    assert report.run_key(a) != report.run_key(b)
    assert report.model_label(a) == "bilinear-cp" and report.model_label(b) == "bilinear-cp +consistency 5"
    for field in dataclasses.fields(ProbeConfig):  # every setting but verbose (the log only) is in the key
        changed = report.run_key(dict(base, config={**config, field.name: "other"})) != report.run_key(a)
        assert changed == (field.name != "verbose"), field.name
