"""MQAR by Zoology's protocol: the data against a per-example check, the answer-only loss against the full logits,
early stopping, the lr sweep, and the CLI end to end on a tiny setting."""
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from bilinear_lm.probes import recall
from bilinear_lm.probes.recall import (IGNORE, POINTS, RECALL_MODELS, ZOOLOGY_LRS, RecallConfig, answer_accuracy,
                                       answer_logits, best_run, mqar, parse_point, recall_data, recall_model,
                                       run_recall, state_floats, sweep_lrs, zoology_batch_size)
from bilinear_lm.probes.report import recall_table

TINY = dict(vocab_size=32, seq_len=16, num_pairs=2, train_examples=24, valid_examples=6, test_examples=6,
            batch_size=8, hidden_size=16, num_heads=2, state_size=4, num_layers=2)
HYBRID = {"layer_types": ["bilinear", "full_attention"], "num_attention_heads": 2, "num_key_value_heads": 2}


def test_mqar_pairs_then_each_key_queried_once_for_its_value():
    n, length, pairs, vocab = 200, 40, 6, 64
    tokens, labels = mqar(n, length, pairs, vocab, torch.Generator().manual_seed(0))
    assert tokens.shape == labels.shape == (n, length) and tokens.dtype == labels.dtype == torch.long
    for x, y in zip(tokens.tolist(), labels.tolist()):
        keys, values = x[0:2 * pairs:2], x[1:2 * pairs:2]
        assert len(set(keys)) == pairs and len(set(values)) == pairs  # distinct keys, distinct values
        assert all(1 <= k < vocab // 2 <= v < vocab for k, v in zip(keys, values))  # lower half, upper half
        value_of = dict(zip(keys, values))
        asked = [t for t, label in enumerate(y) if label != IGNORE]
        assert sorted(x[t] for t in asked) == sorted(keys)  # every key queried once
        assert all(t >= 2 * pairs and (t - 2 * pairs) % 2 == 0 for t in asked)  # after the pairs, at even offsets
        assert all(y[t] == value_of[x[t]] for t in asked)  # the answer: the value paired with that key earlier
        assert all(x[t] == 0 for t in range(2 * pairs, length) if t not in asked)  # filler
        assert all(label == IGNORE for t, label in enumerate(y) if t not in asked)  # answer-only labels
    again = mqar(n, length, pairs, vocab, torch.Generator().manual_seed(0))
    other = mqar(n, length, pairs, vocab, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], tokens) and torch.equal(again[1], labels)  # determined by the seed
    assert not torch.equal(other[0], tokens)


def test_query_gaps_follow_the_power_law():
    """Zoology's p(gap) ~ (gap + 1) ** -0.99, drawn without replacement: the shortest gaps are the likeliest."""
    _, labels = mqar(4000, 64, 4, 8192, torch.Generator().manual_seed(0))
    gaps = ((labels != IGNORE).nonzero()[:, 1] - 8) // 2
    counts = torch.bincount(gaps, minlength=28).tolist()
    assert len(counts) == 28 and counts[0] == max(counts) and counts[0] > 3 * counts[27]
    assert all(a > b for a, b in zip(counts[:6], counts[1:7]))


def test_the_three_points_of_zoology_figure_2():
    assert POINTS == {"64x4": (64, 4), "128x8": (128, 8), "256x16": (256, 16)}
    assert [zoology_batch_size(L) for L, _ in POINTS.values()] == [512, 512, 256]
    assert [parse_point(p) for p in POINTS] == list(POINTS.values())
    assert ZOOLOGY_LRS == pytest.approx(torch.logspace(-4, -2, 4).tolist(), rel=1e-3)
    assert RecallConfig().point == "64x4" and RecallConfig().vocab_size == 8192
    for length, pairs in POINTS.values():
        tokens, labels = mqar(3, length, pairs, generator=torch.Generator().manual_seed(0))
        assert tokens.shape == labels.shape == (3, length)
        assert ((labels != IGNORE).sum(1) == pairs).all() and int(tokens.max()) < 8192
    with pytest.raises(ValueError, match="LENGTHxPAIRS"):
        parse_point("64-4")


def test_mqar_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="4 \\* num_pairs <= seq_len"):
        mqar(1, 15, 4, 64)
    with pytest.raises(ValueError, match="raise vocab_size"):
        mqar(1, 80, 20, 16)
    with pytest.raises(ValueError, match="RecallConfig.epochs"):
        RecallConfig(epochs=0)
    with pytest.raises(ValueError, match="RecallConfig.target"):
        RecallConfig(target=1.5)
    with pytest.raises(ValueError, match="unknown recall model"):
        recall_model("bilinear-lstm", RecallConfig())


def test_recall_data_sets_are_fixed_by_the_seed_and_share_no_draw():
    config = RecallConfig(**TINY)
    data, again = recall_data(config, seed=3), recall_data(config, seed=3)
    assert [len(data[k][0]) for k in ("train", "valid", "test")] == [24, 6, 6]
    assert all(torch.equal(data[k][i], again[k][i]) for k in data for i in (0, 1))
    assert not torch.equal(data["valid"][0], data["test"][0])
    assert not torch.equal(recall_data(config, seed=4)["train"][0], data["train"][0])


@pytest.mark.parametrize("name", [*RECALL_MODELS, "hybrid"])
def test_answer_only_loss_is_the_full_cross_entropy_at_the_answers(name):
    """The LM head applied at the answer positions only gives the loss (and the gradient) of the full logits'
    cross-entropy over the answers, computed here by hand from ``model(tokens).logits``."""
    config = RecallConfig(**TINY, extra=HYBRID if name == "hybrid" else {})
    torch.manual_seed(0)
    model = recall_model("bilinear-conv" if name == "hybrid" else name, config)
    tokens, labels = mqar(5, 16, 2, 32, torch.Generator().manual_seed(0))
    logits, answers = answer_logits(model, tokens, labels)
    assert logits.shape == (10, 32) and answers.tolist() == labels[labels != IGNORE].tolist()
    loss = F.cross_entropy(logits, answers)
    (grad,) = torch.autograd.grad(loss, model.get_input_embeddings().weight)
    full = model(input_ids=tokens).logits.double()
    picked = [-(full[b, t].log_softmax(-1)[labels[b, t]]) for b in range(5) for t in range(16) if labels[b, t] >= 0]
    expected = torch.stack(picked).mean()
    (expected_grad,) = torch.autograd.grad(expected, model.get_input_embeddings().weight)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(grad, expected_grad.float(), rtol=1e-4, atol=1e-6)  # fp32 rounding: LM heads over other rows
    right = sum(int(full[b, t].argmax() == labels[b, t]) for b in range(5) for t in range(16) if labels[b, t] >= 0)
    assert answer_accuracy(model, tokens, labels, batch_size=2) == right / 10


def test_early_stopping_stops_after_the_first_epoch_at_the_target(monkeypatch):
    scripted = iter([0.2, 0.6, 0.96, 0.99, 0.5])  # validation after epochs 1, 2, 3; then the test
    monkeypatch.setattr(recall, "answer_accuracy", lambda *a, **k: next(scripted))
    config = RecallConfig(**{**TINY, "epochs": 10, "target": 0.95})
    lines = []
    r = run_recall("lstm", config, log=lines.append)
    assert (r["stop"], r["epochs_run"], r["valid_acc"], r["test_acc"]) == ("target", 3, 0.96, 0.99)
    assert r["steps"] == 3 * 3 and r["examples_seen"] == 3 * 24  # 24 examples in batches of 8, three epochs
    assert [h["valid_acc"] for h in r["history"]] == [0.2, 0.6, 0.96] and len(lines) == 4
    assert "cost 9 steps, 72 examples" in lines[-1] and "s/step" in lines[-1] and r["device"] == recall.cpu_device()
    monkeypatch.setattr(recall, "answer_accuracy", lambda *a, **k: 0.5)
    r = run_recall("lstm", dataclasses.replace(config, epochs=2), log=lines.append)
    assert (r["stop"], r["epochs_run"], r["steps"], r["examples_seen"]) == ("epochs", 2, 6, 48)


def test_the_cosine_decays_to_zero_over_all_epochs(monkeypatch):
    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    run_recall("lstm", RecallConfig(**{**TINY, "epochs": 2, "target": 1.0, "lr": 0.01}), log=lambda _: None)
    total = 6  # 2 epochs of 3 steps
    assert seen == pytest.approx([0.005 * (1 + math.cos(math.pi * s / total)) for s in range(total)])


def test_an_interrupted_run_resumes_from_its_last_epoch_to_the_uninterrupted_result(tmp_path):
    """Killed while logging epoch 2, the run restarts from epoch 1's checkpoint: the model, AdamW's moments, the
    cosine's step and the data order carry over, so epochs 2-3 repeat the uninterrupted run's losses exactly."""
    config = RecallConfig(**{**TINY, "epochs": 3, "target": 1.0, "lr": 0.01})
    whole = run_recall("llama", config, log=lambda _: None)

    def interrupt(line):
        if "epoch 2/3" in line:
            raise KeyboardInterrupt

    checkpoint = tmp_path / "run.pt"
    with pytest.raises(KeyboardInterrupt):
        run_recall("llama", config, log=interrupt, checkpoint=checkpoint)
    lines = []
    resumed = run_recall("llama", config, log=lines.append, checkpoint=checkpoint)
    assert "resumed" in lines[0] and "after epoch 1" in lines[0] and len(lines) == 1 + 2 + 1  # epochs 2, 3; result
    for key in ("steps", "examples_seen", "valid_acc", "test_acc", "train_loss", "epochs_run"):
        assert resumed[key] == whole[key], key
    assert [h["train_loss"] for h in resumed["history"]] == [h["train_loss"] for h in whole["history"]]
    assert len({h["train_loss"] for h in whole["history"]}) == 3  # the losses move: equal ones say something


def test_another_recall_runs_checkpoint_is_refused_naming_what_differs(tmp_path):
    """A checkpoint names its run (model, seed, config): another run's file at the path is refused, not continued."""
    config, checkpoint = RecallConfig(**{**TINY, "epochs": 2, "target": 1.0, "lr": 0.01}), tmp_path / "run.pt"

    def interrupt(line):
        if "epoch 2/2" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # cut in epoch 2: the checkpoint of llama, seed 0, after epoch 1
        run_recall("llama", config, log=interrupt, checkpoint=checkpoint)
    with pytest.raises(ValueError, match=r"another recall run's checkpoint \(differing: seed\)"):
        run_recall("llama", config, seed=1, checkpoint=checkpoint)
    with pytest.raises(ValueError, match=r"\(differing: config\)"):
        run_recall("llama", dataclasses.replace(config, lr=0.02), checkpoint=checkpoint)
    with pytest.raises(ValueError, match=r"\(differing: model\)"):
        run_recall("lstm", config, checkpoint=checkpoint)
    lines = []
    assert run_recall("llama", config, log=lines.append, checkpoint=checkpoint)["epochs_run"] == 2
    assert "after epoch 1" in lines[0]  # its own run's file is continued
    torch.save({"model": {}, "step": 3}, checkpoint)
    with pytest.raises(ValueError, match="not a recall run's checkpoint"):
        run_recall("llama", config, checkpoint=checkpoint)


def test_the_lr_sweep_keeps_the_best_validation_accuracy(monkeypatch):
    valid = {1e-4: 0.3, 4.642e-4: 0.9, 2.154e-3: 0.99, 1e-2: 0.5}
    calls = []

    def fake_run(model, config, seed, log, data, device):
        calls.append((config.lr, id(data)))
        return {"lr": config.lr, "valid_acc": valid[config.lr], "test_acc": 1 - valid[config.lr], "steps": 10}

    monkeypatch.setattr(recall, "run_recall", fake_run)
    runs, best = sweep_lrs("llama", RecallConfig(**TINY))
    assert [r["lr"] for r in runs] == list(ZOOLOGY_LRS) and best["lr"] == 2.154e-3  # by validation, not test
    assert len({d for _, d in calls}) == 1  # one data set for every lr
    tie = [{"valid_acc": 1.0, "steps": 30, "lr": 1}, {"valid_acc": 1.0, "steps": 20, "lr": 2}]
    assert best_run(tie)["lr"] == 2  # among equals, the fewest steps


def test_recall_cli_runs_the_sweep_resumes_and_writes_a_table(tmp_path):
    from bilinear_lm.probes.recall_cli import main

    args = ["--points", "16x2,16x3", "--models", "lstm,llama", "--lrs", "1e-3,1e-2", "--train-examples", "16",
            "--valid-examples", "4", "--test-examples", "4", "--epochs", "2", "--vocab-size", "32", "--hidden-size",
            "16", "--num-heads", "2", "--batch-size", "8", "--log-every", "0", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [(r["point"], r["model"], r["lr"]) for r in runs] == [
        (p, m, lr) for p in ("16x2", "16x3") for m in ("lstm", "llama") for lr in (1e-3, 1e-2)]
    assert all(r["steps"] == r["epochs_run"] * 2 and r["examples_seen"] == r["epochs_run"] * 16 for r in runs)
    table = (tmp_path / "table.md").read_text()
    assert table.splitlines()[0] == "| model | params | state floats / layer | 16x2 | 16x3 |"
    assert "| llama hidden_size=16 num_heads=2 | 9k | 512 |" in table  # keys, values: 16 positions x width 16
    assert (tmp_path / "recall_vs_state.png").read_bytes()[:4] == b"\x89PNG"
    assert "Devices: " + recall.cpu_device().split(",")[0] in table
    assert not list((tmp_path / "checkpoints").iterdir())  # a recorded run's checkpoint is deleted
    assert main(args) == 0 and json.loads((tmp_path / "results.json").read_text()) == runs  # resumed, not rerun
    assert main([*args, "--points", "16x2", "--models", "lstm", "--lrs", "3e-3"]) == 0  # another lr: a new run
    assert [r["lr"] for r in json.loads((tmp_path / "results.json").read_text())[8:]] == [3e-3]


def test_two_sweeps_into_one_folder_keep_each_others_runs(tmp_path, monkeypatch):
    """A run that another sweep wrote to results.json while this one trained stays in the file beside this one's."""
    from bilinear_lm.probes import recall_cli

    def fake_run(model, config, seed, **kwargs):
        other = {"model": "other", "seed": 5, "config": None}
        path = tmp_path / "results.json"
        path.write_text(json.dumps([*json.loads(path.read_text()), other] if path.exists() else [other]))
        return {"model": model, "seed": seed, "config": dataclasses.asdict(config)}

    monkeypatch.setattr(recall_cli, "run_recall", fake_run)
    monkeypatch.setattr(recall_cli, "recall_table", lambda runs: "")
    monkeypatch.setattr(recall_cli, "plot_recall_vs_state", lambda runs, path: None)
    monkeypatch.setattr(recall_cli, "state_floats", lambda model, seq_len: 1.0)
    args = ["--points", "16x2", "--models", "lstm", "--lrs", "1e-3,1e-2", "--vocab-size", "32", "--output-dir",
            str(tmp_path)]
    assert recall_cli.main(args) == 0
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [(r["model"], r["config"]["lr"] if r["config"] else None) for r in runs] == [
        ("other", None), ("lstm", 1e-3), ("other", None), ("lstm", 1e-2)]


def test_sweep_skips_the_runs_recorded_in_other_folders(tmp_path, monkeypatch):
    """``--skip-runs-in``: a cell another folder's results.json holds (same model, seed and config) is not run again;
    a different lr is; a missing file is refused with one line naming it."""
    from bilinear_lm.probes import recall_cli

    ran = []
    monkeypatch.setattr(recall_cli, "run_recall", lambda model, config, seed, **kw: ran.append(config.lr) or {
        "model": model, "seed": seed, "config": dataclasses.asdict(config)})
    monkeypatch.setattr(recall_cli, "recall_table", lambda runs: "")
    monkeypatch.setattr(recall_cli, "plot_recall_vs_state", lambda runs, path: None)
    args = ["--points", "16x2", "--models", "lstm", "--vocab-size", "32"]
    assert recall_cli.main([*args, "--lrs", "1e-3", "--output-dir", str(tmp_path / "apart")]) == 0
    other = tmp_path / "apart" / "results.json"
    ran.clear()
    sweep = [*args, "--lrs", "1e-3,1e-2", "--output-dir", str(tmp_path / "sweep")]
    assert recall_cli.main([*sweep, "--skip-runs-in", str(other)]) == 0
    assert ran == [1e-2]
    with pytest.raises(SystemExit, match="--skip-runs-in: no results file at .*missing.json"):
        recall_cli.main([*sweep, "--skip-runs-in", f"{other},{tmp_path / 'missing.json'}"])


def test_recall_report_merges_results_files_and_refuses_mixed_work(tmp_path):
    """``--report`` writes one results.json, table and plot from several sweeps' files; it refuses a run recorded in
    two files, the output folder's own results.json and a missing file, each with one line naming it."""
    from bilinear_lm.probes.recall_cli import main

    base = dict(seed=0, extra={}, seq_len=64, num_pairs=4, point="64x4", num_params=1000, train_examples=100,
                stop="epochs", epochs_run=2, epochs=2, steps=4, examples_seen=200, seconds=1.0, s_per_step=0.25,
                cpu_s_per_step=0.125, device="cpu X", lr=1e-3, valid_acc=0.5)
    ours = [dict(base, model="bilinear-memory", test_acc=0.9, state_floats=100.0, config={"lr": 1e-3, "a": 1})]
    peers = [dict(base, model="mamba2", test_acc=0.7, state_floats=9216.0, config={"lr": 1e-3, "a": 2}),
             dict(base, model="mamba2", point="128x8", seq_len=128, num_pairs=8, test_acc=0.2, state_floats=9216.0,
                  config={"lr": 1e-3, "a": 3})]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, b = tmp_path / "a" / "results.json", tmp_path / "b" / "results.json"
    a.write_text(json.dumps(ours)), b.write_text(json.dumps(peers))
    out = tmp_path / "all"
    assert main(["--report", f"{a},{b}", "--output-dir", str(out)]) == 0
    assert json.loads((out / "results.json").read_text()) == ours + peers
    lines = (out / "table.md").read_text().splitlines()
    assert lines[0] == "| model | params | state floats / layer | 64x4 | 128x8 |"
    assert lines[2:4] == ["| bilinear-memory | 1k | 100 | 0.900 (lr 0.001) | - |",
                          "| mamba2 | 1k | 9,216 | 0.700 (lr 0.001) | 0.200 (lr 0.001) |"]
    assert (out / "recall_vs_state.png").read_bytes()[:4] == b"\x89PNG"
    b.write_text(json.dumps(peers + ours))
    for files, message in ((f"{a},{b}", "is in both"), (f"{a},{out / 'results.json'}", "own results.json"),
                           (f"{a},{tmp_path / 'c.json'}", "no results file")):
        with pytest.raises(SystemExit, match=message):
            main(["--report", files, "--output-dir", str(out)])
    assert json.loads((out / "results.json").read_text()) == ours + peers  # a refused merge writes nothing
    (out / "table.md").unlink()  # alone, the folder's own file re-renders its report
    assert main(["--report", str(out / "results.json"), "--output-dir", str(out)]) == 0
    assert (out / "table.md").read_text().splitlines()[2:4] == lines[2:4]


def test_recall_table_shows_the_best_lr_by_validation_and_every_run():
    base = dict(model="llama", extra={}, seq_len=64, num_pairs=4, point="64x4", num_params=1000, train_examples=100,
                stop="epochs", epochs_run=2, epochs=2, steps=4, examples_seen=200, seconds=1.0, s_per_step=0.25,
                cpu_s_per_step=0.125, device="cpu X", state_floats=8192.0)
    runs = [dict(base, seed=0, lr=1e-3, valid_acc=0.5, test_acc=0.6), dict(base, seed=0, lr=1e-2, valid_acc=0.9,
                                                                          test_acc=0.8),
            dict(base, seed=1, lr=1e-3, valid_acc=1.0, test_acc=1.0), dict(base, seed=1, lr=1e-2, valid_acc=0.1,
                                                                           test_acc=0.1)]
    hybrid = dict(base, model="bilinear-conv", seed=0, lr=1e-3, valid_acc=0.5, test_acc=0.7, state_floats=100.0,
                  extra={"layer_types": ["bilinear", "full_attention"], "use_rope": False})
    lines = recall_table([*runs, hybrid]).splitlines()
    assert lines[2] == "| llama | 1k | 8,192 | 0.900 (lr 0.001, 0.01) (n=2) |"
    assert lines[3] == '| bilinear-conv {"layer_types": "BA", "use_rope": false} | 1k | 100 | 0.700 (lr 0.001) |'
    assert lines[7].startswith("| llama | 64x4 | 0 | 0.001 | 100 | 0.500 | 0.600 | epochs | 2/2 | 4 | 200 | 1 | 0.250 | 0.125 |")


def test_recall_table_keeps_two_widths_of_one_model_apart():
    """Runs of one model at two widths are two rows (and two legend entries): the lr sweep's best run is chosen within
    a width, never across widths, though the wider run validates better."""
    from bilinear_lm.probes.report import recall_label

    base = dict(model="llama", extra={}, seq_len=64, num_pairs=4, point="64x4", num_params=1000, train_examples=100,
                stop="epochs", epochs_run=2, epochs=2, steps=4, examples_seen=200, seconds=1.0, s_per_step=0.25,
                cpu_s_per_step=0.125, device="cpu X", seed=0, lr=1e-3, num_layers=2, num_heads=4, state_size=16)
    runs = [dict(base, hidden_size=64, valid_acc=0.5, test_acc=0.4, state_floats=8192.0),
            dict(base, hidden_size=128, valid_acc=0.9, test_acc=0.8, state_floats=16384.0)]
    lines = recall_table(runs).splitlines()
    assert lines[2] == "| llama | 1k | 8,192 | 0.400 (lr 0.001) |"
    assert lines[3] == "| llama hidden_size=128 | 1k | 16,384 | 0.800 (lr 0.001) |"
    hybrid = dict(runs[1], model="bilinear-conv", num_layers=4, extra={"layer_types": ["bilinear", "full_attention"]})
    assert recall_label(hybrid) == 'bilinear-conv hidden_size=128 num_layers=4 {"layer_types": "BA"}'
    assert recall_label(hybrid, short=True) == "bilinear-conv hidden_size=128 num_layers=4 BA"
    assert recall_label(dict(runs[0], num_heads=2), short=True) == "llama num_heads=2"  # a legend entry of its own


def test_recall_cli_flags_are_the_config_fields():
    """Every RecallConfig field but the point's (``--points``), the lr (``--lrs``), the batch size (Zoology's for the
    point unless ``--batch-size``) and ``extra`` (``--extra``) is a flag with the field's default."""
    from bilinear_lm.probes.cli import config_from_args
    from bilinear_lm.probes.recall_cli import build_parser

    parser = build_parser()
    args = parser.parse_args([])
    assert args.batch_size is None and config_from_args(RecallConfig, args, batch_size=512) == RecallConfig()
    args = parser.parse_args(["--epochs", "3", "--state-size", "8", "--extra", '{"conv_width": 2}'])
    assert config_from_args(RecallConfig, args, batch_size=512) == RecallConfig(epochs=3, state_size=8,
                                                                                extra={"conv_width": 2})
    assert [float(x) for x in args.lrs.split(",")] == list(ZOOLOGY_LRS) and args.points == "64x4"
    assert parser.parse_args(["--point", "128x8"]).points == "128x8"
    flags = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(RecallConfig)} - flags == {"seq_len", "num_pairs", "lr"}


def test_every_recall_model_has_untied_output_embeddings():
    """Tied, the bilinear stack's 2-layer attention model stayed at 1 / pairs where Llama (untied) recalled: every
    model is built alike, with its own output matrix."""
    config = RecallConfig(**TINY)
    for name in RECALL_MODELS:
        model = recall_model(name, config)
        out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        assert out.data_ptr() != inp.data_ptr(), name


def test_only_the_neg_gated_deltanets_have_negative_eigenvalues():
    """``-neg`` names, and only they, build Gated DeltaNet with beta in [0, 2] (transition eigenvalues in [-1, 1])."""
    config = RecallConfig(**TINY)
    names = [name for name in RECALL_MODELS if name.startswith("gated_deltanet")]
    assert len(names) == 5
    for name in names:
        assert recall_model(name, config).config.allow_neg_eigval == name.endswith("-neg"), name


def test_state_floats_count_every_cached_tensor_per_layer():
    """Closed forms: Llama's keys and values (2 x length x width), an LSTM's h and c, and the memory-head model's
    tracking state, convolution windows, memory matrices and homogeneous coordinates; Gated DeltaNet's and Mamba2's
    states and convolution windows."""
    c = RecallConfig(**TINY)
    D, N, H = c.hidden_size, c.num_heads, c.state_size
    assert state_floats(recall_model("llama", c), c.seq_len) == 2 * c.seq_len * D
    assert state_floats(recall_model("lstm", c), c.seq_len) == 2 * D
    Dk = Dv = D // N  # recall_model's memory heads: num_heads of hidden / num_heads
    memory = N * (Dv * Dk + 1) + 3 * N * (2 * Dk + Dv)  # S, c and the memory's window of 3 positions
    assert state_floats(recall_model("bilinear-memory", c), c.seq_len) == N * H + 3 * D + memory
    assert state_floats(recall_model("bilinear", c), c.seq_len) == N * H
    # the peers as transformers caches them: the delta rule's N matrices of keys x values and the short convolution
    # of queries, keys and values (transformers keeps its whole width of 4); Mamba2's 2N heads of D/N x state 64 and
    # its convolution of x, B and C
    for name in ("gated_deltanet", "gated_deltanet-neg"):
        assert state_floats(recall_model(name, c), c.seq_len) == N * (D // (2 * N)) * (D // N) + (D // 2 * 2 + D) * 4
    # keys as wide as the values: the memory heads' N heads of D/N x D/N
    for name in ("gated_deltanet-square", "gated_deltanet-square-neg"):
        assert state_floats(recall_model(name, c), c.seq_len) == N * (D // N) ** 2 + (D * 3) * 4
    # Zoology's sizing: 2 heads of keys D/2 and values D (its Gated DeltaNet at width 64: 4,096 state floats)
    assert state_floats(recall_model("gated_deltanet-zoology", c), c.seq_len) == 2 * (D // 2) * D + (2 * D + 2 * D) * 4
    assert state_floats(recall_model("mamba2", c), c.seq_len) == 2 * N * (D // N) * 64 + (2 * D + 2 * 64) * 4


def test_zoologys_published_points_are_drawn_in_state_floats_per_layer():
    """Zoology's "state size" (model.py) is 4 bytes x the recurrent floats of its two layers: its Gated DeltaNet at
    width 64, a BaseConv layer (64 x 3) beside 2 heads of 32 x 64, is 4 x 4,288 = 17,152 (published: 17,000), which
    the plot draws at the mean over the layers, 2,144 floats, up to the figure's rounding."""
    from bilinear_lm.probes.report import ZOOLOGY_FLOATS_PER_LAYER, ZOOLOGY_PUBLISHED

    size = {name: size for name, size, _ in ZOOLOGY_PUBLISHED}["Gated DeltaNet"]
    assert size * ZOOLOGY_FLOATS_PER_LAYER == pytest.approx((64 * 3 + 2 * 32 * 64) / 2, rel=0.01)
