"""``autotp::fp8_cast_transpose`` (``autotp.ir.fp8_cast``): the one-pass cast of delayed
scaling. On the CPU the op is its aten reference: the tests check its values against
``fp8.cast`` and the delayed recipe through it against the recipe without it, bit for bit.
On a GPU with Triton the Triton kernels must equal the reference bit for bit, eager and
under ``torch.compile``."""

from __future__ import annotations

import pytest
import torch

import autotp.runtime.processes.collectives  # noqa: F401 - registers the ops' kernels
from autotp.ir import fp8, fp8_cast, fp8_delayed, ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DELAYED = "tensorwise-delayed"


def _inputs(device: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.dtype, int]]:
    """(t, window, dtype, cols multiple): 300 rows (no multiple of 16), a transposed view, an
    empty window (seeding) and a window below this step's amax (values saturate)."""
    torch.manual_seed(0)
    t = (torch.randn(300, 512) * 3).to(torch.bfloat16).to(device)
    tt = (torch.randn(384, 200) / 7).to(torch.bfloat16).to(device).t()
    zero, small = torch.zeros(1, 1, device=device), torch.full((1, 1), 2.0, device=device)
    return [(t, zero, E4M3, 16), (t, small, E4M3, 16), (tt, zero, E5M2, 1), (tt, small / 50, E5M2, 16), (t.float(), small, E4M3, 1)]


def _check(outs: tuple[torch.Tensor, ...], t: torch.Tensor, window: torch.Tensor, dtype: torch.dtype, multiple: int) -> None:
    q, qt, inv, amax = outs
    expected_q, expected_inv = fp8.cast(t, fp8_cast.used_amax(t, window), dtype, fp8.WHOLE, False)
    m = t.shape[0]
    assert q.dtype == qt.dtype == dtype and qt.shape == (t.shape[1], -(-m // multiple) * multiple)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(qt[:, :m].view(torch.uint8), expected_q.t().view(torch.uint8))
    assert not qt[:, m:].view(torch.uint8).any()
    assert torch.equal(inv, expected_inv) and torch.equal(amax, t.float().abs().amax().reshape(1, 1))


def test_op_is_the_cast_its_transpose_and_the_amax() -> None:
    for t, window, dtype, multiple in _inputs("cpu"):
        _check(fp8_cast.CAST_TRANSPOSE(t, window, dtype, multiple), t, window, dtype, multiple)


def _delayed_steps(one_pass: bool, device: str = "cpu", steps: int = 3) -> list[torch.Tensor]:
    """Three steps of a two-weight delayed op (one bias), gains that grow and shrink: outputs,
    grads and the history after each."""
    torch.manual_seed(0)
    w1, w2, b2 = torch.randn(48, 32, device=device) / 10, torch.randn(64, 32, device=device) / 10, torch.randn(64, device=device)
    history = fp8_delayed.new_history(2, 2, torch.device(device))
    results = []
    with fp8_cast.fused(one_pass):
        for gain in (1.0, 4.0, 0.25)[:steps]:
            x = (torch.randn(2, 20, 32, device=device) * gain).requires_grad_()
            params = [p.clone().requires_grad_() for p in (w1, w2, b2)]
            y1, y2 = ops.FP8_LINEAR(x, params[:2], [None, params[2]], DELAYED, 0, [0, 0], -1, 1, "", history)
            grads = torch.autograd.grad([y1, y2], [x, *params], [torch.randn_like(y1) * gain, torch.randn_like(y2)])
            results += [y1, y2, *grads, history.clone()]
    return results


def test_delayed_recipe_through_the_op_equals_it_without() -> None:
    for a, b in zip(_delayed_steps(True), _delayed_steps(False), strict=True):
        assert torch.equal(a, b)


def test_one_pass_is_used_only_without_an_amax_to_reduce() -> None:
    """A split operand's amax is max-reduced over the group before it is recorded: those calls
    keep the cast of ``fp8.cast``."""
    history = torch.zeros(2, 3)
    with fp8_cast.fused(True):
        assert not fp8._one_pass(fp8.call_of(DELAYED, fp8.X_ROWS, [0], -1, 2, "tp"), history)
        assert fp8._one_pass(fp8.call_of(DELAYED, 0, [0], -1, 2, "tp"), history)
        assert fp8._one_pass(fp8.call_of(DELAYED, fp8.X_ROWS, [1], -1, 1, ""), history)
        assert not fp8._one_pass(fp8.call_of("tensorwise", 0, [0], -1, 1, ""), None)
    assert not fp8._one_pass(fp8.call_of(DELAYED, 0, [0], -1, 1, ""), history)  # off by default


HAS_TRITON = fp8_cast.triton is not None and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("compiled", [False, True])
def test_triton_kernels_equal_the_reference(compiled: bool) -> None:
    def op(*args):
        return fp8_cast.CAST_TRANSPOSE(*args)

    op = torch.compile(op, fullgraph=True) if compiled else op
    for t, window, dtype, multiple in _inputs("cuda"):
        outs = op(t, window, dtype, multiple)
        expected = fp8_cast.reference(t, window, dtype, multiple)
        for a, e in zip(outs, expected, strict=True):
            assert a.shape == e.shape and torch.equal(a.view(torch.uint8) if a.dtype in (E4M3, E5M2) else a,
                                                      e.view(torch.uint8) if e.dtype in (E4M3, E5M2) else e)  # fmt: skip
        _check(outs, t, window, dtype, multiple)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA and Triton")
def test_delayed_recipe_through_the_triton_op_equals_it_without_on_cuda() -> None:
    for a, b in zip(_delayed_steps(True, "cuda"), _delayed_steps(False, "cuda"), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kernel_compiles_for_hopper_with_inductors_float64_scalar() -> None:
    """Inductor passes a Python float to a user kernel as float64 (Triton's launcher as
    float32); the kernel must compile either way (an H200 run failed on it: ``div_rn`` takes
    float32 only). Triton's compiler needs no GPU for this."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for limit in ("fp32", "fp64"):
        sig = {"t_ptr": "*bf16", "window_ptr": "*fp32", "seed_ptr": "*fp32", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv",
               "inv_ptr": "*fp32", "amax_ptr": "*fp32", "M": "i32", "N": "i32", "Mp": "i32", "stride_m": "i32",
               "stride_n": "i32", "limit": limit, "BM": "constexpr", "BN": "constexpr"}  # fmt: skip
        src = ASTSource(fp8_cast._cast_transpose_kernel.fn, signature=sig, constexprs={"BM": 64, "BN": 64})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ptx.count("div.rn.f32") == 2
