"""CUDA-graph regions on CPU: golden reports, blockers with their source lines, stage
boundaries, the cost model, splitting a graph at its regions, and what capture records.

The golden files are ``explain_cudagraphs(..., "json")`` without ``cudagraph_impl``
(which depends on whether Transformer Engine is installed) and without what the trace
alone decides (``tests/goldens.py``). After an intended change,
regenerate them with ``AUTOTP_UPDATE_GOLDEN=1 python -m pytest -q tests/test_cudagraphs.py``
and review the diff. GPU capture is tested in ``test_cudagraphs_gpu.py``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autotp
from autotp.runtime.execution import cudagraphs
from autotp.ir import meta_keys, ops
from autotp.ir import schedules
from autotp.cost_model.cudagraphs import RegionStats, choose_cudagraph_regions, decide
from autotp.ir.plan import CudaGraphPolicy
from autotp.report.cudagraphs import cudagraph_report, explain_cudagraphs
from autotp.passes.find_cudagraph_candidates import COLLECTIVE, HOST_SYNC, HOST_VALUE, find_cudagraph_candidates
from autotp.passes.mark_cudagraph_regions import mark_cudagraph_regions
from autotp.passes.split_cudagraph_regions import _parameter_alias_chain, region_split
from autotp.passes.runner import PassContext
from autotp.ir.plan import ParallelPlan
from distributed import run_on_ranks
from goldens import check_golden
from small_models import build, vocab_size

GOLDEN_CASES = [
    ("llama-tiny", 1, "bfloat16"),
    ("gpt2-tiny", 1, "bfloat16"),
    ("mixtral-tiny", 1, "bfloat16"),
    ("mixtral-tiny", 1, "float32"),
    ("llama-tiny", 2, "bfloat16"),
]


@pytest.mark.parametrize(("model", "pp", "dtype"), GOLDEN_CASES, ids=[f"{m}-pp{pp}-{d}" for m, pp, d in GOLDEN_CASES])
def test_report_matches_golden(model: str, pp: int, dtype: str) -> None:
    report = json.loads(explain_cudagraphs(model, 2, pp, 0, "json", seq=32, dtype=dtype))
    assert report.pop("cudagraph_impl") in (cudagraphs.TORCH, cudagraphs.TRANSFORMER_ENGINE)
    check_golden(f"cudagraphs_{model}_tp2_pp{pp}_{dtype}.json", report)


def test_dense_models_are_one_region_on_nccl() -> None:
    for model in ("llama-tiny", "gpt2-tiny"):
        report = json.loads(explain_cudagraphs(model, 2, 1, 0, "json", seq=32))
        assert report["blockers"] == [] and report["declined_regions"] == []
        (region,) = report["cudagraph_regions"]
        assert region["layers"] == ["embedding", "head"]


def test_moe_capture_is_whole_in_bf16_and_partial_in_fp32() -> None:
    # bf16 experts run aten._grouped_mm after a sort/histc dispatch: nothing syncs, the
    # whole model is one region. fp32 experts take transformers' grouped_mm_fallback,
    # which reads the offsets on the host: attention, router and dispatch are captured
    # around it, the expert matmuls run eagerly.
    whole = json.loads(explain_cudagraphs("mixtral-tiny", 2, 1, 0, "json", seq=32, dtype="bfloat16"))
    assert len(whole["cudagraph_regions"]) == 1 and whole["blockers"] == []
    partial = json.loads(explain_cudagraphs("mixtral-tiny", 2, 1, 0, "json", seq=32, dtype="float32"))
    assert [b["node"] for b in partial["blockers"]] == [f"grouped_mm_fallback{s}" for s in ("", "_1", "_2", "_3")]
    assert all(b["kind"] == HOST_SYNC and "offs.tolist()" in b["reason"] for b in partial["blockers"])
    assert len(partial["cudagraph_regions"]) == 5  # before, between and after the two expert matmuls of each layer


def test_table_lists_regions_and_blockers() -> None:
    table = explain_cudagraphs("mixtral-tiny", 2, 1, 0, "table", seq=32, dtype="float32")
    assert "captured by" in table and "make_graphed_callables" in table
    assert "blockers: 4" in table and "grouped_mm_fallback_3 (layer 1, host_sync)" in table


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        scale = h.abs().amax().item()  # ITEM_LINE
        return self.down(h / scale)


class _ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Scaled(), _Scaled()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


def test_item_is_a_blocker_at_its_node_and_line() -> None:
    compiled = autotp.compile_rank(_ScaledNet(), tp=2, example_inputs={"x": torch.randn(4, 16)}, device="cpu", cuda_graphs=True)
    report = cudagraph_report(compiled.graph, compiled.plan)
    syncs = [b for b in report["blockers"] if b["kind"] == HOST_SYNC]
    assert [b["node"] for b in syncs] == ["item", "item_1"]
    for b in syncs:
        assert b["reason"] == ".item() copies a scalar to the host"
        assert b["source"].endswith(f'test_cudagraphs.py", line {_line_of("ITEM_LINE")}, in forward'), b["source"]
    # The division by the host value runs eagerly too; the rest is captured around them.
    assert [b["node"] for b in report["blockers"] if b["kind"] == HOST_VALUE] == ["div", "div_1"]
    assert len(report["cudagraph_regions"]) == 3
    regions = {n.meta.get(meta_keys.CUDAGRAPH_REGION) for n in compiled.graph.graph.nodes if n.name in ("item", "div")}
    assert regions == {None}


def test_regions_never_span_stage_boundaries() -> None:
    model = build("llama", layers=4)
    ids = torch.randint(0, vocab_size(model), (2, 16))
    compiled = autotp.compile_rank(model, tp=1, pp=2, example_inputs={"input_ids": ids, "labels": ids}, device="cpu", cuda_graphs=True)
    regions: dict[int, list[torch.fx.Node]] = {}
    for node in compiled.graph.graph.nodes:
        if node.meta.get(meta_keys.CUDAGRAPH_REGION) is not None:
            regions.setdefault(node.meta[meta_keys.CUDAGRAPH_REGION], []).append(node)
    assert regions
    for nodes in regions.values():
        assert len({n.meta.get(meta_keys.CHUNK) for n in nodes}) == 1, [n.name for n in nodes]
        assert None not in {n.meta.get(meta_keys.CHUNK) for n in nodes}
        assert not any(n.target is ops.STAGE_BOUNDARY for n in nodes)
    assert {nodes[0].meta[meta_keys.CHUNK] for nodes in regions.values()} == {0, 1}


def _mark(gm: torch.fx.GraphModule, plan: ParallelPlan, backend: str, device: str = "meta") -> torch.fx.GraphModule:
    ctx = PassContext(plan=replace(plan, cudagraphs=True), device=torch.device(device), backend=backend)
    for step in (find_cudagraph_candidates, choose_cudagraph_regions, mark_cudagraph_regions):
        gm = step(gm, ctx)
    return gm


def test_gloo_collectives_are_blockers() -> None:
    compiled = autotp.compile_rank(autotp.presets.build_model("llama-tiny"), tp=2)
    gm = _mark(compiled.graph, compiled.plan, "gloo")
    collectives = [n for n in gm.graph.nodes if n.target in (ops.COPY_TO_TP, ops.REDUCE_FROM_TP)]
    assert collectives
    for node in collectives:
        blocker = node.meta[meta_keys.CUDAGRAPH_BLOCKER]
        assert blocker.kind == COLLECTIVE and "gloo" in blocker.reason
        assert meta_keys.CUDAGRAPH_REGION not in node.meta
    assert len({n.meta.get(meta_keys.CUDAGRAPH_REGION) for n in gm.graph.nodes} - {None}) > 1


def test_cost_model_weighs_launches_against_gpu_time_and_memory() -> None:
    policy = CudaGraphPolicy(max_static_bytes=10_000)
    small = RegionStats(nodes=50, launches=150, gpu_s=50e-6, needs_grad=True, copy_bytes=4096, static_bytes=8_000)
    gemm = RegionStats(nodes=50, launches=150, gpu_s=20e-3, needs_grad=True, copy_bytes=4096, static_bytes=8_000)
    assert decide([small, gemm], policy)[0] is None
    assert "saves" in (decide([gemm], policy)[0] or "")
    # Two launch-bound regions, budget for one: the second is declined for memory.
    verdicts = decide([small, small], policy)
    assert verdicts.count(None) == 1 and "budget" in next(v for v in verdicts if v)
    # A pipeline stage holding two microbatches in flight pins two captures: over budget.
    assert "2 slot(s) of 8000" in (decide([replace(small, slots=2)], policy)[0] or "")


def test_plan_round_trips_with_cudagraphs() -> None:
    compiled = autotp.compile_rank(autotp.presets.build_model("gpt2-tiny"), tp=2, cuda_graphs=True)
    assert compiled.plan.cudagraphs and compiled.plan.cudagraph_impl in (cudagraphs.TORCH, cudagraphs.TRANSFORMER_ENGINE)
    assert ParallelPlan.from_json(compiled.plan.to_json()) == compiled.plan
    old = json.loads(ParallelPlan(tp=2).to_json())
    for key in ("cudagraphs", "cudagraph_impl", "cudagraph_policy"):
        del old[key]
    assert ParallelPlan.from_json(json.dumps(old)) == ParallelPlan(tp=2)


def test_the_compiled_plan_records_the_chosen_regions() -> None:
    compiled = autotp.compile_rank(autotp.presets.build_model("llama-tiny"), tp=2, cuda_graphs=True)
    tagged = {n.meta[meta_keys.CUDAGRAPH_REGION] for n in compiled.graph.graph.nodes if meta_keys.CUDAGRAPH_REGION in n.meta}
    assert tagged and compiled.plan.cudagraph_regions == tuple(sorted(tagged))
    report = cudagraph_report(compiled.graph, compiled.plan)
    assert [r["id"] for r in report["cudagraph_regions"]] == list(compiled.plan.cudagraph_regions)


def test_cuda_graphs_on_cpu_is_a_value_error() -> None:
    model = build("llama")
    with pytest.raises(ValueError, match="cuda_graphs=True captures CUDA graphs, but this rank runs on cpu"):
        autotp.parallelize(model, tp=1, cuda_graphs=True)


def _outputs_and_grads(pm: autotp.ParallelModel, run: Any, ids: torch.Tensor) -> tuple[Any, dict[str, torch.Tensor]]:
    pm.zero_grad(set_to_none=True)
    out = run(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}


def _split_matches(rank: int, world: int, name: str, backend: str) -> dict[str, float]:
    model = build(name)
    ids = torch.randint(0, vocab_size(model), (2, 16), generator=torch.Generator().manual_seed(0))
    pm = autotp.parallelize(model, tp=world, example_inputs={"input_ids": ids, "labels": ids})
    gm = _mark(pm.graph_for(input_ids=ids, labels=ids), pm.plan, backend, "cpu")
    split = region_split(gm)
    expected, expected_grads = _outputs_and_grads(pm, gm, ids)
    out, grads = _outputs_and_grads(pm, split, ids)
    return {
        "regions": len(cudagraphs.regions_of(split)),
        "loss": (out.loss - expected.loss).abs().item(),
        "logits": (out.logits - expected.logits).abs().max().item(),
        "grads": max((grads[n] - g).abs().max().item() for n, g in expected_grads.items()),
    }


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral"])
def test_split_graph_computes_the_same(name: str) -> None:
    result = _split_matches(0, 1, name, "nccl")
    assert result["regions"] == (5 if name == "mixtral" else 1)
    assert result["loss"] == result["logits"] == result["grads"] == 0.0, result


def test_split_graph_with_eager_gloo_collectives_computes_the_same() -> None:
    for result in run_on_ranks(_split_matches, 2, "llama", "gloo"):
        assert result["regions"] > 1
        assert result["loss"] == result["logits"] == result["grads"] == 0.0, result


_EMULATED_POOL: list[tuple[int, int]] = []  # the memory the emulated captures allocated "in their pool"


def _in_pool(*tensors: torch.Tensor) -> None:
    for t in tensors:
        start = t.untyped_storage().data_ptr()
        _EMULATED_POOL.append((start, start + t.untyped_storage().nbytes()))


def _emulate_graph(module: nn.Module, static: tuple[torch.Tensor, ...]) -> None:
    """Replace ``module.forward`` by ``make_graphed_callables``' replay, with its buffers:
    outputs and the gradients the backward graph computes lie in the pool; the gradient
    outputs are buffers outside it, which a returned gradient may alias (the gradient of a
    parameter view that the region outputs is a view of its gradient output)."""
    params = tuple(module.parameters())
    run = module.forward
    surface = (*static, *params)
    wanted = [t for t in surface if t.requires_grad]
    with torch.enable_grad():
        state: dict[str, Any] = {"live": run(*static)}
    outs = tuple(torch.empty_like(o) for o in state["live"])
    grad_outs = tuple(torch.empty_like(o) if o.requires_grad else None for o in state["live"])
    grads = [torch.empty_like(t) for t in wanted]
    _in_pool(*outs, *grads)

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                for buffer, value in zip(static, inputs):
                    buffer.copy_(value)
            with torch.enable_grad():
                state["live"] = run(*static)
            for buffer, value in zip(outs, state["live"]):
                buffer.copy_(value.detach())
            return tuple(o.detach() for o in outs)

        @staticmethod
        def backward(ctx: Any, *incoming: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            for buffer, g in zip(grad_outs, incoming):
                if buffer is not None:
                    buffer.copy_(g)
            pairs = [(o, b) for o, b in zip(state["live"], grad_outs) if b is not None]
            got = torch.autograd.grad([o for o, _ in pairs], wanted, [b for _, b in pairs], allow_unused=True)
            kept = {b.untyped_storage().data_ptr() for b in grad_outs if b is not None}
            returned = []
            for buffer, g in zip(grads, got):
                if g is not None and g.untyped_storage().data_ptr() not in kept:
                    g = buffer.copy_(g)  # computed by the graph: in the pool
                returned.append(g)
            by_input = dict(zip(map(id, wanted), returned))
            return tuple(None if by_input.get(id(t)) is None else by_input[id(t)].detach() for t in surface)

    module.forward = lambda *args: Replay.apply(*args, *params)  # type: ignore[method-assign]


def _emulated_make_graphed_callables(
    modules: tuple[nn.Module, ...], samples: tuple[tuple[torch.Tensor, ...], ...], **kwargs: Any
) -> tuple[nn.Module, ...]:
    """``make_graphed_callables`` on CPU, with its buffer semantics but no graphs: inputs
    are copied into the static samples, outputs and gradients come back in buffers that
    the next call overwrites, and backward uses the activations of the latest forward."""
    for module, static in zip(modules, samples):
        _emulate_graph(module, static)
    return modules


def _emulated_pool(pool: Any) -> list[tuple[int, int]]:
    return list(_EMULATED_POOL)


def _train_captured_and_eager(rank: int, world: int, name: str, sp: bool = False, set_to_none: bool = True) -> dict[str, float]:
    import autotp.api

    torch.cuda.make_graphed_callables = _emulated_make_graphed_callables  # type: ignore[assignment]
    torch.cuda.graph_pool_handle = lambda: None  # type: ignore[assignment]
    cudagraphs._pool_ranges = _emulated_pool
    autotp.api._check_cuda_graphs = lambda *args: None  # type: ignore[assignment]
    model = build(name)
    ids = torch.randint(0, vocab_size(model), (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    eager = autotp.parallelize(copy.deepcopy(model), tp=world, example_inputs=batch, sequence_parallel=sp)
    graphed = autotp.parallelize(model, tp=world, example_inputs=batch, cuda_graphs=True, sequence_parallel=sp)
    assert graphed.plan.sequence_parallel == sp
    optimizers = [torch.optim.SGD(pm.parameters(), lr=0.1) for pm in (eager, graphed)]
    worst = 0.0
    for _ in range(3):
        losses = [pm.train_step(**batch, num_microbatches=2) for pm in (eager, graphed)]
        grads = [pm.unshard_grads() for pm in (eager, graphed)]
        worst = max([worst, (losses[0] - losses[1]).abs().item()] + [(g - grads[1][k]).abs().max().item() for k, g in grads[0].items() if g is not None])
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    micro = {k: v[:2] for k, v in batch.items()}
    with torch.no_grad():
        first, second = graphed(**micro).logits, graphed(input_ids=ids[2:], labels=ids[2:]).logits
        expected = eager(**micro).logits
    return {"worst": worst, "logits": (first - expected).abs().max().item(), "kept": float(not torch.equal(first, second))}


@pytest.mark.parametrize("name", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_training_through_replay_buffers_matches_eager(name: str) -> None:
    # Spawned: the emulation patches torch.cuda for the whole process. One rank is exact;
    # with gloo, collectives split the graph into regions whose gradient sums associate
    # differently from one autograd pass (rounding).
    for world, tolerance in ((1, 0.0), (2, 1e-6)):
        for result in run_on_ranks(_train_captured_and_eager, world, name):
            assert result["worst"] <= tolerance and result["logits"] <= tolerance, (world, result)
            assert result["kept"], "an earlier call's outputs changed: they must be copies, not static buffers"


def test_grads_zeroed_in_place_accumulate_outside_the_replay_buffers() -> None:
    # zero_grad(set_to_none=False) keeps .grad, which autograd first stored as a replay buffer.
    for result in run_on_ranks(_train_captured_and_eager, 1, "llama", False, False):
        assert result["worst"] == 0.0 and result["logits"] == 0.0, result


def test_own_grads_copies_only_grads_in_the_pool() -> None:
    inside, outside = (nn.Parameter(torch.randn(4)) for _ in range(2))
    buffer = torch.randn(4)
    inside.grad, outside.grad = buffer, torch.randn(4)
    kept = outside.grad
    start = buffer.untyped_storage().data_ptr()
    cudagraphs._own_grads((inside, outside), [(start, start + buffer.untyped_storage().nbytes())])
    assert inside.grad is not buffer and inside.grad.data_ptr() != buffer.data_ptr() and torch.equal(inside.grad, buffer)
    assert outside.grad is kept
    inside.grad = None
    cudagraphs._own_grads((inside,), [(0, 2**64)])  # no grad: nothing to copy
    assert inside.grad is None


def test_replay_with_sequence_parallelism_matches_eager() -> None:
    for result in run_on_ranks(_train_captured_and_eager, 2, "llama", True):
        assert result["worst"] <= 1e-6 and result["logits"] <= 1e-6, result
        assert result["kept"], "an earlier call's outputs changed: they must be copies, not static buffers"


def test_sequence_parallel_collectives_stay_inside_one_region_on_nccl() -> None:
    model = autotp.presets.build_model("llama-tiny")
    ids = torch.randint(0, 100, (2, 32))
    compiled = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids, "labels": ids}, cuda_graphs=True,
                                   sequence_parallel=True)  # fmt: skip
    nodes = compiled.graph.graph.nodes
    sp = [n for n in nodes if n.target in (ops.REDUCE_SCATTER, ops.ALL_GATHER)]
    assert sp and all(n.meta.get(meta_keys.CUDAGRAPH_BLOCKER) is None for n in sp)
    assert len(compiled.plan.cudagraph_regions) == 1


def test_first_call_records_static_inputs_and_later_outputs_are_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    # Capture itself needs CUDA; here make_graphed_callables only records what it is given.
    given: list[tuple[tuple[nn.Module, ...], tuple[tuple[torch.Tensor, ...], ...], dict[str, Any]]] = []
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", lambda mods, samples, **kw: given.append((mods, samples, kw)) or mods)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(cudagraphs, "_pool_ranges", lambda pool: [(0, 2**64)] if pool == "pool" else [])
    model = build("llama")
    ids = torch.randint(0, vocab_size(model), (2, 16))
    pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": ids, "labels": ids})
    gm = _mark(pm.graph_for(input_ids=ids, labels=ids), pm.plan, "nccl", "cpu")
    captured = cudagraphs.CapturedGraph(region_split(gm), cudagraphs.TORCH)
    first = captured(input_ids=ids, labels=ids, use_cache=False)
    (modules, samples, kwargs) = given[0]
    assert kwargs["pool"] == "pool" and kwargs["allow_unused_input"]
    assert len(modules) == 1 and [s.dtype for s in samples[0]] == [torch.long, torch.long]
    assert not any(s.requires_grad for s in samples[0])  # token ids: nothing to differentiate
    assert torch.equal(samples[0][0], ids) and samples[0][0].data_ptr() != ids.data_ptr()
    second = captured(input_ids=ids, labels=ids, use_cache=False)
    assert len(given) == 1  # captured once
    assert torch.equal(first.logits, second.logits)
    # A gradient stored in the pool (here: all memory) is copied before the next replay.
    second.loss.backward()
    weight = pm.get_parameter("model.layers.0.mlp.up_proj.weight")
    stored = weight.grad
    assert stored is not None and not weight._backward_hooks  # no per-parameter hook
    captured(input_ids=ids, labels=ids, use_cache=False)
    assert weight.grad is not stored and torch.equal(weight.grad, stored)


def test_no_region_outputs_a_view_of_a_parameter() -> None:
    # Mixtral's fp32 experts run eagerly and read their weights transposed: the transposes are
    # recomputed outside the regions, else the weights' grads alias static gradient outputs.
    model = build("mixtral")
    ids = torch.randint(0, vocab_size(model), (2, 16))
    pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": ids, "labels": ids})
    split = region_split(_mark(pm.graph_for(input_ids=ids, labels=ids), pm.plan, "nccl", "cpu"))
    assert len(cudagraphs.regions_of(split)) == 5
    for name, region in cudagraphs.regions_of(split):
        (output,) = [n for n in region.graph.nodes if n.op == "output"]
        aliases = [o.name for o in output.all_input_nodes if _parameter_alias_chain(o)]
        assert aliases == [], (name, aliases)
    fallbacks = [n for n in split.graph.nodes if "grouped_mm_fallback" in str(n.target)]
    assert len(fallbacks) == 4
    for node in fallbacks:
        weight = node.args[1]
        assert weight.target is torch.ops.aten.transpose.int and weight.args[0].op == "get_attr", node.format_node()


def test_compiled_capture_of_several_regions_compiles_each(monkeypatch: pytest.MonkeyPatch) -> None:
    given: list[tuple[nn.Module, ...]] = []

    def record(modules: tuple[nn.Module, ...], samples: Any, **kwargs: Any) -> tuple[nn.Module, ...]:
        given.append(modules)
        for module in modules:  # run the region uncompiled: inductor's CPU build is not what is tested here
            module.forward = module._orig_mod.forward
        return modules

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", record)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(cudagraphs, "_pool_ranges", lambda pool: [(0, 1)])
    model = build("mixtral")
    ids = torch.randint(0, vocab_size(model), (2, 16))
    pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": ids, "labels": ids})
    gm = pm.graph_for(input_ids=ids, labels=ids)
    split = region_split(_mark(gm, pm.plan, "nccl", "cpu"))
    captured = cudagraphs.CapturedGraph(split, cudagraphs.TORCH, compile_backend="inductor")
    out = captured(input_ids=ids, labels=ids, use_cache=False)
    (modules,) = given
    assert len(modules) == 5 and all(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in modules)
    expected = gm(input_ids=ids, labels=ids, use_cache=False)
    assert torch.equal(out.logits, expected.logits)


def _pipeline_captured_and_eager(rank: int, world: int, name: str, schedule: str, vpp: int) -> dict[str, Any]:
    import autotp.api

    torch.cuda.make_graphed_callables = _emulated_make_graphed_callables  # type: ignore[assignment]
    torch.cuda.graph_pool_handle = lambda: None  # type: ignore[assignment]
    cudagraphs._pool_ranges = _emulated_pool
    autotp.api._check_cuda_graphs = lambda *args: None  # type: ignore[assignment]
    model = build(name, layers=4)
    ids = torch.randint(0, vocab_size(model), (16, 12), generator=torch.Generator().manual_seed(2))
    micro = {"input_ids": ids[:2], "labels": ids[:2]}
    eager = autotp.parallelize(copy.deepcopy(model), pp=world, vpp=vpp, example_inputs=micro)
    graphed = autotp.parallelize(model, pp=world, vpp=vpp, example_inputs=micro, cuda_graphs=True)
    optimizers = [torch.optim.SGD(pm.parameters(), lr=0.1) for pm in (eager, graphed)]
    worst = 0.0
    slots = []
    for microbatches in (4, 4, 8):  # microbatches of 2 sequences: one input signature
        batch = {"input_ids": ids[: 2 * microbatches], "labels": ids[: 2 * microbatches]}
        losses = [pm.train_step(**batch, num_microbatches=microbatches, schedule=schedule) for pm in (eager, graphed)]
        grads = [pm.unshard_grads() for pm in (eager, graphed)]
        worst = max([worst, (losses[0] - losses[1]).abs().item()] + [(g - grads[1][k]).abs().max().item() for k, g in grads[0].items() if g is not None])
        slots.append(graphed.cudagraph_slots)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"worst": worst, "slots": slots, "chunks": graphed.my_chunks}


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), pytest.param("gpipe", 1, marks=pytest.mark.slow), ("interleaved", 2)])
def test_pipeline_capture_uses_a_slot_per_microbatch_in_flight(schedule: str, vpp: int) -> None:
    # With the emulation, a slot reused while its microbatch is still in flight would
    # backpropagate through another microbatch's activations and break the match.
    pp = 2
    for rank, result in enumerate(run_on_ranks(_pipeline_captured_and_eager, pp, "llama", schedule, vpp)):
        assert result["worst"] <= 1e-6, (schedule, rank, result)
        steady = schedules.slots_per_chunk(schedule, pp, vpp, rank)
        expected = {chunk * pp + rank: steady[chunk] for chunk in range(vpp)}
        if schedule == "gpipe":  # every microbatch is in flight: 4, then 8
            assert result["slots"] == [{rank: 4}, {rank: 4}, {rank: 8}], result
        else:  # as many as in flight, whatever the number of microbatches
            assert result["slots"] == [expected] * 3, (schedule, rank, result)
