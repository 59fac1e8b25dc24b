"""In-place writes across a pipeline cut (pp=2, strict rule against the unmodified model):

* a value a stage receives and the model then writes in place (``x *= 0.5`` on the previous
  layer's output) is a leaf of the stage's autograd graph, which an in-place op may not write:
  the stage writes into a copy (``passes/extract_chunks``);
* a ``reshape`` of a permuted tensor is a copy, not a view (halonet's ``q = rearrange(...)``
  then ``q *= scale``): a stage that re-derives the views of a value it receives must not
  take the copy for one, or it would miss the write (``op_facts.is_alias``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_on_ranks

BATCH, SEQ, DIM, HEADS = 2, 8, 16, 4


class DampedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x *= 0.5  # the previous layer's output, scaled in place
        return x + self.proj(x).tanh()


class Damped(nn.Module):
    """Each layer scales its input in place before reading it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DampedLayer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        for layer in self.layers:
            h = layer(h)
        return h


class ScaledHeads(nn.Module):
    """Queries made by a reshape of permuted heads (a copy), scaled in place, read by the next module."""

    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.to_q(x).unflatten(-1, (HEADS, DIM // HEADS)).transpose(1, 2).reshape(BATCH * HEADS, SEQ, DIM // HEADS)
        q *= 0.5
        return self.to_out(q.reshape(BATCH, HEADS, SEQ, DIM // HEADS).transpose(1, 2).flatten(2))


def _strict(rank: int, world: int, name: str) -> str:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    model = {"damped": Damped, "scaled_heads": ScaledHeads}[name]()
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    return check_on_rank(model, {"x": x}, tp=1, pp=2, loss_fn=lambda out: out.square().mean(), microbatches=1).reason


@pytest.mark.parametrize("name", ["damped", "scaled_heads"])
def test_in_place_writes_across_a_pipeline_cut(name: str) -> None:
    assert run_on_ranks(_strict, 2, name) == ["", ""]
