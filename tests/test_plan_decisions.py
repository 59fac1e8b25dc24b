"""The plan holds every decision: CUDA-graph regions chosen by the cost model before the
passes that read them, and the hardware the plan is costed for."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import autotp
from autotp.compiler import compile_steps
from autotp.cost_model import hardware
from autotp.cost_model.cudagraphs import RegionStats, choose_cudagraph_regions, estimate
from autotp.ir import meta_keys
from autotp.ir.plan import DEFAULT_HARDWARE, CudaGraphPolicy, ParallelPlan
from autotp.passes.find_cudagraph_candidates import candidate_regions, find_cudagraph_candidates
from autotp.passes.mark_cudagraph_regions import mark_cudagraph_regions
from autotp.passes.runner import PassContext


def _candidates() -> tuple[torch.fx.GraphModule, ParallelPlan]:
    compiled = autotp.compile_rank(autotp.presets.build_model("llama-tiny"), tp=2)
    plan = replace(compiled.plan, cudagraphs=True)
    gm = find_cudagraph_candidates(compiled.graph, PassContext(plan=plan, backend="gloo"))  # gloo: collectives block
    assert len(candidate_regions(gm)) > 2
    return gm, plan


def _regions(gm: torch.fx.GraphModule) -> set[int]:
    return {n.meta[meta_keys.CUDAGRAPH_REGION] for n in gm.graph.nodes if n.meta.get(meta_keys.CUDAGRAPH_REGION) is not None}


def test_marking_reads_the_regions_the_plan_holds() -> None:
    gm, plan = _candidates()
    marked = mark_cudagraph_regions(gm, PassContext(plan=replace(plan, cudagraph_regions=(0, 2))))
    assert _regions(marked) == {0, 2}
    assert all(n.meta.get(meta_keys.CUDAGRAPH_REGION) == 2 for n in candidate_regions(marked)[2])


def test_the_cost_model_decides_between_the_passes() -> None:
    names = [p.__name__ for p in compile_steps()]
    assert names.index("find_cudagraph_candidates") < names.index("choose_cudagraph_regions") < names.index("mark_cudagraph_regions")
    gm, plan = _candidates()
    ctx = PassContext(plan=plan, backend="gloo")
    assert choose_cudagraph_regions(gm, ctx) is gm and ctx.plan.cudagraph_regions  # the decision is in the plan
    assert _regions(gm) == set()  # the graph is untouched until the pass that reads it
    assert not hasattr(ctx, "choose_cudagraph_regions")  # no policy callback reaches the passes


def test_hardware_is_recorded_and_costs_differ_by_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ParallelPlan().hardware == DEFAULT_HARDWARE
    plan = ParallelPlan(tp=2, hardware="h100")
    assert ParallelPlan.from_json(plan.to_json()) == plan
    old = json.loads(ParallelPlan(tp=2).to_json())  # before plan.hardware, the policy held it
    del old["hardware"]
    old["cudagraph_policy"]["hardware"] = "h100"
    assert ParallelPlan.from_json(json.dumps(old)) == plan
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert hardware.device_hardware(torch.device("cuda", 0)) == "h100"
    assert hardware.device_hardware(torch.device("cpu")) is None
    assert hardware.profile_key(hardware.H200) == "h200"
    assert hardware.profile_key(replace(hardware.H100, name="NVIDIA H100 80GB HBM3 (calibrated)")) == "h100"
    stats = RegionStats(nodes=10, launches=30, gpu_s=1e-4, needs_grad=True, copy_bytes=2**26, static_bytes=2**27)
    policy = CudaGraphPolicy()
    assert estimate(stats, policy, "h100").graph_s > estimate(stats, policy, "h200").graph_s  # H100's HBM is slower
