"""Small hierarchical vision models: a list of stages at growing widths, each a downsampling
module and a list of blocks of its own, the shape of timm's Swin, PVT, ConvNeXt and DaViT
(issue 27, pipelines). The last of the two stages holds most of the weights (twice the width),
so a pipeline cut only between stages leaves it three quarters of the model; the cut falls
inside it (``cost_model.pipeline.balanceable_units``): between its blocks (``swin_stages``),
inside its one block (``convnext_stages``), or between the two blocks of a numbered pair
inside its block list (``dual_block_stages``, three levels of numbered lists); in a ResNeXt whose
last stage holds two blocks each under half the model, inside the first (``bottleneck_stages``); in a
ConvNeXt of four stages whose last three hold a third of the model each, inside one of them (``pyramid_stages``).

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``; the outputs hold ``loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_novel import CLASSES, IMAGE, PATCH, PatchMerging, SwinBlock

WIDTH = 32
GRID = IMAGE // PATCH


class Stage(nn.Module):
    """A downsampling module (none in the first stage), then a numbered list of blocks."""

    def __init__(self, downsample: nn.Module | None, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.downsample = downsample or nn.Identity()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class TokenClassifier(nn.Module):
    """Patch embedding to ``WIDTH`` tokens, the stages, a norm, mean pooling, a 10-class head."""

    def __init__(self, stages: list[Stage]) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, WIDTH, kernel_size=PATCH, stride=PATCH)
        self.layers = nn.ModuleList(stages)
        self.norm, self.head = nn.LayerNorm(2 * WIDTH), nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        for stage in self.layers:
            x = stage(x)
        logits = self.head(self.norm(x).mean(dim=1))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def swin_stages() -> nn.Module:
    """Swin's depths (2, 2): two window blocks, patch merging, two blocks at twice the width."""
    return TokenClassifier([
        Stage(None, [SwinBlock(WIDTH, 4, GRID, 0), SwinBlock(WIDTH, 4, GRID, 2)]),
        Stage(PatchMerging(WIDTH, GRID), [SwinBlock(2 * WIDTH, 8, GRID // 2, 0), SwinBlock(2 * WIDTH, 8, GRID // 2, 0)]),
    ])  # fmt: skip


class ChannelBlock(nn.Module):
    """DaViT's channel attention: each head's channels attend to each other over the tokens."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 4, 1)  # [b, h, d, n]
        attn = ((q * n**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
        x = x + self.proj((attn @ v).permute(0, 3, 1, 2).reshape(b, n, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def dual_block_stages() -> nn.Module:
    """DaViT's depths (1, 1): each stage's one block a numbered pair, window then channel attention."""
    return TokenClassifier([
        Stage(None, [nn.Sequential(SwinBlock(WIDTH, 4, GRID, 0), ChannelBlock(WIDTH, 4))]),
        Stage(PatchMerging(WIDTH, GRID), [nn.Sequential(SwinBlock(2 * WIDTH, 8, GRID // 2, 0), ChannelBlock(2 * WIDTH, 8))]),
    ])  # fmt: skip


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, a LayerNorm over the channels last, a pointwise MLP, a layer scale."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(self.norm(self.dwconv(x).permute(0, 2, 3, 1)))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class Downsample(nn.Module):
    """A channels-first LayerNorm and a 2x2 convolution of stride 2 to twice the channels (or ``out``)."""

    def __init__(self, dim: int, out: int | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.conv = nn.Conv2d(dim, out or 2 * dim, kernel_size=2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


class ConvNeXt(nn.Module):
    """ConvNeXt's depths (1, 1): a patch stem, one block per stage, pooling, a norm, the head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, WIDTH, kernel_size=PATCH, stride=PATCH)
        self.stages = nn.Sequential(Stage(None, [ConvNeXtBlock(WIDTH)]), Stage(Downsample(WIDTH), [ConvNeXtBlock(2 * WIDTH)]))
        self.norm, self.head = nn.LayerNorm(2 * WIDTH), nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.head(self.norm(self.stages(self.stem(pixel_values)).mean(dim=(2, 3))))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class PyramidConvNeXt(nn.Module):
    """ConvNeXt-atto's widths (W, 2W, 2W, 2W), one block per stage: the last three stages hold 27%,
    33% and 33% of the parameters, each under half, and the best cut between whole stages leaves
    the second chunk 65% of them; a cut inside a stage balances it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, WIDTH, kernel_size=2, stride=2)
        widths = (WIDTH, 2 * WIDTH, 2 * WIDTH, 2 * WIDTH)
        self.stages = nn.Sequential(
            Stage(None, [ConvNeXtBlock(WIDTH)]),
            *(Stage(Downsample(cin, cout), [ConvNeXtBlock(cout)]) for cin, cout in zip(widths, widths[1:])),
        )  # fmt: skip
        self.norm, self.head = nn.LayerNorm(2 * WIDTH), nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.head(self.norm(self.stages(self.stem(pixel_values)).mean(dim=(2, 3))))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class Bottleneck(nn.Module):
    """ResNeXt's block: a 1x1 convolution down to ``mid`` channels, a grouped 3x3, a 1x1 up, added to the
    input or to its 1x1 projection (computed after the main branch, as timm's ``BottleneckBlock`` does)."""

    def __init__(self, cin: int, cout: int, mid: int, groups: int = 4) -> None:
        super().__init__()
        self.conv1, self.conv3 = nn.Conv2d(cin, mid, 1), nn.Conv2d(mid, cout, 1)
        self.conv2 = nn.Conv2d(mid, mid, 3, padding=1, groups=groups)
        self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv3(F.relu(self.conv2(F.relu(self.conv1(x))))) + self.shortcut(x))


class BottleneckNet(nn.Module):
    """A ResNeXt of two stages: the second's first block (43% of the parameters, its projection shortcut
    among them) and second (27%) are each under half, and no cut between whole blocks keeps a stage
    under 70% of the model; a cut inside the first block does."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, WIDTH, kernel_size=PATCH, stride=PATCH)
        self.stages = nn.Sequential(
            Stage(None, [Bottleneck(WIDTH, WIDTH, WIDTH), Bottleneck(WIDTH, WIDTH, WIDTH)]),
            Stage(nn.AvgPool2d(2), [Bottleneck(WIDTH, 4 * WIDTH, 48), Bottleneck(4 * WIDTH, 4 * WIDTH, WIDTH)]),
        )  # fmt: skip
        self.head = nn.Linear(4 * WIDTH, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.head(self.stages(self.stem(pixel_values)).mean(dim=(2, 3)))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


MODELS: dict[str, Callable[[], nn.Module]] = {
    "swin_stages": swin_stages,
    "dual_block_stages": dual_block_stages,
    "convnext_stages": ConvNeXt,
    "bottleneck_stages": BottleneckNet,
    "pyramid_stages": PyramidConvNeXt,
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2) -> dict[str, torch.Tensor]:
    """Keyword inputs of model ``name``, the same on every call."""
    gen = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen),
            "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}  # fmt: skip
