"""The Triton scan against the PyTorch scan and the reference loop (on CPU under Triton's interpreter, which
conftest.py turns on when there is no GPU), and a compile check of the kernels for an H100 (sm_90)."""

import os
import re
import subprocess
import sys
import textwrap
from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from bilinear_lm.modeling import bilinear_scan as scan  # noqa: E402
from bilinear_lm.modeling import bilinear_scan_triton as scan_triton  # noqa: E402
from bilinear_lm.modeling.dispatch import cp_recurrence  # noqa: E402
from bilinear_lm.modeling.bilinear_reference import cp_transition, reference_recurrence  # noqa: E402


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# triton.compile of both kernels for an H100 (sm_90; ptxas ships with Triton, no GPU needed) at the padded ranks given
# as arguments, each kernel's ptxas log printed (TRITON_DUMP_PTXAS_LOG)
SM90_SCRIPT = textwrap.dedent("""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from bilinear_lm.modeling import bilinear_scan_triton as ts

    common = {"keep_ptr": "*i8", "restart_ptr": "*i8"}
    forward = {**{a: "*fp32" for a in ["u_ptr", "mt_ptr", "w1t_ptr", "p0_ptr", "p_start_ptr", "G_ptr", "P_ptr",
                                          "S_ptr"]},
               **common, **{a: "i32" for a in "T B R H chunk offset".split()}}
    backward = {**{a: "*fp32" for a in ["dG_ptr", "u_ptr", "S_ptr", "P_ptr", "p0_ptr", "p_start_ptr", "mtt_ptr",
                                          "du_ptr", "DP_ptr", "dp0_ptr", "dps_ptr"]},
                **common, **{a: "i32" for a in "T B R".split()}}
    for RP in map(int, sys.argv[1:]):
        flags = {"HAS_KEEP": True, "HAS_RESTART": True, "BLOCK_B": ts.BLOCK_B, "RP": RP,
                 "PRECISION": ts.dot_precision(RP)}
        for kernel, signature, consts in ((ts._forward_kernel, forward, {**flags, "HP": RP}),
                                          (ts._backward_kernel, backward, flags)):
            source = ASTSource(kernel, {**signature, **{k: "constexpr" for k in consts}}, consts)
            print("kernel", kernel.fn.__name__, RP, flush=True)
            triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": ts.num_warps(RP)})
    print("compiled")
""")


@pytest.fixture(scope="module", autouse=True)
def sm90_compile(tmp_path_factory):
    """SM90_SCRIPT at every padded rank the kernels use, in a process started at module start (the interpreter's
    tests run meanwhile), without TRITON_INTERPRET and with a fresh Triton cache (ptxas reruns)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-c", SM90_SCRIPT, "16", "32", "64", "128"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**env, "TRITON_DUMP_PTXAS_LOG": "1",
                                 "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton_cache"))})
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("T,B,R,H,chunk,offset,masked,restarts,scale,dtype", [
    (1, 3, 6, 6, 1, 0, False, False, 1.0, torch.float32),
    (21, 24, 6, 5, 4, 1, True, True, 1.0, torch.float64),  # two 16-row blocks, the second partial
    (33, 19, 7, 5, 4, 1, True, True, 1.0, torch.float64),  # B not a multiple of the 16-row block; R, H odd
    (65, 3, 20, 9, 16, 5, True, False, 1e4, torch.float64),  # every row overflows: the guard redoes segments
    (40, 5, 6, 6, 16, 0, False, True, 1e-4, torch.float64),  # every row underflows
    (33, 17, 18, 33, 0, 0, True, True, 1.0, torch.float32),  # no normalization; R, H past a power of two
])
def test_triton_scan_equals_the_pytorch_scan(T, B, R, H, chunk, offset, masked, restarts, scale, dtype):
    """Forward and backward loops, every output of each."""
    g = torch.Generator().manual_seed(T + B)
    N = 2
    u = ((1 + 0.5 * torch.randn(B, T, N, R, generator=g, dtype=dtype)) * scale).permute(1, 2, 0, 3)  # the mixer's
    W1 = torch.randn(N, H, R, generator=g, dtype=dtype) / R ** 0.5
    Mt = torch.einsum("nhr,nhs->nrs", W1, torch.randn(N, H, R, generator=g, dtype=dtype) / H ** 0.5).contiguous()
    p0 = torch.randn(N, B, R, generator=g, dtype=dtype)
    keep = torch.rand(T, B, generator=g) > 0.3 if masked else torch.empty(0, dtype=torch.bool)
    restart = torch.rand(T, B, generator=g) > 0.8 if restarts else torch.empty(0, dtype=torch.bool)
    if masked and restarts:
        restart &= keep
    p_start = torch.randn(N, R, generator=g, dtype=dtype) if restarts else torch.empty(0, dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    expected = scan.scan_forward(u, Mt, W1, keep, p0, chunk, offset, restart, p_start)
    got = scan_triton.scan_forward(u, Mt, W1, keep, p0, chunk, offset, restart, p_start)
    for name, a, b in zip("GPS", got, expected):
        assert relative_error(a, b) < tol and a.stride() == b.stride(), name
    _, P, S = expected
    dG = torch.randn(N, B, T, R, generator=g, dtype=dtype).permute(2, 0, 1, 3)  # the einsum's gradient
    MtT = Mt.transpose(1, 2).contiguous()
    expected = scan.scan_backward(dG, u, S, P, p0, p_start, MtT, keep, restart)
    got = scan_triton.scan_backward(dG, u, S, P, p0, p_start, MtT, keep, restart)
    for name, a, b in zip(["du", "DP", "dp0", "dp_start"], got, expected):
        assert relative_error(a, b) < tol and a.stride() == b.stride(), name


def test_triton_recurrence_equals_the_reference_loop_with_every_gradient():
    B, T, N, H, R = 3, 37, 2, 5, 7
    g = torch.Generator().manual_seed(0)
    u = (1 + 0.5 * torch.randn(B, T, N, R, generator=g, dtype=torch.float64)).requires_grad_()
    W1 = torch.randn(N, H, R, generator=g, dtype=torch.float64).div(R ** 0.5).requires_grad_()
    W2 = torch.randn(N, H, R, generator=g, dtype=torch.float64).div(H ** 0.5).requires_grad_()
    h0 = torch.randn(B, N, H, generator=g, dtype=torch.float64).requires_grad_()
    h_start = torch.randn(N, H, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :6] = 0
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[0, [4, 20]] = reset[2, 0] = True
    inputs = [u, W1, W2, h0, h_start]
    results = [f(u, W1, W2, h0, mask, 8, 3, reset=reset, h_start=h_start) for f in (
        partial(cp_recurrence, impl="triton"),
        lambda u, W1, W2, *args, **kw: reference_recurrence(partial(cp_transition, W1=W1, W2=W2), u, *args, **kw))]
    weights = torch.randn_like(results[0][0])
    grads = [torch.autograd.grad((s * weights).sum() + f.sum(), inputs) for s, f in results]
    assert relative_error(results[0][0], results[1][0]) < 1e-11
    for name, got, want in zip(["u", "W1", "W2", "h0", "h_start"], *grads):
        assert relative_error(got, want) < 1e-10, name


def test_explicit_triton_without_a_gpu_or_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    u = torch.ones(1, 4, 1, 2)
    with pytest.raises(RuntimeError, match="recurrence_impl='triton' needs CUDA tensors and Triton"):
        cp_recurrence(u, torch.ones(1, 2, 2), torch.ones(1, 2, 2), torch.ones(1, 2), impl="triton")


def test_kernels_compile_for_an_h100_without_register_spills(sm90_compile):
    """Both kernels at every padded rank compile for sm_90 and spill no register."""
    stdout, err = sm90_compile.communicate(timeout=300)
    assert sm90_compile.returncode == 0 and "compiled" in stdout, err[-3000:]
    kernels = re.findall(r"kernel (\w+) (\d+)", stdout)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", stdout)]
    assert len(spills) == len(kernels) == 8, stdout[-3000:]
    for (name, RP), spill in zip(kernels, spills):
        assert spill == 0, (name, RP, spill)
