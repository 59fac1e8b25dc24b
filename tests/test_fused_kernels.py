"""The cost model's view of ``compile=True``: inductor's fused regions (``cost_model.fused_kernels``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from autotp.compiler import trace, trace_for_planning
from autotp.cost_model.compute import compiled_launches, node_times, segment_time
from autotp.cost_model.saved_tensors import needs_grad, saved_inputs
from autotp.cost_model.flops import global_tensors, node_cost
from autotp.cost_model.fused_kernels import compiled_saves, fused_regions, fusible, region_bytes
from autotp.cost_model.memory import chunk_peaks
from autotp.ir.op_facts import is_matmul, op_name
from autotp.cost_model.fused_loss import compiled_loss_bytes_per_logit, loss_bytes_per_logit
from autotp.cost_model.hardware import H200
from autotp.cost_model.planner import Cluster, Config, Training, estimate


class _Mlp(nn.Module):
    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)
        self.scale = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.nn.functional.silu(self.up(x)) * 2.0)
        return ((y + x) * self.scale).float()


def test_a_fused_region_reads_its_inputs_and_writes_what_leaves_it_once() -> None:
    x = torch.randn(2, 8, 16)
    gm = trace(_Mlp(), {"x": x}, "cpu")
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    regions = fused_regions(calls, {})
    measure = region_bytes(regions, set())
    moved = {tuple(str(m.target) for m in members): measure(head, global_tensors)[0] for head, members in regions.items()}
    tokens, h = 2 * 8, 16
    silu = next(v for k, v in moved.items() if any("silu" in t for t in k))
    assert silu == 2 * tokens * 4 * h * 4  # the up projection's output read, the product written for the down projection
    residual = next(v for k, v in moved.items() if any("add" in t for t in k))
    # the down projection's output, x and the scale read; only the float32 result leaves (the product stays inside)
    assert residual == (2 * tokens * h + h) * 4 + tokens * h * 4
    eager = sum(node_cost(n).bytes for n in calls if fusible(n))
    assert sum(moved.values()) < eager


def _tiny_costs(vocab: int = 1024):
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return trace_for_planning(config, 64, dtype=torch.bfloat16)


def test_a_compiled_layer_launches_fewer_kernels_and_moves_fewer_bytes_than_eager() -> None:
    costs = _tiny_costs()
    eager, compiled = costs.rank(1).layers[0], costs.rank(1, compiled=True).layers[0]
    assert eager.fused is None and compiled.fused is not None
    (forward, backward), backs = compiled_launches(compiled)
    assert 0 < forward.sum() < eager.ops and 0 < backward.sum() < eager.grad_ops
    matmuls = (compiled.kinds == 1) & compiled.grad
    assert (backward[matmuls] == 2).all()  # a linear's backward: two GEMMs
    e_fwd, e_bwd = node_times(eager, 2, H200)
    c_fwd, c_bwd = node_times(compiled, 2, H200)
    memory_bound = compiled.fusible
    assert c_fwd[memory_bound].sum() < e_fwd[memory_bound].sum() and c_bwd[memory_bound].sum() < e_bwd[memory_bound].sum()
    assert (c_fwd[~memory_bound] == e_fwd[~memory_bound]).all()  # GEMMs and attention as eager
    hosted = replace(H200, compiled_launch_host_s=1e-3)  # host-bound: the launches set the pace
    assert segment_time(compiled, 2, hosted, 1).host_s == pytest.approx(1e-3 * (forward.sum() + backward.sum()))


def test_the_fused_loss_compiled_moves_its_logits_a_few_times() -> None:
    costs = _tiny_costs(vocab=4096)
    head = costs.rank(1, compiled=True).head
    assert (head.kinds == 3).sum() == 1  # the planner's graph carries the fused loss
    row = int((head.kinds == 3).nonzero()[0][0])
    per_sample_saved = head.bytes[row, 1] - head.fused[row, 0, 1]
    logits_per_sample = 64 * 4096
    assert per_sample_saved == pytest.approx(logits_per_sample * (loss_bytes_per_logit(2) - compiled_loss_bytes_per_logit(2)))


def test_the_planner_prices_compiled_ranks_with_the_compiled_host_costs() -> None:
    costs = _tiny_costs()
    cluster = Cluster(1, 1, replace(H200, compiled_call_host_s=0.0))
    config = Config(1, 1, 1, 1, 2, 2)
    eager = estimate(costs, cluster, Training(4, "bf16-pure"), config)
    compiled = estimate(costs, cluster, Training(4, "bf16-pure", compiled=True), config)
    assert compiled.step_s < eager.step_s
    slow_calls = estimate(costs, Cluster(1, 1, replace(H200, compiled_call_host_s=0.01)), Training(4, "bf16-pure", compiled=True), config)
    assert slow_calls.step_s - compiled.step_s == pytest.approx(2 * 0.01)  # one call per microbatch


class _Widen(nn.Module):
    """A region whose output (read by a GEMM) is twice the size of its input."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(h, h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(x)
        return self.down(torch.cat([y, y * 2.0], dim=-1)).sum()


def test_compiled_saves_keep_the_cheapest_cut_of_a_region_and_recompute_the_rest() -> None:
    gm = trace(_Widen(), {"x": torch.randn(2, 8, 16)}, "cpu")
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    grad = needs_grad(gm)
    eager = {n: saved_inputs(n, grad) for n in calls}
    down = next(n for n in calls if is_matmul(n) and any(op_name(a.target) == "cat" for a in n.all_input_nodes if a.op == "call_function"))
    up, widened = next(n for n in calls if is_matmul(n) and n is not down), down.args[0]
    assert widened in eager[down]
    tensors = {n: global_tensors(n) for n in gm.graph.nodes}
    compiled = compiled_saves(fused_regions(calls, {}), eager, tensors)
    assert up in compiled[down] and widened not in compiled[down]  # the GEMM's input is recomputed from the half-size cut


def test_a_compiled_backward_holds_a_microbatchs_gradients_until_it_returns() -> None:
    costs = _tiny_costs()
    eager, compiled = costs.rank(1), costs.rank(1, compiled=True)

    def parts(rank):
        return [(rank.preamble.memory, 1), (rank.embedding.memory, 1), *((seg.memory, 1) for seg in rank.layers), (rank.head.memory, 1)]

    assert compiled.layers[0].memory.grads_returned_together and not eager.layers[0].memory.grads_returned_together
    peaks = chunk_peaks(parts(compiled), 2)
    assert peaks.later_backward == peaks.first_backward  # every gradient alive, as the first microbatch's
    table = next(p for name, p in costs.gm.named_parameters() if "embed" in name)
    extra = compiled.embedding.memory.backward.max(axis=0) - eager.embedding.memory.backward.max(axis=0)
    assert extra[0] >= table.numel() * 4  # the float32 accumulator of the table's gradient (its decomposition)
