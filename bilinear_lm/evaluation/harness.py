"""lm-evaluation-harness on an in-memory model (train.py ``--eval_lm_harness``: ``run_harness``).

    from bilinear_lm.evaluation.harness import run_lm_eval
    metrics = run_lm_eval(model, tokenizer, ["wikitext2_local", "lambada_openai_local"], limit=20)
    # {"wikitext2_local": {"word_perplexity": ..., "byte_perplexity": ..., "bits_per_byte": ...},
    #  "lambada_openai_local": {"acc": ..., "acc_stderr": ..., "perplexity": ..., "perplexity_stderr": ...}}

The offline task YAMLs shipped with the package (``TASKS_DIR`` = bilinear_lm/evaluation/lm_eval_tasks) are
always included. Equivalent stock CLI on a saved checkpoint (from the repo root; elsewhere pass ``TASKS_DIR``)::

    lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True --tasks wikitext2_local \
        --include_path bilinear_lm/evaluation/lm_eval_tasks --device cpu
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..utils import eval_mode

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"  # package data: wikitext2_local, lambada_openai_local, probes


def _summarize(results: dict) -> dict:
    """{task: {"metric,filter": v, "metric_stderr,filter": s, "alias": ...}} ->
    {task: {"metric": float, "metric_stderr": float}} (filter "none" dropped, other filters kept as suffix)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.items():
        clean = {}
        for key, value in metrics.items():
            if key == "alias" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name, _, filt = key.partition(",")
            if filt and filt != "none":
                name = f"{name},{filt}"
            clean[name] = float(value)
        out[task] = clean
    return out


def _task_manager(TaskManager, include_path, tasks):
    """Index only include_path when it holds every requested task (indexing lm-eval's ~15k built-in
    tasks costs ~15 s on a small CPU); otherwise index the built-ins too. Unknown names -> ValueError."""
    if include_path:
        tm = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(tm.all_tasks):
            return tm
    tm = TaskManager(include_path=include_path)
    missing = [t for t in tasks if t not in set(tm.all_tasks) and not Path(t).is_file()]
    if missing:
        raise ValueError(f"run_lm_eval: unknown lm-eval task(s) {missing}; the offline tasks are "
                         f"wikitext2_local, lambada_openai_local and the state_tracking_probes in "
                         f"{TASKS_DIR}")
    return tm


def run_lm_eval(model, tokenizer, tasks, limit: int | float | None = None, batch_size: int | str = 8,
                include_path: str | Path | list | None = None, max_length: int | None = None,
                num_fewshot: int | None = None, bootstrap_iters: int = 0, return_raw: bool = False,
                **simple_evaluate_kwargs: Any) -> dict:
    """Evaluate an in-memory ``PreTrainedModel`` + tokenizer with ``lm_eval.simple_evaluate``.

    tasks: task names (str with commas or list). limit: examples per task (int) or fraction (<1).
    include_path: task directories; default: ``TASKS_DIR`` (the offline tasks shipped with the package).
    max_length: HFLM context length (rolling-loglikelihood window; default from the model config, 2048
    when it has none). bootstrap_iters=0 skips bootstrap stderrs (fast; perplexity stderr then absent).
    Returns ``{task: {metric: value}}`` (metric names without the ",none" filter suffix); with
    ``return_raw=True`` the full ``simple_evaluate`` output instead. The model's train/eval mode is
    restored afterwards."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    tasks = list(tasks)
    if not tasks:
        raise ValueError("run_lm_eval: no tasks given (e.g. tasks=['wikitext2_local', 'lambada_openai_local'])")
    if tokenizer is None:
        raise ValueError("run_lm_eval: a tokenizer is required (the one the model was trained with)")
    if tokenizer.eos_token_id is None:
        raise ValueError("run_lm_eval: the tokenizer has no eos_token; lm-eval needs one (prefix/EOT token)")
    if include_path is None:
        include_path = str(TASKS_DIR)
    elif not isinstance(include_path, (list, tuple)):
        if not Path(include_path).exists():
            raise ValueError(f"run_lm_eval: include_path {include_path!r} does not exist")
        include_path = str(include_path)

    with eval_mode(model):
        hf_kwargs = {"pretrained": model, "tokenizer": tokenizer, "batch_size": batch_size if isinstance(batch_size, str) else int(batch_size)}
        if max_length is not None:
            hf_kwargs["max_length"] = int(max_length)
        lm = HFLM(**hf_kwargs)
        task_manager = _task_manager(TaskManager, include_path, tasks)
        out = simple_evaluate(model=lm, tasks=tasks, limit=limit, num_fewshot=num_fewshot,
                              bootstrap_iters=bootstrap_iters, task_manager=task_manager,
                              log_samples=False, **simple_evaluate_kwargs)
    if out is None:  # non-zero rank in distributed runs
        return {}
    if return_raw:
        return out
    return _summarize(out["results"])


def run_harness(model, tokenizer, tasks: str, limit: int | float | None, out_dir: Path) -> None:
    """``run_lm_eval`` on the comma-separated ``tasks`` (train.py's final model, ``--eval_lm_harness``), the results
    written to OUT_DIR/lm_harness.json."""
    tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    results = run_lm_eval(model, tokenizer, tasks, limit=limit)  # {task: {metric: value}}
    (out_dir / "lm_harness.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"lm-eval-harness results written to {out_dir / 'lm_harness.json'}")
