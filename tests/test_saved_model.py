"""What train.py saves, read the way others read it: the final folder's tokenizer by AutoTokenizer in a process that
never imports bilinear_lm, and checkpoints of tied embeddings (saved without transformers' or Accelerate's warnings,
reloaded tied)."""
import json
import logging
import subprocess
import sys

import torch

from bilinear_lm import BilinearConfig, BilinearForCausalLM
from bilinear_lm.modeling.configuration_bilinear import interleaved_layer_types

SMALL = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_heads=2, state_size=4, rank=4)


def test_the_saved_tokenizer_loads_with_autotokenizer_where_bilinear_lm_is_not_imported(tmp_path):
    """transformers 5.23's AutoTokenizer reads the folder's config.json first; without the package (and without
    trust_remote_code) it reads it as a plain PreTrainedConfig, which refused the layer type "bilinear"
    (`layer_types` entries must be in (...)) before it looked at the tokenizer's files. A hybrid, attention layers
    included."""
    from datasets import Dataset

    from bilinear_lm.training import build_tokenizer

    text = "To be, or not to be, that is the question"
    tokenizer = build_tokenizer("bpe", Dataset.from_dict({"text": [text] * 20}), vocab_size=300)
    config = BilinearConfig(**{**SMALL, "vocab_size": len(tokenizer)}, num_attention_heads=2,
                            layer_types=interleaved_layer_types(2, 2))
    BilinearForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    script = ("import sys; from transformers import AutoTokenizer; "
              f"tok = AutoTokenizer.from_pretrained({str(tmp_path)!r}); "
              "assert 'bilinear_lm' not in sys.modules; "
              f"print('LOADED', len(tok), tok({text!r}).input_ids)")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"LOADED {len(tokenizer)} {tokenizer(text).input_ids}" in done.stdout
    assert json.loads((tmp_path / "config.json").read_text())["layer_types"] == ["linear_attention", "full_attention"]
    assert BilinearConfig.from_pretrained(tmp_path).layer_types == ["bilinear", "full_attention"]  # read back


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
