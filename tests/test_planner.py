"""The planner: its choices on small worlds, its errors, the plan and calibrate commands, plan="auto"."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from autotp.cost_model import dp_sync, planner, step_estimate
from autotp.cost_model import calibrate
from autotp.cli.calibrate import add_calibrate_command
from autotp.cli.measure import scale_layer
from autotp.cli.plan import add_plan_command
from autotp.compiler import trace_for_planning
from autotp.cost_model.calibrate import fit_host
from autotp.cost_model.communication import all_reduce_s
from autotp.cost_model.compute import ModelCosts, segment_time
from autotp.cost_model.hardware import CPU, H100, PCIE, PROFILES
from autotp.cost_model.planner import (
    Cluster,
    Training,
    candidates,
    plan,
)
from distributed import run_on_ranks

import autotp
from autotp import presets
from autotp.ir.plan import KEPT_WHOLE_COMM


@pytest.fixture(scope="module")
def llama8b() -> ModelCosts:
    return trace_for_planning(presets.model_config("llama3-8b"), 2048)


@pytest.fixture(scope="module")
def llama70b() -> ModelCosts:
    return trace_for_planning(presets.model_config("llama3-70b"), 4096)


def _model_parallel(e: planner.PlanEstimate) -> int:
    return e.plan.tp * e.plan.pp


def test_tp_never_spans_nodes(llama8b: ModelCosts) -> None:
    for per_node in (2, 4, 8):
        plans = plan(llama8b, Cluster(16, per_node, H100), Training(64), top=100)
        assert plans and all(per_node % e.plan.tp == 0 for e in plans)
    with pytest.raises(ValueError, match="must not span nodes"):
        plan(llama8b, Cluster(16, 4, H100), Training(64), tp=8)


def test_plans_are_ranked_by_step_time_and_fit(llama8b: ModelCosts) -> None:
    plans = plan(llama8b, Cluster(16, 8, H100), Training(64), top=20)
    assert [e.step_s for e in plans] == sorted(e.step_s for e in plans)
    for e in plans:
        p = e.plan
        assert p.tp * p.pp * p.dp == 16
        assert e.mem_bytes_per_gpu <= H100.usable_memory_bytes
        assert e.microbatch_size * e.microbatches * p.dp == 64
        assert e.tokens_per_s == pytest.approx(64 * 2048 / e.step_s)
        assert 0 < e.mfu < 1 and 0 <= e.bubble_share < 1 and 0 <= e.comm_share < 1
        assert e.optimizer_s < e.step_s


def test_memory_pressure_asks_for_more_model_parallelism(llama8b: ModelCosts) -> None:
    # without sequence parallelism: with it, tp=4 x pp=2 is the fastest plan even with room to spare
    roomy = plan(llama8b, Cluster(8, 8, H100), Training(64, sequence_parallel=False), top=1)[0]
    tight = plan(llama8b, Cluster(8, 8, replace(H100, memory_capacity_bytes=40e9)), Training(64, sequence_parallel=False), top=1)[0]
    assert _model_parallel(tight) > _model_parallel(roomy)
    sharded = plan(llama8b, Cluster(8, 8, replace(H100, memory_capacity_bytes=40e9)),
                   Training(64, distributed_optimizer=True, sequence_parallel=False), top=1)[0]  # fmt: skip
    assert _model_parallel(sharded) <= _model_parallel(tight)
    assert sharded.mem_bytes_per_gpu <= 40e9 - H100.reserved_bytes


def test_slow_links_discourage_tensor_parallelism(llama8b: ModelCosts) -> None:
    fast = plan(llama8b, Cluster(8, 8, replace(H100, memory_capacity_bytes=40e9)), Training(64), top=1)[0]
    slow = plan(llama8b, Cluster(8, 8, replace(PCIE, memory_capacity_bytes=40e9)), Training(64), top=1)[0]
    assert slow.plan.tp <= fast.plan.tp
    assert slow.comm_share > 0


def test_fixed_degrees_are_kept(llama8b: ModelCosts) -> None:
    plans = plan(llama8b, Cluster(16, 8, H100), Training(64), tp=2, pp=2, top=50)
    assert plans and all((e.plan.tp, e.plan.pp, e.plan.dp) == (2, 2, 4) for e in plans)
    interleaved = [e for e in plans if e.plan.vpp > 1]
    assert interleaved and all(e.schedule == "interleaved" and e.microbatches % 2 == 0 for e in interleaved)
    assert all(e.schedule == "1f1b" for e in plans if e.plan.vpp == 1)


def test_plans_cover_every_layer_of_the_model(llama8b: ModelCosts) -> None:
    best = plan(llama8b, Cluster(8, 8, H100), Training(64), tp=2, pp=4, top=1)[0]
    names = {p.name for p in best.plan.params}
    assert {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(32)} <= names
    assert len(best.plan.layer_chunks) == 32 and best.plan.head_chunk == best.plan.num_chunks - 1
    assert autotp.ir.plan.ParallelPlan.from_json(best.plan.to_json()) == best.plan
    assert (best.plan.microbatches, best.plan.microbatch_size) == (best.microbatches, best.microbatch_size)
    assert best.plan.schedule == best.schedule


def test_plan_fields_round_trip_and_old_json_loads() -> None:
    full = autotp.ParallelPlan(tp=2, pp=2, microbatches=8, microbatch_size=2, schedule="gpipe", cudagraph_regions=(0, 3),
                               dp_bucket_bytes=2**20, sequence_parallel=True, distributed_optimizer=True, ep=2,
                               precision="bf16-fp32-grads")  # fmt: skip
    assert autotp.ParallelPlan.from_json(full.to_json()) == full
    old = json.loads(autotp.ParallelPlan(tp=2).to_json())
    for key in ("microbatches", "microbatch_size", "schedule", "cudagraph_regions", "dp_bucket_bytes",
                "sequence_parallel", "distributed_optimizer", "ep", "precision"):  # fmt: skip
        del old[key]
    loaded = autotp.ParallelPlan.from_json(json.dumps(old))
    assert loaded == autotp.ParallelPlan(tp=2)
    assert (loaded.microbatches, loaded.schedule_name, loaded.sequence_parallel, loaded.ep) == (1, "1f1b", False, 1)


def test_small_linears_are_replicated_when_comm_outweighs_compute() -> None:
    tiny = trace_for_planning(presets.model_config("llama-tiny"), 32)
    assert step_estimate.small_linears(tiny, 2, 1, CPU) >= {"model.layers.0.self_attn.q_proj.weight"}
    best = plan(tiny, Cluster(2, 2, CPU), Training(4, "fp32"), tp=2, top=1)[0]
    linears = {name for name, _ in tiny.linears} - {"lm_head.weight"}
    assert not linears & {p.name for p in best.plan.params}
    assert any(k.reason == KEPT_WHOLE_COMM for k in best.plan.kept_whole)


def test_large_linears_stay_sharded_and_the_router_replicated() -> None:
    mixtral = trace_for_planning(presets.model_config("mixtral-8x7b"), 4096)
    assert step_estimate.small_linears(mixtral, 8, 1, H100) == {"model.layers.0.mlp.gate.weight"}
    best = plan(mixtral, Cluster(64, 8, H100), Training(64), tp=8, top=1)[0]
    names = {p.name for p in best.plan.params}
    assert "model.layers.31.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(n.endswith("mlp.gate.weight") for n in names)


def test_llama70b_on_1024_gpus(llama70b: ModelCosts) -> None:
    plans = plan(llama70b, Cluster(1024, 8, H100), Training(1024), top=5)
    assert plans and all(e.plan.tp <= 8 and e.plan.pp > 1 for e in plans)
    assert all(e.mem_bytes_per_gpu <= H100.usable_memory_bytes for e in plans)


# ---- errors -----------------------------------------------------------------------------


def test_a_model_that_cannot_fit_says_by_how_much(llama70b: ModelCosts) -> None:
    with pytest.raises(ValueError, match=r"does not fit on 8 x H100 at any degree.*needs [\d.]+ GiB per GPU, [\d.]+ GiB more"):
        plan(llama70b, Cluster(8, 8, H100), Training(8))


def test_world_sizes_that_cannot_be_laid_out(llama8b: ModelCosts) -> None:
    with pytest.raises(ValueError, match="12 GPUs do not make whole nodes of 8"):
        plan(llama8b, Cluster(12, 8, H100), Training(24))
    with pytest.raises(ValueError, match="pp=3 does not divide"):
        plan(llama8b, Cluster(8, 8, H100), Training(24), pp=3)
    with pytest.raises(ValueError, match="no way to split a global batch of 3 over 8 GPUs"):
        plan(llama8b, Cluster(8, 8, H100), Training(3), tp=1, pp=1)
    with pytest.raises(ValueError, match="more pipeline stages than the model's 32 layers"):
        candidates(32, Cluster(64, 8, H100), 64, pp=64)


def test_tp_that_does_not_divide_the_heads_is_skipped_or_refused() -> None:
    gpt2 = trace_for_planning(presets.model_config("gpt2-small"), 128)  # 12 heads
    plans = plan(gpt2, Cluster(8, 8, H100), Training(64), top=100)
    assert {e.plan.tp for e in plans} <= {1, 2, 4}
    with pytest.raises(ValueError, match="tp=8"):
        plan(gpt2, Cluster(8, 8, H100), Training(64), tp=8)


# ---- commands ---------------------------------------------------------------------------


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="autotp")
    commands = parser.add_subparsers(dest="command", required=True)
    add_plan_command(commands)
    add_calibrate_command(commands)
    args = parser.parse_args(argv)
    return args.handler(args)


def test_plan_command_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("plan", "llama3-8b", "--gpus", "16", "--gpus-per-node", "8", "--hardware", "h100", "--global-batch", "64", "--seq", "2048")
    assert _run(*args, "--top", "3", "--explain") == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "tracing one decoder layer" in captured.err and "candidate plans" in captured.err  # progress, not silence
    lines = out.splitlines()
    assert lines[0].startswith("llama3-8b on 16 x H100 (2 nodes of 8), global batch 64 x 2048 tokens")
    assert lines[1].split() == ["#", "tp", "pp", "dp", "vpp", "mbs", "m", "step", "s", "tokens/s", "MFU", "GiB/GPU", "bubble", "comm", "host", "dist-opt", "SP", "overlap", "recomp"]
    assert [l.split()[0] for l in lines[2:5]] == ["1", "2", "3"]
    assert "tp all-reduce time per layer" in out and "bubble / compute, interleaved 1f1b" in out
    # --explain agrees with the table: the bytes of the step it assumed, and what its bubble column is
    assert re.search(r"bytes per parameter, bf16-fp32-grads \(distributed optimizer\)\s+6 \+ 12/d ", out), out
    assert "bytes per parameter, bf16 (" not in out and "the table's bubble column" in out
    assert "training step (dist-opt yes/needed): bf16-fp32-grads" in out
    assert "6 + 12/dp bytes per parameter (2 param, 4 grad, 4 fp32 master + 8 Adam state sharded over dp" in out


def test_plan_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("plan", "llama-tiny", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8", "--seq", "32", "--format", "json") == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and all({"tp", "pp", "dp", "step_s", "mem_bytes_per_gpu", "host_share", "plan"} <= set(p) for p in plans)
    assert [p["step_s"] for p in plans] == sorted(p["step_s"] for p in plans)
    assert all(p["tp"] * p["pp"] * p["dp"] == 4 for p in plans)


def test_plan_command_errors() -> None:
    with pytest.raises(ValueError, match="unknown hardware 'b200'; use one of h200, h100, a100, pcie, cpu"):
        _run("plan", "llama-tiny", "--gpus", "4", "--global-batch", "8", "--seq", "32", "--hardware", "b200")
    with pytest.raises(ValueError, match="--seq 99999 exceeds"):
        _run("plan", "llama-tiny", "--gpus", "4", "--global-batch", "8", "--seq", "99999")
    with pytest.raises(ValueError, match="--gpus must be at least 1"):
        _run("plan", "llama-tiny", "--gpus", "0", "--global-batch", "8")


def test_plan_command_reads_a_calibrated_profile(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from autotp.cost_model.hardware import save_profile

    path = tmp_path / "profile.json"
    save_profile(replace(H100, name="H100 (calibrated)"), path)
    assert _run("plan", "llama-tiny", "--gpus", "2", "--global-batch", "4", "--seq", "32", "--hardware", str(path)) == 0
    assert "2 x H100 (calibrated)" in capsys.readouterr().out


def test_a_cached_calibration_replaces_the_builtin_profile_of_its_gpu_kind(monkeypatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from autotp.cost_model.hardware import calibrated_profile_path, get_profile, save_profile

    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(tmp_path))
    assert get_profile("h100") is H100
    calibrated = replace(H100, name="NVIDIA H100 80GB HBM3 (calibrated)", op_overhead_s=9e-6)
    save_profile(calibrated, calibrated_profile_path("NVIDIA H100 80GB HBM3"))
    assert get_profile("h100") == calibrated
    assert get_profile("h100", calibrated=False) is H100
    assert get_profile("h200") is PROFILES["h200"]
    args = ("plan", "llama-tiny", "--gpus", "2", "--global-batch", "4", "--seq", "32", "--hardware", "h100")
    assert _run(*args) == 0
    assert "2 x NVIDIA H100 80GB HBM3 (calibrated)" in capsys.readouterr().out
    assert _run(*args, "--builtin-profile") == 0
    assert "2 x H100 (" in capsys.readouterr().out

    save_profile(replace(CPU, name="CPU (calibrated)", op_overhead_s=3e-6), calibrated_profile_path("CPU"))
    assert planner.detect_hardware(torch.device("cpu")).op_overhead_s == 3e-6


def test_builtin_h200_tp_collective_host_cost_is_the_recorded_calibration() -> None:
    """The one H200 constant a single GPU cannot measure comes from ``autotp calibrate`` on 4x H200."""
    from pathlib import Path

    from autotp.cli.measure import fitted_profile

    recorded = json.loads((Path(__file__).parents[1] / "benchmarks/results/cost_model_h200x4.json").read_text())
    fitted = fitted_profile(recorded["calibration"], recorded["calibrated_ranks"])
    assert PROFILES["h200"].collective_host_s == pytest.approx(fitted.collective_host_s, rel=5e-3)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_builtin_single_gpu_constants_are_the_recorded_measurement(gpu: str) -> None:
    """Each profile's own constants are ``measure_constants.py --fit`` of the saved measurement of its GPU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from measure_constants import fit

    from autotp.cost_model import hardware

    constants = {"h100": hardware.H100_MEASURED, "h200": {**hardware.H200_MEASURED, **hardware.COMPILED_HOST}}[gpu]
    recorded = Path(__file__).parents[1] / f"benchmarks/results/cost_model_constants_{gpu}x1.json"
    fitted = fit(json.loads(recorded.read_text()))
    for field, value in constants.items():
        if field == "matmul_curve":
            assert np.allclose(np.array(value), np.array(fitted[field]), rtol=1e-3), field
        else:
            assert value == pytest.approx(fitted[field], rel=5e-3), field
        assert getattr(PROFILES[gpu], field) == value, field


# ---- parallelize(plan="auto") -----------------------------------------------------------


def test_auto_plan_keeps_given_degrees_and_plans_the_rest() -> None:
    model = presets.build_model("llama-tiny")
    ids = torch.zeros((4, 32), dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}
    tp2 = autotp.compile_rank(model, tp=2, example_inputs=inputs, plan="auto")
    assert (tp2.plan.tp, tp2.plan.pp) == (2, 1)
    assert any("planned for CPU" in n for n in tp2.plan.notes)
    pp2 = autotp.compile_rank(model, tp=1, pp=2, example_inputs=inputs, plan="auto")
    assert (pp2.plan.tp, pp2.plan.pp, pp2.plan.layer_chunks) == (1, 2, (0, 1))


def test_a_compiled_model_is_planned_as_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """``parallelize(..., compile=True)`` prices its ranks as inductor runs them (``cost_model.fused_kernels``):
    the planner and the sequence-parallel choice are told so."""
    from autotp import compiler

    asked: list[bool] = []
    planned = compiler.auto_plan

    def recording(*args, **kwargs):
        asked.append(kwargs["compiled"])
        return planned(*args, **kwargs)

    monkeypatch.setattr(compiler, "auto_plan", recording)
    model = presets.build_model("llama-tiny")
    ids = torch.zeros((4, 32), dtype=torch.long)
    for compiled in (False, True):
        compiler.plan_model(model, {"input_ids": ids, "labels": ids}, "cpu", tp=1, pp=1, dp=1, vpp=1, plan="auto", compiled=compiled)
    assert asked == [False, True]


def _auto_worker(rank: int, world: int) -> tuple[float, float, tuple[int, int, int]]:
    torch.manual_seed(0)
    model = presets.build_model("llama-tiny", device="cpu", dtype=torch.float32)
    ids = presets.example_inputs(model, batch=4, seq=16)["input_ids"]
    reference = model(input_ids=ids, labels=ids).loss.item()
    pm = autotp.parallelize(model, plan="auto", example_inputs={"input_ids": ids, "labels": ids})
    loss = pm.train_step(input_ids=ids, labels=ids).item()  # the plan's microbatches and schedule
    return loss, reference, (pm.plan.tp, pm.plan.pp, pm.plan.dp)


def test_parallelize_auto_trains_with_the_planned_degrees() -> None:
    results = run_on_ranks(_auto_worker, 2)
    for loss, reference, degrees in results:
        assert loss == pytest.approx(reference, abs=1e-4)
        assert degrees[0] * degrees[1] * degrees[2] == 2
    assert len({r[2] for r in results}) == 1


def test_grad_sync_is_a_queue_of_buckets() -> None:
    """2.5 buckets of bf16 grads over dp=2 in a node: GPU-bound, the GPU times add; host-bound, the host's."""
    bucket = planner.DP_BUCKET_BYTES
    params, tensors = int(2.5 * bucket / 2), 10
    training = Training(global_batch=8)
    gpu_only = replace(H100, op_overhead_s=0.0)
    link = gpu_only.intra_node
    moved = dp_sync.GRAD_SYNC_BYTES_MOVED / gpu_only.memory_bytes_per_s
    expected = 2 * (all_reduce_s(bucket, 2, link) + bucket * moved) + all_reduce_s(bucket / 2, 2, link) + bucket / 2 * moved
    assert dp_sync.grad_sync_s(params, tensors, 2, 2, training.precision, gpu_only) == pytest.approx(expected)
    host_bound = replace(H100, op_overhead_s=1.0)
    ops = 3 * dp_sync.GRAD_SYNC_BUCKET_OPS + dp_sync.GRAD_SYNC_TENSOR_OPS * tensors
    assert dp_sync.grad_sync_s(params, tensors, 2, 2, training.precision, host_bound) == pytest.approx(ops, rel=1e-3)
    assert dp_sync.grad_sync_s(params, tensors, 1, 1, training.precision, host_bound) == 0.0


def test_fit_host_recovers_per_node_costs_from_layer_differences() -> None:
    """Fixed per-call costs (5 ms) cancel; per node 10/20 us, per tp collective 100 us."""
    def run(tp: int, layers: int) -> dict:
        calls, grads, g, f = 30 + 60 * layers, 20 + 58 * layers, 2 * layers * (tp > 1), 2 * layers * (tp > 1)
        forward = 5e-3 + (calls - g) * 10e-6 + g * 100e-6
        return {"tp": tp, "layers": layers, "forward_s": forward, "both_s": forward + 5e-3 + (grads - f) * 20e-6 + f * 100e-6,
                "calls": calls, "grad_calls": grads, "forward_collectives": g, "backward_collectives": f}

    fitted = fit_host([run(tp, layers) for tp in (1, 4) for layers in (2, 6)])
    assert fitted["op_overhead_s"] == pytest.approx(10e-6)
    assert fitted["backward_op_overhead_s"] == pytest.approx(20e-6)
    assert fitted["collective_host_s"] == pytest.approx(100e-6)
    assert fitted["call_host_s"] == pytest.approx(10e-3)  # 5 ms forward + 5 ms backward


def test_fit_compute_time_scale_recovers_the_scale_of_a_layer() -> None:
    """A layer that runs 1.3x the roofline (plus 50 ms of fixed cost per call) gives back 1.3."""
    profile = replace(PROFILES["h200"], op_overhead_s=10e-6, backward_op_overhead_s=20e-6)
    model = calibrate.SCALE_MODEL
    layer = scale_layer()
    per_layer = segment_time(layer, model["batch"], replace(profile, compute_time_scale=1.3), 1).total_s
    runs = [{"layers": n, "both_s": 0.05 + n * per_layer} for n in calibrate.SCALE_LAYERS]
    assert calibrate.fit_compute_time_scale(profile, runs, layer) == pytest.approx(1.3, rel=1e-6)
    # The scale multiplies GPU compute only.
    base, scaled = (segment_time(layer, 2, replace(profile, compute_time_scale=k), 1) for k in (1.0, 2.0))
    assert scaled.compute_s == pytest.approx(2 * base.compute_s) and scaled.host_s == base.host_s


def test_cuda_graph_buffers_count_once_per_microbatch_in_flight(llama8b: ModelCosts) -> None:
    cluster, config = Cluster(8, 8, H100), planner.Config(tp=4, pp=2, dp=1, vpp=1, microbatch_size=1, microbatches=8)
    plain = planner.estimate(llama8b, cluster, Training(8), config)
    graphed = planner.estimate(llama8b, cluster, Training(8, cuda_graph_bytes=1e9), config)
    assert graphed.mem_bytes_per_gpu - plain.mem_bytes_per_gpu == pytest.approx(2e9)  # 1F1B: rank 0 holds 2


def test_rank_params_count_a_traced_layer_once_per_chunk_it_stands_for() -> None:
    from autotp.cost_model.step_estimate import _rank_params

    layer, embedding = {"layers.0.w": 100}, {"embed.w": 10}
    # interleaved: two chunks on the rank, each one copy of the same traced layer; the tied embedding in both
    chunks = [[(layer, 1, True), (embedding, 1, False)], [(layer, 1, True), (embedding, 1, False)]]
    assert _rank_params(chunks) == (210, 3)


def test_the_memory_bounds_that_drop_candidates_are_lower_bounds(llama8b: ModelCosts) -> None:
    """``search`` counts a draft over memory by its floor or bound when either exceeds the capacity: both are at
    most the memory it replays, on every candidate and variant, with CUDA-graph buffers too."""
    from autotp.cost_model.step_estimate import Variant, _draft, sequence_options

    cluster = Cluster(64, 8, H100)
    for training in (Training(256, "bf16-fp32-grads", None), Training(256, "fp32", None, cuda_graph_bytes=1e8)):
        for config in candidates(llama8b.num_layers, cluster, training.global_batch):
            for (sp, overlap), distributed in itertools.product(sequence_options(training, config.tp), [False, True][: 1 + (config.dp > 1)]):
                draft = _draft(llama8b, cluster, training, config, Variant(frozenset(), distributed, sp, overlap))
                assert draft.floor <= draft.bound() <= draft.memory(), (config, sp, overlap, distributed)
