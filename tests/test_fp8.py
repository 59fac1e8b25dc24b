"""FP8 training (``fp8=``): the op against a hand-written reference of each recipe, the plan,
the pass, the cost model and the errors; on the CPU, where ``torch._scaled_mm`` runs.

The reference below writes each recipe out block by block with plain float32 arithmetic:
amax of the block, scale = fp8_max / amax (a power of two, rounded down, for rowwise),
round to FP8, dequantize, matmul. Tensor-parallel equivalence is in ``test_fp8_tp.py``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import autotp
from autotp import presets
from autotp.api import _check_fp8
from autotp.analysis.trace import trace
from autotp.compiler import LOSS_ONLY, lower, trace_for_planning
from autotp.cost_model.compute import segment_time
from autotp.cost_model.graph_costs import build_report
from autotp.cost_model.hardware import H200
from autotp.cost_model.fp8 import plan_fp8, with_fp8_weights
from autotp.ir import ops
from autotp.ir.errors import UserInputError
from autotp.ir.plan import FP8_DIMS, FP8_OUTSIDE_LAYERS, Fp8Linear, ParallelPlan
from small_models import build

RTOL, ATOL = 1e-4, 1e-6
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# recipe -> (activation block, weight block, gradient format, power-of-two scales); None = the whole dim
RECIPES = {
    "tensorwise": ((None, None), (None, None), E5M2, False),
    "rowwise": ((1, None), (1, None), E4M3, True),
    "blockwise": ((1, 128), (128, 128), E4M3, False),
}


def _dequantized(t: torch.Tensor, block: tuple[int | None, int | None], dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """``t`` (2-d) rounded to FP8 block by block (scaled in float32), as float32 again (float64 for a float64 ``t``)."""
    rows, cols = t.shape
    br, bc = block[0] or rows, block[1] or cols
    fmax = torch.finfo(dtype).max
    wide = torch.promote_types(t.dtype, torch.float32)
    out = torch.empty(rows, cols, dtype=wide)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            part = t[i : i + br, j : j + bc].float()
            scale = torch.tensor(fmax, dtype=torch.float32) / part.abs().max().clamp(min=1e-12)
            if pow2:
                scale = torch.tensor(2.0 ** math.floor(math.log2(scale.item())))
            q = (part * scale).clamp(-fmax, fmax).to(dtype)
            out[i : i + br, j : j + bc] = q.to(wide) * scale.reciprocal().to(wide)
    return out


class ReferenceFp8(torch.autograd.Function):
    """y = x·Wᵀ + b with forward, dgrad and wgrad GEMMs on FP8-rounded operands."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, recipe: str) -> torch.Tensor:  # type: ignore[override]
        act, wgt, _, pow2 = RECIPES[recipe]
        x2 = x.reshape(-1, x.shape[-1])
        y = _dequantized(x2, act, E4M3, pow2) @ _dequantized(w, wgt, E4M3, pow2).t()
        ctx.save_for_backward(x2, w)
        ctx.recipe, ctx.shape, ctx.bias = recipe, x.shape, b is not None
        y = y.to(x.dtype) if b is None else y.to(x.dtype) + b
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x2, w = ctx.saved_tensors
        act, wgt, gdt, pow2 = RECIPES[ctx.recipe]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = _dequantized(dy2, act, gdt, pow2) @ _dequantized(w.t(), wgt, E4M3, pow2).t()
        dw = _dequantized(dy2.t(), act, gdt, pow2) @ _dequantized(x2.t(), act, E4M3, pow2).t()
        return dx.reshape(ctx.shape), dw, dy2.sum(0) if ctx.bias else None, None


class ReferenceGemm(nn.Module):
    """A linear (W [out, in]) or GPT-2's Conv1D (``x @ W + b``, W [in, out]) computing the reference recipe."""

    def __init__(self, module: nn.Module, recipe: str) -> None:
        super().__init__()
        self.weight, self.bias, self.recipe = module.weight, module.bias, recipe
        self.kn = not isinstance(module, nn.Linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ReferenceFp8.apply(x, self.weight.t() if self.kn else self.weight, self.bias, self.recipe)


def reference_model(model: nn.Module, plan: ParallelPlan) -> nn.Module:
    """``model`` with each module whose weight the plan runs in FP8 computing the reference recipe."""
    reference = copy.deepcopy(model)
    recipes = {e.weight: e.recipe for e in plan.fp8_linears if e.recipe}
    for name, module in list(reference.named_modules()):
        recipe = recipes.get(f"{name}.weight")
        if recipe:
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent), child, ReferenceGemm(module, recipe))
    assert sum(isinstance(m, ReferenceGemm) for m in reference.modules()) == len(recipes)
    return reference


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_step(loss: torch.Tensor, pm: nn.Module, reference: nn.Module, expected: torch.Tensor, what: str) -> None:
    """``pm``'s training-step loss and every grad equal ``reference``'s (``expected``: its loss, not yet backpropagated)."""
    expected.backward()
    _close(loss, expected.detach(), f"{what}: loss")
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        _close(grads[name], p.grad, f"{what}: grad of {name}")


def check_against_reference(pm: nn.Module, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, what: str) -> float:
    """Logits, loss and every grad of ``pm`` equal ``model`` with the plan's FP8 GEMMs in the reference recipe."""
    reference = reference_model(model, pm.plan)
    out, expected = pm(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    _close(out.logits, expected.logits, f"{what}: logits")
    _close(out.loss, expected.loss, f"{what}: loss")
    out.loss.backward()
    expected.loss.backward()
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        _close(grads[name], p.grad, f"{what}: grad of {name}")
    return out.loss.item()


def _shapes(recipe: str) -> tuple[int, int, int]:
    return (256, 128, 384) if recipe == "blockwise" else (64, 32, 48)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_op_equals_the_hand_written_recipe(recipe: str) -> None:
    """Two weights reading one input (one with a bias): outputs, input, weight and bias grads.
    48 tokens: the blockwise weight gradient runs on a partial 128-token tile."""
    torch.manual_seed(0)
    k, n1, n2 = _shapes(recipe)
    x = (torch.randn(2, 24, k) * 3).requires_grad_()
    w1, w2 = torch.randn(n1, k, requires_grad=True), (torch.randn(n2, k) / 10).requires_grad_()
    b2 = torch.randn(n2, requires_grad=True)
    y1, y2 = ops.FP8_LINEAR(x, [w1, w2], [None, b2], recipe, 0, [0, 0], -1, 1, "")
    dy1, dy2 = torch.randn_like(y1), torch.randn_like(y2) * 100
    grads = torch.autograd.grad([y1, y2], [x, w1, w2, b2], [dy1, dy2])

    xr, w1r, w2r, b2r = (t.detach().clone().requires_grad_() for t in (x, w1, w2, b2))
    r1, r2 = ReferenceFp8.apply(xr, w1r, None, recipe), ReferenceFp8.apply(xr, w2r, b2r, recipe)
    expected = torch.autograd.grad([r1, r2], [xr, w1r, w2r, b2r], [dy1, dy2])
    _close(y1, r1, "output 1")
    _close(y2, r2, "output 2")
    for name, a, e in zip(("x", "w1", "w2", "b2"), grads, expected):
        _close(a, e, f"grad of {name}")
    assert (y1 - x @ w1.t()).norm() / (x @ w1.t()).norm() > 1e-3  # it did round to FP8


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_op_runs_bf16_on_the_cpu(recipe: str) -> None:
    """bf16 activations and weights (the CPU's row-scaled kernel writes float32 only): the outputs
    and grads are the reference's, rounded to bf16."""
    torch.manual_seed(0)
    k, n, _ = _shapes(recipe)
    x, w = torch.randn(2, 24, k, dtype=torch.bfloat16, requires_grad=True), torch.randn(n, k, dtype=torch.bfloat16, requires_grad=True)
    (y,) = ops.FP8_LINEAR(x, [w], [None], recipe, 0, [0], -1, 1, "")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad([y], [x, w], [dy])
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    r = ReferenceFp8.apply(xr, wr, None, recipe)
    expected = torch.autograd.grad([r], [xr, wr], [dy])
    assert y.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(y, r)
    for a, e in zip(grads, expected):
        torch.testing.assert_close(a, e.to(torch.bfloat16))


def _llama(hidden: int = 64, layers: int = 2, kv_heads: int = 2, vocab: int = 128) -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=kv_heads)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def model_for(recipe: str) -> nn.Module:
    """A Llama whose decoder GEMMs all fit the recipe at tp=1 and tp=2 (blockwise: 128-aligned shards)."""
    return _llama(256, kv_heads=8, vocab=256) if recipe == "blockwise" else _llama()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_tp1_model_equals_the_model_with_reference_fp8_linears(recipe: str) -> None:
    model = model_for(recipe)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="on the CPU runs torch._scaled_mm"):
        pm = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs={"input_ids": ids, "labels": ids}, fp8=recipe)
    fp8 = [e for e in pm.plan.fp8_linears if e.recipe]
    assert len(fp8) == 14 and all(e.recipe == recipe for e in fp8)  # q k v o gate up down, 2 layers
    check_against_reference(pm, model, ids, ids, recipe)
    targets = [n.target for n in pm.graph_for(input_ids=ids, labels=ids).graph.nodes]
    assert targets.count(ops.FP8_LINEAR) == 8  # per layer: q/k/v, o, gate/up, down (one op per input)
    assert targets.count(torch.ops.aten.linear.default) == 1  # lm_head


def test_plan_lists_every_gemm_weight_and_round_trips() -> None:
    """lm_head stays in the model's dtype; at tp=2 the KV projections (2 heads of 8: 8 features per
    rank) are too narrow for FP8 GEMMs; the entries survive JSON."""
    model = _llama()
    ids = torch.zeros(2, 16, dtype=torch.long)
    plan = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids, "labels": ids}, fp8=True).plan
    by_weight = {e.weight: e for e in plan.fp8_linears}
    assert plan.fp8 == "tensorwise" and len(by_weight) == 15
    assert by_weight["lm_head.weight"].reason == FP8_OUTSIDE_LAYERS
    kv = by_weight["model.layers.0.self_attn.k_proj.weight"]
    assert kv.recipe == "" and kv.reason == FP8_DIMS and "N=8" in kv.detail
    assert by_weight["model.layers.0.self_attn.q_proj.weight"].recipe == "tensorwise"
    assert ParallelPlan.from_json(plan.to_json()) == plan
    assert ParallelPlan.from_json(replace(plan, fp8="", fp8_linears=()).to_json()).fp8_linears == ()


def test_blockwise_needs_128_aligned_shards() -> None:
    model = _llama()  # hidden 64: no GEMM dim is a multiple of 128
    ids = torch.zeros(2, 16, dtype=torch.long)
    plan = autotp.compile_rank(model, tp=1, example_inputs={"input_ids": ids}, fp8="blockwise").plan
    reasons = {e.reason for e in plan.fp8_linears}
    assert reasons == {FP8_DIMS, FP8_OUTSIDE_LAYERS} and not any(e.recipe for e in plan.fp8_linears)


def test_sequence_parallel_all_gathers_carry_fp8_for_tensorwise() -> None:
    model = model_for("tensorwise")
    ids = torch.zeros(2, 16, dtype=torch.long)
    kwargs = {"input_ids": ids, "labels": ids}
    counts = {}
    for recipe in ("tensorwise", "rowwise"):
        compiled = autotp.compile_rank(model, tp=2, example_inputs=kwargs, sequence_parallel=True, fp8=recipe)
        assert compiled.plan.fp8_all_gather == (recipe == "tensorwise")
        nodes = [n for n in compiled.graph.graph.nodes if n.op == "call_function"]
        counts[recipe] = (sum(n.target is ops.ALL_GATHER for n in nodes),
                          sum(n.target is ops.FP8_LINEAR and n.args[6] >= 0 for n in nodes))  # fmt: skip
    # per layer, the gate/up gather goes FP8; q/k/v's also feeds the bf16 k/v (8 features per rank)
    # and stays, as does lm_head's
    assert counts["tensorwise"] == (3, 2) and counts["rowwise"] == (5, 0)


def test_tp_overlap_leaves_the_gemms_to_fp8() -> None:
    """With ``tp_overlap`` the planner still sees every GEMM (it plans on the graph before the
    overlap's fusion): the FP8 ones leave their collectives unfused, the rest fuse as before."""
    model = model_for("tensorwise")
    ids = torch.zeros(2, 16, dtype=torch.long)
    kwargs = {"example_inputs": {"input_ids": ids, "labels": ids}, "sequence_parallel": True, "tp_overlap": True}
    plain = autotp.compile_rank(model, tp=2, fp8="tensorwise", **kwargs)
    assert [e.weight for e in plain.plan.fp8_linears] == [e.weight for e in autotp.compile_rank(model, tp=2, fp8=True,
            example_inputs=kwargs["example_inputs"], sequence_parallel=True).plan.fp8_linears]  # fmt: skip
    targets = [n.target for n in plain.graph.graph.nodes]
    assert targets.count(ops.FP8_LINEAR) == 8 and ops.MATMUL_REDUCE_SCATTER not in targets


def test_gpt2_conv1d_gemms_run_in_fp8() -> None:
    """GPT-2 multiplies by [in, out] weights (addmm); the op reads them transposed."""
    model = build("gpt2")
    ids = torch.zeros(2, 16, dtype=torch.long)
    compiled = autotp.compile_rank(model, tp=1, example_inputs={"input_ids": ids}, fp8="rowwise")
    assert sum(1 for e in compiled.plan.fp8_linears if e.recipe) == 8  # c_attn, c_proj, c_fc, mlp c_proj per layer
    nodes = [n for n in compiled.graph.graph.nodes if n.target is ops.FP8_LINEAR]
    assert len(nodes) == 8 and not any(n.target is torch.ops.aten.addmm.default for n in compiled.graph.graph.nodes)


def test_unknown_recipe_is_refused() -> None:
    model = _llama()
    with pytest.raises(UserInputError, match="fp8='int8' is not an FP8 recipe; use one of"):
        autotp.compile_rank(model, tp=1, example_inputs={"input_ids": torch.zeros(1, 8, dtype=torch.long)}, fp8="int8")


def test_gpu_without_fp8_tensor_cores_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    with pytest.raises(UserInputError, match=r"needs compute capability 8.9 or higher .* A100-SXM4-80GB has 8.0"):
        _check_fp8(cuda, True, None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    _check_fp8(cuda, "tensorwise", None)
    with pytest.raises(UserInputError, match=r"blockwise.*9.0 exactly"):
        _check_fp8(cuda, "blockwise", None)


def test_plan_fp8_keeps_partial_inputs_in_the_model_dtype() -> None:
    """A GEMM reading a partial sum gets no FP8 (each rank would scale its summand alone)."""
    model = _llama()
    ids = torch.zeros(2, 16, dtype=torch.long)
    compiled = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids})
    gm = compiled.graph
    site = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default and "o_proj" in str(n.args[1].target))
    lay = site.args[0].meta["autotp_layout"]
    site.args[0].meta["autotp_layout"] = replace(lay, dims=(), partial=True)
    plan = plan_fp8(gm, compiled.plan, "tensorwise")
    entry = next(e for e in plan.fp8_linears if e.node == site.name)
    assert entry == Fp8Linear(entry.weight, "", "partial_input", entry.detail, site.name)


def test_cost_model_counts_the_amax_all_reduces() -> None:
    """tp=2 tensorwise: o_proj reads x split on K and a K-split weight (2 amaxes forward, its output
    grad is whole); q_proj (its KV neighbours stay bf16) splits N (1 amax each way)."""
    model = _llama()
    ids = torch.zeros(2, 16, dtype=torch.long)
    compiled = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids, "labels": ids}, fp8="tensorwise")
    report = build_report(compiled.graph, compiled.plan, 0)
    by_weight = {str(r.node.args[1][0].target): r for r in report.nodes if r.node.target is ops.FP8_LINEAR}
    o_proj, q_proj = by_weight["model.layers.0.self_attn.o_proj.weight"], by_weight["model.layers.0.self_attn.q_proj.weight"]
    assert [(c.kind, c.direction, c.bytes) for c in o_proj.collectives] == [("all_reduce", "forward", 8)]
    assert [(c.kind, c.direction, c.bytes) for c in q_proj.collectives] == [("all_reduce", "forward", 4), ("all_reduce", "backward", 4)]


def test_cost_model_prices_fp8_gemms_and_casts() -> None:
    """A Llama-3-8B layer on H200: FP8 keeps the GEMM FLOPs, runs them at twice the rate, and adds
    its casts (q/k/v's forward: x and three weights, each read twice and written in 1 byte, and
    their FP8 copies transposed for the backward, read and written in 1 byte each)."""
    costs = trace_for_planning(presets.model_config("llama3-8b"), 1024)
    bf16, fp8 = costs.rank(1).layers[0], costs.rank(1, fp8="tensorwise").layers[0]
    assert fp8.flops.sum(axis=0) == pytest.approx(bf16.flops.sum(axis=0))
    qkv = int(fp8.fp8.argmax())
    hidden, kv, tokens = 4096, 1024, 2 * 1024
    quantized = 5 * (tokens * hidden + hidden * hidden + 2 * kv * hidden)  # bf16: 2 reads of 2 bytes, 1 write
    quantized += 2 * (tokens * hidden + hidden * hidden + 2 * kv * hidden)  # FP8 transposes: 1 read, 1 write
    const, per_sample = fp8.casts[qkv, 0]  # forward; weights are constant, x grows with the batch
    assert const + 2 * per_sample == quantized
    time_bf16, time_fp8 = segment_time(bf16, 2, H200, 1), segment_time(fp8, 2, H200, 1)
    assert time_fp8.compute_s < 0.85 * time_bf16.compute_s
    no_gain = replace(H200, fp8_matmul_speedup=1.0)
    assert segment_time(fp8, 2, no_gain, 1).compute_s > time_bf16.compute_s  # the casts cost something


def _aten_targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compile_sees_the_quantization_as_aten_ops(recipe: str) -> None:
    """Under ``torch.compile`` the op is no kernel of its own: AOT autograd traces its amaxes,
    scales and casts, forward and backward, into the graphs inductor fuses, with only
    ``_scaled_mm`` left as the GEMMs (3 per weight: forward, dgrad, wgrad)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, _inputs: object) -> Callable[..., object]:
        graphs.append(gm)
        return make_boxed_func(gm)

    def linear(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> list[torch.Tensor]:
        return ops.FP8_LINEAR(torch.nn.functional.rms_norm(x, (x.shape[-1],)), [w1, w2], [None, None], recipe, 0, [0, 0], -1, 1, "")

    torch._dynamo.reset()
    compiled = torch.compile(linear, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    x, w1, w2 = torch.randn(2, 16, 64, requires_grad=True), torch.randn(32, 64, requires_grad=True), torch.randn(48, 64, requires_grad=True)
    y1, y2 = compiled(x, w1, w2)
    (y1.sum() + y2.square().sum()).backward()
    forward, backward = (_aten_targets(gm) for gm in graphs)
    aten, prims = torch.ops.aten, torch.ops.prims
    assert forward.count(aten._scaled_mm.default) == 2 and backward.count(aten._scaled_mm.default) == 4
    for targets in (forward, backward):
        assert aten.amax.default in targets
        assert not any(str(t).startswith("autotp.") for t in targets)
    casts = [n for gm in graphs for n in gm.graph.nodes if n.target in (aten._to_copy.default, prims.convert_element_type.default)]
    assert {n.meta["val"].dtype for n in casts} >= {E4M3, E5M2 if recipe == "tensorwise" else E4M3}
    expected = ops.FP8_LINEAR(torch.nn.functional.rms_norm(x, (64,)), [w1, w2], [None, None], recipe, 0, [0, 0], -1, 1, "")
    for actual, wanted in zip((y1, y2), expected):
        _close(actual, wanted, "compiled output")


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_inductor_compiles_the_op_bit_for_bit(recipe: str) -> None:
    """Inductor's C++ kernels of the op (amaxes, scales, casts, the FP8 copies that the
    backward reads) give the eager op's output and grads bit for bit, given the same inputs:
    what ``test_compiled_model_equals_eager`` can differ in comes from outside the op."""

    def linear(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> list[torch.Tensor]:
        return ops.FP8_LINEAR(x * 1.5, [w1, w2], [None, None], recipe, 0, [0, 0], -1, 1, "")

    torch.manual_seed(0)
    inputs = [torch.randn(2, 16, 256), torch.randn(256, 256) / 20, torch.randn(128, 256) / 20]
    dys = [torch.randn(2, 16, 256), torch.randn(2, 16, 128)]
    results = []
    for run in (linear, torch.compile(linear, fullgraph=True)):
        torch._dynamo.reset()
        leaves = [t.clone().requires_grad_() for t in inputs]
        outs = run(*leaves)
        results.append([*outs, *torch.autograd.grad(outs, leaves, dys)])
    for name, compiled, eager in zip(("y1", "y2", "dx", "dw1", "dw2"), *results):
        assert torch.equal(compiled, eager), f"{recipe}: {name} compiled != eager"


def _trained(pm: nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = pm.train_step(input_ids=ids, labels=ids, num_microbatches=2).item()
    return loss, pm.unshard_grads()


def _fp8_runs(recipe: str, compile: bool | str, exact: bool) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """Loss and grads of one training step: eager FP8, FP8 through ``torch.compile`` with
    backend ``compile``, and with ``exact`` (for ``assert_fp8_rendering``) the model without FP8."""
    model = model_for(recipe)
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    kwargs = {"example_inputs": {"input_ids": ids[:2], "labels": ids[:2]}}
    runs = {"exact": _trained(autotp.parallelize(copy.deepcopy(model), **kwargs), ids)} if exact else {}
    with pytest.warns(UserWarning, match="on the CPU runs torch._scaled_mm"):
        eager = autotp.parallelize(copy.deepcopy(model), fp8=recipe, **kwargs)
        compiled = autotp.parallelize(copy.deepcopy(model), fp8=recipe, compile=compile, **kwargs)
    torch._dynamo.reset()
    runs["compiled"], runs["eager"] = _trained(compiled, ids), _trained(eager, ids)
    torch._dynamo.reset()
    return runs


RENDERING_BOUND = 1.5
"""√2 (two independent FP8 renderings) with 6% for the spread of a norm: ``assert_fp8_rendering``."""


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_fp8_rendering(compiled: dict[str, torch.Tensor], eager: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                         what: str) -> None:  # fmt: skip
    """Every grad of ``compiled`` is an FP8 rendering of the model (like ``eager``'s) that is
    no further from ``eager`` than two independent renderings are.

    Why not equality: inductor reorders float32 work upstream of the casts (its ``mean`` in
    an RMSNorm rounds differently from eager's), so an input to a cast may sit a few ulps
    off and its FP8 rounding lands on the neighbouring value (a flip, 1/8 to 1/16 of the
    value in E4M3); each flip changes the inputs of the layers after it, so flips spread.
    The FP8 op itself compiles bit for bit (``test_inductor_compiles_the_op_bit_for_bit``)
    and the compiled graphs run by eager kernels equal eager bit for bit
    (``test_compiled_graphs_equal_eager_bit_for_bit``): what is left is rounding.

    The bound: each run differs from the exact model X by its rounding errors,
    C − X = e_C and E − X = e_E, of one size (‖e_C‖ ≈ ‖e_E‖). Then ‖C − E‖ = ‖e_C − e_E‖;
    independent roundings give E‖e_C − e_E‖² = 2‖e_E‖², i.e. ‖C − E‖ ≈ √2·‖E − X‖, and each
    rounding the runs share only lowers it. So ‖C − E‖ ≤ 1.5·‖E − X‖ and
    ‖C − X‖ ∈ [‖E − X‖/1.5, 1.5·‖E − X‖]. A run that skipped the quantization has
    ‖C − X‖ ≈ 0; a wrong scale, operand or transposition moves a grad by its own size,
    far beyond 1.5·‖E − X‖. A subtler error (a grad a few percent off) hides in the FP8
    noise of these small models (5–13% per grad): the bit-for-bit tests above catch those."""
    for name, e in eager.items():
        noise = _relative(e, exact[name])
        apart, off = _relative(compiled[name], e) / noise, _relative(compiled[name], exact[name]) / noise
        assert apart <= RENDERING_BOUND, f"{what}: grad of {name} is {apart:.2f}× the FP8 error from eager's"
        assert 1 / RENDERING_BOUND <= off <= RENDERING_BOUND, f"{what}: grad of {name}: {off:.2f}× eager's FP8 error"


def test_rendering_bound_tells_fp8_noise_from_defects() -> None:
    """``assert_fp8_rendering`` on made-up grads: an independent rendering (noise of eager's
    size) passes; no quantization, or eager's grad with a doubled scale, fails."""
    gen = torch.Generator().manual_seed(0)
    exact = {"w": torch.randn(64, 64, generator=gen)}
    eager = {"w": exact["w"] * (1 + 0.06 * torch.randn(64, 64, generator=gen))}
    independent = {"w": exact["w"] * (1 + 0.06 * torch.randn(64, 64, generator=gen))}
    assert_fp8_rendering(independent, eager, exact, "independent")
    for defect in (exact, {"w": eager["w"] * 2}):
        with pytest.raises(AssertionError, match="grad of w"):
            assert_fp8_rendering(defect, eager, exact, "defect")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_compiled_graphs_equal_eager_bit_for_bit(recipe: str) -> None:
    """``compile="aot_eager"``: the graphs ``torch.compile`` makes of the FP8 model (AOT
    autograd's forward and backward, what they save, the partitioner's recomputation) run
    by eager kernels compute eager's loss and grads bit for bit. With the op's inductor
    kernels bit for bit too, a compiled model can differ only by inductor's rounding of the
    rest (``test_compiled_model_is_an_fp8_rendering_of_eager``)."""
    runs = _fp8_runs(recipe, "aot_eager", exact=False)
    (loss, grads), (expected_loss, expected_grads) = runs["compiled"], runs["eager"]
    assert loss == expected_loss
    for name, grad in expected_grads.items():
        assert torch.equal(grads[name], grad), f"{recipe} aot_eager: grad of {name}"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_compiled_model_is_an_fp8_rendering_of_eager(recipe: str) -> None:
    """``compile=True`` on the CPU (inductor's C++ kernels, the quantization fused into its
    producers): every grad within ``assert_fp8_rendering``'s bound of eager FP8's (the loss
    is one scalar, whose rounding error does not concentrate like a norm's: the grads carry
    the forward's differences)."""
    runs = _fp8_runs(recipe, True, exact=True)
    assert_fp8_rendering(runs["compiled"][1], runs["eager"][1], runs["exact"][1], f"{recipe} compiled")


def test_fp8_lm_head_in_the_fused_loss_equals_the_hand_written_recipe() -> None:
    """``linear_cross_entropy`` with ``fp8_recipe="tensorwise"``, 3 chunks (the last partial),
    one ignored token: the loss and both grads equal tensorwise FP8 written out (h and W
    quantized once; each chunk's logit gradient in E5M2 with the chunk's own scale)."""
    torch.manual_seed(0)
    tokens, hidden, vocab, chunk = 40, 64, 96, 16
    h = (torch.randn(tokens, hidden) * 2).requires_grad_()
    w = (torch.randn(vocab, hidden) / 8).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    target[5] = -100
    loss = ops.LINEAR_CROSS_ENTROPY(h, w, target, 0, vocab, -100, 1, chunk, 1, "", "tensorwise")
    loss.backward()

    hq, wq = _dequantized(h.detach(), (None, None), E4M3, False), _dequantized(w.detach(), (None, None), E4M3, False)
    valid = target != -100
    token_weight = valid.float() / valid.sum()
    expected_loss, dh, dw = torch.zeros(()), torch.empty(tokens, hidden), torch.zeros(vocab, hidden)
    for start in range(0, tokens, chunk):
        rows = slice(start, start + chunk)
        logits = hq[rows] @ wq.t()
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, target[rows].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        expected_loss += ((lse - picked) * token_weight[rows]).sum()
        onehot = torch.nn.functional.one_hot(target[rows].clamp(min=0), vocab) * valid[rows].unsqueeze(-1)
        g = ((logits - lse.unsqueeze(-1)).exp() - onehot) * token_weight[rows].unsqueeze(-1)
        gq = _dequantized(g, (None, None), E5M2, False)
        dh[rows] = gq @ wq
        dw += gq.t() @ hq[rows]
    _close(loss, expected_loss, "loss")
    _close(h.grad, dh, "grad of h")
    _close(w.grad, dw, "grad of W")
    exact = torch.nn.functional.cross_entropy(h.detach() @ w.detach().t(), target)
    assert abs(loss.item() - exact.item()) > 1e-5  # it did round to FP8


def with_fp8_lm_head(plan: ParallelPlan) -> ParallelPlan:
    """``plan`` with the lm_head's GEMMs in tensorwise FP8 (the user's opt-in)."""
    edited = with_fp8_weights(plan, ["lm_head.weight"], "tensorwise")
    assert [e.recipe for e in edited.fp8_linears if e.weight == "lm_head.weight"] == ["tensorwise"]
    return edited


def test_fp8_weights_must_be_gemm_weights_of_the_plan() -> None:
    model = model_for("tensorwise")
    plan = autotp.compile_rank(model, tp=1, fp8="tensorwise").plan
    with pytest.raises(UserInputError, match=r"\['model.norm.weight'\] are not GEMM weights"):
        with_fp8_weights(plan, ["model.norm.weight"])


def check_fp8_lm_head(tp: int) -> float:
    """``train_step`` (the lm_head fused into the loss) with the lm_head in tensorwise FP8: loss and
    every grad equal the model with reference FP8 linears, the lm_head's among them (one loss
    chunk: one scale for the logit gradient, as the reference's), and differ from the plan's
    default (lm_head in the model's dtype)."""
    model = model_for("tensorwise")
    gen = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, 128, (2, 16), generator=gen), torch.randint(0, 128, (2, 16), generator=gen)
    example = {"input_ids": ids, "labels": labels}
    default = autotp.compile_rank(model, tp=tp, example_inputs=example, fp8="tensorwise").plan
    plan = with_fp8_lm_head(default)
    assert plan.loss_chunk_tokens >= ids.numel()
    step_graph = lower(trace(model, {**example, "use_cache": False}, "meta"), plan, outputs_read=LOSS_ONLY).graph
    fused = [n for n in step_graph.graph.nodes if n.target is ops.LINEAR_CROSS_ENTROPY]
    assert [n.args[-1] for n in fused] == ["tensorwise"], "train_step's lm_head is not fused with FP8 GEMMs"
    pm = autotp.parallelize(copy.deepcopy(model), tp=tp, example_inputs=example, plan=plan)
    loss = pm.train_step(input_ids=ids, labels=labels)
    reference = reference_model(model, plan)
    check_step(loss, pm, reference, reference(input_ids=ids, labels=labels).loss, f"tp={tp} FP8 lm_head")
    head_in_bf16 = reference_model(model, default)(input_ids=ids, labels=labels).loss
    assert abs(head_in_bf16.item() - loss.item()) > 1e-6
    return loss.item()


def test_fp8_lm_head_fused_into_the_loss_equals_the_reference() -> None:
    with pytest.warns(UserWarning, match="on the CPU runs torch._scaled_mm"):
        check_fp8_lm_head(tp=1)


def test_cost_model_prices_the_fp8_lm_head_of_the_fused_loss() -> None:
    """The fused loss with an FP8 lm_head counts as FP8 GEMMs (priced at the FP8 rate) and its
    forward moves the casts' bytes: h [32, 64] and W [128, 64] (float32: read twice, written
    and transposed in FP8) and the logit gradient [32, 128] (quantized, transposed)."""
    from autotp.analysis.local_shapes import local_tensors
    from autotp.cost_model.fp8 import cast_bytes, has_fp8_gemms

    model = model_for("tensorwise")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    example = {"input_ids": ids, "labels": ids}
    default = autotp.compile_rank(model, tp=1, example_inputs=example, fp8="tensorwise").plan
    traced = trace(model, {**example, "use_cache": False}, "meta")
    for plan, fp8 in ((default, False), (with_fp8_lm_head(default), True)):
        (loss,) = [n for n in lower(traced, plan, outputs_read=LOSS_ONLY).graph.graph.nodes if n.target is ops.LINEAR_CROSS_ENTROPY]
        assert has_fp8_gemms(loss) == fp8
        h, w, g = 32 * 64, 128 * 64, 32 * 128
        expected = (2 * 4 + 1 + 2) * (h + w + g) if fp8 else 0  # each: 2 reads of 4 bytes, 1 write, transposed
        assert cast_bytes(loss, lambda n: local_tensors(n, 1)) == (expected, 0)
