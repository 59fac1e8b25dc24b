"""Rules found by the registry sweep on transformers 5.24 (one process, no process group):
``view_as`` takes its shape donor's split, ``new_*`` buffers filled by ``copy_`` follow
the parts copied in, an empty ``new_zeros`` stays whole, ``einsum`` makes a 3-D expert
weight column-parallel when nothing else is split, a reshape through a common refinement
(``[B, H*D] -> [B*H, D]``, torch's MultiheadAttention) keeps the heads split, and a
one-sided contraction keeps only the side split on the contracted dim whole.
``test_plain_suite`` checks the numerics of whole models built from these on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from autotp.analysis.trace import trace
from autotp.compiler import lower
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.plan import ParallelPlan
from plain_models_structure import EinsumDispatchMoE, EncoderMaskedLM, torch_encoder_layer

aten = torch.ops.aten
DIM, HEADS, HEAD_DIM = 64, 4, 16


def _plan(module: nn.Module, tp: int, **inputs: torch.Tensor) -> tuple[GraphModule, ParallelPlan]:
    gm = trace(module.eval(), inputs or {"x": torch.randn(2, 8, DIM)})
    return gm, plan_tensor_parallel(gm, tp)


def _kinds(plan: ParallelPlan) -> dict[str, str]:
    return {p.name: p.kind for p in plan.params}


def _kept(plan: ParallelPlan) -> set[str]:
    return {k.name for k in plan.kept_whole}


def _rank_nodes(gm: GraphModule, plan: ParallelPlan, target: object) -> list[torch.fx.Node]:
    rank = lower(gm, plan, tp_rank=0, device="cpu", backend="gloo").graph
    return [n for n in rank.graph.nodes if n.target is target]


class GatedHeads(nn.Module):
    """Beam's output gate: ``gate_proj(x).view_as(attn)`` with ``attn`` split by heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.gate, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = F.silu(self.q(x)).view(*x.shape[:2], HEADS, HEAD_DIM)
        gated = attn * torch.sigmoid(self.gate(x).view_as(attn))
        return self.o(gated.reshape(*x.shape[:2], DIM))


@pytest.mark.parametrize("tp", [2, 4])
def test_view_as_takes_the_split_of_its_shape_donor(tp: int) -> None:
    gm, plan = _plan(GatedHeads(), tp)
    kinds = _kinds(plan)
    assert kinds["q.weight"] == kinds["gate.weight"] == "column" and kinds["o.weight"] == "row"
    assert not {"q.weight", "gate.weight", "o.weight"} & _kept(plan)


class BufferFilledByCopies(nn.Module):
    """DeepSeek's key assembly: ``k.new_empty(..., d1 + d2)`` then ``copy_`` of two head-split
    parts into slices of the last dim; and an empty ``new_zeros`` joined to a split tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x).view(*x.shape[:2], HEADS, HEAD_DIM)
        b = self.b(x).view(*x.shape[:2], HEADS, HEAD_DIM)
        joined = a.new_empty(*a.shape[:-1], 2 * HEAD_DIM)
        joined[..., :HEAD_DIM].copy_(a)
        joined[..., HEAD_DIM:].copy_(b)
        flat = joined.reshape(*x.shape[:2], 2 * DIM)
        nothing = flat.new_zeros((x.shape[0], 0, 2 * DIM))
        return self.o(torch.cat((nothing, flat), dim=1))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_new_buffer_filled_by_copies_follows_the_parts_copied_in(tp: int) -> None:
    gm, plan = _plan(BufferFilledByCopies(), tp)
    kinds = _kinds(plan)
    assert kinds["a.weight"] == kinds["b.weight"] == "column" and kinds["o.weight"] == "row", kinds
    (new_empty,) = _rank_nodes(gm, plan, aten.new_empty.default)
    assert list(new_empty.args[1]) == [2, 8, HEADS // tp, 2 * HEAD_DIM]  # the rank's heads
    (cat,) = _rank_nodes(gm, plan, aten.cat.default)  # the empty part is left out: whole, it would not fit the rank's part
    assert len(cat.args[0]) == 1 and cat.args[0][0].target is not aten.new_zeros.default


@pytest.mark.parametrize("tp", [2, 4])
def test_einsum_experts_are_column_then_row_parallel(tp: int) -> None:
    gm, plan = _plan(EinsumDispatchMoE(), tp)
    kinds = _kinds(plan)
    assert kinds["w_in"] == "column" and kinds["w_out"] == "row", kinds


class TorchEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch_encoder_layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.parametrize("tp", [2, 4])
def test_multihead_attention_batch_times_heads_view_keeps_the_heads_split(tp: int) -> None:
    """``F.multi_head_attention_forward`` views ``[L, B, E]`` as ``[L, B*H, D]``."""
    gm, plan = _plan(TorchEncoder(), tp)
    kinds = _kinds(plan)
    assert kinds["layer.self_attn.in_proj_weight"] == "column" and kinds["layer.self_attn.out_proj.weight"] == "row"
    (unflatten,) = _rank_nodes(gm, plan, aten.unflatten.int)
    assert list(unflatten.args[2]) == [3, DIM // tp]  # q, k, v of the rank's heads
    views = [list(n.args[1]) for n in _rank_nodes(gm, plan, aten.view.default)]
    assert [8, 2 * HEADS // tp, HEAD_DIM] in views  # [L, B*H, D] of the rank's heads


def test_a_tied_head_behind_a_column_parallel_transform_keeps_the_vocab_split() -> None:
    """``decoder(norm(gelu(dense(h))))`` with the decoder tied to the token embedding: only the
    transform (split on the decoder's contracted dim) goes whole, the vocabulary stays split."""
    ids = torch.randint(0, 128, (2, 16))
    gm, plan = _plan(EncoderMaskedLM(), 4, input_ids=ids)
    kinds = _kinds(plan)
    assert kinds["decoder.weight"] == "vocab" and "decoder.weight" not in _kept(plan)  # the tied table's one name
    assert "dense.weight" in _kept(plan) or [g.op for g in plan.gathered], plan.gathered  # or its output gathered whole


class ExpertsByIndex(nn.Module):
    """JetMoE's ``ParallelExperts``: one stacked ``[E, out, in]`` weight, ``F.linear(rows_i, weight[i])``."""

    def __init__(self, experts: int = 2) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, 2 * DIM, DIM) / DIM**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, DIM, 2 * DIM) / DIM**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, DIM).chunk(self.w_in.shape[0])
        outs = [F.linear(F.gelu(F.linear(r, self.w_in[i])), self.w_out[i]) for i, r in enumerate(rows)]
        return torch.cat(outs).view_as(x)


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_indexed_out_of_a_stacked_weight_are_column_then_row_parallel(tp: int) -> None:
    gm, plan = _plan(ExpertsByIndex(), tp)
    kinds = _kinds(plan)
    assert kinds["w_in"] == "column" and kinds["w_out"] == "row", kinds
