"""The field's formal-language tasks (Grazzi et al.'s protocol, bilinear_lm.probes.field_tasks) against Python's own
arithmetic, and the probe loop's handling of one label per sequence."""
import dataclasses

import pytest
import torch

from bilinear_lm.probes import ProbeConfig, evaluate, make_task, run_probe
from bilinear_lm.probes.field_tasks import IGNORE, SYMBOLS

ARITHMETIC = ("field_modular_arithmetic", "field_modular_arithmetic_brackets")


@pytest.mark.parametrize("name", ARITHMETIC)
def test_every_answer_is_pythons_value_of_the_expression_mod_5(name):
    """Independent reference: the expression as text, evaluated by Python (``*`` before ``+ -``, unary minus,
    brackets), then ``% 5``."""
    task = make_task(name)
    g = torch.Generator().manual_seed(0)
    operators = set()
    for length in (3, 5, 6, 9, 17, 40, 101):
        tokens, labels = task.sample(40, length, g)
        for row, answer in zip(tokens.tolist(), labels[:, -1].tolist()):
            text = " ".join(SYMBOLS[t] for t in row)
            assert text.endswith(" =")
            assert answer == eval(text[:-2]) % 5, text  # noqa: S307 (digits, + - * and brackets only)
            operators |= {t for t in text.split() if t in "+-*"}
    assert operators == {"+", "-", "*"}


def test_lengths_count_the_answer_and_only_the_last_position_is_labelled():
    """L counts the answer, as the field's generators do: parity reads L - 1 bits, the arithmetic tasks their
    expression and '=' (L - 2 tokens; without brackets L is odd, an even one taken as L - 1; with brackets L >= 5)."""
    expected = {"field_parity": lambda L: L - 1, "field_modular_arithmetic": lambda L: L - 1 - (L + 1) % 2,
                "field_modular_arithmetic_brackets": lambda L: max(L, 5) - 2}
    for name, width in expected.items():
        task = make_task(name)
        for length in (3, 4, 8, 40, 256):
            tokens, labels = task.sample(6, length, torch.Generator().manual_seed(length))
            assert tokens.shape == labels.shape == (6, width(length))
            assert (labels[:, :-1] == IGNORE).all() and labels[:, -1].ge(0).all()
            assert labels[:, -1].lt(task.num_classes).all() and tokens.lt(task.vocab_size).all()
    bits, labels = make_task("field_parity").sample(50, 12, torch.Generator().manual_seed(1))
    assert torch.equal(labels[:, -1], bits.sum(1) % 2)


def test_bracketed_expressions_are_balanced_and_every_open_bracket_closes():
    task = make_task("field_modular_arithmetic_brackets")
    tokens, _ = task.sample(200, 64, torch.Generator().manual_seed(2))
    for row in tokens.tolist():
        depth = 0
        for t in row:
            depth += (SYMBOLS[t] == "(") - (SYMBOLS[t] == ")")
            assert depth >= 0
        assert depth == 0


def test_one_label_per_sequence_trains_scores_only_the_answer_and_pools_the_scaled_accuracy():
    """evaluate scores the labelled positions only (NaN elsewhere), against a hand count; run_probe trains on the
    answers and reports the field's scaled accuracy: final-position accuracy pooled over the test lengths, each
    counted equally, chance-normalized."""
    task = make_task("field_modular_arithmetic")
    config = ProbeConfig(train_lengths=(3, 9), test_lengths=(11, 15), val_length=13, val_size=20, test_size=30,
                         hidden_size=8, state_size=8, steps=6, eval_every=3)
    torch.manual_seed(0)
    from bilinear_lm.probes import build_probe_model, class_logits

    model, _ = build_probe_model("bilinear-cp", task, config)
    tokens, labels = task.sample(30, 11, torch.Generator().manual_seed(3))
    accuracy, loss = evaluate(model, tokens, labels, task.num_classes)
    with torch.no_grad():
        logits = class_logits(model, tokens, task.num_classes)[:, -1]
    assert accuracy[:-1].isnan().all()
    assert float(accuracy[-1]) == pytest.approx(float((logits.argmax(-1) == labels[:, -1]).double().mean()))
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels[:, -1])), rel=1e-5)
    result = run_probe(task, "bilinear-cp", 0, config, log=lambda *_: None)
    finals = [result["test"][str(T)]["final_acc"] for T in (11, 15)]
    assert result["pooled_final_acc_norm"] == pytest.approx((sum(finals) / 2 - 0.2) / 0.8)
    from bilinear_lm.probes.report import markdown_table

    other = {**result, "seed": 1, "pooled_final_acc_norm": result["pooled_final_acc_norm"] - 0.5}
    best, mean = 100 * result["pooled_final_acc_norm"], 100 * (result["pooled_final_acc_norm"] - 0.25)
    assert f"| bilinear-cp | {best:.2f} ({mean:.2f}; 2) |" in markdown_table([result, other])
    with pytest.raises(ValueError, match="has no automaton"):
        run_probe(task, "bilinear-cp", 0, dataclasses.replace(config, state_consistency=1.0))


def test_test_lengths_take_ranges_on_the_command_line():
    from bilinear_lm.probes.cli import _int_list

    assert _int_list("40-256") == tuple(range(40, 257))
    assert _int_list("50,100-102,500") == (50, 100, 101, 102, 500)
