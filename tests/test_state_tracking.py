"""The state-tracking harness: training, length generalization, CLI, sweep outputs (tiny budgets)."""
import json

import pytest
import torch

from bilinear_lm.baselines import LSTMLanguageModel
from bilinear_lm.probes import make_task
from eval import state_tracking as st

TINY = ["--threads", "1", "--val-size", "50", "--test-size", "40", "--hidden-size", "8", "--state-size", "8",
        "--eval-every", "5"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is faster and robust to a loaded machine (2 threads oversubscribe it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def args_for(*argv):
    return st.build_parser().parse_args(list(argv))


def test_parity_bilinear_diagonal_generalizes_to_longer_sequences():
    """Minimal diagonal bilinear model, trained on lengths 2-10, is perfect at length 300 (val-based stopping)."""
    args = args_for("--hidden-size", "32", "--state-size", "16", "--steps", "600", "--eval-every", "50",
                    "--patience", "100", "--val-size", "200", "--test-size", "200", "--test-lengths", "100,300")
    r = st.run_probe(make_task("parity"), "bilinear-diagonal", 0, args, log=lambda *_: None)
    assert r["stop_reason"] == "val_perfect" and r["steps"] < 600
    assert r["best_val_acc"] == 1.0
    for L in ("100", "300"):
        assert r["test"][L]["final_acc"] == 1.0
        assert r["test"][L]["beyond_train_acc"] == 1.0
        assert r["test"][L]["final_acc_norm"] == 1.0


def test_chunked_evaluation_matches_one_batch():
    torch.manual_seed(0)
    task = make_task("cycle_navigation", 4)
    model = LSTMLanguageModel(max(task.vocab_size, task.num_classes), 8)
    x, y = task.sample(13, 17, torch.Generator().manual_seed(0))
    acc1, loss1 = st.evaluate(model, x, y, task.num_classes, eval_tokens=10 ** 6)
    acc2, loss2 = st.evaluate(model, x, y, task.num_classes, eval_tokens=17 * 3)  # chunks of 3 sequences
    assert torch.allclose(acc1, acc2) and abs(loss1 - loss2) < 1e-6
    logits = model(input_ids=x).logits[..., :task.num_classes]
    assert torch.allclose(acc1, (logits.argmax(-1) == y).double().mean(0))


@pytest.mark.parametrize("mixer", st.BILINEAR_MIXERS)
def test_every_bilinear_mixer_builds_as_the_minimal_model(mixer):
    task = make_task("modular_arithmetic", 3)
    model, cfg = st.build_model(f"bilinear-{mixer}", task, args_for(*TINY))
    assert type(model).__name__ == "BilinearForCausalLM"
    assert model.config.num_hidden_layers == 1 and model.config.use_mlp is False
    assert model.config.mixer_type == mixer and cfg["vocab_size"] == task.vocab_size
    if mixer == "full":
        assert model.config.rank == task.vocab_size
    x, _ = task.sample(2, 7)
    assert st.class_logits(model, x, task.num_classes).shape == (2, 7, task.num_classes)
    assert model.config.use_gate is False  # the paper's linear readout
    assert st.build_model(f"bilinear-{mixer}", task, args_for(*TINY, "--gate"))[0].config.use_gate is True


def test_cli_single_run_writes_results_json(tmp_path):
    out = tmp_path / "r.json"
    st.main(["--task", "modular_addition", "--m", "3", "--model", "lstm", "--steps", "20",
             "--test-lengths", "30,50", "--output", str(out), *TINY])
    (r,) = json.loads(out.read_text())["runs"]
    assert (r["task"], r["m"], r["model"], r["steps"], r["stop_reason"]) == ("modular_addition", 3, "lstm", 20, "steps")
    assert r["seconds"] >= 0 and r["num_params"] > 0 and r["train_lengths"] == [2, 10]
    assert r["chance"] == pytest.approx(1 / 3)
    assert r["best_val_acc"] == pytest.approx(max(h["val_acc"] for h in r["history"]), abs=1e-5)   # selected on validation, not training
    for L in (30, 50):
        te = r["test"][str(L)]
        assert len(te["per_position_acc"]) == L
        assert te["final_acc"] == pytest.approx(te["per_position_acc"][-1], abs=1e-4)
        assert te["beyond_train_acc"] == pytest.approx(sum(te["per_position_acc"][10:]) / (L - 10), abs=1e-3)
        assert te["final_acc_norm"] == pytest.approx((te["final_acc"] - 1 / 3) / (2 / 3))


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
    with pytest.raises(SystemExit, match="no results file at"):
        st.main(["--report", str(tmp_path / "missing.json"), "--output-dir", str(merged)])


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
    got = st.state_consistency_loss(states, labels, C)
    assert torch.allclose(got, torch.stack(expected).mean())
    # Same direction within each class at any positive scale: zero. A sign flip is penalized.
    protos = torch.randn(C, N, H, dtype=torch.float64)
    scale = torch.rand(B, T, N, 1, dtype=torch.float64) + 0.1
    same = [protos[labels] * scale]
    assert st.state_consistency_loss(same, labels, C) < 1e-24
    flipped = same[0].clone()
    flipped[1, 2] *= -1
    assert st.state_consistency_loss([flipped], labels, C) > 1e-3


def test_state_consistency_hooks_capture_training_states_only():
    task = make_task("random_fsm", 4)
    args = args_for(*TINY)
    model, _ = st.build_model("bilinear-cp", task, args)
    captured = st.capture_training_states(model)
    x, y = task.sample(3, 6, torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=x)
    loss = st.state_consistency_loss(captured, y, task.num_classes)
    assert len(captured) == 1 and captured[0].shape == (3, 6, 1, 8) and captured[0].requires_grad
    loss.backward()
    mixer = model.model.layers[0].mixer
    for p in (mixer.W2, mixer.in_proj.weight, mixer.h0):  # through the scan, the input factors and the start state
        assert p.grad is not None and p.grad.abs().sum() > 0
    captured.clear()
    model.eval()
    with torch.no_grad():
        model(input_ids=x)
    assert captured == []


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
        st.state_consistency_loss([], torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="gradient checkpointing"):
        st.state_consistency_loss([torch.randn(2, 4, 1, 8)], torch.zeros(2, 3, dtype=torch.long), 4)


def test_runs_with_and_without_state_consistency_are_separate_rows():
    base = {"task": "parity", "task_params": {}, "model": "bilinear-cp", "seed": 0}
    a, b = dict(base), dict(base, state_consistency=5.0)
    assert st.run_key(a) != st.run_key(b)
    assert st.model_label(a) == "bilinear-cp" and st.model_label(b) == "bilinear-cp +consistency 5"
