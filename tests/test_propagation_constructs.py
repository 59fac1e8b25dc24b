"""Issue 27's constructs on tiny modules, one process, no process group: each is sharded
(the plan and the per-rank shapes say how), kept whole with a plan entry naming the node,
the op and the bytes, or refused with one clear error. ``test_plain_models`` checks the
numerics of whole models built from them on gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from autotp.analysis.local_shapes import local_shape
from autotp.analysis.propagation import propagate
from autotp.analysis.propagation_result import NodeRole
from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir import meta_keys, ops
from autotp.ir.dim_sharding import DimSharding
from autotp.ir.plan import KEPT_WHOLE_CONFLICT, KEPT_WHOLE_READ_WHOLE, ParallelPlan
from autotp.compiler import lower
from plain_models_attention import (
    DIM,
    EmptyCacheAttention,
    GroupedOutputAttention,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LatentAttention,
    MultiQueryPartialRotary,
    FalconBroadcastKV,
    FalconMultiQuery,
    PairedHeadsAttention,
    QKNormAttention,
    SlicedKeyMultiQuery,
    RepeatInterleaveAttention,
    TitanAttention,
    precompute_freqs_cis,
)
from distributed import run_on_ranks
from plain_models_einops import build as build_einops, example_inputs as einops_inputs
from plain_models_library import ParallelBlock, WeightNormMLP, build as build_library, example_inputs as library_inputs
from plain_models_mixers import HeadExperts, LinearAttention, LoopMoE, StackedExperts, ViTAttention

aten = torch.ops.aten


def _x() -> torch.Tensor:
    return torch.randn(2, 8, DIM)


def _plan(module: nn.Module, tp: int, **inputs: torch.Tensor) -> tuple[GraphModule, ParallelPlan]:
    gm = trace(module.eval(), inputs or {"x": _x()})
    return gm, plan_tensor_parallel(gm, tp)


def _kinds(plan: ParallelPlan) -> dict[str, tuple[str, DimSharding]]:
    return {p.name: (p.kind, p.sharding) for p in plan.params}


def _rank_graph(gm: GraphModule, plan: ParallelPlan, rank: int = 0) -> GraphModule:
    return lower(gm, plan, tp_rank=rank, device="cpu", backend="gloo").graph


def _kept(plan: ParallelPlan) -> dict[str, tuple[str, str, str, int]]:
    return {k.name: (k.reason, k.node, k.op, k.bytes) for k in plan.kept_whole}


class Titan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = TitanAttention()
        self.register_buffer("freqs_cis", precompute_freqs_cis(HEAD_DIM, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, self.freqs_cis)


@pytest.mark.parametrize("tp", [2, 4])
def test_gqa_by_repeat_interleave_repeats_each_ranks_own_kv_heads(tp: int) -> None:
    gm, plan = _plan(RepeatInterleaveAttention(), tp)
    kinds = _kinds(plan)
    assert kinds["qkv.weight"][0] == "column" and kinds["proj.weight"][0] == "row"
    # q heads, then k and v heads: each part split by heads; 2 KV heads at tp=4 are held twice
    assert kinds["qkv.weight"][1] == DimSharding(96, (64, 16, 16), (8, 2, 2))
    rank = _rank_graph(gm, plan)
    repeats = [n.args[1] for n in rank.graph.nodes if n.target is aten.repeat_interleave.self_int]
    assert repeats == [HEADS // tp // max(KV_HEADS // tp, 1)] * 2  # local q heads per local kv head


@pytest.mark.parametrize("tp", [2, 4])
def test_one_kv_head_with_head_dim_slices_replicates_the_kv_head(tp: int) -> None:
    """A fused QKV with a single KV head, then partial rotary ``k[..., :rot]`` (construct 3)."""
    gm, plan = _plan(MultiQueryPartialRotary(), tp)
    kind, sharding = _kinds(plan)["query_key_value.weight"]
    assert kind == "column" and sharding == DimSharding(80, (64, 8, 8), (8, 1, 1))  # k and v on every rank
    assert _kinds(plan)["dense.weight"][0] == "row"
    rank = _rank_graph(gm, plan)
    expands = [n for n in rank.graph.nodes if n.target is aten.expand.default]
    assert [list(n.args[1])[1] for n in expands] == [HEADS // tp] * 2  # the one head broadcast to the local heads


@pytest.mark.parametrize("tp", [2, 4])
def test_one_kv_head_taken_by_constant_index_or_sliced_before_its_view(tp: int) -> None:
    """Falcon-7B's ``fused[..., [-2], :]`` is a slice of the heads; a key cut in halves and
    joined again (``cat`` along the cut dim) keeps each half its own segment."""
    for module, name in ((FalconMultiQuery(), "query_key_value.weight"), (SlicedKeyMultiQuery(), "qkv.weight")):
        gm, plan = _plan(module, tp)
        kind, sharding = _kinds(plan)[name]
        assert kind == "column" and sharding.local_size(tp) == 64 // tp + 16, sharding  # local q heads, k and v whole
    rank = _rank_graph(gm, plan)
    halves = [n.args[2:4] for n in rank.graph.nodes if n.target is aten.slice.Tensor and n.args[1] == 2]
    assert halves[:2] == [(0, 4), (4, 8)]


@pytest.mark.parametrize("tp", [2, 4])
def test_one_kv_head_broadcast_by_attention_keeps_the_query_heads_split(tp: int) -> None:
    """HF Falcon: the one key and value head pass a reshape that keeps their size-1 head dim
    and reach SDPA without an expand; the key and value index their own positions."""
    gm, plan = _plan(FalconBroadcastKV(), tp)
    kind, sharding = _kinds(plan)["query_key_value.weight"]
    assert kind == "column" and sharding == DimSharding(80, (64, 8, 8), (HEADS, 1, 1))
    assert _kinds(plan)["dense.weight"][0] == "row" and not plan.kept_whole
    rank = _rank_graph(gm, plan)
    kv = [n.args[2:4] for n in rank.graph.nodes if n.target is aten.slice.Tensor and n.args[1] == 2][:3]
    local = HEADS // tp
    assert kv == [(0, local), (local, local + 1), (local + 1, local + 2)]  # q heads, the key head, the value head


@pytest.mark.parametrize("tp", [2, 4])
def test_one_kv_head_expanded_to_all_heads_is_held_whole_and_read_by_the_ranks_heads(tp: int) -> None:
    """A parallel block (GPT-J / PaLM): one projection for q, one k and one v head, gate and up;
    k and v expanded to every query head before SDPA. Their segments are held whole, the rank
    reads its heads of the expanded k and v."""
    gm, plan = _plan(ParallelBlock(), tp)
    kind, sharding = _kinds(plan)["fused.weight"]
    assert kind == "column" and sharding.segments == (64, 8, 8, 128, 128) and sharding.groups[1:3] == (1, 1), sharding
    assert sharding.local_size(tp) == 64 // tp + 16 + 256 // tp
    assert _kinds(plan)["attn_out.weight"][0] == _kinds(plan)["ff_out.weight"][0] == "row"
    assert "fused.weight" not in _kept(plan)
    local = HEADS // tp
    for rank in range(tp):
        heads = [n.args[2:4] for n in _rank_graph(gm, plan, rank).graph.nodes if n.target is aten.slice.Tensor and n.args[1] == 1]
        assert heads == [(rank * local, (rank + 1) * local)] * 2  # of the expanded key, of the value


def _library_model_at(rank: int, world: int, name: str) -> tuple[bool, str, float]:
    from autotp.report.strict_rule import check_on_rank

    result = check_on_rank(build_library(name), library_inputs(name), tp=world)
    return result.equal, result.reason, result.share


@pytest.mark.parametrize("tp", [2, 4])
def test_one_value_head_contracted_by_einsum_is_held_whole_and_the_query_heads_stay_split(tp: int) -> None:
    """PaLM's attention: one key and one value head with no heads letter, ``"bhij,bjd->bhid"``.
    The query heads split ``attn`` on ``h`` and the fused projection's value segment split ``v``
    on ``d``, both kept by the output: the value head is held whole as the key head is (the
    projection was kept whole before: PaLM-rlhf, 85% of the model on a rank at tp=2)."""
    gm, plan = _plan(build_library("parallel_einsum_mqa_block"), tp, **library_inputs("parallel_einsum_mqa_block"))
    assert not plan.gathered and all(why == KEPT_WHOLE_READ_WHOLE for why, *_ in _kept(plan).values()), (plan.gathered, _kept(plan))
    for layer in range(2):
        kind, sharding = _kinds(plan)[f"layers.{layer}.fused.weight"]
        assert kind == "column" and sharding.local_size(tp) == DIM // tp + 2 * HEAD_DIM + 4 * DIM // tp, sharding  # k and v whole
        assert _kinds(plan)[f"layers.{layer}.attn_out.weight"][0] == "row"
    for equal, reason, share in run_on_ranks(_library_model_at, tp, "parallel_einsum_mqa_block"):
        assert equal, reason
        assert share <= 1.3 / tp


@pytest.mark.parametrize("tp", [2, 4])
def test_a_matrix_vector_matmul_makes_the_vector_row_parallel(tp: int) -> None:
    """``tanh(W x) @ v`` and ``u @ tanh(W' x)^T`` with 1-D ``v`` and ``u`` (additive attention scores;
    hyper-connections' ``normed @ dynamic_beta_fn``) contract the projections' split features: the
    vectors split with them and the scores are partial sums. A matmul of a 1-D operand took no split
    input before: the projections were gathered whole or kept whole (coconut and E2-TTS at tp=4)."""
    name = "additive_pooling_matvec"
    _, plan = _plan(build_library(name), tp, **library_inputs(name))
    kinds = _kinds(plan)
    for layer in range(2):
        at = f"layers.{layer}.attention"
        assert [kinds[f"{at}.{p}"][0] for p in ("proj.weight", "key.weight", "v", "u")] == ["column", "column", "row", "row"]
    for equal, reason, share in run_on_ranks(_library_model_at, tp, name):
        assert equal, reason
        assert share <= 1.3 / tp


@pytest.mark.parametrize("tp", [2, 4])
def test_views_through_size_one_factors_and_back_keep_one_split(tp: int) -> None:
    """``y + y.view(b, s, 1, d).view(b, s, 1, 1, d).view(b, s, d)``: each view splits the dim into a
    size-1 factor and itself, whose split is the dim's own; the add joined the ends of two such
    links into a loop, and the heads view after it recursed forever (``RecursionError`` in the
    planner; hyper-connections with one fraction make these views: coconut at tp=4)."""
    name = "unit_factor_views"
    _, plan = _plan(build_library(name), tp, **library_inputs(name))
    assert not plan.gathered and all(why == KEPT_WHOLE_READ_WHOLE for why, *_ in _kept(plan).values()), (plan.gathered, _kept(plan))
    assert _kinds(plan)["layers.0.attention.proj.weight"][0] == "column" and _kinds(plan)["layers.0.attention.out.weight"][0] == "row"
    for equal, reason, share in run_on_ranks(_library_model_at, tp, name):
        assert equal, reason
        assert share <= 1.3 / tp


@pytest.mark.parametrize("tp", [2, 4])
def test_weight_norm_reparametrized_linears_get_megatrons_column_row_pair(tp: int) -> None:
    """``parametrizations.weight_norm``: ``_weight_norm(v, g)`` becomes ``v * g / ‖v‖`` over each
    row; the up projection's v and g split on its rows, the down projection's v on its
    columns with a tp-reduced norm statistic, g whole."""
    gm, plan = _plan(WeightNormMLP(), tp)
    assert aten._weight_norm.default not in [n.target for n in gm.graph.nodes]
    kinds = {name.replace("parametrizations.weight.", ""): (kind, s.groups) for name, (kind, s) in _kinds(plan).items()}
    assert kinds["up.original1"][0] == "column" and kinds["up.original0"][0] == "bias" and kinds["up.bias"][0] == "bias"
    assert kinds["down.original1"][0] == "row" and "down.parametrizations.weight.original1" not in _kept(plan)
    rank = _rank_graph(gm, plan)
    weights = [tuple(local_shape(n.args[1], tp)) for n in rank.graph.nodes if n.target is aten.linear.default]
    assert weights == [(128 // tp, DIM), (DIM, 128 // tp)]


def test_only_ops_of_parameters_alone_are_decomposed() -> None:
    """``group_norm`` reads an activation: it stays one op; the weight norm of a parameter does not."""

    class GroupNormed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.GroupNorm(4, DIM)
            self.proj = nn.utils.parametrizations.weight_norm(nn.Linear(DIM, DIM))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(self.norm(x.transpose(1, 2)).transpose(1, 2))

    targets = {n.target for n in trace(GroupNormed().eval(), {"x": _x()}).graph.nodes}
    assert aten.group_norm.default in targets and aten.linalg_vector_norm.default in targets
    assert aten._weight_norm.default not in targets


def test_cat_onto_an_empty_cache_keeps_the_heads_split() -> None:
    """``cat([torch.tensor([]), k], dim=-2)``: cat skips the 1-D empty input (XLM's cache)."""
    gm, plan = _plan(EmptyCacheAttention(), 4)
    kinds = _kinds(plan)
    assert [kinds[f"{n}.weight"][0] for n in ("q_lin", "k_lin", "v_lin", "out_lin")] == ["column"] * 3 + ["row"]
    assert [k.name for k in plan.kept_whole] == ["out_lin.bias"]  # added after the row-parallel sum


def test_key_heads_tiled_by_repeat_meet_the_expert_query_heads() -> None:
    """JetMoE's attention experts: ``k.repeat(1, top_k, 1, 1)`` tiles the split key heads once
    per choice, the queries' ``[top_k, kv heads]`` match it, and the output regrouped as
    ``[tokens, top_k, kv*D]`` is row-parallel into each expert's output projection."""
    gm, plan = _plan(HeadExperts(), 4)
    kinds = _kinds(plan)
    assert kinds["input_linear"][0] == "column" and kinds["kv_proj.weight"][0] == "column"
    assert kinds["output_linear"][0] == "row"
    assert [k.name for k in plan.kept_whole] == ["router.weight"]  # top-k over the experts
    rank = _rank_graph(gm, plan)
    assert [list(n.args[1]) for n in rank.graph.nodes if n.target is aten.repeat.default] == [[1, 2, 1, 1]] * 2


@pytest.mark.parametrize("tp", [2, 4])
def test_a_grouped_weight_viewed_into_factors_follows_the_split_groups(tp: int) -> None:
    """DeepSeek-V4's ``o_a_proj``: ``weight.view(groups, -1, d_in)`` before its ``bmm`` with
    the groups split; the weight's rows are split in whole groups."""
    gm, plan = _plan(GroupedOutputAttention(), tp)
    kinds = _kinds(plan)
    rows = GroupedOutputAttention.GROUPS * GroupedOutputAttention.RANK
    assert kinds["o_a"] == ("column", DimSharding(rows, (rows,), (GroupedOutputAttention.GROUPS,)))
    assert kinds["o_b.weight"][0] == "row" and not plan.kept_whole
    rank = _rank_graph(gm, plan)
    views = [list(n.args[1]) for n in rank.graph.nodes if n.target is aten.view.default and n.args[0].name == "o_a"]
    assert [v[0] for v in views] == [GroupedOutputAttention.GROUPS // tp]
    assert "o_a" not in _kinds(plan_tensor_parallel(gm, tp, replicate=["o_a"]))  # the planner's choice to keep it whole holds


def test_complex_rotary_keeps_the_heads_split() -> None:
    gm, plan = _plan(Titan(), 2)
    kinds = _kinds(plan)
    assert {n: k for n, (k, _) in kinds.items()} == {
        "attention.wq.weight": "column", "attention.wk.weight": "column", "attention.wv.weight": "column",
        "attention.wo.weight": "row",
    }  # fmt: skip
    prop = propagate(gm, 2, plan=plan)
    (complex_q, _) = [n for n in gm.graph.nodes if n.target is aten.view_as_complex.default]
    assert prop.layout(complex_q).describe(2) == "Shard(2:4/8)"


@pytest.mark.parametrize("beit_bias", [False, True])
def test_timm_qkv_shards_heads_inside_each_of_q_k_v(beit_bias: bool) -> None:
    """``reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)``; BEiT's bias ``cat(q_bias, 0, v_bias)``."""
    gm, plan = _plan(ViTAttention(beit_bias), 2)
    kinds = _kinds(plan)
    assert kinds["qkv.weight"] == ("column", DimSharding(3 * DIM, (DIM,) * 3, (HEADS,) * 3))
    assert kinds["proj.weight"][0] == "row"
    if beit_bias:  # the assembled bias is read through the rank's slices
        (linear,) = [n for n in gm.graph.nodes if n.target is aten.linear.default][:1]
        prop = propagate(gm, 2, plan=plan)
        assert [(s.name, d) for s, d, _ in prop.local_slices[linear]] == [("cat", 0)]
        assert _kept(plan)["q_bias"][0] == KEPT_WHOLE_READ_WHOLE


class TenClasses(nn.Module):
    """An MLP and a 10-class output: tp=4 does not split the classes."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.classes = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM), nn.Linear(DIM, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classes(x + self.down(F.gelu(self.up(x))))


def test_an_output_dim_tp_does_not_split_is_split_with_padding() -> None:
    """10 classes at tp=4: blocks of 3, the last rank's one class and two of padding, gathered
    whole for the output (it was kept whole before padded splits)."""
    gm, plan = _plan(TenClasses(), 4)
    kinds = _kinds(plan)
    assert kinds["up.weight"][0] == "column" and kinds["down.weight"][0] == "row"
    kind, sharding = kinds["classes.weight"]
    assert kind == "column" and sharding.padded and sharding.local_size(4) == 3
    assert "classes.weight" not in _kept(plan)


class FewHeads(nn.Module):
    """Attention with 3 heads and nothing else: tp=2 cannot split it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(48, 144, bias=False), nn.Linear(48, 48, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 3, 16).transpose(1, 2) for t in self.qkv(x).split(48, dim=-1))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 48))


def test_a_model_tp_cannot_split_is_refused_naming_the_op_and_the_degrees_that_work() -> None:
    gm = trace(FewHeads().eval(), {"x": torch.randn(2, 8, 48)})
    with pytest.raises(ValueError, match=r"tp=2 cannot shard this model: .*module qkv.*3 blocks .* smallest tp that splits it is 3"):
        plan_tensor_parallel(gm, 2)
    assert {p.name for p in plan_tensor_parallel(gm, 3).params} == {"qkv.weight", "o.weight"}


class VocabScale(nn.Module):
    def __init__(self, vocab: int = 130) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, DIM), nn.Linear(DIM, vocab, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, vocab))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(ids)) * (self.scale.float() * 2.0)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def test_per_vocabulary_vector_is_split_with_the_padded_vocabulary() -> None:
    """``scale.float() * 2.0`` is computed from the parameter alone: it is split with the
    vocab-parallel logits from its read (padded alike), not read whole and sliced."""
    ids = torch.randint(0, 130, (2, 8))
    _, plan = _plan(VocabScale(), 4, ids=ids, labels=ids)
    padded = DimSharding(130, (130,), (130,), padded=True)
    assert _kinds(plan)["head.weight"] == ("column", padded) and _kinds(plan)["scale"] == ("bias", padded)
    assert not plan.kept_whole


class ShortConvMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = LinearAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixer(x)


def test_depthwise_short_convolution_follows_the_channel_split() -> None:
    gm, plan = _plan(ShortConvMixer(), 2)
    kinds = _kinds(plan)
    assert kinds["mixer.q_conv.conv.weight"][0] == "depthwise" and kinds["mixer.q_conv.conv.bias"][0] == "bias"
    assert kinds["mixer.q_proj.weight"][0] == "column" and kinds["mixer.o_proj.weight"][0] == "row"
    convs = [n for n in _rank_graph(gm, plan).graph.nodes if n.target is aten.conv1d.default]
    assert [n.args[6] for n in convs] == [DIM // 2] * 3  # one group per local channel


class L2Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.normalize(self.up(x), dim=-1))


def test_norms_over_a_sharded_dim_use_a_tp_reduced_statistic() -> None:
    """``F.normalize`` (``linalg_vector_norm``) over a sharded dim, and q/k norms over all heads."""
    gm, plan = _plan(L2Norm(), 2)
    assert _kinds(plan)["up.weight"][0] == "column" and _kinds(plan)["down.weight"][0] == "row"
    prop = propagate(gm, 2, plan=plan)
    (norm,) = [n for n in gm.graph.nodes if n.target is aten.linalg_vector_norm.default]
    assert prop.roles[norm] is NodeRole.SHARDED_NORM
    rank = _rank_graph(gm, plan)
    assert not [n for n in rank.graph.nodes if n.target is aten.linalg_vector_norm.default]
    gm, plan = _plan(QKNormAttention(), 2)
    kinds = _kinds(plan)
    assert {n: kinds[n][0] for n in ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight", "o_proj.weight")} == {
        "q_proj.weight": "column", "k_proj.weight": "column", "q_norm.weight": "bias", "k_norm.weight": "bias",
        "o_proj.weight": "row",
    }  # fmt: skip


def test_a_statistic_that_would_unshard_the_heads_gathers_the_latent_or_keeps_its_producer_whole() -> None:
    """Latent attention: a q norm over the low-rank ``wq_a`` output. A tp-reduced statistic
    would make ``wq_b`` row-parallel and the attention replicated; the planner splits
    ``wq_a`` and gathers its latent before the norm (fewer bytes than ``wq_a`` whole), and
    splits the smaller ``wkv_a`` too, its output gathered where it is computed (its rotary
    part meets the heads' concatenation)."""
    gm, plan = _plan(LatentAttention(), 2)
    kinds = _kinds(plan)
    assert {n: kinds[n][0] for n in ("wq_a.weight", "wq_b.weight", "wkv_a.weight", "wkv_b.weight", "wo.weight")} == {
        "wq_a.weight": "column", "wq_b.weight": "column", "wkv_a.weight": "column", "wkv_b.weight": "column", "wo.weight": "row",
    }  # fmt: skip
    assert sorted(g.op for g in plan.gathered) == ["cat", "mean"] and all(g.bytes > 0 for g in plan.gathered), plan.gathered
    wkv_a = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "wkv_a.weight")
    assert {g.tensor for g in plan.gathered if g.op == "cat"} == {u.name for u in wkv_a.users}, plan.gathered
    assert not {"wq_a.weight", "wkv_a.weight"} & set(_kept(plan))


def test_heads_regrouped_in_pairs_stay_split_on_pair_boundaries() -> None:
    gm, plan = _plan(PairedHeadsAttention(), 4)
    kinds = _kinds(plan)
    assert kinds["o.weight"][0] == "row" and kinds["lam"][0] == "bias" and kinds["q.weight"][0] == "column"
    assert kinds["q.weight"][1].groups == (4,)  # whole pairs of heads
    gm, plan = _plan(PairedHeadsAttention(), 8)  # one head per rank would split a pair: pairs held twice
    q = _kinds(plan)["q.weight"][1]
    assert q.groups == (4,) and q.replicas(8) == 2 and q.ranges(5, 8) == [(32, 48)]


class MoE(nn.Module):
    def __init__(self, combine: str) -> None:
        super().__init__()
        self.moe = LoopMoE(combine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


@pytest.mark.parametrize("combine", ["index_put", "index_add"])
def test_moe_loop_combined_by_index_put_shards_every_expert(combine: str) -> None:
    gm, plan = _plan(MoE(combine), 2)
    kinds = _kinds(plan)
    for e in range(LoopMoE.EXPERTS):
        assert kinds[f"moe.experts.{e}.w1.weight"][0] == "column" and kinds[f"moe.experts.{e}.w2.weight"][0] == "row"
    assert _kept(plan)["moe.gate.weight"][:3] == (KEPT_WHOLE_CONFLICT, "softmax", "softmax")


class Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = StackedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def test_3d_experts_with_biases_and_interleaved_gate_up() -> None:
    gm, plan = _plan(Stacked(), 4)
    kinds = _kinds(plan)
    inter = StackedExperts.INTER
    assert kinds["moe.gate_up_proj"] == ("column", DimSharding(2 * inter, (2 * inter,), (inter,)))  # (gate, up) pairs stay together
    assert kinds["moe.gate_up_proj_bias"][0] == "bias" and kinds["moe.down_proj"][0] == "row"
    assert _kept(plan)["moe.down_proj_bias"][0] == KEPT_WHOLE_READ_WHOLE  # added after the all-reduce


def test_every_parameter_kept_whole_has_an_entry_with_node_op_and_bytes() -> None:
    gm, plan = _plan(MoE("index_put"), 2)
    sharded = {p.name for p in plan.params}
    kept = {k.name: k for k in plan.kept_whole}
    for name, p in gm.named_parameters():
        assert (name in sharded) != (name in kept), name
        if name in kept:
            k = kept[name]
            assert k.node and k.op and k.bytes == p.numel() * 4 and k.detail, k


def test_fixed_mode_takes_the_planned_reshape_choices() -> None:
    """The plan (one KV head replicated, heads inside each of q, k, v) replays without the
    planner's retries."""
    for module in (MultiQueryPartialRotary(), ViTAttention()):
        gm, plan = _plan(module, 2)
        prop = propagate(gm, 2, plan=plan)
        assert not prop.conflicts
        assert all(meta_keys.LAYOUT in n.meta for n in _rank_graph(gm, plan).graph.nodes if n.op == "call_function")


def test_local_shapes_of_a_one_head_kv_segment() -> None:
    gm, plan = _plan(MultiQueryPartialRotary(), 4)
    rank = _rank_graph(gm, plan, rank=1)
    (split,) = [n for n in rank.graph.nodes if n.target is aten.split_with_sizes.default][:1]
    assert list(split.args[1]) == [16, 8, 8]  # 2 local q heads, the k and v head whole
    views = [n for n in rank.graph.nodes if n.target is aten.view.default][:3]
    assert [local_shape(v, 4) for v in views] == [(2, 8, 2, 8), (2, 8, 1, 8), (2, 8, 1, 8)]


class InPlaceActivation(nn.Module):
    """``F.mish(inplace=True)`` (``aten.mish_``, not tagged pointwise: ``mish``'s rule), a median
    over the sequence (``median.dim``, no autotp rule) and ``cumprod`` over the features (which
    DTensor would gather)."""

    def __init__(self, cumulative: bool) -> None:
        super().__init__()
        self.cumulative = cumulative
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.mish(self.up(x), inplace=True)
        h = h - h.median(1, keepdim=True).values
        return self.down(h.cumprod(-1) if self.cumulative else h)


def test_ops_without_a_rule_take_dtensors_strategy_when_it_keeps_the_split() -> None:
    from autotp.analysis.op_rules import rule_for

    gm, plan = _plan(InPlaceActivation(cumulative=False), 2)
    (mish,) = [n for n in gm.graph.nodes if n.target is aten.mish_.default]
    (median,) = [n for n in gm.graph.nodes if n.target is aten.median.dim]
    assert rule_for(mish.target) is not None and rule_for(median.target) is None
    walked = propagate(gm, 2, plan=plan)
    assert walked.layout(mish).describe(2) == "Shard(2:128/256)"
    assert walked.layout(next(iter(median.users))).describe(2) == "Shard(2:128/256)"  # the median's values
    assert _kinds(plan)["up.weight"][0] == "column" and _kinds(plan)["down.weight"][0] == "row"
    gm, plan = _plan(InPlaceActivation(cumulative=True), 2)  # DTensor would move cumprod's input: opaque
    (cumprod,) = [n for n in gm.graph.nodes if n.target is aten.cumprod.default]
    # settled at cumprod: up.weight kept whole there, or (a small activation) its input gathered there
    kept = _kept(plan).get("up.weight")
    assert kept is not None and kept[:3] == (KEPT_WHOLE_CONFLICT, cumprod.name, "cumprod") or [(g.node, g.op) for g in plan.gathered] == [(cumprod.name, "cumprod")]


class EmptySlice(nn.Module):
    """An empty slice of a split dim (a rotary part of width 0, an empty cache entry)
    joined back: it used to recurse without end in ``select_range``."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(torch.cat((h[..., :0], F.gelu(h)), dim=-1))


def test_an_empty_slice_of_a_split_dim_does_not_crash() -> None:
    gm, plan = _plan(EmptySlice(), 2)
    assert _kinds(plan)["up.weight"][0] == "column" and _kinds(plan)["down.weight"][0] == "row"


class TwoHeadBiasedAttention(nn.Module):
    """timm's fused-qkv attention at a small width (Hiera's first stage: 2 heads), both
    projections with a bias: at tp=4 each head is held by two ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4).unbind(0)
        y = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, DIM))
        return {"loss": (y * torch.linspace(-1, 1, DIM)).square().mean()}


def _two_heads_at_tp4(rank: int, world: int) -> tuple[bool, str, tuple[int, ...]]:
    from autotp import parallelize
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    x = {"x": torch.randn(2, 8, DIM)}
    result = check_on_rank(TwoHeadBiasedAttention(), x, tp=world)
    pm = parallelize(TwoHeadBiasedAttention(), tp=world, example_inputs=x)
    return result.equal, result.reason, tuple(dict(pm.named_parameters())["proj.weight"].shape)


def test_a_biased_projection_over_heads_held_by_two_ranks_adds_each_head_once() -> None:
    """The output projection contracts heads each held by two of the four ranks; without a bias
    its input is scaled by 1/2 before the all-reduce, and with one (``ROW_WITH_BIAS``, the bias
    added after the all-reduce) it was not: every head counted twice (Hiera at tp=4)."""
    for equal, reason, local in run_on_ranks(_two_heads_at_tp4, 4):
        assert equal, reason
        assert local == (DIM, DIM // 2)  # a head's columns: the heads are replicated, not whole


class NarrowChannels(nn.Module):
    """CLIP's ResNet stem at a small width: a 3x3 convolution to 2 channels, then a dense one
    from those 2 channels (row-parallel, with and without a bias), then a channel einsum (with an
    ellipsis, as einops writes them) over the next 2: at tp=4 each of the 2 channels is held by two ranks."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 2, 3, padding=1)
        self.mix = nn.Conv2d(2, 2, 3, padding=1, bias=bias)
        self.up = nn.Conv2d(2, 2, 1)
        self.out = nn.Parameter(torch.randn(2, 8) / 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.up(F.relu(self.mix(F.relu(self.stem(x)))))
        z = torch.einsum("bc...,cd->bd...", F.relu(y), self.out)
        return {"loss": (z * torch.linspace(-1, 1, 8)[:, None, None]).square().mean()}


def _narrow_channels_at_tp4(rank: int, world: int, bias: bool) -> tuple[bool, str]:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    result = check_on_rank(NarrowChannels(bias), {"x": torch.randn(2, 3, 6, 6)}, tp=world)
    return result.equal, result.reason


@pytest.mark.parametrize("bias", [False, True])
def test_convolutions_and_einsums_over_channels_held_by_two_ranks_add_each_channel_once(bias: bool) -> None:
    """A dense convolution or an einsum that contracts channels each held by two of the four
    ranks scales its input by 1/2 before the all-reduce, as a matmul does; without it every
    channel counted twice (CLIP's ResNet stem at tp=4: a loss 0.5% off)."""
    for equal, reason in run_on_ranks(_narrow_channels_at_tp4, 4, bias):
        assert equal, reason


class PaddedVocabHead(nn.Module):
    """nanochat's head: a vocabulary of 250 padded to 256 rows for speed, the logits sliced back
    to 250 and soft-capped before the loss. 250 is no multiple of 4, nor are the 6 dropped rows."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(256, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.lm_head = nn.Linear(DIM, 256, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.wte(idx)
        logits = self.lm_head(x + self.mlp(x))[..., :250].float()
        logits = 15 * torch.tanh(logits / 15)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten())}


def _padded_vocab_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"idx": ids, "targets": ids.roll(-1, 1)}


def _padded_vocab_at(rank: int, world: int) -> tuple[bool, str, float]:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    result = check_on_rank(PaddedVocabHead(), _padded_vocab_inputs(), tp=world)
    return result.equal, result.reason, result.share


def test_logits_sliced_back_from_a_padded_vocabulary_stay_vocab_parallel() -> None:
    """At tp=4 the lm_head's 256 rows split in blocks of 64 and ``[..., :250]`` cuts inside the last:
    the slice is a padded dim of those blocks (the last rank zeroes its 6 dropped columns, the loss
    masks them), where a cut into segments of 250 and 6 would keep the head whole."""
    gm, plan = _plan(PaddedVocabHead(), 4, **_padded_vocab_inputs())
    assert _kinds(plan)["lm_head.weight"][0] == "column" and "lm_head.weight" not in _kept(plan)
    last = _rank_graph(gm, plan, rank=3)
    assert any(n.target is aten.lt.Scalar and n.args[1] == 250 - 3 * 64 for n in last.graph.nodes)
    assert not any(n.target is aten.lt.Scalar for n in _rank_graph(gm, plan, rank=0).graph.nodes)
    for equal, reason, share in run_on_ranks(_padded_vocab_at, 4):
        assert equal, reason
        assert share <= 1.3 / 4


def _class_first_loss_at(rank: int, world: int) -> tuple[bool, str, float]:
    from autotp.report.strict_rule import check_on_rank

    result = check_on_rank(build_einops("einops_class_first_loss"), einops_inputs("einops_class_first_loss"), tp=world)
    return result.equal, result.reason, result.share


def test_cross_entropy_over_logits_with_the_class_dim_second_is_vocab_parallel() -> None:
    """``F.cross_entropy(rearrange(logits, "b n c -> b c n"), labels)`` (lucidrains' habit), with
    ``ignore_index`` and with ``reduction="none"``: the loss reads the rank's columns of the tied
    head, as the [N, C] loss does; the logits were gathered whole before (the tied embedding kept
    whole where a gather cost more: PaLM-rlhf at tp=2, 85% of the model on a rank)."""
    inputs = einops_inputs("einops_class_first_loss")
    gm, plan = _plan(build_einops("einops_class_first_loss"), 4, **inputs)
    assert not plan.gathered and all(why == KEPT_WHOLE_READ_WHOLE for why, *_ in _kept(plan).values()), (plan.gathered, _kept(plan))
    assert _kinds(plan)["decoder.output.weight"][0] == "vocab"  # the tied embedding, planned under one of its names
    rank = _rank_graph(gm, plan, rank=1)
    assert sum(n.target is ops.VOCAB_PARALLEL_CROSS_ENTROPY for n in rank.graph.nodes) == 2
    for equal, reason, share in run_on_ranks(_class_first_loss_at, 2):
        assert equal, reason
        assert share <= 1.3 / 2


def test_a_padded_dim_of_given_blocks_holds_them_past_its_end() -> None:
    kept = DimSharding(250, (250,), (250,), padded=True, block=64)
    assert [kept.ranges(r, 4) for r in range(4)] == [[(0, 64)], [(64, 128)], [(128, 192)], [(192, 256)]]
    assert kept.local_size(4) == 64 and DimSharding.from_json(kept.to_json()) == kept
    assert "block" not in DimSharding(250, (250,), (250,), padded=True).to_json()  # plans without it read as before



class EmptyMemoryCat(nn.Module):
    """block-recurrent-transformer's first segment: the memories so far are ``torch.empty(b, 0, dim)``,
    and the new ones, split over the ranks on their features, are concatenated onto them."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = F.gelu(self.up(x))
        memories = torch.cat((torch.empty(x.shape[0], 0, 2 * DIM, dtype=x.dtype), h), dim=-2)
        return {"loss": (self.down(memories) * torch.linspace(-1, 1, DIM)).square().mean()}


def _empty_memory_cat_at(rank: int, world: int) -> tuple[bool, str]:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    result = check_on_rank(EmptyMemoryCat(), {"x": torch.randn(2, 8, DIM)}, tp=world)
    return result.equal, result.reason


def test_a_split_cat_onto_an_empty_factory_tensor_leaves_it_out() -> None:
    """The empty input has no layout (it adds nothing), so the rank graph drops it: kept, its
    features would have the model's size beside the rank's part (a crash in cat)."""
    gm, plan = _plan(EmptyMemoryCat(), 2)
    assert _kinds(plan)["up.weight"][0] == "column"
    for equal, reason in run_on_ranks(_empty_memory_cat_at, 2):
        assert equal, reason


class GroupedConvolutions(nn.Module):
    """A grouped 3x3 (``groups`` groups of 4 channels) after a column-parallel 1x1, then a dense 1x1 back; and one
    (2 groups) straight on the whole input, then the same: the first reads split channels, the second the
    rank's groups of a whole input. ``groups=3`` leaves the tp=2 split no whole groups."""

    def __init__(self, groups: int = 4) -> None:
        super().__init__()
        self.down, self.up = nn.Conv2d(4, 4 * groups, 1), nn.Conv2d(4 * groups, 4, 1)
        self.grouped = nn.Conv2d(4 * groups, 4 * groups, 3, padding=1, groups=groups, bias=False)
        self.whole_in = nn.Conv2d(4, 8, 3, padding=1, groups=2)
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.up(F.relu(self.grouped(F.relu(self.down(x))))) + x
        z = self.out(F.relu(self.whole_in(y)))
        return {"loss": (z * torch.linspace(-1, 1, 4)[:, None, None]).square().mean()}


def _grouped_at_tp2(rank: int, world: int, groups: int) -> tuple[bool, str, float, dict[str, tuple[int, ...]]]:
    from autotp import parallelize
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    x = {"x": torch.randn(2, 4, 6, 6)}
    result = check_on_rank(GroupedConvolutions(groups), x, tp=world)
    torch.manual_seed(0)
    pm = parallelize(GroupedConvolutions(groups), tp=world, example_inputs=x)
    return result.equal, result.reason, result.share, {n: tuple(p.shape) for n, p in pm.named_parameters()}


def test_grouped_convolutions_split_on_whole_groups_or_within_them() -> None:
    """4 groups at tp=2: each rank convolves 2 whole groups. 3 groups, which tp=2 does not
    divide: each rank holds half of every group's input channels (row-parallel within the
    groups, a partial sum), its input from a 1x1 split in 3 segments alike; kept whole before."""
    for equal, reason, share, shapes in run_on_ranks(_grouped_at_tp2, 2, 4):
        assert equal, reason
        assert shapes["grouped.weight"] == (8, 4, 3, 3) and shapes["whole_in.weight"] == (4, 2, 3, 3)  # 2 of 4 groups, 1 of 2
        assert share < 0.6
    for equal, reason, share, shapes in run_on_ranks(_grouped_at_tp2, 2, 3):
        assert equal, reason
        assert shapes["grouped.weight"] == (12, 2, 3, 3) and shapes["down.weight"] == (6, 4, 1, 1)  # 2 of 4 channels of each group
        assert share < 0.6


def test_experts_in_the_groups_of_convolutions_split_within_each_group() -> None:
    """Attention experts folded into 2 groups of 1x1 convolutions (``grouped_conv_experts``) at
    tp=4: q/kv column-parallel within each group (every rank a block of each expert's heads),
    an SDPA over [batch, experts, heads, tokens, head_dim] split on the heads, the heads merged
    back between the whole experts, the output projection row-parallel within the groups; held
    whole before (63% on a rank)."""
    import autotp
    import plain_models_library as library
    from test_plain_suite import run_config

    result = run_config("tp4", ["grouped_conv_experts"])["grouped_conv_experts"]
    assert result.passed, result.reason
    assert result.share < 0.3
    plan = autotp.compile_rank(library.build("grouped_conv_experts"), tp=4, example_inputs=library.example_inputs("grouped_conv_experts")).plan
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["layers.0.attention.to_q.weight"] == "column" and kinds["layers.0.attention.to_out.weight"] == "row", kinds
    assert not plan.gathered, plan.gathered  # SDPA split on its heads (dim 2), the heads merged back with the experts


def test_experts_merged_into_the_batch_put_the_kv_split_on_the_heads() -> None:
    """mixture-of-attention's layout (``experts_in_the_batch``): ``to_kv``'s grouped output chunked
    into keys and values across its 2 groups, each viewed [batch, experts, heads, head_dim, tokens],
    the experts then merged into SDPA's batch. tp=4 does not divide the experts factor the view
    first splits; merged into the batch, that split still carries the view's choice, so the
    attention's conflict moves it to the heads (before, every rank held the keys whole: to_kv
    kept whole, 48% of the model on a rank)."""
    import autotp
    import plain_models_choices as choices
    from test_plain_suite import run_config

    result = run_config("tp4", ["experts_in_the_batch"])["experts_in_the_batch"]
    assert result.passed, result.reason
    assert result.share < 0.3
    plan = autotp.compile_rank(choices.build("experts_in_the_batch"), tp=4, example_inputs={"input_ids": torch.zeros(2, 16, dtype=torch.long),
                               "labels": torch.zeros(2, 16, dtype=torch.long)}).plan  # fmt: skip
    for name in ("to_q", "to_kv"):
        param = next(p for p in plan.params if p.name == f"layers.0.branch.{name}.weight")
        assert param.kind == "column" and param.sharding.local_size(4) * 4 == param.sharding.size, param
    assert not plan.gathered and not [k.name for k in plan.kept_whole if "norm" not in k.name and k.name.endswith(".weight")]


class _ShapedLike(nn.Module):
    """An MLP over the flattened tokens whose hidden activation takes its shape from a whole
    tensor by ``reshape_as`` (x-transformers' GRU gating reshapes the cell's output like the
    branch's)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.up(x.flatten(0, 1)))
        return self.down(hidden.reshape_as(x.repeat(1, 1, 4)))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_read_for_its_shape_alone_does_not_constrain_the_split(tp: int) -> None:
    """``reshape_as(other)`` becomes the reshape to other's shape at trace time: other's split (here
    whole) no longer has to be the reshaped tensor's, so the pair stays column/row-parallel with
    nothing gathered (the split hidden activation met the whole ``other`` before)."""
    gm, plan = _plan(_ShapedLike(), tp)
    assert not any(n.target in (aten.reshape_as.default, aten.view_as.default) for n in gm.graph.nodes)
    kinds = _kinds(plan)
    assert kinds["up.weight"][0] == "column" and kinds["down.weight"][0] == "row", kinds
    assert not plan.gathered and [k.name for k in plan.kept_whole] == ["down.bias"]



class ScalarGatedResidual(nn.Module):
    """graph-transformer-pytorch's gated residual: one gate per token, ``Linear(3 * DIM, 1)`` of the
    input, the update and their difference, broadcast over the features."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.gate = nn.Linear(3 * DIM, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(x)))
        g = self.gate(torch.cat((x, h, x - h), -1)).sigmoid()
        return h * g + x * (1 - g)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_split_of_a_size_one_dim_is_not_broadcast(tp: int) -> None:
    """The gate's one output was split (padded) and its split carried onto the features it is broadcast
    over: the rank graph broke its invariants ("dim 2 has size 32 but its sharded var has 1")."""
    from block_lm import BlockLm

    gm, plan = _plan(BlockLm(ScalarGatedResidual, 64, DIM), tp, input_ids=torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8)))
    assert _kinds(plan)["layers.0.up.weight"][0] == "column" and _kinds(plan)["layers.0.down.weight"][0] == "row"
    assert _kept(plan)["layers.0.gate.weight"][0] == KEPT_WHOLE_CONFLICT
    _rank_graph(gm, plan)


class QuantileHead(nn.Module):
    """Chronos-2's forecast head: a projection's ``(q p)`` features read as ``[q, p]`` quantiles
    of a patch, then the patches' points merged (``b n (q p) -> b q (n p)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return self.proj(x).reshape(b, n, 3, 4).permute(0, 2, 1, 3).reshape(b, 3, n * 4)


def test_a_projection_the_plan_holds_whole_stays_whole_through_a_reshape_into_factors() -> None:
    """A plan may hold a column projection's features whole (one block every rank holds: Chronos-2's
    residual projection, whose sum with a row-parallel output is whole). Its ``(q p)`` features then
    reshape into factors none of size 1; the walk of the plan put the split on ``p`` anyway (2 of its
    4 points on a rank) while the weight stayed whole, and the rank's reshape read ``[b, n, 3, 2]`` out
    of 12 features per row (Chronos-2 at tp=2: "shape '[2, 2, 3, 2]' is invalid for input of size 48")."""
    gm, plan = _plan(QuantileHead(), 2)
    whole = DimSharding(12, (12,), (1,))
    plan = dataclasses.replace(plan, params=tuple(dataclasses.replace(p, sharding=whole) if p.name.startswith("proj.") else p for p in plan.params))
    assert {p.name for p in plan.params} == {"proj.weight", "proj.bias"}
    propagate(gm, 2, plan=plan)
    rank = _rank_graph(gm, plan)
    reshapes = [n for n in rank.graph.nodes if n.target is aten.reshape.default or n.target is aten.view.default]
    assert [tuple(n.args[1]) for n in reshapes] == [(2, 8, 3, 4), (2, 3, 32)]  # every rank's whole features
