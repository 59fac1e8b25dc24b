"""A reversible transformer written as Reformer's and RevNet's code writes it (issue 27): one custom
autograd Function runs every block under ``no_grad`` and, in backward, reconstructs each block's
input from its output and accumulates the blocks' parameter gradients itself
(``torch.autograd.backward`` on the recomputed block). Its arguments are the two-stream input, the
``ModuleList`` of blocks, and a dict of keyword arguments holding the positional table and a flag
the Function sets; a block's attention draws a random number per call, which the backward replays
from the random state the forward recorded (as LSH attention's random rotations are).

The suite protocol (``tests/test_plain_suite.py``): ``NAMES``, ``build(name)`` (eval mode,
fixed weights); the default inputs (``input_ids`` and ``labels`` below ``VOCAB``), the outputs
hold ``loss``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ = 128, 64, 4, 2, 16
HEAD_DIM = DIM // HEADS


class RandomScaleAttention(nn.Module):
    """Causal attention whose query is scaled by one random draw per call."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.qkv(self.norm(x) + pos).unflatten(-1, (3, HEADS, HEAD_DIM)).transpose(1, 3)).unbind(2)
        q = q * (1 + 0.1 * torch.rand((), device=x.device))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


class ReversibleBlock(nn.Module):
    """``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)`` over the two halves of the channels; ``backward_pass``
    inverts it, recomputing f and g with the random state of their forward."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = RandomScaleAttention(), MLP()
        self.f_state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, pos: torch.Tensor, reverse: bool) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        with torch.no_grad():
            self.f_state = torch.get_rng_state()
            y1 = x1 + self.f(x2, pos)
            y2 = x2 + self.g(y1)
        return torch.cat([y1, y2], dim=-1)

    def backward_pass(self, y: torch.Tensor, dy: torch.Tensor, pos: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        assert reverse
        y1, y2 = y.chunk(2, dim=-1)
        dy1, dy2 = dy.chunk(2, dim=-1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = self.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2 = y2 - gy1
            dx1 = dy1 + y1.grad
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.f_state)
            x2 = x2.detach().requires_grad_()
            fx2 = self.f(x2, pos)
            torch.autograd.backward(fx2, dx1)
        with torch.no_grad():
            x1 = y1 - fx2
            dx2 = dy2 + x2.grad
        return torch.cat([x1, x2], dim=-1), torch.cat([dx1, dx2], dim=-1)


class ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, blocks: nn.ModuleList, kwargs: dict[str, Any]) -> torch.Tensor:
        kwargs["reverse"] = False
        for block in blocks:
            x = block(x, **kwargs)
        ctx.y, ctx.blocks, ctx.kwargs = x.detach(), blocks, kwargs
        return x

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.kwargs["reverse"] = True
        y = ctx.y
        for block in reversed(ctx.blocks):
            y, dy = block.backward_pass(y, dy, **ctx.kwargs)
        return dy, None, None


class ReversibleLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.register_buffer("pos", torch.linspace(-0.5, 0.5, SEQ * DIM).view(1, SEQ, DIM))
        self.blocks = nn.ModuleList(ReversibleBlock() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(2 * DIM), nn.Linear(2 * DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids)
        h = ReversibleFunction.apply(torch.cat([h, h], dim=-1), self.blocks, {"pos": self.pos, "reverse": False})
        logits = self.head(self.norm(h))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


NAMES = ("reversible_blocks",)


def build(name: str) -> nn.Module:
    assert name in NAMES
    torch.manual_seed(0)
    return ReversibleLM().eval()
