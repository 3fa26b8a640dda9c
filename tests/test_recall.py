"""MQAR data against a per-example loop, the sweep CLI, and query accuracy against a hand count."""
import dataclasses
import json

import pytest
import torch

from bilinear_lm.probes import recall
from bilinear_lm.probes.recall import (IGNORE, RECALL_MODELS, RecallConfig, held_out_set, mqar, query_accuracy,
                                       recall_model, train_batch)
from bilinear_lm.probes.report import recall_table


def test_mqar_labels_are_the_values_of_the_queried_keys():
    tokens, labels = mqar(50, 40, 6, 64, torch.Generator().manual_seed(0))
    for x, y in zip(tokens.tolist(), labels.tolist()):
        pairs = dict(zip(x[0:12:2], x[1:12:2]))
        assert len(pairs) == 6 and all(1 <= k < 32 <= v < 64 for k, v in pairs.items())  # distinct keys, halves
        asked = [(t, label) for t, label in enumerate(y) if label != IGNORE]
        assert sorted(x[t] for t, _ in asked) == sorted(pairs)  # every key asked once, after the pairs
        assert all(t >= 12 and label == pairs[x[t]] for t, label in asked)
        assert all(x[t] == 0 for t in range(12, 40) if y[t] == IGNORE)
    again, _ = mqar(50, 40, 6, 64, torch.Generator().manual_seed(0))
    assert torch.equal(again, tokens)


def test_dense_training_sequences_query_every_position_after_the_pairs_and_the_test_set_stays_plain():
    config = RecallConfig(vocab_size=64, seq_len=40, num_pairs=6, batch_size=400, dense_fraction=0.5, test_size=50)
    tokens, labels = train_batch(config, torch.Generator().manual_seed(0))
    dense = 0
    for x, y in zip(tokens.tolist(), labels.tolist()):
        pairs = dict(zip(x[0:12:2], x[1:12:2]))
        asked = [(t, label) for t, label in enumerate(y) if label != IGNORE]
        assert all(t >= 12 and label == pairs[x[t]] for t, label in asked)  # every answer is its key's value
        assert set(x[t] for t, _ in asked) == set(pairs)  # every key asked at least once
        if len(asked) == 40 - 12:  # dense: a query at every position after the pairs
            dense += 1
        else:  # plain: each key once, token 0 elsewhere
            assert len(asked) == 6 and all(x[t] == 0 for t in range(12, 40) if y[t] == IGNORE)
    assert 160 < dense < 240  # about half of 400
    all_dense = train_batch(dataclasses.replace(config, dense_fraction=1.0), torch.Generator().manual_seed(0))[1]
    assert ((all_dense[:, 12:] != IGNORE).all() and (all_dense[:, :12] == IGNORE).all())
    plain = train_batch(dataclasses.replace(config, dense_fraction=0.0), torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(plain, mqar(400, 40, 6, 64, torch.Generator().manual_seed(0))))
    # the held-out set is plain MQAR, the same with or without dense training
    test = held_out_set(config, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(test, held_out_set(dataclasses.replace(config, dense_fraction=0.0),
                                                                     seed=3)))
    assert ((test[1] != IGNORE).sum(1) == 6).all()


def test_run_recall_trains_on_dense_batches_and_tests_on_plain_ones(monkeypatch):
    seen = []  # (dense argument, answers per sequence) of every mqar call of the run

    def recording_mqar(*args, dense=0.0, **kwargs):
        tokens, labels = mqar(*args, dense=dense, **kwargs)
        seen.append((dense, sorted(set((labels != IGNORE).sum(1).tolist()))))
        return tokens, labels

    monkeypatch.setattr(recall, "mqar", recording_mqar)
    config = RecallConfig(vocab_size=32, seq_len=16, num_pairs=2, steps=2, batch_size=4, test_size=4, hidden_size=16,
                          num_layers=1, dense_fraction=1.0)
    logged = []
    result = recall.run_recall("lstm", config, log=logged.append, log_every=1)
    assert seen == [(0.0, [2]), (1.0, [12]), (1.0, [12])]  # the test set first, then 2 dense training batches
    # log_every=1: a line per step, the last with the loss the result records, then the result's line
    assert [line.split(":")[0] for line in logged[:2]] == ["lstm step 1/2", "lstm step 2/2"]
    assert f"training loss {result['train_loss']:.4f}" in logged[1] and "test acc" in logged[2]


def test_mqar_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="3 \\* num_pairs <= seq_len"):
        mqar(1, 10, 4, 64)
    with pytest.raises(ValueError, match="raise vocab_size"):
        mqar(1, 64, 20, 16)
    with pytest.raises(ValueError, match="RecallConfig.steps"):
        RecallConfig(steps=0)
    with pytest.raises(ValueError, match="RecallConfig.dense_fraction"):
        RecallConfig(dense_fraction=1.5)
    with pytest.raises(ValueError, match="unknown recall model"):
        recall_model("bilinear-lstm", RecallConfig())


def test_query_accuracy_counts_only_queries():
    class Oracle(torch.nn.Module):  # right at the first half of the queries of every row, wrong elsewhere
        def forward(self, input_ids):
            logits = torch.zeros(*input_ids.shape, 64)
            for b, row in enumerate(self.labels):
                asked = (row != IGNORE).nonzero().flatten()
                for t in asked[: len(asked) // 2]:
                    logits[b, t, row[t]] = 1.0
                logits[b, :, 0] = 0.5  # the argmax elsewhere: token 0, never a value
            return type("Out", (), {"logits": logits})

    tokens, labels = mqar(3, 30, 4, 64, torch.Generator().manual_seed(1))
    oracle = Oracle()
    oracle.labels = labels
    assert query_accuracy(oracle, tokens, labels) == pytest.approx(0.5)


def test_recall_sweep_cli_writes_results_and_a_table(tmp_path):
    from bilinear_lm.probes.recall_cli import main

    args = ["--models", "bilinear-conv,lstm", "--pairs", "2", "--seq-len", "16", "--steps", "2",
            "--test-size", "4", "--vocab-size", "32", "--hidden-size", "16",
            "--state-size", "4", "--num-heads", "2", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [r["model"] for r in runs] == ["bilinear-conv", "lstm"]
    assert "| bilinear-conv |" in (tmp_path / "table.md").read_text()
    assert main(args) == 0 and json.loads((tmp_path / "results.json").read_text()) == runs  # resumed, not rerun
    assert main([*args, "--steps", "3", "--models", "lstm"]) == 0  # other settings: a new run
    again = json.loads((tmp_path / "results.json").read_text())
    assert again[:2] == runs and [(r["model"], r["steps"]) for r in again[2:]] == [("lstm", 3)]


def test_recall_cli_flags_are_the_config_fields():
    """Every RecallConfig field but the grid's num_pairs (``--pairs``) is a flag with the field's default (``--lr``
    a list: the sweep's, see below)."""
    import dataclasses

    from bilinear_lm.probes.cli import config_from_args
    from bilinear_lm.probes.recall_cli import build_parser

    args = build_parser().parse_args([])
    assert config_from_args(RecallConfig, args, num_pairs=8) == RecallConfig()
    args = build_parser().parse_args(["--seq-len", "32", "--state-size", "8"])
    assert config_from_args(RecallConfig, args, num_pairs=2, lr=0.01) == RecallConfig(seq_len=32, lr=0.01,
                                                                                    state_size=8, num_pairs=2)
    flags = {a.dest for a in build_parser()._actions}
    assert {f.name for f in dataclasses.fields(RecallConfig)} - flags == {"num_pairs"}
    args = build_parser().parse_args(["--extra", '{"conv_width": 2}'])
    assert config_from_args(RecallConfig, args).extra == {"conv_width": 2}


def test_recall_lr_sweep_reports_the_best_lr_per_model_and_pairs(tmp_path):
    from bilinear_lm.probes.recall_cli import main

    assert main(["--models", "lstm", "--pairs", "1,2", "--seq-len", "8", "--steps", "2", "--test-size", "4",
                 "--vocab-size", "16", "--hidden-size", "8", "--lr", "1e-3,1e-2", "--output-dir", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [(r["num_pairs"], r["lr"]) for r in runs] == [(1, 1e-3), (1, 1e-2), (2, 1e-3), (2, 1e-2)]
    runs[0]["test_acc"], runs[1]["test_acc"], runs[2]["test_acc"], runs[3]["test_acc"] = 0.5, 0.25, 0.125, 1.0
    assert recall_table(runs).splitlines()[2].endswith("| 0.500 (lr 0.001) | 1.000 (lr 0.01) |")
    runs += [dict(r, seed=1, test_acc=0.0) for r in runs]  # seed 1: best lr 1e-3 at 2 pairs
    assert recall_table(runs).splitlines()[2].endswith("| 0.250 (lr 0.001) (n=2) | 0.500 (lr 0.001, 0.01) (n=2) |")


def test_every_recall_model_has_untied_output_embeddings():
    """Tied, the bilinear stack's 2-layer attention model stayed at 1 / pairs where Llama (untied) recalled: every
    model is built alike, with its own output matrix."""
    config = RecallConfig(num_pairs=2, seq_len=16, vocab_size=32, hidden_size=16, state_size=4, num_heads=2)
    for name in RECALL_MODELS:
        model = recall_model(name, config)
        out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        assert out.data_ptr() != inp.data_ptr(), name
