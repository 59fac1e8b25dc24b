"""Constructs of the thirteenth round of issue 27 (``tests/plain_models_hops.py``): FlexAttention
split on its heads, with its score and mask functions reading the global index of the rank's
heads, a per-head block mask read through the rank's heads, and a captured parameter's gradient
summed over the ranks; the tp group's gathers and all-reduces returning their operand's memory
layout. ``test_plain_suite`` checks the whole models at every degree."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from autotp.analysis.trace import trace
from autotp.compiler import rank_graph
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir import meta_keys, ops
from autotp.passes.flex_attention_rank import flex_attention_call
from autotp.report.strict_rule import check_on_rank
from autotp.runtime.processes import collectives
from distributed import run_on_ranks
from plain_models_hops import build, example_inputs



def _flex_nodes(name: str, tp: int) -> tuple[list[torch.fx.Node], object]:
    traced = trace(build(name), example_inputs(name))
    plan = plan_tensor_parallel(traced, tp)
    gm = rank_graph(traced, plan)
    return [n for n in gm.graph.nodes if n.target is flex_attention_call], plan


@pytest.mark.parametrize("name", ["flex_alibi", "flex_relative_bias", "flex_per_head_window", "flex_gqa"])
def test_flex_attention_runs_on_the_ranks_heads(name: str) -> None:
    """Before, FlexAttention had no rule: q, k and v were gathered and every rank computed every
    head (and the gathered q's layout broke a ``view`` after it)."""
    nodes, plan = _flex_nodes(name, 2)
    assert nodes and not plan.gathered
    assert all(n.meta[meta_keys.LAYOUT][0].var_at(1) is not None for n in nodes)
    assert all(a.target is not ops.GATHER_FROM_TP for n in nodes for a in n.args[:3])


def test_a_per_head_block_mask_is_read_through_the_ranks_heads() -> None:
    nodes, _ = _flex_nodes("flex_per_head_window", 2)
    for node in nodes:
        tensors = [t for t in node.args[4] if isinstance(t, torch.fx.Node) and isinstance(t.meta.get("val"), torch.Tensor)]
        assert tensors and all(t.target is torch.ops.aten.slice.Tensor and t.args[1:] == (1, 0, 4) for t in tensors)


def _score_function_heads(rank: int, world: int) -> list[int]:
    """The head index each local head's score function sees on tp rank ``rank``."""
    from autotp.compiler import lower

    traced = trace(build("flex_alibi"), example_inputs("flex_alibi"))
    plan = plan_tensor_parallel(traced, world)
    program = lower(traced, plan, tp_rank=rank, device="cpu", backend="gloo")
    gm = program.graph
    node = next(n for n in gm.graph.nodes if n.target is flex_attention_call)
    score = getattr(gm, node.args[3].target)
    zero = torch.zeros(())
    return [int(score(zero, zero, torch.tensor(h), zero, torch.ones((), dtype=torch.long), torch.arange(8.0)).item()) for h in range(4)]


def test_the_score_function_reads_the_global_head() -> None:
    """``slopes[h] * (kv - q)`` with slopes 0..7 and ``kv - q = 1`` gives the global head."""
    assert run_on_ranks(_score_function_heads, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _relative_bias_at_tp2(rank: int, world: int) -> object:
    return check_on_rank(build("flex_relative_bias"), example_inputs("flex_relative_bias"), tp=2)


def test_a_parameter_the_score_function_reads_gets_the_sum_of_the_ranks_gradients() -> None:
    """Each rank's heads read their rows of the per-head bias table, which every rank holds
    whole: f before the op sums the ranks' gradients of it (checked against the unmodified
    model, gradient of ``rel_bias`` included)."""
    results = run_on_ranks(_relative_bias_at_tp2, 2)
    assert all(r.passed for r in results), [r.reason for r in results]


def _gathered_layouts(rank: int, world: int) -> list[tuple[int, ...]]:
    group = dist.new_group(list(range(world)))
    collectives.register_group("layout_test", group)
    x = torch.arange(2.0 * 3 * 4 * 5).view(2, 4, 3, 5).transpose(1, 2) + rank  # [2, 3, 4, 5], heads-major in memory
    gathered = ops.GATHER_FROM_TP(x, 1, 6, "layout_test")
    reduced = ops.REDUCE_FROM_TP(x, "layout_test")
    assert torch.equal(gathered, torch.cat([x - rank + r for r in range(world)], dim=1))
    padded = ops.GATHER_FROM_TP(x, 1, 5, "layout_test")  # a padded dim: the first 5 of the 6 gathered
    assert torch.equal(padded, gathered[:, :5]) and padded.stride() == (100, 5, 25, 1)
    assert torch.equal(reduced, sum(x - rank + r for r in range(world)))
    assert gathered._base is None and reduced._base is None  # tensors of their own: written in place by MoE combines
    with FakeTensorMode():
        fake = torch.empty(2, 4, 3, 5).transpose(1, 2)
        fakes = (ops.GATHER_FROM_TP(fake, 1, 6, "layout_test").stride(), ops.REDUCE_FROM_TP(fake, "layout_test").stride())
    assert fakes == (gathered.stride(), reduced.stride())
    return [gathered.stride(), reduced.stride()]


def test_gathers_and_all_reduces_keep_their_operands_memory_order() -> None:
    """A gathered transposed tensor was returned contiguous, so a ``view`` export recorded on the
    unmodified model's (transposed) tensor failed on the rank's."""
    strides = run_on_ranks(_gathered_layouts, 2)
    assert strides[0] == [(120, 5, 30, 1), (60, 5, 15, 1)]


def _expanded_value_attention(rank: int, world: int) -> list[tuple[int, ...]]:
    collectives.register_group("expanded_test", dist.new_group(list(range(world))))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 4, 16, generator=gen).transpose(1, 2)  # [B, H, S, D] read from [B, S, H, D]
    v = torch.randn(2, 1, 16, 16, generator=gen).expand(2, 4, 16, 16)  # one KV head repeated by expand
    reduced = ops.REDUCE_FROM_TP(v, "expanded_test")
    out = torch.nn.functional.scaled_dot_product_attention(q, v, reduced, is_causal=True)
    out.transpose(1, 2).view(2, 16, -1)  # the view export recorded after SDPA: valid only in SDPA's fast layout
    with FakeTensorMode():
        fake = ops.REDUCE_FROM_TP(torch.empty(2, 1, 16, 16).expand(2, 4, 16, 16), "expanded_test")
    return [reduced.stride(), fake.stride(), out.stride()]


def test_an_all_reduced_expanded_value_keeps_sdpa_on_its_fast_layout() -> None:
    """A KV head repeated by ``expand`` (stride 0 over the heads) was all-reduced into a tensor
    with the heads innermost; SDPA's CPU kernel then fell back to the math path, whose
    output's transpose no longer allowed the ``view`` the trace recorded (torchtune's Gemma at tp=2)."""
    strides = run_on_ranks(_expanded_value_attention, 2)
    assert strides[0] == [(1024, 256, 16, 1), (1024, 256, 16, 1), (1024, 16, 64, 1)]
