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


def _fused_and_reference(monkeypatch, fn, *inputs):
    """``fn(*inputs)`` and its gradients by the C++ kernels, then by the PyTorch formulas (no kernels loaded)."""
    from bilinear_lm.modeling import dispatch

    results = []
    for kernels in (cpu.load, None):
        monkeypatch.setattr(dispatch, "loaded_cpu_kernels", kernels)
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype))
        results.append([out, *(x.grad for x in leaves)])
    return results


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-6)])
def test_fused_blocks_equal_the_pytorch_formulas(monkeypatch, dtype, tol):
    """SwiGLU, RMSNorm and the per-head state norm (forward and every gradient) by the C++ kernels against the
    PyTorch formulas: odd widths, a strided input (the mixer's states are a permuted view), large gate values
    (the vectorized exp's clamp); and a zero state normalizes to zeros, not NaN (the norm's floor)."""
    import torch.nn.functional as F

    from bilinear_lm.modeling import dispatch

    if cpu.load() is None:
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 5, 2 * 37, generator=g, dtype=dtype) * 4
    gate_up[0, 0, :3] = torch.tensor([-120.0, 95.0, 0.0])
    x, weight = torch.randn(3, 5, 33, generator=g, dtype=dtype), torch.randn(33, generator=g, dtype=dtype)
    h = torch.randn(5, 3, 4, 9, generator=g, dtype=dtype).permute(1, 0, 2, 3)
    head_weight = torch.randn(4, 9, generator=g, dtype=dtype)
    for name, fn, inputs in (("swiglu", lambda t: dispatch.swiglu(t, F.silu), (gate_up,)),
                             ("rms_norm", lambda a, w: dispatch.rms_norm(a, w, 1e-5), (x, weight)),
                             ("state_norm", dispatch.state_norm, (h, head_weight))):
        fused, reference = _fused_and_reference(monkeypatch, fn, *inputs)
        for i, (a, b) in enumerate(zip(fused, reference)):
            assert ((a - b).abs().max() / b.abs().max()).item() < tol, (name, i)
    h[0, 0, 1] = 0
    assert torch.equal(dispatch.state_norm(h, head_weight)[0, 0, 1], torch.zeros(9, dtype=dtype))


def test_fused_ops_and_the_gemv_pass_opcheck():
    """The fused blocks' custom ops and the GEMV's: schema, autograd registration, fake implementations equal to the
    real outputs."""
    from bilinear_lm.modeling import dispatch

    if cpu.load() is None:
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(dispatch._swiglu, (gate_up,))
    torch.library.opcheck(dispatch._swiglu_backward, (gate_up.detach(), torch.randn(4, 3, dtype=torch.float64)))
    torch.library.opcheck(dispatch._rms_norm, (x, weight, 1e-5, 0.0))
    rstd = dispatch._rms_norm(x.detach(), weight.detach(), 0.0, 1e-3)[1]
    torch.library.opcheck(dispatch._rms_norm_backward, (torch.randn_like(x), x.detach(), weight.detach(), rstd, 1e-3))
    rows, w = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64)
    torch.library.opcheck(dispatch._small_batch_linear, (rows, w))
    torch.testing.assert_close(dispatch._small_batch_linear(rows, w), rows @ w.T, rtol=1e-13, atol=1e-13)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of the C++ kernels' functions that ``bilinear_lm.modeling.dispatch`` calls, recorded (the kernels
    loaded, skipped without a compiler)."""
    from bilinear_lm.modeling import dispatch

    kernel = cpu.load()
    if kernel is None:
        pytest.skip("no C++ compiler here")
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(kernel, name)

    monkeypatch.setattr(dispatch, "loaded_cpu_kernels", Spy)
    return calls


def test_fused_blocks_run_only_on_eager_cpu_fp32_fp64_silu(kernel_calls):
    """The fused ops take CPU fp32/fp64 tensors of one dtype with SiLU, eagerly; bf16, mixed dtypes, another
    activation or a compiled graph (Inductor fuses the PyTorch ops itself) run the PyTorch formulas."""
    import torch.nn.functional as F

    from bilinear_lm.modeling import dispatch

    calls = kernel_calls
    x, weight = torch.randn(2, 8), torch.ones(8)
    dispatch.swiglu(x, F.silu), dispatch.rms_norm(x, weight, 1e-5), dispatch.state_norm(x[:, None], weight[None])
    assert calls == ["swiglu_forward", "rms_norm_forward", "rms_norm_forward"]
    calls.clear()
    dispatch.swiglu(x, F.gelu), dispatch.swiglu(x.bfloat16(), F.silu)
    dispatch.rms_norm(x.bfloat16(), weight, 1e-5), dispatch.rms_norm(x.double(), weight, 1e-5)
    torch.compile(lambda t: dispatch.swiglu(t, F.silu) + dispatch.rms_norm(t[:, :4], weight[:4], 1e-5),
                  backend="eager", fullgraph=True)(x)
    assert calls == []


@pytest.mark.parametrize("gemv", [False, True])
def test_a_compiled_steps_projection_calls_the_gemv_op_exactly_where_chosen(gemv, kernel_calls, monkeypatch):
    """``dispatch.linear`` in a compiled graph: the C++ GEMV as a custom op where ``GEMV_IN_COMPILED_STEPS`` (MKL's
    GEMV slow: non-Intel CPUs), else Inductor's own product; equal to ``F.linear`` either way (fp64), and the op runs
    only for a decoding step's few rows without gradients."""
    from bilinear_lm.modeling import dispatch

    calls = kernel_calls
    monkeypatch.setattr(dispatch, "GEMV_IN_COMPILED_STEPS", gemv)
    layer = torch.nn.Linear(37, 11, bias=False).double()
    x = torch.randn(2, 1, 37, dtype=torch.float64)
    torch._dynamo.reset()  # the flag and the spy are read while tracing
    compiled = torch.compile(lambda t: dispatch.linear(layer, t), fullgraph=True, dynamic=False)
    with torch.no_grad():
        got = compiled(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight), rtol=1e-13, atol=1e-13)
    assert ("small_batch_linear" in calls) == gemv
    calls.clear()
    assert compiled(x).requires_grad and not calls  # gradients: Inductor's product (a recompile)


def test_a_compile_interrupted_earlier_costs_the_next_run_seconds_not_forever(tmp_path):
    """A compile killed mid-way (Ctrl-C, a kill, out of memory) leaves torch's ``lock`` file in the build folder, and
    torch before 2.14 waits for as long as it exists. Here: a fresh ``TORCH_EXTENSIONS_DIR`` holding a copy of the
    built kernels and an hour-old lock; a new process loads the kernels within a minute (it hung forever before),
    saying on one line, on such a torch, which lock it removed and how old it was."""
    import re
    import shutil
    import time

    from torch.utils import cpp_extension

    if cpu.load() is None:
        pytest.skip("the C++ kernels do not build on this machine")
    name = cpu.build_name()
    shutil.copytree(cpp_extension._get_build_directory(name, False), tmp_path / name)
    lock = tmp_path / name / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    started = time.time()
    run = subprocess.run([sys.executable, "-c", "import bilinear_lm.kernels.cpu as cpu; assert cpu.load() is not None"],
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert time.time() - started < 60
    if hasattr(cpp_extension, "FileBaton"):  # torch < 2.14: the lock that would have hung
        assert re.search(rf"bilinear-lm: removed a stale build lock {re.escape(str(lock))} \(36\d\d s old", run.stderr), \
            run.stderr
    assert "compiling" not in run.stderr  # the copied build is used as it is
