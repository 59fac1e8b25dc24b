"""Mamba2's mixer layout in a model of our own (fp32, gloo, the strict rule of
``autotp.report.strict_rule``): one projection for ``[z | x | B | C | dt]``, ``x``, ``B`` and
``C`` through one depthwise causal convolution, ``B`` and ``C`` of fewer groups than ranks
repeated to the heads (``repeat_interleave``), a recurrence over time. x, z, dt and x's
convolution channels are split by heads; the B and C segments are held whole on every rank
(their groups go on the size-1 factor of ``view(b, s, groups, state)`` when a rank cannot
hold whole groups) and each rank repeats them to its own heads, instead of the projection
being kept whole.

Zamba's mixer (one Mamba per head, a Python loop over its heads) has its per-head projections
on the left of the matmul, ``x_proj[:, None] @ x``: the loop's ``select`` keeps the heads whole,
so the channels split inside each head, ``x_proj`` is row-parallel over them and ``dt_proj``
column-parallel, as a right-hand weight would be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from autotp.cost_model.tensor_parallel import _Search, plan_tensor_parallel
from block_lm import BlockLm
from distributed import run_on_ranks
from torch import nn

from autotp.analysis.trace import trace
from autotp.report.strict_rule import StrictResult, check_on_rank, combine

DIM, HEADS, HEAD_DIM, STATE, KERNEL, VOCAB, SEQ = 32, 8, 4, 4, 4, 64, 6
INNER = HEADS * HEAD_DIM


class GroupedSsm(nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.conv_dim = INNER + 2 * groups * STATE
        self.in_proj = nn.Linear(DIM, INNER + self.conv_dim + HEADS, bias=False)
        self.conv = nn.Conv1d(self.conv_dim, self.conv_dim, KERNEL, groups=self.conv_dim, padding=KERNEL - 1)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, HEADS + 1, dtype=torch.float32)))
        self.dt_bias = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS))
        self.D = nn.Parameter(torch.ones(HEADS))
        self.out_proj = nn.Linear(INNER, DIM, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, s, _ = u.shape
        z, xbc, dt = self.in_proj(u).split([INNER, self.conv_dim, HEADS], dim=-1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :s]).transpose(1, 2)
        x, B, C = xbc.split([INNER, self.groups * STATE, self.groups * STATE], dim=-1)
        x = x.view(b, s, HEADS, HEAD_DIM)
        B = B.view(b, s, self.groups, STATE).repeat_interleave(HEADS // self.groups, dim=2)
        C = C.view(b, s, self.groups, STATE).repeat_interleave(HEADS // self.groups, dim=2)
        dt = F.softplus(dt + self.dt_bias)  # [b, s, heads]
        decay = torch.exp(dt * -torch.exp(self.A_log))
        state = torch.zeros(b, HEADS, HEAD_DIM, STATE, dtype=u.dtype)
        ys = []
        for t in range(s):
            state = state * decay[:, t, :, None, None] + (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None, :]
            ys.append((state * C[:, t, :, None, :]).sum(-1))
        y = torch.stack(ys, dim=1) + x * self.D[:, None]
        return self.out_proj(y.reshape(b, s, INNER) * F.silu(z))


MAMBA_HEADS, RANK = 2, 8


class PerHeadProjections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, INNER)
        self.x_proj = nn.Parameter(torch.randn(MAMBA_HEADS, RANK, INNER // MAMBA_HEADS) * 0.2)
        self.dt_proj = nn.Parameter(torch.randn(MAMBA_HEADS, INNER // MAMBA_HEADS, RANK) * 0.2)
        self.out_proj = nn.Linear(INNER, DIM)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, s, _ = u.shape
        h = F.silu(self.in_proj(u)).transpose(1, 2).reshape(b, MAMBA_HEADS, -1, s).transpose(0, 1)  # [heads, b, head_dim, s]
        low = self.x_proj[:, None] @ h  # [heads, b, rank, s]
        outs = [h[i] * torch.sigmoid(self.dt_proj[i] @ low[i]) for i in range(MAMBA_HEADS)]
        return self.out_proj(torch.cat(outs, dim=1).transpose(1, 2))


def _build(groups: int) -> nn.Module:
    torch.manual_seed(0)
    return BlockLm(lambda: GroupedSsm(groups) if groups else PerHeadProjections(), VOCAB, DIM).eval()


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=gen), "labels": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("groups", [1, 2])
def test_the_groups_are_held_whole_and_the_heads_split(groups: int, tp: int) -> None:
    plan = plan_tensor_parallel(trace(_build(groups), _inputs()), tp)
    layouts = {p.name: p for p in plan.params}
    proj, conv = layouts["layers.0.in_proj.weight"], layouts["layers.0.conv.weight"]
    # [z | x | B | C | dt] in whole heads, B and C in whole groups: one block every rank holds
    # for one group, two blocks (each held by tp/2 ranks) for two
    bc = groups * STATE
    assert proj.kind == "column" and proj.sharding.segments == (INNER, INNER, bc, bc, HEADS), proj
    assert proj.sharding.groups == (HEADS, HEADS, groups, groups, HEADS), proj
    assert conv.sharding.segments == (INNER, bc, bc) and conv.sharding.groups == (HEADS, groups, groups), conv
    assert layouts["layers.0.out_proj.weight"].kind == "row"
    assert not [k for k in plan.kept_whole if k.name.startswith("layers.")], plan.kept_whole


@pytest.mark.parametrize("tp", [2, 4])
def test_weights_on_the_left_split_inside_each_head(tp: int) -> None:
    plan = plan_tensor_parallel(trace(_build(0), _inputs()), tp)
    kinds = {p.name: (p.kind, p.dim) for p in plan.params}
    assert kinds["layers.0.in_proj.weight"] == ("column", 0) and kinds["layers.0.out_proj.weight"] == ("row", 1), kinds
    assert kinds["layers.0.x_proj"] == ("row", 2) and kinds["layers.0.dt_proj"] == ("column", 1), kinds
    assert not [k for k in plan.kept_whole if k.name.startswith("layers.") and not k.name.endswith("out_proj.bias")], plan.kept_whole


def _strict_on_rank(rank: int, world: int, groups: int) -> StrictResult:
    return check_on_rank(_build(groups), _inputs(), tp=world, pp=1)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_the_mixer_passes_the_strict_rule(tp: int) -> None:
    for groups in (1, 2, 0):  # 0: the per-head projections
        result = combine(run_on_ranks(_strict_on_rank, tp, groups, timeout_s=400))
        assert result.passed, f"{groups} group(s) at tp={tp}: {result.reason}"


def test_a_reshape_retry_is_repeated_in_every_layer() -> None:
    """The planner settles a conflict and its repeats in the other layers together, and so it
    retries their reshapes' choices together: in a deep model (Zamba's 76 tiny layers) one
    layer at a time ran out of walks."""
    torch.manual_seed(0)
    gm = trace(BlockLm(lambda: GroupedSsm(1), VOCAB, DIM, layers=3).eval(), _inputs())
    search = _Search(gm, 4, set())

    def module(name: str) -> str:
        node = next(n for n in gm.graph.nodes if n.name == name)
        return list(node.meta["nn_module_stack"].values())[-1][0]

    views = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.view.default and module(n.name) == "layers.0"]
    assert len(views) >= 2
    for i, name in enumerate(views):
        repeats = search.repeated({(name, 1)})
        assert {module(n) for n, _ in repeats} == {"layers.0", "layers.1", "layers.2"} and {f for _, f in repeats} == {1}
        # the i-th view of each layer, not every view there
        assert all(v not in {n for n, _ in repeats} for v in views if v != name)
