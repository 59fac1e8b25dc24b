"""The other sound local fallback: a split activation that an op needs whole is all-gathered
there (``ParallelPlan.gathered``, ``passes/gather_activations``) where that beats keeping the
parameters behind it whole (``cost_model/layout_choice.footprint``). Models of our own, fp32,
gloo, the strict rule of ``autotp.report.strict_rule``:

* a low-rank (latent) key/value projection, an RMS norm of the latent, an up-projection to
  the heads (multi-head latent attention): the latent projection is column-split, the small
  latent gathered before its norm, the up-projection column-parallel over the heads;
* a wide projection followed by a softmax over its features (an attention over channels):
  the projection is column-split and its output gathered at the softmax, instead of keeping
  the wide weight whole;
* a depthwise convolution over split channels before a grouped one whose groups no tp
  splits: the depthwise output is gathered, and the grouped convolution keeps its global
  ``groups`` (``passes/rewrite_shapes`` reads a gathered input as whole);
* a dual-stream diffusion transformer (``plain_models_shares``): each block's adaLN-Zero
  modulation linear is column-split and its output gathered where it is computed, in every
  layer alike."""

from __future__ import annotations

import plain_models_shares as shares
import pytest
import torch
import torch.nn.functional as F
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from block_lm import BlockLm
from distributed import run_on_ranks
from torch import nn

from autotp.analysis.trace import trace
from autotp.ir.plan import ParallelPlan
from autotp.report.strict_rule import StrictResult, check_on_rank, combine

DIM, HEADS, HEAD_DIM, RANK, VOCAB, SEQ = 64, 4, 16, 32, 32, 8


class RmsNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LatentAttention(nn.Module):
    """Keys and values from a low-rank latent: ``kv_up(norm(kv_down(x)))``, split into heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.kv_down = nn.Linear(DIM, RANK, bias=False)
        self.kv_norm = RmsNorm(RANK)
        self.kv_up = nn.Linear(RANK, 2 * HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        kv = self.kv_up(self.kv_norm(self.kv_down(x))).view(b, s, HEADS, 2 * HEAD_DIM).transpose(1, 2)
        k, v = kv.split(HEAD_DIM, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class ChannelSoftmax(nn.Module):
    """A wide projection weighted by a softmax over its own features, then projected back."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(DIM, 8 * DIM)
        self.down = nn.Linear(8 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wide(x)
        return self.down(F.gelu(h) * torch.softmax(h, dim=-1))


class GroupedConvMixer(nn.Module):
    """A causal depthwise convolution over a projection's channels, then a grouped one, then an
    MLP (ZAYA's query/key convolutions). With 3 groups of 16 channels, which tp=2 and tp=4 do not
    divide, the grouped convolution is split within its groups; with 6 groups of 2 channels at
    tp=4, neither the groups nor a group's channels split four ways: the depthwise output is
    gathered for the grouped convolution, which keeps its global ``groups``."""

    def __init__(self, channels: int = 48, groups: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, channels)
        self.depthwise = nn.Conv1d(channels, channels, kernel_size=2, groups=channels)
        self.grouped = nn.Conv1d(channels, channels, kernel_size=1, groups=groups)
        self.up, self.down = nn.Linear(channels, 8 * DIM), nn.Linear(8 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.proj(x).transpose(1, 2), (1, 0))
        return self.down(F.gelu(self.up(self.grouped(self.depthwise(h)).transpose(1, 2))))


BLOCKS = {"latent_attention": LatentAttention, "channel_softmax": ChannelSoftmax, "grouped_conv": GroupedConvMixer,
          "narrow_groups_conv": lambda: GroupedConvMixer(12, 6)}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return BlockLm(BLOCKS[name], VOCAB, DIM).eval()


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=gen), "labels": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}


def _plan(name: str, tp: int) -> ParallelPlan:
    return plan_tensor_parallel(trace(_build(name), _inputs()), tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_latent_is_gathered_and_the_heads_stay_split(tp: int) -> None:
    plan = _plan("latent_attention", tp)
    kinds = {p.name: p.kind for p in plan.params}
    for i in range(2):
        assert kinds[f"layers.{i}.kv_down.weight"] == "column", kinds
        assert kinds[f"layers.{i}.kv_up.weight"] == kinds[f"layers.{i}.q.weight"] == "column", kinds
        assert kinds[f"layers.{i}.out.weight"] == "row", kinds
    assert len(plan.gathered) == 2 and all(g.bytes and g.comm_s > 0 and g.op for g in plan.gathered), plan.gathered
    assert not [k for k in plan.kept_whole if k.name.endswith("kv_down.weight")], plan.kept_whole


@pytest.mark.parametrize("tp", [2, 4])
def test_the_wide_projection_is_split_and_gathered_at_the_softmax(tp: int) -> None:
    plan = _plan("channel_softmax", tp)
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["layers.0.wide.weight"] == "column", kinds
    assert [g.op for g in plan.gathered] and not [k for k in plan.kept_whole if k.name.endswith("wide.weight")], plan


@pytest.mark.parametrize("tp", [2, 4])
def test_a_grouped_convolution_splits_within_its_groups_or_reads_the_gathered_channels(tp: int) -> None:
    plan = _plan("grouped_conv", tp)
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["layers.0.proj.weight"] == "column" and kinds["layers.0.depthwise.weight"] == "depthwise", kinds
    assert kinds["layers.0.grouped.weight"] == "row" and not plan.gathered, plan
    if tp == 4:
        plan = _plan("narrow_groups_conv", tp)
        kinds = {p.name: p.kind for p in plan.params}
        assert kinds["layers.0.proj.weight"] == "column" and kinds["layers.0.depthwise.weight"] == "depthwise", kinds
        assert plan.gathered and {g.op for g in plan.gathered} == {"conv1d"}, plan.gathered


@pytest.mark.parametrize("tp", [2, 4])
def test_each_layers_modulation_is_split_and_gathered_where_it_is_computed(tp: int) -> None:
    """adaLN-Zero's modulation linear gives the shift, scale and gate that a split would carry
    into the residual stream and its norms; its small output is gathered as computed, at the
    same place of every layer. Weighed one layer at a time, against keeping that layer's
    weight whole, each gather tied within ``TIE`` and lost on its collective."""
    model = shares.build("dual_stream_dit")
    gm = trace(model, shares.example_inputs("dual_stream_dit"))
    plan = plan_tensor_parallel(gm, tp)
    kinds = {p.name: p.kind for p in plan.params}
    blocks = [n for n, _ in model.named_parameters() if n.endswith("mod.linear.weight") and "blocks" in n]
    assert blocks and all(kinds.get(n) == "column" for n in blocks), kinds
    nodes = {n.name: n for n in gm.graph.nodes}
    sources = sorted(list(nodes[g.tensor].meta["nn_module_stack"].values())[-1][0] for g in plan.gathered)
    assert sources == sorted(n.removesuffix(".weight") for n in blocks), sources


def test_the_gathers_round_trip_through_the_plan_json() -> None:
    plan = _plan("latent_attention", 2)
    assert ParallelPlan.from_json(plan.to_json()).gathered == plan.gathered


def _strict_on_rank(rank: int, world: int, name: str) -> StrictResult:
    return check_on_rank(_build(name), _inputs(), tp=world, pp=1)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_blocks_pass_the_strict_rule(tp: int) -> None:
    for name in BLOCKS:
        result = combine(run_on_ranks(_strict_on_rank, tp, name, timeout_s=400))
        assert result.passed, f"{name} at tp={tp}: {result.reason}"


class RotateHalfOverSplit(nn.Module):
    """A rotary embedding by ``rotate_half`` (``cat(-x[..., n/2:], x[..., :n/2])``) with full-size
    cos/sin buffers, on a column-split projection's output (MiniCPM3's key rope part, split
    when its latent projection is split and the value gathered after the rope)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        angles = torch.arange(SEQ, dtype=torch.float32)[:, None] * torch.arange(DIM)[None] / 10
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos())
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wide(x)
        rotated = torch.cat((-h[..., DIM:], h[..., :DIM]), dim=-1)
        return self.down(h * self.cos + rotated * self.sin)


def _rotate_half_on_rank(rank: int, world: int) -> StrictResult:
    torch.manual_seed(0)
    return check_on_rank(BlockLm(RotateHalfOverSplit, VOCAB, DIM).eval(), _inputs(), tp=world, pp=1)


def test_rotate_half_over_a_split_dim() -> None:
    """The two halves are segments of one split dim; ``cat(-x2, x1) * sin`` beside ``x * cos``
    lines them up, which makes the two segments one layout variable: each slice's local bounds
    come from its position (the second half starts at the rank's second block), not from
    looking that variable up among the segments (which found the first half for both)."""
    result = combine(run_on_ranks(_rotate_half_on_rank, 2, timeout_s=400))
    assert result.passed, result.reason
