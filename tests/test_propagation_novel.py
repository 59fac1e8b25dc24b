"""Constructs of the second round of issue 27 (``tests/plain_models_novel.py``) on tiny
modules, one process: what the planner decides for them. ``test_plain_suite`` checks the
numerics of the whole models on gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.analysis.layers import layer_of, num_layers
from autotp.analysis.trace import trace
from autotp.compiler import lower
from autotp.cost_model.pipeline import plan_pipeline
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.errors import UserInputError
from autotp.ir.plan import KEPT_WHOLE_CONFLICT
from plain_models_attention import NanoGPTAttention, PreNormBlock
from plain_models_novel import ConformerConv, EncoderDecoder, GatheredWeightsMoE, MambaBlock, SortedTokenMoE, example_inputs

DIM = 64


class TokenRouter(nn.Module):
    """A one-output router (mixture-of-depths) whose score is used by every rank alike:
    its size-1 output dim leaves the tensor by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.router, self.up, self.down = nn.Linear(DIM, 1, bias=False), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        score = self.router(x)
        score = {"squeeze": lambda s: s.squeeze(-1), "select": lambda s: s[..., 0], "view": lambda s: s.view(s.shape[0], s.shape[1]),
                 "flatten": lambda s: s.flatten(1), "sum": lambda s: s.sum(-1)}[self.how](score)  # fmt: skip
        return x + self.down(torch.relu(self.up(x))) * score.sigmoid().unsqueeze(-1)


@pytest.mark.parametrize("how", ["squeeze", "select", "view", "flatten", "sum"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_one_output_router_read_alike_by_every_rank_is_not_split(how: str, tp: int) -> None:
    """Splitting the router's size-1 output dim holds it whole on every rank, and its grad
    would be summed over them as if each rank used it differently: the dim must not be
    dropped (squeeze, select, view) while it carries a split."""
    gm = trace(TokenRouter(how).eval(), {"x": torch.randn(2, 8, DIM)})
    plan = plan_tensor_parallel(gm, tp)
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds.get("up.weight") == "column" and kinds.get("down.weight") == "row"
    assert "router.weight" not in kinds
    kept = {k.name: k.reason for k in plan.kept_whole}
    assert kept["router.weight"] == KEPT_WHOLE_CONFLICT


@pytest.mark.parametrize("tp", [2, 4])
def test_mamba1_scan_splits_its_channels_with_dt_read_through_the_ranks_slice(tp: int) -> None:
    """Mamba1's reference scan: ``einsum("bld,dn->bldn", dt, A)`` meets ``dt`` split over the
    inner channels and ``A = -exp(A_log)`` whole (read whole at its first use): ``A`` is
    read through the rank's slice instead of keeping ``in_proj`` whole."""
    gm = trace(MambaBlock().eval(), {"x": torch.randn(2, 16, DIM)})
    kinds = {p.name: p.kind for p in plan_tensor_parallel(gm, tp).params}
    assert kinds["mixer.in_proj.weight"] == "column" and kinds["mixer.out_proj.weight"] == "row"
    assert kinds["mixer.conv1d.weight"] == "depthwise" and kinds["mixer.x_proj.weight"] == "row"


def test_grouped_mm_experts_over_sorted_tokens_split_their_hidden_dim() -> None:
    """torchtitan's grouped experts (``[E, out, in]`` weights transposed into
    ``torch._grouped_mm`` at cumulative offsets of ``histc`` counts), traced in bf16 (the
    dtype PyTorch's meta kernel of that op takes): every expert's hidden dim is split."""
    block = PreNormBlock(NanoGPTAttention(), SortedTokenMoE()).to(torch.bfloat16).eval()
    gm = trace(block, {"x": torch.randn(2, 16, DIM, dtype=torch.bfloat16)})
    for tp in (2, 4):
        kinds = {p.name: (p.kind, p.dim) for p in plan_tensor_parallel(gm, tp).params}
        assert kinds["feed_forward.experts.w1"] == kinds["feed_forward.experts.w3"] == ("expert_column", 1)
        assert kinds["feed_forward.experts.w2"] == ("expert_row", 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_weights_gathered_per_token_split_their_hidden_dim(tp: int) -> None:
    """gpt-fast's Mixtral: ``einsum("ti,taoi->tao", x, w1[selected])``. The gathered view's
    top-k dim (2, which tp=2 divides) is a letter only that operand has, but no dim of the
    weight: the split takes the experts' hidden dim, which is one."""
    gm = trace(PreNormBlock(NanoGPTAttention(), GatheredWeightsMoE()).eval(), {"x": torch.randn(2, 16, DIM)})
    plan = plan_tensor_parallel(gm, tp)
    kinds = {p.name: (p.kind, p.dim) for p in plan.params}
    assert kinds["feed_forward.w1"] == kinds["feed_forward.w3"] == ("column", 1)
    assert kinds["feed_forward.w2"] == ("row", 2)
    assert not [k.name for k in plan.kept_whole if k.name.startswith("feed_forward.w")]


def test_an_fp32_grouped_mm_is_refused_naming_the_module_and_the_meta_kernel() -> None:
    block = PreNormBlock(NanoGPTAttention(), SortedTokenMoE()).eval()
    with pytest.raises(UserInputError, match=r"module feed_forward\.experts .*meta kernel \(meta_grouped_mm\).*bf16"):
        trace(block, {"x": torch.randn(2, 16, DIM)})


def test_layers_of_several_module_lists_are_numbered_in_the_order_they_run() -> None:
    """An encoder's and a decoder's layers (``encoder.0``, ``decoder.0``) are different
    layers: numbered in the order they run, the pipeline cuts between them by cost."""
    gm = trace(EncoderDecoder().eval(), example_inputs("encoder_decoder"))
    order = [layer_of(n) for n in gm.graph.nodes if n.op == "call_function" and layer_of(n) is not None]
    assert num_layers(gm) == 4 and order == sorted(order) and set(order) == {0, 1, 2, 3}
    assert plan_pipeline(gm, 2, 1)[0] == (0, 0, 1, 1)


class HeadGroupNorm(nn.Module):
    """RetNet's output: heads flattened into channels, a ``GroupNorm`` with one group per
    head (``groups``), a swish gate, the output projection."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.v, self.g, self.o = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.GroupNorm(groups, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.norm(self.v(x).reshape(b * s, DIM)).view(b, s, DIM)
        return self.o(torch.nn.functional.silu(self.g(x)) * y)


@pytest.mark.parametrize("tp", [2, 4])
def test_group_norm_over_whole_groups_keeps_the_channels_split(tp: int) -> None:
    gm = trace(HeadGroupNorm(8).eval(), {"x": torch.randn(2, 8, DIM)})
    kinds = {p.name: p.kind for p in plan_tensor_parallel(gm, tp).params}
    assert kinds["v.weight"] == kinds["g.weight"] == "column" and kinds["o.weight"] == "row"
    assert kinds["norm.weight"] == kinds["norm.bias"] == "bias"
    rank_graph = lower(gm, plan_tensor_parallel(gm, tp), tp_rank=tp - 1, device="cpu", backend="gloo").graph
    (norm,) = [n for n in rank_graph.graph.nodes if n.target is torch.ops.aten.group_norm.default]
    assert norm.args[1] == 8 // tp  # the rank's own groups


def test_group_norm_with_groups_tp_does_not_divide_keeps_its_input_whole() -> None:
    gm = trace(HeadGroupNorm(2).eval(), {"x": torch.randn(2, 8, DIM)})
    plan = plan_tensor_parallel(gm, 4)
    (norm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.group_norm.default]
    kept = {k.name: k.reason for k in plan.kept_whole}.get("v.weight")  # or its output gathered at the norm
    assert kept == KEPT_WHOLE_CONFLICT or [g.node for g in plan.gathered] == [norm.name], (kept, plan.gathered)


@pytest.mark.parametrize("tp", [2, 4])
def test_conformer_convolution_module_is_split_over_its_channels(tp: int) -> None:
    """Pointwise conv to 2C, ``glu`` over the channels (two halves split alike), a depthwise
    conv, eval-mode ``batch_norm`` (per-channel vectors follow), a pointwise conv back:
    column-parallel in, row-parallel out, its bias added after the all-reduce."""
    gm = trace(ConformerConv().eval(), {"x": torch.randn(2, 16, DIM)})
    plan = plan_tensor_parallel(gm, tp)
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["pointwise1.weight"] == "column" and kinds["depthwise.weight"] == "depthwise"
    assert kinds["norm.weight"] == kinds["norm.bias"] == "bias" and kinds["pointwise2.weight"] == "row"
    rank_graph = lower(gm, plan, tp_rank=0, device="cpu", backend="gloo").graph
    (last,) = [n for n in rank_graph.graph.nodes if n.target is torch.ops.aten.conv1d.default and n.args[1].target == "pointwise2.weight"]
    assert last.args[2] is None and any(u.target is torch.ops.autotp.reduce_from_tp.default for u in last.users)
