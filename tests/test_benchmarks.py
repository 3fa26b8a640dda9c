"""benchmarks/speed.py argument handling, with the timing replaced (no benchmark is run)."""
import pytest

from benchmarks import speed


@pytest.fixture
def untimed(monkeypatch):
    """A tiny size, one call per timed function (each "takes" 1 s), no matmul peak measurement."""
    monkeypatch.setitem(speed.SIZES, "tiny", dict(hidden_size=16, num_hidden_layers=1, num_heads=2,
                                                   state_size=4, rank=4))
    monkeypatch.setattr(speed, "timed", lambda fn, *args, **kwargs: (fn(), 1.0)[1])
    monkeypatch.setattr(speed, "matmul_peak", lambda dtype: 1e9)


@pytest.mark.parametrize("precisions", ["bf16", "fp32", "fp32,bf16"])
def test_train_part_with_any_precision_subset(untimed, precisions, capsys):
    speed.main(["--parts", "train", "--sizes", "tiny", "--models", "bilinear", "--seq-lens", "8",
                "--tokens-per-step", "16", "--precisions", precisions])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny | bilinear |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # | size | model | params | T | batch | fp32 tok/s | bf16 tok/s | bf16/fp32 | MFU | recurrence share |
    measured = precisions.split(",")
    assert cells[3:5] == ["8", "2"]
    assert cells[5] == ("16" if "fp32" in measured else "-")  # 2 x 8 tokens in one 1 s step
    assert cells[6] == ("16" if "bf16" in measured else "-")
    assert cells[7] == ("1.00x" if len(measured) == 2 else "-")
    assert (cells[9] == "-") == ("fp32" not in measured)  # the recurrence share is an fp32 measurement


@pytest.mark.parametrize("flag,value", [("--precisions", "fp16"), ("--parts", "trian"), ("--sizes", "1B"),
                                        ("--models", "gpt")])
def test_unknown_values_are_named(flag, value, capsys):
    with pytest.raises(SystemExit):
        speed.main([flag, value])
    err = capsys.readouterr().err
    assert f"{flag}: unknown value {value!r}" in err and "choose from" in err


def test_gpu_benchmark_says_it_needs_a_gpu(capsys, monkeypatch):
    from benchmarks import gpu

    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--parts", "scan"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.main(["--parts", "scan,warp"])
    assert "unknown ['warp']" in capsys.readouterr().err
