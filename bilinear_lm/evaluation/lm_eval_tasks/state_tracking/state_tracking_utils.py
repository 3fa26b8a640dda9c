"""Offline lm-eval datasets for the state-tracking probes, rendered as text for zero-shot scoring.

Each document is one probe sequence (symbols joined by spaces) with an instruction; the answer is the
class after the whole sequence (the final-position label of ``bilinear_lm.probes``), scored as multiple
choice over the task's class names. The task, ``m``, sequence ``length``, ``num_examples`` and ``seed`` come
from the YAML ``metadata`` (override with ``lm_eval --metadata '{"length": 50}'``).
"""
from __future__ import annotations

import torch

INSTRUCTIONS = {
    "parity": "Each symbol is a bit. Is the number of 1s even (0) or odd (1)?",
    "modular_addition": "Add the numbers modulo {m}. What is the sum?",
    "cycle_navigation": "Start at position 0 on a cycle of {m} positions and apply each move. Where do you end?",
    "permutation_S3": "Each permutation lists the images of 0, 1, 2. What is the composition x_n o ... o x_1 "
                      "of the sequence x_1 ... x_n?",
}


def render_probe(task_name: str, m: int | None, length: int, num_examples: int, seed: int) -> list[dict]:
    """Probe sequences as lm-eval documents: ``{"text", "choices", "label"}``."""
    from bilinear_lm.probes import make_task

    task = make_task(task_name, m)
    tokens, labels = task.sample(num_examples, length, generator=torch.Generator().manual_seed(seed))
    names = task.automaton.symbol_names
    # permutation classes are the group elements themselves (label = state), named like the symbols
    classes = task.automaton.state_names if task_name.startswith("permutation") else task.automaton.class_names
    instruction = INSTRUCTIONS[task_name].format(m=m)
    return [
        {"text": f"{instruction}\nSequence: {' '.join(names[s] for s in row)}\nAnswer:",
         "choices": [f" {c}" for c in classes], "label": int(label[-1])}
        for row, label in zip(tokens.tolist(), labels)
    ]


def load_probe(task: str, length: int = 20, num_examples: int = 200, seed: int = 0, m: int | None = None,
               **kwargs):
    """custom_dataset for the probe tasks: a DatasetDict with one ``test`` split."""
    import datasets

    if task not in INSTRUCTIONS:
        raise ValueError(f"state-tracking lm-eval task: unknown probe {task!r}; choose from {sorted(INSTRUCTIONS)}")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(render_probe(task, m, length, num_examples, seed))})
