"""Constructs of the sixth round of issue 27 (``tests/plain_models_domains.py``): quantization
scales over sharded dims, what the planner decides for them in one process and the numerics on
ranks. ``test_plain_suite`` checks the whole models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.analysis.propagation import propagate
from autotp.analysis.propagation_result import NodeRole
from autotp.analysis.trace import trace
from autotp.compiler import choose_plan
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir import ops
from autotp.ir.errors import UserInputError
from distributed import run_on_ranks
from plain_models_attention import DIM, VOCAB
from plain_models_domains import FakeQuantLinear, build, example_inputs


class _QuantizedMLP(nn.Module):
    """An MLP under int8 QAT, whose down projection also clips by its input's smallest value."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.up, self.down, self.head = nn.Embedding(VOCAB, DIM), FakeQuantLinear(DIM, 4 * DIM), FakeQuantLinear(4 * DIM, DIM), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = F.gelu(self.up(self.embed(input_ids)))
        h = h - h.detach().amin().clamp(max=0)
        logits = self.head(self.down(h))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class _MaxPooledByGrad(nn.Module):
    """``amax`` over the hidden dim with a gradient: each rank's maximum alone would send the
    gradient to every rank that ties, so this one needs its dim whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.up, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(1, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.up(self.embed(input_ids)).amax(dim=-1, keepdim=True))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class _ArgmaxFeature(nn.Module):
    """``max(dim)`` whose indices are read: a rank's index is local, so the dim stays whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.up, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(2, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        peak, where = self.up(self.embed(input_ids)).detach().max(dim=-1, keepdim=True)
        logits = self.head(torch.cat([peak, where.float()], -1))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {k: torch.randint(0, VOCAB, (2, 8), generator=gen) for k in ("input_ids", "labels")}


def test_quantization_scales_over_a_sharded_dim_are_max_reduced() -> None:
    """The row-parallel projection's per-channel weight scales (``amax`` over its split input
    dim) and its input's per-tensor scale (``amax`` of a split activation) are each rank's
    maximum, max-reduced over the group; the column-parallel one's scales follow its split rows."""
    gm = trace(_QuantizedMLP().eval(), _inputs())
    plan = plan_tensor_parallel(gm, 2)
    layouts = {p.name: p for p in plan.params}
    assert (layouts["up.weight"].kind, layouts["down.weight"].kind) == ("column", "row")
    prop = propagate(gm, 2, plan=plan)
    extrema = sorted(n.name for n, role in prop.roles.items() if role is NodeRole.SHARDED_EXTREMUM)
    assert extrema == ["amax_2", "amax_3", "amin"], extrema


def test_an_extremum_that_takes_a_gradient_is_not_reduced_by_rank() -> None:
    gm = trace(_MaxPooledByGrad().eval(), _inputs())
    prop = propagate(gm, 2)
    assert NodeRole.SHARDED_EXTREMUM not in prop.roles.values() and "needs a sharded dim whole" in str(prop.conflicts[0])


def test_straight_through_scales_over_a_sharded_dim_are_max_reduced() -> None:
    """BitNet's quantizers: a per-token scale from ``max(dim).values`` of an activation that takes a
    gradient, detached only after the quantization (the gradient of the maximum reaches no loss),
    and a ternary weight scaled by its mean magnitude. Each rank's maximum, max-reduced; before,
    the row-parallel projection's input was gathered at the ``max``."""
    gm = trace(build("ternary_ste_mlp"), example_inputs("ternary_ste_mlp"))
    plan = plan_tensor_parallel(gm, 2)
    layouts = {p.name: p.kind for p in plan.params}
    assert (layouts["layers.0.feed_forward.up.weight"], layouts["layers.0.feed_forward.down.weight"]) == ("column", "row")
    assert plan.gathered == (), plan.gathered
    prop = propagate(gm, 2, plan=plan)
    extrema = [n.target for n, role in prop.roles.items() if role is NodeRole.SHARDED_EXTREMUM]
    assert extrema == [torch.ops.aten.max.dim] * 2, extrema


def test_a_maximum_whose_indices_are_read_needs_its_dim_whole() -> None:
    gm = trace(_ArgmaxFeature().eval(), _inputs())
    prop = propagate(gm, 2)
    assert NodeRole.SHARDED_EXTREMUM not in prop.roles.values() and "needs a sharded dim whole" in str(prop.conflicts[0])


def test_a_function_scaling_forward_and_backward_apart_is_elementwise_on_shards() -> None:
    """Unit scaling's Function saves ``torch.tensor(bwd_scale)``, a scalar its forward makes: it was
    an opaque node that no sharded input may enter, so every linear was kept whole."""
    gm = trace(build("unit_scaled_mlp"), example_inputs("unit_scaled_mlp"))
    plan = plan_tensor_parallel(gm, 4)
    layouts = {p.name: p.kind for p in plan.params}
    assert (layouts["layers.0.feed_forward.up.weight"], layouts["layers.0.feed_forward.down.weight"]) == ("column", "row")
    assert {n.target for n in gm.graph.nodes if "_ScaledGrad" in str(n.args[2:3])} == {ops.ELEMENTWISE_FUNCTION}


def test_a_number_computed_from_the_batch_size_refuses_a_split_step() -> None:
    """Each piece of a split step traced its own ``numel()`` into the unit-scaled Function's call (at
    pp=2 the embedding's gradient was sqrt(2) off, silently); whole, the step is the model's."""
    name = "unit_scaled_mlp"
    model, inputs = build(name), example_inputs(name)
    trace(model, inputs)
    piece = {k: v[:1] for k, v in inputs.items()}
    with pytest.raises(UserInputError, match=r"computes a number from its batch's size at .*custom Function .*_ScaledGrad.* for a piece of 1 rows"):
        trace(model, piece, split_batch=True)


def _strict(rank: int, world: int, name: str) -> str:
    from autotp.report.strict_rule import check_on_rank

    own = {"quantized_mlp": _QuantizedMLP, "max_pooled": _MaxPooledByGrad, "argmax_feature": _ArgmaxFeature}
    if name in own:
        return check_on_rank(own[name]().eval(), _inputs(), tp=world).reason
    return check_on_rank(build(name), example_inputs(name), tp=world).reason


@pytest.mark.parametrize("name", ["quantized_mlp", "max_pooled", "argmax_feature", "ternary_ste_mlp", "unit_scaled_mlp"])
def test_extrema_at_tp2_equal_the_unmodified_model(name: str) -> None:
    assert run_on_ranks(_strict, 2, name) == ["", ""]


def test_the_qat_model_of_the_suite_splits_both_projections() -> None:
    gm = trace(build("fake_quant_qat"), example_inputs("fake_quant_qat"))
    layouts = {p.name: p for p in plan_tensor_parallel(gm, 4).params}
    assert layouts["layers.0.feed_forward.down.weight"].kind == "row" and layouts["layers.0.feed_forward.up.weight"].kind == "column"


def test_a_model_without_a_layer_list_is_pipelined_between_its_blocks() -> None:
    """The hourglass runs eight modules one after another and has no numbered list: a pipeline
    cuts between those blocks, and one deeper than them names how deep it can go."""
    gm = trace(build("hourglass_shortening"), example_inputs("hourglass_shortening"))
    plan = choose_plan(gm, 1, 2, 1, 1, None)
    assert plan.layer_chunks == () and {chunk for _, chunk in plan.module_chunks} == {0}, plan.module_chunks
    with pytest.raises(UserInputError, match=r"cuts between the 8 modules the forward runs one after another; use pp\*vpp <= 8"):
        choose_plan(gm, 1, 16, 1, 1, None)


def test_scans_along_the_sequence_keep_the_split_channels() -> None:
    """``logcumsumexp``, ``cummax`` (and ``cumprod``, ``cummin``) scan one dim: the channels
    split by the projection before them stay split (they were opaque: the projection was kept
    whole, 35% of the model on a rank at tp=4)."""
    gm = trace(build("log_space_scans"), example_inputs("log_space_scans"))
    plan = plan_tensor_parallel(gm, 4)
    layouts = {p.name: p for p in plan.params}
    assert layouts["layers.0.attention.in_proj.weight"].kind == "column" and layouts["layers.0.attention.out_proj.weight"].kind == "row"
    assert not {k.name for k in plan.kept_whole} & {"layers.0.attention.in_proj.weight", "layers.0.attention.out_proj.weight"}
