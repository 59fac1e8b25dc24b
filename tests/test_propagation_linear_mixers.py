"""Linear-attention mixers with fused input projections (``plain_models_linear_mixers``), one
process: the plan is Megatron's multi-part layout. Every segment of the fused projection
(q, k, v, z; or each key-head group) is split by whole heads, rank r holding part r of
each; the depthwise conv's channels, the per-head vectors and the gated norm follow; the
output projection is row-parallel. ``test_plain_suite`` checks the numerics on gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.dim_sharding import DimSharding
from autotp.ir.plan import ParallelPlan
from plain_models_attention import DIM
from plain_models_linear_mixers import GROUPS, KEY_DIM, KEY_HEADS, MODELS, STATE, VALUE_DIM, VALUE_HEADS, GatedDeltaNet, Mamba2Mixer


def _plan(module: nn.Module, tp: int) -> ParallelPlan:
    torch.manual_seed(0)
    return plan_tensor_parallel(trace(module.eval(), {"x": torch.randn(2, 8, DIM)}), tp)


def _layouts(plan: ParallelPlan) -> dict[str, tuple[str, DimSharding]]:
    return {p.name: (p.kind, p.sharding) for p in plan.params}


def _rank_rows(sharding: DimSharding, rank: int, tp: int) -> list[int]:
    return [i for start, stop in sharding.ranges(rank, tp) for i in range(start, stop)]


def _no_matrix_kept_whole(module: nn.Module, plan: ParallelPlan) -> None:
    kept = [k.name for k in plan.kept_whole if module.get_parameter(k.name).dim() >= 2]
    assert not kept, plan.kept_whole


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_qkv_conv_and_gated_norm_split_by_heads(tp: int) -> None:
    """Qwen3.5's layout: ``in_proj_qkv`` is all q heads, all k heads, all v heads."""
    module = GatedDeltaNet(grouped=False)
    plan = _plan(module, tp)
    _no_matrix_kept_whole(module, plan)
    layouts = _layouts(plan)
    key, value = KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM
    q, k, v = (key // tp, key // tp, value // tp)
    for name in ("in_proj_qkv.weight", "conv1d.weight"):
        _, sharding = layouts[name]
        assert _rank_rows(sharding, 1, tp) == [*range(q, 2 * q), *range(key + k, key + 2 * k), *range(2 * key + v, 2 * key + 2 * v)]
    assert layouts["conv1d.weight"][0] == "depthwise" and layouts["in_proj_qkv.weight"][0] == "column"
    assert layouts["out_proj.weight"][0] == "row" and _rank_rows(layouts["out_proj.weight"][1], 1, tp) == [*range(v, 2 * v)]
    assert _rank_rows(layouts["dt_bias"][1], 1, tp) == [*range(VALUE_HEADS // tp, 2 * VALUE_HEADS // tp)]


@pytest.mark.parametrize("tp", [2, 4])
def test_grouped_qkvz_splits_whole_key_head_groups(tp: int) -> None:
    """Qwen3-Next's layout: ``in_proj_qkvz`` rows are grouped per key head; a rank holds whole
    groups, and the conv (fed in q|k|v order after the reorder) holds the matching heads."""
    module = GatedDeltaNet(grouped=True)
    plan = _plan(module, tp)
    _no_matrix_kept_whole(module, plan)
    layouts = _layouts(plan)
    group = 2 * KEY_DIM + 2 * VALUE_HEADS // KEY_HEADS * VALUE_DIM
    per_rank = KEY_HEADS // tp
    assert layouts["in_proj_qkvz.weight"][0] == "column"
    assert _rank_rows(layouts["in_proj_qkvz.weight"][1], 1, tp) == [*range(per_rank * group, 2 * per_rank * group)]
    key, q = KEY_HEADS * KEY_DIM, KEY_HEADS * KEY_DIM // tp
    assert _rank_rows(layouts["conv1d.weight"][1], 0, tp)[: 2 * q] == [*range(q), *range(key, key + q)]
    assert layouts["out_proj.weight"][0] == "row"


@pytest.mark.parametrize("tp", [2, 4])
def test_mamba2_norm_groups_and_shared_b_c_follow_the_heads(tp: int) -> None:
    """Mamba2: the gated norm views the heads in groups, B and C are shared by groups of
    heads; a rank holds whole groups, their heads, their B and C channels."""
    module = Mamba2Mixer()
    plan = _plan(module, tp)
    _no_matrix_kept_whole(module, plan)
    layouts = _layouts(plan)
    inner = VALUE_HEADS * VALUE_DIM
    assert layouts["in_proj.weight"][0] == "column" and layouts["out_proj.weight"][0] == "row"
    assert layouts["norm.weight"][1].local_size(tp) == inner // tp
    assert layouts["conv1d.weight"][0] == "depthwise" and layouts["conv1d.bias"][0] == "bias"
    x, bc = inner // tp, GROUPS // tp * STATE  # rank 1: its heads' x channels, its groups' B and C
    assert _rank_rows(layouts["conv1d.weight"][1], 1, tp) == [
        *range(x, 2 * x), *range(inner + bc, inner + 2 * bc), *range(inner + GROUPS * STATE + bc, inner + GROUPS * STATE + 2 * bc)
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("config", ["tp2", "tp4", "pp2"])
def test_linear_mixers_pass_the_strict_rule(config: str) -> None:
    """Gloo ranks, fp32: loss, logits and every grad equal, each rank at most 1.3/(tp·pp) of
    the parameters, no matrix kept whole without an entry (``test_plain_suite.run_config``)."""
    from test_plain_suite import _failures, run_config

    results = run_config(config, sorted(MODELS))
    assert set(results) == set(MODELS)
    assert not _failures(results), _failures(results)
