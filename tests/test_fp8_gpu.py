"""FP8 on a GPU with FP8 tensor cores: cuBLAS's FP8 GEMMs (operand layouts and scale layouts
per recipe) give the CPU kernels' numbers, and ``compile=True`` and ``cuda_graphs=True`` run
the FP8 model as eager does (amaxes stay on the device: no host sync blocks capture)."""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from autotp.ir import fp8_delayed, ops
from autotp.ir.errors import UserInputError
from test_fp8 import ReferenceFp8, assert_fp8_rendering, model_for

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(CAPABILITY < (8, 9), reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)"),
]
RECIPES = ["tensorwise", "rowwise"] + (["blockwise"] if CAPABILITY[0] == 9 else [])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gemms_against_reference(recipe: str, device: str) -> None:
    """bf16 inputs, two weights (one with a bias), 300 tokens (not a multiple of 16 or 128: the
    weight gradient pads them): the op on ``device`` against ``test_fp8``'s reference recipe on
    the CPU (FP8-rounded operands, float32 GEMMs; it needs no FP8 kernel of the CPU, which torch
    2.11 has for tensorwise scales only). The sums differ in order and in the forward's fast
    accumulation, and the outputs round to bf16."""
    torch.manual_seed(0)
    k, n1, n2 = 512, 384, 256
    cpu = [torch.randn(3, 100, k), torch.randn(n1, k) / 20, torch.randn(n2, k) / 20, torch.randn(n2)]
    cpu = [t.to(torch.bfloat16).requires_grad_() for t in cpu]
    x, w1, w2, b2 = (t.detach().to(device).requires_grad_() for t in cpu)
    outs = ops.FP8_LINEAR(x, [w1, w2], [None, b2], recipe, 0, [0, 0], -1, 1, "")
    expected = [ReferenceFp8.apply(cpu[0], cpu[1], None, recipe), ReferenceFp8.apply(cpu[0], cpu[2], cpu[3], recipe)]
    dys = [torch.ones_like(o) * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype) for o in expected]
    results = [[*outs, *torch.autograd.grad(outs, [x, w1, w2, b2], [d.to(device) for d in dys])],
               [*expected, *torch.autograd.grad(expected, cpu, dys)]]  # fmt: skip
    for name, actual, wanted in zip(("y1", "y2", "dx", "dw1", "dw2", "db2"), *results):
        error = _relative(actual.detach().cpu(), wanted.detach())
        assert error < 1e-2, f"{recipe} {name}: {error:.2e}"
    exact = cpu[0].detach().float() @ cpu[1].detach().float().t()
    assert 1e-3 < _relative(outs[0].detach().cpu(), exact) < 0.1  # FP8 rounding, not a wrong GEMM


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_gemms_equal_the_reference_recipe(recipe: str) -> None:
    gemms_against_reference(recipe, "cuda")


def _train(pm: torch.nn.Module, ids: torch.Tensor, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = []
    for _ in range(steps):
        for p in pm.parameters():
            p.grad = None
        losses.append(pm.train_step(input_ids=ids, labels=ids).item())
    return losses, {k: v.float() for k, v in pm.unshard_grads().items()}


@pytest.mark.parametrize("recipe", ["tensorwise", "tensorwise-delayed"])
@pytest.mark.parametrize("mode", ["compile", "cuda_graphs"])
def test_compiled_and_captured_fp8_equal_eager(mode: str, recipe: str) -> None:
    """Float32 weights (in bf16 the roundings of the non-FP8 work add to the differences).
    Inductor's CUDA kernels reorder the float32 work upstream of the casts, so some FP8
    roundings flip: every grad must be an FP8 rendering of the model no further from eager
    FP8's than two independent renderings (``test_fp8.assert_fp8_rendering`` derives the
    bound), against the same model run eagerly without FP8. Delayed scaling: the first of the 3
    steps seeds the histories inside the compiled graph, the others scale from the histories,
    updated on the device (CUDA graphs are refused with it); every recorded amax is eager's to within an E5M2
    rounding step (1/4): it is the largest element of an operand computed from FP8 roundings,
    some of which flip (the CPU's inductor run of this test: 2.5% at most)."""
    model = model_for("blockwise").to("cuda", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kwargs = {"input_ids": ids, "labels": ids}
    if mode == "cuda_graphs" and recipe == "tensorwise-delayed":
        with pytest.raises(UserInputError, match="cuda_graphs=True is not supported"):
            autotp.parallelize(copy.deepcopy(model), example_inputs=kwargs, fp8=recipe, cuda_graphs=True)
        return
    exact = autotp.parallelize(copy.deepcopy(model), example_inputs=kwargs)
    eager = autotp.parallelize(copy.deepcopy(model), example_inputs=kwargs, fp8=recipe)
    other = autotp.parallelize(copy.deepcopy(model), example_inputs=kwargs, fp8=recipe, **{mode: True})
    assert any(n.target is ops.FP8_LINEAR for n in other.graph_for(**kwargs).graph.nodes)
    (_, g0), (_, g1), (_, g2) = _train(exact, ids), _train(eager, ids), _train(other, ids)
    assert_fp8_rendering(g2, g1, g0, mode)
    histories = [{n: b for n, b in pm.named_buffers() if n.startswith(fp8_delayed.HISTORY_PREFIX)} for pm in (eager, other)]
    assert len(histories[1]) == (8 if recipe == "tensorwise-delayed" else 0)
    for name, history in histories[0].items():
        assert bool((history > 0).all()) and bool((histories[1][name] > 0).all()), f"{name}: a step recorded no amax"
        torch.testing.assert_close(histories[1][name], history, rtol=0.25, atol=0, msg=lambda m: f"{name}: {m}")
    if mode == "cuda_graphs":
        assert other.cudagraph_slots, "nothing was captured"


def _tp2_on_gpu(rank: int, world: int, recipe: str, compile_: bool) -> dict[str, object]:
    """This rank's GPU runs the unmodified model, one-GPU FP8 and the tp=2 FP8 model with
    sequence parallelism on NCCL (float32 weights, as above); returns what the test checks."""
    torch.cuda.set_device(rank)
    model = model_for("blockwise").to("cuda", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kwargs = {"input_ids": ids, "labels": ids}
    exact = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs=kwargs)
    one_gpu = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs=kwargs, fp8=recipe)
    parallel = autotp.parallelize(copy.deepcopy(model), tp=world, example_inputs=kwargs, fp8=recipe,
                                  sequence_parallel=True, compile=compile_)  # fmt: skip
    gathers = [n for n in parallel.graph_for(**kwargs).graph.nodes if n.target is ops.FP8_LINEAR and n.args[6] >= 0]
    (_, g0), (_, g1), (l2, g2) = _train(exact, ids), _train(one_gpu, ids), _train(parallel, ids)
    return {"backend": torch.distributed.get_backend(), "fp8_all_gather": parallel.plan.fp8_all_gather,
            "gathering_ops": len(gathers), "losses": l2, "grads": (g2, g1, g0)}  # fmt: skip


TP2_CASES = [("tensorwise", False), ("tensorwise", True), ("tensorwise-delayed", True)]


@pytest.mark.parametrize(("recipe", "compile_"), TP2_CASES, ids=[f"{r}-{'compile' if c else 'eager'}" for r, c in TP2_CASES])
def test_fp8_tp2_with_fp8_all_gathers_on_nccl(recipe: str, compile_: bool) -> None:
    """tp=2 with sequence parallelism on two GPUs: the tensorwise all-gathers into FP8 GEMMs
    carry FP8 over NCCL, each sharded operand's scale is the group's (one max all-reduce), and
    every gradient is an FP8 rendering of the model no further from one GPU's FP8 than two
    independent renderings (``assert_fp8_rendering``: the row-parallel partial sums and the
    reduced scales round in another order than one GPU's GEMMs)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    from autotp.runtime.processes.launcher import spawn_ranks

    results = spawn_ranks(_tp2_on_gpu, 2, recipe, compile_, backend="nccl", timeout_s=540)
    assert results[0]["losses"] == results[1]["losses"], f"ranks disagree on the losses: {results[0]['losses']} {results[1]['losses']}"
    for r in results:
        assert r["backend"] == "nccl"
        assert r["fp8_all_gather"] == (recipe == "tensorwise") and (r["gathering_ops"] > 0) == r["fp8_all_gather"]
        assert_fp8_rendering(*r["grads"], f"tp=2 {recipe}")
