"""Small plain-PyTorch models whose sharding hangs on where a split was put before it reached
the op that judges it (issue 27, tp=4): attention experts folded into convolution groups whose
keys and values are chunked across the groups and whose experts are merged into the batch of a
4-D SDPA (lucidrains' mixture-of-attention), a residual gated by a ``GRUCell`` whose output
takes its shape from the whole input by ``reshape_as`` (x-transformers' GRU gating), and an MLP
whose down projection reads its hidden units concatenated with its whole input (a UNet's skip
connection, DenseNet's concatenation).

The suite protocol (``tests/test_plain_suite.py``): ``NAMES``, ``build(name)`` (eval mode,
fixed weights); the default inputs (``input_ids`` and ``labels`` below ``VOCAB``), the outputs
hold ``loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS = 128, 64, 4, 2
HEAD_DIM = DIM // HEADS
EXPERTS = 2


class ExpertsInTheBatch(nn.Module):
    """Each expert's q, k and v from its own group of 1x1 convolution channels; ``to_kv``'s output
    is chunked in two across the groups (keys from the first group's channels, values from the
    second's, as mixture-of-attention does), each viewed ``[batch, experts, heads, head_dim, tokens]``;
    the experts then join the batch of one 4-D SDPA and leave it for the grouped output projection."""

    def __init__(self) -> None:
        super().__init__()
        e = EXPERTS
        self.to_q = nn.Conv1d(DIM * e, DIM * e, 1, bias=False, groups=e)
        self.to_kv = nn.Conv1d(DIM * e, 2 * DIM * e, 1, bias=False, groups=e)
        self.to_out = nn.Conv1d(DIM * e, DIM * e, 1, bias=False, groups=e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        folded = x.transpose(1, 2).repeat(1, EXPERTS, 1)  # [b, experts * dim, s]
        q, k, v = (self.to_q(folded), *self.to_kv(folded).chunk(2, dim=1))
        q, k, v = (t.view(b, EXPERTS, HEADS, HEAD_DIM, s).transpose(-1, -2).flatten(0, 1) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b * experts, heads, s, head_dim]
        y = y.unflatten(0, (b, EXPERTS)).transpose(-1, -2).reshape(b, EXPERTS * DIM, s)
        return self.to_out(y).view(b, EXPERTS, DIM, s).mean(1).transpose(1, 2)


class GRUGatedResidual(nn.Module):
    """``x + f(x)`` replaced by a GRU cell whose input is f's output and whose hidden state is the
    residual stream, both flattened over the tokens; the new state takes the shape of f's output
    by ``reshape_as``."""

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.norm, self.branch, self.gru = nn.LayerNorm(DIM), branch, nn.GRUCell(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.branch(self.norm(x))
        return self.gru(out.flatten(0, 1), x.flatten(0, 1)).reshape_as(out)


class SkipConcatMLP(nn.Module):
    """``down(cat([gelu(up(x)), x]))``: the hidden units split, the input whole, one contraction over both."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(5 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.cat([F.gelu(self.up(x)), x], dim=-1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, HEAD_DIM)).transpose(1, 3).unbind(2)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class PreNorm(nn.Module):
    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.norm, self.branch = nn.LayerNorm(DIM), branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(self.norm(x))


class LM(nn.Module):
    def __init__(self, layer: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(layer() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "experts_in_the_batch": lambda: LM(lambda: PreNorm(ExpertsInTheBatch())),
    "gru_gated_residual": lambda: LM(lambda: nn.Sequential(GRUGatedResidual(Attention()), PreNorm(_mlp()))),
    "skip_concat_mlp": lambda: LM(lambda: nn.Sequential(PreNorm(Attention()), PreNorm(SkipConcatMLP()))),
}
NAMES = tuple(MODELS)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()
