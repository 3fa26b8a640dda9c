"""What train.py saves besides metrics, read the way others read it: checkpoints of tied embeddings (saved without
Accelerate's warning, reloaded tied), the model card (README.md, read by huggingface_hub) and the closing summary."""
import logging
import os
from pathlib import Path

import pytest
import torch

from bilinear_lm import BilinearConfig, BilinearForCausalLM

SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_heads=2, state_size=4, rank=4)


def test_a_checkpoint_of_tied_embeddings_saves_without_a_warning_and_reloads_tied(tmp_path, caplog, capsys):
    """Accelerate's save_state warned "Removed shared tensor {'lm_head.weight'} ... check that you don't receive any
    warning while reloading" at every checkpoint: it drops every alias of a tensor it is given, and was given the
    state dict with both names of the tied weight. save_checkpoint gives it the state dict transformers would save
    (the tied copies the model declares, `all_tied_weights_keys`, left out); the reloaded model is tied again and
    equal."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from bilinear_lm.training import TrainState, save_checkpoint

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = accelerator.prepare(BilinearForCausalLM(BilinearConfig(**SMALL)))
        with caplog.at_level(logging.INFO):
            save_checkpoint(accelerator, str(tmp_path), TrainState(step=1), _NoTokenizer())
        printed = capsys.readouterr()
        assert "shared tensor" not in caplog.text + printed.out + printed.err
        from safetensors.torch import load_file

        saved = load_file(tmp_path / "checkpoints" / "step_1" / "model.safetensors")
        assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved

        torch.manual_seed(1)
        other = BilinearForCausalLM(BilinearConfig(**SMALL))
        assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
        accelerator._models = []
        other = accelerator.prepare(other)
        with caplog.at_level(logging.WARNING):
            accelerator.load_state(str(tmp_path / "checkpoints" / "step_1"))
        assert "missing" not in caplog.text.lower()
        assert other.lm_head.weight is other.model.embed_tokens.weight  # still tied
        for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
            assert torch.equal(a, b), name
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


class _NoTokenizer:
    def save_pretrained(self, path):
        path.mkdir(parents=True, exist_ok=True)


RECORDS = [{"step": 5, "loss": 3.5, "lr": 1e-3, "train_seconds": 2.0, "tokens_per_sec": 100.0, "epoch": 0},
           {"step": 10, "loss": 3.0, "lr": 1e-3, "train_seconds": 4.0, "tokens_per_sec": 100.0, "epoch": 0},
           {"step": 10, "train_seconds": 4.0, "val_loss": 3.1234, "val_ppl": 22.72, "peak_rss_mib": 900.0},
           {"step": 10, "final": True, "params_identical_across_ranks": True, "num_processes": 1, "n_params": 1234,
            "peak_rss_mib": 910.0}]


def test_the_model_card_is_a_hub_card_naming_the_real_metrics_and_how_to_load(tmp_path):
    """README.md next to the final model: huggingface_hub.ModelCard reads its metadata (library, pipeline tag, tags)
    and its text names the config, the data, the command, the final metrics, the versions and both ways to load."""
    import transformers
    from huggingface_hub import ModelCard

    import bilinear_lm
    from bilinear_lm.training import parse_config, write_model_card

    argv = ["--config", "bilinear_lm/configs/tiny.yaml", "--max_steps", "10", "--output_dir", str(tmp_path)]
    cfg = parse_config(argv)
    model = BilinearForCausalLM(BilinearConfig(**SMALL))
    write_model_card(tmp_path, cfg, model, 1234, RECORDS)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"bilinear-lm", "custom_code"} <= set(card.data.tags)
    text = card.text
    for expected in ("| validation loss | 3.1234 (step 10) |", "| validation perplexity | 22.72 |",
                     "| final training loss | 3.0000 (step 10) |", "| parameters | 1,234 ", "| hidden_size | 16 |",
                     "Tiny Shakespeare", "a byte-level BPE of 4096 tokens",
                     f"python train.py --config bilinear_lm/configs/tiny.yaml --max_steps 10 --output_dir {tmp_path}",
                     "from_pretrained(PATH, trust_remote_code=True)", "import bilinear_lm",
                     f"bilinear-lm {bilinear_lm.__version__}", f"transformers {transformers.__version__}"):
        assert expected in text, expected


def test_the_closing_summary_line_names_losses_time_throughput_memory_and_where_the_model_is(tmp_path):
    from bilinear_lm.training import peak_rss_mib, run_summary

    (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_10").mkdir()
    line = run_summary(RECORDS, 10, 4.0, 75.0, 10 * 1024, tmp_path)
    assert "\n" not in line and peak_rss_mib() > 0
    assert line.startswith("done: 10 steps in 1m15s (4.0s training, 2,560 tokens/s), train loss 3.0000, val loss "
                           "3.1234 (ppl 22.72, step 10), peak memory ")
    assert line.endswith(f" GiB RSS; model in {tmp_path}, checkpoints in {tmp_path / 'checkpoints'} (newest step_10)")
    assert "not evaluated" in run_summary(RECORDS[:2], 10, 4.0, 5.0, 10, tmp_path)


def test_a_saved_gated_deltanet_loads_without_the_package_by_its_card_and_in_the_perplexity_cli(tmp_path):
    """model_type "gated_deltanet" is ours, not transformers': its checkpoints (train.py --model_type
    gated_deltanet) did not load by `AutoModelForCausalLM.from_pretrained`, as the card said, nor in eval/perplexity.py
    or benchmarks/loss_by_position.py ("Transformers does not recognize this architecture"), nor in lm-eval's
    `--model hf` (no remote code). Now the folder holds the adapter as remote code: the card's code, run as written in
    a new interpreter where bilinear_lm cannot be imported, gives the saved model's logits and greedy continuation (the
    [-1, 1] form: its doubled beta is the adapter's), and the CLI its perplexity."""
    import json
    import re
    import subprocess
    import sys

    from huggingface_hub import ModelCard

    from bilinear_lm.baselines import build_model
    from bilinear_lm.evaluation.perplexity import evaluate_text
    from bilinear_lm.training import parse_config, write_model_card
    from fixtures import cached_tokenizer

    tokenizer = cached_tokenizer()
    torch.manual_seed(0)
    model = build_model("gated_deltanet", dict(hidden_size=32, num_hidden_layers=2, num_heads=2, state_size=8, rank=8,
                                               allow_neg_eigval=True), len(tokenizer)).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    cfg = parse_config(["--config", "bilinear_lm/configs/tiny.yaml", "--model_type", "gated_deltanet"])
    write_model_card(tmp_path, cfg, model, 1234, RECORDS)
    assert "custom_code" in ModelCard.load(tmp_path / "README.md").data.tags
    code = re.search(r"```python\n(.*?)```", (tmp_path / "README.md").read_text(), re.S).group(1)
    assert "trust_remote_code=True" in code and "bilinear_lm" not in code
    ids = tokenizer("To be, or not to be", return_tensors="pt").input_ids
    torch.save(ids, tmp_path / "ids.pt")
    code = code.replace("PATH", repr(str(tmp_path)))
    code = ('import sys\nsys.modules["bilinear_lm"] = None  # the package is not importable here\n' + code + (
        f"\nimport torch\nassert type(model).__module__.startswith('transformers_modules'), type(model).__module__\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        f"torch.save((model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False)), "
        f"{str(tmp_path / 'out.pt')!r})\n"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    logits, generated = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        assert torch.allclose(logits, model(ids).logits, atol=1e-6)
        assert torch.equal(generated, model.generate(ids, max_new_tokens=4, do_sample=False))

    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 3
    (tmp_path / "text.txt").write_text(text)
    cli = Path(__file__).parents[1] / "eval" / "perplexity.py"
    run = subprocess.run([sys.executable, str(cli), "--model", str(tmp_path), "--file", str(tmp_path / "text.txt"),
                          "--segment_len", "16", "--output", str(tmp_path / "ppl.json")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    scored = json.loads((tmp_path / "ppl.json").read_text())["results"]["streaming"]
    expected = evaluate_text(model, tokenizer, text, segment_len=16)["streaming"]
    assert scored["tokens"] == expected["tokens"]
    assert scored["nll"] == pytest.approx(expected["nll"], rel=1e-6)
