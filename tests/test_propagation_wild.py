"""Constructs of the third round of issue 27 (``tests/plain_models_wild.py``) on tiny
modules, one process: what the planner decides for them. ``test_plain_suite`` checks the
numerics of the whole models on gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.analysis.layers import repeated_modules
from autotp.analysis.trace import trace
from autotp.compiler import choose_plan
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.errors import UserInputError
from plain_models_attention import LAYERS
from plain_models_wild import DIM, Albert, UnfoldWindowAttention, example_inputs


@pytest.mark.parametrize("tp", [2, 4])
def test_sliding_windows_by_unfold_keep_the_heads_split(tp: int) -> None:
    """``k.unfold(2, w, 1)`` over the sequence of ``[B, H, S, D]`` keys: the heads keep their
    split (only the unfolded dim must be whole), so the fused qkv stays column-parallel."""
    gm = trace(UnfoldWindowAttention().eval(), {"x": torch.randn(2, 16, DIM)})
    plan = plan_tensor_parallel(gm, tp)
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["qkv.weight"] == "column" and kinds["proj.weight"] == "row"
    assert {k.name for k in plan.kept_whole} <= {"proj.bias"}  # a row-parallel bias is added after the all-reduce


class CrossAttentionLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(DIM, 8, 2 * DIM, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.layer(x, memory)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_packed_in_projection_split_into_query_and_key_value_parts_is_column_parallel(tp: int) -> None:
    """``nn.MultiheadAttention`` as cross-attention splits its packed ``in_proj_weight`` (and
    bias) ``[E, 2E]`` before the two linears: the parameter is split in those segments, each
    over its heads, instead of read whole on every rank."""
    gm = trace(CrossAttentionLayer().eval(), {"x": torch.randn(2, 8, DIM), "memory": torch.randn(2, 6, DIM)})
    plan = plan_tensor_parallel(gm, tp)
    params = {p.name: p for p in plan.params}
    packed = params["layer.multihead_attn.in_proj_weight"]
    assert packed.dim == 0 and packed.sharding.segments == (DIM, DIM, DIM)  # q, k, v, each over its heads
    assert params["layer.multihead_attn.in_proj_bias"].sharding.segments == (DIM, DIM, DIM)
    assert params["layer.multihead_attn.out_proj.weight"].kind == "row"
    assert not {k.name for k in plan.kept_whole} & {"layer.multihead_attn.in_proj_weight", "layer.self_attn.in_proj_weight"}


def test_a_pipeline_over_one_shared_layer_is_refused_naming_it() -> None:
    """ALBERT runs one layer module ``LAYERS + 1`` times: no numbered layers to cut between,
    and every stage would hold the shared layer whole. The error names the module and the fix."""
    gm = trace(Albert().eval(), example_inputs("albert_shared_layer"))
    assert repeated_modules(gm.graph) == {"shared": LAYERS + 1}
    with pytest.raises(UserInputError, match=r"0 layers; .*module 'shared' runs 3 times .*cross-layer sharing.*use pp=1"):
        choose_plan(gm, 1, 2, 1, 1, None)
