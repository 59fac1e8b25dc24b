"""Dims tp does not divide, split with padding (``autotp.analysis.padded_dims``).

Each model below has a width that tp=4 does not divide. Before padding, its weights stayed
whole or tp=4 was refused. Checked at tp=4 (and tp=2 where the width is even): loss and every
gradient equal to the unmodified model, each rank holding its ceil(size / tp) block, several
optimizer steps keeping the padding rows zero, and the refusal of what padding cannot do.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_on_ranks


class SigmoidFfn(nn.Module):
    """An FFN of 14 hidden units whose activation is not zero at zero (sigmoid): the padding of
    the hidden dim is 1.5 until the row-parallel projection masks it and its sum masks it. At
    tp=4 the blocks are 4 wide; with 6 units they are 2 wide and the last rank holds padding only."""

    def __init__(self, hidden: int = 14) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, hidden), nn.Linear(hidden, 8)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, hidden))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.sigmoid(self.up(x)) * self.gate + 1.0
        y = self.down(h) + x
        return {"loss": (y * torch.linspace(-1, 1, 8)).square().mean() + h.sum(-1).mean() * 1e-2}


class FusedGateUp(nn.Module):
    """SwiGLU with gate and up fused in one projection of 2 x 14 outputs, cut by ``chunk`` (or by
    slices): each half is split with padding at its own end, the fused weight's shard holding a
    block of each."""

    def __init__(self, sliced: bool = False) -> None:
        super().__init__()
        self.sliced = sliced
        self.gate_up, self.down = nn.Linear(8, 28), nn.Linear(14, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.gate_up(x)
        gate, up = (h[..., :14], h[..., 14:]) if self.sliced else h.chunk(2, -1)
        y = self.down(F.silu(gate) * (up + 1.0)) + x
        return {"loss": (y * torch.linspace(-1, 1, 8)).square().mean()}


class SqueezeExcite(nn.Module):
    """A RegNet-style squeeze-and-excitation of 38 channels (1x1 convolutions), then an
    einsum projection of 10 features back: both widths split with padding at tp=4."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(16, 38, 1), nn.Conv2d(38, 16, 1)
        self.proj_in = nn.Linear(16, 10)
        self.proj_out = nn.Parameter(torch.randn(10, 4) / 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        s = self.expand(F.silu(self.reduce(x.mean((2, 3), keepdim=True))))
        f = x * torch.sigmoid(s)
        z = torch.einsum("bf,fo->bo", F.gelu(self.proj_in(f.mean((2, 3)))), self.proj_out)
        return {"loss": (z - 0.3).square().mean()}


class FactoredWidth(nn.Module):
    """The 6 hidden units viewed as 3 pairs and summed per pair: the view cuts the padded dim
    into parts (a rank's block of 2 would not be whole pairs of the global dim), so padding is
    refused there; the plan gathers the value or keeps the layer whole."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 6), nn.Linear(3, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.down(torch.tanh(self.up(x)).unflatten(-1, (3, 2)).sum(-1)).square().mean()}


class ClassHead(nn.Module):
    """An MLP and a 10-class head: the logits are returned (gathered whole, the padding left
    out) and their cross-entropy over the labelled rows is the loss (vocab-parallel, the
    padded classes masked; the rows picked by a mask, whose count is read at run time)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.classes = nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.classes(x + self.down(F.gelu(self.up(x))))
        labels = torch.arange(x.shape[0]) % 11 - 1
        keep = labels >= 0
        return {"loss": F.cross_entropy(logits[keep], labels[keep]), "logits": logits}


class _Res2Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        width = -(-dim // 3)
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1, groups=width) for _ in range(2))
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.chunk(3, dim=1)
        first = self.convs[0](parts[0])
        h = torch.cat([first, self.convs[1](first + parts[1]), parts[2]], 1).permute(0, 2, 3, 1)
        return x + (self.gamma * self.fc2(F.gelu(self.fc1(h)))).permute(0, 3, 1, 2)


class Res2Scales(nn.Module):
    """EdgeNeXt's (Res2Net's) scales in two blocks: 88 channels cut by ``chunk(3)`` into 30, 30 and
    28, the first two through depthwise 3x3s in a chain, then an MLP and a per-channel layer scale
    over all 88. At tp=4 the chunks are not multiples of 4; planning crashed on a walk that padded
    a chunk (a padded dim as a segment), where the conflict is now settled."""

    def __init__(self, dim: int = 88) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 1)
        self.blocks = nn.Sequential(_Res2Block(dim), _Res2Block(dim))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.blocks(self.stem(x)).square().mean()}


MODELS = {"res2_scales": Res2Scales, "sigmoid_ffn": SigmoidFfn, "squeeze_excite": SqueezeExcite, "factored_width": FactoredWidth, "class_head": ClassHead,
          "fused_gate_up": FusedGateUp, "sliced_gate_up": lambda: FusedGateUp(sliced=True)}
INPUTS = {"res2_scales": (2, 3, 4, 4), "sigmoid_ffn": (3, 5, 8), "squeeze_excite": (2, 16, 6, 6), "factored_width": (3, 5, 8), "class_head": (12, 8), "fused_gate_up": (3, 5, 8), "sliced_gate_up": (3, 5, 8)}


def _check(rank: int, world: int, name: str) -> tuple[bool, str, float, float, dict[str, tuple[int, ...]], list[str]]:
    from autotp import parallelize
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    inputs = {"x": torch.randn(*INPUTS[name])}
    result = check_on_rank(MODELS[name](), inputs, tp=world)
    torch.manual_seed(0)
    pm = parallelize(MODELS[name](), tp=world, example_inputs=inputs)
    padded = [p.name for p in pm.plan.params if p.sharding.padded]
    return result.equal, result.reason, result.share, result.limit, {n: tuple(p.shape) for n, p in pm.named_parameters()}, padded


@pytest.mark.parametrize("tp", [2, 4])
def test_an_ffn_whose_width_tp_does_not_divide_is_split_with_padding(tp: int) -> None:
    for equal, reason, share, limit, shapes, padded in run_on_ranks(_check, tp, "sigmoid_ffn"):
        assert equal, reason
        assert share <= limit
        if tp == 4:
            assert sorted(padded) == ["down.weight", "gate", "up.bias", "up.weight"]
            assert shapes["up.weight"] == (4, 8) and shapes["down.weight"] == (8, 4) and shapes["gate"] == (4,)
        else:
            assert padded == [] and shapes["up.weight"] == (7, 8)


@pytest.mark.parametrize("name", ["fused_gate_up", "sliced_gate_up"])
def test_segments_of_a_fused_projection_are_each_split_with_padding(name: str) -> None:
    for equal, reason, share, limit, shapes, padded in run_on_ranks(_check, 4, name):
        assert equal, reason
        assert share <= limit and sorted(padded) == ["down.weight", "gate_up.bias", "gate_up.weight"]
        assert shapes["gate_up.weight"] == (8, 8) and shapes["down.weight"] == (8, 4)


def test_padded_convolution_channels_and_einsum_features_equal_the_model() -> None:
    for equal, reason, share, limit, shapes, padded in run_on_ranks(_check, 4, "squeeze_excite"):
        assert equal, reason
        assert share <= limit
        assert {"reduce.weight", "expand.weight", "proj_in.weight", "proj_out"} <= set(padded)
        assert shapes["reduce.weight"] == (10, 16, 1, 1) and shapes["expand.weight"] == (16, 10, 1, 1)
        assert shapes["proj_in.weight"] == (3, 16) and shapes["proj_out"] == (3, 4)


def test_a_class_dim_tp_does_not_divide_is_split_with_padding() -> None:
    for equal, reason, share, limit, shapes, padded in run_on_ranks(_check, 4, "class_head"):
        assert equal, reason
        assert share <= limit and sorted(padded) == ["classes.bias", "classes.weight"]
        assert shapes["classes.weight"] == (3, 8)


def test_chunks_tp_does_not_divide_of_a_dim_it_divides_are_settled() -> None:
    for equal, reason, share, limit, _, _ in run_on_ranks(_check, 4, "res2_scales"):
        assert equal, reason
        assert share <= limit


def test_padding_is_refused_where_an_op_cuts_the_padded_dim() -> None:
    from autotp.analysis.propagation import propagate
    from autotp.analysis.trace import trace

    gm = trace(FactoredWidth(), {"x": torch.randn(*INPUTS["factored_width"])})
    prop = propagate(gm, 4, padded=frozenset({"up.weight", "up.bias"}))
    assert [str(c).split(": ")[-1] for c in prop.conflicts] == ["cuts a dim split with padding into parts"]
    for equal, reason, _, _, shapes, padded in run_on_ranks(_check, 4, "factored_width"):
        assert equal, reason


def _train(rank: int, world: int, steps: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float], list[float]]:
    from autotp import parallelize

    torch.manual_seed(0)
    model = SigmoidFfn(hidden=6)
    reference = copy.deepcopy(model)
    batches = [{"x": torch.randn(3, 5, 8)} for _ in range(steps)]
    pm = parallelize(model, tp=world, example_inputs=batches[0])
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for m in (pm, reference)]
    losses: tuple[list[float], list[float]] = ([], [])
    for batch in batches:
        for m, opt, out in zip((pm, reference), opts, losses):
            opt.zero_grad()
            loss = m(**batch)["loss"]
            loss.backward()
            opt.step()
            out.append(loss.item())
    local = {n: p.detach().clone() for n, p in pm.named_parameters()}
    return pm.unshard_state_dict(), local | {"ref." + n: p.detach() for n, p in reference.named_parameters()}, *losses


def test_optimizer_steps_keep_the_padding_rows_zero() -> None:
    """AdamW with weight decay over 4 steps: the padding rows get no gradient, so they stay
    zero, and the model trains as the unmodified one does."""
    results = run_on_ranks(_train, 4, 4)
    for rank, (full, local, losses, ref_losses) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name in ("up.weight", "up.bias", "down.weight", "gate"):
            torch.testing.assert_close(full[name], local["ref." + name], rtol=1e-5, atol=1e-6)
        if rank == 3:  # its block [6, 8) is all padding
            assert not local["up.weight"].any() and not local["down.weight"].any() and not local["gate"].any()
