"""Unit tier for the analysis layer: layout propagation on tiny hand-written modules,
the op classifier, per-rank shapes and the layer rule. No process groups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from autotp.analysis.layers import (
    EMBEDDING,
    HEAD,
    last_layer_position,
    layer_index,
    layer_of,
    num_layers,
    outside_layers,
    with_layer_index,
)
from autotp.analysis.local_shapes import local_shape, local_slice_bounds, local_tensors
from autotp.ir.op_facts import OpKind, is_matmul, op_kind, op_name
from autotp.analysis.op_rules import RULES, rule_for
from autotp.analysis.propagation import propagate
from autotp.analysis.propagation_result import NodeRole, Propagation, check_divisible, param_sharding
from autotp.analysis.shapes import reshape_chunks
from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.plan import KEPT_WHOLE_CONFLICT
from autotp.ir.layouts import PARTIAL, REPLICATE, DimVar, resolve, set_segments
from autotp.passes.annotate_layouts import annotate_layouts
from autotp.passes.runner import PassContext

aten = torch.ops.aten
D, HEADS, HEAD_DIM, VOCAB = 16, 4, 4, 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """Multi-head attention with ``kv_heads`` key/value heads, repeated (``repeat_kv``) to
    the query heads, and optionally one fused QKV projection split three ways."""

    def __init__(self, kv_heads: int = HEADS, fused: bool = False) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.fused = fused
        q_out, kv_out = HEADS * HEAD_DIM, kv_heads * HEAD_DIM
        if fused:
            self.qkv = nn.Linear(D, q_out + 2 * kv_out, bias=False)
        else:
            self.q = nn.Linear(D, q_out, bias=False)
            self.k = nn.Linear(D, kv_out, bias=False)
            self.v = nn.Linear(D, kv_out, bias=False)
        self.o = nn.Linear(q_out, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        kv_out = self.kv_heads * HEAD_DIM
        if self.fused:
            q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, kv_out, kv_out], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        rep = HEADS // self.kv_heads
        if rep > 1:
            k = k[:, :, None].expand(b, self.kv_heads, rep, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
            v = v[:, :, None].expand(b, self.kv_heads, rep, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class EmbeddingLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


class NormOverShardedDim(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.norm = nn.LayerNorm(4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


class SoftmaxOverShardedDim(NormOverShardedDim):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x).softmax(-1))


class Stack(nn.Module):
    """Embedding, two numbered layers, a head: the layer rule's test model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(MLP() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _trace(module: nn.Module, **inputs: torch.Tensor) -> GraphModule:
    return trace(module.eval(), inputs)


def _x() -> torch.Tensor:
    return torch.randn(2, 8, D)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8))


def _nodes(gm: GraphModule, *targets: object) -> list[Node]:
    return [n for n in gm.graph.nodes if n.target in targets]


def _kinds(prop: Propagation) -> dict[str, tuple[str, int | None]]:
    return {name: (d.kind, d.dim) for name, d in prop.decisions.items()}


def _annotate(gm: GraphModule, tp: int) -> None:
    annotate_layouts(gm, PassContext(plan_tensor_parallel(gm, tp)))


class TwoSlices(nn.Module):
    """A fused projection read back through two slices of its sharded output dim."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = nn.Linear(D, 8 * D, bias=False)
        self.down_a = nn.Linear(4 * D, D, bias=False)
        self.down_b = nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fused(x)
        return self.down_a(F.silu(h[..., : 4 * D])) + self.down_b(h[..., 4 * D :])


# ---- propagation: layouts, roles, decisions --------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_an_empty_part_of_a_split_dim_constrains_nothing(tp: int) -> None:
    """A head's features cut into a rotary half, its other half and an empty rest (an indexer whose
    head dim is its rotary dim: ``split([rope_dim, head_dim - rope_dim])``): the empty part is one
    empty block on every rank. It gave blocks of 0 elements, and checking them divided by zero."""
    features = DimVar(16, frozenset({"q.weight"}))
    halves = set_segments(features, [8, 8, 0], "split")
    sharding = resolve(features, tp)
    assert sharding.groups[2] == 1 and sharding.check(tp) is None and sharding.local_size(tp) >= 0
    assert resolve(halves[2], tp).check(tp) is None


def test_mlp_is_a_column_row_pair() -> None:
    gm = _trace(MLP(), x=_x())
    prop = propagate(gm, 2)
    assert not prop.conflicts
    assert _kinds(prop) == {
        "up.weight": ("column", 0),
        "up.bias": ("bias", 0),
        "down.weight": ("row", 1),
        "down.bias": ("replicate", None),
    }
    up, down = _nodes(gm, aten.linear.default)
    assert prop.layout(up).describe(2) == "Shard(2:32/64)"
    assert prop.layout(_nodes(gm, aten.gelu.default)[0]).describe(2) == "Shard(2:32/64)"
    # the row-parallel matmul's bias is added after the all-reduce
    assert prop.roles == {down: NodeRole.ROW_WITH_BIAS}
    assert prop.layout(down) == REPLICATE
    assert param_sharding(prop, "down.bias") is None
    kind, dim, sharding = param_sharding(prop, "up.weight")
    assert (kind, dim, sharding.local_size(2)) == ("column", 0, 32)


def test_attention_shards_heads_and_reduces_after_the_output_projection() -> None:
    gm = _trace(Attention(), x=_x())
    prop = propagate(gm, 2)
    assert not prop.conflicts
    assert _kinds(prop) == {"q.weight": ("column", 0), "k.weight": ("column", 0), "v.weight": ("column", 0), "o.weight": ("row", 1)}
    (sdpa,) = _nodes(gm, aten.scaled_dot_product_attention.default)
    assert prop.layout(sdpa).describe(2) == "Shard(1:2/4)"  # [B, H, S, D] on heads
    o_proj = _nodes(gm, aten.linear.default)[-1]
    assert prop.layout(o_proj) == PARTIAL
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert prop.reduce_inputs == {output: [o_proj]}


def test_fused_qkv_split_gives_each_part_its_heads() -> None:
    gm = _trace(Attention(kv_heads=2, fused=True), x=_x())
    prop = propagate(gm, 2)
    assert not prop.conflicts
    assert _kinds(prop) == {"qkv.weight": ("column", 0), "o.weight": ("row", 1)}
    (split,) = _nodes(gm, aten.split_with_sizes.default)
    parts = prop.layouts[split]
    assert [p.describe(2) for p in parts] == ["Shard(2:8/16)", "Shard(2:4/8)", "Shard(2:4/8)"]
    check_divisible(prop, gm)


def test_repeat_kv_records_an_expand_fixup() -> None:
    gm = _trace(Attention(kv_heads=2), x=_x())
    prop = propagate(gm, 2)
    assert not prop.conflicts
    expands = _nodes(gm, aten.expand.default)
    assert set(prop.expand_fixups) == set(expands)
    for e in expands:
        ((dim, merged, outer),) = prop.expand_fixups[e]
        assert (dim, merged.find().size, outer.find().size) == (2, 4, 2)  # the repeat dim; 4 heads from 2
        assert prop.layout(e).describe(2) == "Shard(1:1/2)"


def test_embedding_and_cross_entropy_are_vocab_parallel() -> None:
    gm = _trace(EmbeddingLM(), ids=_ids(), labels=_ids())
    prop = propagate(gm, 2)
    assert not prop.conflicts
    assert _kinds(prop) == {"embed.weight": ("vocab", 0), "head.weight": ("column", 0)}
    (embedding,) = _nodes(gm, aten.embedding.default)
    (loss,) = _nodes(gm, aten.cross_entropy_loss.default)
    assert prop.roles == {embedding: NodeRole.VOCAB_EMBEDDING, loss: NodeRole.VOCAB_CROSS_ENTROPY}
    assert prop.layout(embedding) == PARTIAL
    head = _nodes(gm, aten.linear.default)[0]
    assert prop.reduce_inputs == {head: [embedding]}  # the lookup is reduced before the head reads it


def test_policy_can_forbid_the_vocab_table() -> None:
    gm = _trace(EmbeddingLM(), ids=_ids(), labels=_ids())
    prop = propagate(gm, 2, policy=lambda name, kind, shape: kind != "vocab")
    assert _kinds(prop)["embed.weight"] == ("replicate", None)
    assert NodeRole.VOCAB_EMBEDDING not in prop.roles.values()


def test_norm_over_a_sharded_dim_takes_a_tp_reduced_statistic() -> None:
    gm = _trace(NormOverShardedDim(), x=_x())
    prop = propagate(gm, 2)
    assert not prop.conflicts
    (norm,) = _nodes(gm, aten.layer_norm.default)
    assert prop.roles[norm] is NodeRole.SHARDED_NORM and prop.layout(norm).describe(2) == "Shard(2:32/64)"
    assert _kinds(prop) == {
        "up.weight": ("column", 0), "up.bias": ("bias", 0), "norm.weight": ("bias", 0), "norm.bias": ("bias", 0),
        "down.weight": ("row", 1), "down.bias": ("replicate", None),
    }  # fmt: skip
    # forbidden there, it is a conflict blamed on the producer
    forbidden = propagate(gm, 2, statistics=lambda n: n is not norm)
    (conflict,) = forbidden.conflicts
    assert conflict.origins == {"up.weight"} and conflict.statistic == norm.name
    # the planner keeps the statistic: the MLP stays sharded
    plan = plan_tensor_parallel(gm, 2)
    assert {p.name: p.kind for p in plan.params} == {
        "up.weight": "column", "up.bias": "bias", "norm.weight": "bias", "norm.bias": "bias", "down.weight": "row",
    }  # fmt: skip


def test_op_that_needs_a_sharded_dim_whole_is_a_conflict_blamed_on_its_producer() -> None:
    gm = _trace(SoftmaxOverShardedDim(), x=_x())
    prop = propagate(gm, 2)
    (conflict,) = prop.conflicts
    assert "needs a sharded dim whole" in str(conflict)
    assert conflict.origins == {"up.weight"}
    (softmax,) = _nodes(gm, aten._softmax.default, aten.softmax.int)
    assert prop.layout(softmax) == REPLICATE  # the walk goes on as if replicated
    # the planner gathers the softmax's input (16 tokens: fewer bytes than up.weight's state)
    plan = plan_tensor_parallel(gm, 2)
    assert {p.name: p.kind for p in plan.params}["up.weight"] == "column"
    (gathered,) = plan.gathered
    linear = softmax.args[0]
    assert (gathered.tensor, gathered.node, gathered.op, gathered.bytes) == (linear.name, softmax.name, "softmax", 2 * 8 * 4 * D * 4)
    # with 1024 tokens the gathered activation outweighs the weight: the culprit is kept whole
    gm = _trace(SoftmaxOverShardedDim(), x=torch.randn(4, 256, D))
    (softmax,) = _nodes(gm, aten._softmax.default, aten.softmax.int)
    plan = plan_tensor_parallel(gm, 2)
    assert {p.name: p.kind for p in plan.params} == {"down.weight": "column", "down.bias": "bias"} and not plan.gathered
    kept = {k.name: k for k in plan.kept_whole}
    assert kept["up.weight"].reason == KEPT_WHOLE_CONFLICT and kept["up.weight"].node == softmax.name
    assert kept["up.weight"].op == "softmax" and kept["up.weight"].bytes == 4 * D * D * 4


def test_a_plan_that_does_not_fit_is_a_value_error() -> None:
    gm = _trace(SoftmaxOverShardedDim(), x=_x())
    bad = plan_tensor_parallel(_trace(MLP(), x=_x()), 2)  # shards up.* like the failing walk
    with pytest.raises(ValueError, match="the plan does not fit the graph at .*softmax"):
        propagate(gm, 2, plan=bad)


def test_fixed_mode_reproduces_the_planned_layouts() -> None:
    gm = _trace(Attention(kv_heads=2), x=_x())
    planned = propagate(gm, 2)
    fixed = propagate(gm, 2, plan=plan_tensor_parallel(gm, 2))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            a, b = planned.layouts[node], fixed.layouts[node]
            assert (a.describe(2), a.partial) == (b.describe(2), b.partial), node.name


def test_needs_grad_follows_the_parameters() -> None:
    gm = _trace(MLP(), x=_x())
    prop = propagate(gm, 2)
    assert all(prop.needs_grad[n] for n in _nodes(gm, aten.linear.default, aten.gelu.default))
    assert not prop.needs_grad[next(n for n in gm.graph.nodes if n.op == "placeholder")]


def test_every_rule_is_found_in_one_table() -> None:
    assert rule_for(aten.linear.default) is RULES[aten.linear.default]
    assert rule_for(aten.gelu.default) is not None  # pointwise by tag
    assert rule_for(aten.nonzero.default) is None  # opaque
    assert reshape_chunks((2, 8, 16), (2, 8, 4, 4)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert reshape_chunks((2, 3), (7,)) is None


# ---- op classifier ---------------------------------------------------------------------


def test_op_kinds() -> None:
    assert op_name(aten.linear.default) == "linear"
    assert op_kind(aten.addmm.default) is OpKind.MATMUL
    assert op_kind(aten._grouped_mm.default) is OpKind.GROUPED_MATMUL
    assert op_kind(aten.scaled_dot_product_attention.default) is OpKind.ATTENTION
    assert op_kind(aten.embedding.default) is OpKind.EMBEDDING
    assert op_kind(aten.add.Tensor) is OpKind.OTHER
    assert OpKind.GROUPED_MATMUL.is_matmul and not OpKind.ATTENTION.is_matmul
    gm = _trace(MLP(), x=_x())
    assert [n.name for n in gm.graph.nodes if is_matmul(n)] == ["linear", "linear_1"]


# ---- local shapes ----------------------------------------------------------------------


@pytest.mark.parametrize("tp, repeat", [(2, 2), (4, 1)])
def test_local_shapes_of_repeat_kv(tp: int, repeat: int) -> None:
    """At tp=4 the two KV heads are each held by two ranks: one KV head, one query head, no repeat."""
    gm = _trace(Attention(kv_heads=2), x=_x())
    _annotate(gm, tp)
    expand = _nodes(gm, aten.expand.default)[0]
    assert local_shape(expand, tp) == (2, 1, repeat, 8, HEAD_DIM)
    assert local_shape(expand.next, tp) == (2, HEADS // tp, 8, HEAD_DIM)  # the merging reshape
    weights = {n.name: local_shape(n, tp) for n in gm.graph.nodes if n.op == "get_attr"}
    assert weights == {"q_weight": (16 // tp, D), "k_weight": (4, D), "v_weight": (4, D), "o_weight": (D, 16 // tp)}


def test_local_shapes_of_splits_and_slices() -> None:
    gm = _trace(Attention(kv_heads=2, fused=True), x=_x())
    _annotate(gm, 2)
    (split,) = _nodes(gm, aten.split_with_sizes.default)
    assert [t.shape for t in local_tensors(split, 2)] == [(2, 8, 8), (2, 8, 4), (2, 8, 4)]
    gm = _trace(TwoSlices(), x=_x())
    _annotate(gm, 2)
    slices = _nodes(gm, aten.slice.Tensor)
    assert [local_slice_bounds(s, 2) for s in slices] == [(0, 32), (32, 64)]
    assert [local_shape(s, 2) for s in slices] == [(2, 8, 32), (2, 8, 32)]


def test_local_shapes_without_a_layout_are_global() -> None:
    gm = _trace(MLP(), x=_x())
    assert [local_shape(n, 2) for n in _nodes(gm, aten.linear.default)] == [(2, 8, 64), (2, 8, 16)]


# ---- layer rule ------------------------------------------------------------------------


def test_layer_index_of_names() -> None:
    assert layer_index("model.layers.3.mlp.up_proj.weight") == 3
    assert layer_index("transformer.h.12") == 12
    assert layer_index("lm_head.weight") is None
    assert with_layer_index("model.layers.0.mlp.weight", 5) == "model.layers.5.mlp.weight"


def test_layers_and_sections_of_nodes() -> None:
    gm = _trace(Stack(), ids=_ids())
    nodes = list(gm.graph.nodes)
    assert num_layers(gm) == 2
    (embedding,) = _nodes(gm, aten.embedding.default)
    linears = _nodes(gm, aten.linear.default)
    assert [layer_of(n) for n in linears] == [0, 0, 1, 1, None]
    last = last_layer_position(nodes)
    assert nodes[last].meta["nn_module_stack"] and layer_of(nodes[last]) == 1
    assert outside_layers(nodes.index(embedding), last) == EMBEDDING
    assert outside_layers(nodes.index(linears[-1]), last) == HEAD


def test_repeated_heads_must_repeat_the_ranks_own_heads() -> None:
    """``repeat_kv`` (expand, then a reshape merging the repeats into the heads) runs on each
    rank's part only where the rank's query heads repeat its own key heads: 8 query heads over 4
    KV heads at tp=4 and at tp=8 (each KV head on two ranks) do; KV heads held whole on every
    rank beside query heads in two blocks of two do not (ZAYA's values at tp=4, which the rank
    graphs otherwise computed with the wrong value heads), and the planner keeps those
    parameters whole."""
    from autotp.analysis.propagation_result import misaligned_repeats
    from autotp.ir.dim_sharding import DimSharding

    gqa = DimSharding(8, (8,), (8,)), DimSharding(4, (4,), (4,))
    assert misaligned_repeats(*gqa, 4) is None and misaligned_repeats(*gqa, 8) is None
    whole_heads = DimSharding(2, (1, 1), (1, 1))
    assert "do not repeat" in misaligned_repeats(DimSharding(4, (4,), (2,)), whole_heads, 4)
    assert misaligned_repeats(DimSharding(4, (2, 2), (2, 2)), whole_heads, 4) is None  # heads 0 and 2: one of each
