"""Cost-model formulas against hand-computed cases (autotp.cost_model)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import sympy
import torch
from autotp.cost_model import closed_forms as cf
from autotp.cost_model.bubble import bubble_fraction, pipeline_time_s
from autotp.cost_model.communication import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    group_all_reduce_s,
    p2p_s,
    reduce_scatter_s,
    ring_all_reduce_s,
    tree_all_reduce_s,
)
from autotp.cost_model.compute import ModelCosts, queue_s, segment_time
from autotp.cost_model.flops import global_tensors, node_cost
from autotp.cost_model.hardware import (
    H100,
    H200,
    H200_ALLREDUCE_CURVE,
    PROFILES,
    Link,
    fit_link,
    get_profile,
    load_profile,
    profile_from_json,
    save_profile,
)
from autotp.cost_model import memory
from autotp.cost_model.memory import bytes_per_param, in_flight

from autotp import presets
from autotp.ir import schedules
from autotp.ir.plan import OVERLAP_ALL_GATHER, OVERLAP_REDUCE_SCATTER
from autotp.analysis.trace import trace
from autotp import compiler
from autotp.compiler import model_costs

MB = 2**20


# ---- communication ---------------------------------------------------------------------


def test_ring_all_reduce_is_alpha_plus_2_t_minus_1_over_t_n_over_b() -> None:
    link = Link(latency_s=25e-6, bus_bytes_per_s=353e9)
    assert ring_all_reduce_s(MB, 4, link) == pytest.approx(25e-6 + 1.5 * MB / 353e9)
    assert ring_all_reduce_s(MB, 2, link) == pytest.approx(25e-6 + 1.0 * MB / 353e9)
    assert ring_all_reduce_s(MB, 1, link) == 0.0


def test_tree_and_ring_latency_terms_and_the_cheaper_one_wins() -> None:
    link = Link(latency_s=10e-6, bus_bytes_per_s=100e9, hop_latency_s=2e-6)
    # 64 ranks: ring 2*63 steps, tree 2*log2(64) = 12 steps
    assert ring_all_reduce_s(8e6, 64, link) == pytest.approx(10e-6 + 126 * 2e-6 + 2 * 63 / 64 * 8e6 / 100e9)
    assert tree_all_reduce_s(8e6, 64, link) == pytest.approx(10e-6 + 12 * 2e-6 + 2 * 8e6 / 100e9)
    assert all_reduce_s(1e3, 64, link) == tree_all_reduce_s(1e3, 64, link)  # small: latency-bound, tree
    assert all_reduce_s(1e10, 64, link) == ring_all_reduce_s(1e10, 64, link)  # large: the ring sends less


def test_reduce_scatter_all_gather_all_to_all_and_p2p() -> None:
    link = Link(latency_s=5e-6, bus_bytes_per_s=200e9, hop_latency_s=1e-6)
    expected = 5e-6 + 7 * 1e-6 + 7 / 8 * 64 * MB / 200e9
    for fn in (reduce_scatter_s, all_gather_s, all_to_all_s):
        assert fn(64 * MB, 8, link) == pytest.approx(expected)
    assert p2p_s(64 * MB, link) == pytest.approx(5e-6 + 64 * MB / 200e9)
    # an all-reduce is a reduce-scatter then an all-gather, up to one call's latency
    ring = ring_all_reduce_s(64 * MB, 8, link)
    assert ring == pytest.approx(reduce_scatter_s(64 * MB, 8, link) + all_gather_s(64 * MB, 8, link) - link.latency_s)


def test_group_all_reduce_is_hierarchical_across_nodes() -> None:
    n = 100 * MB
    intra, inter = H100.intra_node, H100.inter_node
    assert group_all_reduce_s(n, 8, 8, H100) == all_reduce_s(n, 8, intra)
    assert group_all_reduce_s(n, 4, 1, H100) == all_reduce_s(n, 4, inter)
    expected = reduce_scatter_s(n, 8, intra) + all_reduce_s(n / 8, 2, inter) + all_gather_s(n, 8, intra)
    assert group_all_reduce_s(n, 16, 8, H100) == pytest.approx(expected)
    assert group_all_reduce_s(n, 16, 8, H100) > group_all_reduce_s(n, 8, 8, H100)


# ---- hardware --------------------------------------------------------------------------


def test_h200_alpha_beta_reproduces_the_measured_all_reduce_curve() -> None:
    """DESIGN.md §5: 54 GB/s at 1 MB ... 353 GB/s at 1 GB on 4 ranks."""
    for profile_link in (H200.intra_node, fit_link(H200_ALLREDUCE_CURVE, 4)):
        for nbytes, bus in H200_ALLREDUCE_CURVE:
            measured = 1.5 * nbytes / bus
            assert ring_all_reduce_s(nbytes, 4, profile_link) == pytest.approx(measured, rel=0.06)
    assert 21e-6 <= H200.collective_latency_s <= 29e-6
    assert 600e12 < H200.matmul_flops_per_s < H200.peak_flops_per_s  # the measured curve's rate, below the datasheet's



def test_profiles_separate_intra_and_inter_node_links_and_cite_sources() -> None:
    for profile in PROFILES.values():
        assert profile.source
        assert profile.inter_node.bus_bytes_per_s < profile.intra_node.bus_bytes_per_s or profile is PROFILES["cpu"]
    assert set(PROFILES) >= {"h100", "h200", "a100", "pcie", "cpu"}


def test_unknown_hardware_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown hardware 'tpu'.*h200.*h100.*a100.*pcie.*cpu"):
        get_profile("tpu")


def test_profile_json_round_trip(tmp_path: Path) -> None:
    profile = replace(H200, name="H200 (calibrated)", p2p=Link(9e-6, 120e9), op_overhead_s=7e-6, matmul_curve=((1e9, 1e-5), (1e12, 1e-3)))
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert get_profile(str(path)) == profile
    with pytest.raises(ValueError, match="unknown hardware profile keys"):
        profile_from_json({"name": "x", "bogus": 1})
    with pytest.raises(ValueError, match="does not exist"):
        get_profile(str(tmp_path / "missing.json"))


# ---- memory ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "plain", "replicated", "sharded"),
    [("bf16", 20, 4, 16), ("bf16-fp32-grads", 18, 6, 12), ("fp32", 16, 8, 8)],
)
def test_bytes_per_param_follow_megatrons_table(precision: str, plain: int, replicated: int, sharded: int) -> None:
    """The seed's table: 20 / 4 + 16/d, 18 / 6 + 12/d, 16 / 8 + 8/d."""
    assert bytes_per_param(precision) == plain
    for d in (1, 2, 8, 64):
        assert bytes_per_param(precision, True, d) == pytest.approx(replicated + sharded / d)
    assert bytes_per_param(precision, True, 1) == plain


def test_unknown_precision() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp8'.*bf16"):
        bytes_per_param("fp8")


def _max_outstanding(order: list[schedules.Action]) -> int:
    live = peak = 0
    for action in order:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 4), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (4, 3, 4)])
def test_in_flight_matches_the_schedules_orders(pp: int, vpp: int, m: int) -> None:
    name = schedules.default_schedule(vpp)
    if name == "1f1b" and m < pp:
        name = "gpipe"
    for rank in range(pp):
        order = schedules.schedule(name, pp, vpp, m, rank)
        assert in_flight(name, pp, vpp, m, rank) == _max_outstanding(order)


def test_in_flight_formulas() -> None:
    assert in_flight("1f1b", 8, 1, 32, 0) == 8
    assert in_flight("1f1b", 8, 1, 32, 7) == 1
    assert in_flight("interleaved", 4, 2, 16, 0) == (4 - 0 - 1) * 2 + (2 - 1) * 4 + 1
    assert in_flight("gpipe", 4, 1, 16, 0) == 16
    assert in_flight(None, 1, 1, 16, 0) == 1


def _moments_by_walking(name: str | None, pp: int, vpp: int, m: int, rank: int) -> list[tuple]:
    """The distinct (kind, chunk, held, deferred, grads, first) of a rank's schedule, one action at a time."""
    actions = [schedules.Action(k, 0, i) for i in range(m) for k in "FB"] if name is None else schedules.schedule(name, pp, vpp, m, rank)
    chunks = vpp if name == "interleaved" else 1
    held, deferred, grads = [0] * chunks, [0] * chunks, [False] * chunks
    seen: dict[tuple, None] = {}
    for a in actions:
        c = a.chunk
        if a.kind == "F":
            seen["F", c, tuple(held), tuple(deferred), tuple(grads), False] = None
            held[c] += 1
            continue
        if a.kind == "B":
            held[c] -= 1
        else:
            deferred[c] -= 1
        seen[a.kind, c, tuple(held), tuple(deferred), tuple(grads), not grads[c]] = None
        if a.kind == "B" and name == "zbh1":
            deferred[c] += 1
        else:
            grads[c] = True
    return list(seen)


@pytest.mark.parametrize("name", [None, "gpipe", "1f1b", "zbh1", "interleaved"])
def test_moment_arrays_are_the_schedules_distinct_moments_in_order(name: str | None) -> None:
    for pp, vpp, m in [(1, 1, 3), (2, 1, 4), (4, 1, 2), (4, 1, 9), (8, 1, 32), (2, 2, 4), (4, 3, 8), (3, 5, 6), (4, 10, 16)]:
        if (name is None) != (pp == 1) or (vpp > 1) != (name == "interleaved") or (name != "gpipe" and m < pp) or (name == "interleaved" and m % pp):
            continue
        for rank in range(pp):
            arrays = memory.moment_arrays(name, pp, vpp, m, rank)
            kinds = np.where(arrays.forward, "F", np.where(arrays.weight, "W", "B"))
            rows = [(str(k), int(c), tuple(map(int, h)), tuple(map(int, d)), tuple(map(bool, g)), bool(f))
                    for k, c, h, d, g, f in zip(kinds, arrays.chunk, arrays.held, arrays.deferred, arrays.grads, arrays.first)]  # fmt: skip
            assert rows == _moments_by_walking(name, pp, vpp, m, rank), (name, pp, vpp, m, rank)
            assert arrays.in_flight == max(sum(r[2]) + (r[0] == "F") for r in rows) == memory.held_in_flight(name, pp, vpp, m, rank)


# ---- bubble ----------------------------------------------------------------------------


def test_bubble_fractions() -> None:
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 16)
    with pytest.raises(ValueError, match="unknown schedule"):
        bubble_fraction("zero-bubble", 4, 8)


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 1, 4), (4, 1, 8), (4, 2, 8), (2, 3, 4)])
def test_pipeline_time_matches_the_simulated_schedule(pp: int, vpp: int, m: int) -> None:
    """Unit forward and backward: the step count of ``simulate`` and the closed form agree."""
    name = schedules.default_schedule(vpp)
    steps = schedules.simulate(pp, vpp, m, lambda r: schedules.schedule(name, pp, vpp, m, r))
    step, bubble = pipeline_time_s([2.0] * (pp * vpp), [2.0] * (pp * vpp), pp, vpp, m)
    assert step == steps
    assert bubble / (step - bubble) == pytest.approx(bubble_fraction(name, pp, m, vpp))


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_zbh1_time_and_memory_match_its_simulated_order(pp: int, m: int) -> None:
    """F, B and W one step each (a chunk's forward+backward is 3 steps): the closed form
    gives the simulated step count, a third of 1F1B's bubble, and 1F1B's peak memory."""
    steps = schedules.simulate(pp, 1, m, lambda r: schedules.schedule("zbh1", pp, 1, m, r))
    step, bubble = pipeline_time_s([3.0] * pp, [3.0] * pp, pp, 1, m, "zbh1")
    assert step == steps == 3 * m + pp - 1
    assert bubble / (step - bubble) == pytest.approx(bubble_fraction("zbh1", pp, m)) == pytest.approx(bubble_fraction("1f1b", pp, m) / 3)
    for rank in range(pp):
        live = peak = 0
        for a in schedules.schedule("zbh1", pp, 1, m, rank):
            live += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        assert in_flight("zbh1", pp, 1, m, rank) == peak == int(cf.IN_FLIGHT["zbh1"].subs({cf.p: pp, cf.m: m}))
    assert float(cf.BUBBLE["zbh1"].subs({cf.p: pp, cf.m: m})) == pytest.approx(bubble_fraction("zbh1", pp, m))


def test_unequal_stages_are_paced_by_the_slowest() -> None:
    step, bubble = pipeline_time_s([1.0, 3.0], [1.0, 3.0], 2, 1, 4)
    assert step == pytest.approx(4 * 3.0 + 1 * 2.0)
    assert bubble == pytest.approx(2.0)


def test_fill_and_drain_cost_gpu_time_only() -> None:
    """Host-bound chunks (GPU busy 0.5 of each 3 s): the bubble is (p-1)·mean(G)/v, not of S."""
    step, bubble = pipeline_time_s([3.0, 3.0, 3.0, 3.0], [0.5, 0.5, 0.5, 0.5], 2, 2, 4)
    assert bubble == pytest.approx(1 * (1.0 + 1.0) / 2 / 2)
    assert step == pytest.approx(4 * 6.0 + 0.5)


# ---- closed forms ----------------------------------------------------------------------


def test_closed_forms_agree_with_the_functions() -> None:
    link = Link(25e-6, 353e9)
    values = {cf.alpha: 25e-6, cf.B: 353e9, cf.t: 4, cf.n: 8 * MB}
    assert float(cf.RING_ALL_REDUCE_S.subs(values)) == pytest.approx(ring_all_reduce_s(8 * MB, 4, link))
    for name, (plain, distributed) in cf.BYTES_PER_PARAM.items():
        assert float(plain) == bytes_per_param(name)
        assert float(distributed.subs(cf.d, 16)) == pytest.approx(bytes_per_param(name, True, 16))
    for p, v, m, r in ((4, 1, 8, 0), (4, 1, 8, 3), (4, 2, 8, 1)):
        name = schedules.default_schedule(v)
        assert int(cf.IN_FLIGHT[name].subs({cf.p: p, cf.v: v, cf.m: m, cf.r: r})) == in_flight(name, p, v, m, r)
        assert float(cf.BUBBLE[name].subs({cf.p: p, cf.v: v, cf.m: m})) == pytest.approx(bubble_fraction(name, p, m, v))
        share = cf.BUBBLE[name] / (1 + cf.BUBBLE[name])
        assert sympy.simplify(cf.BUBBLE_SHARE[name] - share) == 0
    assert sympy.simplify(cf.TP_ALL_REDUCE_BYTES_PER_LAYER.subs(cf.e, 2) - 8 * cf.b * cf.s * cf.h) == 0
    text = cf.explain({cf.b: 1, cf.s: 2048, cf.h: 4096, cf.e: 2, cf.t: 8, cf.alpha: 25e-6, cf.B: 353e9})
    line = next(l for l in text.splitlines() if l.startswith("tp all-reduce time per layer"))
    expected = 4 * (25e-6 + 2 * 7 / 8 * 2048 * 4096 * 2 / 353e9)
    assert sympy.sstr(cf.TP_COMM_S_PER_LAYER) in line and float(line.rsplit("= ", 1)[1]) == pytest.approx(expected, rel=1e-3)


@pytest.fixture(scope="module")
def llama_tiny() -> ModelCosts:
    model = presets.build_model("llama-tiny", dtype=torch.bfloat16)
    ids = torch.zeros((2, 32), dtype=torch.long)
    return model_costs(trace(model, {"input_ids": ids, "labels": ids, "use_cache": False}, "meta"))


def test_tp_comm_per_layer_is_megatrons_closed_form(llama_tiny: ModelCosts) -> None:
    """2 forward + 2 backward all-reduces of b·s·h per decoder layer, as the compiled graph has them."""
    layer = llama_tiny.rank(2).layers[0]
    kinds = sorted((c.kind, c.direction) for c in layer.collectives)
    assert kinds == [("all_reduce", "backward")] * 2 + [("all_reduce", "forward")] * 2
    per_sample = sum(c.bytes.per_sample for c in layer.collectives)
    assert per_sample == int(cf.TP_ALL_REDUCE_BYTES_PER_LAYER.subs({cf.b: 1, cf.s: 32, cf.h: 64, cf.e: 2}))


# ---- compute ---------------------------------------------------------------------------


def test_costs_scale_exactly_with_the_microbatch_size(llama_tiny: ModelCosts) -> None:
    """Costs traced at batch 2 and scaled to 6 equal the costs of a trace at batch 6."""
    model = presets.build_model("llama-tiny", dtype=torch.bfloat16)
    ids = torch.zeros((6, 32), dtype=torch.long)
    direct = trace(model, {"input_ids": ids, "labels": ids, "use_cache": False}, "meta")
    calls = [n for n in direct.graph.nodes if n.op == "call_function"]
    assert llama_tiny.forward_flops(6) == pytest.approx(sum(node_cost(n).flops for n in calls))
    six = model_costs(direct)
    for tp in (1, 2):
        for scaled, exact in zip(llama_tiny.rank(tp).layers + (llama_tiny.rank(tp).head,), six.rank(tp).layers + (six.rank(tp).head,)):
            assert (scaled.flops[:, 0] + 6 * scaled.flops[:, 1]).sum() == pytest.approx((exact.flops[:, 0] + 6 * exact.flops[:, 1]).sum())
            assert (scaled.bytes[:, 0] + 6 * scaled.bytes[:, 1]).sum() == pytest.approx((exact.bytes[:, 0] + 6 * exact.bytes[:, 1]).sum())
            at6 = np.array([1.0, 6.0])
            assert scaled.memory.saved @ at6 == pytest.approx(exact.memory.saved @ at6)
            assert np.max(scaled.memory.backward @ at6) == pytest.approx(np.max(exact.memory.backward @ at6))
    embedding = next(n for n in calls if n.target is torch.ops.aten.embedding.default)
    assert llama_tiny.hidden_bytes == sum(t.nbytes for t in global_tensors(embedding)) / 6


def test_tensor_parallelism_shards_params_compute_and_activations(llama_tiny: ModelCosts) -> None:
    one, two = llama_tiny.rank(1).layers[0], llama_tiny.rank(2).layers[0]
    assert two.param_numel * 2 == pytest.approx(one.param_numel, rel=0.05)  # norm weights stay whole
    assert two.flops[:, 1].sum() < 0.6 * one.flops[:, 1].sum()
    assert two.memory.saved[1] < one.memory.saved[1]
    assert not one.collectives


def test_segment_time_is_host_bound_when_launches_dominate(llama_tiny: ModelCosts) -> None:
    layer = llama_tiny.rank(1).layers[0]
    slow_host = replace(H100, op_overhead_s=1e-3, backward_op_overhead_s=2e-3)
    t = segment_time(layer, 2, slow_host, 1)
    assert t.host_s == pytest.approx(layer.ops * 1e-3 + layer.grad_ops * 2e-3)
    assert t.total_s == pytest.approx(t.host_s, rel=1e-3)
    assert 0 < layer.grad_ops <= layer.ops
    fast_host = replace(H100, op_overhead_s=0.0, backward_op_overhead_s=0.0)
    assert segment_time(layer, 2, fast_host, 1).total_s == pytest.approx(segment_time(layer, 2, fast_host, 1).compute_s)


def test_queue_is_the_single_stream_recurrence() -> None:
    """The GPU starts node i when it finished i-1 and the host has issued i."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        host, gpu = rng.exponential(1.0, 30), rng.exponential(1.0, 30)
        issued = finished = 0.0
        for h, g in zip(host, gpu):
            issued += h
            finished = max(finished, issued) + g
        assert queue_s(host, gpu) == pytest.approx(finished)
    assert queue_s(np.ones(4), np.zeros(4)) == 4.0  # launch-bound
    assert queue_s(np.zeros(4), np.ones(4)) == 4.0  # GPU-bound
    assert queue_s(np.array([1.0, 1.0]), np.array([5.0, 0.5])) == 6.5  # the GEMM hides the next launch


def test_matmul_time_interpolates_the_measured_curve() -> None:
    curve = ((1e9, 10e-6), (1e11, 200e-6), (1e12, 1.5e-3))
    hw = replace(H100, matmul_curve=curve)
    times = hw.matmul_time_s(np.array([1e9, 1e10, 1e11, 1e12, 4e12, 1e6]))
    assert times[0] == pytest.approx(10e-6) and times[2] == pytest.approx(200e-6) and times[3] == pytest.approx(1.5e-3)
    assert times[1] == pytest.approx(math.sqrt(10e-6 * 200e-6))  # halfway in log-log
    assert times[4] == pytest.approx(6e-3)  # the largest GEMM's rate beyond the curve
    assert times[5] == pytest.approx(10e-6)  # the launch floor below it
    assert replace(H100, matmul_curve=(), matmul_latency_s=0.0).matmul_time_s(np.array([805e12]))[0] == pytest.approx(805e12 / 712.5e12)


def test_roofline_with_backward_twice_forward(llama_tiny: ModelCosts) -> None:
    layer = llama_tiny.rank(1).layers[0]
    hw = replace(H100, op_overhead_s=0.0, backward_op_overhead_s=0.0, attention_backward_factor=2.0, elementwise_backward_factor=2.0,
                 compute_time_scale=1.0, matmul_curve=(), matmul_latency_s=0.0, attention_latency_s=0.0)
    flops = layer.flops[:, 0] + 4 * layer.flops[:, 1]
    nbytes = layer.bytes[:, 0] + 4 * layer.bytes[:, 1]
    rates = [hw.attention_rate if k == 2 else hw.matmul_flops_per_s for k in layer.kinds]
    forward = sum(max(f / rate, b / hw.memory_bytes_per_s) for f, b, rate in zip(flops, nbytes, rates))
    sums = float(np.sum(layer.grad_sums[:, 0] + 4 * layer.grad_sums[:, 1])) / hw.memory_bytes_per_s
    assert segment_time(layer, 4, hw, 1).compute_s == pytest.approx(3 * forward + sums)
    assert math.isfinite(forward) and forward > 0 and sums > 0


def test_backward_sums_the_gradients_of_a_tensor_read_by_several_ops() -> None:
    """A tensor read by k differentiable ops costs k - 1 gradient adds in the backward (3 bytes moved per byte),
    as autograd runs them: counted at dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotp.cost_model.saved_tensors import needs_grad
    from autotp.cost_model.gradient_sums import gradient_sum_bytes

    class ThreeReaders(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(8, 8, bias=False) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(x @ self.a.weight)  # needs a gradient: read by three linears
            return (self.a(h) + self.b(h) + self.c(h)).sum()

    x = torch.randn(5, 8)
    gm = torch.export.export(ThreeReaders(), (x,)).module()
    grad = needs_grad(gm)
    relu = next(n for n in gm.graph.nodes if "relu" in str(n.target))
    assert gradient_sum_bytes(relu, global_tensors, grad) == (3 * 2 * x.nbytes,)
    sums = [0]

    class CountSums(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor) and args[0].shape == x.shape:
                sums[0] += 1
            return func(*args, **(kwargs or {}))

    loss = ThreeReaders()(x)
    with CountSums():
        loss.backward()
    assert sums[0] == 2


def test_attention_kernels_pay_their_latency_forward_and_backward(llama_tiny: ModelCosts) -> None:
    layer = llama_tiny.rank(1).layers[0]
    hw = replace(H100, attention_latency_s=0.0, compute_time_scale=1.0)
    slow = replace(hw, attention_latency_s=1e-3)  # far above the tiny kernels' FLOP time and bytes
    attentions = int(np.sum(layer.kinds == 2))
    assert attentions >= 1
    extra = segment_time(layer, 4, slow, 1).compute_s - segment_time(layer, 4, hw, 1).compute_s
    assert extra == pytest.approx(attentions * 1e-3 * (1 + hw.attention_backward_factor), rel=1e-3)


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16-pure")])
def test_optimizer_bytes_are_what_foreach_adamw_moves(dtype: torch.dtype, precision: str) -> None:
    """``adamw_bytes_per_param``: the bytes of parameter-sized tensors torch's foreach AdamW reads and writes
    per step, counted at dispatch (an in-place op writes its first operand too; views move nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotp.cost_model.dp_sync import adamw_bytes_per_param

    numel = 37  # a prime: no other tensor of the step has a multiple of it
    params = [torch.nn.Parameter(torch.randn(numel, dtype=torch.float32).to(dtype)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(numel).to(dtype)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    optimizer.step()  # the first step creates the moments
    moved = [0]

    def sized(t: object) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() == numel

    class CountBytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
                written = torch.utils._pytree.tree_leaves(args[0]) if func._schema.name.endswith("_") else []
                moved[0] += sum(t.numel() * t.element_size() for t in leaves + written if sized(t))
            return out

    with CountBytes():
        optimizer.step()
    assert moved[0] == adamw_bytes_per_param(precision) * numel * len(params)


def test_collective_nodes_cost_the_collective_host_time(llama_tiny: ModelCosts) -> None:
    layer = llama_tiny.rank(2).layers[0]
    forward = sum(c.direction == "forward" for c in layer.collectives)
    backward = len(layer.collectives) - forward
    assert forward == backward == 2  # g after attention and MLP; f before them
    hw = replace(H100, op_overhead_s=1e-6, backward_op_overhead_s=2e-6, collective_host_s=1e-3)
    host = (layer.ops - forward) * 1e-6 + (layer.grad_ops - backward) * 2e-6 + 4 * 1e-3
    assert segment_time(layer, 2, hw, 2).host_s == pytest.approx(host)


def test_preamble_holds_the_repeated_nodes_once(llama_tiny: ModelCosts) -> None:
    """Masks, positions and rotary tables: forward only, in no other segment."""
    rc = llama_tiny.rank(1)
    assert rc.preamble.ops > 10 and rc.preamble.grad_ops == 0
    segments = (rc.embedding, *rc.layers, rc.head, rc.preamble)
    lowered = compiler.lower(llama_tiny.gm, rc.plan, outputs_read=compiler.LOSS_ONLY).graph  # what the segments were measured on
    assert sum(seg.ops for seg in segments) == sum(n.op == "call_function" for n in lowered.graph.nodes)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_cost_model_reads_the_rank_graph_lower_makes(llama_tiny: ModelCosts, sequence_parallel: bool) -> None:
    """``rank_graph`` skips only the chunk programs: the rank graph is the one ``lower`` returns, node for node."""
    overlap = (OVERLAP_ALL_GATHER, OVERLAP_REDUCE_SCATTER) if sequence_parallel else ()
    plan = replace(llama_tiny.rank(2).plan, sequence_parallel=sequence_parallel, tp_overlap=overlap)
    planned = compiler.rank_graph(llama_tiny.gm, plan, outputs_read=compiler.LOSS_ONLY)
    lowered = compiler.lower(llama_tiny.gm, plan, outputs_read=compiler.LOSS_ONLY).graph
    assert planned.code == lowered.code and not any(name.startswith("chunk_") for name, _ in planned.named_children())


def test_the_estimate_says_how_long_the_gpu_waits_for_the_host(llama_tiny: ModelCosts) -> None:
    """A tiny model is host-bound: most of its step is the GPU waiting for the host; without host costs, none."""
    from autotp.cost_model.planner import Cluster, Config, Training, estimate

    config = Config(tp=1, pp=1, dp=1, vpp=1, microbatch_size=1, microbatches=2)
    bound = estimate(llama_tiny, Cluster(1, 1, H100), Training(2), config)
    assert 0.5 < bound.host_wait_s / bound.step_s < 1
    free = replace(H100, op_overhead_s=0.0, backward_op_overhead_s=0.0, call_host_s=0.0, collective_host_s=0.0)
    assert estimate(llama_tiny, Cluster(1, 1, free), Training(2), config).host_wait_s == pytest.approx(0.0, abs=1e-12)
