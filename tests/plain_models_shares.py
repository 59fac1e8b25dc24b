"""Small plain-PyTorch models whose weights a rank holds its share of only if the planner
splits what a conflict would keep whole (issue 27, tensor parallelism at tp=4): a dual-stream
diffusion transformer (image and text tokens with their own adaLN-Zero modulations, joint
attention over both) followed by single-stream blocks, as video and image diffusion models
write them.

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``; each model returns the loss it computes from ``target``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, LAYERS, SINGLE_LAYERS, MLP = 64, 4, 2, 2, 192
HEAD_DIM = DIM // HEADS
LATENT, TOKENS, TEXT, TEXT_DIM, FREQ = 8, 128, 6, 32, 32


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def heads(x: torch.Tensor) -> torch.Tensor:
    """[B, N, H * D] -> [B, H, N, D]."""
    return x.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)


class Modulation(nn.Module):
    """adaLN-Zero: one linear of the conditioning gives ``count`` shift/scale/gate vectors."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count, self.linear = count, nn.Linear(DIM, count * DIM)

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(c)).chunk(self.count, dim=1)


class Stream(nn.Module):
    """One stream's weights in a dual-stream block: modulation, q/k/v, output and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.mod = Modulation(6)
        self.norm1 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(DIM, DIM) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(DIM, MLP), nn.GELU(approximate="tanh"), nn.Linear(MLP, DIM))


class DoubleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = Stream(), Stream()

    def forward(self, x: torch.Tensor, txt: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mods = [s.mod(c) for s in (self.image, self.text)]
        normed = [modulate(s.norm1(h), m[0], m[1]) for s, h, m in zip((self.image, self.text), (x, txt), mods)]
        q, k, v = (torch.cat([heads(getattr(s, p)(h)) for s, h in zip((self.image, self.text), normed)], dim=2) for p in ("to_q", "to_k", "to_v"))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        outs = []
        for s, h, m, a in zip((self.image, self.text), (x, txt), mods, attn.split([x.shape[1], txt.shape[1]], dim=1)):
            h = h + m[2][:, None] * s.to_out(a)
            outs.append(h + m[5][:, None] * s.mlp(modulate(s.norm2(h), m[3], m[4])))
        return outs[0], outs[1]


class SingleBlock(nn.Module):
    """One fused input projection for q, k, v and the MLP; one output projection of both."""

    def __init__(self) -> None:
        super().__init__()
        self.mod = Modulation(3)
        self.norm = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.linear1 = nn.Linear(DIM, 3 * DIM + MLP)
        self.linear2 = nn.Linear(DIM + MLP, DIM)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(c)
        q, k, v, mlp = self.linear1(modulate(self.norm(x), shift, scale)).split([DIM, DIM, DIM, MLP], dim=-1)
        attn = F.scaled_dot_product_attention(heads(q), heads(k), heads(v)).transpose(1, 2).flatten(2)
        return x + gate[:, None] * self.linear2(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))


class DualStreamDiT(nn.Module):
    """Latent and text tokens embedded apart, a timestep embedding conditioning every block,
    dual-stream then single-stream blocks over the joined tokens, a modulated final layer
    predicting the latents; the loss is the mean squared error to a target."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image_in, self.text_in = nn.Linear(LATENT, DIM), nn.Linear(TEXT_DIM, DIM)
        self.time = nn.Sequential(nn.Linear(FREQ, DIM), nn.SiLU(), nn.Linear(DIM, DIM))
        self.double_blocks = nn.ModuleList(DoubleBlock() for _ in range(LAYERS))
        self.single_blocks = nn.ModuleList(SingleBlock() for _ in range(SINGLE_LAYERS))
        self.final_mod = Modulation(2)
        self.final_norm = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.final = nn.Linear(DIM, LATENT)

    def forward(self, latents: torch.Tensor, text: torch.Tensor, timestep: torch.Tensor, target: torch.Tensor | None = None) -> dict[str, Any]:
        freqs = torch.exp(-math.log(10000) * torch.arange(FREQ // 2, dtype=torch.float32) / (FREQ // 2))
        c = self.time(torch.cat([torch.cos(timestep[:, None] * freqs), torch.sin(timestep[:, None] * freqs)], dim=-1))
        x, txt = self.image_in(latents), self.text_in(text)
        for block in self.double_blocks:
            x, txt = block(x, txt, c)
        x = torch.cat([x, txt], dim=1)
        for block in self.single_blocks:
            x = block(x, c)
        shift, scale = self.final_mod(c)
        pred = self.final(modulate(self.final_norm(x[:, : latents.shape[1]]), shift, scale))
        out: dict[str, Any] = {"logits": pred}
        if target is not None:
            out["loss"] = F.mse_loss(pred, target)
        return out


MODELS: dict[str, Callable[[], nn.Module]] = {
    "dual_stream_dit": DualStreamDiT,
}


def build(name: str) -> nn.Module:
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"latents": torch.randn(batch, TOKENS, LATENT, generator=gen), "text": torch.randn(batch, TEXT, TEXT_DIM, generator=gen),
            "timestep": torch.tensor([3.0, 700.0][:batch]), "target": torch.randn(batch, TOKENS, LATENT, generator=gen)}  # fmt: skip
