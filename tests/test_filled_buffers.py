"""Two constructs of HF's Mamba mixers, in models of our own (fp32, gloo, the strict rule of
``autotp.report.strict_rule``):

* a state buffer made by ``torch.zeros`` and filled by ``copy_`` with a tensor split over
  its channels (a convolution's cache): the buffer takes the split, as the same zeros at the
  rank's size, instead of holding a whole copy that a split tensor cannot be copied into;
* a partial sum of full size (a row-parallel projection's output, before its all-reduce)
  multiplied into a tensor split on that dim: it is summed, then read through the rank's
  slice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from block_lm import BlockLm
from distributed import run_on_ranks
from torch import nn

from autotp.analysis.trace import trace
from autotp.report.strict_rule import StrictResult, check_on_rank, combine

DIM, CHANNELS, VOCAB, SEQ, KERNEL = 32, 64, 16, 8, 4


class CachedConvolution(nn.Module):
    """A depthwise causal convolution whose last inputs are kept in a zeros buffer, as HF's
    Mamba keeps its convolution state (``cache.update_conv_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, CHANNELS)
        self.conv = nn.Conv1d(CHANNELS, CHANNELS, KERNEL, groups=CHANNELS, padding=KERNEL - 1)
        self.down = nn.Linear(CHANNELS, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).transpose(1, 2)  # [b, channels, s]
        state = torch.zeros(h.shape[0], CHANNELS, KERNEL, dtype=h.dtype, device=h.device)
        state.copy_(h[:, :, -KERNEL:])
        h = F.silu(self.conv(h)[..., : h.shape[-1]]) + state.mean(dim=-1, keepdim=True)
        return self.down(h.transpose(1, 2))


class GatedBySum(nn.Module):
    """Channels scaled by a projection of themselves: ``h * mix(h)``, mix reading the split
    channels (row-parallel: its output is a partial sum of full size that meets h's split, as
    Mamba's ``x_proj`` output B meets the split time steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, CHANNELS)
        self.mix = nn.Linear(CHANNELS, CHANNELS, bias=False)  # its output stays a partial sum until the product
        self.down = nn.Linear(CHANNELS, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        return self.down(h * self.mix(h))


BLOCKS = {"cached_convolution": CachedConvolution, "gated_by_sum": GatedBySum}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return BlockLm(BLOCKS[name], VOCAB, DIM).eval()


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=gen), "labels": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_the_block_is_split_megatron_style(name: str) -> None:
    plan = plan_tensor_parallel(trace(_build(name), _inputs()), 2)
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["layers.0.up.weight"] == "column" and kinds["layers.0.down.weight"] == "row", kinds
    assert not [k for k in plan.kept_whole if k.name.startswith("layers.0.") and k.name.endswith("weight")], plan.kept_whole


def _strict_on_rank(rank: int, world: int, name: str) -> StrictResult:
    return check_on_rank(_build(name), _inputs(), tp=world, pp=1)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_blocks_pass_the_strict_rule(tp: int) -> None:
    for name in BLOCKS:
        result = combine(run_on_ranks(_strict_on_rank, tp, name, timeout_s=400))
        assert result.passed, f"{name} at tp={tp}: {result.reason}"
