"""Constructs of the third round of issue 27 (``tests/plain_models_wild.py``) on tiny
modules, one process: what the planner decides for them. ``test_plain_suite`` checks the
numerics of the whole models on gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.analysis.layers import repeated_modules
from autotp.analysis.shapes import strided_walk
from autotp.analysis.trace import trace
from autotp.compiler import choose_plan
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.errors import UserInputError
from plain_models_attention import LAYERS
from plain_models_wild import DIM, Albert, StridedWindowAttention, UnfoldWindowAttention, example_inputs, heads, merge


class HeadPairs(nn.Module):
    """``as_strided`` that reads two heads as one (a stride of two heads): it mixes the split heads."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads(t).contiguous() for t in self.qkv(x).chunk(3, dim=-1))
        b, h, s, d = k.shape
        pairs = k.as_strided((b, h // 2, s, 2 * d), (h * s * d, 2 * s * d, d, 1))
        return self.proj(merge(q * pairs.mean(-1).repeat_interleave(2, dim=1)[..., None] + v))


@pytest.mark.parametrize("window", [UnfoldWindowAttention, StridedWindowAttention])
@pytest.mark.parametrize("tp", [2, 4])
def test_sliding_windows_keep_the_heads_split(tp: int, window: type[nn.Module]) -> None:
    """``k.unfold(2, w, 1)`` over the sequence of ``[B, H, S, D]`` keys, or the same windows by
    ``as_strided``: the heads keep their split (only the windowed dim must be whole; the
    rank's strides are rewritten), so the fused qkv stays column-parallel."""
    gm = trace(window().eval(), {"x": torch.randn(2, 16, DIM)})
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


def test_strides_that_mix_a_split_dim_keep_its_producer_whole() -> None:
    """Strides that read across the split heads (two heads as one) are no walk along input
    dims: the split conflicts there, settled by the sound fallback (an entry naming the node)."""
    gm = trace(HeadPairs().eval(), {"x": torch.randn(2, 16, DIM)})
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.as_strided.default)
    assert strided_walk(node) is None
    plan = plan_tensor_parallel(gm, 2)
    settled = [g.node for g in plan.gathered] + [k.node for k in plan.kept_whole if k.name == "qkv.weight"]
    assert settled == ["as_strided"]  # the keys gathered before it (cheaper than keeping qkv whole)


def test_strided_walk_of_sliding_windows() -> None:
    gm = trace(StridedWindowAttention().eval(), {"x": torch.randn(2, 16, DIM)})
    walks = [strided_walk(n) for n in gm.graph.nodes if n.target is torch.ops.aten.as_strided.default]
    assert walks == [[0, 1, 2, 2, 3]] * 2  # [B, H, S-w+1, w, D]: the windows' two dims both step along the sequence
