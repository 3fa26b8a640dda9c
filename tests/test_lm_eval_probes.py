"""The state-tracking probes as lm-eval tasks: documents checked by independent arithmetic, and an
end-to-end zero-shot run of a tiny bilinear model on all four."""
import re

import pytest
import torch

from bilinear_lm.evaluation.harness import run_lm_eval
from bilinear_lm.evaluation.lm_eval_tasks.state_tracking.state_tracking_utils import load_probe, render_probe
from fixtures import build_tiny_model, cached_tokenizer


def answer_from_text(task, m, sequence):
    """Solve the rendered sequence directly (no automaton): the expected answer string."""
    words = sequence.split(" ")
    if task == "parity":
        return str(words.count("1") % 2)
    if task == "modular_addition":
        return str(sum(map(int, words)) % m)
    if task == "cycle_navigation":
        return str(sum({"stay": 0, "+1": 1, "-1": -1}[w] for w in words) % m)
    perms = [tuple(map(int, p)) for p in re.findall(r"\((\d), (\d), (\d)\)", sequence)]
    result = (0, 1, 2)
    for p in perms:  # x_n o ... o x_1: apply x_1 first
        result = tuple(p[result[i]] for i in range(3))
    return str(result)


@pytest.mark.parametrize("task,m", [("parity", None), ("modular_addition", 5), ("cycle_navigation", 5),
                                    ("permutation_S3", None)])
def test_rendered_documents_have_the_right_answer(task, m):
    docs = render_probe(task, m, length=15, num_examples=50, seed=3)
    for doc in docs:
        sequence = re.search(r"Sequence: (.*)\nAnswer:", doc["text"]).group(1)
        assert doc["choices"][doc["label"]].strip() == answer_from_text(task, m, sequence)
    assert len({d["label"] for d in docs}) > 1  # not a constant answer


def test_unknown_probe_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown probe"):
        load_probe(task="tower_of_hanoi")


@torch.no_grad()
def zero_shot_accuracy(model, tokenizer, docs):
    """Multiple choice by hand, one model call per choice: the choice (after lm-eval's target delimiter " ") with
    the highest summed log-probability given the text, the continuation tokens being those the text + choice
    tokenization adds after the text's own tokens."""
    hits = 0
    for doc in docs:
        context = tokenizer(doc["text"]).input_ids
        scores = []
        for choice in doc["choices"]:
            continuation = tokenizer(doc["text"] + " " + choice).input_ids[len(context):]
            ids = torch.tensor([context + continuation])
            logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
            scores.append(sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(continuation)))
        hits += max(range(len(scores)), key=scores.__getitem__) == doc["label"]
    return hits / len(docs)


def test_zero_shot_probe_tasks_run_end_to_end():
    """lm-eval's accuracy on the first 4 documents of each probe (the YAMLs' metadata) equals the one computed by
    hand from the same documents."""
    tokenizer = cached_tokenizer()
    model = build_tiny_model("bilinear", len(tokenizer))
    results = run_lm_eval(model, tokenizer, ["state_tracking_probes"], limit=4, batch_size=4)
    probes = {"probe_parity": ("parity", None), "probe_modular_addition": ("modular_addition", 5),
              "probe_cycle_navigation": ("cycle_navigation", 5), "probe_permutation_S3": ("permutation_S3", None)}
    assert set(probes) <= set(results)
    for name, (task, m) in probes.items():
        docs = render_probe(task, m, length=20, num_examples=200, seed=0)[:4]
        assert results[name]["acc"] == zero_shot_accuracy(model, tokenizer, docs), name
