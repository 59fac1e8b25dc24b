"""``instance_norm`` (MONAI's and nnU-Net's convolution blocks): statistics per sample and
channel over the spatial dims, so convolutions split over their channels stay split through it,
its affine weight and bias taking the channels' split; a split spatial dim is a conflict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from distributed import run_on_ranks

CHANNELS = 16


class ConvBlocks(nn.Module):
    """Two convolution blocks (convolution, instance norm, leaky ReLU) and a pooled class head."""

    def __init__(self, affine: bool = True, track_running_stats: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.norm1 = nn.InstanceNorm2d(CHANNELS, affine=affine, track_running_stats=track_running_stats)
        self.conv2 = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.norm2 = nn.InstanceNorm2d(CHANNELS, affine=affine, track_running_stats=track_running_stats)
        self.head = nn.Linear(CHANNELS, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = F.leaky_relu(self.norm1(self.conv1(x)))
        h = F.leaky_relu(self.norm2(self.conv2(h)))
        logits = self.head(h.mean((2, 3)))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(2, 3, 8, 8, generator=gen), "labels": torch.randint(0, 8, (2,), generator=gen)}


@pytest.mark.parametrize("tp", [2, 4])
def test_convolutions_stay_split_through_instance_norm(tp: int) -> None:
    torch.manual_seed(0)
    plan = plan_tensor_parallel(trace(ConvBlocks().eval(), _inputs()), tp)
    kinds = {p.name: (p.kind, p.dim) for p in plan.params}
    assert kinds["conv1.weight"] == ("column", 0) and kinds["conv2.weight"] == ("row", 1)
    assert kinds["norm1.weight"] == ("bias", 0) and kinds["norm1.bias"] == ("bias", 0)
    assert {k.name for k in plan.kept_whole} <= {"conv2.bias", "norm2.weight", "norm2.bias"}  # after conv2's all-reduce


def _strict(rank: int, world: int, track_running_stats: bool) -> str:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    return check_on_rank(ConvBlocks(track_running_stats=track_running_stats).eval(), _inputs(), tp=world).reason


@pytest.mark.parametrize("track_running_stats", [False, True])
def test_instance_norm_at_tp2_equals_the_model(track_running_stats: bool) -> None:
    assert run_on_ranks(_strict, 2, track_running_stats) == ["", ""]
