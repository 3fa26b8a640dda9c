"""The compiled CPU scan's build: visible, skippable, keyed on the toolchain, and never run when unused."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import bilinear_lm.kernels.cpu as cpu


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader with no module loaded yet, an empty extensions folder, and the compiler replaced by a stub that
    records its calls (no minute-long build)."""
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_failed", False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(cpu.DISABLE_ENV, raising=False)
    calls = []

    def fake_load(name, **kwargs):
        calls.append(name)
        return "built"

    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load)
    return calls


def test_a_build_says_so_in_one_line_and_a_cached_one_is_silent(fresh_loader, tmp_path, capsys):
    assert cpu.load() == "built"
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "compiling the C++ CPU kernels" in message and cpu.DISABLE_ENV in message
    name = fresh_loader[0]
    (tmp_path / name / f"{name}.so").touch()  # what a finished build leaves
    cpu._module = None
    assert cpu.load() == "built"
    assert capsys.readouterr().err == ""


def test_the_environment_switch_disables_the_build(fresh_loader, monkeypatch):
    from bilinear_lm.modeling import dispatch

    monkeypatch.setenv(cpu.DISABLE_ENV, "1")
    assert cpu.load() is None and fresh_loader == []
    monkeypatch.setattr(dispatch, "cpu_kernels_available", lambda: cpu.load() is not None)
    u = torch.ones(1, 5, 2, 3)
    assert dispatch.resolve_impl("auto", u, 3, 3) == "torch"
    with pytest.raises(RuntimeError, match=f"recurrence_impl='cpp' needs .*{cpu.DISABLE_ENV}=1"):
        dispatch.resolve_impl("cpp", u, 3, 3)


def test_the_cache_key_covers_compiler_and_ninja(monkeypatch):
    versions = {"c++": "g++ 12", "ninja": "1.11"}
    monkeypatch.setattr(cpu, "_version", lambda command: versions[command[0]])
    monkeypatch.delenv("CXX", raising=False)
    first = cpu.build_name()
    versions["ninja"] = "1.13"
    second = cpu.build_name()
    versions["c++"] = "clang 17"
    third = cpu.build_name()
    assert len({first, second, third}) == 3 and all(n.startswith("bilinear_cpu_kernels_") for n in (first, second, third))


def test_no_build_when_the_chosen_implementation_does_not_use_it(tmp_path, tiny_bilinear_config):
    """A fresh process with an empty extensions folder: training and decoding steps with ``recurrence_impl`` torch,
    then reference, compile nothing (nothing printed, nothing written)."""
    script = textwrap.dedent(f"""
        import torch
        import bilinear_lm.kernels.cpu as cpu
        from bilinear_lm import BilinearConfig, BilinearForCausalLM
        from bilinear_lm.modeling.transitions import build_kernels
        for impl in ("torch", "reference"):
            config = BilinearConfig(**{{**{tiny_bilinear_config.to_diff_dict()!r}, 'recurrence_impl': impl}})
            build_kernels(config, "cpu")
            model = BilinearForCausalLM(config)
            ids = torch.randint(0, config.vocab_size, (2, 20))
            model(ids, labels=ids).loss.backward()
            model.generate(ids[:, :3], max_new_tokens=3)
            assert cpu._module is None and not cpu._failed, impl
            print("ok", impl)
    """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout == "ok torch\nok reference\n", result.stderr[-2000:]
    assert "compiling" not in result.stderr and not (tmp_path / "ext").exists()


def test_decoding_projections_take_the_gemv_and_nothing_else_does(monkeypatch):
    """``dispatch.linear``: the GEMV equals the layer (fp64, output features not a multiple of its 4-row blocks) and
    is taken only by a plain, hook-free ``nn.Linear`` on at most 4 rows without gradients; it never builds."""
    from bilinear_lm.modeling import dispatch

    kernel = cpu.load()
    if kernel is None:
        pytest.skip("no C++ compiler here")
    calls = []

    class Spy:
        def small_batch_linear(self, x, w):
            calls.append(tuple(x.shape))
            return kernel.small_batch_linear(x, w)

    monkeypatch.setattr(dispatch, "loaded_cpu_kernels", Spy)
    layer = torch.nn.Linear(37, 23, bias=False).double()
    x = torch.randn(3, 1, 37, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(dispatch.linear(layer, x), x @ layer.weight.T, rtol=1e-12, atol=1e-12)
        assert calls == [(3, 37)]
        dispatch.linear(layer, torch.randn(5, 37, dtype=torch.float64))  # five rows: not a decoding step
        dispatch.linear(type("Adapter", (torch.nn.Linear,), {})(37, 23, bias=False).double(), x)  # not a plain Linear
        handle = layer.register_forward_hook(lambda *args: None)
        dispatch.linear(layer, x)  # a hook must run
        handle.remove()
    dispatch.linear(layer, x)  # gradients on: training
    assert calls == [(3, 37)]
