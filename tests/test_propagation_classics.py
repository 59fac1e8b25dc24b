"""Constructs of the twelfth round of issue 27 (``tests/plain_models_classics.py``): a matmul
weight computed from parameters of other shapes (a KAN layer's spline weight times its scaler,
viewed into [out, in * K]) splits its parameters along the dims behind the weight's; advanced
indexing by an index split on the heads, and by an ``arange`` enumerating the split heads in
place (Informer's ProbSparse queries), keeps the heads split. ``test_plain_suite`` checks the
whole models at every degree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.analysis.sharding_policy import _outer_factor
from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from distributed import run_on_ranks
from plain_models_attention import DecoderLM, PreNormBlock
from plain_models_classics import build, example_inputs
from plain_models_idioms import FusedHeads
from plain_models_frontier import merge_heads


def _layouts(model: nn.Module, inputs: dict[str, torch.Tensor], tp: int) -> tuple[dict[str, tuple[str, int | None]], set[str]]:
    plan = plan_tensor_parallel(trace(model, inputs), tp)
    return {p.name: (p.kind, p.dim) for p in plan.params}, {k.name for k in plan.kept_whole}


@pytest.mark.parametrize(
    ("src", "dst", "dim", "behind"),
    [((4, 5, 3), (4, 15), 0, 0), ((4, 5, 3), (4, 15), 1, 1), ((4, 15), (4, 5, 3), 1, 1), ((4, 15), (4, 5, 3), 2, None), ((1, 6), (6,), 0, 1)],
)
def test_a_view_keeps_a_dim_behind_the_outermost_factor_of_its_group(src: tuple[int, ...], dst: tuple[int, ...], dim: int, behind: int | None) -> None:
    assert _outer_factor(src, dst, dim) == behind


def test_a_weight_viewed_from_a_product_of_parameters_splits_them() -> None:
    """``(spline_weight * spline_scaler[..., None]).view(out, -1)`` read by ``F.linear``: the
    product read both parameters whole (90% of the model on a rank at tp=4). The hint now
    follows the weight's out features back through the view and the broadcast product to
    dim 0 of both (column; the scaler, broadcast into the weight, as a bias), and its
    contracted dim to their dim 1 (row)."""
    layouts, kept = _layouts(build("kan_ffn"), example_inputs("kan_ffn"), 4)
    for part, kind, dim in (("up", "column", 0), ("down", "row", 1)):
        for param in ("spline_weight", "base_weight"):
            assert layouts[f"layers.0.feed_forward.{part}.{param}"] == (kind, dim), (part, param)
        assert layouts[f"layers.0.feed_forward.{part}.spline_scaler"] == ("bias", dim)  # broadcast into the weight: a scale
    assert not {k for k in kept if "feed_forward" in k}


def test_an_arange_enumerating_the_split_heads_reads_them_in_place() -> None:
    """``q[arange(B)[:, None, None], arange(H)[None, :, None], top]`` with ``top`` split on the
    heads, and the write ``context[..same..] = attn @ v``: before, an index split on the heads
    conflicted and the fused q/k/v projection was kept whole (34% of the model on a rank at
    tp=4)."""
    layouts, kept = _layouts(build("informer_probsparse"), example_inputs("informer_probsparse"), 4)
    assert layouts["layers.0.attention.qkv.weight"] == ("column", 0)
    assert not {k for k in kept if ".attention." in k}


class HeadsVoteAttention(FusedHeads):
    """Each head's top keys marked in one [B, L] tensor of the whole batch (any head's vote
    counts), which then scales every head's values: a write at positions an index split on
    the heads holds, into a tensor the heads do not split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        B, H, L, _ = q.shape
        top = (q * k).sum(-1).topk(4, dim=-1).indices  # [B, H, 4]
        votes = torch.zeros(B, L)
        votes[torch.arange(B)[:, None, None], top] = 1.0
        y = F.scaled_dot_product_attention(q, k, v * (1 + votes[:, None, :, None]), is_causal=True)
        return self.o(merge_heads(y))


def _votes_model() -> nn.Module:
    torch.manual_seed(0)
    return DecoderLM(lambda: PreNormBlock(HeadsVoteAttention())).eval()


def _check(rank: int, world: int, name: str) -> str:
    from autotp.report.strict_rule import check_on_rank

    if name == "heads_vote":
        return check_on_rank(_votes_model(), example_inputs("based_taylor"), tp=world).reason
    return check_on_rank(build(name), example_inputs(name), tp=world).reason


def test_a_write_at_positions_a_split_index_holds_is_not_split() -> None:
    """Each rank would mark only its own heads' votes into the whole [B, L] tensor: the rule
    refuses to split there, and the parallel model equals the unmodified one."""
    assert run_on_ranks(_check, 2, "heads_vote") == ["", ""]


@pytest.mark.parametrize("name", ["informer_probsparse", "kan_ffn"])
def test_the_models_at_tp2_equal_the_unmodified_model(name: str) -> None:
    assert run_on_ranks(_check, 2, name) == ["", ""]
